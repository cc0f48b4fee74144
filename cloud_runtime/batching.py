"""Continuous batching of every protocol's model work (HAT §2.1, §3.3) inside the cloud server.

Each request is validated on arrival and becomes scheduler work (cloud_runtime.scheduler) on its session: "decode"
when it is a decode / verify segment (at most max_draft_len + 1 positions), "prefill" otherwise (a prompt or a HAT
prompt chunk, which the scheduler may split further over steps). Split protocols send hidden states for the middle
layers; token protocols' tokens are embedded and run through every layer. The server drains its socket, then
`step()` computes one batch of many sessions' segments — one forward per layer range (cloud_runtime.runner), in this
process or through pipeline stages (cloud_runtime.pipeline) — and each finished work's `Pending.finish` builds the
reply (Deep, Verdict, SessionOpened, Generated). Each batch that comes back feeds HAT's state monitoring (eq. 1-2)
with its real token count and compute time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from cloud_runtime.runner import Engine
from cloud_runtime.scheduler import Scheduler, SchedulerConfig, SchedulerRefusal
from hat_split.wire import messages as P
from hat_split.math.chunking import DelayModel

log = logging.getLogger("hatspec.cloud")
STEP_LOG = 4096  # batches whose size and time the stats keep (for the fleet benchmark's per-step figures)


@dataclass
class Pending:
    """How to answer a queued work: `finish(output states, self)` returns the reply, or None after queueing more work
    for the same request (`llm` decodes token by token) with this Pending."""

    identity: bytes
    msg: Any
    session: Any  # the server's session object; its compute_s gets this work's share of each step
    finish: Callable[[Any, "Pending"], Optional[P.Message]]
    uplink_bps: float = 0.0
    compute_s: float = 0.0  # compute time of the steps this request took part in


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


class Batcher:
    """The server's side of the engine (cloud_runtime.runner.Engine): queued works carry how to answer them."""

    def __init__(self, config: SchedulerConfig, executor: Any, load: DelayModel, decode_limit: int):
        self.engine = Engine(Scheduler(config), executor)
        self.load = load
        self.decode_limit = decode_limit  # positions up to which work is decode / verify
        self._pending: Dict[int, Pending] = {}  # id(work) → how to answer it
        self.stats = StepStats()

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def executor(self) -> Any:
        return self.engine.executor

    def open(self, key: Hashable, start: int, stop: int) -> None:
        """A session of layers [start, stop) (the full model for token protocols); replaces an open one."""
        if key in self.scheduler.sessions:
            self.close(key)
        try:
            self.engine.open(key, start, stop)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None

    def close(self, key: Hashable) -> None:
        for w in self.engine.close(key):
            self._pending.pop(id(w), None)

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions computed, positions queued) of a session."""
        return self.engine.held(key)

    def crop(self, key: Hashable, length: int) -> None:
        try:
            self.engine.crop(key, length)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None

    def submit(self, key: Hashable, states: Any, pending: Pending) -> None:
        """Queue `states # [1, n, hidden]` (a torch tensor in the model's dtype) as decode or prefill work."""
        kind = "decode" if states.shape[1] <= self.decode_limit else "prefill"
        try:
            work = self.engine.submit(key, kind, states)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        self._pending[id(work)] = pending

    @property
    def busy(self) -> bool:
        return self.engine.busy

    @property
    def can_launch(self) -> bool:
        return self.engine.can_launch

    def step(self) -> Tuple[List[Tuple[bytes, P.Message]], List[Hashable]]:
        """Launch and collect batches: (identity, reply) for every request finished, and the sessions dropped because
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
        replies = []
        for work, out in finished:
            p = self._pending.pop(id(work), None)
            if p is None:
                continue
            p.session.last_active = time.monotonic()  # the device's silence counts from its answer
            try:
                reply = p.finish(out, p)
            except P.ProtocolError as exc:  # e.g. the next token's work does not fit any more
                reply = P.Error(exc.code, exc.message, getattr(p.msg, "session_id", None), getattr(p.msg, "step", None))
            except Exception as exc:
                log.exception("finishing a %s failed", type(p.msg).__name__)
                reply = P.Error("internal", f"{type(exc).__name__}: {exc}", getattr(p.msg, "session_id", None),
                                getattr(p.msg, "step", None))
            if reply is not None:
                replies.append((p.identity, reply))
        if reports or finished:
            self.stats.step_s += time.perf_counter() - t0
        return replies, []

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
