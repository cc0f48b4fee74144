"""How many tokens CU-HLM uploads: the offline k* (eq. 21) and the online k(t)* (eq. 23-24). Pure numpy.

With x sorted in descending order and x̂ its eq. 15 reconstruction from the top k, the distortion numerator is the
tail L1 error T(k) = Σ_{i>k} |x_i − r_k / (V − k)|, r_k = Σ_{i>k} x_i (the head's error is 0: kept values are sent).
`tail_l1` gives T(k) for every k = 1..V at once from prefix sums (O(V log V)).

Online (eq. 23): Ū(k) = T(k) / ((1 − x_d)·ℓ(−1) + x_d·ℓ(−β_d)), ℓ(z) = ln(1 + e^{ηz}) / η the softplus with
temperature η, β_d estimated from the uncertainty by the calibrated line β = a·u + b; k(t)* = the smallest k with
Ū(k) ≤ θ (eq. 24). Ū grows with β_d, so k(t)* grows with uncertainty.
Offline (eq. 21): k* = the smallest k whose mean over calibration tokens of U(k, t) = T(k) / D_TV(x, y) is ≤ θ.
"""
from __future__ import annotations

import numpy as np


def softplus(z: np.ndarray | float, eta: float) -> np.ndarray:
    """ℓ(z) = ln(1 + e^{ηz}) / η, computed without overflow."""
    if not eta > 0:
        raise ValueError("softplus temperature η must be > 0")
    return np.logaddexp(0.0, eta * np.asarray(z, dtype=np.float64)) / eta


def tail_l1(x: np.ndarray) -> np.ndarray:
    """T(k) for k = 1..V of one distribution `x # [V]`; returns `# [V]` (index k − 1), T(V) = 0."""
    s = np.sort(np.asarray(x, dtype=np.float64).reshape(-1))[::-1]  # [V] descending
    V = s.size
    prefix = np.concatenate([[0.0], np.cumsum(s)])  # [V + 1]: prefix[j] = Σ_{i<j} s_i
    k = np.arange(1, V + 1)  # [V]
    tail_mass = np.maximum(prefix[V] - prefix[k], 0.0)  # r_k
    n_tail = V - k
    c = np.divide(tail_mass, n_tail, out=np.zeros(V), where=n_tail > 0)  # the uniform fill
    # among tail entries (index >= k) those above c come first (descending): j = max(k, #{s > c})
    above = np.searchsorted(-s, -c, side="left")  # number of entries strictly greater than c
    j = np.maximum(above, k)
    upper = (prefix[j] - prefix[k]) - (j - k) * c
    lower = (V - j) * c - (prefix[V] - prefix[j])
    return np.where(n_tail > 0, np.maximum(upper + lower, 0.0), 0.0)


def online_k(x: np.ndarray, draft_prob: float, beta_hat: float, theta: float, eta: float = 10.0,
             k_max: int | None = None) -> int:
    """k(t)* of eq. 24 for one distribution; at least 1, at most k_max (default V)."""
    if not 0 <= beta_hat <= 1 or not 0 <= draft_prob <= 1:
        raise ValueError("beta_hat and draft_prob must be probabilities")
    if not theta > 0:
        raise ValueError("tolerance θ must be > 0")
    denom = (1.0 - draft_prob) * softplus(-1.0, eta) + draft_prob * softplus(-beta_hat, eta)
    t = tail_l1(x)  # [V], non-increasing in k up to rounding
    ok = np.flatnonzero(t / denom <= theta)
    k = int(ok[0]) + 1 if ok.size else t.size
    return min(k, k_max or t.size)


def offline_k(tails: np.ndarray, tvd: np.ndarray, theta: float) -> int:
    """k* of eq. 21 from calibration tokens: tails `# [N, K]` = T(k) on a k grid 1..K, tvd `# [N]` = D_TV(x, y).

    Tokens with D_TV = 0 (the models agree exactly; U-HLM skips them) are left out. Returns K if no k meets θ.
    """
    tails = np.asarray(tails, dtype=np.float64)
    tvd = np.asarray(tvd, dtype=np.float64).reshape(-1)
    if tails.ndim != 2 or tails.shape[0] != tvd.size:
        raise ValueError("tails must be [N, K] with one D_TV per row")
    keep = tvd > 1e-12
    if not keep.any():
        return 1
    mean_u = (tails[keep] / tvd[keep, None]).mean(axis=0)  # [K]
    ok = np.flatnonzero(mean_u <= theta)
    return int(ok[0]) + 1 if ok.size else tails.shape[1]
