"""Runs the scheduler's batches (cloud_runtime.scheduler) on a model part: one forward per step over the ragged
segments of many sessions (hat_split.partition.Stack.forward_batch), each on its own KV cache.

The runner holds each session's cache and the inputs of its queued works; a work's output is returned when its last
segment has run (a prompt chunked over several steps comes back whole). Per step it reports the batch's token count
and compute time, which is what HAT's state monitoring (eq. 1-2) observes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Tuple

from cloud_runtime.scheduler import Batch, Work
from hat_split.partition import PartCache, Stack


@dataclass(frozen=True)
class StepReport:
    step: int
    tokens: int  # positions computed in the step, all sessions
    segments: int
    compute_s: float


class Runner:
    def __init__(self, stack: Stack):
        self.stack = stack
        self.caches: Dict[Hashable, PartCache] = {}
        self._inputs: Dict[int, Any] = {}  # id(work) → `# [1, tokens, hidden]`
        self._partial: Dict[int, List[Any]] = {}  # id(work) → outputs of its segments so far

    def open(self, session: Hashable, cache: Optional[PartCache] = None) -> None:
        """Run this session's segments on `cache` (its own, e.g. a MiddleSession's; a new one by default)."""
        self.caches[session] = PartCache() if cache is None else cache

    def feed(self, work: Work, hidden: Any) -> None:
        """The input states `# [1, work.tokens, hidden]` of a submitted work."""
        if hidden.shape[1] != work.tokens:
            raise ValueError(f"work of {work.tokens} positions fed {hidden.shape[1]} states")
        self._inputs[id(work)] = hidden

    def close(self, session: Hashable, works: List[Work] = ()) -> None:
        self.caches.pop(session, None)
        for w in works:
            self._inputs.pop(id(w), None)
            self._partial.pop(id(w), None)

    def run(self, batch: Batch) -> Tuple[List[Tuple[Work, Any]], StepReport]:
        """Compute one planned batch; returns (finished works with their outputs `# [1, tokens, hidden]`, report)."""
        import torch

        caches, xs = [], []
        for seg in batch.segments:
            cache = self.caches[seg.session]
            if cache.length != seg.start:
                raise RuntimeError(f"session {seg.session!r} holds {cache.length} positions, its segment starts at "
                                   f"{seg.start}")
            caches.append(cache)
            xs.append(self._inputs[id(seg.work)][:, seg.offset:seg.offset + seg.n])
        t0 = time.perf_counter()
        outs = self.stack.forward_batch(caches, xs)
        compute_s = time.perf_counter() - t0
        finished = []
        for seg, out in zip(batch.segments, outs):
            key = id(seg.work)
            parts = self._partial.setdefault(key, [])
            parts.append(out)
            if seg.final:
                del self._partial[key], self._inputs[key]
                finished.append((seg.work, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)))
        return finished, StepReport(batch.step, batch.tokens, len(batch.segments), compute_s)
