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


def tree_allowed(past: int, ancestors: np.ndarray, depth: np.ndarray, window: Optional[int] = None) -> np.ndarray:
    """`# [n, past + n]` bool for a draft tree of n nodes on a cache of `past` positions (hat_split.math.tree):
    node i sits at position past + depth[i] − 1 and attends to every cached position and to its own ancestors
    (`ancestors # [n, n]`, hat_split.math.tree.ancestor_mask); a sliding window counts positions, not nodes."""
    anc = np.asarray(ancestors, dtype=bool)
    n = anc.shape[0]
    q_pos = past + np.asarray(depth, dtype=np.int64) - 1  # [n]
    k_pos = np.concatenate([np.arange(past), q_pos])  # [past + n]
    ok = np.concatenate([np.ones((n, past), dtype=bool), anc], axis=1)
    if window:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok
