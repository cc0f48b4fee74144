"""A target the batched steps do not run, on each session's own cache (`new_state`, `forward` on a `KVState`,
`crop`): a torch model whose layout the partition does not know (hat_split.models.partition.check_family), one
request at a time on its HF cache; or a llama.cpp target (hat_split.models.llamacpp_lm), whose `forward_many` puts
every session's queued work of a step into one batch (one sequence id each, one `llama_decode` per n_batch positions).

It takes the handlers' work through the same calls as the batched path (cloud_runtime.batching.Batcher): token ids
in, the logits rows the request wants out, at the server's next `step()`. Split protocols are refused before any
work exists (they need the partition), so only token work arrives here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Sequence, Tuple

from cloud_runtime.batching import Finished, StepStats
from hat_split.wire import messages as P


log = logging.getLogger("hatspec.cloud")


@dataclass(frozen=True)
class _Work:
    key: Hashable
    tokens: List[int]  # fed on the session's cache
    logits: int  # logits rows of its last positions to return
    tag: Any  # the caller's handle (compute_s, session.compute_s get the forward's time)


class UnbatchedRunner:
    """Each session's cache in this process; every queued work is computed, in arrival order, at `step()`."""

    stages = 1
    wake_socket = None  # work finishes inside step()

    def __init__(self, lm: Any):
        self.lm = lm  # hat_split.models.lm.CausalLM, or anything with new_state / forward / crop (tests' chains)
        self.caches: Dict[Hashable, Any] = {}  # session key → KVState
        self._queue: List[_Work] = []
        self.launches = 0  # forwards computed so far (one per work, or one per batch of sessions)
        self.stats = StepStats()  # no batched steps: only forward_s (model time) counts

    @property
    def kv_used(self) -> int:
        return sum(kv.length for kv in self.caches.values())

    def open(self, key: Hashable, start: int, stop: int) -> None:
        """A session with an empty cache (the layer range is always the whole model here); replaces an open one."""
        self.close(key)
        self.caches[key] = self.lm.new_state()

    def close(self, key: Hashable) -> None:
        self.caches.pop(key, None)
        self._queue = [w for w in self._queue if w.key != key]

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions cached, positions queued) of a session; (0, 0) for one not open."""
        kv = self.caches.get(key)
        return (kv.length, sum(len(w.tokens) for w in self._queue if w.key == key)) if kv is not None else (0, 0)

    def crop(self, key: Hashable, length: int) -> None:
        self.lm.crop(self.caches[key], length)

    def submit_tokens(self, key: Hashable, tokens: Sequence[int], logits: int, tag: Any) -> None:
        if key not in self.caches:
            raise P.ProtocolError("no_session", f"session {key!r} holds no cache")
        self._queue.append(_Work(key, list(tokens), logits, tag))

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    @property
    def can_launch(self) -> bool:
        return bool(self._queue)

    def step(self) -> Finished:
        """Compute every queued work, in arrival order: one forward_many call per round of distinct sessions when the
        model batches, else one forward per work. The sessions of a failed forward are dropped (their caches are in
        an unknown state)."""
        out = Finished()
        queue, self._queue = self._queue, []
        while queue:
            batch, seen, rest = [], set(), []
            for work in queue:  # a session's second work waits for the next round (it continues the first)
                (rest if work.key in seen or not self._batches and batch else batch).append(work)
                seen.add(work.key)
            queue = rest
            batch = [w for w in batch if not self._refuse_dropped(w, out)]
            if batch:
                self._compute(batch, out)
        return out

    @property
    def _batches(self) -> bool:
        return hasattr(self.lm, "forward_many")

    @staticmethod
    def _refuse_dropped(work: _Work, out: Finished) -> bool:
        if work.key in out.dropped:
            out.failed.append((work.tag, "the session's earlier work failed"))
            return True
        return False

    def _compute(self, batch: List[_Work], out: Finished) -> None:
        t0 = time.perf_counter()
        caches = [self.caches[w.key] for w in batch]
        try:
            if self._batches:
                rows = self.lm.forward_many(caches, [w.tokens for w in batch], [w.logits for w in batch])
            else:
                rows = [self.lm.forward(caches[0], batch[0].tokens, n_logits=batch[0].logits)]  # [logits, vocab]
        except Exception as exc:  # the caches are in an unknown state: drop the sessions
            log.exception("forward failed")
            for work in batch:
                out.failed.append((work.tag, f"{type(exc).__name__}: {exc}"))
                self.close(work.key)
                out.dropped.append(work.key)
            return
        dt = time.perf_counter() - t0
        self.launches += 1
        self.stats.forward_s += dt
        total = sum(len(w.tokens) for w in batch)
        for work, logits in zip(batch, rows):
            share = dt * len(work.tokens) / total  # the forward's time, shared by its tokens
            work.tag.compute_s += share
            work.tag.session.compute_s += share
            out.done.append((work.tag, logits if work.logits else None))

    def shutdown(self) -> None:
        self.caches.clear()
