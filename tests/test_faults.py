"""Faults (issue 9): a link cut mid-answer and a cloud restarted mid-session. The device notices the drop (ZMTP
heartbeats / the connection's end), reconnects with backoff and reopens its session from its own history: nothing is
lost or repeated. `wait` pauses (greedy output identical to an uninterrupted run); `degrade` keeps generating with
the device's own model meanwhile and marks those tokens."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig, LinkConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from hat_split.wire import messages as P
from hat_split.math.sampling import SamplingParams
from hat_split.net.security import LinkSecurity
from testbed.link_emulator import LinkEmulator
from tests.conftest import refusing_port, serving

PROMPT = [5, 17, 99, 3, 250, 7]
N = 40


def _generate(endpoint, draft, policy="wait", on_tokens=None, protocol="sd"):
    params = SamplingParams(0.0)
    with CloudClient(LinkConfig(endpoint, security=LinkSecurity.plaintext(), connect_timeout_s=0.5, connect_retries=1,
                                backoff_s=0.1, request_timeout_s=30, heartbeat_s=1.0),
                     P.Hello("faulty", "tiny", 512, "tiny-vocab")) as client:
        config = EdgeConfig(model="tiny", link=LinkConfig(security=LinkSecurity.plaintext(), link_policy=policy,
                                                          backoff_s=0.2, reconnect_timeout_s=60))
        gen = new_session(config, GenerationRequest(PROMPT, protocol, params, N, seed=0, on_tokens=on_tokens),
                          Drafter(draft, params), client, frozenset(), 1)
        return gen.run(PROMPT, lambda toks: "")


def _cut_after(link, k, seconds, mode="reset"):
    """An on_tokens hook cutting the link once `k` tokens are out, restoring it `seconds` later."""
    state = {"n": 0, "cut": False}

    def hook(tokens, _logprobs=None):
        state["n"] += len(tokens)
        if state["n"] >= k and not state["cut"]:
            state["cut"] = True
            link.cut(mode)
            state["timer"] = threading.Timer(seconds, link.restore)
            state["timer"].start()

    hook.state = state
    return hook


@pytest.mark.parametrize("mode,protocol", [("reset", "sd"), ("stall", "sd"), ("reset", "randhlm"),
                                           ("stall", "uhlm")])
def test_link_cut_under_wait_gives_the_uninterrupted_answer(tiny_server, tiny_pair, mode, protocol):
    """Also for the protocols that draw on the device per round (randhlm's coin, U-HLM's perturbations): the round
    lost to the cut draws the same again when it is retried."""
    draft = tiny_pair[0]
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    reference = _generate(tiny_server.endpoint, draft, protocol=protocol)
    with LinkEmulator("loopback", (host, int(port))) as link:
        hook = _cut_after(link, 8, 3.0, mode)  # longer than the heartbeat
        got = _generate(link.address, draft, "wait", hook, protocol=protocol)
        hook.state["timer"].join()
    assert got.tokens == reference.tokens and got.n == N  # nothing lost, nothing duplicated
    assert got.interruptions >= 1 and got.degraded == []


@pytest.mark.parametrize("protocol", ["sd", "llm"])
def test_link_cut_under_degrade_keeps_generating_and_marks_the_tokens(tiny_server, tiny_pair, protocol):
    """`llm` drafts nothing, so its draft reads the prompt only once the link is down (none of its time before)."""
    draft = tiny_pair[0]
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    reference = _generate(tiny_server.endpoint, draft, protocol=protocol)
    if protocol == "llm":
        assert reference.device_compute_s == 0.0
    with LinkEmulator("loopback", (host, int(port))) as link:
        hook = _cut_after(link, 8, 1.0)
        got = _generate(link.address, draft, "degrade", hook, protocol)
        hook.state["timer"].join()  # the answer may be complete before the link is back
    assert got.n == N and got.interruptions >= 1 and got.degraded
    first = got.degraded[0]
    assert 8 <= first and got.tokens[:first] == reference.tokens[:first]  # before the cut: the target's tokens
    assert got.degraded == list(range(first, first + len(got.degraded)))  # one run of local tokens, marked


def test_a_cloud_restarted_mid_session_lets_the_device_finish(tiny_pair):
    """The cloud goes away mid-answer (its socket closed, its sessions gone) and a new cloud binds the same port a
    second later: the device replays its history into a new session; its answer equals the uninterrupted one."""
    draft, target = tiny_pair
    first_ctx = serving(target)
    first = first_ctx.__enter__()
    endpoint = first.endpoint
    reference = _generate(endpoint, draft)
    second = {}

    def start_second():
        time.sleep(1.0)
        second["ctx"] = serving(target, bind=endpoint)
        second["server"] = second["ctx"].__enter__()

    state = {"n": 0}

    def hook(tokens, _logprobs=None):
        state["n"] += len(tokens)
        if state["n"] >= 10 and "thread" not in state:
            first_ctx.__exit__(None, None, None)  # the cloud dies
            state["thread"] = threading.Thread(target=start_second)
            state["thread"].start()

    try:
        got = _generate(endpoint, draft, "wait", hook)
        assert got.tokens == reference.tokens and got.interruptions >= 1
        assert second["server"].stats.sessions_opened >= 1  # the answer was finished by the new cloud
    finally:
        state["thread"].join()
        second["ctx"].__exit__(None, None, None)


# -- the split protocols: only hidden states cross the link, so the device replays its history's shallow states -------
@pytest.fixture(scope="module")
def tiny_adapter(tiny_pair):
    from hat_split.models.adapter import Adapter

    return Adapter(tiny_pair[1].model, 1).eval().requires_grad_(False)


def _generate_split(endpoint, model, adapter, protocol, policy="wait", on_tokens=None, tap=None):
    from edge_runtime.config import SplitConfig
    from edge_runtime.split_drafter import SplitDrafter
    from edge_runtime.backends.split_parts import TorchSplitParts
    from hat_split.models.partition import SplitModel

    params = SamplingParams(0.0)
    parts = TorchSplitParts(SplitModel(model, 1), adapter if protocol == "hat" else None)
    with CloudClient(LinkConfig(endpoint, security=LinkSecurity.plaintext(), connect_timeout_s=0.5, connect_retries=1,
                                backoff_s=0.1, request_timeout_s=30, heartbeat_s=1.0),
                     P.Hello("faulty-split", "tiny", 512, "tiny-vocab")) as client:
        client.tap = tap
        config = EdgeConfig(model="tiny", link=LinkConfig(security=LinkSecurity.plaintext(), link_policy=policy,
                                                          backoff_s=0.2, reconnect_timeout_s=60),
                            split=SplitConfig(m=1, draft_stop_prob=0.0, draft_len=4, chunk_tokens=3))
        gen = new_session(config, GenerationRequest(PROMPT, protocol, params, N, seed=0, on_tokens=on_tokens),
                          SplitDrafter(parts, params, 0), client, frozenset(), 1)
        return gen.run(PROMPT, lambda toks: "")


def _link(server):
    host, port = server.endpoint.split("//")[1].rsplit(":", 1)
    return LinkEmulator("loopback", (host, int(port)))


@pytest.mark.parametrize("protocol", ["ushape", "hat"])
def test_split_protocols_resume_after_a_cut_with_the_uninterrupted_answer(tiny_server, tiny_pair, tiny_adapter,
                                                                          protocol):
    model = tiny_pair[1].model
    reference = _generate_split(tiny_server.endpoint, model, tiny_adapter, protocol)
    with _link(tiny_server) as link:
        hook = _cut_after(link, 8, 3.0, "stall")  # longer than the heartbeat
        got = _generate_split(link.address, model, tiny_adapter, protocol, "wait", hook)
        hook.state["timer"].join()
    assert got.tokens == reference.tokens and got.n == N
    assert got.interruptions >= 1 and got.degraded == []
    assert got.prefill_chunks > reference.prefill_chunks  # the history went up again, in chunks


def test_hat_under_degrade_drafts_alone_and_ushape_waits(tiny_server, tiny_pair, tiny_adapter):
    model = tiny_pair[1].model
    reference = _generate_split(tiny_server.endpoint, model, tiny_adapter, "hat")
    with _link(tiny_server) as link:
        hook = _cut_after(link, 8, 1.5)
        got = _generate_split(link.address, model, tiny_adapter, "hat", "degrade", hook)
        hook.state["timer"].join()
        assert got.n == N and got.interruptions >= 1 and got.degraded
        first = got.degraded[0]
        assert 8 <= first and got.tokens[:first] == reference.tokens[:first]
        assert got.degraded == list(range(first, first + len(got.degraded)))
        # U-shape has no draft to generate with: under degrade it waits, and its answer is the uninterrupted one
        ushape = _generate_split(tiny_server.endpoint, model, tiny_adapter, "ushape")
        hook = _cut_after(link, 8, 1.5)
        got = _generate_split(link.address, model, tiny_adapter, "ushape", "degrade", hook)
        hook.state["timer"].join()
    assert got.tokens == ushape.tokens and got.interruptions >= 1 and got.degraded == []


@pytest.mark.parametrize("protocol", ["sd", "hat"])
def test_a_cut_while_the_prompt_is_on_the_link_is_survived(tiny_server, tiny_pair, tiny_adapter, protocol):
    """The link is cut the moment the session's opening message goes up: the device never saw its first token."""
    draft, target = tiny_pair
    opening = (P.OpenSession, P.OpenSplit)
    with _link(tiny_server) as link:
        cut = {}

        def tap(direction, frames):
            if direction == "up" and not cut and isinstance(P.decode(frames), opening):
                link.cut("reset")
                cut["timer"] = threading.Timer(2.0, link.restore)
                cut["timer"].start()

        if protocol == "sd":
            reference = _generate(tiny_server.endpoint, draft)
            with CloudClient(LinkConfig(link.address, security=LinkSecurity.plaintext(), connect_timeout_s=0.5,
                                        connect_retries=1, backoff_s=0.1, request_timeout_s=30, heartbeat_s=1.0),
                             P.Hello("faulty", "tiny", 512, "tiny-vocab")) as client:
                client.tap = tap
                params = SamplingParams(0.0)
                config = EdgeConfig(model="tiny", link=LinkConfig(security=LinkSecurity.plaintext(), backoff_s=0.2,
                                                                  reconnect_timeout_s=60))
                got = new_session(config, GenerationRequest(PROMPT, "sd", params, N, seed=0),
                                  Drafter(draft, params), client, frozenset(), 1).run(PROMPT, lambda toks: "")
        else:
            reference = _generate_split(tiny_server.endpoint, target.model, tiny_adapter, "hat")
            got = _generate_split(link.address, target.model, tiny_adapter, "hat", tap=tap)
        cut["timer"].join()
    assert got.tokens == reference.tokens and got.interruptions >= 1


def test_a_session_the_cloud_forgot_is_reopened_from_the_history(tiny_pair):
    """The device goes silent mid-answer for longer than the cloud's session timeout (the link stays up): the cloud
    frees the session, the device's next request is answered `no_session`, and it reopens from its history."""
    draft, target = tiny_pair
    with serving(target, session_timeout_s=1.0) as server:
        reference = _generate(server.endpoint, draft)
        state = {"n": 0}

        def hook(tokens, _logprobs=None):
            state["n"] += len(tokens)
            if state["n"] >= 10 and "slept" not in state:
                state["slept"] = True
                time.sleep(2.5)  # silent past the timeout; the server's loop frees the session meanwhile

        expired = server.stats.sessions_expired
        got = _generate(server.endpoint, draft, "wait", hook)
        assert server.stats.sessions_expired > expired and server.stats.errors_by_code.get("no_session", 0) >= 1
    assert got.tokens == reference.tokens and got.interruptions == 1


def test_a_cloud_slow_to_welcome_is_waited_for_not_given_up(tiny_server):
    """Connected and accepted but busy (a loaded cloud answers between compute steps): the handshake waits past the
    connect timeout instead of failing. A proxy delays every reply by 1.5 s; the connect timeout is 0.5 s."""
    import zmq

    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    back.connect(tiny_server.endpoint)
    stop = threading.Event()

    def relay():
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        while not stop.is_set():
            ready = dict(poller.poll(100))
            if front in ready:
                peer, *frames = front.recv_multipart()
                back.send_multipart(frames)
            if back in ready:
                reply = back.recv_multipart()
                time.sleep(1.5)
                front.send_multipart([peer, *reply])

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        with CloudClient(LinkConfig(f"tcp://127.0.0.1:{port}", security=LinkSecurity.plaintext(),
                                    connect_timeout_s=0.5, connect_retries=1, request_timeout_s=10),
                         P.Hello("slow", "tiny", 512, "tiny-vocab")) as client:
            assert client.welcome is not None
        with refusing_port() as nobody:
            absent = CloudClient(LinkConfig(f"tcp://127.0.0.1:{nobody}", security=LinkSecurity.plaintext(),
                                            connect_timeout_s=0.3, connect_retries=1, request_timeout_s=10),
                                 P.Hello("x", "tiny", 512, "tiny-vocab"))
            with pytest.raises(Exception, match="no answer from the cloud"):  # nobody listening: still fails fast
                absent.connect()
    finally:
        stop.set()
        thread.join()
        front.close(0)
        back.close(0)


@pytest.mark.real_models
def test_a_request_starting_while_the_link_is_down_waits_for_it(smollm2):
    """The runtime has been served, then the link is cut between two requests: the next request reconnects with
    backoff once the link is back instead of failing. A cloud never reached still fails at once."""
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import vocab_fingerprint

    vocab = vocab_fingerprint(smollm2.tokenizer)
    with serving(CausalLM(smollm2.model), vocab=vocab, session_timeout_s=2.0) as server, _link(server) as link:
        config = EdgeConfig(model="smollm2-135m", link=LinkConfig(
            link.address, security=LinkSecurity.plaintext(), backoff_s=0.2, connect_timeout_s=0.5, connect_retries=1,
            heartbeat_s=1.0, reconnect_timeout_s=60))
        with EdgeRuntime(config, smollm2) as rt:
            first = rt.generate(PROMPT, "sd", SamplingParams(0.0), 12, seed=0)
            rt.close()  # as the agent does after a failed report
            link.cut("reset")
            threading.Timer(2.0, link.restore).start()
            t0 = time.monotonic()
            second = rt.generate(PROMPT, "sd", SamplingParams(0.0), 12, seed=0)
            assert second.tokens == first.tokens and time.monotonic() - t0 > 1.5
            # the link drops between requests while the runtime still holds its connection: under degrade the
            # device starts the answer alone, from this prompt, and the cloud finishes it
            rt.config = dataclasses.replace(rt.config, link=dataclasses.replace(rt.config.link, link_policy="degrade"))
            link.cut("reset")
            time.sleep(1.2)  # past half the session timeout: the request's first send says Hello again, and fails

            restored = []

            def slow_board(tokens, logprobs):  # driven, not hoped for: the link comes back once the device has
                if not restored:               # begun alone, and each commit takes a slow board's 0.1 s, so the
                    restored.append(link.restore())  # cloud is back long before the device could finish alone
                time.sleep(0.1)
            third = rt.generate(PROMPT, "sd", SamplingParams(0.0), 12, seed=0, on_tokens=slow_board)
            assert third.n == 12 and third.interruptions == 1 and third.degraded[0] == 0
            assert third.degraded == list(range(len(third.degraded))) and len(third.degraded) < 12, third.degraded
            n = len(third.degraded)  # the cloud came back before the end: the tokens are the target's
            assert third.tokens[:n] == CausalLM(smollm2.model).greedy(PROMPT, n)  # the same model drafts
            assert third.tokens == first.tokens
            # an answer made wholly alone leaves its session's connection closed (every reconnect failed): the
            # next request connects afresh instead of failing with "not connected"
            link.cut("reset")
            time.sleep(1.2)
            fourth = rt.generate(PROMPT, "sd", SamplingParams(0.0), 12, seed=0)
            assert fourth.n == 12 and fourth.degraded == list(range(12))
            link.restore()
            fifth = rt.generate(PROMPT, "sd", SamplingParams(0.0), 12, seed=0)
            assert fifth.tokens == first.tokens and fifth.degraded == [] and fifth.interruptions == 0
    with refusing_port() as nobody:
        never = EdgeConfig(model="smollm2-135m", link=LinkConfig(f"tcp://127.0.0.1:{nobody}",
                                                                 security=LinkSecurity.plaintext(),
                                                                 connect_timeout_s=0.3, connect_retries=1))
        with EdgeRuntime(never, smollm2) as rt:
            t0 = time.monotonic()
            with pytest.raises(Exception, match="no answer from the cloud"):
                rt.generate(PROMPT, "sd", SamplingParams(0.0), 4)
            assert time.monotonic() - t0 < 5


def test_a_close_whose_reply_was_lost_leaves_nothing_for_the_next_request(smollm2, monkeypatch):
    """The connection drops while a session's Closed is due, and the Closed comes after all: the next request must
    not take it for its own answer (it connects afresh), and gives the same tokens."""
    from edge_runtime.client import LinkDown
    from edge_runtime.runtime import EdgeRuntime
    from edge_runtime.sessions.token import TokenSession
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import vocab_fingerprint

    close, lost = TokenSession.close, []

    def close_lost_once(self, prompt):
        if lost:
            return close(self, prompt)
        lost.append(self.session_id)
        self.client.send(P.CloseSession(self.session_id, None, None, len(prompt) + len(self.generated)))
        time.sleep(0.3)  # the Closed arrives, unread
        raise LinkDown("the connection to the cloud dropped while a reply was due (planted)")

    monkeypatch.setattr(TokenSession, "close", close_lost_once)
    with serving(CausalLM(smollm2.model), vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        config = EdgeConfig(model="smollm2-135m", link=LinkConfig(server.endpoint, security=LinkSecurity.plaintext()))
        with EdgeRuntime(config, smollm2) as rt:
            first = rt.generate(PROMPT, "llm", SamplingParams(0.0), 8, seed=0)
            second = rt.generate(PROMPT, "llm", SamplingParams(0.0), 8, seed=0)
    assert lost and first.tokens == second.tokens


def test_a_drop_while_no_reply_was_due_does_not_fail_the_next_request(tiny_server):
    """The link drops and comes back while the device is idle (its socket reconnects by itself): the next request
    says Hello again (the cloud behind may have restarted: test_a_cloud_restarted_mid_session_lets_the_device_finish)
    and is answered; a drop while its reply is due still counts (the resume tests above)."""
    with _link(tiny_server) as link:
        hello = P.Hello("idle-device", "m", 0, "", "test")
        with CloudClient(LinkConfig(link.address, security=LinkSecurity.plaintext(), heartbeat_s=1.0), hello) \
                as client:
            assert isinstance(client.request(P.Report(P.DeviceState())), P.Reported)
            link.cut("reset")
            time.sleep(0.5)
            link.restore()
            time.sleep(1.0)  # the socket reconnects
            assert isinstance(client.request(P.Report(P.DeviceState())), P.Reported)
