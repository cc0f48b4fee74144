"""Speedup accounting for speculative decoding that cannot exceed its bound unnoticed (derivation: docs/SPEEDUP.md).

Terms (Leviathan et al. 2023, section 3; QS-SD eq. (7)-(10) is the same round with a link added):
  * T: one target step, s: the target's time per token decoding alone (the baseline run's mean). The model assumes
    verifying gamma + 1 positions in one forward costs one target step.
  * t_d: one draft step, s, *with* the draft's per-token overheads (sampling, host sync, encoding for the link), as
    measured over the draft's own decoding; c = t_d / T.
  * round i: the draft proposes gamma_i tokens, the target verifies them and n_i tokens are committed (the a_i = n_i - 1
    accepted drafts and one resampled or bonus token), taking w_i seconds of wall time.
  * alpha: acceptance rate per draft position, estimated as accepted / examined positions, sum a_i /
    sum (a_i + [a_i < gamma_i]) (a round that stops short of gamma_i examined one rejected position); with i.i.d.
    acceptance this is the maximum-likelihood estimate, and it is bench.py's alpha.

Under the model each round costs at least gamma_i * t_d + T, so

    measured = T * sum n_i / sum w_i  <=  T * sum n_i / sum (gamma_i t_d + T)  =  sum n_i / sum (gamma_i c + 1) = bound

holds for every run whose rounds each took at least their draft and target steps (the link and any overhead only
add time). A measured speedup above `bound` therefore means a measurement or definition error (T measured on a
slower target, t_d without its overheads, overlapping rounds, a different baseline) and is reported in `problems`,
never clipped. `ideal` is the closed form (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) at the estimated alpha
and the (fixed) gamma: the expectation of `bound`, equal to it up to sampling noise over many rounds.
Pure functions over numpy arrays: no clock, no model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from hat_split.math.verify import ideal_speedup

__all__ = ["SpeedupReport", "estimate_alpha", "speedup_report", "BOUND_RTOL"]

# How far the measured speedup may sit above its bound before it is flagged: timer resolution and the jitter of the
# two step-time means, not a license for real excess (1 %).
BOUND_RTOL = 0.01


@dataclass(frozen=True)
class SpeedupReport:
    rounds: int  # verification rounds in the run
    tokens: int  # tokens committed, sum n_i
    alpha: float  # acceptance rate per examined draft position (estimate)
    gamma: float  # mean draft length per round (the draft length itself when fixed)
    c: float  # draft step / target step, t_d / T
    tokens_per_round: float  # sum n_i / rounds
    measured: float  # T * tokens / sum w_i: tokens/s of the run over tokens/s of the target alone
    bound: float  # tokens / sum (gamma_i c + 1): the speedup of these rounds with zero overhead; measured <= bound
    ideal: Optional[float]  # closed form at (alpha, gamma); None when gamma varied between rounds
    efficiency: float  # measured / bound, in (0, 1] when consistent
    short_rounds: int  # rounds whose wall time is below gamma_i t_d + T (impossible under the model)
    problems: Tuple[str, ...]  # one sentence per inconsistency; empty when measured <= bound holds

    @property
    def consistent(self) -> bool:
        return not self.problems


def _array(values: Sequence, name: str, integer: bool) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty flat sequence, got shape {arr.shape}")
    if integer:
        if not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
        return arr.astype(np.int64)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)) or arr.dtype == np.bool_:
        raise ValueError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds a NaN or an infinity")
    return arr


def _positive(x: float, name: str, allow_zero: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite real, got {x!r}")
    if x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {x!r}")
    return float(x)


def estimate_alpha(tokens_per_round: np.ndarray, drafts_per_round: np.ndarray) -> float:
    """Accepted / examined draft positions: sum a_i / sum (a_i + [a_i < gamma_i]), a_i = n_i - 1 (`# [rounds]` each).
    0 when no position was examined (every gamma_i = 0)."""
    accepted = tokens_per_round - 1
    examined = accepted + (accepted < drafts_per_round)
    total = int(examined.sum())
    return float(accepted.sum()) / total if total else 0.0


def speedup_report(tokens_per_round: Sequence[int], drafts_per_round: Sequence[int], round_seconds: Sequence[float],
                   target_step_s: float, draft_step_s: float, rtol: float = BOUND_RTOL) -> SpeedupReport:
    """Measured speedup, its bound and the closed-form ideal for one run, from its per-round log.

    tokens_per_round `# [rounds]` int: n_i, committed tokens (1 <= n_i <= gamma_i + 1);
    drafts_per_round `# [rounds]` int: gamma_i, drafts proposed (>= 0);
    round_seconds `# [rounds]` float: w_i, wall time of the round (draft, link and verification), s;
    target_step_s: T, s per token of the target decoding alone; draft_step_s: t_d, s per draft token with overheads.
    """
    n = _array(tokens_per_round, "tokens_per_round", integer=True)
    g = _array(drafts_per_round, "drafts_per_round", integer=True)
    w = _array(round_seconds, "round_seconds", integer=False)
    if not (n.shape == g.shape == w.shape):
        raise ValueError(f"one entry per round in each log: {n.size}, {g.size}, {w.size}")
    if np.any(g < 0):
        raise ValueError("drafts_per_round must be >= 0")
    if np.any(n < 1) or np.any(n > g + 1):
        raise ValueError("each round commits between 1 and gamma_i + 1 tokens (its accepted drafts and one more)")
    if np.any(w <= 0):
        raise ValueError("round_seconds must be > 0")
    T = _positive(target_step_s, "target_step_s")
    t_d = _positive(draft_step_s, "draft_step_s", allow_zero=True)
    rtol = _positive(rtol, "rtol", allow_zero=True)
    c = t_d / T
    tokens = int(n.sum())
    measured = T * tokens / float(w.sum())
    floor = g * t_d + T  # [rounds] the least time each round can take under the model, s
    bound = tokens / float((g * c + 1.0).sum())
    alpha = estimate_alpha(n, g)
    fixed = bool(np.all(g == g[0]))
    ideal = ideal_speedup(alpha, int(g[0]), c) if fixed else None
    short = int(np.sum(w < floor * (1.0 - rtol)))
    problems = []
    if measured > bound * (1.0 + rtol):
        problems.append(f"measured speedup {measured:.4g} exceeds its bound {bound:.4g}: the rounds took less time "
                        f"than their draft and target steps, so T ({T:.4g} s) or t_d ({t_d:.4g} s) is overstated, "
                        f"rounds overlapped, or the baseline is not this target")
    if short:
        problems.append(f"{short} of {n.size} rounds took less than gamma_i * t_d + T")
    return SpeedupReport(rounds=int(n.size), tokens=tokens, alpha=alpha, gamma=float(g.mean()), c=c,
                         tokens_per_round=tokens / n.size, measured=measured, bound=bound, ideal=ideal,
                         efficiency=measured / bound, short_rounds=short, problems=tuple(problems))

