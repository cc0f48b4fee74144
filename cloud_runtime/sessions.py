"""What the cloud keeps per device session, plain Python (no torch): the model's caches live in the runner, keyed by
the same (device identity, session id).

- `TargetSession` (`sd`, `hlm`, `llm`, ...): the target's state (hat_split.math.target_state: committed tokens,
  sampling, the cloud's random stream); the cache covers a prefix of the committed tokens, the runner says how much.
- `MiddleSession` (`hat`, `ushape`): the middle part's bookkeeping, nothing else. The cloud never sees a token: it
  holds hidden states' keys and values for `position` positions of the device's sequence (in this process, or spread
  over pipeline stages). Each `Hidden` request says where its states start (`position`); positions past it (the
  device's rejected drafts) are cropped first, then the new shallow states run through layers [start, stop) in a
  batched step with other sessions' work and the last `want` deep states go back.

Both keep what the uplink estimate (`Arrival.uplink_bps`) and the idle timer need.

`SessionTable` is the one owner of the open sessions: the handlers (cloud_runtime.token_handlers,
cloud_runtime.split_handlers), admission (cloud_runtime.quotas.Admission) and the server's loop add, replace and drop
them only through it, and it checks that a request continuing a session is in step with the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterable, List, Optional, Tuple, Union

from cloud_runtime.work import Key, ModelWork
from hat_split.math.target_state import TargetState
from hat_split.wire import messages as P

RATE_RESOLUTION_S = 1e-3  # scheduling noise of two processes' clocks: shorter uplink transfers are not resolved
ACTIVE_S = 2.0  # a device heard from (a request, an answer) this recently is still using the cloud: between two
# verifies it drafts, and its next request is on its way


@dataclass
class TargetSession:
    """The cloud's side of one token-family session (`sd`, `hlm`, `llm`, ...): the target's state (the committed
    tokens, its sampling parameters and random stream), what the device's quotas and the uplink estimate need, and the
    idle timer. Its cache lives in the work runner. The other end is the device's edge_runtime.sessions.token
    `TokenSession`; hat_split.models.target's `TargetSession` drives a target in process (the offline trainers)."""
    session_id: int
    protocol: str
    target: TargetState  # committed tokens, sampling parameters, the cloud's random stream
    device: Hashable = None  # the device it belongs to (cloud_runtime.quotas): its quotas and fair share
    step: int = 0  # last request step served
    last_active: float = field(default_factory=time.monotonic)  # monotonic time of the last answer or request
    compute_s: float = 0.0  # model time spent on this session (its share of each batched step), seconds
    link_rtt_s: float = 0.0  # the device's tiny-message round trip (OpenSession): baseline of the uplink estimate
    replied_at: float = 0.0  # perf_counter() when the last reply to this session left
    logprobs: Optional[int] = None  # k: replies carry the committed tokens' log-probabilities (OpenSession.logprobs)

    @property
    def tokens(self) -> List[int]:
        """The committed sequence: prompt + generated."""
        return self.target.tokens


@dataclass
class MiddleSession:
    session_id: int
    protocol: str
    hidden_format: str  # how deep states go back (hat_split.wire.hidden_codec)
    start: int  # the middle layers [start, stop)
    stop: int
    device: Hashable = None  # the device it belongs to (cloud_runtime.quotas): its quotas and fair share
    position: int = 0  # positions computed (the cache's length, wherever its layers live), as of the last reply
    step: int = 0  # last request step served
    last_active: float = field(default_factory=time.monotonic)  # monotonic time of the last answer or request
    compute_s: float = 0.0  # model time spent on this session (its share of each batched step), seconds
    link_rtt_s: float = 0.0  # the device's tiny-message round trip (OpenSplit): baseline of the uplink estimate
    replied_at: float = 0.0  # perf_counter() when the last reply to this session left
    tree_at: Optional[int] = None  # the position of the last draft tree's first state, until its path is kept


Session = Union[TargetSession, MiddleSession]


class SessionTable:
    """The open sessions by (device identity, session id); their caches live in the work runner, `work`."""

    def __init__(self, work: ModelWork):
        self.work = work
        self._open: Dict[Key, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, key: Key) -> bool:
        return key in self._open

    def get(self, key: Key) -> Optional[Session]:
        return self._open.get(key)

    def items(self) -> Iterable[Tuple[Key, Session]]:
        return self._open.items()

    def values(self) -> Iterable[Session]:
        return self._open.values()

    def put(self, key: Key, session: Session) -> None:
        """A session opened (its cache already is, in the runner)."""
        self._open[key] = session

    def forget(self, key: Key) -> None:
        """Drop a session whose cache is gone or about to be replaced (nothing happens for one not open)."""
        self._open.pop(key, None)

    def free(self, key: Key) -> None:
        """Close an open session: its cache and queued work in the runner, then the session."""
        self.work.close(key)
        del self._open[key]

    def clear(self) -> None:
        self._open.clear()

    def of_peer(self, identity: bytes) -> bool:
        """Whether a connection holds any session."""
        return any(k[0] == identity for k in self._open)

    def others_active(self, device: Hashable, now: Optional[float] = None) -> int:
        """Devices other than `device` using the cloud: a session heard from within `ACTIVE_S` seconds or with work
        queued. Steadier than the queue at one instant (a device drafting between verifies has nothing queued)."""
        now = time.monotonic() if now is None else now
        return len({s.device for k, s in self._open.items()
                    if s.device != device and (now - s.last_active <= ACTIVE_S or self.work.held(k)[1])})

    def idle(self, now: float, limit: float) -> List[Key]:
        """Sessions silent for over `limit` seconds at monotonic time `now` and with no request being computed."""
        return [k for k, s in self._open.items() if now - s.last_active > limit and not self.work.held(k)[1]]

    def continuing(self, identity: bytes, msg: Any, kind: type = TargetSession) -> Any:
        """The session a request continues, checked to be in step with the device."""
        key = (identity, msg.session_id)
        session = self._open.get(key)
        if session is None:
            raise P.ProtocolError("no_session", f"no open session {msg.session_id} (expired or never opened)")
        if not isinstance(session, kind):
            raise P.ProtocolError("invalid", f"session {msg.session_id} speaks {session.protocol!r}: "
                                  f"{type(msg).__name__} does not belong to it")
        if msg.step != session.step + 1:
            raise P.ProtocolError("desync", f"step {msg.step} out of order: the cloud expects {session.step + 1}")
        done, queued = self.work.held(key)
        if kind is MiddleSession:
            if msg.position > done + queued:
                raise P.ProtocolError("desync", f"device assumes position {msg.position}, the cloud holds "
                                      f"{done} positions and has {queued} queued")
        else:
            if msg.position != len(session.tokens):
                raise P.ProtocolError(
                    "desync", f"device assumes position {msg.position}, the cloud holds {len(session.tokens)} tokens")
            if queued:
                raise P.ProtocolError("busy_session", f"session {msg.session_id} still has a request being computed")
        session.last_active = time.monotonic()
        return session

    def not_computing(self, key: Key) -> None:
        """Refuse to close or replace a session while a request of it is being computed: closing drops its queued
        work, and that request would never be answered (a device reconnecting comes with a new identity)."""
        if key in self._open and self.work.held(key)[1]:
            raise P.ProtocolError("busy_session", f"session {key[1]} still has a request being computed")


@dataclass
class Arrival:
    """The request being handled: when it was taken off the socket and its size (the dispatcher,
    cloud_runtime.handlers, sets both before each handler runs)."""

    at: float = 0.0  # perf_counter() when it was taken off the socket
    size: int = 0  # its bytes
    unseen_s: float = 0.0  # it may have arrived this long before `at` (the cloud was computing, not reading)

    def stamp(self) -> Dict[str, float]:
        """When the request was read and how long before it may have arrived, for its Pending (work.Pending)."""
        return {"received_at": self.at, "unseen_s": self.unseen_s}

    def uplink_bps(self, session: Any, idle_s: float) -> float:
        """The uplink rate this request saw: its bits over the time it spent on the link.

        Time on the link = (arrival − the previous reply's departure) − the device's idle time in between − the
        device's tiny-message round trip (propagation both ways and the reply's own transfer). Exact for one device on
        an otherwise idle server; a request that queued behind other devices' compute reads as a slower link, and one
        that may have waited unseen in the socket for more than a quarter of that time (`unseen_s`) is not measured.
        A transfer quicker than RATE_RESOLUTION_S is counted as taking that long: the answer is then a lower bound
        (such a link is fast enough for any payload here). Returns 0 without a baseline (no link_rtt_s from the device).
        """
        if not session.replied_at or not session.link_rtt_s or not 0 <= idle_s < 1e6:
            return 0.0
        on_link = self.at - session.replied_at - idle_s - session.link_rtt_s
        if self.unseen_s > max(RATE_RESOLUTION_S, 0.25 * on_link):  # it waited in the socket for an unknown part
            return 0.0  # of that while the cloud computed: not measurable
        return 8.0 * self.size / max(on_link, RATE_RESOLUTION_S)
