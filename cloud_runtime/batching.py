"""Continuous batching of the split protocols' middle-part work (HAT §2.1, §3.3) inside the cloud server.

A `Hidden` request is validated on arrival and becomes scheduler work (cloud_runtime.scheduler): "decode" when it is
a decode / verify segment (at most max_draft_len + 1 positions), "prefill" otherwise (a prompt or a HAT prompt chunk,
which the scheduler may split further over steps). The server drains its socket, then `step()` computes one batch of
many sessions' segments — one forward per layer range (cloud_runtime.runner), in this process or through pipeline
stages (cloud_runtime.pipeline) — and returns the `Deep` replies of the works it finished. Each batch that comes back
feeds HAT's state monitoring (eq. 1-2) with its real token count and compute time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Tuple

import numpy as np

from cloud_runtime.runner import Engine
from cloud_runtime.scheduler import Scheduler, SchedulerConfig, SchedulerRefusal, Work
from cloud_runtime.split_session import MiddleSession
from hat_split import protocol as P
from hat_split.chunking import DelayModel
from hat_split.hidden_codec import encode_hidden

log = logging.getLogger("hatspec.cloud")
STEP_LOG = 4096  # batches whose size and time the stats keep (for the fleet benchmark's per-step figures)


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
    forward_s: float = 0.0  # model time of the batches (a pipeline: launch to return)
    step_s: float = 0.0  # whole step() time: scheduling, forward (this process's part), reply encoding
    stage_s: List[float] = field(default_factory=list)  # model time per pipeline stage
    step_log: List[Tuple[int, int, float]] = field(default_factory=list)  # recent (tokens, segments, compute_s)

    def observe(self, tokens: int, segments: int, compute_s: float, stage_s) -> None:
        self.steps += 1
        self.tokens += tokens
        self.segments += segments
        self.max_segments = max(self.max_segments, segments)
        self.forward_s += compute_s
        self.stage_s = [a + b for a, b in zip(self.stage_s, stage_s)] if self.stage_s else list(stage_s)
        self.step_log.append((tokens, segments, compute_s))
        del self.step_log[:-STEP_LOG]


class MiddleBatcher:
    def __init__(self, config: SchedulerConfig, executor: Any, load: DelayModel, decode_limit: int):
        self.engine = Engine(Scheduler(config), executor)
        self.load = load
        self.decode_limit = decode_limit  # positions up to which a Hidden is decode / verify work
        self._pending: Dict[int, _Pending] = {}  # id(work) → how to answer it
        self.stats = StepStats()

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def executor(self) -> Any:
        return self.engine.executor

    def open(self, key: Hashable, session: MiddleSession) -> None:
        if key in self.scheduler.sessions:
            self.close(key)  # reopening an id replaces the old session
        try:
            self.engine.open(key, session.start, session.stop)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None

    def close(self, key: Hashable) -> None:
        for w in self.engine.close(key):
            self._pending.pop(id(w), None)

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions computed, positions queued) of a session."""
        return self.engine.held(key)

    def submit(self, key: Hashable, identity: bytes, msg: P.Hidden, session: MiddleSession, states: np.ndarray,
               uplink_bps: float) -> None:
        """Queue a validated Hidden: crop the session to its position (only when nothing is queued), then its work."""
        import torch

        done, queued = self.held(key)
        kind = "decode" if states.shape[0] <= self.decode_limit else "prefill"
        x = torch.from_numpy(np.ascontiguousarray(states)).to(self.executor.dtype)[None]
        try:
            if msg.position < done + queued:
                if queued:
                    raise P.ProtocolError("desync", f"position {msg.position} would roll back while {queued} "
                                          "positions are still queued")
                self.engine.crop(key, msg.position)
                session.position = msg.position
            work = self.engine.submit(key, kind, x)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        self._pending[id(work)] = _Pending(identity, msg, session, uplink_bps)

    @property
    def busy(self) -> bool:
        return self.engine.busy

    @property
    def can_launch(self) -> bool:
        return self.engine.can_launch

    def step(self, cloud_state: Callable[[], P.CloudState]) -> Tuple[List[Tuple[bytes, P.Message]], List[Hashable]]:
        """Launch and collect batches: (identity, reply) for every work finished, and the sessions dropped because
        their batch failed (each of their queued works answered with an Error)."""
        t0 = time.perf_counter()
        try:
            finished, reports = self.engine.step()
        except Exception as exc:  # a compute failure: the batches' sessions are in an unknown state, drop them
            log.exception("batched step failed")
            return self._fail(f"{type(exc).__name__}: {exc}")
        for batch, report in reports:
            self.load.observe(batch.tokens, report.compute_s)
            self.stats.observe(batch.tokens, len(batch.segments), report.compute_s, report.stage_s)
            for seg in batch.segments:
                p = self._pending.get(id(seg.work))
                if p is not None:
                    p.compute_s += report.compute_s
                    p.session.compute_s += report.compute_s * seg.n / batch.tokens
        replies = [self._reply(w, out, cloud_state) for w, out in finished]
        if reports or finished:
            self.stats.step_s += time.perf_counter() - t0
        return [r for r in replies if r is not None], []

    def _reply(self, work: Work, deep: Any, cloud_state: Callable[[], P.CloudState]):
        p = self._pending.pop(id(work), None)
        if p is None:
            return None
        m = p.msg
        out = None
        if m.want:
            out = encode_hidden(deep[0, deep.shape[1] - m.want:].float().numpy(), p.session.hidden_format)
        p.session.position = self.held(work.session)[0]
        p.session.last_active = time.monotonic()
        return p.identity, P.Deep(m.session_id, m.step, p.session.position, out, p.compute_s, p.uplink_bps,
                                  cloud_state())

    def _fail(self, why: str) -> Tuple[List[Tuple[bytes, P.Message]], List[Hashable]]:
        out, dropped = [], []
        for batch in self.engine.abandon():
            for key in dict.fromkeys(seg.session for seg in batch.segments):
                if key in dropped or key not in self.scheduler.sessions:
                    continue
                for w in self.scheduler.sessions[key].queue:
                    p = self._pending.get(id(w))
                    if p is not None:
                        out.append((p.identity, P.Error("internal", why, p.msg.session_id, p.msg.step)))
                self.close(key)
                dropped.append(key)
        return out, dropped
