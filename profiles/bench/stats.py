"""Summaries of measured samples (latencies, rates) that every benchmark reports alike: mean and percentiles, None
where there is no sample (a JSON null, never a NaN or an exception).

Intervals (percentile bootstrap, Efron & Tibshirani 1993 ch. 13): resample the n values with replacement `resamples`
times, take the mean of each resample, and report the (1 - level)/2 and (1 + level)/2 quantiles of those means.
`paired_diff_ci` does the same on per-prompt differences a_i - b_i (same prompts, same seeds), which removes the
prompt-to-prompt variance both runs share. Fewer than two values give no interval (None), never a zero-width one.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np


def mean(values: Sequence[float]) -> Optional[float]:
    return float(np.mean(values)) if len(values) else None


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100, linear interpolation) of `values`."""
    return float(np.percentile(values, q)) if len(values) else None


def percentiles(values: Sequence[float], qs: Iterable[int] = (50, 90, 99)) -> Dict[str, Optional[float]]:
    """{"p50", "p90", "p99" (per qs), "mean", "n"} of `values`."""
    return {**{f"p{q}": percentile(values, q) for q in qs}, "mean": mean(values), "n": len(values)}


def _sample(values: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of numbers, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds a NaN or an infinity")
    return arr


def bootstrap_ci(values: Sequence[float], level: float = 0.95, resamples: int = 10000,
                 seed: int = 0) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """(mean, lo, hi): the mean of `values` and its percentile-bootstrap interval at `level`; seeded.

    (None, None, None) with no values; (mean, None, None) with one."""
    if not (isinstance(level, float) and 0.0 < level < 1.0):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples must be an int >= 100, got {resamples!r}")
    arr = _sample(values, "values")
    n = len(arr)
    if n == 0:
        return None, None, None
    if n < 2:
        return float(arr[0]), None, None
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    block = max(1, (1 << 22) // n)  # resamples per draw: at most ~4M indices (32 MB) at a time
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        means[start:stop] = arr[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(arr.mean()), float(lo), float(hi)


def paired_diff_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95, resamples: int = 10000,
                   seed: int = 0) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """(mean, lo, hi) of the per-prompt differences a_i - b_i, with `b` the baseline on the same prompts and seeds."""
    xa, xb = _sample(a, "a"), _sample(b, "b")
    if xa.shape != xb.shape:
        raise ValueError(f"paired samples need one value per prompt in each: {len(xa)} vs {len(xb)}")
    return bootstrap_ci(xa - xb, level, resamples, seed)


def mean_ci_text(values: Sequence[float], level: float = 0.95, resamples: int = 10000, seed: int = 0,
                 form: str = "pm", digits: int = 2) -> str:
    """The mean and its bootstrap interval as text: "0.42 ± 0.05 (n=64)" (form "pm": the larger of the two half-widths,
    so the ± never understates an asymmetric interval) or "0.42 [0.37, 0.47] (n=64)" (form "interval")."""
    if form not in ("pm", "interval"):
        raise ValueError(f"form must be 'pm' or 'interval', got {form!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or not 0 <= digits <= 12:
        raise ValueError(f"digits must be an int in [0, 12], got {digits!r}")
    m, lo, hi = bootstrap_ci(values, level, resamples, seed)
    n = len(values)
    if m is None:
        return "n/a (n=0)"
    if lo is None or hi is None:
        return f"{m:.{digits}f} (n={n})"
    if form == "pm":
        half = max(m - lo, hi - m)
        return f"{m:.{digits}f} ± {math.ceil(half * 10 ** digits) / 10 ** digits:.{digits}f} (n={n})"
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] (n={n})"
