"""The device's uncertainty about its own draft token: temperature perturbation (U-HLM §III-B, eq. 6-7).

M temperatures θ_k are drawn uniformly from [0, θmax]; a sample token d_k is drawn from softmax(z / θ_k) of the same
logits z (no extra model forward); u = (1/M) Σ_k 1(d_k ≠ d) for the draft token d. Paper: M = 20, θmax = 2.

Only whether d_k equals d matters, so instead of sampling M whole tokens this draws the M match indicators directly:
1(d_k = d) ~ Bernoulli(softmax(z / θ_k)[d]), which has exactly the same distribution as sampling d_k and comparing.
That costs one [M, V] exp per row (~4 ms for V = 151,936 and M = 20 in float32) instead of M inverse-CDF searches.
θ = 0 is the limit: all mass on the argmax (shared uniformly by tied maxima).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerturbationConfig:
    n_samples: int = 20  # M
    theta_max: float = 2.0  # temperatures ~ U[0, θmax]

    def __post_init__(self) -> None:
        if not 1 <= self.n_samples <= 4096:
            raise ValueError(f"n_samples (M) must be in 1..4096, got {self.n_samples}")
        if not (np.isfinite(self.theta_max) and self.theta_max > 0):
            raise ValueError(f"theta_max must be a finite number > 0, got {self.theta_max}")


def match_probabilities(logits: np.ndarray, tokens: np.ndarray, thetas: np.ndarray) -> np.ndarray:
    """softmax(logits / θ)[token] for every row and temperature.

    logits `# [B, V]` (-inf = masked), tokens `# [B]`, thetas `# [B, M]` >= 0. Returns float64 `# [B, M]`.
    """
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 2 or z.shape[1] == 0:
        raise ValueError(f"logits must be [B, V], got shape {z.shape}")
    tokens = np.asarray(tokens).reshape(-1)
    thetas = np.asarray(thetas, dtype=np.float64)
    B, V = z.shape
    if tokens.shape != (B,) or thetas.ndim != 2 or thetas.shape[0] != B:
        raise ValueError(f"need tokens [B] and thetas [B, M] for B = {B}, got {tokens.shape} and {thetas.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= V):
        raise ValueError(f"tokens outside [0, {V})")
    if np.any(thetas < 0) or not np.all(np.isfinite(thetas)):
        raise ValueError("temperatures must be finite and >= 0")
    if np.isnan(z).any() or np.isposinf(z).any():
        raise ValueError("logits contain NaN or +inf")
    mx = z.max(axis=1, keepdims=True)  # [B, 1]
    if np.isneginf(mx).any():
        raise ValueError("a row of logits is entirely -inf")
    gap = z - mx  # [B, V] <= 0, -inf for masked tokens
    out = np.empty(thetas.shape, dtype=np.float64)  # [B, M]
    n_max = (gap == 0).sum(axis=1)  # [B] tied maxima
    rows = np.arange(B)
    gap_d = gap[rows, tokens].astype(np.float64)  # [B]
    for b in range(B):  # vectorised over M (and V); B is a draft length, small
        th = thetas[b]  # [M]
        hot = th > 0
        out[b, ~hot] = (gap_d[b] == 0) / n_max[b]  # θ = 0: uniform over the argmax set
        if hot.any():
            inv = (1.0 / th[hot]).astype(np.float32)  # [m]
            e = np.exp(gap[b][None, :] * inv[:, None])  # [m, V] float32, max term is exactly 1
            out[b, hot] = np.exp(gap_d[b] / th[hot]) / e.sum(axis=1, dtype=np.float64)
    return np.clip(out, 0.0, 1.0)


def perturbation_uncertainty(logits: np.ndarray, tokens: np.ndarray, config: PerturbationConfig,
                             rng: np.random.Generator) -> np.ndarray:
    """u `# [B]` in {0, 1/M, ..., 1}: the fraction of M temperature-perturbed samples that differ from each token.

    Consumes 2·B·M uniforms from `rng` (temperatures, then match draws), whatever the logits.
    """
    B = np.shape(logits)[0] if np.ndim(logits) == 2 else 0  # other shapes are refused by match_probabilities
    thetas = rng.uniform(0.0, config.theta_max, size=(B, config.n_samples))  # [B, M]
    draws = rng.random((B, config.n_samples))  # [B, M]
    match = draws < match_probabilities(logits, tokens, thetas)  # [B, M]
    return 1.0 - match.mean(axis=1)


def sampled_uncertainty_reference(logits: np.ndarray, token: int, config: PerturbationConfig,
                                  rng: np.random.Generator) -> float:
    """Slow reference for one row, literally as U-HLM eq. 6-7: sample M whole tokens, count the mismatches."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    mismatches = 0
    for theta in rng.uniform(0.0, config.theta_max, size=config.n_samples):
        if theta == 0:
            d = int(np.argmax(z))
        else:
            w = np.exp((z - z.max()) / theta)
            d = int(rng.choice(z.size, p=w / w.sum()))
        mismatches += d != token
    return mismatches / config.n_samples
