"""Summaries of measured samples (latencies, rates) that every benchmark reports alike: mean and percentiles, None
where there is no sample (a JSON null, never a NaN or an exception)."""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

import numpy as np


def mean(values: Sequence[float]) -> Optional[float]:
    return float(np.mean(values)) if len(values) else None


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100, linear interpolation) of `values`."""
    return float(np.percentile(values, q)) if len(values) else None


def percentiles(values: Sequence[float], qs: Iterable[int] = (50, 90, 99)) -> Dict[str, Optional[float]]:
    """{"p50", "p90", "p99" (per qs), "mean", "n"} of `values`."""
    return {**{f"p{q}": percentile(values, q) for q in qs}, "mean": mean(values), "n": len(values)}
