"""The cloud's ZAP handler (ZeroMQ's authentication protocol, RFC 27): which devices may connect over CurveZMQ.

A thread answers libzmq's authentication requests on inproc://zeromq.zap.01 for the ROUTER socket's domain: a CURVE
client whose public key is in the allow-list directory is accepted (its certificate name becomes the connection's
user id); any other is refused with status 400 and the refusal is logged with the client's address and key. The
directory is read again when it changes, so adding a device (`hat-keys allow`) needs no restart.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Dict, List

import zmq
from zmq.utils import z85

from hat_split.net.security import allowed_keys, fingerprint

log = logging.getLogger(__name__)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = "hatspec"


class ZapAllowList:
    def __init__(self, ctx: zmq.Context, allow_dir: str):
        self.allow_dir = allow_dir
        self.keys: Dict[bytes, str] = allowed_keys(allow_dir)
        self._mtime = os.stat(allow_dir).st_mtime_ns
        self.accepted = 0
        self.refused: List[dict] = []  # {"address", "key", "mechanism", "reason"}, newest last (bounded)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise RuntimeError(f"another CurveZMQ server of this process holds {ZAP_ENDPOINT} ({exc}): one "
                               f"authenticating server per process") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def _reload(self) -> None:
        mtime = os.stat(self.allow_dir).st_mtime_ns
        if mtime != self._mtime:
            self.keys, self._mtime = allowed_keys(self.allow_dir), mtime
            log.info("allow-list %s reloaded: %d device keys", self.allow_dir, len(self.keys))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            frames = self._sock.recv_multipart()
            try:
                reply = self.answer(frames)
            except Exception as exc:  # libzmq waits for an answer: a bug here must refuse, not hang the handshake
                log.exception("ZAP request failed")
                reply = [frames[0] if frames else b"1.0", frames[1] if len(frames) > 1 else b"", b"500",
                         f"{type(exc).__name__}".encode(), b"", b""]
            self._sock.send_multipart(reply)

    def answer(self, frames: List[bytes]) -> List[bytes]:
        """A ZAP reply to a ZAP request [version, id, domain, address, identity, mechanism, credentials...]."""
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        reply = lambda code, text, user=b"": [version, request_id, code, text, user, b""]  # noqa: E731
        if mechanism != b"CURVE" or len(frames) < 7:
            return self._refuse(reply, address, b"", mechanism, "not a CURVE client")
        key = z85.encode(frames[6])
        try:
            self._reload()
        except OSError as exc:
            log.error("allow-list %s unreadable: %s", self.allow_dir, exc)
        name = self.keys.get(key)
        if name is None:
            return self._refuse(reply, address, key, mechanism, "key not in the allow-list")
        self.accepted += 1
        return reply(b"200", b"OK", name.encode())

    def _refuse(self, reply, address: bytes, key: bytes, mechanism: bytes, reason: str) -> List[bytes]:
        entry = {"address": address.decode(errors="replace"), "key": fingerprint(key) if key else "",
                 "mechanism": mechanism.decode(errors="replace"), "reason": reason}
        self.refused = (self.refused + [entry])[-100:]
        log.warning("refused a device from %s (%s key %s): %s", entry["address"], entry["mechanism"],
                    entry["key"] or "-", reason)
        return reply(b"400", reason.encode())

    def close(self) -> None:
        """Stop the thread, then give the endpoint back at once (unbind: a socket's close frees an inproc endpoint
        only later, in libzmq's reaper, and the next server of this process must be able to bind it)."""
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._sock.unbind(ZAP_ENDPOINT)
        except zmq.ZMQError:  # already gone
            pass
        self._sock.close(linger=0)
