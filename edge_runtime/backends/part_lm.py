"""A draft model made of exported parts (export.graphs), with CausalLM's interface and no torch.

One `PartChainLM` runs one part (a whole draft model) or a chain of them (HAT's input part → Λ → output part, the
split draft w_S) through a backend's part runners (edge_runtime.backends.onnx_backend,
edge_runtime.backends.trt_backend, or TorchPart for validation). Each part's KV cache is a list of arrays, grown by the
graph's `present` outputs and cropped by slicing, so the Drafter (edge_runtime.drafter) keeps its cache convention
unchanged. Draft trees need no other graph: a tree's nodes go through the same parts with the tree's mask and their
positions by depth (hat_split.math.masks.TreeStep), and the accepted path is gathered into place (`keep_rows`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from hat_split.files import bundle as B
from hat_split.models.lm import KVState, board_time, check_crop, check_feed
from hat_split.math.masks import TreeStep, additive


@dataclass
class PartIO:
    """What a part's graph takes and gives, read from its declared inputs (named as hat_split.files.bundle says)."""

    names: List[str]  # inputs in graph order
    float_dtype: np.dtype  # dtype of states, masks and caches
    tokens_in: bool
    logits_out: bool
    cached: List[int]  # cache keys, in graph order
    kv_shape: Tuple[int, int]  # (kv heads, head dim)
    pairs_in: bool = False  # the feature part: `tokens` beside x (the features)
    features_out: bool = False  # the normed features follow the logits (hat_split.files.bundle.FEATURES)

    @staticmethod
    def from_inputs(inputs: Sequence[Tuple[str, np.dtype, Sequence]], outputs: Sequence[str] = ()) -> "PartIO":
        """inputs: (name, numpy dtype, shape with symbolic dims as strings or None); outputs: the output names."""
        by_name = {n: (d, s) for n, d, s in inputs}
        for need in (B.X, B.POSITION_IDS):
            if need not in by_name:
                raise ValueError(f"the graph has no input {need!r}: not a hatspec part (inputs: {list(by_name)})")
        cached = [int(n[len(B.PAST_KEY):]) for n, _, _ in inputs if n.startswith(B.PAST_KEY)]
        tokens_in = np.dtype(by_name[B.X][0]).kind == "i"
        float_inputs = (B.MASK, B.PAST_KEY, B.PAST_VALUE)  # name prefixes: masks (mask_sliding too) and caches
        floats = [d for n, d, _ in inputs if n == B.X and not tokens_in or n.startswith(float_inputs)]
        if not floats:
            raise ValueError("a part taking token ids has layers, so masks and caches: this graph has none")
        float_dtype = np.dtype(floats[0])
        kv = (0, 0)
        if cached:
            shape = by_name[B.past_names(cached[0])[0]][1]
            kv = (int(shape[1]), int(shape[3]))
        return PartIO([n for n, _, _ in inputs], float_dtype, tokens_in, B.LOGIT_INDEX in by_name, cached, kv,
                      B.TOKENS in by_name, B.FEATURES in outputs)

    @property
    def main_outputs(self) -> int:
        """Outputs before the grown caches: the states or logits, and the features where the part gives them."""
        return 2 if self.features_out else 1


class PartRunner(Protocol):
    """A backend's handle on one part: `io` and `run(feed) -> outputs` (output, then presents in `io.cached` order)."""

    io: PartIO
    providers: List[str]  # what actually runs it (execution providers, "tensorrt", "torch")

    def run(self, feed: Dict[str, np.ndarray]) -> List[np.ndarray]: ...


@dataclass
class PartChainLM:
    parts: List[PartRunner]
    vocab_size: int
    window: Optional[int] = None  # sliding window of the model's local layers (Gemma 3)
    slowdown: float = 1.0  # > 1 emulates a slower board (hat_split.models.lm.board_time)
    last_outputs: List[np.ndarray] = field(default_factory=list, init=False)  # each part's output of the last call

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a chain needs at least one part")
        if not self.parts[0].io.tokens_in or not self.parts[-1].io.logits_out:
            raise ValueError("a draft chain must start from token ids and end in logits")

    @property
    def providers(self) -> List[List[str]]:
        return [p.providers for p in self.parts]

    def warm_up(self) -> None:
        self.forward(self.new_state(), [0, 0], n_logits=1)

    def new_state(self) -> KVState:
        return KVState(cache=[empty_cache(p) for p in self.parts])

    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens`; float32 logits `# [n_logits, vocab]` of the last n_logits positions."""
        n = len(tokens)
        check_feed(n, n_logits)
        past = state.length
        t0 = time.perf_counter()
        x: np.ndarray = np.asarray([list(tokens)], dtype=np.int64)
        self.last_outputs = []
        masks: Dict[tuple, np.ndarray] = {}  # built once per forward, shared by the parts of the chain
        for part, cache in zip(self.parts, state.cache):
            x = run_part(part, cache, x, past, n_logits, self.window, masks)
            self.last_outputs.append(x)
        state.length += n
        state.forward_s += board_time(time.perf_counter() - t0, self.slowdown)
        state.forward_tokens += n
        logits = np.asarray(x[0], dtype=np.float32).reshape(-1, self.vocab_size)
        return logits[logits.shape[0] - n_logits:]

    def forward_tree(self, state: KVState, parents: Sequence[int], tokens: Sequence[int], start: int) -> np.ndarray:
        """A draft tree's new nodes (the last len(tokens) entries of `parents`, the tree so far) on a tree begun at
        cache position `start`, its earlier nodes the cache's positions from there; float32 logits
        `# [len(tokens), vocab]` after each new node. The nodes stay in the cache until `keep`."""
        n = len(tokens)
        if not n:
            raise ValueError("a tree step needs at least one node")
        tree = TreeStep.make(start, parents, state.length - start, n)
        t0 = time.perf_counter()
        x: np.ndarray = np.asarray([list(tokens)], dtype=np.int64)
        masks: Dict[tuple, np.ndarray] = {}
        for part, cache in zip(self.parts, state.cache):
            x = run_part(part, cache, x, state.length, n, self.window, masks, tree)
        state.length += n
        state.forward_s += board_time(time.perf_counter() - t0, self.slowdown)
        state.forward_tokens += n
        return np.asarray(x[0], dtype=np.float32).reshape(n, self.vocab_size)

    def keep(self, state: KVState, start: int, rows: Sequence[int]) -> None:
        """Of the tree begun at `start`, keep the nodes `rows` (the accepted path, offsets from start) in place."""
        for cache in state.cache:
            cache[:] = keep_rows(cache, start, state.length, rows)
        state.length = start + len(rows)

    def crop(self, state: KVState, length: int) -> None:
        check_crop(state, length)
        for cache in state.cache:
            cache[:] = [a[:, :, :length] for a in cache]
        state.length = length


def run_part(part: PartRunner, cache: List[np.ndarray], x: np.ndarray, past: int, n_logits: int,
             window: Optional[int], masks: Optional[Dict[tuple, np.ndarray]] = None,
             tree: Optional[TreeStep] = None) -> np.ndarray:
    """One part over the positions past .. past + n - 1 of `x` (ids `# [1, n]` or states `# [1, n, hidden]`): its
    output (states, or logits `# [1, max(n_logits, 1), vocab]`); `cache` (the part's past keys and values, in
    `io.cached` order) is replaced by the grown one. `masks` shares the masks between the parts of one step. `tree`:
    the n positions are a draft tree's new nodes (their positions by depth, each seeing its ancestors only)."""
    return run_part_outputs(part, cache, x, past, n_logits, window, masks, tree=tree)[0]


def run_part_outputs(part: PartRunner, cache: List[np.ndarray], x: np.ndarray, past: int, n_logits: int,
                     window: Optional[int], masks: Optional[Dict[tuple, np.ndarray]] = None,
                     tokens: Optional[np.ndarray] = None, tree: Optional[TreeStep] = None) -> List[np.ndarray]:
    """`run_part`'s, with every output before the caches (`io.main_outputs`: the features after the logits where the
    part gives them); `tokens`: the feature part's token states `# [1, n, hidden]`."""
    io = part.io
    n = x.shape[1]
    if io.pairs_in != (tokens is not None):
        raise ValueError("the feature part takes token states beside the features; no other part does")
    masks = {} if masks is None else masks
    if tree is not None and (tree.start + tree.earlier != past or tree.depth.size - tree.earlier != n):
        raise ValueError(f"the tree step covers {tree.depth.size - tree.earlier} nodes after "
                         f"{tree.start + tree.earlier} positions; the part is at {past} with {n}")
    positions = np.arange(past, past + n, dtype=np.int64) if tree is None else tree.positions
    feed = {B.X: x if io.tokens_in else x.astype(io.float_dtype, copy=False), B.POSITION_IDS: positions[None]}
    if tokens is not None:
        if tokens.shape[:2] != x.shape[:2]:
            raise ValueError(f"{tokens.shape[1]} token states for {n} features")
        feed[B.TOKENS] = tokens.astype(io.float_dtype, copy=False)
    for name, w in ((B.MASK, None), (B.MASK_SLIDING, window)):
        if name in io.names:
            key = (w, io.float_dtype)
            if key not in masks:
                masks[key] = additive(past, n, w, io.float_dtype) if tree is None else tree.additive(w, io.float_dtype)
            feed[name] = masks[key]
    if io.logits_out:  # at least one row: no graph ever sees an empty tensor there
        feed[B.LOGIT_INDEX] = np.arange(n - max(n_logits, 1), n, dtype=np.int64)
    for j, layer in enumerate(io.cached):
        key, value = B.past_names(layer)
        feed[key], feed[value] = cache[2 * j], cache[2 * j + 1]
    outs = part.run(feed)
    cache[:] = outs[io.main_outputs:]
    return list(outs[:io.main_outputs])


def keep_rows(arrays: List[np.ndarray], start: int, length: int, rows: Sequence[int]) -> List[np.ndarray]:
    """A part's keys and values `# [1, kv_heads, length, head_dim]` each, keeping of the positions from `start` only
    `rows` (offsets from start, in order), closed up: a draft tree's accepted path moved into place, the other
    branches dropped (gathered, not recomputed)."""
    if not 0 <= start <= length or any(not 0 <= r < length - start for r in rows):
        raise ValueError(f"cannot keep rows {list(rows)} after position {start} of a cache of {length}")
    index = np.concatenate([np.arange(start), start + np.asarray(rows, dtype=np.int64)]).astype(np.int64)
    return [a[:, :, index] for a in arrays]


def empty_cache(part: PartRunner) -> List[np.ndarray]:
    """A part's cache of no positions: keys and values `# [1, kv_heads, 0, head_dim]` per cached layer."""
    empty = np.zeros((1, part.io.kv_shape[0], 0, part.io.kv_shape[1]), dtype=part.io.float_dtype)
    return [empty] * (2 * len(part.io.cached))
