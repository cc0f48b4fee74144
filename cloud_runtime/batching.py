"""Continuous batching of the split protocols' middle-part work (HAT §2.1, §3.3) inside the cloud server.

A `Hidden` request is validated on arrival and becomes scheduler work (cloud_runtime.scheduler): "decode" when it is
a decode / verify segment (at most max_draft_len + 1 positions), "prefill" otherwise (a prompt or a HAT prompt chunk,
which the scheduler may split further over steps). The server drains its socket, then `step()` computes one batch of
many sessions' segments — one forward per layer range (cloud_runtime.runner) — and returns the `Deep` replies of the
works it finished. Each step feeds HAT's state monitoring (eq. 1-2) with the batch's real token count and compute
time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Tuple

import numpy as np

from cloud_runtime.runner import Runner
from cloud_runtime.scheduler import Batch, Scheduler, SchedulerConfig, SchedulerRefusal, Work
from cloud_runtime.split_session import MiddleSession
from hat_split import protocol as P
from hat_split.chunking import DelayModel
from hat_split.hidden_codec import encode_hidden

log = logging.getLogger("hatspec.cloud")


@dataclass
class _Pending:
    identity: bytes
    msg: P.Hidden
    session: MiddleSession
    uplink_bps: float
    compute_s: float = 0.0  # compute time of the steps this work took part in


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    segments: int = 0
    max_segments: int = 0
    forward_s: float = 0.0  # model time inside the steps
    step_s: float = 0.0  # whole step() time: scheduling, forward, reply encoding


class MiddleBatcher:
    def __init__(self, config: SchedulerConfig, load: DelayModel, decode_limit: int):
        self.scheduler = Scheduler(config)
        self.load = load
        self.decode_limit = decode_limit  # positions up to which a Hidden is decode / verify work
        self.runners: Dict[Tuple[int, int], Runner] = {}
        self._pending: Dict[int, _Pending] = {}  # id(work) → how to answer it
        self._ranges: Dict[Hashable, Tuple[int, int]] = {}
        self.stats = StepStats()

    def open(self, key: Hashable, session: MiddleSession) -> None:
        if key in self.scheduler.sessions:
            self.close(key)  # reopening an id replaces the old session
        try:
            self.scheduler.open(key)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        stack = session.stack
        layers = (stack.start, stack.stop)
        runner = self.runners.get(layers)
        if runner is None:
            runner = self.runners[layers] = Runner(stack)
        runner.open(key, session.cache)
        self._ranges[key] = layers

    def close(self, key: Hashable) -> None:
        works = self.scheduler.close(key)
        layers = self._ranges.pop(key, None)
        if layers is not None:
            self.runners[layers].close(key, works)
        for w in works:
            self._pending.pop(id(w), None)

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions computed, positions queued) of a session."""
        s = self.scheduler.sessions[key]
        return s.context, s.queued

    def submit(self, key: Hashable, identity: bytes, msg: P.Hidden, session: MiddleSession, states: np.ndarray,
               uplink_bps: float) -> None:
        """Queue a validated Hidden: crop the session to its position (only when nothing is queued), then its work."""
        import torch

        done, queued = self.held(key)
        if msg.position < done + queued:
            if queued:
                raise P.ProtocolError("desync", f"position {msg.position} would roll back while {queued} positions "
                                      "are still queued")
            session.cache.crop(msg.position)
            self.scheduler.crop(key, msg.position)
        n = states.shape[0]
        kind = "decode" if n <= self.decode_limit else "prefill"
        try:
            work = self.scheduler.submit(key, kind, n)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        dtype = session.stack.model.model.embed_tokens.weight.dtype
        self.runners[self._ranges[key]].feed(work, torch.from_numpy(np.ascontiguousarray(states)).to(dtype)[None])
        self._pending[id(work)] = _Pending(identity, msg, session, uplink_bps)

    @property
    def busy(self) -> bool:
        return any(s.queue for s in self.scheduler.sessions.values())

    def step(self, cloud_state: Callable[[], P.CloudState]) -> Tuple[List[Tuple[bytes, P.Message]], List[Hashable]]:
        """Compute one batch: (identity, reply) for every work it finished, and the sessions dropped because their
        batch failed (each of their queued works answered with an Error)."""
        t0 = time.perf_counter()
        batch = self.scheduler.plan()
        if batch is None:
            return [], []
        groups: Dict[Tuple[int, int], List[Any]] = {}
        for seg in batch.segments:
            groups.setdefault(self._ranges[seg.session], []).append(seg)
        finished: Dict[int, Any] = {}
        forward_s = 0.0
        try:
            for layers, segs in groups.items():
                done, report = self.runners[layers].run(Batch(batch.step, segs))
                forward_s += report.compute_s
                finished.update({id(w): out for w, out in done})
        except Exception as exc:  # a compute failure: the batch's sessions are in an unknown state, drop them
            log.exception("batch %d failed", batch.step)
            return self._fail(batch, f"{type(exc).__name__}: {exc}")
        completed = self.scheduler.complete(batch)
        self.load.observe(batch.tokens, forward_s)
        for seg in batch.segments:
            p = self._pending.get(id(seg.work))
            if p is not None:
                p.compute_s += forward_s
                p.session.compute_s += forward_s * seg.n / batch.tokens
        replies = [self._reply(w, finished[id(w)], cloud_state) for w in completed]
        st = self.stats
        st.steps += 1
        st.tokens += batch.tokens
        st.segments += len(batch.segments)
        st.max_segments = max(st.max_segments, len(batch.segments))
        st.forward_s += forward_s
        st.step_s += time.perf_counter() - t0
        return [r for r in replies if r is not None], []

    def _reply(self, work: Work, deep: Any, cloud_state: Callable[[], P.CloudState]):
        p = self._pending.pop(id(work), None)
        if p is None:
            return None
        m = p.msg
        out = None
        if m.want:
            out = encode_hidden(deep[0, deep.shape[1] - m.want:].float().numpy(), p.session.hidden_format)
        p.session.last_active = time.monotonic()
        return p.identity, P.Deep(m.session_id, m.step, p.session.position, out, p.compute_s, p.uplink_bps,
                                  cloud_state())

    def _fail(self, batch: Batch, why: str) -> Tuple[List[Tuple[bytes, P.Message]], List[Hashable]]:
        self.scheduler.abandon(batch)
        out, dropped = [], []
        for key in dict.fromkeys(seg.session for seg in batch.segments):
            for w in self.scheduler.sessions[key].queue:
                p = self._pending.get(id(w))
                if p is not None:
                    out.append((p.identity, P.Error("internal", why, p.msg.session_id, p.msg.step)))
            self.close(key)
            dropped.append(key)
        return out, dropped
