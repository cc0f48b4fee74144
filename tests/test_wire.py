"""The wire (hat_split.wire): every message round-trips; bad frames are refused with an Error while the server keeps
serving."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from edge_runtime.config import LinkConfig
from hat_split.net.security import LinkSecurity
from hat_split.wire import dist_codec
from hat_split.wire import messages as P

ARR = np.arange(5, dtype=np.int32)
DIST = dist_codec.pack(np.eye(2, 8, dtype=np.float16), "sparse")
EXAMPLES = [
    P.Hello("dev", "draft", 8, "fp", "sw"),
    P.Welcome(1, "target", 8, "fp", 60.0, 16, 1024, ["sd", "hlm"], "sw"),
    P.OpenSession(3, "sd", ARR, P.Sampling(0.7, 20, 0.9), 42),
    P.SessionOpened(3, 5, 0.25),
    P.Verify(3, 1, 5, np.zeros(0, np.int32), np.array([0, 1], np.int32), DIST),
    P.Verify(3, 2, 7, ARR, np.array([1], np.int32), P.DistPayload("dense", np.full((1, 8), 0.125, np.float32))),
    P.Verdict(3, 1, 2, 7, 8, 0.1),
    P.Generate(3, 3, 8, ARR, 4),
    P.Generated(3, 3, ARR, 12, 0.5),
    P.CloseSession(3),
    P.Closed(3, 3, 1.5),
    P.Error("desync", "boom", 3, 2),
]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    return a == b


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    frames = P.encode(msg)
    assert frames[0][:4] == P.MAGIC + bytes([P.PROTOCOL_VERSION])
    decoded = P.decode([bytes(f) for f in frames])
    assert _same(msg, decoded)


def test_tensors_travel_as_raw_frames_not_in_the_header():
    big = np.arange(10000, dtype=np.int32)
    frames = P.encode(P.OpenSession(1, "sd", big))
    assert len(frames) == 2 and len(frames[1]) == big.nbytes and len(frames[0]) < 200
    decoded = P.decode(frames)
    assert np.shares_memory(decoded.prompt, np.frombuffer(frames[1], np.int32)) or decoded.prompt.base is not None


def test_unknown_fields_from_a_newer_peer_are_ignored():
    header = msgspec.msgpack.encode({"type": "CloseSession", "session_id": 4, "added_in_v9": [1, 2]})
    msg = P.decode([P.MAGIC + bytes([P.PROTOCOL_VERSION]) + header])
    assert msg == P.CloseSession(4)


def _frames(msg):
    return [bytes(f) for f in P.encode(msg)]


BAD = {
    "empty": ([], "malformed"),
    "no_magic": ([b"XXXX" + b"\x80"], "malformed"),
    "wrong_version": ([P.MAGIC + bytes([P.PROTOCOL_VERSION + 1]) + _frames(P.CloseSession(1))[0][4:]], "version"),
    "garbage_header": ([P.MAGIC + bytes([P.PROTOCOL_VERSION]) + b"\xc1\xff\x00"], "malformed"),
    "unknown_type": ([P.MAGIC + bytes([P.PROTOCOL_VERSION]) + msgspec.msgpack.encode({"type": "Nope"})], "malformed"),
    "negative_id": ([P.MAGIC + bytes([P.PROTOCOL_VERSION]) +
                     msgspec.msgpack.encode({"type": "CloseSession", "session_id": -1})], "malformed"),
    "truncated_tensor": (_frames(P.OpenSession(1, "sd", ARR))[:1] +
                         [bytes(_frames(P.OpenSession(1, "sd", ARR))[1][:7])],
                         "malformed"),
    "missing_tensor_frame": (_frames(P.OpenSession(1, "sd", ARR))[:1], "malformed"),
    "oversized": (_frames(P.OpenSession(1, "sd", np.zeros(1 << 19, np.int32))), "oversized"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_frames_raise_protocol_error(name):
    frames, code = BAD[name]
    with pytest.raises(P.ProtocolError) as err:
        P.decode(frames, max_bytes=1 << 20)
    assert err.value.code == code and err.value.message


def test_disallowed_dtype_is_refused():
    header = msgspec.msgpack.encode({"type": "OpenSession", "session_id": 1, "protocol": "sd",
                                     "prompt": {"dtype": "object", "shape": [1], "frame": 1}})
    with pytest.raises(P.ProtocolError, match="not allowed"):
        P.decode([P.MAGIC + bytes([P.PROTOCOL_VERSION]) + header, b"\x00" * 8])


def test_dist_codec_round_trip_and_validation():
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.full(50, 0.05), size=3)
    values = dist_codec.quantize(q, "float16")
    for fmt in ("dense", "sparse"):
        payload = P.decode(P.encode(P.Verify(1, 1, 0, ARR, ARR[:3], dist_codec.pack(values, fmt)))).dist
        assert np.array_equal(dist_codec.decode_dist(payload, 3, 50), dist_codec.dequantize(values))
    bad = P.DistPayload("sparse", np.ones(2, np.float16), np.array([3, 1], np.int32), np.array([0, 2], np.int64))
    with pytest.raises(ValueError, match="ascending"):
        dist_codec.decode_dist(bad, 1, 50)
    with pytest.raises(ValueError, match="shape"):
        dist_codec.decode_dist(P.DistPayload("dense", np.ones((2, 49), np.float16)), 2, 50)
    with pytest.raises(ValueError, match="positive mass"):
        dist_codec.decode_dist(P.DistPayload("dense", np.zeros((1, 50), np.float16)), 1, 50)


def test_float16_wire_rounding_is_the_same_with_and_without_torch():
    """Both casts are round-to-nearest-even from float32: the wire values never depend on what the process loaded."""
    import torch  # noqa: F401  (makes dist_codec take its torch path)

    rng = np.random.default_rng(1)
    q = np.concatenate([rng.dirichlet(np.full(4000, 0.01), size=4),  # mostly tiny entries: subnormals, underflow
                        rng.dirichlet(np.ones(4000), size=2),
                        np.full((1, 4000), 1 / 4000)])  # [7, 4000]
    q[0, :8] = [6e-8, 2.9e-8, 3.0e-8, 5.96e-8, 6.1e-5, 6.09e-5, 0.5 + 2 ** -12, 0.5 + 3 * 2 ** -12]  # ties, edges
    fast = dist_codec.quantize(q, "float16")
    slow = q.astype(np.float32).astype(np.float16)
    assert fast.dtype == np.float16 and np.array_equal(fast.view(np.uint16), slow.view(np.uint16))
    assert np.array_equal(dist_codec.quantize(q, "float32"), q.astype(np.float32))


# -- the server under bad input -------------------------------------------------------------------------------------
def _raw_socket(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    return sock


def _ask(sock, frames, timeout_ms=5000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the server did not answer"
    return P.decode(sock.recv_multipart())


def test_server_answers_bad_frames_with_errors_and_keeps_serving(tiny_server, tiny_pair):
    from edge_runtime.client import CloudClient
    from edge_runtime.config import EdgeConfig
    from edge_runtime.drafter import Drafter
    from edge_runtime.protocols import new_session
    from edge_runtime.request import GenerationRequest
    from hat_split.math.sampling import SamplingParams

    bad = _raw_socket(tiny_server)
    hello = P.Hello("bad", "tiny", 512, "tiny-vocab")
    # requests before the handshake are refused
    reply = _ask(bad, _frames(P.CloseSession(1)))
    assert isinstance(reply, P.Error) and reply.code == "no_handshake"
    assert isinstance(_ask(bad, _frames(hello)), P.Welcome)
    good = CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                       P.Hello("good", "tiny", 512, "tiny-vocab"))
    with good:
        cfg = EdgeConfig(model="tiny", draft_len=3)
        gen = new_session(cfg, GenerationRequest([1, 2, 3, 4], "sd", SamplingParams(0.0), 12, seed=7),
                          Drafter(tiny_pair[0], SamplingParams(0.0)), good, frozenset(), 1)
        # interleave: every bad frame is answered, the good client's session goes on between them
        for name in sorted(BAD):
            frames, code = BAD[name]
            if not frames:
                frames = [b""]  # an empty body behind the identity
                code = "malformed"
            reply = _ask(bad, frames)
            assert isinstance(reply, P.Error) and reply.code in (code, "malformed", "oversized"), (name, reply)
        semantic = [
            (P.OpenSession(1, "nope", ARR), "invalid"),
            (P.OpenSession(1, "sd", np.array([600], np.int32)), "invalid"),
            (P.OpenSession(1, "sd", ARR, P.Sampling(-1.0)), "invalid"),
            (P.Verify(99, 1, 0, ARR[:0], ARR[:1], DIST), "no_session"),
        ]
        for msg, code in semantic:
            reply = _ask(bad, _frames(msg))
            assert isinstance(reply, P.Error) and reply.code == code, (msg, reply)
        assert isinstance(_ask(bad, _frames(P.OpenSession(5, "sd", ARR))), P.SessionOpened)
        one_hot = dist_codec.pack(np.eye(1, 512, 0, dtype=np.float16), "sparse")
        for msg, code in [
            (P.Verify(5, 1, 3, ARR[:0], ARR[:1], one_hot), "desync"),  # wrong position
            (P.Verify(5, 2, 5, ARR[:0], ARR[:1], one_hot), "desync"),  # skipped step
            (P.Verify(5, 1, 5, ARR[:0], ARR[1:2], one_hot), "invalid"),  # draft has zero probability
            (P.Verify(5, 1, 5, ARR[:0], np.zeros(17, np.int32), one_hot), "invalid"),  # too long
            (P.Generate(5, 1, 5, ARR[:0], 100000), "invalid"),
        ]:
            reply = _ask(bad, _frames(msg))
            assert isinstance(reply, P.Error) and reply.code == code, (msg, reply)
        result = gen.run([1, 2, 3, 4], lambda toks: "")
    assert result.n == 12 and result.round_trips >= 3
    assert tiny_server.stats.errors >= len(BAD) + len(semantic) + 5
    bad.close()


def test_vocab_mismatch_is_refused_at_handshake(tiny_server):
    from edge_runtime.client import CloudClient, CloudError

    with pytest.raises(CloudError, match="vocab"):
        CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                    P.Hello("d", "other", 512, "another-vocab")).connect()


def test_unreachable_server_fails_fast_with_a_clear_error():
    import time

    from edge_runtime.client import CloudClient, CloudUnavailable

    t0 = time.monotonic()
    with pytest.raises(CloudUnavailable, match="after 2 attempts"):
        CloudClient(LinkConfig("tcp://127.0.0.1:9", security=LinkSecurity.plaintext(), connect_timeout_s=0.3,
                               connect_retries=2, backoff_s=0.1), P.Hello("d", "m", 1, "")).connect()
    assert time.monotonic() - t0 < 5


def test_idle_sessions_are_freed(tiny_server):
    import time

    sock = _raw_socket(tiny_server)
    assert isinstance(_ask(sock, _frames(P.Hello("idle", "tiny", 512, "tiny-vocab"))), P.Welcome)
    assert isinstance(_ask(sock, _frames(P.OpenSession(1, "sd", ARR))), P.SessionOpened)
    assert len(tiny_server.tables.sessions) == 1
    tiny_server.expire_idle(time.monotonic() + tiny_server.config.session_timeout_s + 1)
    assert len(tiny_server.tables.sessions) == 0
    reply = _ask(sock, _frames(P.Verify(1, 1, 5, ARR[:0], ARR[:1], DIST)))
    assert isinstance(reply, P.Error) and reply.code in ("no_session", "no_handshake")
    sock.close()


def test_the_cloud_gives_freed_heap_back_when_its_last_session_closes_and_each_interval_while_busy(
        tiny_server, monkeypatch):
    import time

    from cloud_runtime import server as srv

    trims = []
    monkeypatch.setattr(srv.heap, "trim", lambda: trims.append(1) or 0.001)
    start = tiny_server.stats.heap_trims
    now = time.monotonic()
    tiny_server._trimmed = (now, (tiny_server.work.stats.steps, tiny_server.stats.sessions_opened,
                                  len(tiny_server.tables.sessions)))
    tiny_server.trim_heap(now + 1e6)
    assert not trims  # nothing happened since the last trim
    sock = _raw_socket(tiny_server)
    assert isinstance(_ask(sock, _frames(P.Hello("trim", "tiny", 512, "tiny-vocab"))), P.Welcome)
    assert isinstance(_ask(sock, _frames(P.OpenSession(1, "sd", ARR))), P.SessionOpened)
    tiny_server.trim_heap(now + 1)
    assert not trims  # a session is open and the interval has not passed
    tiny_server.trim_heap(now + tiny_server.config.heap_trim_s + 1)
    assert len(trims) == 1
    tiny_server.trim_heap(now + 2 * tiny_server.config.heap_trim_s + 2)
    assert len(trims) == 1  # nothing ran since
    assert isinstance(_ask(sock, _frames(P.CloseSession(1))), P.Closed)
    tiny_server.trim_heap(now + 2 * tiny_server.config.heap_trim_s + 3)
    assert len(trims) == 2 and tiny_server.stats.heap_trims == start + 2  # the last session closed: at once
    sock.close()


def test_a_device_silent_past_the_cloud_timeout_says_hello_again(tiny_server):
    """The cloud forgets a peer with no session after its session timeout; the device's next request, after that
    long a silence, re-handshakes first instead of being refused."""
    import time

    from edge_runtime.client import CloudClient, CloudError

    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("quiet", "tiny", 512, "tiny-vocab")) as client:
        tiny_server.expire_idle(time.monotonic() + tiny_server.config.session_timeout_s + 1)
        assert not tiny_server.tables.registry.peers
        with pytest.raises(CloudError, match="no_handshake"):  # silent for less than the margin: sent as is
            client.request(P.OpenSession(1, "sd", ARR))
        tiny_server.expire_idle(time.monotonic() + tiny_server.config.session_timeout_s + 1)
        client.last_sent_at -= tiny_server.config.session_timeout_s  # as if the device had been silent that long
        assert isinstance(client.request(P.OpenSession(2, "sd", ARR)), P.SessionOpened)


def test_device_state_reaches_the_cloud(tiny_server):
    """HAT §3.2 state monitoring: profile, power mode and drafting delay go up with a session opening and in Report;
    the cloud keeps each device's latest state (and logs a mode change)."""
    from edge_runtime.client import CloudClient, CloudError
    from edge_runtime.monitor import DeviceMonitor

    monitor = DeviceMonitor("agx-orin-64gb", power_mode="MODE_30W", draft_s=0.012)
    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("orin-7", "tiny", 512, "tiny-vocab")) as client:
        opened = client.request(P.OpenSession(1, "sd", ARR, device=monitor.state()))
        assert isinstance(opened, P.SessionOpened)
        (entry,) = [d for d in tiny_server.tables.registry.devices.values() if d["device_id"] == "orin-7"]
        assert (entry["profile"], entry["power_mode"], entry["draft_s"]) == ("agx-orin-64gb", "MODE_30W", 0.012)
        monitor.power_mode = "MODE_15W"
        reply = client.request(P.Report(monitor.state(up_bps=8e6)))
        assert isinstance(reply, P.Reported) and reply.cloud.pipeline == 1
        assert entry["power_mode"] == "MODE_15W" and entry["up_bps"] == 8e6
        assert entry in tiny_server.report()["devices"]
        for bad in (P.DeviceState(up_bps=float("nan")), P.DeviceState(input_s=-0.001),
                    P.DeviceState(adapter_s=float("inf"))):  # refused with the field's name; nothing kept
            with pytest.raises(CloudError, match="invalid.*(up_bps|input_s|adapter_s) must be finite"):
                client.request(P.Report(bad))
        assert entry["up_bps"] == 8e6 and "input_s" not in entry
        client.request(P.Report(monitor.state(input_s=0.004, adapter_s=0.002)))  # a board's prefill times are kept
        assert (entry["input_s"], entry["adapter_s"]) == (0.004, 0.002)


def test_the_monitor_measures_drafting_delay_and_never_invents_a_mode():
    from types import SimpleNamespace

    from edge_runtime.monitor import DeviceMonitor

    m = DeviceMonitor()
    m.observe(SimpleNamespace(protocol="sd", device_compute_s=1.2, device_prefill_s=0.2, drafted=50, n=40))
    assert m.draft_s == pytest.approx(0.02)
    m.observe(SimpleNamespace(protocol="hat"), split_draft_s=0.03)
    assert m.draft_s == pytest.approx(0.8 * 0.02 + 0.2 * 0.03)
    from hardware.jetson_control import shutil

    if shutil.which("nvpmodel") is None:
        assert m.refresh_mode() == "" and "not a Jetson" in m.mode_error


def test_a_refused_close_leaves_the_session_intact(tiny_server):
    """Found by the fuzzer: a CloseSession refused for desync used to drop the session from the batched steps while
    keeping it open, so the next request on it failed inside the server."""
    from edge_runtime.client import CloudClient, CloudError

    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("closer", "tiny", 512, "tiny-vocab")) as client:
        opened = client.request(P.OpenSession(1, "sd", ARR))
        with pytest.raises(CloudError, match="desync"):
            client.request(P.CloseSession(1, None, None, opened.position + 5))
        reply = client.request(P.Generate(1, 1, opened.position, ARR[:0], 2))
        assert isinstance(reply, P.Generated) and len(reply.tokens) == 2
        closed = client.request(P.CloseSession(1, None, None, opened.position + 2))
        assert isinstance(closed, P.Closed) and closed.n_tokens == opened.position + 2
    assert tiny_server.stats.errors_by_code.get("internal", 0) == 0
