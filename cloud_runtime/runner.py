"""Runs the scheduler's batches (cloud_runtime.scheduler) on a model: one forward per layer range and step over the
ragged segments of many sessions (hat_split.models.partition.Stack.forward_batch), each on its own KV cache.

Three pieces, from the inside out:

- `StageRunner` computes jobs on the layers one process owns, [lo, hi) of the model: each job is one session's
  segment with the layer range it asks for; the runner runs the part of that range inside [lo, hi) on the session's
  cache of those layers (a job whose range misses [lo, hi) passes through). One process owning every layer is the
  single-process cloud; pipeline stages (cloud_runtime.pipeline) own consecutive slices.
- An executor moves a planned batch through the stages: `LocalExecutor` is one StageRunner, synchronous; the
  pipeline's keeps several batches in flight. Both take cache operations (crop, close) that every stage applies, in
  order, before its next batch.
- `Engine` ties the scheduler to an executor: sessions' queued inputs go in, one step plans and launches what the
  executor has room for and collects the batches that came back; a work's output is returned when its last segment
  has come back (a prompt chunked over several steps comes back whole). Each returned batch reports its token count
  and compute time, which is what HAT's state monitoring (eq. 1-2) observes.

Around them, `ModelEnds` is where work enters and leaves the layers on the serving process: token ids become input
embeddings, final states become logits rows (final norm + LM head), and split protocols' states cross between the
wire's float32 arrays and the model's dtype. Nothing outside this module and the pipeline touches the model.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from cloud_runtime.scheduler import Batch, Scheduler, Work
from hat_split.models.partition import PartCache, Stack, embed, head_logits

CROP, CLOSE = "crop", "close"


@dataclass(frozen=True)
class Job:
    """One session's segment as a stage sees it: layers [start, stop) of its states at positions position .. + n."""

    sid: int
    start: int
    stop: int
    position: int
    n: int


@dataclass(frozen=True)
class StepReport:
    step: int
    tokens: int  # positions computed in the step, all sessions
    segments: int
    compute_s: float  # model time of the step (the pipeline: its time from launch to return)
    stage_s: Tuple[float, ...] = ()  # model time of each stage


class StageRunner:
    """The layers [lo, hi) of one model, run for many sessions' jobs."""

    def __init__(self, model: Any, lo: int = 0, hi: Optional[int] = None):
        self.model = model
        self.lo = lo
        self.hi = model.config.num_hidden_layers if hi is None else hi
        self.caches: Dict[int, PartCache] = {}
        self._stacks: Dict[Tuple[int, int], Stack] = {}

    def apply(self, ops: Sequence[Tuple[str, int, int]]) -> None:
        """Cache operations, in order: (CROP, sid, length) forgets positions >= length, (CLOSE, sid, 0) the cache."""
        for op, sid, arg in ops:
            if op == CLOSE:
                self.caches.pop(sid, None)
            elif op == CROP:
                cache = self.caches.get(sid)
                if cache is not None:
                    cache.crop(min(arg, cache.length))
            else:
                raise ValueError(f"unknown cache operation {op!r}")

    def run(self, jobs: Sequence[Job], xs: Sequence[Any]) -> Tuple[List[Any], float]:
        """Each job's states `xs[i] # [1, n_i, hidden]` through its layers inside [lo, hi); returns the outputs (the
        input itself where the job has no layer here) and the model time."""
        groups: Dict[Tuple[int, int], List[int]] = {}
        for i, job in enumerate(jobs):
            layers = (max(job.start, self.lo), min(job.stop, self.hi))
            if layers[0] < layers[1]:
                groups.setdefault(layers, []).append(i)
        outs = list(xs)
        t0 = time.perf_counter()
        for layers, idx in groups.items():
            stack = self._stacks.get(layers)
            if stack is None:
                stack = self._stacks[layers] = Stack(self.model, *layers)
            caches = [self._cache(jobs[i]) for i in idx]
            for i, out in zip(idx, stack.forward_batch(caches, [xs[i] for i in idx])):
                outs[i] = out
        return outs, time.perf_counter() - t0

    def _cache(self, job: Job) -> PartCache:
        cache = self.caches.get(job.sid)
        if cache is None:
            cache = self.caches[job.sid] = PartCache()
        if cache.length != job.position:
            raise RuntimeError(f"session {job.sid} holds {cache.length} positions here, its segment starts at "
                               f"{job.position}")
        return cache


class ModelEnds:
    """The target's embeddings and head, on the process that serves (a pipeline's rank 0 keeps them)."""

    def __init__(self, model: Any):
        self.model = model
        self.dtype = next(model.parameters()).dtype

    def embed(self, tokens: Sequence[int]) -> Any:
        """Input embeddings `# [1, n, hidden]` of token ids, in the model's dtype."""
        return embed(self.model, tokens)

    def logits(self, out: Any, n: int) -> np.ndarray:
        """Float32 logits `# [n, vocab]` of the last n positions of final hidden states `out # [1, positions, hidden]`
        (final norm + LM head)."""
        return head_logits(self.model, out[:, out.shape[1] - n:])[0].numpy()

    def states_in(self, x: np.ndarray) -> Any:
        """Shallow states from the wire `# [n, hidden]` (float32) as the layers' input `# [1, n, hidden]`."""
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(self.dtype)[None]

    @staticmethod
    def states_out(out: Any, n: int) -> np.ndarray:
        """The last n deep states of `out # [1, positions, hidden]` as float32 `# [n, hidden]` for the wire."""
        return out[0, out.shape[1] - n:].float().numpy()


class LocalExecutor:
    """Every layer in this process: a batch is computed when launched."""

    depth = 1  # batches in flight

    def __init__(self, model: Any):
        self.runner = StageRunner(model)
        self._done: List[Tuple[int, List[Any], float, Tuple[float, ...]]] = []

    @property
    def stages(self) -> int:
        return 1

    def apply(self, ops: Sequence[Tuple[str, int, int]]) -> None:
        self.runner.apply(ops)

    def launch(self, step: int, jobs: Sequence[Job], xs: Sequence[Any]) -> None:
        outs, compute_s = self.runner.run(jobs, xs)
        self._done.append((step, outs, compute_s, (compute_s,)))

    def collect(self) -> List[Tuple[int, List[Any], float, Tuple[float, ...]]]:
        """Batches that came back, oldest first: (step, outputs, compute seconds, per-stage seconds). Compute
        seconds are what the batch cost the server: here its model time; through a pipeline, launch to return."""
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        pass


class Engine:
    """The scheduler and an executor: queue sessions' work with its input states, `step()` to compute."""

    def __init__(self, scheduler: Scheduler, executor: Any):
        if scheduler.config.max_in_flight != executor.depth:
            raise ValueError(f"the scheduler plans {scheduler.config.max_in_flight} batches ahead, the executor "
                             f"holds {executor.depth}")
        self.scheduler = scheduler
        self.executor = executor
        self._sid = itertools.count(1)
        self._sessions: Dict[Hashable, Tuple[int, int, int]] = {}  # key → (sid, first layer, stop layer)
        self._inputs: Dict[int, Any] = {}  # id(work) → `# [1, tokens, hidden]`
        self._partial: Dict[int, List[Any]] = {}  # id(work) → outputs of its segments so far
        self._launched: List[Batch] = []  # batches in flight, oldest first
        self.launches = 0  # batches launched so far

    def open(self, key: Hashable, start: int, stop: int) -> None:
        """A session of layers [start, stop); its cache is empty (SchedulerRefusal if it cannot be admitted)."""
        self.scheduler.open(key)
        self._sessions[key] = (next(self._sid), start, stop)

    def close(self, key: Hashable) -> List[Work]:
        """Forget a session and its cache; returns its unfinished works."""
        works = self.scheduler.close(key)
        entry = self._sessions.pop(key, None)
        if entry is not None:
            self.executor.apply([(CLOSE, entry[0], 0)])
        for w in works:
            self._inputs.pop(id(w), None)
            self._partial.pop(id(w), None)
        return works

    def crop(self, key: Hashable, length: int) -> None:
        self.scheduler.crop(key, length)
        self.executor.apply([(CROP, self._sessions[key][0], length)])

    def submit(self, key: Hashable, kind: str, states: Any, tag: Any = None) -> Work:
        """Queue `states # [1, n, hidden]` (SchedulerRefusal, nothing queued, if it cannot be taken)."""
        work = self.scheduler.submit(key, kind, states.shape[1], tag)
        self._inputs[id(work)] = states
        return work

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions computed, positions queued) of a session."""
        s = self.scheduler.sessions[key]
        return s.context, s.queued

    @property
    def busy(self) -> bool:
        """Work queued or in flight."""
        return bool(self._launched) or any(s.queue for s in self.scheduler.sessions.values())

    @property
    def can_launch(self) -> bool:
        return len(self._launched) < self.executor.depth and any(
            s.head() is not None for s in self.scheduler.sessions.values())

    def step(self) -> Tuple[List[Tuple[Work, Any]], List[Tuple[Batch, StepReport]]]:
        """Launch what the executor has room for, collect what came back: (finished works with their outputs
        `# [1, tokens, hidden]`, (batch, report) of every batch that came back)."""
        import torch

        while len(self._launched) < self.executor.depth:
            batch = self.scheduler.plan()
            if batch is None:
                break
            jobs, xs = [], []
            for seg in batch.segments:
                sid, start, stop = self._sessions[seg.session]
                jobs.append(Job(sid, start, stop, seg.start, seg.n))
                xs.append(self._inputs[id(seg.work)][:, seg.offset:seg.offset + seg.n])
                if seg.final:
                    del self._inputs[id(seg.work)]
            self._launched.append(batch)
            self.launches += 1
            self.executor.launch(batch.step, jobs, xs)
        finished, reports = [], []
        for step, outs, compute_s, stage_s in self.executor.collect():
            batch = self._launched.pop(0)
            if batch.step != step:
                raise RuntimeError(f"batch {step} came back where {batch.step} was expected")
            for seg, out in zip(batch.segments, outs):
                s = self.scheduler.sessions.get(seg.session)
                if s is not None and any(w is seg.work for w in s.queue):  # not closed meanwhile
                    self._partial.setdefault(id(seg.work), []).append(out)
            for work in self.scheduler.complete(batch):
                parts = self._partial.pop(id(work))
                finished.append((work, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)))
            reports.append((batch, StepReport(batch.step, batch.tokens, len(batch.segments), compute_s, stage_s)))
        return finished, reports

    def abandon(self) -> List[Batch]:
        """Forget the batches in flight after a compute failure (their sessions must be closed)."""
        self._launched.clear()
        return self.scheduler.abandon()
