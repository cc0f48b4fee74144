"""Attention masks as plain arrays: the one definition the torch parts and the exported graphs' runtimes share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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


@dataclass(frozen=True)
class TreeStep:
    """A forward of a draft tree's n new nodes on a cache that holds the committed sequence (`start` positions) and
    the tree's `earlier` nodes after it (a tree grown a level per forward): what any runtime feeds its layers."""

    start: int
    earlier: int
    ancestors: np.ndarray  # bool [N, N], the whole tree so far (hat_split.math.tree.ancestor_mask)
    depth: np.ndarray  # int64 [N]

    @staticmethod
    def make(start: int, parents: Sequence[int], earlier: int, n: int) -> "TreeStep":
        """`parents`: the whole tree so far in node order, its last n entries the new nodes. ValueError when they
        do not add up or are not a tree."""
        from hat_split.math.tree import ancestor_mask, check_tree

        par = np.asarray(parents, dtype=np.int64)
        if par.ndim != 1 or earlier < 0 or n < 1 or par.size != earlier + n:
            raise ValueError(f"a tree with {max(earlier, 0)} nodes in the cache and {n} new ones needs "
                             f"{max(earlier, 0) + n} parents, got {par.size}")
        depth = check_tree(par, np.arange(par.size), par.size, par.size)  # the shape only (tokens: the verifier's)
        return TreeStep(int(start), int(earlier), ancestor_mask(par), depth)

    @property
    def positions(self) -> np.ndarray:
        """int64 `# [n]`: the new nodes' positions, start + depth − 1."""
        return self.start + self.depth[self.earlier:] - 1

    def allowed(self, window: Optional[int] = None) -> np.ndarray:
        """bool `# [n, start + earlier + n]`: what each new node attends to (tree_allowed's rows of the new nodes)."""
        return tree_allowed(self.start, self.ancestors, self.depth, window or None)[self.earlier:]

    def additive(self, window: Optional[int], dtype) -> np.ndarray:
        """`# [1, 1, n, start + earlier + n]` additive mask in a numpy float dtype."""
        dtype = np.dtype(dtype)
        return np.where(self.allowed(window), dtype.type(0), np.finfo(dtype).min).astype(dtype)[None, None]
