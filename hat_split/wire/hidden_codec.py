"""How hidden states cross the link in the split protocols (`hat`, `ushape`): float16 (default), float32, or 8-bit.

Pure numpy (no torch): states are `# [n, hidden]` float32 arrays at this boundary.

- "float16": the default of HAT; 2 bytes per value.
- "float32": lossless; used where bit-exact agreement with the unsplit model is wanted.
- "int8": per row, the OUTLIERS largest-magnitude values go as float16 with their indices (the residual stream of
  an LLM carries a few "massive" dimensions hundreds of times larger than the rest), the others as int8 with one
  float32 absmax scale per row: H + 4 + 6·OUTLIERS bytes per row instead of 2H.
"""
from __future__ import annotations

import numpy as np

from hat_split.wire.messages import HiddenPayload

HIDDEN_FORMATS = ("float16", "float32", "int8")
OUTLIERS = 8  # int8: values per row sent exactly (float16) instead of quantized


def bytes_per_position(fmt: str, hidden: int) -> int:
    """Wire bytes of one position's hidden state in `fmt` (HAT's A in eq. 3 and 6), payload only."""
    if fmt == "int8":
        return hidden + 4 + 6 * min(OUTLIERS, hidden)
    return hidden * {"float16": 2, "float32": 4}[fmt]


def encode_hidden(states: np.ndarray, fmt: str = "float16") -> HiddenPayload:
    """states `# [n, hidden]` float → payload."""
    x = np.asarray(states, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"hidden states must be [n, hidden], got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("hidden states hold NaN or infinity")
    if fmt == "float16":
        return HiddenPayload(fmt, x.astype(np.float16))
    if fmt == "float32":
        return HiddenPayload(fmt, x)
    if fmt != "int8":
        raise ValueError(f"hidden format must be one of {', '.join(HIDDEN_FORMATS)}, got {fmt!r}")
    n, h = x.shape
    k = min(OUTLIERS, h)
    idx = np.argpartition(-np.abs(x), k - 1, axis=1)[:, :k] if k else np.zeros((n, 0), np.int64)  # [n, k]
    rows = np.arange(n)[:, None]
    rest = x.copy()
    rest[rows, idx] = 0.0
    scale = np.abs(rest).max(axis=1) / 127.0  # [n]
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(rest / safe[:, None]), -127, 127).astype(np.int8)  # [n, h]
    return HiddenPayload(fmt, q, scale.astype(np.float32), idx.astype(np.int32), x[rows, idx].astype(np.float16))


def decode_hidden(payload: HiddenPayload, n: int, hidden: int) -> np.ndarray:
    """Payload → float32 `# [n, hidden]`; ValueError (with the reason) for anything malformed."""
    fmt = payload.format
    v = payload.values
    if fmt not in HIDDEN_FORMATS:
        raise ValueError(f"hidden format {fmt!r} unknown; known: {', '.join(HIDDEN_FORMATS)}")
    want = {"float16": np.float16, "float32": np.float32, "int8": np.int8}[fmt]
    if not isinstance(v, np.ndarray) or v.dtype != want or v.shape != (n, hidden):
        got = f"{v.dtype} {v.shape}" if isinstance(v, np.ndarray) else type(v).__name__
        raise ValueError(f"{fmt} hidden states must be {np.dtype(want).name} [{n}, {hidden}], got {got}")
    if fmt != "int8":
        x = v.astype(np.float32)
    else:
        k = min(OUTLIERS, hidden)
        parts = {"scales": (payload.scales, np.float32, (n,)), "outlier_idx": (payload.outlier_idx, np.int32, (n, k)),
                 "outliers": (payload.outliers, np.float16, (n, k))}
        for name, (arr, dtype, shape) in parts.items():
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != shape:
                raise ValueError(f"int8 hidden states need {name} {np.dtype(dtype).name} {list(shape)}")
        idx = payload.outlier_idx
        if idx.size and (idx.min() < 0 or idx.max() >= hidden):
            raise ValueError(f"outlier indices outside [0, {hidden})")
        x = v.astype(np.float32) * payload.scales[:, None]
        x[np.arange(n)[:, None], idx] = payload.outliers.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("hidden states hold NaN or infinity")
    return x
