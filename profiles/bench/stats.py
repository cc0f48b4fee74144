"""Summaries of measured samples (latencies, rates) that every benchmark reports alike: mean and percentiles, None
where there is no sample (a JSON null, never a NaN or an exception), and the one rule for intervals of a mean.

The interval rule (every bench goes through `mean_ci`; none keeps interval code of its own):
- n >= MIN_BOOTSTRAP_N (8): percentile bootstrap (Efron & Tibshirani 1993 ch. 13): resample the n values with
  replacement `resamples` times, take each resample's mean, report the (1 - level)/2 and (1 + level)/2 quantiles.
- 2 <= n < 8: Student's t interval, mean ± t(df = n - 1) · s / sqrt(n), s the sample standard deviation. A
  percentile bootstrap of so few values is too narrow: over n = 2 its resample means are x1, (x1 + x2)/2 and x2
  only, so its "95 %" interval is the min and the max.
- n < 2: no interval (lo and hi None), never a zero-width one.
Every interval is a dict {"mean", "lo", "hi", "n", "method"} ("bootstrap", "t", or None without an interval), and
its text names both: "0.91 [0.87, 0.94] (n=12, bootstrap)", "2.00 ± 12.71 (n=2, t)".
`paired_diff_ci` and `paired_ratio` apply the rule to per-prompt differences a_i - b_i or ratios a_i / b_i (same
prompts, same seeds), which removes the prompt-to-prompt variance both runs share.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

T = TypeVar("T")
MIN_BOOTSTRAP_N = 8  # below this many values the t interval, not the percentile bootstrap
LEVEL = 0.95  # every bench's intervals


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


def _check_level(level: float) -> None:
    if not (isinstance(level, float) and 0.0 < level < 1.0):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")


def bootstrap_ci(values: Sequence[float], level: float = LEVEL, resamples: int = 10000,
                 seed: int = 0) -> Tuple[float, float, float]:
    """(mean, lo, hi): the mean of `values` and its percentile-bootstrap interval at `level`; seeded. Refuses fewer
    than MIN_BOOTSTRAP_N values (`mean_ci` gives those the t interval)."""
    _check_level(level)
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples must be an int >= 100, got {resamples!r}")
    arr = _sample(values, "values")
    n = len(arr)
    if n < MIN_BOOTSTRAP_N:
        raise ValueError(f"a percentile bootstrap needs n >= {MIN_BOOTSTRAP_N} values, got {n} (stats.mean_ci)")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    block = max(1, (1 << 22) // n)  # resamples per draw: at most ~4M indices (32 MB) at a time
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        means[start:stop] = arr[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(arr.mean()), float(lo), float(hi)


def _t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (an int >= 1) degrees of freedom: the closed forms of Abramowitz &
    Stegun 26.7.3 (odd df) and 26.7.4 (even df), θ = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    c2, term = math.cos(theta) ** 2, 1.0
    if df % 2 == 0:  # sinθ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ... up to cos^(df-2)θ)
        total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return math.sin(theta) * total
    if df == 1:
        return 2.0 * theta / math.pi
    term = math.cos(theta)  # (2/π)(θ + sinθ (cosθ + 2/3 cos³θ + ... up to cos^(df-2)θ))
    total = term
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2.0 / math.pi * (theta + math.sin(theta) * total)


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The t with P(|T| <= t) = `level` for Student's t with `df` degrees of freedom (the (1 + level)/2 quantile):
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447 for df = 1..6 at 0.95. Bisection on θ of `_t_within`."""
    _check_level(level)
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df!r}")
    lo, hi = 0.0, math.pi / 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_within(math.sqrt(df) * math.tan(mid), df) < level else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def t_ci(values: Sequence[float], level: float = LEVEL) -> Tuple[float, float, float]:
    """(mean, lo, hi): mean ± t(n - 1) · s / sqrt(n), s with n - 1 in its denominator; needs n >= 2."""
    arr = _sample(values, "values")
    if len(arr) < 2:
        raise ValueError(f"a t interval needs n >= 2 values, got {len(arr)}")
    m = float(arr.mean())
    half = t_quantile(len(arr) - 1, level) * float(arr.std(ddof=1)) / math.sqrt(len(arr))
    return m, m - half, m + half


def mean_ci(values: Sequence[float], level: float = LEVEL, resamples: int = 10000, seed: int = 0) -> dict:
    """{"mean", "lo", "hi", "n", "method"} of `values` by the module's rule: bootstrap from 8 values, t from 2."""
    arr = _sample(values, "values")
    n = len(arr)
    if n >= MIN_BOOTSTRAP_N:
        (m, lo, hi), method = bootstrap_ci(arr, level, resamples, seed), "bootstrap"
    elif n >= 2:
        (m, lo, hi), method = t_ci(arr, level), "t"
    else:
        _check_level(level)
        m, lo, hi, method = (float(arr[0]) if n else None), None, None, None
    return {"mean": m, "lo": lo, "hi": hi, "n": n, "method": method}


def paired_diff_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL, resamples: int = 10000,
                   seed: int = 0) -> dict:
    """`mean_ci` of the per-prompt differences a_i - b_i, with `b` the baseline on the same prompts and seeds."""
    xa, xb = _sample(a, "a"), _sample(b, "b")
    if xa.shape != xb.shape:
        raise ValueError(f"paired samples need one value per prompt in each: {len(xa)} vs {len(xb)}")
    return mean_ci(xa - xb, level, resamples, seed)


def _n_text(ci: dict) -> str:
    return f"(n={ci['n']}, {ci['method']})" if ci["lo"] is not None else f"(n={ci['n']})"


def ci_text(ci: Optional[dict], fmt: str = "{:.2f}", scale: float = 1.0, with_n: bool = True,
            form: str = "pm") -> str:
    """An interval as text, values times `scale`: "0.42 ± 0.05 (n=8, bootstrap)" (form "pm": the larger half-width,
    so the ± never understates an asymmetric interval) or "0.42 [0.37, 0.47] (n=8, bootstrap)" (form "interval");
    "2.00 (n=1)" without one; "-" without a mean. `with_n=False` leaves "(n=…, method)" to the table's note
    (`ci_note`)."""
    if form not in ("pm", "interval"):
        raise ValueError(f"form must be 'pm' or 'interval', got {form!r}")
    if not ci or ci["mean"] is None:
        return "-"
    m = ci["mean"] * scale
    n = f" {_n_text(ci)}" if with_n else ""
    if ci["lo"] is None or ci["hi"] is None:
        return fmt.format(m) + n
    lo, hi = ci["lo"] * scale, ci["hi"] * scale
    if form == "interval":
        return f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]" + n
    return f"{fmt.format(m)} ± {fmt.format(max(m - lo, hi - m))}" + n


def ci_note(cis: Iterable[Optional[dict]]) -> str:
    """What a table's bare intervals (ci_text with_n=False) are: "95 % intervals: n=2 (t)", "n=3 (t), n=60
    (bootstrap)"."""
    seen = sorted({(c["n"], c["method"]) for c in cis if c and c.get("lo") is not None})
    if not seen:
        return "no intervals (fewer than 2 values each)"
    return f"{100 * LEVEL:.0f} % intervals: " + ", ".join(f"n={n} ({method})" for n, method in seen)


def mean_ci_text(values: Sequence[float], level: float = LEVEL, resamples: int = 10000, seed: int = 0,
                 form: str = "pm", digits: int = 2) -> str:
    """`mean_ci` of `values` as text: "0.42 ± 0.05 (n=64, bootstrap)" (form "pm", the half-width rounded up) or
    "0.42 [0.37, 0.47] (n=64, bootstrap)" (form "interval"); "n/a (n=0)" without values."""
    if form not in ("pm", "interval"):
        raise ValueError(f"form must be 'pm' or 'interval', got {form!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or not 0 <= digits <= 12:
        raise ValueError(f"digits must be an int in [0, 12], got {digits!r}")
    ci = mean_ci(values, level, resamples, seed)
    if ci["mean"] is None:
        return "n/a (n=0)"
    if form == "pm" and ci["lo"] is not None:
        m, half = ci["mean"], max(ci["mean"] - ci["lo"], ci["hi"] - ci["mean"])
        return f"{m:.{digits}f} ± {math.ceil(half * 10 ** digits) / 10 ** digits:.{digits}f} {_n_text(ci)}"
    return ci_text(ci, f"{{:.{digits}f}}", form=form)


def rotated(items: Sequence[T], i: int) -> List[T]:
    """Prompt i's order of the systems: `items` starting at item i mod k, so that over k prompts each runs first once
    and a drift of the machine's speed falls on all alike (every bench that compares systems)."""
    start = i % len(items) if items else 0
    return list(items[start:]) + list(items[:start])


def interval(values: Sequence[Optional[float]]) -> dict:
    """`mean_ci` of the finite values (one per prompt or request; None and NaN are the ones without the figure, left
    out of n), at the 95 % level."""
    return mean_ci([float(v) for v in values if v is not None and math.isfinite(v)])


def _pairs(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> List[tuple]:
    if len(a) != len(b):
        raise ValueError(f"paired figures need one value per prompt in each: {len(a)} vs {len(b)}")
    return [(x, y) for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]


def paired_ratio(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> dict:
    """`interval` of the per-prompt ratios a_i / b_i, `b` the baseline on the same prompts; prompts where either has
    no value or b_i <= 0 are left out (n says how many remain)."""
    return interval([x / y for x, y in _pairs(a, b) if y > 0])


def paired_diff(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> dict:
    """`paired_diff_ci` of the prompts where both have a value."""
    pairs = _pairs(a, b)
    return paired_diff_ci([x for x, _ in pairs], [y for _, y in pairs])
