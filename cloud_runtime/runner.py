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

from cloud_runtime.buckets import Buckets, exact_shape, pad_step
from cloud_runtime.scheduler import Batch, Scheduler, Work
from hat_split.models.graphs import StepGraphs
from hat_split.models.partition import PartCache, Stack, head_logits
from hat_split.models.placement import (available_bytes, is_cuda, model_device, synchronize, to_device,
                                        to_host)
from hat_split.models.slots import SlotKV, SlotStep, position_bytes, run_slots, slot_bytes

CROP, CLOSE, KEEP = "crop", "close", "keep"


@dataclass(frozen=True)
class Job:
    """One session's segment as a stage sees it: layers [start, stop) of its states at positions position .. + n."""

    sid: int
    start: int
    stop: int
    position: int
    n: int
    tree: Tuple[int, ...] = ()  # a draft tree's verify: the parent of each of the n positions (hat_split.math.tree;
    # -1: the cache's end); () a chain


@dataclass(frozen=True)
class StepReport:
    step: int
    tokens: int  # positions computed in the step, all sessions
    segments: int
    compute_s: float  # model time of the step (the pipeline: its time from launch to return)
    stage_s: Tuple[float, ...] = ()  # model time of each stage


@dataclass(frozen=True)
class KvLayout:
    """How a stage keeps its sessions' keys and values: `slots` > 0 preallocates that many slots of `length`
    positions (hat_split.models.slots; sessions beyond them get growing caches), 0 keeps growing caches only;
    `graphs` captures the slot steps of up to `decode_limit` positions per row as CUDA graphs."""

    slots: int = 0
    length: int = 0
    graphs: bool = False
    decode_limit: int = 17  # positions per row of a step that is decode / verify: a chain's or a draft tree's
    # (max(max_draft_len, CloudConfig.tree_nodes) + 1)
    chain_limit: int = 0  # a chain verify's positions (max_draft_len + 1): a bucket of its own (0: none)
    max_rows: int = 64  # sessions per step the graph buckets reach

    def describe(self) -> str:
        if not self.slots:
            return "kv=dynamic"
        return f"kv=slots:{self.slots}x{self.length} graphs={'on' if self.graphs else 'off'}"


SLOT_MEMORY_SHARE = 0.8  # of the memory free after loading the model, what the slots may take at most


def kv_layout(config: Any, model: Any) -> KvLayout:
    """The KV layout a cloud config asks for on the device the model sits on (CloudConfig's kv_layout, graphs): as
    many slots as kv_positions holds, within max_sessions and SLOT_MEMORY_SHARE of the free memory (the log line
    says how many); ValueError for graphs asked off CUDA, or no room for one slot."""
    on_gpu = is_cuda(model_device(model))
    graphs = config.graphs == "on" or (config.graphs == "auto" and on_gpu)
    if graphs and not on_gpu:
        raise ValueError("graphs = on captures CUDA graphs: the model is on the CPU (device cpu, or no GPU)")
    if not (config.kv_layout == "slots" or (config.kv_layout == "auto" and on_gpu)):
        return KvLayout()
    weight = next(model.parameters())
    layers = sum(not getattr(layer, "freed", False) for layer in model.model.layers)  # a pipeline stage: its slice
    per_slot = slot_bytes(model.config, layers, config.max_context, weight.element_size())
    room = int(SLOT_MEMORY_SHARE * available_bytes(weight.device)) // per_slot - 1  # one slot is the scratch
    slots = min(config.max_sessions, max(1, config.kv_positions // config.max_context), room)
    if slots < 1:
        raise ValueError(f"the slot layout needs {per_slot / 2**30:.2f} GiB per slot of max_context = "
                         f"{config.max_context} positions and {weight.device} has "
                         f"{available_bytes(weight.device) / 2**30:.2f} GiB free: lower max_context, or kv_layout "
                         f"dynamic")
    return KvLayout(slots, config.max_context, graphs, max(config.max_draft_len, config.tree_nodes) + 1,
                    min(64, config.max_sessions), config.max_draft_len + 1)


@dataclass
class SlotSession:
    """A session's place in the slot layout: its slot and the positions it holds there."""

    slot: int
    length: int = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length


class StageRunner:
    """The layers [lo, hi) of one model, run for many sessions' jobs."""

    def __init__(self, model: Any, lo: int = 0, hi: Optional[int] = None, layout: KvLayout = KvLayout()):
        self.model = model
        self.lo = lo
        self.hi = model.config.num_hidden_layers if hi is None else hi
        self.caches: Dict[int, Any] = {}  # sid → PartCache or SlotSession
        self._stacks: Dict[Tuple[int, int], Stack] = {}
        self.layout = layout
        self.slots: Optional[SlotKV] = None
        if layout.slots:
            self.slots = SlotKV(model, self.lo, self.hi, layout.slots, layout.length)
            self.buckets = Buckets.make(min(layout.max_rows, layout.slots), layout.decode_limit, layout.length,
                                        also_tokens=(layout.chain_limit,))
        self.device = model_device(model)
        self.graphs = StepGraphs(self.device, layout.graphs and layout.slots > 0)

    def apply(self, ops: Sequence[Tuple[str, int, Any]]) -> None:
        """Cache operations, in order: (CROP, sid, length) forgets positions >= length, (CLOSE, sid, 0) the cache,
        (KEEP, sid, [start, *rows]) keeps of the positions from start only rows (a draft tree's accepted path)."""
        for op, sid, arg in ops:
            if op == KEEP:
                cache = self.caches.get(sid)
                start, rows = int(arg[0]), [int(r) for r in arg[1:]]
                if isinstance(cache, SlotSession):
                    self.slots.keep(cache.slot, start, rows)
                    cache.crop(start + len(rows))
                elif cache is not None:
                    cache.keep(start, rows)
            elif op == CLOSE:
                cache = self.caches.pop(sid, None)
                if isinstance(cache, SlotSession):
                    self.slots.release(cache.slot)
            elif op == CROP:
                cache = self.caches.get(sid)
                if cache is not None:
                    cache.crop(min(arg, cache.length))
            else:
                raise ValueError(f"unknown cache operation {op!r}")

    def run(self, jobs: Sequence[Job], xs: Sequence[Any]) -> Tuple[List[Any], float]:
        """Each job's states `xs[i] # [1, n_i, hidden]` through its layers inside [lo, hi); returns the outputs (the
        input itself where the job has no layer here) and the model time. Slot sessions' decode / verify segments run
        as one (bucketed, captured) step, their prompt chunks as another; growing caches' segments as a third."""
        groups: Dict[Tuple[Tuple[int, int], str], List[int]] = {}
        for i, job in enumerate(jobs):
            layers = (max(job.start, self.lo), min(job.stop, self.hi))
            if layers[0] < layers[1]:
                cache = self._cache(job)
                kind = ("decode" if job.n <= self.layout.decode_limit else "prefill") if isinstance(
                    cache, SlotSession) else "tree" if job.tree else "grow"
                groups.setdefault((layers, kind), []).append(i)
        outs = list(xs)
        t0 = time.perf_counter()
        for (layers, kind), idx in groups.items():
            stack = self._stacks.get(layers)
            if stack is None:
                stack = self._stacks[layers] = Stack(self.model, *layers)
            caches = [self.caches[jobs[i].sid] for i in idx]
            hs = [xs[i] for i in idx]
            if kind == "tree":  # a growing cache's tree: its own mask, one forward each
                results = [stack.forward_tree(c, h, jobs[i].tree) for c, h, i in zip(caches, hs, idx)]
            elif kind == "grow":
                results = stack.forward_batch(caches, hs)
            else:  # slots: chains and trees in one step, each row's mask from its ancestors
                results = self._slot_step(stack, layers, caches, hs, kind == "decode", [jobs[i].tree for i in idx])
            for i, out in zip(idx, results):
                outs[i] = out
        synchronize(self.device)  # the model time is the device's, not the launches'
        return outs, time.perf_counter() - t0

    def _slot_step(self, stack: Stack, layers: Tuple[int, int], sessions: Sequence[SlotSession], hs: Sequence[Any],
                   bucketed: bool, trees: Sequence[Tuple[int, ...]]) -> List[Any]:
        """One step of slot sessions: padded to its bucket and replayed from a graph when `bucketed` and the sizes
        are within the buckets, else eager at its own sizes. trees[i]: session i's draft tree (its positions'
        parents), () for a chain."""
        import torch

        segments = [(s.slot, s.length, h.shape[1]) for s, h in zip(sessions, hs)]
        shape = self.buckets.shape(*exact_shape(segments)) if bucketed and self.graphs.enabled else None
        rows, tokens, width = shape or exact_shape(segments)
        index = pad_step(segments, rows, tokens, self.slots.scratch, trees)
        device = hs[0].device
        packed = to_device(np.array([index.write_slot, index.write_pos, index.positions], dtype=np.int64), device)
        rows_t = to_device(np.array([index.rows, index.past], dtype=np.int64), device)
        ancestors = to_device(index.ancestors, device)
        if all(h.shape[1] == tokens for h in hs):  # every row full (decode steps): one copy
            hidden = torch.cat([*hs, hs[0].new_zeros(rows - len(hs), tokens, hs[0].shape[-1])])
        else:
            hidden = hs[0].new_zeros(rows, tokens, hs[0].shape[-1])
            for i, h in enumerate(hs):
                hidden[i, :h.shape[1]] = h[0]

        def step(hidden: Any, rows_t: Any, packed: Any, ancestors: Any) -> Any:
            return run_slots(stack, SlotStep(self.slots, rows_t[0], packed[0], packed[1], width), hidden, packed[2],
                             rows_t[1], ancestors)

        with torch.inference_mode():
            if shape is None:
                out = step(hidden, rows_t, packed, ancestors)
            else:
                out = self.graphs.run((layers, shape), step, (hidden, rows_t, packed, ancestors))
        for s, (_, _, n) in zip(sessions, segments):
            s.length += n
        return [out[i:i + 1, :n] for i, (_, _, n) in enumerate(segments)]

    def _cache(self, job: Job) -> Any:
        cache = self.caches.get(job.sid)
        if cache is None:
            slot = self.slots.take() if self.slots is not None else None
            cache = self.caches[job.sid] = PartCache() if slot is None else SlotSession(slot)
        if cache.length != job.position:
            raise RuntimeError(f"session {job.sid} holds {cache.length} positions here, its segment starts at "
                               f"{job.position}")
        return cache


class ModelEnds:
    """The target's embeddings and head, on the process that serves (a pipeline's rank 0 keeps them). A step's token
    ids and wire states go to the model's device together, and its results come back to the host together."""

    def __init__(self, model: Any):
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.device = model_device(model)

    def kv_cost(self, start: int, stop: int) -> int:
        """Bytes of KV cache per position of a session on layers [start, stop) (wherever its layers run)."""
        return position_bytes(self.model, stop - start)

    def rows(self, wants: Sequence[Tuple[Any, int, int]]) -> List[Optional[np.ndarray]]:
        """What each finished work wants of its output states `out # [1, positions, hidden]`, given as (out, logits,
        states): the float32 logits `# [logits, vocab]` of its last positions (final norm + LM head), or its last deep
        states `# [states, hidden]` float32 for the wire, or None. One head over every work's logits rows; one copy to
        the host of all logits, one of all states."""
        import torch

        heads = [out[0, out.shape[1] - n:] for out, n, _ in wants if n]
        states = [out[0, out.shape[1] - k:] for out, n, k in wants if not n and k]
        logits = (to_host(head_logits(self.model, torch.cat(heads)[None])[0]) if heads else None)
        deep = to_host(torch.cat(states)) if states else None
        result: List[Optional[np.ndarray]] = []
        at_logits = at_states = 0
        for _, n, k in wants:
            if n:
                result.append(logits[at_logits:at_logits + n])
                at_logits += n
            elif k:
                result.append(deep[at_states:at_states + k])
                at_states += k
            else:
                result.append(None)
        return result

    def inputs(self, host: Sequence[np.ndarray]) -> List[Any]:
        """The layers' inputs `# [1, n, hidden]` (the model's dtype, on its device) of a step's segments, each given
        on the host: token ids `# [n]` (int64: their embeddings) or shallow states from the wire `# [n, hidden]`
        (float32). Each kind crosses to the device in one copy, the token ids through one embedding lookup."""
        import torch

        out: List[Any] = [None] * len(host)
        for is_tokens in (True, False):
            idx = [i for i, x in enumerate(host) if (x.ndim == 1) == is_tokens]
            if not idx:
                continue
            x = to_device(np.concatenate([host[i] for i in idx]), self.device)
            with torch.inference_mode():
                x = self.model.model.embed_tokens(x[None]) if is_tokens else x.to(self.dtype)[None]
            at = 0
            for i in idx:
                out[i] = x[:, at:at + len(host[i])]
                at += len(host[i])
        return out


class LocalExecutor:
    """Every layer in this process: a batch is computed when launched."""

    depth = 1  # batches in flight

    def __init__(self, model: Any, layout: KvLayout = KvLayout()):
        self.runner = StageRunner(model, layout=layout)
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
    """The scheduler and an executor: queue sessions' work with its inputs on the host (token ids or wire states),
    `step()` to compute: each launched batch's inputs go to the model's device together (ModelEnds.inputs)."""

    def __init__(self, scheduler: Scheduler, executor: Any, ends: ModelEnds):
        if scheduler.config.max_in_flight != executor.depth:
            raise ValueError(f"the scheduler plans {scheduler.config.max_in_flight} batches ahead, the executor "
                             f"holds {executor.depth}")
        self.scheduler = scheduler
        self.executor = executor
        self.ends = ends
        self._sid = itertools.count(1)
        self._sessions: Dict[Hashable, Tuple[int, int, int]] = {}  # key → (sid, first layer, stop layer)
        self._inputs: Dict[int, np.ndarray] = {}  # id(work) → token ids `# [n]` or states `# [n, hidden]`
        self._partial: Dict[int, List[Any]] = {}  # id(work) → outputs of its segments so far
        self._trees: Dict[int, Tuple[int, ...]] = {}  # id(work) → its positions' parents (a draft tree's verify)
        self._launched: List[Batch] = []  # batches in flight, oldest first
        self.launches = 0  # batches launched so far

    def open(self, key: Hashable, start: int, stop: int, owner: Hashable = None) -> None:
        """A session of device `owner` on layers [start, stop); its cache is empty (SchedulerRefusal if it cannot be
        admitted)."""
        self.scheduler.open(key, owner, self.ends.kv_cost(start, stop))
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
            self._trees.pop(id(w), None)
        return works

    def crop(self, key: Hashable, length: int) -> None:
        self.scheduler.crop(key, length)
        self.executor.apply([(CROP, self._sessions[key][0], length)])

    def keep(self, key: Hashable, start: int, rows: Sequence[int]) -> None:
        """Of a session's positions from `start` on keep only `rows` (offsets, in order): a draft tree's accepted
        path, gathered into place on every stage."""
        self.scheduler.crop(key, start + len(rows))
        self.executor.apply([(KEEP, self._sessions[key][0], [start, *[int(r) for r in rows]])])

    def submit(self, key: Hashable, kind: str, host: np.ndarray, tag: Any = None,
               tree: Optional[Sequence[int]] = None) -> Work:
        """Queue token ids `# [n]` (int64) or shallow states `# [n, hidden]` (float32) of a session (SchedulerRefusal,
        nothing queued, if it cannot be taken); tree: the parent of each position (a draft tree's verify, queued as
        one decode segment: its mask is whole)."""
        work = self.scheduler.submit(key, "decode" if tree is not None else kind, len(host), tag)
        self._inputs[id(work)] = host
        if tree is not None:
            self._trees[id(work)] = tuple(int(p) for p in tree)
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
                jobs.append(Job(sid, start, stop, seg.start, seg.n, self._trees.get(id(seg.work), ())))
                xs.append(self._inputs[id(seg.work)][seg.offset:seg.offset + seg.n])
                if seg.final:
                    del self._inputs[id(seg.work)]
                    self._trees.pop(id(seg.work), None)
            self._launched.append(batch)
            self.launches += 1
            self.executor.launch(batch.step, jobs, self.ends.inputs(xs))
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
