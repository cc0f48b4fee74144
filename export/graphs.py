"""Torch modules with every input explicit, for export: one part of a decoder model.

A part is: token embeddings (or hidden states in), the model's layers [start, stop), optionally Λ (the distilled
adapter) after them, and optionally final norm + head. The feature part is the feature drafter
(hat_split.models.feature_drafter): pairs of features and token states in, its fusion layer, decoder layer and norm,
then the draft head (the model's head, or its rows of a draft vocabulary). Its KV cache goes in as tensors and comes out
grown by the new positions (`present = past ++ new`); positions and the additive causal mask (and, for Gemma 3's local
layers, the sliding-window mask) are inputs, so one graph serves a prefill, a chunk on top of a cache and a single step.
The runtime (edge_runtime.backends.part_lm) builds the masks with hat_split.math.masks and crops caches by slicing; no
torch on the device.

Graph inputs, in order: `x` (int64 `# [1, n]` ids or `# [1, n, hidden]` states), `position_ids` int64 `# [1, n]`,
(the feature part: `tokens` `# [1, n, hidden]`), `mask` `# [1, 1, n, past + n]` (then `mask_sliding` when a sliding
layer is in the part), `logit_index` int64 `# [k]` (parts with a head: the positions whose logits are wanted), then
`past_key_<i>`, `past_value_<i>` per cached layer i `# [1, kv_heads, past, head_dim]`. Outputs: `hidden`
`# [1, n, hidden]` or `logits` float32 `# [1, k, vocab]`, (the feature part, and an output part exported for it:
`features` `# [1, n, hidden]`), then `present_key_<i>`, `present_value_<i>`. The names are the bundle contract's
(hat_split.files.bundle), which the device's runners read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from edge_runtime.backends.part_lm import PartIO
from hat_split.files import bundle as B
from hat_split.models.partition import SLIDING, Stack, additive_mask, head_logits, layer_types, lm_head_logits

@dataclass(frozen=True)
class PartSpec:
    """Which slice of the model a graph holds (one row of a bundle's manifest)."""

    name: str  # draft: the whole model; input / adapter / feature / output: HAT's device parts
    start: int  # first model layer
    stop: int  # one past the last model layer
    adapter: bool  # Λ runs after the model layers
    tokens_in: bool  # x is token ids (embeddings inside) rather than hidden states
    logits_out: bool  # final norm + head at the end
    drafter: bool = False  # the feature drafter: x the features, `tokens` the token states; its head at the end
    features_out: bool = False  # the normed features (the feature part: f̂) follow the logits

    @staticmethod
    def of(kind: str, n_layers: int, m: int = 0, tail: int = 0, features: bool = False) -> "PartSpec":
        """The standard parts: a whole draft model, or HAT's device parts of a model cut at m (with `tail` layers kept
        beside the head). features: the output part also gives the normed features (what the feature part reads)."""
        if kind == "draft":
            return PartSpec("draft", 0, n_layers, False, True, True)
        if not 1 <= m < n_layers - tail:
            raise ValueError(f"a cut at m={m} with tail={tail} leaves no middle layer of {n_layers}")
        if kind == "input":
            return PartSpec("input", 0, m, False, True, False)
        if kind == "adapter":
            return PartSpec("adapter", m, m, True, False, False)
        if kind == "feature":
            return PartSpec("feature", m, m, False, False, True, drafter=True, features_out=True)
        if kind == "output":
            return PartSpec("output", n_layers - tail, n_layers, False, False, True, features_out=features)
        raise ValueError(f"unknown part {kind!r}; known: {', '.join(B.PARTS)}")

    def cached_layers(self, n_layers: int) -> List[int]:
        """Cache keys of the part's attention layers (Λ's key is n_layers, the feature drafter's n_layers + 1, as in
        hat_split.models.adapter and hat_split.models.feature_drafter)."""
        own = [n_layers] if self.adapter else [n_layers + 1] if self.drafter else []
        return list(range(self.start, self.stop)) + own

    def mask_kinds(self, config: Any, adapter_type: Optional[str] = None) -> List[str]:
        """The attention kinds present (full first): one mask input each."""
        kinds = set(layer_types(config)[self.start:self.stop])
        if self.adapter or self.drafter:
            kinds.add(adapter_type)
        return sorted(kinds, key=lambda k: k == SLIDING)

    def input_names(self, config: Any, adapter_type: Optional[str] = None) -> List[str]:
        names = [B.X, B.POSITION_IDS] + ([B.TOKENS] if self.drafter else [])
        names += [B.MASK_SLIDING if k == SLIDING else B.MASK for k in self.mask_kinds(config, adapter_type)]
        names += [B.LOGIT_INDEX] if self.logits_out else []
        for i in self.cached_layers(config.num_hidden_layers):
            names += B.past_names(i)
        return names

    def output_names(self, config: Any) -> List[str]:
        names = [B.LOGITS if self.logits_out else B.HIDDEN] + ([B.FEATURES] if self.features_out else [])
        for i in self.cached_layers(config.num_hidden_layers):
            names += B.present_names(i)
        return names


def part_specs(kinds: List[str], n_layers: int, m: int, tail: int) -> List[PartSpec]:
    """The specs of a bundle's parts: with the feature part, the output part gives the features it reads."""
    return [PartSpec.of(k, n_layers, m, tail, features="feature" in kinds) for k in kinds]


class KVIO:
    """`past_key_values` for one traced call: layer i's past comes in as tensors, `update` returns past ++ new and keeps
    it as the layer's present."""

    def __init__(self, past: Dict[int, Tuple[Any, Any]]):
        self.past = past
        self.present: Dict[int, Tuple[Any, Any]] = {}

    def update(self, key: Any, value: Any, layer_idx: int, *_: Any, **__: Any) -> Tuple[Any, Any]:
        k0, v0 = self.past[layer_idx]
        k, v = torch.cat([k0, key], dim=-2), torch.cat([v0, value], dim=-2)
        self.present[layer_idx] = (k, v)
        return k, v


class PartGraph(torch.nn.Module):
    """The export module of one PartSpec over a loaded model (and its draft module: Λ, or the feature drafter, whose
    head reads `rows`, hat_split.models.partition.head_rows, when over a draft vocabulary). forward takes and returns
    flat tensors."""

    def __init__(self, model: Any, spec: PartSpec, adapter: Any = None, rows: Any = None):
        super().__init__()
        if (spec.adapter or spec.drafter) and adapter is None:
            raise ValueError(f"part {spec.name!r} needs the {'feature drafter' if spec.drafter else 'adapter'}")
        self.model, self.spec, self.adapter, self.rows = model, spec, adapter, rows
        layer = adapter.layer if spec.drafter else adapter if spec.adapter else None
        extra = [(layer, adapter.layer_type)] if layer is not None else []
        self.stack = Stack(model, spec.start, spec.stop, extra_layers=extra)
        self.kinds = spec.mask_kinds(model.config, adapter.layer_type if adapter is not None else None)
        self.cached = spec.cached_layers(model.config.num_hidden_layers)

    def forward(self, x, position_ids, *rest):
        tokens = None
        if self.spec.drafter:
            tokens, rest = rest[0], rest[1:]
        masks = dict(zip(self.kinds, rest[:len(self.kinds)]))
        rest = rest[len(self.kinds):]
        logit_index = None
        if self.spec.logits_out:
            logit_index, rest = rest[0], rest[1:]
        past = {i: (rest[2 * j], rest[2 * j + 1]) for j, i in enumerate(self.cached)}
        kv = KVIO(past)
        hidden = self.model.model.embed_tokens(x) if self.spec.tokens_in else x
        if tokens is not None:
            hidden = self.adapter.fuse(hidden, tokens)
        if len(self.stack):
            hidden = self.stack.run_layers(kv, hidden, lambda kind, window: masks[kind], position_ids, True)
        outs = [hidden]
        if self.spec.features_out:  # the feature drafter's own norm, or the model's final norm
            hidden = self.adapter.norm_o(hidden) if self.spec.drafter else self.model.model.norm(hidden)
            outs = [lm_head_logits(self.model, hidden.index_select(1, logit_index), True, self.rows), hidden]
        elif self.spec.logits_out:
            outs = [head_logits(self.model, hidden.index_select(1, logit_index), train=True).float()]
        presents = [t for i in self.cached for t in kv.present[i]]
        return (*outs, *presents)


def example_inputs(model: Any, spec: PartSpec, adapter: Any = None, n: int = 3, past: int = 4,
                   dtype: Any = None) -> Tuple[Any, ...]:
    """Inputs for tracing (sizes > 1 so that no dimension is specialised): n new positions on a cache of `past`."""
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    window = getattr(cfg, "sliding_window", None)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randint(0, cfg.vocab_size, (1, n), generator=gen) if spec.tokens_in
         else torch.randn(1, n, cfg.hidden_size, generator=gen).to(dtype))
    args = [x, torch.arange(past, past + n)[None]]
    if spec.drafter:
        args.append(torch.randn(1, n, cfg.hidden_size, generator=gen).to(dtype))
    for kind in spec.mask_kinds(cfg, adapter.layer_type if adapter is not None else None):
        args.append(additive_mask(past, n, window if kind == SLIDING else None, dtype))
    if spec.logits_out:
        args.append(torch.arange(n))
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for _ in spec.cached_layers(cfg.num_hidden_layers):
        args += [torch.randn(1, heads, past, head_dim, generator=gen).to(dtype) for _ in range(2)]
    return tuple(args)


class TorchPart:
    """A PartGraph run eagerly in torch behind the part-runner interface (edge_runtime.backends.part_lm): the
    reference that artifacts are validated against, and proof that the graphs compute what the model does."""

    providers = ["torch"]

    def __init__(self, model: Any, spec: PartSpec, adapter: Any = None, rows: Any = None):
        self.graph = PartGraph(model, spec, adapter, rows).eval()
        self.names = spec.input_names(model.config, adapter.layer_type if adapter is not None else None)
        dtype = {torch.float32: np.float32, torch.float16: np.float16}[next(model.parameters()).dtype]
        example = example_inputs(model, spec, adapter)
        self.io = PartIO.from_inputs([(n, np.int64 if t.dtype == torch.long else dtype, tuple(t.shape))
                                      for n, t in zip(self.names, example)], spec.output_names(model.config))

    def run(self, feed):
        with torch.inference_mode():
            outs = self.graph(*[torch.from_numpy(feed[n]) for n in self.names])
        return [o.numpy() for o in outs]
