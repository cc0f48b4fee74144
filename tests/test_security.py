"""CurveZMQ on the device-cloud link (issue 9): an allow-listed device is served, an unknown or plaintext one is
refused (and the refusal logged), nothing readable crosses the wire, and plaintext happens only when asked for."""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from cloud_runtime.config import CloudConfig
from edge_runtime.client import CloudClient, CloudError, CloudUnavailable
from edge_runtime.config import LinkConfig
from hat_split.wire import messages as P
from hat_split.net.keys_cli import main as keys_main
from hat_split.net.security import LinkSecurity, ephemeral
from tests.conftest import finishes_within, serving

PROMPT = np.arange(300, 340, dtype=np.int32)  # 40 distinctive token ids of the tiny vocabulary


def _server(tiny_pair, security):
    return serving(tiny_pair[1], security)


@contextlib.contextmanager
def _recording_proxy(upstream: str):
    """A TCP relay that keeps every byte it forwards (both directions); `cut(delay_down_s)` drops the live connections
    and holds what later connections' cloud sends back to the device for delay_down_s (a slow or loaded path)."""
    host, port = upstream.split("//")[1].rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    wire = bytearray()
    lock = threading.Lock()
    live = []
    delay_down_s = [0.0]

    def cut(delay_s: float = 0.0):
        delay_down_s[0] = delay_s
        for s in live:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def pump(a, b, down):
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                with lock:
                    wire.extend(data)
                if down:
                    time.sleep(delay_down_s[0])
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept():
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                server = socket.create_connection((host, int(port)))
                live.extend((client, server))
                for a, b, down in ((client, server, False), (server, client, True)):
                    threading.Thread(target=pump, args=(a, b, down), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", wire, cut
    listener.close()


def _hello(name: str) -> P.Hello:
    return P.Hello(name, "tiny", 512, "tiny-vocab")


def _session(endpoint: str, name: str, security) -> P.Message:
    link = LinkConfig(endpoint, security=security or LinkSecurity.plaintext(), connect_timeout_s=2.0,
                      connect_retries=2, backoff_s=0.1)
    with CloudClient(link, _hello(name)) as client:
        return client.request(P.OpenSession(1, "sd", PROMPT))


def test_allow_listed_device_served_others_refused_and_logged(tiny_pair, tmp_path, caplog):
    cloud, devices = ephemeral(tmp_path / "keys", ["orin-1", "orin-2"])
    _, stranger = ephemeral(tmp_path / "other", ["stranger"])  # a well-formed key the cloud never allowed
    stranger = LinkSecurity("curve", stranger["stranger"].secret_key, devices["orin-1"].server_key)
    with _server(tiny_pair, cloud) as server, caplog.at_level(logging.WARNING, logger="cloud_runtime.zap"):
        assert isinstance(_session(server.endpoint, "orin-1", devices["orin-1"]), P.SessionOpened)
        with pytest.raises(CloudError, match="refused this device's key"):
            _session(server.endpoint, "stranger", stranger)
        with pytest.raises(CloudError, match="security handshake failed"):
            _session(server.endpoint, "plain", None)  # a plaintext device against the encrypted cloud
        refused = server.report()["security"]["refused"]
        assert refused and refused[0]["reason"] == "key not in the allow-list" and refused[0]["key"]
        assert any("refused a device" in r.getMessage() for r in caplog.records)
        # revoking a key takes effect for new connections, without a restart
        assert keys_main(["revoke", "orin-2", "--allow-dir", cloud.allow_dir]) == 0
        with pytest.raises(CloudError, match="refused this device's key"):
            _session(server.endpoint, "orin-2", devices["orin-2"])
        assert server.report()["security"]["accepted"] >= 1


def test_traffic_is_not_readable_on_the_wire(tiny_pair, tmp_path):
    cloud, devices = ephemeral(tmp_path / "keys", ["orin-1"])
    marker = PROMPT.tobytes()[:16]  # four consecutive prompt token ids as they would be framed
    with _server(tiny_pair, cloud) as server, _recording_proxy(server.endpoint) as (address, wire, _):
        assert isinstance(_session(address, "orin-1", devices["orin-1"]), P.SessionOpened)
        assert len(wire) > PROMPT.nbytes
        assert marker not in wire and b"OpenSession" not in wire and b"tiny-vocab" not in wire
    with _server(tiny_pair, LinkSecurity.plaintext()) as server, \
            _recording_proxy(server.endpoint) as (address, wire, _):
        assert isinstance(_session(address, "plain", None), P.SessionOpened)
        assert marker in wire and b"OpenSession" in wire  # the control: plaintext is readable


@pytest.mark.parametrize("delay_down_s", [0.0, 0.5])
def test_a_device_refused_on_reconnection_is_told_and_never_hangs(tiny_pair, tmp_path, delay_down_s):
    """A connected device whose key is revoked, then whose link drops: libzmq reconnects, the cloud refuses the new
    handshake and the socket is left with nowhere to queue a message. The next request must fail at once with the
    reason, not block in the send forever. With delay_down_s the refusal reaches the device well after the cloud
    counted it (a slow path; on a loaded machine the relay alone did it): the request, sent while the handshake is
    still in flight, must wait for its outcome rather than call the link merely down."""
    cloud, devices = ephemeral(tmp_path / "keys", ["orin-1"])
    link_of = lambda address: LinkConfig(address, security=devices["orin-1"], connect_timeout_s=2.0,  # noqa: E731
                                         connect_retries=2, backoff_s=0.1)
    with _server(tiny_pair, cloud) as server, _recording_proxy(server.endpoint) as (address, _, cut):
        client = CloudClient(link_of(address), _hello("orin-1"))
        client.connect()
        assert isinstance(client.request(P.OpenSession(1, "sd", PROMPT)), P.SessionOpened)
        assert keys_main(["revoke", "orin-1", "--allow-dir", cloud.allow_dir]) == 0
        cut(delay_down_s)
        deadline = time.monotonic() + 3.0
        while not server.report()["security"]["refused"] and time.monotonic() < deadline:
            time.sleep(0.05)  # libzmq's reconnection, refused
        assert server.report()["security"]["refused"], "the reconnection was never refused"
        outcome = []

        def second_request():
            try:
                client.request(P.OpenSession(2, "sd", PROMPT))
                outcome.append("answered")
            except CloudError as exc:
                outcome.append(str(exc))
            except CloudUnavailable as exc:  # (LinkDown included)
                outcome.append(f"unavailable: {exc}")

        took = finishes_within(second_request, 30, "the request's send on a refused connection")
        client.close()
        assert took < 2.0 + 2.0 * 2 + 1.0, outcome
        assert outcome and "refused this device's key" in outcome[0], outcome


def test_plaintext_only_when_asked_for(tmp_path):
    with pytest.raises(ValueError, match="unless --plaintext is given; the cloud needs --curve-secret and "
                                         "--curve-allow"):
        CloudConfig(model="tiny")
    with pytest.raises(ValueError, match="the device needs --curve-secret and --curve-server-key"):
        LinkSecurity().check("device")
    with pytest.raises(ValueError, match="does not exist"):
        LinkSecurity("curve", str(tmp_path / "nope.key_secret"), str(tmp_path / "c.key")).check("device")
    from cloud_runtime.cli import build_parser

    assert getattr(build_parser().parse_args(["serve", "--model", "m", "--plaintext"]), "security.mode") == "plaintext"


def test_a_closed_cloud_gives_the_zap_endpoint_back_at_once(tmp_path):
    """Servers started one after another in one process (tests, a restarted server) each get the ZAP endpoint: a
    closed allow-list unbinds it at once (libzmq frees an inproc endpoint only later on a bare close); two live
    authenticating servers in one process are refused with the reason."""
    import zmq

    from cloud_runtime.zap import ZapAllowList

    ctx = zmq.Context.instance()
    (tmp_path / "allow").mkdir()
    for _ in range(10):  # a bare close failed the next bind ~97 % of the time
        ZapAllowList(ctx, str(tmp_path / "allow")).close()
    first = ZapAllowList(ctx, str(tmp_path / "allow"))
    try:
        with pytest.raises(RuntimeError, match="one authenticating server per process"):
            ZapAllowList(ctx, str(tmp_path / "allow"))
    finally:
        first.close()
