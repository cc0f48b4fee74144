"""Targets the layer-by-layer batched steps (cloud_runtime.batching) do not run, each session on the model's own
cache (`new_state`, `forward` on a `KVState`, `crop`), planned by the same scheduler (cloud_runtime.scheduler):

- a llama.cpp target (hat_split.models.llamacpp_lm): a step's segments, one per session, go into one
  `forward_many` — one `llama_decode` with one sequence id per session, as the step's token budget is at most
  the context's n_batch;
- a torch model whose layout the partition does not know (hat_split.models.partition.check_family): one forward per
  segment on its HF cache.

A llama.cpp target also verifies draft trees: a tree's positions go into the same `llama_decode` as the other
sessions' work, on sequence-id sets (hat_split.models.llamacpp_lm), and `keep` keeps the accepted path in place. A
torch model on its HF cache takes chains only.

So both get what the batched path has: admission against the KV bound (the llama.cpp context's n_ctx, all sessions
together), the per-session context limit and the session limit, refusals naming the numbers; decode and verify
segments first each step, prompts chunked into what is left of the token budget; HAT's state monitoring fed with
each step's real size and time. Split protocols are refused before any work exists (they need the partition), so
only token work arrives here: token ids in, the logits rows the request wants out.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from cloud_runtime.batching import Finished, StepStats
from cloud_runtime.scheduler import Batch, Scheduler, SchedulerConfig, SchedulerRefusal
from hat_split.math.chunking import DelayModel
from hat_split.models.llamacpp_tree import paths
from hat_split.models.slots import position_bytes
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.cloud")


def tree_sequences(max_sessions: int, tree_nodes: int, max_seq: int) -> int:
    """n_seq_max of a llama.cpp cloud's context: a sequence per session (and one more, for a session reopened while
    its old state is still held) and, for draft trees of up to `tree_nodes` nodes (a path each, at most one per
    node), as many as every session's tree at once would take, within llama.cpp's `max_seq`."""
    states = max_sessions + 1
    return min(max_seq, states + max_sessions * tree_nodes) if tree_nodes else states


def tree_capacity(n_seq_max: int, max_sessions: int) -> int:
    """The sequences a llama.cpp cloud of n_seq_max keeps for draft trees' paths (tree_sequences): the largest tree
    one Verify may carry; a step takes the trees whose paths fit what is free and leaves the rest to the next."""
    return max(0, n_seq_max - max_sessions - 1)


@dataclass
class _Queued:
    tokens: List[int]  # the work's token ids, fed segment by segment
    logits: int  # logits rows of its last positions to return
    tag: Any  # the caller's handle (compute_s, session.compute_s get each step's time)
    tree: Optional[Tuple[int, ...]] = None  # a draft tree's verify: the parent of each position (−1: the cache's end)
    rows: List[np.ndarray] = field(default_factory=list)  # logits rows of its segments so far


class CacheRunner:
    """Sessions on the model's own caches, one scheduled step at a time (`step()`)."""

    stages = 1
    wake_socket = None  # a step finishes inside step()

    def __init__(self, lm: Any, config: SchedulerConfig, decode_limit: int, load: DelayModel):
        """lm: hat_split.models.llamacpp_lm.LlamaCppLM, hat_split.models.lm.CausalLM, or anything with new_state /
        forward / crop (tests' chains); decode_limit: positions up to which a work is decode / verify."""
        if config.max_in_flight != 1:
            raise ValueError("a model on its own caches computes one step at a time (max_in_flight = 1)")
        self.lm = lm
        self.scheduler = Scheduler(config)
        self.decode_limit = decode_limit
        self.load = load
        self.caches: Dict[Hashable, Any] = {}  # session key → KVState
        self._queued: Dict[int, _Queued] = {}  # id(work) → its tokens and request
        self.launches = 0  # steps computed so far
        self.stats = StepStats()

    @property
    def _batches(self) -> bool:
        return hasattr(self.lm, "forward_many")

    @property
    def takes_trees(self) -> bool:
        """Whether the model verifies draft trees (a llama.cpp target); ModelFacts.tree_refusal says so first."""
        return hasattr(self.lm, "forward_tree") and self._batches

    @property
    def kv_used(self) -> int:
        return self.scheduler.kv_used

    def open(self, key: Hashable, start: int, stop: int, owner: Hashable = None) -> None:
        """A session of device `owner` with an empty cache (always the whole model here); replaces an open one."""
        self.close(key)
        try:
            self.scheduler.open(key, owner, self.kv_cost(start, stop))
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        try:
            self.caches[key] = self.lm.new_state()
        except RuntimeError as exc:  # llama.cpp: every sequence id in use
            self.scheduler.close(key)
            raise P.ProtocolError("busy", str(exc)) from None

    def close(self, key: Hashable) -> None:
        for work in self.scheduler.close(key):
            self._queued.pop(id(work), None)
        self.caches.pop(key, None)  # a llama.cpp state gives its sequence back when collected

    def kv_cost(self, start: int, stop: int) -> int:
        """Bytes of KV cache per position of a session (always the whole model here): llama.cpp's f16 cache, a torch
        model's in its dtype; 0 for a model that does not say (tests' chains)."""
        if hasattr(self.lm, "kv_bytes_per_position"):
            return int(self.lm.kv_bytes_per_position())
        model = getattr(self.lm, "model", None)
        if model is None or not hasattr(model, "config"):
            return 0
        return position_bytes(model, model.config.num_hidden_layers)

    def held_bytes(self, key: Hashable) -> int:
        s = self.scheduler.sessions.get(key)
        return s.held_bytes if s is not None else 0

    def held(self, key: Hashable) -> Tuple[int, int]:
        """(positions cached, positions queued) of a session; (0, 0) for one not open."""
        s = self.scheduler.sessions.get(key)
        return (s.context, s.queued) if s is not None else (0, 0)

    def crop(self, key: Hashable, length: int) -> None:
        try:
            self.scheduler.crop(key, length)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        self.lm.crop(self.caches[key], length)

    def keep(self, key: Hashable, start: int, rows: Sequence[int]) -> None:
        """Of a session's positions from `start` on keep only `rows` (offsets, in order): a draft tree's accepted
        path, kept in place."""
        if not self.takes_trees:
            raise P.ProtocolError("invalid", "draft trees are not verified on this model's own caches")
        try:
            self.scheduler.crop(key, start + len(rows))
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        self.lm.keep(self.caches[key], start, rows)

    def submit_tokens(self, key: Hashable, tokens: Sequence[int], logits: int, tag: Any,
                      tree: Optional[Sequence[int]] = None) -> None:
        """Queue token ids on a session's cache; the work comes back with the logits `# [logits, vocab]` of its last
        `logits` positions (None for 0). tree: the parent of each position (a draft tree's verify, one decode
        segment: its mask is whole); refused by a model that takes no trees (the handlers refuse it first:
        ModelFacts.tree_refusal). Refused, nothing queued, when it does not fit."""
        if tree is not None and not self.takes_trees:
            raise P.ProtocolError("invalid", "draft trees are not verified on this model's own caches")
        kind = "decode" if tree is not None or len(tokens) <= self.decode_limit else "prefill"
        try:
            work = self.scheduler.submit(key, kind, len(tokens), tag)
        except SchedulerRefusal as exc:
            raise P.ProtocolError(exc.code, exc.message) from None
        self._queued[id(work)] = _Queued(list(tokens), logits, tag,
                                         None if tree is None else tuple(int(p) for p in tree))

    def submit_states(self, key: Hashable, states: np.ndarray, want: int, tag: Any) -> None:
        raise P.ProtocolError("unsupported", "this cloud's model runs token protocols only")

    @property
    def busy(self) -> bool:
        return any(s.queue for s in self.scheduler.sessions.values())

    @property
    def can_launch(self) -> bool:
        return any(s.head() is not None for s in self.scheduler.sessions.values())

    def step(self) -> Finished:
        """Plan and compute one step; every work it finishes comes back with its rows. The sessions of a failed
        step are dropped (their caches are in an unknown state)."""
        out = Finished()
        t0 = time.perf_counter()
        batch = self.scheduler.plan(self._tree_room() if self.takes_trees else None)
        if batch is None:
            return out
        states, feeds, wants, trees = [], [], [], []
        for seg in batch.segments:
            q = self._queued[id(seg.work)]
            first = seg.work.tokens - q.logits  # the work's first position whose logits row is wanted
            states.append(self.caches[seg.session])
            feeds.append(q.tokens[seg.offset:seg.offset + seg.n])
            wants.append(max(0, seg.offset + seg.n - max(seg.offset, first)))
            trees.append(None if q.tree is None else (q.tree, states[-1].length))  # a decode segment: whole
        try:
            if self._batches:
                rows = self.lm.forward_many(states, feeds, wants, trees if any(trees) else None)
            else:
                rows = [self.lm.forward(s, f, n_logits=k) for s, f, k in zip(states, feeds, wants)]
        except Exception as exc:
            log.exception("step failed")
            return self._fail(batch, f"{type(exc).__name__}: {exc}")
        compute_s = time.perf_counter() - t0
        self.launches += 1
        self.load.observe(batch.tokens, compute_s)
        self.stats.observe(batch.tokens, len(batch.segments), compute_s, (compute_s,))
        for seg, r in zip(batch.segments, rows):
            q = self._queued[id(seg.work)]
            q.tag.compute_s += compute_s
            q.tag.session.compute_s += compute_s * seg.n / batch.tokens
            if len(r):
                q.rows.append(r)
        for work in self.scheduler.complete(batch):
            q = self._queued.pop(id(work))
            out.done.append((q.tag, np.concatenate(q.rows) if q.logits else None))
        self.stats.step_s += time.perf_counter() - t0
        return out

    def _tree_room(self):
        """The scheduler's `fits` for a step: a draft tree's verify joins while llama.cpp's free sequences hold its
        paths (one per leaf); the others wait for the next step, after this one's trees are kept."""
        free = self.lm.free_sequences

        def fits(work: Any) -> bool:
            nonlocal free
            tree = self._queued[id(work)].tree
            need = 0 if tree is None else paths(tree)  # one per leaf
            if need > free:
                return False
            free -= need
            return True
        return fits

    def _fail(self, batch: Batch, why: str) -> Finished:
        out = Finished()
        self.scheduler.abandon()
        for key in dict.fromkeys(seg.session for seg in batch.segments):
            for work in self.scheduler.sessions[key].queue:
                out.failed.append((self._queued[id(work)].tag, why))
            self.close(key)
            out.dropped.append(key)
        return out

    def shutdown(self) -> None:
        for key in list(self.caches):
            self.close(key)
