"""U-HLM's skip rule held to a risk per answer, with its rejection model refitted online. Pure numpy.

U-HLM skips the upload of a draft token when its uncertainty u is at most a threshold; a skipped token is committed
without verification, and with probability β(u) the cloud would have rejected it (U-HLM eq. 5: β = a·u + b). A
threshold set per token (hat_split.math.calibration: a measured risk per token) lets an answer of L tokens carry
L times that risk: multi-step arithmetic does not forgive it. Here:

- **the answer's budget** ε: the expected number of would-be-rejected skips in one answer. The request's length L
  (its max_new_tokens: a bound on the answer) gives a risk per token ε / L; the threshold is the largest u_th whose
  skips carry at most that risk over the recent tokens' uncertainties (`threshold_for_risk_per_token`); and an
  accountant (`AnswerBudget`) stops skipping once the predicted rejections of this answer's skips reach ε;
- **the line refitted online** (`RejectionFit`): every uploaded token's verdict (rejected or not: a Bernoulli draw of
  mean β(u)) is a point of the line, weighted down as newer points arrive (a memory of `memory` tokens); the
  calibration's line is a prior worth `prior_weight` points spread over u ∈ [0, 1]. A domain where the draft is
  rejected more often than the calibration said raises the line and lowers the threshold; an easier one does the
  opposite. Uploads only see u above the threshold, so a fraction `explore` of the would-be skips is uploaded
  anyway (its verdict fits the low end of the line; selecting on u does not bias a regression on u).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Tuple

import numpy as np

PRIOR_POINTS = 11  # the prior line's points: u = 0, 0.1, ..., 1
NEVER = -1.0  # a threshold no u reaches (u >= 0): never skip


def beta_hat(a: float, b: float, u) -> np.ndarray:
    """The rejection model β̂(u) = clip(a·u + b, 0, 1) `# [N]`."""
    return np.clip(a * np.asarray(u, dtype=np.float64) + b, 0.0, 1.0)


def threshold_for_risk_per_token(us: np.ndarray, a: float, b: float, risk: float) -> float:
    """The largest threshold t among the uncertainties `us` `# [N]` (recent tokens, skipped or not) such that skipping
    every u <= t carries a predicted risk per token mean(β̂(u)·[u <= t]) <= risk; NEVER when even the smallest u
    exceeds it or there are no points. Ties skip together."""
    us = np.asarray(us, dtype=np.float64).reshape(-1)
    if not risk >= 0 or not math.isfinite(risk):
        raise ValueError(f"the risk per token must be a finite number >= 0, got {risk}")
    us = us[np.isfinite(us)]
    if us.size == 0:
        return NEVER
    values, inverse = np.unique(us, return_inverse=True)  # ascending distinct u
    risk_at = np.cumsum(np.bincount(inverse, weights=beta_hat(a, b, us), minlength=values.size)) / us.size
    ok = np.flatnonzero(risk_at <= risk + 1e-12)
    return float(values[ok[-1]]) if ok.size else NEVER


class RejectionFit:
    """Weighted least squares of β = a·u + b over (u, rejected) points with exponential forgetting, and the prior line
    as `prior_weight` points at u = 0, 0.1, ..., 1 that are never forgotten. Always finite: a degenerate set of points
    (one u value only) keeps the prior's slope."""

    def __init__(self, prior: Tuple[float, float], prior_weight: float = 50.0, memory: float = 2000.0):
        a, b = prior
        if not (math.isfinite(a) and math.isfinite(b)):
            raise ValueError(f"the prior line must be finite, got a={a}, b={b}")
        if not prior_weight > 0 or not memory >= 1:
            raise ValueError(f"prior_weight must be > 0 and memory >= 1 token, got {prior_weight}, {memory}")
        self.prior = (float(a), float(b))
        self.decay = 1.0 - 1.0 / memory
        grid = np.linspace(0.0, 1.0, PRIOR_POINTS)
        y = a * grid + b  # the prior line itself (not clipped: it is a line's points)
        w = prior_weight / PRIOR_POINTS
        self._prior = np.array([w * grid.size, w * grid.sum(), w * (grid**2).sum(), w * y.sum(), w * (grid * y).sum()])
        self._data = np.zeros(5)  # Σw, Σw·u, Σw·u², Σw·y, Σw·u·y of the observed points
        self.observed = 0

    def observe(self, u: float, rejected: float) -> None:
        """One uploaded token: its uncertainty and whether the cloud rejected it (1) or accepted it (0)."""
        if not (math.isfinite(u) and 0.0 <= rejected <= 1.0):
            raise ValueError(f"a point needs a finite u and rejected in [0, 1], got u={u}, rejected={rejected}")
        self._data *= self.decay
        self._data += (1.0, u, u * u, rejected, u * rejected)
        self.observed += 1

    def line(self) -> Tuple[float, float]:
        """(a, b) of the weighted fit over the prior's and the observed points."""
        n, su, suu, sy, suy = self._prior + self._data
        var = suu / n - (su / n) ** 2
        if var <= 1e-12:  # unreachable with the prior's spread, kept for safety: the prior's slope through the mean
            a = self.prior[0]
        else:
            a = (suy / n - (su / n) * (sy / n)) / var
        return float(a), float(sy / n - a * su / n)


@dataclass
class AnswerBudget:
    """One answer's accountant: skips stop once their predicted rejections would exceed ε."""

    epsilon: float
    spent: float = 0.0  # Σ β̂(u) over this answer's skips

    def allows(self, beta: float) -> bool:
        return self.spent + beta <= self.epsilon + 1e-12

    def spend(self, beta: float) -> None:
        self.spent += beta


@dataclass
class SkipPolicy:
    """The skip decision of uhlm / cuhlm, kept across a device's requests (its line and recent uncertainties).

    rule "threshold": skip when u <= the configured threshold (U-HLM's rule; `refit` moves it as a per-token risk
    `token_risk` on the refitted line); rule "answer": the answer's budget ε as above."""

    rule: str
    threshold: float  # the configured u_th (rule "threshold" without refit)
    line: Tuple[float, float]  # the calibrated β = a·u + b
    epsilon: float = 0.5  # rule "answer": expected would-be-rejected skips per answer
    token_risk: float = 0.02  # rule "threshold" with refit: the risk per token
    refit: bool = False
    explore: float = 0.0  # the fraction of would-be skips uploaded anyway (their verdicts fit the line's low end)
    memory: int = 2000  # tokens: the horizon of the refit's forgetting and of the recent uncertainties
    prior_weight: float = 50.0
    every: int = 16  # tokens between threshold updates within an answer
    fit: RejectionFit = field(init=False)
    recent_u: Deque[float] = field(init=False)
    budget: AnswerBudget = field(init=False)
    current: float = field(init=False)  # the threshold in force
    _length: int = field(init=False, default=1)
    _since: int = field(init=False, default=0)

    RULES = ("threshold", "answer")

    def __post_init__(self) -> None:
        if self.rule not in self.RULES:
            raise ValueError(f"the skip rule must be one of {', '.join(self.RULES)}, got {self.rule!r}")
        if not (self.epsilon >= 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"the answer's risk ε must be a finite number >= 0, got {self.epsilon}")
        if not 0.0 <= self.token_risk <= 1.0 or not 0.0 <= self.explore < 1.0:
            raise ValueError(f"token_risk must be in [0, 1] and explore in [0, 1), got {self.token_risk}, "
                             f"{self.explore}")
        if self.memory < 1 or self.every < 1:
            raise ValueError(f"memory and every must be >= 1 token, got {self.memory}, {self.every}")
        self.fit = RejectionFit(self.line, self.prior_weight, self.memory)
        self.recent_u = deque(maxlen=self.memory)
        self.begin(1)

    def begin(self, length: int) -> None:
        """A new answer of at most `length` tokens: a fresh budget, the threshold set for it."""
        self._length = max(1, int(length))
        self.budget = AnswerBudget(self.epsilon)
        self._update()

    def _update(self) -> None:
        self._since = 0
        if self.rule == "threshold" and not self.refit:
            self.current = self.threshold
            return
        a, b = self.fit.line() if self.refit else self.line
        risk = self.epsilon / self._length if self.rule == "answer" else self.token_risk
        self.current = threshold_for_risk_per_token(np.fromiter(self.recent_u, float), a, b, risk)

    def decide(self, u: float, coin: float) -> str:
        """"skip", "upload" or "explore" (a would-be skip uploaded for the refit) for a token of uncertainty u;
        coin: a uniform draw in [0, 1) from the session's own stream."""
        if not math.isfinite(u):
            raise ValueError(f"the uncertainty must be finite, got {u}")
        self.recent_u.append(u)
        self._since += 1
        if self._since >= self.every:
            self._update()
        if u > self.current:
            return "upload"
        beta = float(beta_hat(*(self.fit.line() if self.refit else self.line), u))
        if self.rule == "answer" and not self.budget.allows(beta):
            return "upload"
        if self.refit and coin < self.explore:
            return "explore"
        self.budget.spend(beta)
        return "skip"

    def observe(self, u: float, rejected: bool) -> None:
        """An uploaded token's verdict (refit only)."""
        if self.refit:
            self.fit.observe(u, 1.0 if rejected else 0.0)

    def state(self) -> dict:
        a, b = self.fit.line() if self.refit else self.line
        return {"rule": self.rule, "threshold": self.current, "line": [a, b], "answer_risk_spent": self.budget.spent,
                "points": self.fit.observed}

