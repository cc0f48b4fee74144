"""Summaries of measured samples (latencies, rates) that every benchmark reports alike: mean and percentiles, None
where there is no sample (a JSON null, never a NaN or an exception).

Intervals (percentile bootstrap, Efron & Tibshirani 1993 ch. 13): resample the n values with replacement `resamples`
times, take the mean of each resample, and report the (1 - level)/2 and (1 + level)/2 quantiles of those means.
`paired_diff_ci` does the same on per-prompt differences a_i - b_i (same prompts, same seeds), which removes the
prompt-to-prompt variance both runs share. Fewer than two values give no interval (None), never a zero-width one.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

T = TypeVar("T")


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


def rotated(items: Sequence[T], i: int) -> List[T]:
    """Prompt i's order of the systems: `items` starting at item i mod k, so that over k prompts each runs first once
    and a drift of the machine's speed falls on all alike (every bench that compares systems)."""
    start = i % len(items) if items else 0
    return list(items[start:]) + list(items[:start])


def interval(values: Sequence[Optional[float]]) -> dict:
    """{"mean", "lo", "hi", "n"}: the mean of the finite values (one per prompt or request; None and NaN are the ones
    without the figure, left out of n) and its 95 % percentile-bootstrap interval; lo and hi None below two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    m, lo, hi = bootstrap_ci(xs)
    return {"mean": m, "lo": lo, "hi": hi, "n": len(xs)}


def _pairs(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> List[tuple]:
    if len(a) != len(b):
        raise ValueError(f"paired figures need one value per prompt in each: {len(a)} vs {len(b)}")
    return [(x, y) for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]


def paired_ratio(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> dict:
    """`interval` of the per-prompt ratios a_i / b_i, `b` the baseline on the same prompts; prompts where either has
    no value or b_i <= 0 are left out (n says how many remain)."""
    return interval([x / y for x, y in _pairs(a, b) if y > 0])


def paired_diff(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> dict:
    """{"mean", "lo", "hi", "n"} of the per-prompt differences a_i - b_i (stats.paired_diff_ci)."""
    pairs = _pairs(a, b)
    m, lo, hi = paired_diff_ci([x for x, _ in pairs], [y for _, y in pairs])
    return {"mean": m, "lo": lo, "hi": hi, "n": len(pairs)}


def ci_text(ci: Optional[dict], fmt: str = "{:.2f}", scale: float = 1.0, with_n: bool = True) -> str:
    """An `interval` as text: "0.42 ± 0.05 (n=8)", the ± the larger half-width (as stats.mean_ci_text), values times
    `scale`; "-" without a mean."""
    if not ci or ci["mean"] is None:
        return "-"
    m = ci["mean"] * scale
    n = f" (n={ci['n']})" if with_n else ""
    if ci["lo"] is None or ci["hi"] is None:
        return fmt.format(m) + n
    return f"{fmt.format(m)} ± {fmt.format(max(m - ci['lo'] * scale, ci['hi'] * scale - m))}" + n
