"""HAT's draft adapter Λ and the draft model w_S = output part ∘ Λ ∘ input part (paper 004, §3.4).

Λ has the structure of one decoder self-attention block of the model it is cut from: the pre-attention norm, the
self-attention (with the family's own rotary embedding, grouped KV heads and, for Gemma 3, q/k norms), the
post-attention norm where the family has one (Gemma's sandwich norm) and the residual. Its starting point for
distillation (`ADAPTER_INITS`) is a copy of layer m (the first middle layer), a copy of the model's last layer, or
random weights with the family's initialiser scale; docs/HAT.md has what each reaches. Its trained parameter count is
what the paper's Table 4 reports (67M for Vicuna-7B: 4 · 4096²).

Λ runs as an extra layer of a `Stack` with its own PartCache, keyed by a layer index past the model's last, so its KV
cache never collides with the model's layers.

Artifact: a directory with `adapter.safetensors` (Λ's weights) and `adapter.json` (format, base model name and
fingerprint, cut, layer type, parameter count, training record), and `draft_vocab.npy`: the token ids of the
distillation data ranked by frequency, from which a device may draft over the N most frequent only (`split.draft_vocab`:
a head N rows tall instead of the vocabulary's; verification still uses the whole head, so the output is exact).
`load_adapter` refuses an adapter made for another model or cut with the reason.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np

from hat_split.files.atomic import write_json
from hat_split.models.hf_cache import cache_kwargs
from hat_split.models.partition import SplitModel, Stack, layer_types, model_fingerprint

ADAPTER_FORMAT = 1
ADAPTER_INITS = ("layer-m", "last", "random")  # Λ's starting point: a copy of layer m, of the last layer, or random
WEIGHTS = "adapter.safetensors"
META = "adapter.json"
DRAFT_VOCAB = "draft_vocab.npy"  # token ids of the distillation data, most frequent first


def _module_base():
    import torch

    return torch.nn.Module


class Adapter(_module_base()):
    """Λ: norm → self-attention (→ post-norm) + residual, shaped like a layer of `model` (its template: layer m, or
    the last layer for init "last") and started from it (init "layer-m", "last") or from random weights."""

    def __init__(self, model: Any, m: int, init: str = "layer-m"):
        super().__init__()
        layers = model.model.layers
        if not 0 <= m < len(layers):
            raise ValueError(f"adapter template layer {m} outside the model's {len(layers)} layers")
        if init not in ADAPTER_INITS:
            raise ValueError(f"unknown adapter init {init!r}; choose {', '.join(ADAPTER_INITS)}")
        self.init, self.template = init, len(layers) - 1 if init == "last" else m
        template = layers[self.template]
        self.layer_type = layer_types(model.config)[self.template]
        self.input_layernorm = copy.deepcopy(template.input_layernorm)
        self.self_attn = copy.deepcopy(template.self_attn)
        self.self_attn.layer_idx = len(layers)  # its own key in a PartCache
        sandwich = hasattr(template, "pre_feedforward_layernorm")  # Gemma: a norm between attention and residual
        self.post_attention_layernorm = copy.deepcopy(template.post_attention_layernorm) if sandwich else None
        if init == "random":
            self._randomise(model)
        for p in self.parameters():
            p.requires_grad_(True)

    def _randomise(self, model: Any) -> None:
        """The family's own initialiser (its `_init_weights`: linear weights N(0, initializer_range²), biases 0,
        norms as a fresh norm of that family holds them), on every module of Λ."""
        for module in self.modules():
            if module is not self:
                model._init_weights(module)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_ids=None,
                past_key_values=None, use_cache=True, cache=None, **kwargs):
        residual = hidden_states
        kv = cache if cache is not None else past_key_values  # either keyword (hat_split.models.hf_cache)
        out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                position_embeddings=position_embeddings, position_ids=position_ids,
                                use_cache=use_cache, **cache_kwargs(self.self_attn, kv))
        if self.post_attention_layernorm is not None:
            out = self.post_attention_layernorm(out)
        return residual + out

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def adapter_stack(split: SplitModel, adapter: Adapter) -> Stack:
    """Λ as a Stack of its own (no model layers, one extra layer) on the split model's rotary embedding."""
    return Stack(split.model, split.m, split.m, extra_layers=[(adapter, adapter.layer_type)])


def save_adapter(path: str | os.PathLike[str], adapter: Adapter, split: SplitModel, base_model: str,
                 record: Dict[str, Any], provenance: Optional[Dict[str, Any]] = None) -> Path:
    """Write the artifact directory (weights first, metadata last: a directory with adapter.json is complete);
    `provenance` (hat_split.files.provenance: commit, command, machine) goes beside the record when given."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in adapter.state_dict().items()}
    save_file(state, str(out / WEIGHTS))
    meta = {
        "format": ADAPTER_FORMAT,
        "base_model": base_model,
        "fingerprint": model_fingerprint(split.model),
        "model_type": split.model.config.model_type,
        "m": split.m,
        "tail": split.tail,
        "layer_type": adapter.layer_type,
        "init": adapter.init,
        "template_layer": adapter.template,
        "params": adapter.n_params(),
        "record": record,
    }
    if provenance is not None:
        meta["provenance"] = provenance
    write_json(out / META, meta, indent=1)
    return out


def read_adapter_meta(path: str | os.PathLike[str]) -> Dict[str, Any]:
    meta_path = Path(path) / META
    if not meta_path.is_file() and (Path(path) / "drafter.json").is_file():
        raise ValueError(f"{path} holds a feature drafter, not HAT's adapter Λ: it drafts in protocol hat (torch, or "
                         "a bundle exported with `hat-export onnx --parts hat-feature`); use an adapter made by "
                         "`hat-distill` here")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not an adapter directory (no {META}); make one with `hat-distill`")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{meta_path}: adapter format {meta.get('format')} is not {ADAPTER_FORMAT}")
    return meta


def check_cut(meta: Dict[str, Any], split: SplitModel, what: str, made: str, make: str) -> None:
    """One line naming what differs between a draft module's record (Λ's or a feature drafter's) and the split it is
    asked to run on: the model's fingerprint, or the cut."""
    fp = model_fingerprint(split.model)
    if meta["fingerprint"] != fp:
        raise ValueError(f"{what} was {made} for {meta['base_model']!r} (fingerprint {meta['fingerprint'][:12]}), "
                         f"this model's is {fp[:12]}: {make} one for this model")
    if (meta["m"], meta["tail"]) != (split.m, split.tail):
        raise ValueError(f"{what} was {made} for the cut m={meta['m']}, tail={meta['tail']}; this split is "
                         f"m={split.m}, tail={split.tail}")


def load_adapter(path: str | os.PathLike[str], split: SplitModel) -> Adapter:
    """Λ from an artifact, checked against the split model it will run on."""
    from safetensors.torch import load_file

    meta = read_adapter_meta(path)
    check_cut(meta, split, f"adapter {path}", "distilled", "distil")
    adapter = Adapter(split.model, split.m, meta.get("init", "layer-m"))
    state = load_file(str(Path(path) / WEIGHTS))
    missing, unexpected = adapter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"adapter {path}: weights do not fit (missing {missing}, unexpected {unexpected})")
    adapter.to(device=split.model.model.embed_tokens.weight.device, dtype=split.dtype).eval()
    for p in adapter.parameters():
        p.requires_grad_(False)
    return adapter


def rank_vocab(windows: Sequence[Sequence[int]], vocab_size: int, first: Sequence[int] = ()) -> np.ndarray:
    """The token ids occurring in `windows`, most frequent first (ties: lower id first), after the ids `first` (the
    end-of-sequence tokens: a draft must be able to stop). int32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    tokens = np.concatenate([np.asarray(w, dtype=np.int64).reshape(-1) for w in windows] or [np.zeros(0, np.int64)])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    counts = np.bincount(tokens, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    seen = order[counts[order] > 0]
    head = np.array([t for t in dict.fromkeys(int(t) for t in first) if 0 <= t < vocab_size], dtype=np.int64)
    return np.concatenate([head, seen[~np.isin(seen, head)]]).astype(np.int32)


def save_draft_vocab(path: str | os.PathLike[str], ranked: np.ndarray) -> Path:
    out = Path(path) / DRAFT_VOCAB
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, np.asarray(ranked, dtype=np.int32))
    tmp.replace(out)
    return out


def load_draft_vocab(path: str | os.PathLike[str], n: int) -> np.ndarray:
    """The n most frequent token ids of an adapter's distillation data, ascending (a head over them reads the
    weight's rows in order)."""
    f = Path(path) / DRAFT_VOCAB
    if n < 1:
        raise ValueError(f"a draft vocabulary needs at least one token, got {n}")
    if not f.is_file():
        raise FileNotFoundError(f"adapter {path} has no {DRAFT_VOCAB}: add one with `hat-distill --eval-only --out "
                                f"{path} --draft-vocab {n}` (ranks the tokens of its training data)")
    ranked = np.load(f)
    if n > len(ranked):
        raise ValueError(f"adapter {path} ranked {len(ranked)} distinct tokens of its data; a draft vocabulary of {n} "
                         f"needs that many (use at most {len(ranked)}, or 0 for the whole vocabulary)")
    return np.sort(ranked[:n]).astype(np.int64)
