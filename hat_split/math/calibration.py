"""U-HLM / CU-HLM calibration from recorded tokens: the rejection model, the skip thresholds, the risk and k*.
Pure numpy.

Input: one record per examined draft token — its uncertainty u (U-HLM eq. 8-9), the draft probability x_d and the
target probability y_d of that token — and, for CU-HLM's offline k*, the tail-to-distortion ratios of each token.

- rejection probability β_d = max(0, 1 − y_d / x_d) (the speculative-sampling rejection chance of the draft token);
- the linear rejection model β = a·u + b (U-HLM eq. 5/7), fitted by least squares, with its MSE, R² and correlation;
- Δ = P(y_d < x_d), the risk-averse threshold −b/a (only tokens predicted to be accepted outright are skipped) and the
  risk-prone threshold (Δ − b)/a (U-HLM Theorem 1, eq. 11);
- the expected rejection risk R of eq. 12 between the two thresholds — with the model line and the empirical density of
  u (`risk_model`), and with the measured β_d (`risk_measured`) — and its Hölder bound eq. 13 (`risk_bound`), where the
  density f(u) is a histogram estimate;
- the offline k* of CU-HLM eq. 21 for a tolerance θ: the smallest k whose mean of T(k) / D_TV(x, y) is ≤ θ.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

import numpy as np

from hat_split.math.vocab_size_policy import tail_l1

FORMAT = "hatspec-calibration/1"
THRESHOLD_RULES = ("risk-prone", "risk-averse", "risk-budget")


def rejection_probability(x_d: np.ndarray, y_d: np.ndarray) -> np.ndarray:
    """β_d = max(0, 1 − y_d / x_d) per token `# [N]`; a token the draft could not sample (x_d = 0) gives 0."""
    x = np.asarray(x_d, dtype=np.float64)
    y = np.asarray(y_d, dtype=np.float64)
    if x.shape != y.shape or np.any(x < 0) or np.any(y < 0):
        raise ValueError("x_d and y_d must be non-negative arrays of one shape")
    ratio = np.divide(y, x, out=np.ones_like(x), where=x > 0)
    return np.clip(1.0 - ratio, 0.0, 1.0)


@dataclass(frozen=True)
class LineFit:
    a: float
    b: float
    mse: float
    r2: float
    corr: float
    n: int


def fit_line(u: np.ndarray, beta: np.ndarray) -> LineFit:
    """Least-squares β = a·u + b with its mean squared error, R² and Pearson correlation."""
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    beta = np.asarray(beta, dtype=np.float64).reshape(-1)
    if u.size != beta.size or u.size < 3:
        raise ValueError(f"need at least 3 (u, β) pairs of equal count, got {u.size} and {beta.size}")
    if not (np.isfinite(u).all() and np.isfinite(beta).all()):
        raise ValueError("u and β must be finite")
    if np.ptp(u) == 0:
        raise ValueError("all uncertainties are equal: the line cannot be fitted (more or more varied prompts?)")
    a, b = np.polyfit(u, beta, 1)
    resid = beta - (a * u + b)
    var = beta.var()
    mse = float(np.mean(resid**2))
    r2 = 1.0 - mse / var if var > 0 else 1.0
    corr = float(np.corrcoef(u, beta)[0, 1]) if var > 0 else 0.0
    return LineFit(float(a), float(b), mse, float(r2), corr, int(u.size))


class OfflineKAccumulator:
    """Running mean over calibration tokens of U(k) = T(k) / D_TV(x, y) for k = 1..k_max (CU-HLM eq. 20-21).

    Tokens where the two distributions are equal (D_TV = 0) carry no distortion to bound and are left out.
    """

    def __init__(self, k_max: int):
        if k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.k_max = k_max
        self.sum = np.zeros(k_max)
        self.count = 0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """x, y: the draft's and the target's distributions of one position `# [V]`."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        if x.shape != y.shape:
            raise ValueError("x and y must have the same vocabulary")
        tvd = 0.5 * float(np.abs(x - y).sum())
        if tvd <= 1e-12:
            return
        t = tail_l1(x)[: self.k_max]  # [min(V, k_max)]
        if t.size < self.k_max:
            t = np.concatenate([t, np.zeros(self.k_max - t.size)])
        self.sum += t / tvd
        self.count += 1

    def mean(self) -> np.ndarray:
        return self.sum / max(self.count, 1)

    def k_star(self, theta: float) -> int:
        """The smallest k with mean U(k) ≤ θ (eq. 21); k_max when none is."""
        if not theta > 0:
            raise ValueError("tolerance θ must be > 0")
        if self.count == 0:
            return 1
        ok = np.flatnonzero(self.mean() <= theta)
        return int(ok[0]) + 1 if ok.size else self.k_max


def risk(u: np.ndarray, beta: np.ndarray, fit: LineFit, lo: float, hi: float, bins: int = 50) -> Dict[str, float]:
    """Eq. 12 and its bound eq. 13 between thresholds lo = −b/a and hi = (Δ − b)/a.

    risk_model: ∫ (a·u + b) f(u) du with the empirical density of u (a mean over tokens in [lo, hi));
    risk_measured: the same with the measured β_d in place of the line;
    risk_bound: sqrt(∫ (a·u + b)² du) · sqrt(∫ f(u)² du) over [lo, hi], f a `bins`-bin histogram density on [0, 1].
    """
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    beta = np.asarray(beta, dtype=np.float64).reshape(-1)
    inside = (u >= lo) & (u < hi)
    risk_model = float(np.mean(np.where(inside, fit.a * u + fit.b, 0.0))) if u.size else 0.0
    risk_measured = float(np.mean(np.where(inside, beta, 0.0))) if u.size else 0.0
    if hi <= lo:
        return {"risk_model": risk_model, "risk_measured": risk_measured, "risk_bound": 0.0}
    a, b = fit.a, fit.b
    line_sq = ((a * hi + b) ** 3 - (a * lo + b) ** 3) / (3 * a) if a != 0 else b * b * (hi - lo)
    density, edges = np.histogram(u, bins=bins, range=(0.0, 1.0), density=True)
    overlap = np.clip(np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo), 0.0, None)  # [bins]
    f_sq = float(np.sum(density**2 * overlap))
    return {"risk_model": risk_model, "risk_measured": risk_measured,
            "risk_bound": math.sqrt(max(line_sq, 0.0)) * math.sqrt(f_sq)}


def threshold_for_risk(u: np.ndarray, beta: np.ndarray, budget: float) -> float:
    """The largest u_th whose skipped tokens (u <= u_th) carry a measured rejection risk Σβ / N <= budget; −1 if none.

    A threshold rule beside Theorem 1's: it bounds the expected extra rejections per token directly on the records.
    """
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    beta = np.asarray(beta, dtype=np.float64).reshape(-1)
    if u.size == 0 or budget < 0:
        raise ValueError("need records and a budget >= 0")
    values, inverse = np.unique(u, return_inverse=True)  # ascending distinct u
    risk_at = np.cumsum(np.bincount(inverse, weights=beta, minlength=values.size)) / u.size  # skip all u <= value
    ok = np.flatnonzero(risk_at <= budget)
    return float(values[ok[-1]]) if ok.size else -1.0


@dataclass
class Calibration:
    """What `hat-calibrate` measured; saved as JSON and loaded by the edge (`hat-edge --calibration`)."""

    draft: str
    target: str
    temperature: float
    n_tokens: int
    fit: LineFit
    delta: float  # Δ = P(y_d < x_d)
    u_risk_averse: float  # −b/a
    u_risk_prone: float  # (Δ − b)/a
    risk_model: float
    risk_measured: float
    risk_bound: float
    k_theta: float
    k_star: int  # offline k* for k_theta (eq. 21)
    perturb_samples: int
    theta_max: float
    extra: Dict[str, float] = field(default_factory=dict)
    risk_budget: float = 0.0  # measured rejection risk per token allowed by the "risk-budget" rule
    u_risk_budget: float = -1.0  # its threshold (threshold_for_risk)
    format: str = FORMAT

    def threshold(self, rule: str) -> float:
        if rule not in THRESHOLD_RULES:
            raise ValueError(f"threshold rule must be one of {', '.join(THRESHOLD_RULES)}, got {rule!r}")
        return {"risk-prone": self.u_risk_prone, "risk-averse": self.u_risk_averse,
                "risk-budget": self.u_risk_budget}[rule]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a hatspec calibration file (expected format {FORMAT!r})")
        try:
            fit = LineFit(**data["fit"])
            fields = {k: v for k, v in data.items() if k not in ("fit", "format")}
            cal = cls(fit=fit, **fields)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"calibration file is incomplete or has unknown fields: {exc}") from None
        numbers = [fit.a, fit.b, cal.delta, cal.u_risk_averse, cal.u_risk_prone]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers) or cal.k_star < 1:
            raise ValueError("calibration file holds non-finite values or k_star < 1")
        return cal


def calibrate(u: np.ndarray, x_d: np.ndarray, y_d: np.ndarray, k_acc: Optional[OfflineKAccumulator], k_theta: float,
              risk_budget: float = 0.02, **meta) -> Calibration:
    """Fit the rejection model and derive thresholds, risk and k* from per-token records `# [N]`."""
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    x_d = np.asarray(x_d, dtype=np.float64).reshape(-1)
    y_d = np.asarray(y_d, dtype=np.float64).reshape(-1)
    beta = rejection_probability(x_d, y_d)
    fit = fit_line(u, beta)
    delta = float(np.mean(y_d < x_d))
    if fit.a <= 0:
        raise ValueError(f"the fitted rejection line has slope a = {fit.a:.4f} <= 0: uncertainty does not predict "
                         "rejection on these records (too few tokens, or a mismatched pair?)")
    lo, hi = -fit.b / fit.a, (delta - fit.b) / fit.a
    r = risk(u, beta, fit, lo, hi)
    k_star = k_acc.k_star(k_theta) if k_acc is not None else 1
    return Calibration(n_tokens=int(u.size), fit=fit, delta=delta, u_risk_averse=float(lo), u_risk_prone=float(hi),
                       k_theta=k_theta, k_star=k_star, risk_budget=risk_budget,
                       u_risk_budget=threshold_for_risk(u, beta, risk_budget), **r, **meta)


def save(path: str, cal: Calibration) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cal.to_json(), f, indent=1)


def load(path: str) -> Calibration:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read calibration file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path} is not JSON: {exc}") from None
    return Calibration.from_json(data)
