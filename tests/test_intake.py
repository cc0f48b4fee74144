"""The cloud's intake thread (cloud_runtime/intake.py): it owns the public socket and stamps each request as it
arrives. Timing under a computing loop is tests/test_client.py's (the link estimate of a loaded cloud); here, what
must never be silent: a thread that failed leaves a cloud that reads nothing, and the loop says so."""
from __future__ import annotations

import logging
import time

import pytest
import zmq

from cloud_runtime.intake import STAMP, unpack


def test_a_stamp_travels_with_its_request():
    raw = [STAMP.pack(12.5, 0.25), b"device-a", b"identity", b"body"]
    assert unpack(raw) == (12.5, 0.25, "device-a", [b"identity", b"body"])


def test_an_intake_that_failed_stops_the_loop_loudly(tiny_pair, monkeypatch, caplog):
    """A bug in the thread is logged, and serve_forever raises instead of serving a socket nobody reads."""
    from cloud_runtime.config import CloudConfig
    from cloud_runtime.intake import Intake
    from cloud_runtime.server import CloudServer
    from hat_split.net.security import LinkSecurity

    def broken(self, empty_at):
        raise ValueError("planted")

    monkeypatch.setattr(Intake, "_take_requests", broken)
    cfg = CloudConfig(model="tiny", bind="tcp://127.0.0.1:0", poll_ms=20, max_context=1024,
                      security=LinkSecurity.plaintext())
    with caplog.at_level(logging.ERROR, logger="hatspec.cloud"), CloudServer(cfg, tiny_pair[1], "tiny-target",
                                                                              "tiny-vocab") as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        try:
            sock.send(b"anything")  # the thread's read fails on it
            deadline = time.perf_counter() + 10.0  # (a bound: never a hung test)
            with pytest.raises(RuntimeError, match="the intake thread stopped"):
                server.serve_forever(until=lambda: time.perf_counter() > deadline)
        finally:
            sock.close()
    assert "the intake thread failed" in caplog.text and "planted" in caplog.text
