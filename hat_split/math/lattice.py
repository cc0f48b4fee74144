"""Lattice quantization of probability vectors (QS-SD §III, SQS-SD Algorithm 2). Pure numpy.

The lattice of resolution ℓ over K entries is {b/ℓ : b ∈ ℕ^K, Σ b = ℓ}. `nearest` finds its point nearest to a
probability vector (Reznik's rounding): round ℓ·q to integers, then fix the sum by moving the |Σ b − ℓ| entries whose
rounding error ζ = b − ℓ·q is most in the way by one step each. That point minimises every ℓ_p distance, in
particular the total variation distance, which is at most K / (4ℓ).

`topk_support` gives the K most probable tokens (the sparse support of K-SQS); `threshold_support` the tokens with
q ≥ β (C-SQS). Quantizing on a support renormalises q there first, so the quantized draft is a distribution.
"""
from __future__ import annotations

import numpy as np


def nearest(q: np.ndarray, ell: int) -> np.ndarray:
    """Integer counts `# [..., K]` (each row sums to ℓ) of the lattice point nearest to each row of q `# [..., K]`.

    Rows of q must be non-negative with positive sums; they are renormalised. O(K) per row (argpartition).
    """
    if not isinstance(ell, (int, np.integer)) or ell < 1:
        raise ValueError(f"lattice resolution ℓ must be an integer >= 1, got {ell!r}")
    q = np.asarray(q, dtype=np.float64)
    if q.ndim == 0 or q.shape[-1] < 1:
        raise ValueError("q needs a last axis of at least one entry")
    if not np.isfinite(q).all() or (q < 0).any():
        raise ValueError("q must be finite and non-negative")
    sums = q.sum(axis=-1, keepdims=True)
    if (sums <= 0).any():
        raise ValueError("every row of q needs positive mass")
    rows = (q / sums).reshape(-1, q.shape[-1]) * ell  # [R, K] ℓ·q
    b = np.floor(rows + 0.5).astype(np.int64)  # [R, K]
    diff = b.sum(axis=1) - ell  # [R]
    for r in np.flatnonzero(diff):
        zeta = b[r] - rows[r]  # rounding error of each entry
        n = int(abs(diff[r]))
        if diff[r] > 0:  # too many: take one from the n entries rounded up the most
            idx = np.argpartition(-zeta, n - 1)[:n]
            b[r, idx] -= 1
        else:  # too few: add one to the n entries rounded down the most
            idx = np.argpartition(zeta, n - 1)[:n]
            b[r, idx] += 1
    return b.reshape(q.shape)


def tv_distance(q: np.ndarray, counts: np.ndarray, ell: int) -> np.ndarray:
    """Total variation distance between (renormalised) rows of q and the lattice points counts/ℓ."""
    q = np.asarray(q, dtype=np.float64)
    q = q / q.sum(axis=-1, keepdims=True)
    return 0.5 * np.abs(q - np.asarray(counts) / ell).sum(axis=-1)


def topk_support(q: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices `# [k]` of the k largest entries of one distribution `q # [V]`."""
    q = np.asarray(q).reshape(-1)
    if not 1 <= k <= q.size:
        raise ValueError(f"support size K must be in 1..{q.size}, got {k}")
    if k == q.size:
        return np.arange(q.size)
    idx = np.argpartition(-q, k - 1)[:k]
    return np.sort(idx)


def threshold_support(q: np.ndarray, beta: float) -> np.ndarray:
    """Sorted indices of {x : q(x) >= β}; the most probable token when none reaches β (the support is never empty)."""
    q = np.asarray(q).reshape(-1)
    idx = np.flatnonzero(q >= beta)
    return idx if idx.size else np.array([int(np.argmax(q))])
