"""Cut one causal LM into HAT's three parts: input (embeddings + first m layers), middle,
output (last layers + norm + head).

HAT (paper 004, §3.1, Fig. 2): the input and output parts stay on the device, the middle part runs in the cloud, and
only hidden states cross the link. Each part is a `Stack` — a contiguous range of the model's own decoder layers run
directly, with:

- its own KV cache (`PartCache`), keyed by the layers' global index, croppable to a prefix like hat_split.models.lm's;
- an explicit additive causal mask built here, aligned to the cache's end (a chunk of n positions on top of a cache of
  `past` attends to all `past` cached positions plus its own causal triangle). Never `is_causal`: SDPA aligns that to
  the top-left corner, which is wrong for a chunk on a cache (see ../shared/OFFLINE.md). Layers of type
  "sliding_attention" (Gemma 3) get the model's sliding window in the same mask;
- rotary embeddings computed from absolute positions, per layer type where the model has several (Gemma 3).

Nothing is copied per model family: llama, qwen2 and gemma3 share the structure `model.model.{embed_tokens, layers,
norm, rotary_emb}` + `lm_head`; Gemma's embedding scale lives inside its embedding module and its optional final
logit soft-capping is applied from the config. The parts hold references to the loaded model's modules (no weight
copies), so a cloud can serve the middle of any cut from one loaded model.

Shapes: hidden states are `# [1, n, hidden]` torch tensors in the model's dtype; logits come back as float32.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hat_split.math.masks import allowed
from hat_split.models.hf_cache import cache_kwargs

SUPPORTED_FAMILIES = ("llama", "qwen2", "gemma3_text", "gemma3")  # model_type values whose layout is checked here
FULL = "full_attention"
SLIDING = "sliding_attention"


class PartCache:
    """KV cache of one part: per global layer index, key and value `# [1, kv_heads, length, head_dim]`.

    It is what the decoder layers' attention calls `update(k, v, layer_idx)` on (hat_split.models.hf_cache); a Stack
    advances `length` once all its layers have appended a chunk.
    """

    def __init__(self) -> None:
        self.kv: Dict[int, Tuple[Any, Any]] = {}
        self.length = 0  # positions held
        self.forward_s = 0.0  # accumulated compute time of the part on this cache
        self.forward_tokens = 0

    def update(self, key: Any, value: Any, layer_idx: int, *_: Any, **__: Any) -> Tuple[Any, Any]:
        import torch

        old = self.kv.get(layer_idx)
        if old is not None:
            key = torch.cat([old[0], key], dim=-2)
            value = torch.cat([old[1], value], dim=-2)
        self.kv[layer_idx] = (key, value)
        return key, value

    def fork(self) -> "PartCache":
        """A copy that shares the tensors: they are never written in place, so the two evolve independently."""
        c = PartCache()
        c.kv = dict(self.kv)
        c.length = self.length
        return c

    def crop(self, length: int) -> None:
        """Forget positions >= length (rejected drafts; a peer's shorter committed prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if length < self.length:
            self.kv = {i: (k[..., :length, :], v[..., :length, :]) for i, (k, v) in self.kv.items()}
            self.length = length

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keep, of the positions from `start` on, only `rows` (offsets from start, in order) and close them up: a
        draft tree's accepted path moved into place, the other branches dropped (their keys and values gathered,
        not recomputed)."""
        import torch

        if not 0 <= start <= self.length or any(not 0 <= r < self.length - start for r in rows):
            raise ValueError(f"cannot keep rows {list(rows)} after position {start} of a cache of {self.length}")
        if list(rows) == list(range(len(rows))):  # already in place: a crop
            self.crop(start + len(rows))
            return
        index = None
        kept = {}
        for i, (k, v) in self.kv.items():
            if index is None:
                index = torch.tensor([start + r for r in rows], dtype=torch.long, device=k.device)
            kept[i] = (torch.cat([k[..., :start, :], k.index_select(-2, index)], dim=-2),
                       torch.cat([v[..., :start, :], v.index_select(-2, index)], dim=-2))
        self.kv = kept
        self.length = start + len(rows)

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv.values())


def tree_inputs(start: int, parents: Sequence[int], earlier: int, n: int, dtype: Any, device: Any) -> Tuple[Any, Any]:
    """What a forward of a draft tree's n new nodes needs (hat_split.math.tree): `mask_for(kind, window)`, the
    additive mask `# [1, 1, n, start + earlier + n]` of each layer type (every position before `start`, then the
    node's own ancestors: the tree's `earlier` nodes already in the cache and the new ones, in node order), and the
    nodes' positions `# [1, n]` (start + depth − 1). `parents`: the whole tree so far, its last n entries the new
    nodes."""
    import torch

    from hat_split.math.masks import TreeStep

    step = TreeStep.make(start, parents, earlier, n)

    def mask_for(kind: str, window: Optional[int]) -> Any:
        ok = step.allowed(window)  # [n, start + earlier + n]
        mask = torch.zeros(ok.shape, dtype=dtype)
        mask.masked_fill_(~torch.from_numpy(ok), torch.finfo(dtype).min)
        return mask[None, None].to(device)

    return mask_for, torch.from_numpy(step.positions).to(device)[None]


def additive_mask(past: int, n: int, window: Optional[int], dtype: Any, width: Optional[int] = None,
                  device: Any = "cpu") -> Any:
    """Mask `# [1, 1, n, width]` of a torch dtype on `device`: 0 where query i (position past + i) may attend key j,
    the dtype's min elsewhere (hat_split.math.masks.allowed: causal, sliding window, padding slots hidden)."""
    import torch

    mask = torch.zeros((n, past + n if width is None else width), dtype=dtype)
    mask.masked_fill_(~torch.from_numpy(allowed(past, n, window, width)), torch.finfo(dtype).min)
    return mask[None, None].to(device)


def layer_types(config: Any) -> List[str]:
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [FULL] * n
    if len(types) != n:
        raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
    return list(types)


@dataclass
class Stack:
    """Decoder layers [start, stop) of one model, run on a PartCache with explicit positions and masks."""

    model: Any  # the loaded *ForCausalLM
    start: int
    stop: int
    # (layer, type) run after the model's own (adapter)
    extra_layers: List[Tuple[Any, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.model.config.num_hidden_layers
        if not 0 <= self.start <= self.stop <= n:
            raise ValueError(f"layer range [{self.start}, {self.stop}) is outside the model's {n} layers")
        self.types = layer_types(self.model.config)
        self._rotary_takes_type = "layer_type" in inspect.signature(self.model.model.rotary_emb.forward).parameters

    @property
    def layers(self) -> List[Tuple[Any, str]]:
        own = [(self.model.model.layers[i], self.types[i]) for i in range(self.start, self.stop)]
        return own + list(self.extra_layers)

    def __len__(self) -> int:
        return self.stop - self.start + len(self.extra_layers)

    def forward(self, cache: PartCache, hidden: Any, train: bool = False) -> Any:
        """Run `hidden # [batch, n, hidden]` at positions cache.length .. cache.length + n - 1; returns the same shape.

        train: record the graph (distillation); otherwise inference mode (clone a result before training on it).
        """
        import torch

        n = hidden.shape[1]
        if n < 1:
            raise ValueError("a part needs at least one position")
        past = cache.length
        t0 = time.perf_counter()
        device = hidden.device
        hidden = self.run_layers(cache, hidden, lambda kind, window: additive_mask(past, n, window, hidden.dtype,
                                                                                   device=device),
                                 torch.arange(past, past + n, device=device)[None], train)
        cache.length += n
        cache.forward_s += time.perf_counter() - t0
        cache.forward_tokens += n
        return hidden

    def forward_tree(self, cache: PartCache, hidden: Any, parents: Sequence[int], start: Optional[int] = None) -> Any:
        """Run a draft tree's new nodes `hidden # [1, n, hidden]` on `cache`. `parents` is the whole tree so far in
        node order (hat_split.math.tree), its last n entries the new nodes; the tree begins at cache position `start`
        (default: the cache's end, a tree run in one call), and its earlier nodes are the cache's positions from
        there (a tree grown a level at a time). Node g sits at position start + depth_g − 1 and attends to the
        cache before `start` and to its own ancestors; returns `# [1, n, hidden]` and leaves the new nodes in the
        cache after the earlier ones (PartCache.keep keeps the accepted path)."""
        n = hidden.shape[1]
        start = cache.length if start is None else start
        mask_for, positions = tree_inputs(start, parents, cache.length - start, n, hidden.dtype, hidden.device)
        t0 = time.perf_counter()
        hidden = self.run_layers(cache, hidden, mask_for, positions, False)
        cache.length += n
        cache.forward_s += time.perf_counter() - t0
        cache.forward_tokens += n
        return hidden

    def forward_batch(self, caches: Sequence[PartCache], hiddens: Sequence[Any]) -> List[Any]:
        """One forward for several sessions: `hiddens[i] # [1, n_i, hidden]` at positions caches[i].length .. ;
        returns each session's `# [1, n_i, hidden]`. Equal to forwarding each session alone."""
        if len(caches) != len(hiddens) or not caches:
            raise ValueError("forward_batch needs one cache per segment, and at least one segment")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a session may appear once per batch")
        lengths = [h.shape[1] for h in hiddens]
        if min(lengths) < 1:
            raise ValueError("a part needs at least one position")
        if len(caches) == 1:  # nothing to pad: the plain path, without the padded copy of the cache
            return [self.forward(caches[0], hiddens[0])]
        t0 = time.perf_counter()
        batch = BatchCache(caches, lengths)
        padded = hiddens[0].new_zeros(len(hiddens), batch.n, hiddens[0].shape[-1])
        for i, h in enumerate(hiddens):
            padded[i, :h.shape[1]] = h[0]
        out = self.run_layers(batch, padded, lambda kind, window: batch.mask(window, padded.dtype, padded.device),
                              batch.positions(padded.device), False)
        dt = (time.perf_counter() - t0) / len(caches)
        for cache, n in zip(caches, lengths):
            cache.length += n
            cache.forward_s += dt
            cache.forward_tokens += n
        return [out[i:i + 1, :n] for i, n in enumerate(lengths)]

    def run_layers(self, cache: Any, hidden: Any, mask_for: Any, positions: Any, train: bool) -> Any:
        """The layers on `hidden # [B, n, hidden]` at `positions # [B, n]`: `cache` is what their attention calls
        update(key, value, layer) on, `mask_for(kind, window)` gives each layer type's additive mask."""
        import torch

        layers = self.layers
        with contextlib.nullcontext() if train else torch.inference_mode():
            window = getattr(self.model.config, "sliding_window", None)
            masks, rope = {}, {}
            for _, kind in layers:
                if kind not in masks:
                    masks[kind] = mask_for(kind, window if kind == SLIDING else None)
                    rotary = self.model.model.rotary_emb
                    rope[kind] = (rotary(hidden, positions, kind) if self._rotary_takes_type
                                  else rotary(hidden, positions))
            for layer, kind in layers:
                out = layer(hidden, attention_mask=masks[kind], position_embeddings=rope[kind], position_ids=positions,
                            use_cache=True, **cache_kwargs(layer, cache))
                hidden = out[0] if isinstance(out, tuple) else out
        return hidden


class BatchCache:
    """The `past_key_values` of one batched step over several sessions' PartCaches (HAT §2.1 continuous batching).

    Row i holds session i's segment of n_i positions, right-padded to the batch's longest. On each layer's update the
    row's valid new keys and values go into its own PartCache (PartCache.update), and the layer attends over a padded
    batch whose row i is [its cached and new positions, zeros to the widest row]; `mask` hides what row i must not
    see."""

    def __init__(self, caches: Sequence[PartCache], lengths: Sequence[int]):
        self.caches, self.lengths = list(caches), list(lengths)
        self.pasts = [c.length for c in self.caches]
        self.n = max(self.lengths)
        self.width = max(self.pasts) + self.n

    def update(self, key: Any, value: Any, layer_idx: int, *_: Any, **__: Any) -> Tuple[Any, Any]:
        b, heads, _, dim = key.shape
        keys = key.new_zeros(b, heads, self.width, dim)
        values = value.new_zeros(b, heads, self.width, dim)
        for i, (cache, past, n) in enumerate(zip(self.caches, self.pasts, self.lengths)):
            k, v = cache.update(key[i:i + 1, :, :n], value[i:i + 1, :, :n], layer_idx)
            keys[i, :, :past + n] = k[0]
            values[i, :, :past + n] = v[0]
        return keys, values

    def positions(self, device: Any = "cpu") -> Any:
        """`# [B, n_max]` absolute positions of every row's queries (padding continues the row's count)."""
        import torch

        return torch.stack([torch.arange(p, p + self.n) for p in self.pasts]).to(device)

    def mask(self, window: Optional[int], dtype: Any, device: Any = "cpu") -> Any:
        """`# [B, 1, n_max, width]`: each row's causal (and sliding-window) mask over its own slots; padded queries
        see their row like a valid one would (their outputs are dropped)."""
        import torch

        return torch.cat([additive_mask(p, self.n, window, dtype, self.width) for p in self.pasts]).to(device)


@dataclass
class SplitModel:
    """One model cut at m (input part = embeddings + layers [0, m)) and n - tail (output part = the last `tail` layers,
    final norm and head); the middle part is layers [m, n - tail)."""

    model: Any
    m: int  # layers in the input part (HAT: 2 of 32 for Vicuna-7B)
    tail: int = 0  # layers kept with the head in the output part
    input: Stack = field(init=False)
    middle: Stack = field(init=False)
    output: Stack = field(init=False)

    def __post_init__(self) -> None:
        check_family(self.model)
        n = self.model.config.num_hidden_layers
        if not 0 <= self.m or not 0 <= self.tail or self.m + self.tail >= n:
            raise ValueError(f"cut m={self.m}, tail={self.tail} leaves no middle layer of {n}")
        self.input = Stack(self.model, 0, self.m)
        self.middle = Stack(self.model, self.m, n - self.tail)
        self.output = Stack(self.model, n - self.tail, n)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def dtype(self) -> Any:
        return self.model.model.embed_tokens.weight.dtype

    def embed(self, tokens: Sequence[int]) -> Any:
        return embed(self.model, tokens)

    def run_input(self, cache: PartCache, tokens: Sequence[int]) -> Any:
        """Shallow hidden states `# [1, n, hidden]` of `tokens` (embeddings + the first m layers)."""
        if not tokens:
            raise ValueError("run_input needs at least one token")
        return self.input.forward(cache, self.embed(tokens))

    def run_output(self, cache: PartCache, hidden: Any, n_logits: Optional[int] = None, rows: Any = None,
                   features: bool = False) -> Any:
        """Float32 logits `# [n_logits, vocab]` of the last n_logits positions of deep hidden states `# [1, n, hidden]`.

        The tail layers (if any) see every position (their cache must stay complete); norm and head only the last
        n_logits (default: all). rows: `head_rows` of a token subset, for logits over that subset only. features:
        return (logits, the normed features `# [1, n, hidden]` of every position: what the head reads).
        """
        import torch

        n = hidden.shape[1]
        n_logits = n if n_logits is None else n_logits
        if not 0 <= n_logits <= n:
            raise ValueError(f"n_logits={n_logits} must be in [0, {n}]")
        if len(self.output):
            hidden = self.output.forward(cache, hidden)
        else:
            cache.length += n
        if features:
            with torch.inference_mode():
                normed = self.model.model.norm(hidden)
            return lm_head_logits(self.model, normed[:, n - n_logits:], rows=rows)[0], normed
        if n_logits == 0:
            return torch.zeros(0, self.model.config.vocab_size if rows is None else rows.shape[0],
                               device=hidden.device)
        return head_logits(self.model, hidden[:, n - n_logits:], rows=rows)[0]

    def fingerprint(self) -> str:
        return model_fingerprint(self.model)


def embed(model: Any, tokens: Sequence[int]) -> Any:
    """Input embeddings `# [1, n, hidden]` of token ids (Gemma's scale is inside its embedding module)."""
    import torch

    weight = model.model.embed_tokens.weight
    with torch.inference_mode():
        return model.model.embed_tokens(torch.tensor([list(tokens)], dtype=torch.long).to(weight.device))


def head_logits(model: Any, hidden: Any, train: bool = False, rows: Any = None) -> Any:
    """Final norm + LM head (+ Gemma's soft-capping when configured): `# [b, n, hidden]` → float32 `# [b, n, vocab]`
    (rows: `head_rows` of a token subset → `# [b, n, subset]`)."""

    import torch

    with contextlib.nullcontext() if train else torch.inference_mode():
        return lm_head_logits(model, model.model.norm(hidden), train, rows)


def head_rows(model: Any, ids: Sequence[int]) -> Any:
    """The LM head's weight rows of tokens `ids`, contiguous: a head over that subset of the vocabulary."""
    import torch

    if getattr(model.lm_head, "bias", None) is not None:
        raise ValueError("a head over a token subset needs an LM head without bias")
    weight = model.lm_head.weight
    idx = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if idx.numel() < 1 or int(idx.min()) < 0 or int(idx.max()) >= weight.shape[0]:
        raise ValueError(f"token ids must be in [0, {weight.shape[0]}) and at least one")
    return weight.detach()[idx].contiguous()


def lm_head_logits(model: Any, normed: Any, train: bool = False, rows: Any = None) -> Any:
    """The LM head (+ soft-capping) on already normed features `# [b, n, hidden]` → float32 `# [b, n, vocab]`."""

    import torch

    with contextlib.nullcontext() if train else torch.inference_mode():
        logits = model.lm_head(normed) if rows is None else torch.nn.functional.linear(normed, rows)
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
    return logits.float()


def free_layers(model: Any, drop: Sequence[int]) -> None:
    """Free the weights of decoder layers a process never runs (a device: the middle part; a pipeline stage: the
    other stages'). Each becomes a `FreedLayer` holding only its input norm (so `model_fingerprint` still matches)
    that raises if it is ever called."""
    import torch

    class FreedLayer(torch.nn.Module):
        freed = True

        def __init__(self, index: int, norm: Any):
            super().__init__()
            self.index = index
            self.input_layernorm = norm

        def forward(self, *args, **kwargs):
            raise RuntimeError(f"decoder layer {self.index} was freed in this process: it runs elsewhere")

    layers = model.model.layers
    for i in drop:
        if not getattr(layers[i], "freed", False):
            layers[i] = FreedLayer(i, layers[i].input_layernorm)


def holds_all_layers(model: Any) -> bool:
    """False once `free_layers` has freed any decoder layer of the model."""
    return not any(getattr(layer, "freed", False) for layer in model.model.layers)


def check_family(model: Any) -> None:
    """Refuse, with the reason, a model whose layout the partition does not know."""
    kind = getattr(getattr(model, "config", None), "model_type", "?")
    inner = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, a)]
    if kind not in SUPPORTED_FAMILIES or missing or not hasattr(model, "lm_head"):
        detail = f" (missing {', '.join(missing)})" if missing else ""
        raise ValueError(f"cannot split a {kind!r} model{detail}: supported families are "
                         f"{', '.join(SUPPORTED_FAMILIES)}")


def model_fingerprint(model: Any) -> str:
    """Hash of a model's shape and of weights no quantizer touches (the norms): device and cloud parts must match.

    Cheap (a few kilobytes hashed), and different for different checkpoints of one architecture. The norms are hashed
    at bfloat16 precision, so a float32 device and a bfloat16 cloud of the same checkpoint agree (each loads the same
    float32 weights and rounds them once); a float16 copy rounds differently and is not recognised as the same.
    """
    import torch

    cfg = model.config
    h = hashlib.sha256()
    h.update(repr((cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)).encode())
    tensors = [model.model.norm.weight] + [layer.input_layernorm.weight for layer in model.model.layers]
    for t in tensors:
        h.update(t.detach().to(torch.bfloat16).to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:32]
