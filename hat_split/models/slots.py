"""A static KV layout for the cloud's batched steps: every session's keys and values in a slot of buffers allocated
once, so a step's tensors have shapes that depend only on its bucket (cloud_runtime.buckets) and the step can be
captured as a CUDA graph and replayed (hat_split.models.graphs).

Layout: per layer range [lo, hi) of one process, keys and values `# [layers, slots + 1, kv_heads, length, head_dim]`.
Slot `slots` is scratch: the padding of a bucketed step (rows beyond the batch, positions beyond a row's segment)
writes there, so real slots only ever hold their session's positions.

A step is described by index tensors on the model's device (all int64):
- `rows # [B]`: the slot each batch row reads;
- `write_slot, write_pos # [B, n]`: where each query position's new key and value go (scratch for padding);
- `positions # [B, n]`: each query's absolute position (rotary embeddings and the mask);
- `past # [B]`, `ancestors # [B, n, n]`: what each row's slot held before the step, and which of the step's own keys
  each query sees (a chain's earlier ones; a draft tree's ancestors, hat_split.math.tree);
and a static `width`, the key positions [0, width) a row attends over (the mask hides the others).
Equal to `Stack.forward_batch` on `PartCache`s up to float rounding (tests/test_slots.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from hat_split.models.partition import Stack


def kv_geometry(config: Any) -> tuple:
    """(kv_heads, head_dim) of a model's attention layers."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return kv_heads, head_dim


def slot_bytes(config: Any, layers: int, length: int, dtype_bytes: int) -> int:
    """Bytes of one slot's keys and values: layers x 2 x kv_heads x length x head_dim x the dtype's size."""
    kv_heads, head_dim = kv_geometry(config)
    return layers * 2 * kv_heads * length * head_dim * dtype_bytes


def position_bytes(model: Any, layers: int) -> int:
    """Bytes of KV cache per position of `layers` of a loaded model, in its weights' dtype."""
    return slot_bytes(model.config, layers, 1, next(model.parameters()).element_size())


class SlotKV:
    """Keys and values of layers [lo, hi) for `slots` sessions of up to `length` positions each, preallocated."""

    def __init__(self, model: Any, lo: int, hi: int, slots: int, length: int):
        import torch

        if slots < 1 or length < 1 or not 0 <= lo < hi:
            raise ValueError(f"a slot layout needs slots >= 1, length >= 1 and layers, got {slots}, {length}, "
                             f"[{lo}, {hi})")
        weight = model.model.embed_tokens.weight if hasattr(model.model.embed_tokens, "weight") else \
            next(model.parameters())
        kv_heads, head_dim = kv_geometry(model.config)
        self.lo, self.hi, self.slots, self.length = lo, hi, slots, length
        self.scratch = slots  # the padding's slot
        shape = (hi - lo, slots + 1, kv_heads, length, head_dim)
        self.k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self._free: List[int] = list(range(slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def take(self) -> Optional[int]:
        """A free slot, or None when all are held."""
        return self._free.pop() if self._free else None

    def keep(self, slot: int, start: int, rows: List[int]) -> None:
        """Of the slot's positions from `start` keep only `rows` (offsets, in order), moved into place: a draft
        tree's accepted path (the gathered copy is taken before it is written back)."""
        import torch

        if rows == list(range(len(rows))):
            return
        index = torch.tensor([start + r for r in rows], dtype=torch.long, device=self.k.device)
        for buf in (self.k, self.v):
            buf[:, slot, :, start:start + len(rows)] = buf[:, slot].index_select(2, index)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)


@dataclass
class SlotStep:
    """The `past_key_values` of one step on a SlotKV: each layer's update writes the new keys and values at their
    (slot, position) and returns the rows' slots over [0, width)."""

    kv: SlotKV
    rows: Any  # [B]
    write_slot: Any  # [B, n]
    write_pos: Any  # [B, n]
    width: int

    def update(self, key: Any, value: Any, layer_idx: int, *_: Any, **__: Any):
        layer = layer_idx - self.kv.lo  # key, value: [B, kv_heads, n, head_dim]
        k, v = self.kv.k[layer], self.kv.v[layer]  # [slots + 1, kv_heads, length, head_dim]
        k[self.write_slot, :, self.write_pos] = key.transpose(1, 2).to(k.dtype)  # [B, n, kv_heads, head_dim]
        v[self.write_slot, :, self.write_pos] = value.transpose(1, 2).to(v.dtype)
        return k[self.rows, :, :self.width], v[self.rows, :, :self.width]


def slot_mask(positions: Any, past: Any, ancestors: Any, width: int, window: Optional[int], dtype: Any) -> Any:
    """`# [B, 1, n, width]` additive mask: query i of row b sees the row's keys t < past[b] (its slot before the
    step) and, of the step's own keys t = past[b] + j, those with ancestors[b, i, j] (a chain's j <= i; a draft
    tree's ancestors); a sliding layer only keys whose position (t before the step, positions[b, j] after) is within
    `window` of the query's; the dtype's min elsewhere. Built from tensors only, so a captured graph rebuilds it on
    replay."""
    import torch

    B, n = positions.shape
    t = torch.arange(width, device=positions.device)[None, None, :]  # [1, 1, width]
    rel = t - past[:, None, None]  # [B, 1, width]: the step's key index, < 0 before the step
    j = rel.clamp(0, n - 1).expand(B, n, width)
    own = torch.gather(ancestors, 2, j).bool() & (rel >= 0) & (rel < n)
    ok = (rel < 0) | own
    if window is not None:
        key_pos = torch.where(rel < 0, t.expand(B, 1, width), torch.gather(positions, 1, j[:, 0]).unsqueeze(1))
        ok = ok & (key_pos > positions[:, :, None] - window)
    mask = torch.zeros(ok.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~ok, torch.finfo(dtype).min)[:, None]


def run_slots(stack: Stack, step: SlotStep, hidden: Any, positions: Any, past: Any,
              ancestors: Any) -> Any:
    """Layers of `stack` on `hidden # [B, n, hidden]` at `positions # [B, n]`, keys and values in `step`'s slots
    (`past # [B]`, `ancestors # [B, n, n]`: slot_mask); returns `# [B, n, hidden]`. Only tensor operations:
    capturable as a CUDA graph."""
    return stack.run_layers(step, hidden, lambda kind, window: slot_mask(positions, past, ancestors, step.width,
                                                                         window, hidden.dtype), positions, False)
