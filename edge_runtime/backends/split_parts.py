"""The device's parts of a split model behind one interface, so HAT and U-shape run on any backend.

`SplitDrafter` (edge_runtime.split_drafter) needs five operations on per-part caches — the input part over tokens,
Λ over shallow states, the output part (tail layers, norm, head) over states, and cropping and forking a cache — plus
the cut's identity for OpenSplit and the conversion of states to and from the wire's float32 rows. Two backends give
them:

- `TorchSplitParts`: a `SplitModel` (and its `Adapter`) in torch; states are torch tensors of the model's dtype.
- `BundleSplitParts`: a hat-export bundle's `input`, `adapter` (or `feature`) and `output` graphs run by onnxruntime
  or TensorRT part runners (edge_runtime.backends.part_lm); states are numpy arrays of the graphs' float dtype, caches
  are `ArrayCache`s. No torch on the device. Draft trees run through the same graphs, fed a tree's mask and positions.

Both compute the same functions (export.validate checks the graphs against torch), so a bundle's device speaks the same
protocol to the same cloud as a torch device with the same weights (the fingerprint in OpenSplit is the model's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from edge_runtime.backends.part_lm import PartRunner, empty_cache, keep_rows, run_part_outputs
from hat_split.math.masks import TreeStep
from hat_split.models.partition import PartCache
from hat_split.models.placement import model_device, to_device, to_host


class PartCacheLike(Protocol):
    length: int

    def crop(self, length: int) -> None: ...

    def fork(self) -> "PartCacheLike": ...


class SplitParts(Protocol):
    """What the device holds of a model cut at m with `tail` layers beside the head."""

    fingerprint: str  # the whole model's weight fingerprint (hat_split.models.partition.model_fingerprint)
    m: int  # layers in the input part
    stop: int  # first layer of the output part (n_layers - tail)
    tail: int
    hidden_size: int
    has_adapter: bool  # a draft module of either kind (protocol hat)
    kind: str  # which: "adapter" (Λ), "feature" (hat_split.models.feature_drafter), "" (none: U-shape only)
    token_input: str  # a feature drafter's: "shallow" or "embedding" (then drafting needs no input part)
    vocab: int  # the head's rows
    draft_ids: Optional[np.ndarray]  # the draft's tokens when it drafts over a subset (split.draft_vocab), else None

    def new_cache(self) -> PartCacheLike: ...

    def run_input(self, cache: Any, tokens: Sequence[int]) -> Any: ...  # shallow states `# [1, n, hidden]`

    def run_adapter(self, cache: Any, states: Any) -> Any: ...  # Λ: `# [1, n, hidden]` → same

    def run_output(self, cache: Any, states: Any, n_logits: int, draft: bool = False) -> np.ndarray: ...
    # float32 `# [n_logits, vocab]`; draft=True with draft_ids: `# [n_logits, len(draft_ids)]` over those tokens

    def run_output_features(self, cache: Any, states: Any, n_logits: int) -> Tuple[np.ndarray, Any]: ...
    # run_output's logits and the normed features `# [1, n, hidden]` of every position (kind "feature")

    def run_feature(self, cache: Any, features: Any, states: Any, tokens: Sequence[int]) -> Tuple[np.ndarray, Any]: ...
    # the feature drafter over n pairs (f_{p-1}, the token's shallow state / id): the last position's draft logits
    # float32 `# [1, vocab or len(draft_ids)]` and the predicted features `# [1, n, hidden]`

    def zeros(self, n: int) -> Any: ...  # `# [1, n, hidden]` of the states' type (the feature before position 0)

    def cat(self, states: List[Any]) -> Any: ...  # along positions

    def to_wire(self, states: Any) -> np.ndarray: ...  # `# [1, n, hidden]` → float32 `# [n, hidden]`

    def from_wire(self, rows: np.ndarray) -> Any: ...  # float32 `# [n, hidden]` → `# [1, n, hidden]`


@dataclass
class TorchSplitParts:
    split: Any  # hat_split.models.partition.SplitModel
    adapter: Any = None  # the draft module: an Adapter (Λ) or a FeatureDrafter; None: U-shape only
    draft_ids: Optional[np.ndarray] = None  # the draft's head over these tokens only (their weight rows, copied)

    def __post_init__(self) -> None:
        from hat_split.models.adapter import adapter_stack
        from hat_split.models.feature_drafter import FeatureDrafter
        from hat_split.models.partition import head_rows

        self.kind = ("" if self.adapter is None else
                     "feature" if isinstance(self.adapter, FeatureDrafter) else "adapter")
        self.lam_stack = adapter_stack(self.split, self.adapter) if self.kind == "adapter" else None
        self.feature_stack = self.adapter.stack(self.split) if self.kind == "feature" else None
        self.token_input = self.adapter.token_input if self.kind == "feature" else ""
        self.vocab = int(self.split.model.lm_head.weight.shape[0])
        self._draft_rows = None if self.draft_ids is None else head_rows(self.split.model, self.draft_ids)
        self.fingerprint = self.split.fingerprint()
        self.m, self.tail = self.split.m, self.split.tail
        self.stop = int(self.split.model.config.num_hidden_layers) - self.tail
        self.hidden_size = self.split.hidden_size
        self.has_adapter = self.adapter is not None

    def new_cache(self):
        return PartCache()

    def run_input(self, cache, tokens: Sequence[int]):
        return self.split.run_input(cache, tokens)

    def run_adapter(self, cache, states):
        if self.lam_stack is None:
            raise RuntimeError("these parts have no adapter (protocol hat needs one)")
        return self.lam_stack.forward(cache, states)

    def run_output(self, cache, states, n_logits: int, draft: bool = False) -> np.ndarray:
        return to_host(self.split.run_output(cache, states, n_logits, self._draft_rows if draft else None))

    def run_output_features(self, cache, states, n_logits: int) -> Tuple[np.ndarray, Any]:
        logits, features = self.split.run_output(cache, states, n_logits, features=True)
        return to_host(logits), features

    # -- draft trees (hat_split.math.tree): the same parts with a tree's mask; `parents` is the tree so far, its last
    # n entries the new positions, begun at cache position `start` (Stack.forward_tree) --
    def run_input_tree(self, cache, tokens: Sequence[int], parents: Sequence[int], start: int):
        return self.split.input.forward_tree(cache, self.split.embed(tokens), parents, start)

    def run_adapter_tree(self, cache, states, parents: Sequence[int], start: int):
        if self.lam_stack is None:
            raise RuntimeError("draft trees are drafted by Λ; these parts have none")
        return self.lam_stack.forward_tree(cache, states, parents, start)

    def run_output_tree(self, cache, states, parents: Sequence[int], start: int, draft: bool = False) -> np.ndarray:
        """Float32 logits `# [n, vocab]` (the draft's subset with `draft` and draft_ids) after every new position."""
        return self.head_at(self.run_tail_tree(cache, states, parents, start), range(states.shape[1]), draft)

    def run_tail_tree(self, cache, states, parents: Sequence[int], start: int):
        """The output part's tail layers over a tree's new positions (what the head reads, `# [1, n, hidden]`)."""
        if len(self.split.output):
            return self.split.output.forward_tree(cache, states, parents, start)
        cache.length += states.shape[1]  # norm and head only: the cache counts positions
        return states

    def head_at(self, states, positions: Sequence[int], draft: bool = False) -> np.ndarray:
        """Norm and head over some positions of `states # [1, n, hidden]`: float32 `# [len(positions), vocab]`."""
        from hat_split.models.partition import head_logits

        rows = states[:, list(positions)]
        return to_host(head_logits(self.split.model, rows, rows=self._draft_rows if draft else None)[0])

    def run_feature(self, cache, features, states, tokens: Sequence[int]) -> Tuple[np.ndarray, Any]:
        from hat_split.models.feature_drafter import draft_logits, token_states

        if self.feature_stack is None:
            raise RuntimeError("these parts have no feature drafter")
        fhat = self.adapter.step(self.feature_stack, cache, features,
                                 token_states(self.split, self.adapter, states, tokens))
        return to_host(draft_logits(self.split.model, fhat[:, -1:], self._draft_rows)[0]), fhat

    def run_feature_tree(self, cache, features, states, tokens: Sequence[int], parents: Sequence[int],
                         start: int) -> Tuple[np.ndarray, Any]:
        """The feature drafter over a draft tree's new nodes (their pairs' features and states `# [1, n, hidden]`,
        states None for embeddings): float32 draft logits `# [n, vocab or subset]` after each, and their f̂."""
        from hat_split.models.feature_drafter import draft_logits, token_states

        if self.feature_stack is None:
            raise RuntimeError("these parts have no feature drafter")
        fhat = self.adapter.step_tree(self.feature_stack, cache, features,
                                      token_states(self.split, self.adapter, states, tokens), parents, start)
        return to_host(draft_logits(self.split.model, fhat, self._draft_rows)[0]), fhat

    def features_at(self, states, positions: Sequence[int]):
        """The target's features `# [1, k, hidden]` (normed: what the head reads) at some positions of the output
        part's states `# [1, n, hidden]` (a tree's, `run_tail_tree`)."""
        import torch

        with torch.inference_mode():
            return self.split.model.model.norm(states[:, list(positions)])

    def zeros(self, n: int):
        import torch

        weight = self.split.model.model.embed_tokens.weight
        return torch.zeros(1, n, self.hidden_size, dtype=weight.dtype, device=weight.device)

    def cat(self, states: List[Any]):
        import torch

        return torch.cat(states, dim=1)

    def to_wire(self, states) -> np.ndarray:
        return to_host(states[0])

    def from_wire(self, rows: np.ndarray):
        return to_device(rows, model_device(self.split.model), self.split.dtype)[None]


@dataclass
class ArrayCache:
    """One exported part's cache: its `present` arrays (keys and values per cached layer) and the positions held."""

    arrays: List[np.ndarray]
    length: int = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if length < self.length:
            self.arrays = [a[:, :, :length] for a in self.arrays]
            self.length = length

    def fork(self) -> "ArrayCache":
        return ArrayCache(list(self.arrays), self.length)  # arrays are replaced, never written: sharing is safe

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Of the positions from `start` on keep only `rows` (offsets from start, in order), closed up: a draft
        tree's accepted path (a part without layers keeps only the count)."""
        self.arrays = keep_rows(self.arrays, start, self.length, rows)
        self.length = start + len(rows)


@dataclass
class BundleTreeStates:
    """What a bundle's output part makes of a draft tree's 1 + N deep states. Its graph is fused (tail layers, norm,
    head and the features), so the rows verification reads are computed by it, each once: on demand, a call per
    read, where the part has no layers (norm and head only: most of the device's verify work is the head, and a
    walk reads the accepted path's rows and one more), else all at once under the tree's mask."""

    parts: "BundleSplitParts"
    deep: Optional[np.ndarray]  # `# [1, n, hidden]` while rows are computed on demand
    logits: Dict[int, np.ndarray] = field(default_factory=dict)  # row → float32 `# [vocab]`
    features: Dict[int, np.ndarray] = field(default_factory=dict)  # row → `# [1, 1, hidden]`

    def take(self, positions: Sequence[int]) -> None:
        missing = [i for i in dict.fromkeys(positions) if i not in self.logits]
        if missing:
            outs = self.parts._run(self.parts.output, ArrayCache([]), self.deep[:, missing], len(missing))
            self.fill(missing, outs)

    def fill(self, rows: Sequence[int], outs: List[np.ndarray]) -> None:
        logits = np.asarray(outs[0][0], dtype=np.float32)
        for k, i in enumerate(rows):
            self.logits[i] = logits[k]
            if len(outs) > 1:
                self.features[i] = outs[1][:, k:k + 1]


def _check_logits(n_logits: int, n: int) -> None:
    if not 0 <= n_logits <= n:
        raise ValueError(f"n_logits={n_logits} must be in [0, {n}]")


@dataclass
class BundleSplitParts:
    input: PartRunner
    output: PartRunner
    adapter: Optional[PartRunner]  # Λ; None: U-shape, or the feature drafter
    model: dict  # the bundle manifest's `model` record
    window: Optional[int] = None  # Gemma 3's sliding window
    feature: Optional[PartRunner] = None  # the feature drafter (its head over draft_ids when given)
    draft_ids: Optional[np.ndarray] = None  # the feature part's draft vocabulary (None: the whole head); Λ's output
    # part is always the whole head
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        m = self.model
        self.fingerprint, self.m, self.tail = m["fingerprint"], int(m["m"]), int(m["tail"])
        self.stop = int(m["layers"]) - self.tail
        self.hidden_size = int(m["hidden"])
        self.vocab = int(m["vocab"])
        if self.adapter is not None and self.feature is not None:
            raise ValueError("a device drafts with Λ or with the feature drafter, not both")
        self.has_adapter = self.adapter is not None or self.feature is not None
        self.kind = "feature" if self.feature is not None else "adapter" if self.adapter is not None else ""
        self.token_input = "shallow" if self.feature is not None else ""
        self.state_dtype = self.output.io.float_dtype
        for name, part, tokens_in, logits_out in (("input", self.input, True, False),
                                                  ("output", self.output, False, True),
                                                  ("adapter", self.adapter, False, False),
                                                  ("feature", self.feature, False, True)):
            if part is not None and (part.io.tokens_in, part.io.logits_out) != (tokens_in, logits_out):
                raise ValueError(f"the {name} graph does not take and give what an {name} part does")
        if self.feature is not None and not (self.feature.io.pairs_in and self.feature.io.features_out):
            raise ValueError("the feature graph does not take the pairs and give the features a feature part does")
        if self.feature is not None and not self.output.io.features_out:
            raise ValueError("the bundle's output part gives no features, which the feature drafter reads: export "
                             "the bundle again with hat-export onnx --parts hat-feature")

    def new_cache(self) -> ArrayCache:
        return ArrayCache([])  # a part's empty arrays come with its first run (`_run`)

    def run_input(self, cache: ArrayCache, tokens: Sequence[int]) -> np.ndarray:
        if not tokens:
            raise ValueError("run_input needs at least one token")
        return self._run(self.input, cache, np.asarray([list(tokens)], dtype=np.int64), 0)[0]

    def run_adapter(self, cache: ArrayCache, states: np.ndarray) -> np.ndarray:
        if self.adapter is None:
            raise RuntimeError("these parts have no adapter (protocol hat needs one)")
        return self._run(self.adapter, cache, states, 0)[0]

    def run_output(self, cache: ArrayCache, states: np.ndarray, n_logits: int, draft: bool = False) -> np.ndarray:
        if n_logits == 0 and not self.output.io.cached:  # norm + head only: nothing to remember, nothing to compute
            _check_logits(n_logits, states.shape[1])
            cache.length += states.shape[1]
            return np.zeros((0, self.vocab), np.float32)
        return self._output(cache, states, n_logits)[0]

    def run_output_features(self, cache: ArrayCache, states: np.ndarray, n_logits: int) -> Tuple[np.ndarray, Any]:
        if not self.output.io.features_out:
            raise RuntimeError("the bundle's output part gives no features (hat-export onnx --parts hat-feature)")
        logits, features = self._output(cache, states, n_logits)
        return logits, features

    def _output(self, cache: ArrayCache, states: np.ndarray, n_logits: int) -> List[Any]:
        """The output part's outputs, its logits cut to the last n_logits rows as float32 `# [n_logits, vocab]`."""
        _check_logits(n_logits, states.shape[1])
        outs = self._run(self.output, cache, states, n_logits)
        logits = outs[0]
        return [np.asarray(logits[0], dtype=np.float32)[logits.shape[1] - n_logits:], *outs[1:]]

    def run_feature(self, cache: ArrayCache, features: np.ndarray, states: np.ndarray,
                    tokens: Sequence[int]) -> Tuple[np.ndarray, Any]:
        if self.feature is None:
            raise RuntimeError("these parts have no feature drafter")
        logits, fhat = self._run(self.feature, cache, features, 1, tokens=states)
        return np.asarray(logits[0, -1:], dtype=np.float32), fhat

    # -- draft trees (hat_split.math.tree): the same graphs, fed the tree's mask and its nodes' positions by depth
    # (hat_split.math.masks.TreeStep); `parents` is the tree so far, its last n entries the new positions, begun at
    # cache position `start` (TorchSplitParts' methods of the same names) --
    def run_input_tree(self, cache: ArrayCache, tokens: Sequence[int], parents: Sequence[int],
                       start: int) -> np.ndarray:
        x = np.asarray([list(tokens)], dtype=np.int64)
        return self._run(self.input, cache, x, 0, tree=_tree_step(cache, parents, start, x.shape[1]))[0]

    def run_adapter_tree(self, cache: ArrayCache, states: np.ndarray, parents: Sequence[int],
                         start: int) -> np.ndarray:
        if self.adapter is None:
            raise RuntimeError("draft trees are drafted by Λ; these parts have none")
        return self._run(self.adapter, cache, states, 0, tree=_tree_step(cache, parents, start, states.shape[1]))[0]

    def run_output_tree(self, cache: ArrayCache, states: np.ndarray, parents: Sequence[int], start: int,
                        draft: bool = False) -> np.ndarray:
        """Float32 logits `# [n, vocab]` after every new position (a bundle's output part is the whole head)."""
        n = states.shape[1]
        return np.asarray(self._run(self.output, cache, states, n, tree=_tree_step(cache, parents, start, n))[0][0],
                          dtype=np.float32)

    def run_tail_tree(self, cache: ArrayCache, states: np.ndarray, parents: Sequence[int],
                      start: int) -> BundleTreeStates:
        """The output part over a tree's 1 + N deep states (`BundleTreeStates`: head_at and features_at read it)."""
        n = states.shape[1]
        step = _tree_step(cache, parents, start, n)  # the tree is checked here whichever way its rows are computed
        if not self.output.io.cached:  # norm and head only: rows on demand; the cache counts positions
            cache.length += n
            return BundleTreeStates(self, states)
        out = BundleTreeStates(self, None)
        out.fill(range(n), self._run(self.output, cache, states, n, tree=step))
        return out

    def head_at(self, states: BundleTreeStates, positions: Sequence[int], draft: bool = False) -> np.ndarray:
        """Float32 `# [len(positions), vocab]` of a tree's rows (the whole head: a bundle's output part)."""
        states.take(positions)
        return np.stack([states.logits[i] for i in positions])

    def features_at(self, states: BundleTreeStates, positions: Sequence[int]) -> np.ndarray:
        """The target's features `# [1, k, hidden]` at some rows of a tree's output (the feature drafter's pairs)."""
        if not self.output.io.features_out:
            raise RuntimeError("the bundle's output part gives no features (hat-export onnx --parts hat-feature)")
        states.take(positions)
        return np.concatenate([states.features[i] for i in positions], axis=1)

    def run_feature_tree(self, cache: ArrayCache, features: np.ndarray, states: np.ndarray, tokens: Sequence[int],
                         parents: Sequence[int], start: int) -> Tuple[np.ndarray, Any]:
        """The feature part over a tree's new nodes (their pairs): draft logits `# [n, vocab or subset]`, f̂."""
        if self.feature is None:
            raise RuntimeError("these parts have no feature drafter")
        n = features.shape[1]
        logits, fhat = self._run(self.feature, cache, features, n, tokens=states,
                                 tree=_tree_step(cache, parents, start, n))
        return np.asarray(logits[0], dtype=np.float32), fhat

    def zeros(self, n: int) -> np.ndarray:
        return np.zeros((1, n, self.hidden_size), dtype=self.state_dtype)

    def cat(self, states: List[np.ndarray]) -> np.ndarray:
        return np.concatenate(states, axis=1)

    def to_wire(self, states: np.ndarray) -> np.ndarray:
        return np.asarray(states[0], dtype=np.float32)

    def from_wire(self, rows: np.ndarray) -> np.ndarray:
        return rows.astype(self.state_dtype, copy=False)[None]

    def _run(self, part: PartRunner, cache: ArrayCache, x: np.ndarray, n_logits: int,
             tokens: Optional[np.ndarray] = None, tree: Optional[TreeStep] = None) -> List[np.ndarray]:
        if x.shape[1] < 1:
            raise ValueError("a part needs at least one position")
        if not cache.arrays:
            cache.arrays = empty_cache(part)
        out = run_part_outputs(part, cache.arrays, x, cache.length, n_logits, self.window, tokens=tokens, tree=tree)
        cache.length += x.shape[1]
        return out


def _tree_step(cache: ArrayCache, parents: Sequence[int], start: int, n: int) -> TreeStep:
    """A tree step of n new nodes on a part's cache that holds the tree's earlier nodes after `start`."""
    return TreeStep.make(start, parents, cache.length - start, n)
