"""The cloud's intake: a thread that owns the public ROUTER socket, so that a request is seen when it arrives, not when
the serving loop next reads.

The serving loop (cloud_runtime.server) reads its socket only between steps. Under load it computes all the time, so
every request waited unseen for part of a step, its reply could only say how long it may have waited (`unseen_s`), and
the device took no round-trip sample from it: its estimate of the link stayed whatever it was before the load (a
previous link's, or its connect probes' upper bound, a step's wait included: 0.56 s on a 4 ms link, 2026-11-28,
docs/LINKS.md). Here a thread does nothing but move frames: it reads each request as it arrives, stamps it with
`time.perf_counter()` (the loop's clock: one per process) and how long before the read it may have arrived (its poll
woke on it: about 0; a burst read after the thread waited for the interpreter: since it last saw the socket empty),
and hands it to the loop through an inproc pair; replies go back the same way. The loop then counts a reply's
`held_s` from the arrival, so the device's sample (wall time less `held_s`) is the link's alone, loaded cloud or not.

Model steps release the interpreter (torch's kernels, llama.cpp's calls), so the thread reads while they run; while
the loop runs Python the thread waits for the interpreter at most a switch interval (5 ms by default), and that
wait is in `unseen_s`.

A thread that fails logs why and ends; the loop then raises (`alive`) rather than serve a socket nobody reads.

Frames to the loop: [stamp (two float64: arrival, unseen_s), user (the CurveZMQ allow-list name, or empty), identity,
message frames...]; from the loop: [identity, message frames...], or one empty frame: stop.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any, List, Tuple

import zmq

log = logging.getLogger("hatspec.cloud")

WOKE_S = 1e-3  # a poll that returned a request after blocking this long was woken by it: it arrived just then
POLL_MS = 200  # the thread looks at its stop flag at least this often (a stop frame wakes it at once)
STAMP = struct.Struct("<dd")  # arrival (perf_counter seconds), unseen_s
STOP = b""  # the loop's one-frame message that ends the thread


class Intake:
    """The thread that serves `front` (a bound ROUTER, handed over: only this thread uses it from now on); `sock` is
    the loop's end of the pair (the loop's to poll, read and write; `close` closes both ends)."""

    def __init__(self, ctx: zmq.Context, front: zmq.Socket, curve: bool) -> None:
        self.endpoint = front.getsockopt_string(zmq.LAST_ENDPOINT)
        self._front, self._curve = front, curve
        address = f"inproc://hatspec-intake-{id(self):x}"
        self._back = ctx.socket(zmq.PAIR)  # the thread's end
        self.sock = ctx.socket(zmq.PAIR)  # the loop's end
        for s in (self._back, self.sock):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)  # no limit: one request in flight per device bounds what waits here, and
            s.setsockopt(zmq.RCVHWM, 0)  # a full pipe would block the thread, and the thread the loop
        self._back.bind(address)
        self.sock.connect(address)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hatspec-intake", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread still serves the public socket (it ends on `close`, or on a bug it logged)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (it closes the public socket), then close the loop's end."""
        if self.alive:
            self._stopping.set()
            try:
                self.sock.send(STOP, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                log.error("the intake thread did not stop within 5 s")
        self.sock.close(linger=0)

    # -- the thread -----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        front, back = self._front, self._back
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        empty_at = time.perf_counter()  # when the public socket was last seen with nothing waiting
        try:
            while not self._stopping.is_set():
                looked = time.perf_counter()
                ready = dict(poller.poll(POLL_MS))
                woke = time.perf_counter()
                if front not in ready or woke - looked > WOKE_S:  # watched until now
                    empty_at = woke
                if front in ready:
                    empty_at = self._take_requests(empty_at)
                if back in ready and not self._give_replies():
                    return
        except Exception:  # a bug here must not pass silently: the cloud would be deaf
            log.exception("the intake thread failed: the cloud reads no more requests")
        finally:
            front.close(linger=0)
            back.close(linger=0)

    def _take_requests(self, empty_at: float) -> float:
        """Every request waiting on the public socket, stamped, to the loop; returns when it was seen empty."""
        while True:
            try:
                raw = self._front.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return time.perf_counter()
            at = time.perf_counter()
            self._back.send_multipart([STAMP.pack(at, max(0.0, at - empty_at)), self._user(raw), *raw], copy=False)

    def _user(self, raw: List[Any]) -> bytes:
        """The allow-list name ZAP gave the request's connection (CurveZMQ), or empty."""
        if not self._curve or not hasattr(raw[-1], "get"):
            return b""
        try:
            return (raw[-1].get("User-Id") or "").encode()
        except zmq.ZMQError:
            return b""

    def _give_replies(self) -> bool:
        """Every reply the loop has written, to its device; False on the loop's stop."""
        while True:
            try:
                frames = self._back.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            if len(frames) == 1 and frames[0].bytes == STOP:
                return False
            try:
                self._front.send_multipart(frames, copy=False)
            except zmq.ZMQError as exc:  # EHOSTUNREACH (ROUTER_MANDATORY): the device went away before its answer
                log.warning("dropping reply to vanished peer %r: %s", bytes(frames[0]), exc)


def unpack(raw: List[Any]) -> Tuple[float, float, str, List[Any]]:
    """The loop's side: a request from the intake as (arrival, unseen_s, user, [identity, message frames...])."""
    stamp = raw[0].bytes if hasattr(raw[0], "bytes") else bytes(raw[0])
    user = raw[1].bytes if hasattr(raw[1], "bytes") else bytes(raw[1])
    at, unseen = STAMP.unpack(stamp)
    return at, unseen, user.decode(errors="replace"), list(raw[2:])
