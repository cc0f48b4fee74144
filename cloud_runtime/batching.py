"""Continuous batching of every protocol's model work (HAT §2.1, §3.3) inside the cloud server.

The handlers (cloud_runtime.handlers) validate each request and queue its model work here on its session: "decode"
when it is a decode / verify segment (at most max_draft_len + 1 positions), "prefill" otherwise (a prompt or a HAT
prompt chunk, which the scheduler may split further over steps). Split protocols send hidden states for the middle
layers; token protocols' tokens are embedded and run through every layer. The server drains its socket, then
`step()` computes one batch of many sessions' segments — one forward per layer range (cloud_runtime.runner), in this
process or through pipeline stages (cloud_runtime.pipeline) — and returns each finished work with the numpy rows its
request needs: a token work's logits of its last positions, a split work's last deep states. The handlers turn those
into replies (Deep, Verdict, SessionOpened, Generated). Each batch that comes back feeds HAT's state monitoring
(eq. 1-2) with its real token count and compute time.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from cloud_runtime.runner import Engine, ModelEnds
from cloud_runtime.scheduler import Scheduler, SchedulerConfig, SchedulerRefusal
from hat_split.math.chunking import DelayModel
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.cloud")
STEP_LOG = 4096  # batches whose size and time the stats keep (for the fleet benchmark's per-step figures)
DUTY_WINDOW_S = 5.0  # the recent stretch whose share spent in steps the cost report states (StepStats.duty)


@dataclass
class Finished:
    """What one step gave back: works `done` with their rows (None where the request wants none), works `failed`
    with the reason (their batch failed), and the sessions `dropped` with that batch."""

    done: List[Tuple[Any, Optional[np.ndarray]]] = field(default_factory=list)
    failed: List[Tuple[Any, str]] = field(default_factory=list)
    dropped: List[Hashable] = field(default_factory=list)


@dataclass(frozen=True)
class _Queued:
    tag: Any  # the caller's handle for the request (cloud_runtime.work.Pending)
    logits: int  # token work: logits rows of its last positions to return
    states: int  # split work: deep states of its last positions to return


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    segments: int = 0
    max_segments: int = 0
    forward_s: float = 0.0  # model time of the batches (a pipeline: launch to return)
    step_s: float = 0.0  # whole step() time: scheduling, forward (this process's part), logits of finished works
    head_s: float = 0.0  # model time outside the batched steps: final norm and head, results to the host
    stage_s: List[float] = field(default_factory=list)  # model time per pipeline stage
    step_log: List[Tuple[int, int, float]] = field(default_factory=list)  # recent (tokens, segments, compute_s)

    def __post_init__(self) -> None:
        # (when it ended, compute_s) of the steps of the last DUTY_WINDOW_S: not a field, so that the cloud's status
        # file (dataclasses.asdict of these stats, as JSON) leaves it out
        self.recent: Deque[Tuple[float, float]] = deque()

    def observe(self, tokens: int, segments: int, compute_s: float, stage_s: Sequence[float],
                now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.recent.append((now, compute_s))
        while self.recent and self.recent[0][0] < now - DUTY_WINDOW_S:
            self.recent.popleft()
        self.steps += 1
        self.tokens += tokens
        self.segments += segments
        self.max_segments = max(self.max_segments, segments)
        self.forward_s += compute_s
        self.stage_s = [a + b for a, b in zip(self.stage_s, stage_s)] if self.stage_s else list(stage_s)
        self.step_log.append((tokens, segments, compute_s))
        del self.step_log[:-STEP_LOG]

    def duty(self, now: Optional[float] = None) -> float:
        """The share of the last DUTY_WINDOW_S seconds spent computing steps (a step that ended at e after c seconds
        ran over [e − c, e]): 1 when steps ran back to back, as under other devices' continuous decoding, where a
        request waits for the step in progress to end whenever it comes (hat_split.math.costmodel.phase_wait)."""
        now = time.monotonic() if now is None else now
        start = now - DUTY_WINDOW_S
        spent = sum(max(0.0, min(end, now) - max(end - c, start)) for end, c in self.recent)
        return min(1.0, spent / DUTY_WINDOW_S)


class Batcher:
    """The server's side of the engine (cloud_runtime.runner.Engine): token ids and wire states in, numpy rows out.

    A work's `tag` is the caller's handle for its request: it gets the compute time of every step the work takes part
    in (`tag.compute_s`) and its session its share by positions (`tag.session.compute_s`); nothing else of it is
    read here."""

    def __init__(self, config: SchedulerConfig, executor: Any, ends: ModelEnds, load: DelayModel, decode_limit: int):
        self.engine = Engine(Scheduler(config), executor, ends)
        self.ends = ends
        self.load = load
        self.decode_limit = decode_limit  # positions up to which work is decode / verify
        self._queued: Dict[int, _Queued] = {}  # id(work) → its request and the rows it wants back
        self.stats = StepStats()

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def stages(self) -> int:
        return self.engine.executor.stages

    @property
    def wake_socket(self) -> Any:
        """A ZeroMQ socket readable when a batch is back from pipeline stages (None: batches finish in step())."""
        return getattr(self.engine.executor, "wake_socket", None)

    @property
    def launches(self) -> int:
        """Batches launched so far."""
        return self.engine.launches

    @property
    def kv_used(self) -> int:
        return self.scheduler.kv_used

    def open(self, key: Hashable, start: int, stop: int, owner: Hashable = None) -> None:
        """A session of device `owner` on layers [start, stop) (the full model for token protocols); replaces an open
        one."""
        if key in self.scheduler.sessions:
            self.close(key)
        try:
            self.engine.open(key, start, stop, owner)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None

    def close(self, key: Hashable) -> None:
        """Forget a session (nothing happens for one never opened)."""
        for w in self.engine.close(key):
            self._queued.pop(id(w), None)

    def kv_cost(self, start: int, stop: int) -> int:
        return self.ends.kv_cost(start, stop)

    def held_bytes(self, key: Hashable) -> int:
        """Bytes of KV cache a session holds (its context and queued work); 0 for one not open."""
        s = self.scheduler.sessions.get(key)
        return s.held_bytes if s is not None else 0

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions computed, positions queued) of a session; (0, 0) for one not open."""
        return self.engine.held(key) if key in self.scheduler.sessions else (0, 0)

    def crop(self, key: Hashable, length: int) -> None:
        try:
            self.engine.crop(key, length)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None

    def submit_tokens(self, key: Hashable, tokens: Sequence[int], logits: int, tag: Any,
                      tree: Optional[Sequence[int]] = None) -> None:
        """Queue token ids of a token-protocol session (their embeddings through every layer); the work comes back
        with the logits `# [logits, vocab]` of its last `logits` positions (None for 0). tree: each position's parent
        (hat_split.math.tree; a draft tree's verify, one masked forward)."""
        self._submit(key, np.asarray(tokens, dtype=np.int64).reshape(-1), _Queued(tag, logits, 0), tree)

    def keep(self, key: Hashable, start: int, rows: Sequence[int]) -> None:
        """Of a session's positions from `start` keep only `rows` (a draft tree's accepted path)."""
        try:
            self.engine.keep(key, start, rows)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None

    def submit_states(self, key: Hashable, states: np.ndarray, want: int, tag: Any,
                      tree: Optional[Sequence[int]] = None) -> None:
        """Queue a split session's shallow states `# [n, hidden]` (float32) for its middle layers; the work comes
        back with its last `want` deep states `# [want, hidden]` float32 (None for 0). tree: each state's parent (a
        draft tree's, one masked forward)."""
        self._submit(key, np.asarray(states, dtype=np.float32), _Queued(tag, 0, want), tree)

    def _submit(self, key: Hashable, host: np.ndarray, queued: _Queued, tree: Optional[Sequence[int]] = None) -> None:
        kind = "decode" if len(host) <= self.decode_limit else "prefill"
        try:
            work = self.engine.submit(key, kind, host, tree=tree)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        self._queued[id(work)] = queued

    @property
    def busy(self) -> bool:
        return self.engine.busy

    @property
    def can_launch(self) -> bool:
        return self.engine.can_launch

    def step(self) -> Finished:
        """Launch and collect batches; every work finished comes back with its rows."""
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
                q = self._queued.get(id(seg.work))
                if q is not None:
                    q.tag.compute_s += report.compute_s
                    q.tag.session.compute_s += report.compute_s * seg.n / batch.tokens
        out = Finished()
        wanted = [(self._queued.pop(id(work), None), states) for work, states in finished]
        wanted = [(q, states) for q, states in wanted if q is not None]
        if wanted:
            t1 = time.perf_counter()
            rows = self.ends.rows([(states, q.logits, q.states) for q, states in wanted])
            head_s = time.perf_counter() - t1  # the head's time counts as the requests' compute, by logits rows
            self.stats.head_s += head_s
            n_logits = sum(q.logits for q, _ in wanted) or 1
            for (q, _), r in zip(wanted, rows):
                dt = head_s * q.logits / n_logits
                q.tag.compute_s += dt
                q.tag.session.compute_s += dt
                out.done.append((q.tag, r))
        if reports or finished:
            self.stats.step_s += time.perf_counter() - t0
        return out

    def _fail(self, why: str) -> Finished:
        out = Finished()
        for batch in self.engine.abandon():
            for key in dict.fromkeys(seg.session for seg in batch.segments):
                if key in out.dropped or key not in self.scheduler.sessions:
                    continue
                for w in self.scheduler.sessions[key].queue:
                    q = self._queued.get(id(w))
                    if q is not None:
                        out.failed.append((q.tag, why))
                self.close(key)
                out.dropped.append(key)
        return out

    def shutdown(self) -> None:
        """Stop the executor (a pipeline's stages)."""
        self.engine.executor.close()
