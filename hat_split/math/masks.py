"""Attention masks as plain arrays: the one definition the torch parts and the exported graphs' runtimes share."""
from __future__ import annotations

from typing import Optional

import numpy as np


def allowed(past: int, n: int, window: Optional[int] = None, width: Optional[int] = None) -> np.ndarray:
    """`# [n, width]` bool (width = past + n by default): query i (position past + i) may attend key slot j.

    Causal: j <= past + i. Sliding window w (Gemma 3 local layers, transformers' convention): also j > past + i - w.
    Slots past past + n (a batch row's padding) are hidden from every query.
    """
    q = np.arange(past, past + n)[:, None]
    k = np.arange(past + n if width is None else width)[None, :]
    ok = k <= q
    if window:
        ok &= k > q - window
    return ok


def additive(past: int, n: int, window: Optional[int], dtype, width: Optional[int] = None) -> np.ndarray:
    """`# [1, 1, n, width]` additive mask in a numpy float dtype: 0 where allowed, the dtype's minimum elsewhere."""
    dtype = np.dtype(dtype)
    return np.where(allowed(past, n, window, width), dtype.type(0), np.finfo(dtype).min).astype(dtype)[None, None]
