"""A hostile device for `hat-bench soak --hostile-phases K`, in its own process: an authenticated device (its own key in
the cloud's allow-list, so CurveZMQ lets it in) that, while its phase is on, opens sessions as fast as the cloud
answers, each with a long prompt, never closes one, and sends junk frames between them (random bytes, a truncated
frame, a wrong protocol version; oversized frames are the fuzzer's: hat-bench fuzz). It keeps up to `outstanding`
requests in flight and counts every answer by kind and error code: what the cloud refused it, how often it was
served.

The driver switches it with "on" / "off" over a pipe and stops it with None; it answers with its counts.
"""
from __future__ import annotations

import collections
import os
import time
import traceback
from typing import Dict

import numpy as np
import zmq

from hat_split.net.security import load_public, load_secret
from hat_split.wire import messages as P

JUNK_EVERY = 3  # one junk frame after this many session openings


def junk(rng: np.random.Generator, kind: int) -> list:
    """A malformed request of one of three kinds (the cloud must answer each with an Error and carry on)."""
    good = P.encode(P.OpenSession(0, "sd", np.zeros(4, np.int32)))
    if kind == 0:  # random bytes
        return [rng.bytes(int(rng.integers(1, 512)))]
    if kind == 1:  # a frame cut short
        head = bytes(good[0])
        return [head[:max(1, len(head) // 2)]]
    head = bytearray(bytes(good[0]))  # another protocol version
    head[3] = (head[3] + 7) % 256
    return [bytes(head), *good[1:]]


def hostile_main(conn, spec: dict) -> None:
    """spec: endpoint, security (LinkSecurity), device_id, vocab_size, vocab_fingerprint, model, prompt_tokens,
    outstanding, seed."""
    try:
        counts = _run(conn, spec)
        conn.send(("done", counts))
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(conn, spec: dict) -> Dict[str, int]:
    rng = np.random.default_rng(spec["seed"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"{spec['device_id']}-{os.getpid()}".encode())
    security = spec["security"]
    if security.curve:
        sock.curve_publickey, sock.curve_secretkey = load_secret(security.secret_key)
        sock.curve_serverkey = load_public(security.server_key)
    sock.connect(spec["endpoint"])
    counts: Dict[str, int] = collections.Counter()
    hello = P.encode(P.Hello(spec["device_id"], spec["model"], spec["vocab_size"], spec["vocab_fingerprint"]))
    sock.send_multipart(hello)
    outstanding, sid, on = 1, 0, False
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if conn.poll(0):
            cmd = conn.recv()
            if cmd is None:
                break
            on = cmd == "on"
        while poller.poll(0 if on and outstanding < spec["outstanding"] else 50):
            reply = P.decode(sock.recv_multipart())
            outstanding -= 1
            key = f"error:{reply.code}" if isinstance(reply, P.Error) else type(reply).__name__
            counts[key] += 1
            if key == "error:no_handshake":  # the cloud forgot it (idle past the session timeout): say Hello again
                sock.send_multipart(hello)
                outstanding += 1
        if not on or outstanding >= spec["outstanding"]:
            continue
        sid += 1
        prompt = rng.integers(0, spec["vocab_size"], spec["prompt_tokens"]).astype(np.int32)
        sock.send_multipart(P.encode(P.OpenSession(sid, "sd", prompt)))
        counts["sent_open"] += 1
        outstanding += 1
        if sid % JUNK_EVERY == 0:
            sock.send_multipart(junk(rng, sid // JUNK_EVERY % 3))
            counts["sent_junk"] += 1
            outstanding += 1
    time.sleep(0.1)
    sock.close(linger=0)
    ctx.term()
    return dict(counts)
