"""The cloud's answer to each request: validate it, queue its model work, and build the reply once the work's rows
are back. Plain Python and numpy (no torch): the model is the runner's (cloud_runtime.batching over
cloud_runtime.runner, or cloud_runtime.cache_runner), reached only through `ModelWork`.

Every request is checked before anything changes (hat_split.wire.messages: ids in range, lengths, positions, steps);
anything wrong raises `ProtocolError`, which the server (cloud_runtime.server) answers with an `Error` naming the
problem. A request that needs the model is queued as work and answered later: the server's step hands back each
finished work with the numpy rows it asked for (a token work's logits of its last positions, a split work's last
deep states) and `finish` turns them into the reply. Token protocols (hat_split.protocols family "token") verify or
sample here with the session's own `TargetState`; split protocols (family "split") only carry states.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple

import msgspec
import numpy as np

from cloud_runtime.config import CloudConfig
from cloud_runtime.quotas import Holding, Quota, QuotaBook, QuotaExceeded, Usage, eviction_order
from cloud_runtime.sessions import MiddleSession, TokenSession
from hat_split.math.chunking import DelayModel, chunk_size
from hat_split.math.logprobs import MAX_TOP_LOGPROBS, Logprobs, concat, token_logprobs
from hat_split.math.sampling import SamplingParams
from hat_split.math.target_state import TargetState
from hat_split.protocols import NAMES as PROTOCOL_NAMES, of_family
from hat_split.wire import messages as P
from hat_split.wire.dist_codec import decode_dist
from hat_split.wire.hidden_codec import HIDDEN_FORMATS, bytes_per_position, decode_hidden, encode_hidden

log = logging.getLogger("hatspec.cloud")

TOKEN_PROTOCOLS = of_family("token")  # verified by the full target
SPLIT_PROTOCOLS = of_family("split")  # the cloud runs middle layers over hidden states (HAT)
SOFTWARE = "hatspec-cloud/0.1"
MEASURED = ("draft_s", "up_bps", "down_bps", "input_s", "adapter_s")  # a DeviceState's numbers
STATS_FIGURES = ("tokens_per_s", "ttft_p50_s", "tbt_p50_s", "acceptance", "watts")  # a DeviceStats' floats
RATE_RESOLUTION_S = 1e-3  # scheduling noise of two processes' clocks: shorter uplink transfers are not resolved

Key = Tuple[bytes, int]  # (device identity, session id)


@dataclass(frozen=True)
class ModelFacts:
    """What the handlers know of the target, read once from the loaded model."""

    name: str  # the model's name in the Welcome
    vocab_fingerprint: str  # hat_split.models.loading.vocab_fingerprint: a device's vocabulary must match it
    vocab_size: int  # token ids must be below this (the logits' width)
    layers: int  # decoder layers: a token session runs [0, layers)
    hidden_size: int  # width of the split protocols' states
    fingerprint: str = ""  # hat_split.models.partition.model_fingerprint: a device's parts must come from this model
    split_refusal: str = ""  # why the split protocols cannot run on this model; "" when they can


@dataclass
class ServerStats:
    requests: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    sessions_opened: int = 0
    sessions_expired: int = 0
    errors_by_code: Dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0  # loop time spent handling messages and computing steps (waiting on the socket excluded)
    heap_trims: int = 0  # times the C heap's free pages went back to the system (hat_split.heap)
    heap_trim_s: float = 0.0  # seconds those took, on the serving loop


@dataclass
class Pending:
    """A request whose model work is queued: what its reply needs once the work comes back."""

    identity: bytes
    msg: Any  # the request
    session: Any  # TokenSession or MiddleSession; its compute_s gets this work's share of each step
    uplink_bps: float = 0.0  # the rate the request's upload saw (Verdict, Deep)
    compute_s: float = 0.0  # compute time of the steps this request took part in
    draft: List[int] = field(default_factory=list)  # Verify: the drafts
    q: Optional[np.ndarray] = None  # Verify: the drafts' distributions `# [L, vocab]`
    generated: List[int] = field(default_factory=list)  # Generate: the tokens sampled so far
    logprobs: List[Logprobs] = field(default_factory=list)  # Generate: theirs, when the session asked


class ModelWork(Protocol):
    """The model side as the handlers use it (cloud_runtime.batching.Batcher, cloud_runtime.cache_runner.CacheRunner):
    sessions' caches by key, work queued with the rows it wants back. `submit_states` is only called for split
    sessions, which a model without `ModelFacts.split_refusal` alone opens (the Batcher)."""

    stages: int  # pipeline stages of the middle part

    def open(self, key: Hashable, start: int, stop: int, owner: Hashable = None) -> None: ...

    def close(self, key: Hashable) -> None: ...

    def held(self, key: Hashable) -> Tuple[int, int]: ...  # (positions computed, positions queued)

    def held_bytes(self, key: Hashable) -> int: ...  # bytes of KV cache a session holds (context and queued)

    def kv_cost(self, start: int, stop: int) -> int: ...  # bytes of KV cache per position of layers [start, stop)

    def crop(self, key: Hashable, length: int) -> None: ...

    def submit_tokens(self, key: Hashable, tokens: Sequence[int], logits: int, tag: Pending) -> None: ...

    def submit_states(self, key: Hashable, states: np.ndarray, want: int, tag: Pending) -> None: ...


class Handlers:
    """One method per request type; sessions, peers and devices are the server's tables, shared."""

    def __init__(self, config: CloudConfig, model: ModelFacts, work: ModelWork, load: DelayModel,
                 stats: ServerStats, sessions: Dict[Key, Any], peers: Dict[bytes, float], devices: Dict[bytes, dict],
                 quotas: Optional[QuotaBook] = None, kv_bytes: int = 0):
        """quotas: each device's quotas (default: none); kv_bytes: the cloud's KV memory, for fair shares."""
        self.config = config
        self.model = model
        self.work = work
        self.load = load  # HAT state monitoring of the batched steps (eq. 1-2), observed by the batcher
        self.stats = stats
        self.sessions = sessions  # (identity, session id) → TokenSession or MiddleSession
        self.peers = peers  # identity → monotonic time of its last message, for devices that said Hello
        self.devices = devices  # identity → HAT §3.2 state: device id, profile, power mode, γ, β
        self.quotas = quotas or QuotaBook(Quota())
        self.kv_bytes = kv_bytes
        self.users: Dict[bytes, str] = {}  # identity → the allow-list name it authenticated with (CurveZMQ)
        self.evicted = 0  # sessions evicted to make room
        self.limits = P.Limits(model.vocab_size, config.max_draft_len, config.max_context, config.max_generate)
        self._received_at = 0.0  # perf_counter() when the request being handled was taken off the socket
        self._request_bytes = 0  # its size
        self._handlers: Dict[type, Callable[[bytes, Any], Optional[P.Message]]] = {
            P.Hello: self._hello,
            P.OpenSession: self._open,
            P.Verify: self._verify,
            P.Generate: self._generate,
            P.CloseSession: self._close,
            P.OpenSplit: self._open_split,
            P.Hidden: self._hidden,
            P.Report: self._report,
        }
        self._finishers: Dict[type, Callable[[Pending, Optional[np.ndarray]], Optional[P.Message]]] = {
            P.OpenSession: self._opened,
            P.Verify: self._verdict,
            P.Generate: self._next_token,
            P.Hidden: self._deep,
        }

    def handle(self, identity: bytes, msg: Any, received_at: float, request_bytes: int,
               user: str = "") -> Optional[P.Message]:
        """The reply to one decoded request, or None when it is answered once its work is computed. `user`: the
        allow-list name the connection authenticated with (CurveZMQ), "" on a plaintext link."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise P.ProtocolError("unexpected", f"{type(msg).__name__} is not a request the cloud accepts")
        if type(msg) is not P.Hello and identity not in self.peers:
            raise P.ProtocolError("no_handshake", "send Hello before any other request")
        if user:
            self.users[identity] = user
        self._received_at, self._request_bytes = received_at, request_bytes
        reply = handler(identity, msg)
        self.peers[identity] = time.monotonic()  # after the handler: a refused Hello is no handshake
        return reply

    def finish(self, pending: Pending, rows: Optional[np.ndarray]) -> Optional[P.Message]:
        """The reply to a request whose work came back with `rows`, or None after queueing more work for it."""
        pending.session.last_active = time.monotonic()  # the device's silence counts from its answer
        return self._finishers[type(pending.msg)](pending, rows)

    def cloud_state(self) -> P.CloudState:
        return P.CloudState(self.load.mu or 0.0, self.load.g_mu(), self.work.stages)

    # -- handshake and device state -------------------------------------------------------------------------------
    def _hello(self, identity: bytes, msg: P.Hello) -> P.Message:
        if msg.vocab_fingerprint and msg.vocab_fingerprint != self.model.vocab_fingerprint:
            raise P.ProtocolError(
                "vocab_mismatch",
                f"device model {msg.model!r} has vocabulary {msg.vocab_fingerprint[:12]}, cloud model "
                f"{self.model.name!r} has {self.model.vocab_fingerprint[:12]}: they cannot generate together",
            )
        self.devices.setdefault(identity, {"device_id": msg.device_id, "model": msg.model})
        return P.Welcome(
            protocol_version=P.PROTOCOL_VERSION,
            model=self.model.name,
            vocab_size=self.model.vocab_size,
            vocab_fingerprint=self.model.vocab_fingerprint,
            session_timeout_s=self.config.session_timeout_s,
            max_draft_len=self.config.max_draft_len,
            max_context=self.config.max_context,
            protocols=list(TOKEN_PROTOCOLS + SPLIT_PROTOCOLS),
            software=SOFTWARE,
        )

    def _report(self, identity: bytes, msg: P.Report) -> P.Message:
        """A device's state (`_observe`) and, from an agent, what it served lately: kept as its latest `stats` (the
        fleet view, cloud_runtime.fleet), replacing the previous ones (a report without stats keeps those), with
        the time of the report (`report_at`, Unix time)."""
        if msg.stats is not None:
            check_stats(msg.stats)
        self._observe(identity, msg.device)
        entry = self.devices[identity]
        entry["report_at"] = time.time()
        if msg.stats is not None:
            entry["stats"] = msgspec.structs.asdict(msg.stats)  # plain values: the status file is JSON
        return P.Reported(self.cloud_state())

    def _observe(self, identity: bytes, state: P.DeviceState) -> None:
        """Keep a device's latest self-report (HAT §3.2); a changed power mode is logged. Refuses (before anything
        changes) rates and times that are negative or not finite."""
        bad = [k for k in MEASURED if not (math.isfinite(getattr(state, k)) and getattr(state, k) >= 0)]
        if bad:
            raise P.ProtocolError("invalid", f"the device's {', '.join(bad)} must be finite and >= 0")
        entry = self.devices.setdefault(identity, {"device_id": identity.decode(errors="replace")})
        if state.power_mode and entry.get("power_mode") not in (None, state.power_mode):
            log.info("device %s: power mode %s -> %s", entry["device_id"], entry["power_mode"], state.power_mode)
        for key in ("power_mode", "profile"):
            if getattr(state, key):
                entry[key] = getattr(state, key)
        for key in MEASURED:
            if getattr(state, key) > 0:
                entry[key] = getattr(state, key)
        entry["reported_at"] = time.time()

    # -- devices: quotas and room ---------------------------------------------------------------------------------
    def device_of(self, identity: bytes) -> Any:
        """Who quotas and fair shares count: the allow-list name the connection authenticated with, else (a plaintext
        link) the device id its Hello declared, else the connection."""
        return self.users.get(identity) or self.devices.get(identity, {}).get("device_id") or identity

    def usage(self, device: Any) -> Usage:
        """What a device holds now: sessions, their KV bytes, requests being computed, prompt tokens this minute."""
        u = Usage(prompt_tokens=self.quotas.prompt_tokens(device, time.monotonic()))
        for key, s in self.sessions.items():
            if s.device == device:
                u.sessions += 1
                u.kv_bytes += self.work.held_bytes(key)
                u.in_flight += bool(self.work.held(key)[1])
        return u

    def _charge(self, identity: bytes, key: Key, cost: int, positions: int, new_session: bool = False,
                prompt: int = 0) -> Any:
        """Refuse (ProtocolError "quota", naming the quota and the usage) a request that would take its device past a
        quota: a new session, `positions` more KV positions at `cost` bytes each, one more request being computed,
        `prompt` prompt tokens (spent with `_spend` once the work is queued). Returns the device."""
        device = self.device_of(identity)
        busy = key in self.sessions and bool(self.work.held(key)[1])
        try:
            self.quotas.check(device, self.usage(device), sessions=int(new_session), kv_bytes=cost * positions,
                              in_flight=int(positions > 0 and not busy), prompt_tokens=prompt)
        except QuotaExceeded as exc:
            raise P.ProtocolError("quota", str(exc)) from None
        return device

    def _spend(self, device: Any, prompt: int) -> None:
        """Count prompt tokens a device sent, once its work is queued."""
        self.quotas.spend_prompt(device, prompt, time.monotonic())

    def _with_room(self, identity: bytes, key: Key, fn: Callable[[], Any]) -> Any:
        """fn() (it opens a session or queues work); when the cloud is out of KV memory or sessions, evict idle
        sessions (cloud_runtime.quotas.eviction_order) one at a time and try again, until it fits or none is left."""
        while True:
            try:
                return fn()
            except P.ProtocolError as exc:
                if exc.code not in ("memory_full", "busy") or not self._evict_one(identity, key):
                    raise

    def _evict_one(self, identity: bytes, spare: Key) -> bool:
        """Close the first idle session eviction picks; its device reopens it from its own history when it next
        asks ("no_session"). False when none may go."""
        holdings = [Holding(k, s.device, self.work.held_bytes(k), not self.work.held(k)[1], s.last_active)
                    for k, s in self.sessions.items()]
        capacity = self.kv_bytes or sum(h.kv_bytes for h in holdings)
        order = eviction_order(holdings, capacity, self.device_of(identity), spare)
        if not order:
            return False
        victim = order[0]
        log.info("evicted session %s of device %s (idle, %d KV bytes) to make room for device %s", victim.key[1],
                 victim.device, victim.kv_bytes, self.device_of(identity))
        self.work.close(victim.key)
        del self.sessions[victim.key]
        self.evicted += 1
        return True

    # -- sessions -------------------------------------------------------------------------------------------------
    def _admit(self, identity: bytes, key: Key) -> None:
        def room() -> None:
            if key not in self.sessions and len(self.sessions) >= self.config.max_sessions:
                raise P.ProtocolError("busy", f"the cloud holds its limit of {self.config.max_sessions} sessions")
        self._with_room(identity, key, room)

    def _session(self, identity: bytes, msg: Any, kind: type = TokenSession) -> Any:
        """The session a request continues, checked to be in step with the device."""
        key = (identity, msg.session_id)
        session = self.sessions.get(key)
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

    def _not_computing(self, key: Key) -> None:
        """Refuse to close or replace a session while a request of it is being computed: closing drops its queued
        work, and that request would never be answered (a device reconnecting comes with a new identity)."""
        if key in self.sessions and self.work.held(key)[1]:
            raise P.ProtocolError("busy_session", f"session {key[1]} still has a request being computed")

    def _uplink_bps(self, session: Any, idle_s: float) -> float:
        """The uplink rate this request saw: its bits over the time it spent on the link.

        Time on the link = (arrival − the previous reply's departure) − the device's idle time in between − the
        device's tiny-message round trip (propagation both ways and the reply's own transfer). Exact for one device on
        an otherwise idle server; a request that queued behind other devices' compute reads as a slower link.
        A transfer quicker than RATE_RESOLUTION_S is counted as taking that long: the answer is then a lower bound
        (such a link is fast enough for any payload here). Returns 0 without a baseline (no link_rtt_s from the device).
        """
        if not session.replied_at or not session.link_rtt_s or not 0 <= idle_s < 1e6:
            return 0.0
        on_link = self._received_at - session.replied_at - idle_s - session.link_rtt_s
        return 8.0 * self._request_bytes / max(on_link, RATE_RESOLUTION_S)

    def _close(self, identity: bytes, msg: P.CloseSession) -> P.Message:
        """Everything is checked before anything changes: a refused CloseSession leaves the session intact."""
        key = (identity, msg.session_id)
        session = self.sessions.get(key)
        if session is None:
            raise P.ProtocolError("no_session", f"no open session {msg.session_id}")
        self._not_computing(key)
        if isinstance(session, MiddleSession):  # no tokens to digest: report the positions held
            self.work.close(key)
            del self.sessions[key]
            return P.Closed(msg.session_id, session.step, session.compute_s, session.position, 0)
        new: List[int] = []
        if msg.new_tokens is not None:  # the device's last skipped tokens: append (no compute) before the digest
            new = P.check_tokens(msg.new_tokens, "new_tokens", self.limits.vocab_size).tolist()
            if msg.position != len(session.tokens):
                raise P.ProtocolError(
                    "desync", f"device assumes position {msg.position}, the cloud holds {len(session.tokens)} tokens")
        tokens = session.tokens + new
        length = len(tokens) if msg.length is None else msg.length
        if length > len(tokens):
            raise P.ProtocolError("desync", f"device holds {length} tokens, the cloud only {len(tokens)}")
        session.target.tokens = tokens
        self.work.close(key)
        del self.sessions[key]
        return P.Closed(msg.session_id, session.step, session.compute_s, len(tokens),
                        P.sequence_digest(tokens[:length]))

    # -- token protocols ------------------------------------------------------------------------------------------
    def _open(self, identity: bytes, msg: P.OpenSession) -> Optional[P.Message]:
        if msg.protocol not in TOKEN_PROTOCOLS:
            raise P.ProtocolError("invalid", f"protocol {msg.protocol!r} is not served here; known: {TOKEN_PROTOCOLS}")
        prompt = P.check_tokens(msg.prompt, "prompt", self.limits.vocab_size, 1, self.limits.max_context)
        if msg.logprobs is not None and msg.logprobs > MAX_TOP_LOGPROBS:
            raise P.ProtocolError("invalid", f"logprobs asks for {msg.logprobs} alternatives per token; at most "
                                             f"{MAX_TOP_LOGPROBS}")
        try:
            params = SamplingParams(msg.sampling.temperature, msg.sampling.top_k, msg.sampling.top_p)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"sampling: {exc}") from None
        key = (identity, msg.session_id)
        self._not_computing(key)
        self._observe(identity, msg.device)
        cost = self.work.kv_cost(0, self.model.layers)
        device = self._charge(identity, key, cost, len(prompt) - 1, key not in self.sessions, len(prompt))
        self._admit(identity, key)
        self.sessions.pop(key, None)  # reopening an id replaces the old session (which may have been a split one)
        self._with_room(identity, key, lambda: self.work.open(key, 0, self.model.layers, device))
        session = TokenSession(msg.session_id, msg.protocol, TargetState(params, msg.seed, prompt.tolist()),
                               device)
        session.link_rtt_s = max(0.0, float(msg.link_rtt_s))
        session.logprobs = msg.logprobs
        self.sessions[key] = session
        self.stats.sessions_opened += 1
        if len(session.tokens) == 1:  # the last prompt token is fed with the first drafts: nothing to prefill
            return P.SessionOpened(msg.session_id, 1, 0.0)
        self._with_room(identity, key, lambda: self.work.submit_tokens(key, session.tokens[:-1], 0,
                                                                       Pending(identity, msg, session)))
        self._spend(device, len(prompt))
        return None

    def _opened(self, p: Pending, _: None) -> P.Message:
        return P.SessionOpened(p.msg.session_id, len(p.session.tokens), p.compute_s)

    def _verify(self, identity: bytes, msg: P.Verify) -> Optional[P.Message]:
        session = self._session(identity, msg)
        lim = self.limits
        new = P.check_tokens(msg.new_tokens, "new_tokens", lim.vocab_size)
        draft = P.check_tokens(msg.draft, "draft", lim.vocab_size, 1, lim.max_draft_len)
        L = draft.shape[0]
        if len(session.tokens) + new.shape[0] + L + 1 > lim.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={lim.max_context} tokens")
        try:
            q = decode_dist(msg.dist, L, lim.vocab_size)  # [L, vocab]
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"dist: {exc}") from None
        if np.any(q[np.arange(L), draft] <= 0):
            raise P.ProtocolError("invalid", "a draft token has zero probability under the distribution sent with it")
        key, drafts = (identity, msg.session_id), draft.tolist()
        feed = session.tokens[self.work.held(key)[0]:] + new.tolist() + drafts
        self._charge(identity, key, self.work.kv_cost(0, self.model.layers), len(feed))
        pending = Pending(identity, msg, session, self._uplink_bps(session, msg.idle_s), draft=drafts, q=q)
        self._with_room(identity, key, lambda: self.work.submit_tokens(key, feed, L + 1, pending))
        session.tokens.extend(new.tolist())  # committed once the work is queued (a refusal changes nothing)
        session.step = msg.step
        return None

    def _verdict(self, p: Pending, logits: np.ndarray) -> P.Message:
        """Verify the drafts against the target's logits `# [L + 1, vocab]`; the cache keeps the accepted ones."""
        session, msg = p.session, p.msg
        n, token, keep = session.target.accept(p.draft, p.q, logits)
        self.work.crop((p.identity, msg.session_id), keep)  # drop the rejected tail
        lp = None if session.logprobs is None else token_logprobs(logits[:n + 1], p.draft[:n] + [token],
                                                                  session.logprobs)
        return P.Verdict(msg.session_id, msg.step, n, token, len(session.tokens), p.compute_s, p.uplink_bps,
                         _wire(lp))

    def _generate(self, identity: bytes, msg: P.Generate) -> Optional[P.Message]:
        session = self._session(identity, msg)
        lim = self.limits
        new = P.check_tokens(msg.new_tokens, "new_tokens", lim.vocab_size)
        if msg.n > lim.max_generate:
            raise P.ProtocolError("invalid", f"n={msg.n} exceeds max_generate={lim.max_generate}")
        if len(session.tokens) + new.shape[0] + msg.n > lim.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={lim.max_context} tokens")
        if msg.n < 1:  # nothing to compute: commit and answer
            session.tokens.extend(new.tolist())
            session.step = msg.step
            return P.Generated(msg.session_id, msg.step, np.zeros(0, np.int32), len(session.tokens), 0.0)
        key = (identity, msg.session_id)
        feed = session.tokens[self.work.held(key)[0]:] + new.tolist()
        self._charge(identity, key, self.work.kv_cost(0, self.model.layers), len(feed) + msg.n)
        self._with_room(identity, key, lambda: self.work.submit_tokens(key, feed, 1, Pending(identity, msg, session)))
        session.tokens.extend(new.tolist())
        session.step = msg.step
        return None

    def _next_token(self, p: Pending, logits: np.ndarray) -> Optional[P.Message]:
        """Sample the next token from logits `# [1, vocab]`; one token per step, like any decoding device."""
        p.generated.append(p.session.target.sample_next(logits))
        if p.session.logprobs is not None:
            p.logprobs.append(token_logprobs(logits[-1:], p.generated[-1:], p.session.logprobs))
        msg = p.msg
        if len(p.generated) < msg.n:  # the request's next position (its quota was charged for all n at once)
            key = (p.identity, msg.session_id)
            self._with_room(p.identity, key, lambda: self.work.submit_tokens(key, p.generated[-1:], 1, p))
            return None
        return P.Generated(msg.session_id, msg.step, np.asarray(p.generated, np.int32), len(p.session.tokens),
                           p.compute_s, _wire(concat(p.logprobs) if p.logprobs else None))

    # -- split protocols (HAT) ------------------------------------------------------------------------------------
    def _open_split(self, identity: bytes, msg: P.OpenSplit) -> P.Message:
        if msg.protocol not in SPLIT_PROTOCOLS:
            raise P.ProtocolError("invalid", f"OpenSplit is for {SPLIT_PROTOCOLS}, not {msg.protocol!r}")
        model = self.model
        if model.split_refusal:
            raise P.ProtocolError("invalid", model.split_refusal)
        if msg.fingerprint != model.fingerprint:
            raise P.ProtocolError("model_mismatch", f"the device's parts come from another model (fingerprint "
                                  f"{msg.fingerprint[:12]}) than the cloud's {model.name!r} "
                                  f"({model.fingerprint[:12]})")
        if not 1 <= msg.start < msg.stop <= model.layers:
            raise P.ProtocolError("invalid", f"middle layers [{msg.start}, {msg.stop}) must satisfy 1 <= start < stop "
                                  f"<= {model.layers}: the device keeps at least one layer (embeddings alone reveal "
                                  "the tokens)")
        if msg.hidden_format not in HIDDEN_FORMATS:
            raise P.ProtocolError("invalid", f"hidden_format must be one of {HIDDEN_FORMATS}")
        key = (identity, msg.session_id)
        self._not_computing(key)
        self._observe(identity, msg.device)
        device = self._charge(identity, key, 0, 0, key not in self.sessions)
        self._admit(identity, key)
        session = MiddleSession(msg.session_id, msg.protocol, msg.hidden_format, msg.start, msg.stop, device)
        session.link_rtt_s = max(0.0, float(msg.link_rtt_s))
        self._with_room(identity, key, lambda: self.work.open(key, msg.start, msg.stop, device))
        self.sessions[key] = session
        self.stats.sessions_opened += 1
        chunk = 0
        if self.load.known and msg.device.up_bps > 0 and msg.prompt_tokens > 0:
            chunk = chunk_size(self.load, bytes_per_position(msg.hidden_format, model.hidden_size),
                               msg.device.up_bps, 1, msg.prompt_tokens, msg.device.input_s, msg.device.adapter_s)
        return P.SplitOpened(msg.session_id, model.hidden_size, chunk, self.cloud_state())

    def _hidden(self, identity: bytes, msg: P.Hidden) -> Optional[P.Message]:
        session = self._session(identity, msg, MiddleSession)
        states = msg.states.values
        if not isinstance(states, np.ndarray) or states.ndim != 2 or states.shape[0] < 1:
            raise P.ProtocolError("invalid", "states must hold [n >= 1, hidden] values")
        n = states.shape[0]
        try:
            x = decode_hidden(msg.states, n, self.model.hidden_size)  # [n, hidden] float32
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"states: {exc}") from None
        if msg.want > n:
            raise P.ProtocolError("invalid", f"want={msg.want} exceeds the {n} states sent")
        if msg.position + n > self.limits.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={self.limits.max_context} positions")
        key = (identity, msg.session_id)
        done, queued = self.work.held(key)
        if msg.position < done + queued:  # the device rolled back (rejected drafts): only with nothing queued
            if queued:
                raise P.ProtocolError("desync", f"position {msg.position} would roll back while {queued} positions "
                                      "are still queued")
            self.work.crop(key, msg.position)
            session.position = msg.position
        prompt = n if n > self.config.max_draft_len + 1 else 0  # a prompt chunk, not a decode / verify
        device = self._charge(identity, key, self.work.kv_cost(session.start, session.stop), n, prompt=prompt)
        pending = Pending(identity, msg, session, self._uplink_bps(session, msg.idle_s))
        self._with_room(identity, key, lambda: self.work.submit_states(key, x, msg.want, pending))
        self._spend(device, prompt)
        session.step = msg.step
        return None

    def _deep(self, p: Pending, deep: Optional[np.ndarray]) -> P.Message:
        """Deep states `# [want, hidden]` (None: none wanted) back to the device."""
        session, msg = p.session, p.msg
        out = encode_hidden(deep, session.hidden_format) if deep is not None else None
        session.position = self.work.held((p.identity, msg.session_id))[0]
        return P.Deep(msg.session_id, msg.step, session.position, out, p.compute_s, p.uplink_bps, self.cloud_state())


def check_stats(stats: P.DeviceStats) -> None:
    """Refuse (ProtocolError "invalid") a device's stats whose figures are not finite, whose protocols are not known
    ones ("unknown": a name the agent did not know) or do not add up to its requests."""
    bad = [k for k in STATS_FIGURES if getattr(stats, k) is not None and not math.isfinite(getattr(stats, k))]
    if bad:
        raise P.ProtocolError("invalid", f"the device's stats {', '.join(bad)} must be finite")
    unknown = sorted(set(stats.protocols) - set(PROTOCOL_NAMES) - {"unknown"})
    if unknown:
        raise P.ProtocolError("invalid", f"the device's stats count unknown protocols {unknown}")
    if sum(stats.protocols.values()) != stats.requests:
        raise P.ProtocolError("invalid", f"the device's stats count {stats.requests} requests but "
                              f"{sum(stats.protocols.values())} by protocol")


def _wire(lp: Optional[Logprobs]) -> Optional[P.TokenLogprobs]:
    """Committed tokens' log-probabilities as a reply carries them (None: the session did not ask)."""
    return None if lp is None else P.TokenLogprobs(lp.values, lp.top_ids, lp.top_values)
