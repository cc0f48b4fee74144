"""The cloud's ZeroMQ ROUTER server: one loop, many devices, one session per device request.

Every request is decoded and validated before any compute (hat_split.wire.messages); anything wrong is answered with an
`Error` naming the problem and the loop carries on with the next message. Valid model work is queued, not computed
on arrival: the loop drains every waiting message, then runs one batched step of many sessions' work
(cloud_runtime.batching: token protocols' tokens through every layer, split protocols' hidden states through the
middle ones; in this process or pipeline stages) and answers the requests it finished. Sessions keep their KV caches
between rounds and are dropped after `session_timeout_s` of silence, freeing their memory. A model whose layout the
partition does not know (hat_split.models.partition.check_family) serves token protocols one request at a time instead.

Flow control is request/response: a device has at most one request in flight, so the ROUTER never queues more than
one reply per device. ROUTER_MANDATORY makes a reply to a vanished device fail loudly (it is then dropped) rather
than silently.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import zmq

from cloud_runtime.batching import Batcher, Pending
from cloud_runtime.config import CloudConfig
from cloud_runtime.runner import LocalExecutor
from cloud_runtime.scheduler import SchedulerConfig
from hat_split.models.target import TargetSession
from cloud_runtime.split_session import MiddleSession
from hat_split.wire import messages as P
from hat_split.math.chunking import DelayModel, chunk_size
from hat_split.wire.dist_codec import decode_dist
from hat_split.wire.hidden_codec import HIDDEN_FORMATS, bytes_per_position, decode_hidden, encode_hidden
from hat_split.models.lm import CausalLM
from hat_split.models.partition import check_family, embed, head_logits, model_fingerprint
from hat_split.math.sampling import SamplingParams

log = logging.getLogger("hatspec.cloud")

TOKEN_PROTOCOLS = ("sd", "hlm", "llm", "uhlm", "randhlm", "cuhlm", "qs", "ksqs", "csqs", "sq")  # verified by the full target
SPLIT_PROTOCOLS = ("hat", "ushape")  # the cloud runs middle layers over hidden states (HAT)
SOFTWARE = "hatspec-cloud/0.1"
RATE_RESOLUTION_S = 1e-3  # scheduling noise of two processes' clocks: shorter uplink transfers are not resolved


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
    head_s: float = 0.0  # model time outside the batched steps: token protocols' embeddings, final norm and head


class CloudServer:
    """Serves token-protocol sessions for many devices over one ROUTER socket."""

    def __init__(self, config: CloudConfig, lm: CausalLM, model_name: str, vocab_fingerprint: str,
                 executor: Any = None):
        """executor: where the split protocols' middle layers run (cloud_runtime.runner.LocalExecutor by default,
        cloud_runtime.pipeline.PipelineExecutor for pipeline stages)."""
        self.config = config
        self.lm = lm
        self.model_name = model_name
        self.vocab_fingerprint = vocab_fingerprint
        self.limits = P.Limits(lm.vocab_size, config.max_draft_len, config.max_context, config.max_generate)
        self.sessions: Dict[Tuple[bytes, int], Any] = {}  # TargetSession or MiddleSession
        self.load = DelayModel()  # HAT state monitoring of the middle part's steps (eq. 1-2)
        model = getattr(lm, "model", None)  # None: a model without layers (tests' Markov chains)
        try:  # the batched steps need a model whose layout is known; token protocols then run in them too
            check_family(model)
            self._batched_tokens = True
        except ValueError:
            self._batched_tokens = False
        executor = LocalExecutor(model if self._batched_tokens else None) if executor is None else executor
        self.batcher = Batcher(SchedulerConfig(config.token_budget, config.prefill_floor, config.kv_positions,
                                                     config.max_context, config.max_sessions, executor.depth),
                                     executor, self.load, config.max_draft_len + 1)
        self._fingerprint = ""  # model_fingerprint of the loaded model, computed on the first OpenSplit
        self.peers: Dict[bytes, float] = {}  # identity → last message time, for devices that said Hello
        self.zap = None  # cloud_runtime.zap.ZapAllowList when the link is CurveZMQ
        self._status_at = -1e9  # monotonic time of the last status file
        self.devices: Dict[bytes, dict] = {}  # identity → HAT §3.2 state: device id, profile, power mode, γ, β
        self.stats = ServerStats()
        self._ctx = zmq.Context.instance()
        self._sock: Optional[zmq.Socket] = None
        self._running = False
        self._received_at = 0.0  # perf_counter() when the request being handled was taken off the socket
        self._request_bytes = 0  # its size
        self._handlers: Dict[type, Callable[[bytes, Any], P.Message]] = {
            P.Hello: self._hello,
            P.OpenSession: self._open,
            P.Verify: self._verify,
            P.Generate: self._generate,
            P.CloseSession: self._close,
            P.OpenSplit: self._open_split,
            P.Hidden: self._hidden,
            P.Report: self._report,
        }

    # -- lifetime -------------------------------------------------------------------------------------------------
    def __enter__(self) -> "CloudServer":
        sock = self._ctx.socket(zmq.ROUTER)
        security = self.config.security
        if security.curve:  # CurveZMQ: encrypted, and only devices in the allow-list get through (ZAP)
            from cloud_runtime.zap import DOMAIN, ZapAllowList
            from hat_split.net.security import load_secret

            public, secret = load_secret(security.secret_key)
            self.zap = ZapAllowList(self._ctx, security.allow_dir)
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.zap_domain = DOMAIN.encode()
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops a peer whose single frame exceeds this; the application check answers smaller excess.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.bind(self.config.bind)
        self._sock = sock
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self.zap is not None:
            self.zap.close()
            self.zap = None
        self.sessions.clear()
        self.batcher.executor.close()

    @property
    def endpoint(self) -> str:
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def stop(self) -> None:
        self._running = False

    def serve_forever(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Serve until stop() is called or `until()` returns True (checked every poll_ms)."""
        self._running = True
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        wake = getattr(self.batcher.executor, "wake_socket", None)  # readable when a pipeline batch is back
        if wake is not None:
            poller.register(wake, zmq.POLLIN)
        last_sweep = time.monotonic()
        while self._running and not (until and until()):
            # launchable work: do not wait; batches in pipeline stages: until one is back (wake socket) or, without
            # one, look again soon; idle: wake to expire sessions
            waiting = self.batcher.busy and wake is None
            wait_ms = 0 if self.batcher.can_launch else 1 if waiting else self.config.poll_ms
            ready = any(sock is self._sock for sock, _ in poller.poll(wait_ms))
            t0, work = time.perf_counter(), (self.batcher.stats.steps, self.batcher.engine.launches)
            if ready:
                self.drain()
            self.step()
            if ready or (self.batcher.stats.steps, self.batcher.engine.launches) != work:
                self.stats.busy_s += time.perf_counter() - t0
            now = time.monotonic()
            if now - last_sweep >= 1.0:
                self.expire_idle(now)
                last_sweep = now
                if self.config.status_file and now - self._status_at >= self.config.status_interval_s:
                    self.write_status()
                    self._status_at = now

    def report(self) -> dict:
        """Counters of the server and of its batched steps (`hat-cloud serve --stats-json`)."""
        import dataclasses

        b = self.batcher.stats
        own = (b.stage_s[0] if b.stage_s else 0.0) + self.stats.head_s  # this process's model time (a pipeline: stage 0's)
        return {"server": dataclasses.asdict(self.stats), "stages": self.batcher.executor.stages,
                "sessions": {"open": len(self.sessions), "kv_positions": self.batcher.scheduler.kv_used},
                "steps": dataclasses.asdict(b), "devices": list(self.devices.values()),
                "security": {"mode": self.config.security.mode, **({"accepted": self.zap.accepted,
                                                                     "refused": self.zap.refused} if self.zap else {})},
                "overhead": 1.0 - own / self.stats.busy_s if self.stats.busy_s > 0 and b.steps else None}

    def write_status(self) -> None:
        """The report, written atomically to config.status_file (a reader never sees half a file)."""
        from hat_split.files.atomic import write_json

        write_json(self.config.status_file,
                   {"time": time.time(), "model": self.model_name, "endpoint": self.endpoint, **self.report()})

    def drain(self) -> None:
        """Handle every message already waiting, so that one batched step sees all of them."""
        while True:
            try:
                raw = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle_one(raw)

    def step(self) -> None:
        """Launch and collect batched steps of every session's queued work; sends the replies of what finished."""
        try:
            replies, dropped = self.batcher.step()
        except Exception:  # a bug here must not take the server down; the batch's devices time out and retry
            log.exception("batched step failed")
            return
        for key in dropped:
            self.sessions.pop(key, None)
        for identity, reply in replies:
            if isinstance(reply, P.Error):
                reply = self._error(reply.code, reply.message, reply)
            self._send(identity, reply, reply)

    # -- one message ----------------------------------------------------------------------------------------------
    def handle_one(self, raw: List[Any]) -> None:
        """Decode, validate and answer one request; a split protocol's Hidden is answered later by `step`."""
        frames = [f.buffer if hasattr(f, "buffer") else f for f in raw]
        identity, body = P.split_envelope(frames)
        self._received_at = time.perf_counter()
        self._request_bytes = P.frame_bytes(body)
        self.stats.requests += 1
        self.stats.bytes_in += self._request_bytes
        msg: Any = None
        try:
            msg = P.decode(body, self.config.max_message_bytes)
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise P.ProtocolError("unexpected", f"{type(msg).__name__} is not a request the cloud accepts")
            if type(msg) is not P.Hello and identity not in self.peers:
                raise P.ProtocolError("no_handshake", "send Hello before any other request")
            self.peers[identity] = time.monotonic()
            reply = handler(identity, msg)
        except P.ProtocolError as exc:
            reply = self._error(exc.code, exc.message, msg)
        except Exception as exc:  # a bug or a compute failure must not take the server down
            log.exception("internal error while serving %s", type(msg).__name__)
            reply = self._error("internal", f"{type(exc).__name__}: {exc}", msg)
        if reply is not None:
            self._send(identity, reply, msg)

    def _send(self, identity: bytes, reply: P.Message, msg: Any) -> None:
        out = P.encode(reply)
        self.stats.bytes_out += P.frame_bytes(out)
        try:
            self._sock.send_multipart([identity, *out], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the device went away before its answer
            log.warning("dropping reply to vanished peer %r: %s", identity, exc)
        session = self.sessions.get((identity, getattr(msg, "session_id", None)))
        if session is not None:
            session.replied_at = time.perf_counter()

    def _error(self, code: str, message: str, msg: Any) -> P.Error:
        self.stats.errors += 1
        self.stats.errors_by_code[code] = self.stats.errors_by_code.get(code, 0) + 1
        log.info("error %s: %s", code, message)
        return P.Error(code, message, getattr(msg, "session_id", None), getattr(msg, "step", None))

    def _working(self, key: Tuple[bytes, int]) -> bool:
        """The session has a request queued or being computed (it is waiting on the cloud, not idle)."""
        return key in self.batcher.scheduler.sessions and self.batcher.held(key)[1] > 0

    def expire_idle(self, now: float) -> None:
        """Free sessions silent for session_timeout_s since their last reply (never one the cloud still owes an
        answer: under load a request can wait longer than the timeout), and forget peers with no session left."""
        limit = self.config.session_timeout_s
        for key in [k for k, s in self.sessions.items() if now - s.last_active > limit and not self._working(k)]:
            log.info("session %s of %r idle for over %.0f s: freed", key[1], key[0], limit)
            del self.sessions[key]
            self.batcher.close(key)
            self.stats.sessions_expired += 1
        for peer in [p for p, t in self.peers.items() if now - t > limit]:
            if not any(k[0] == peer for k in self.sessions):
                del self.peers[peer]
                self.devices.pop(peer, None)

    # -- handlers ---------------------------------------------------------------------------------------------------
    def _hello(self, identity: bytes, msg: P.Hello) -> P.Message:
        if msg.vocab_fingerprint and msg.vocab_fingerprint != self.vocab_fingerprint:
            raise P.ProtocolError(
                "vocab_mismatch",
                f"device model {msg.model!r} has vocabulary {msg.vocab_fingerprint[:12]}, cloud model "
                f"{self.model_name!r} has {self.vocab_fingerprint[:12]}: they cannot generate together",
            )
        self.peers[identity] = time.monotonic()
        self.devices.setdefault(identity, {"device_id": msg.device_id, "model": msg.model})
        return P.Welcome(
            protocol_version=P.PROTOCOL_VERSION,
            model=self.model_name,
            vocab_size=self.lm.vocab_size,
            vocab_fingerprint=self.vocab_fingerprint,
            session_timeout_s=self.config.session_timeout_s,
            max_draft_len=self.config.max_draft_len,
            max_context=self.config.max_context,
            protocols=list(TOKEN_PROTOCOLS + SPLIT_PROTOCOLS),
            software=SOFTWARE,
        )

    def _open(self, identity: bytes, msg: P.OpenSession) -> P.Message:
        if msg.protocol not in TOKEN_PROTOCOLS:
            raise P.ProtocolError("invalid", f"protocol {msg.protocol!r} is not served here; known: {TOKEN_PROTOCOLS}")
        prompt = P.check_tokens(msg.prompt, "prompt", self.limits.vocab_size, 1, self.limits.max_context)
        try:
            params = SamplingParams(msg.sampling.temperature, msg.sampling.top_k, msg.sampling.top_p)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"sampling: {exc}") from None
        key = (identity, msg.session_id)
        if key not in self.sessions and len(self.sessions) >= self.config.max_sessions:
            raise P.ProtocolError("busy", f"the cloud holds its limit of {self.config.max_sessions} sessions")
        self.sessions.pop(key, None)
        self.batcher.close(key)  # the id may have been a split session
        session = TargetSession(self.lm, msg.session_id, msg.protocol, params, msg.seed, prompt.tolist())
        session.link_rtt_s = max(0.0, float(msg.link_rtt_s))
        self._observe(identity, msg.device)
        if self._batched_tokens:
            self.batcher.open(key, 0, self.lm.model.config.num_hidden_layers)
        self.sessions[key] = session  # reopening an id replaces the old session
        self.stats.sessions_opened += 1
        opened = lambda compute_s: P.SessionOpened(msg.session_id, len(session.tokens), compute_s)  # noqa: E731
        if not self._batched_tokens:
            session.prefill()
            return opened(session.compute_s)
        if len(session.tokens) == 1:  # the last prompt token is fed with the first drafts: nothing to prefill
            return opened(0.0)
        self._queue_tokens(key, session.tokens[:-1], Pending(identity, msg, session, lambda out, p: opened(p.compute_s)))
        return None

    def _queue_tokens(self, key: Tuple[bytes, int], tokens: List[int], pending: Pending) -> None:
        """Queue `tokens` of a token-protocol session for the batched steps (their embeddings through every layer);
        `pending.finish(final hidden states, pending)` answers."""
        t0 = time.perf_counter()
        states = embed(self.lm.model, tokens)
        self.stats.head_s += time.perf_counter() - t0
        self.batcher.submit(key, states, pending)

    def _logits(self, out: Any, n: int, pending: Pending) -> np.ndarray:
        """Float32 logits `# [n, vocab]` of the last n positions of final hidden states; head time counts as compute."""
        t0 = time.perf_counter()
        logits = head_logits(self.lm.model, out[:, out.shape[1] - n:])[0].numpy()
        dt = time.perf_counter() - t0
        self.stats.head_s += dt
        pending.compute_s += dt
        pending.session.compute_s += dt
        return logits

    def _session(self, identity: bytes, msg: Any, kind: type = TargetSession) -> Any:
        session = self.sessions.get((identity, msg.session_id))
        if session is None:
            raise P.ProtocolError("no_session", f"no open session {msg.session_id} (expired or never opened)")
        if not isinstance(session, kind):
            raise P.ProtocolError("invalid", f"session {msg.session_id} speaks {session.protocol!r}: "
                                  f"{type(msg).__name__} does not belong to it")
        if msg.step != session.step + 1:
            raise P.ProtocolError("desync", f"step {msg.step} out of order: the cloud expects {session.step + 1}")
        if kind is MiddleSession:
            done, queued = self.batcher.held((identity, msg.session_id))
            if msg.position > done + queued:
                raise P.ProtocolError("desync", f"device assumes position {msg.position}, the cloud holds "
                                      f"{done} positions and has {queued} queued")
        else:
            if msg.position != len(session.tokens):
                raise P.ProtocolError(
                    "desync", f"device assumes position {msg.position}, the cloud holds {len(session.tokens)} tokens")
            if self._batched_tokens and self.batcher.held((identity, msg.session_id))[1]:
                raise P.ProtocolError("busy_session", f"session {msg.session_id} still has a request being computed")
        session.last_active = time.monotonic()
        return session

    def _verify(self, identity: bytes, msg: P.Verify) -> P.Message:
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
        uplink_bps = self._uplink_bps(session, msg.idle_s)
        compute0 = session.compute_s
        if not self._batched_tokens:
            n, token = session.verify(new.tolist(), draft.tolist(), q)
            session.step = msg.step
            return P.Verdict(msg.session_id, msg.step, n, token, len(session.tokens), session.compute_s - compute0,
                             uplink_bps)
        key, drafts = (identity, msg.session_id), draft.tolist()
        feed = session.tokens[self.batcher.held(key)[0]:] + new.tolist() + drafts

        def finish(out: Any, p: Pending) -> P.Message:
            n, token, keep = session.accept(drafts, q, self._logits(out, L + 1, p))
            self.batcher.crop(key, keep)  # keep the accepted drafts, drop the rejected tail
            return P.Verdict(msg.session_id, msg.step, n, token, len(session.tokens), p.compute_s, p.uplink_bps)

        self._queue_tokens(key, feed, Pending(identity, msg, session, finish, uplink_bps))
        session.tokens.extend(new.tolist())  # committed once the work is queued (a refusal changes nothing)
        session.step = msg.step
        return None

    def _uplink_bps(self, session: TargetSession, idle_s: float) -> float:
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

    def _generate(self, identity: bytes, msg: P.Generate) -> P.Message:
        session = self._session(identity, msg)
        lim = self.limits
        new = P.check_tokens(msg.new_tokens, "new_tokens", lim.vocab_size)
        if msg.n > lim.max_generate:
            raise P.ProtocolError("invalid", f"n={msg.n} exceeds max_generate={lim.max_generate}")
        if len(session.tokens) + new.shape[0] + msg.n > lim.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={lim.max_context} tokens")
        compute0 = session.compute_s
        if not self._batched_tokens or msg.n < 1:
            tokens = session.generate(new.tolist(), msg.n)
            session.step = msg.step
            return P.Generated(msg.session_id, msg.step, np.asarray(tokens, np.int32), len(session.tokens),
                               session.compute_s - compute0)
        key, out_tokens = (identity, msg.session_id), []
        feed = session.tokens[self.batcher.held(key)[0]:] + new.tolist()

        def finish(out: Any, p: Pending) -> Optional[P.Message]:  # one token per step, like any decoding device
            out_tokens.append(session.sample_next(self._logits(out, 1, p)))
            if len(out_tokens) < msg.n:
                self._queue_tokens(key, out_tokens[-1:], p)
                return None
            return P.Generated(msg.session_id, msg.step, np.asarray(out_tokens, np.int32), len(session.tokens),
                               p.compute_s)

        self._queue_tokens(key, feed, Pending(identity, msg, session, finish))
        session.tokens.extend(new.tolist())
        session.step = msg.step
        return None

    def _close(self, identity: bytes, msg: P.CloseSession) -> P.Message:
        """Everything is checked before anything changes: a refused CloseSession leaves the session intact."""
        key = (identity, msg.session_id)
        session = self.sessions.get(key)
        if session is None:
            raise P.ProtocolError("no_session", f"no open session {msg.session_id}")
        if isinstance(session, MiddleSession):  # no tokens to digest: report the positions held
            self.batcher.close(key)
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
        session.tokens = tokens
        self.batcher.close(key)
        del self.sessions[key]
        return P.Closed(msg.session_id, session.step, session.compute_s, len(tokens), P.sequence_digest(tokens[:length]))

    # -- split protocols (HAT) ------------------------------------------------------------------------------------
    def _open_split(self, identity: bytes, msg: P.OpenSplit) -> P.Message:
        if msg.protocol not in SPLIT_PROTOCOLS:
            raise P.ProtocolError("invalid", f"OpenSplit is for {SPLIT_PROTOCOLS}, not {msg.protocol!r}")
        model = getattr(self.lm, "model", None)
        try:
            check_family(model)
        except ValueError as exc:
            raise P.ProtocolError("invalid", str(exc)) from None
        if not self._fingerprint:
            self._fingerprint = model_fingerprint(model)
        if msg.fingerprint != self._fingerprint:
            raise P.ProtocolError("model_mismatch", f"the device's parts come from another model (fingerprint "
                                  f"{msg.fingerprint[:12]}) than the cloud's {self.model_name!r} "
                                  f"({self._fingerprint[:12]})")
        n = model.config.num_hidden_layers
        if not 1 <= msg.start < msg.stop <= n:
            raise P.ProtocolError("invalid", f"middle layers [{msg.start}, {msg.stop}) must satisfy 1 <= start < stop "
                                  f"<= {n}: the device keeps at least one layer (embeddings alone reveal the tokens)")
        if msg.hidden_format not in HIDDEN_FORMATS:
            raise P.ProtocolError("invalid", f"hidden_format must be one of {HIDDEN_FORMATS}")
        key = (identity, msg.session_id)
        if key not in self.sessions and len(self.sessions) >= self.config.max_sessions:
            raise P.ProtocolError("busy", f"the cloud holds its limit of {self.config.max_sessions} sessions")
        session = MiddleSession(msg.session_id, msg.protocol, msg.hidden_format, msg.start, msg.stop)
        session.link_rtt_s = max(0.0, float(msg.link_rtt_s))
        self._observe(identity, msg.device)
        self.batcher.open(key, msg.start, msg.stop)
        self.sessions[key] = session
        self.stats.sessions_opened += 1
        hidden = int(model.config.hidden_size)
        chunk = 0
        if self.load.known and msg.device.up_bps > 0 and msg.prompt_tokens > 0:
            chunk = chunk_size(self.load, bytes_per_position(msg.hidden_format, hidden), msg.device.up_bps, 1,
                               msg.prompt_tokens)
        return P.SplitOpened(msg.session_id, hidden, chunk, self._cloud_state())

    def _hidden(self, identity: bytes, msg: P.Hidden) -> P.Message:
        import torch

        session = self._session(identity, msg, MiddleSession)
        states = msg.states.values
        if not isinstance(states, np.ndarray) or states.ndim != 2 or states.shape[0] < 1:
            raise P.ProtocolError("invalid", "states must hold [n >= 1, hidden] values")
        n, hidden = states.shape[0], int(self.lm.model.config.hidden_size)
        try:
            x = decode_hidden(msg.states, n, hidden)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"states: {exc}") from None
        if msg.want > n:
            raise P.ProtocolError("invalid", f"want={msg.want} exceeds the {n} states sent")
        if msg.position + n > self.limits.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={self.limits.max_context} positions")
        key = (identity, msg.session_id)
        done, queued = self.batcher.held(key)
        if msg.position < done + queued:  # the device rolled back (rejected drafts): only with nothing queued
            if queued:
                raise P.ProtocolError("desync", f"position {msg.position} would roll back while {queued} positions "
                                      "are still queued")
            self.batcher.crop(key, msg.position)
            session.position = msg.position
        states = torch.from_numpy(np.ascontiguousarray(x)).to(self.batcher.executor.dtype)[None]

        def finish(deep: Any, p: Pending) -> P.Message:
            out = None
            if msg.want:
                out = encode_hidden(deep[0, deep.shape[1] - msg.want:].float().numpy(), session.hidden_format)
            session.position = self.batcher.held(key)[0]
            session.last_active = time.monotonic()
            return P.Deep(msg.session_id, msg.step, session.position, out, p.compute_s, p.uplink_bps,
                          self._cloud_state())

        self.batcher.submit(key, states, Pending(identity, msg, session, finish, self._uplink_bps(session, msg.idle_s)))
        session.step = msg.step
        return None  # answered by step() once computed

    def _report(self, identity: bytes, msg: P.Report) -> P.Message:
        self._observe(identity, msg.device)
        return P.Reported(self._cloud_state())

    def _observe(self, identity: bytes, state: P.DeviceState) -> None:
        """Keep a device's latest self-report (HAT §3.2); a changed power mode is logged."""
        entry = self.devices.setdefault(identity, {"device_id": identity.decode(errors="replace")})
        if state.power_mode and entry.get("power_mode") not in (None, state.power_mode):
            log.info("device %s: power mode %s -> %s", entry["device_id"], entry["power_mode"], state.power_mode)
        for key in ("power_mode", "profile"):
            if getattr(state, key):
                entry[key] = getattr(state, key)
        for key in ("draft_s", "up_bps", "down_bps"):
            if getattr(state, key) > 0:
                entry[key] = getattr(state, key)
        entry["reported_at"] = time.time()

    def _cloud_state(self) -> P.CloudState:
        return P.CloudState(self.load.mu or 0.0, self.load.g_mu(), self.batcher.executor.stages)
