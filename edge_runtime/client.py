"""The device's ZeroMQ DEALER client: handshake with bounded retries, one request in flight, byte counters.

Bytes are counted from the frames actually sent and received (hat_split.wire.messages.frame_bytes), so every
bytes-per-token figure in hatspec is measured, not computed from a formula. The client is built from the device's
LinkConfig whole; what a request does with a dropped link is its session's business (edge_runtime.sessions).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Type, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from edge_runtime.config import LinkConfig
from hat_split.math.chunking import RoundTripFilter
from hat_split.net.security import load_public, load_secret
from hat_split.wire import messages as P

M = TypeVar("M", bound=P.Message)

RECONNECT_BACKOFF_MAX_S = 5.0  # the longest wait between two reconnection attempts after a drop
RTT_PROBES = 3  # tiny round trips after the handshake: the round-trip estimate's first samples
RTT_WINDOW = 16  # the round trip is the least of at most this many recent samples ...
RTT_MAX_AGE_S = 30.0  # ... of the last this many seconds
RTT_SAMPLE_BYTES = 1024  # an exchange is a sample when its frames are at most this big both ways (1 KiB: 1.6 ms at
# LTE's 5 Mbit/s uplink, within a few percent of its round trip)
RTT_ARRIVAL_S = 1e-3  # ... and its reply was seen within this long of arriving, and its request by the cloud
NO_MODEL_WORK = (P.Welcome, P.Reported, P.SplitOpened)  # replies the cloud sends without a model step (an older
# cloud's carry no held_s: their held time is taken as 0)


def _seconds(value: object) -> Optional[float]:
    """A reply's duration field as seconds, or None when it is missing or not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


class CloudUnavailable(RuntimeError):
    """The cloud did not answer within the configured attempts or timeout."""


class LinkDown(CloudUnavailable):
    """The connection to the cloud dropped (reset, or ZMTP heartbeats unanswered) while a reply was awaited."""


def reconnect_delays(first_s: float) -> Iterator[float]:
    """Waits between reconnection attempts after a drop: first_s, doubling, at most RECONNECT_BACKOFF_MAX_S."""
    delay = first_s
    while True:
        yield delay
        delay = min(2 * delay, RECONNECT_BACKOFF_MAX_S)


def expect(reply: P.Message, kind: Type[M], request: Type[P.Message]) -> M:
    """`reply` when it is the `kind` of message that answers a `request`; a RuntimeError saying so otherwise."""
    if not isinstance(reply, kind):
        raise RuntimeError(f"unexpected answer to {request.__name__}: {reply!r}")
    return reply


class CloudError(RuntimeError):
    """The cloud answered with an Error message."""

    def __init__(self, error: P.Error):
        super().__init__(f"cloud refused ({error.code}): {error.message}")
        self.error = error


@dataclass
class LinkCounters:
    up_bytes: int = 0  # request frames sent
    down_bytes: int = 0  # reply frames received
    round_trips: int = 0

    def snapshot(self) -> "LinkCounters":
        return LinkCounters(self.up_bytes, self.down_bytes, self.round_trips)

    def since(self, earlier: "LinkCounters") -> "LinkCounters":
        return LinkCounters(
            self.up_bytes - earlier.up_bytes, self.down_bytes - earlier.down_bytes,
            self.round_trips - earlier.round_trips
        )


class CloudClient:
    """Context manager: connects, says Hello (retrying with backoff), then `request()` one message at a time."""

    def __init__(self, link: LinkConfig, hello: P.Hello):
        """link: the device's LinkConfig (endpoint, CurveZMQ keys or plaintext, timeouts, retries, heartbeats)."""
        self.link = link
        self.hello = hello
        self._monitor = None
        self.counters = LinkCounters()
        self.welcome: Optional[P.Welcome] = None
        self.rtt = RoundTripFilter(RTT_WINDOW, RTT_MAX_AGE_S)  # the link's round trip: probed in connect, then
        # sampled from every small exchange (`base_rtt_s`), so it follows a link that changes under the connection
        self.last_sent_bytes = 0  # the last request's frames' bytes
        self.last_reply_at = 0.0  # perf_counter() when the last reply arrived (first seen by `ready`, else read)
        self.last_reply_bytes = 0  # its frames' bytes
        self.arrival_uncertainty_s = 0.0  # it arrived within this many seconds before last_reply_at
        self._seen_at: Optional[float] = None  # when `ready` first saw the reply now waiting
        self._quiet_at = 0.0  # when the socket was last seen without a reply
        self.last_sent_at = 0.0  # perf_counter() when the last request left
        self.tap: Optional[Callable[[str, List[bytes]], None]] = None  # sees ("up" | "down", frames) of every message
        self._drops = 0  # connection drops the socket's events have shown
        self._welcome_due = False  # a Hello went out just before the request in flight (`send`): its reply comes first
        self._ctx = zmq.Context.instance()
        self._sock: Optional[zmq.Socket] = None

    def __enter__(self) -> "CloudClient":
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_socket(self) -> None:
        self.close()
        self._welcome_due = False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # a DEALER left with no connection to queue on (its handshake refused, or the link dropped) blocks a send
        # forever; bounded, the send fails like an unanswered request and the caller reconnects or degrades
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(1000 * self.link.connect_timeout_s)))
        sock.setsockopt(zmq.IDENTITY, f"{self.hello.device_id}-{uuid.uuid4().hex[:8]}".encode())
        security = self.link.security
        if security.curve:
            sock.curve_publickey, sock.curve_secretkey = load_secret(security.secret_key)
            sock.curve_serverkey = load_public(security.server_key)
        # ZMTP heartbeats: a link that stops carrying bytes is noticed within heartbeat_s instead of a request timeout
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(1000 * self.link.heartbeat_s / 3))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(1000 * self.link.heartbeat_s))
        self._handshake_events: List[int] = []
        self._established = False  # the ZMTP handshake (CurveZMQ and ZAP included) succeeded: the cloud is there
        self._handshaking = False  # TCP is connected and the handshake's outcome has not come back yet
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
                                                | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED)
        sock.connect(self.link.server)
        self._sock, self._seen_at = sock, None

    def _monitor_event(self) -> int:
        """Read one socket event; handshake failures are kept for `_handshake_failure`."""
        event = recv_monitor_message(self._monitor)["event"]
        self._drops += event == zmq.EVENT_DISCONNECTED
        if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            self._handshake_events.append(event)  # (no-detail failures are connections reset mid-handshake)
        self._established = (self._established or event == zmq.EVENT_HANDSHAKE_SUCCEEDED) and \
            event != zmq.EVENT_DISCONNECTED
        self._handshaking = event == zmq.EVENT_CONNECTED
        return event

    def _await_handshake(self) -> None:
        """After a drop, while a reconnection's handshake is in flight (TCP up, no outcome yet), wait for its outcome,
        at most connect_timeout_s: a refusal (a revoked key) travels back behind the cloud's decision, and a request
        sent meanwhile must learn it rather than call the link merely down. With no connection in progress (the
        cloud's host unreachable) it returns at once."""
        deadline = time.monotonic() + self.link.connect_timeout_s
        while self._handshaking and self._monitor is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._monitor.poll(int(1000 * left)):
                return
            self._monitor_event()

    def _dropped(self) -> bool:
        """Read the socket's waiting events; True when one says the connection dropped."""
        before = self._drops
        self._connected()
        return self._drops > before

    def _connected(self) -> bool:
        """The connection is up and accepted (events seen so far): a silent cloud is busy, not absent."""
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor_event()
        return self._established

    def _handshake_failure(self) -> Optional[str]:
        """Why the security handshake failed, if the socket monitor saw it fail."""
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor_event()
        if not self._handshake_events:
            return None
        if zmq.EVENT_HANDSHAKE_FAILED_AUTH in self._handshake_events:
            return ("the cloud refused this device's key: add its public key (NAME.key) to the cloud's allow-list "
                    "(hat-keys allow)")
        return ("the security handshake failed: the cloud and this device disagree on CurveZMQ (one side "
                "plaintext?) or on the cloud's public key")

    def connect(self) -> P.Welcome:
        """Handshake; raises CloudUnavailable after `retries` silent attempts, CloudError if refused."""
        link = self.link
        delay = link.backoff_s
        for attempt in range(1, link.connect_retries + 1):
            self._open_socket()
            try:
                try:
                    reply = self._roundtrip(self.hello, link.connect_timeout_s)
                except CloudUnavailable:
                    if not self._connected():
                        raise
                    # connected and accepted, yet no Welcome: a loaded cloud answers between its compute steps
                    reply = self._receive(link.request_timeout_s)
            except CloudUnavailable:
                failure = self._handshake_failure()
                if failure:
                    self.close()
                    raise CloudError(P.Error("unauthorized", failure)) from None
                if attempt == link.connect_retries:
                    break
                time.sleep(delay)
                delay *= 2
                continue
            if isinstance(reply, P.Error):
                self.close()
                raise CloudError(reply)
            if not isinstance(reply, P.Welcome):
                self.close()
                raise CloudError(P.Error("unexpected", f"expected Welcome, got {type(reply).__name__}"))
            if reply.protocol_version != P.PROTOCOL_VERSION:
                raise CloudError(P.Error("version", f"cloud speaks v{reply.protocol_version}"))
            self.welcome = reply
            try:
                self._probe_rtt()
            except LinkDown:  # dropped right after the Welcome: this attempt failed
                self.welcome = None
                if attempt == link.connect_retries:
                    break
                time.sleep(delay)
                delay *= 2
                continue
            return reply
        self.close()
        raise CloudUnavailable(
            f"no answer from the cloud at {self.link.server} after {link.connect_retries} attempts "
            f"({link.connect_timeout_s:.1f} s each): is `hat-cloud serve` running and reachable?"
        )

    def _probe_rtt(self) -> None:
        """RTT_PROBES tiny round trips on the open connection: the round-trip filter's first samples (`_sample_rtt`).

        The first Hello also paid for TCP and ZeroMQ's greeting, so it is not one of them.
        """
        self.rtt.clear()
        least = math.inf
        for _ in range(RTT_PROBES):
            t0 = time.perf_counter()
            reply = self._roundtrip(self.hello, self.link.request_timeout_s)  # (connected: a slow answer is a loaded
            # cloud; a probe given up on would leave its late reply to the next request)
            if isinstance(reply, P.Welcome):
                least = min(least, self.last_reply_at - t0 - (_seconds(reply.held_s) or 0.0))
        if not self.rtt.samples and 0 < least < math.inf:  # none was read as it arrived (a busy cloud, a busy
            self.rtt.observe(least, self.last_reply_at)  # host): the least of them, an upper bound, beats none

    @property
    def base_rtt_s(self) -> float:
        """The link's round trip now: the least of the recent exchanges' times on the wire (0 before any)."""
        return self.rtt.value

    def _sample_rtt(self, reply: P.Message) -> None:
        """An exchange whose frames are small both ways and whose reply was seen as it arrived is a round-trip sample:
        its wall time less the time the cloud says it held the request (`held_s`: its queueing and model time; from an
        older cloud, the model time it reports, so a loaded cloud's queueing stays in; replies without either: none).
        Others (a row or a state of kilobytes, a reply read late) would measure the link's rate or the device's work
        as well, and so would one that waited unseen in the cloud's socket while it computed (`unseen_s`, the reply
        says how long it may have: a loaded cloud's every request, so a loaded cloud leaves the estimate as it was)."""
        unseen = _seconds(getattr(reply, "unseen_s", 0.0))
        if (self.last_sent_bytes > RTT_SAMPLE_BYTES or self.last_reply_bytes > RTT_SAMPLE_BYTES
                or self.arrival_uncertainty_s > RTT_ARRIVAL_S or unseen is None or unseen > RTT_ARRIVAL_S):
            return
        held = _seconds(getattr(reply, "held_s", None))
        if not held and isinstance(reply, P.Closed):  # its compute_s is the whole session's: nothing to go by
            return
        if not held:
            held = 0.0 if isinstance(reply, NO_MODEL_WORK) else _seconds(getattr(reply, "compute_s", None))
        if held is None:
            return
        sample = self.last_reply_at - self.last_sent_at - held
        if sample > 0:
            self.rtt.observe(sample, self.last_reply_at)

    def request(self, msg: P.Message) -> P.Message:
        """Send one request and return its reply; CloudError for an Error reply, CloudUnavailable on timeout."""
        self.send(msg)
        return self.receive()

    def send(self, msg: P.Message) -> None:
        """First half of `request`: lets the device compute while the cloud works on the request."""
        if self._sock is None:
            raise CloudUnavailable("not connected: use the client as a context manager or call connect()")
        # a drop since the last exchange, while no reply was due, is not this request's failure: the socket
        # reconnected by itself, perhaps to a cloud that restarted and does not know this device, so it says Hello
        # again first (only a drop from now on may lose this request's reply)
        dropped = not isinstance(msg, P.Hello) and self._dropped()
        if dropped:
            self._await_handshake()
            failure = self._handshake_failure()
            if failure:  # it reconnected and the cloud refused it (a revoked key): say so at once
                raise CloudError(P.Error("unauthorized", failure))
            if not self._established:  # not back yet: the caller reconnects (or degrades) as after any drop
                raise self._lost(f"the connection to the cloud at {self.link.server} dropped and is not back")
        if not isinstance(msg, P.Hello) and dropped:
            self._rehello()  # a socket that reconnected: the cloud behind may be another, its Welcome first
        elif not isinstance(msg, P.Hello) and self._forgotten():
            # the Hello goes just ahead of the request, on the same trip (the cloud reads a connection's messages in
            # order): an idle device's request waited a whole round trip for the Welcome first, and under load a
            # Hello waits for the cloud's step in progress (0.5-0.9 s of auto's first token in the bench's load
            # phases, whose auto runtime sat a minute between its requests); `_receive` takes the Welcome
            self._put(P.encode(self.hello))
            self._welcome_due = True
        frames = P.encode(msg)
        self._put(frames)
        self.last_sent_at = time.perf_counter()
        self.last_sent_bytes = P.frame_bytes(frames)

    def _put(self, frames) -> None:
        """One message's frames onto the socket, counted and tapped."""
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise self._lost(f"the connection to the cloud at {self.link.server} could not take a message within "
                             f"{self.link.connect_timeout_s:.1f} s") from None
        self.counters.up_bytes += P.frame_bytes(frames)
        if self.tap is not None:
            self.tap("up", [bytes(f) for f in frames])

    def receive(self) -> P.Message:
        """Second half of `request`."""
        reply = self._receive(self.link.request_timeout_s)
        if isinstance(reply, P.Error):
            raise CloudError(reply)
        return reply

    def _lost(self, what: str) -> Exception:
        """The error for a connection that is gone: refused by the cloud when it reconnected (CloudError), dropped
        after the Welcome (LinkDown), or never up (CloudUnavailable)."""
        failure = self._handshake_failure()
        if failure:
            return CloudError(P.Error("unauthorized", failure))
        return LinkDown(what) if self.welcome is not None else CloudUnavailable(what)

    def _forgotten(self) -> bool:
        """True when this client has been silent long enough that the cloud may have dropped it (it forgets a peer
        with no session after `session_timeout_s`; half of it leaves room for clocks and queues)."""
        return (self.welcome is not None and self.last_sent_at > 0
                and time.perf_counter() - self.last_sent_at > 0.5 * self.welcome.session_timeout_s)

    def _rehello(self) -> None:
        """Say Hello again on the open connection before a request after a long silence."""
        reply = self._roundtrip(self.hello, self.link.request_timeout_s)
        if not isinstance(reply, P.Welcome):
            raise CloudError(reply if isinstance(reply, P.Error) else
                             P.Error("unexpected", f"expected Welcome, got {type(reply).__name__}"))
        self.welcome = reply

    def _roundtrip(self, msg: P.Message, timeout_s: float) -> P.Message:
        self.send(msg)
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> P.Message:
        """The next reply within timeout_s; when a Hello went just ahead of the request (`send`), its Welcome first:
        kept as the cloud's latest, and the request's reply read after it within what is left (one round trip,
        counted once). A refused Hello raises CloudError once the request's reply, which follows, is read too (so
        it is not taken for the next request's)."""
        deadline = time.monotonic() + timeout_s
        welcome_due, self._welcome_due = self._welcome_due, False
        reply = self._read(timeout_s)
        if not welcome_due:
            return reply
        self.counters.round_trips -= 1  # the Hello shared the request's trip
        self._seen_at = None  # the request's reply is stamped on its own arrival
        left = max(0.0, deadline - time.monotonic())
        if isinstance(reply, P.Welcome):
            self.welcome = reply
            return self._read(left)
        try:
            self._read(left)
        except (CloudUnavailable, LinkDown):
            pass
        raise CloudError(reply if isinstance(reply, P.Error) else
                         P.Error("unexpected", f"expected Welcome, got {type(reply).__name__}"))

    def _read(self, timeout_s: float) -> P.Message:
        self.ready()  # a reply already waiting arrived while the device did something else: stamped with that window
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
            if self._sock in ready:
                break
            if self._monitor is not None and self._monitor in ready:
                if self._monitor_event() == zmq.EVENT_DISCONNECTED and self.welcome is not None:
                    raise self._lost(f"the connection to the cloud at {self.link.server} dropped while a reply was due")
                continue
            raise CloudUnavailable(f"the cloud at {self.link.server} did not answer within {timeout_s:.1f} s")
        reply = [f.buffer for f in self._sock.recv_multipart(copy=False)]
        # a device busy drafting reads a reply late; the link estimates need its arrival, which `ready` saw
        if self._seen_at is None:  # the poll above woke as it arrived
            self.last_reply_at, self.arrival_uncertainty_s = time.perf_counter(), 0.0
        else:
            self.last_reply_at = self._seen_at
            self.arrival_uncertainty_s = self._seen_at - max(self._quiet_at, self.last_sent_at)
        self._seen_at = None
        self.last_reply_bytes = P.frame_bytes(reply)
        self.counters.down_bytes += self.last_reply_bytes
        self.counters.round_trips += 1
        if self.tap is not None:
            self.tap("down", [bytes(f) for f in reply])
        msg = P.decode(reply)
        self._sample_rtt(msg)
        return msg

    def ready(self, wait_s: float = 0.0) -> bool:
        """True when a reply is waiting (waits at most wait_s for one): lets the device work until the cloud answers.
        The first True stamps the reply's arrival (`last_reply_at` once it is read), so the time the device spends
        finishing its work does not count as time on the link; the time since the last look that saw nothing is the
        stamp's uncertainty (`arrival_uncertainty_s`)."""
        if self._seen_at is not None:
            return True
        waiting = bool(self._sock is not None and self._sock.poll(int(wait_s * 1000), zmq.POLLIN))
        now = time.perf_counter()
        if waiting:
            self._seen_at = now
            if wait_s > 0:  # the poll woke as it arrived
                self._quiet_at = now
        else:
            self._quiet_at = now
        return waiting

    def wait(self, seconds: float) -> None:
        """Sleep `seconds` while watching the socket, so that a reply arriving meanwhile is stamped when it arrives:
        the sleeps of an emulated slower board (hat_split.models.lm.board_time) are time a real board spends
        computing with its CPU free to notice the network."""
        if self._sock is None:
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while end - time.perf_counter() > 1e-3 and not self.ready(end - time.perf_counter()):
            pass
        left = end - time.perf_counter()
        if left > 0:
            time.sleep(left)

    @property
    def is_open(self) -> bool:
        """Whether the socket is open: a handshake that failed every attempt (`connect`) closes it."""
        return self._sock is not None

    def close(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
