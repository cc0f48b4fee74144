"""Token sampling shared by the device and the cloud, and the terms of speculative decoding used across hatspec.

Terms (defined here once; every other module uses them in this sense)
--------------------------------------------------------------------
draft model
    The small model on the device (SLM). Its next-token distribution is **q**. The U-HLM / CU-HLM papers
    (Oh et al.; /work/shared/papers/001_*, 000_*) call it **x**(t); the QS-SD paper (Zhang et al.; 003_*) calls it
    q_l (or q̂_l once quantized).
target model
    The large model in the cloud (LLM). Its next-token distribution is **p**; U-HLM / CU-HLM call it **y**(t).
    Speculative decoding makes the output follow p exactly, whatever q is.
draft tokens
    x_1 .. x_L, sampled autoregressively by the draft model, x_l ~ q_l (q_l conditioned on the prefix and
    x_1 .. x_{l-1}). q_l must be exactly the distribution x_l was sampled from (after `warp`, after any
    quantization: QS-SD's "quantize, then sample"), otherwise the output is not exact.
accepted
    Going left to right, draft x_l is accepted with probability min(1, p_l(x_l) / q_l(x_l)) (QS-SD eq. (1); U-HLM
    "immediate / probabilistic acceptance"). With a uniform u ~ U[0, 1): accepted iff u < p_l(x_l) / q_l(x_l),
    evaluated without division as u * q_l(x_l) < p_l(x_l).
rejected
    The first draft that is not accepted. It and every later draft are discarded.
resampled token
    At the first rejection, position l, a replacement token is drawn from the residual distribution
    norm(max(p_l - q_l, 0)) (QS-SD eq. (2); U-HLM eq. (2); CU-HLM eq. (2)).
bonus token
    If all L drafts are accepted, one more token is drawn from the target's distribution at position L + 1,
    p_{L+1}, which the target computed anyway in the same parallel pass. Every verification therefore yields
    N + 1 tokens, N = number accepted (0 <= N <= L): QS-SD eq. (3) appends x_1 .. x_N and the resampled / bonus token.

The rule is the speculative sampling of Leviathan, Kalman & Matias, "Fast inference from transformers via
speculative decoding", ICML 2023 (Algorithm 1, Appendix A.1 for the proof of exactness), and Chen et al.,
"Accelerating large language model decoding with speculative sampling", arXiv:2302.01318, 2023 (Algorithm 2).
QS-SD §II.3 restates it as eqs. (1)-(3), and eq. (4) is the resulting guarantee P(X = x) = p(x). The verification
itself is in `hat_split.math.verify`; this module holds what both sides need to turn logits into the distributions p and
q and to draw from them.

What is here
------------
`SamplingParams` (temperature / top-k / top-p), `warp(logits, params) -> probs` and inverse-CDF sampling with explicit
uniforms (`sample`) or a generator (`sample_rng`). Pure numpy, no torch: the same code runs on the Jetson and in the
cloud. Explicit uniforms make a draw a pure function of its inputs, so a seeded session is reproducible and a batched
draw equals the per-row draws with the same uniforms.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "warp", "sample", "sample_rng", "TOP_P_TOL"]

# Slack on the top-p mass test (cumulative mass >= top_p - TOP_P_TOL): float64 cumulative sums of probabilities that
# "should" reach top_p exactly (e.g. 0.5 + 0.3 vs 0.8) may fall short by an ulp; without the slack such a boundary
# token would drag one more token into the nucleus. 1e-12 is far above float64 rounding of a <=152k-term sum of
# probabilities and far below any mass that matters for sampling.
TOP_P_TOL = 1e-12

# Top-p without top-k: first look for the nucleus among this many highest-probability tokens (np.argpartition, O(V)),
# growing x8 until the candidates hold >= top_p of the mass in every row. Sorting only the candidates instead of the
# full 152k vocabulary is 2-3x faster for the peaked distributions LLMs produce; flat rows fall back to a full sort.
_TOP_P_FIRST_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a sampling distribution. Applied the same way on the device (q) and the cloud (p)."""

    temperature: float = 1.0  # logits are divided by this; 0 = greedy (one-hot at the argmax); 1 = unchanged
    top_k: int = 0  # keep the k largest logits (plus ties with the k-th); 0 = off
    top_p: float = 1.0  # keep the smallest most-probable set with mass >= top_p (nucleus sampling); 1 = off

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise ValueError(f"SamplingParams.temperature must be a real number, got {t!r}")
        if not math.isfinite(float(t)) or float(t) < 0:
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise ValueError(f"SamplingParams.top_k must be an int (0 = off), got {k!r}")
        if int(k) < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {k!r}")
        tp = self.top_p
        if isinstance(tp, bool) or not isinstance(tp, numbers.Real):
            raise ValueError(f"SamplingParams.top_p must be a real number, got {tp!r}")
        if not (0.0 < float(tp) <= 1.0):  # also rejects NaN
            raise ValueError(f"SamplingParams.top_p must satisfy 0 < top_p <= 1 (1 = off), got {tp!r}")
        # Normalise numpy scalars etc. to plain Python types (frozen: bypass __setattr__).
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(tp))

    @property
    def greedy(self) -> bool:
        """True for temperature 0: the distribution is one-hot at the argmax and top-k / top-p do not matter."""
        return self.temperature == 0.0


def _as_logits(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validated `logits # [..., V]` as `# [rows, V]` in their own dtype (not copied), and row maxima `# [rows, 1]`
    as float64."""
    a = np.asarray(logits)
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"logits must be a real float array, got dtype {a.dtype}")
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {a.shape}")
    a = a.reshape(-1, a.shape[-1])
    mx = a.max(axis=-1, keepdims=True).astype(np.float64)  # one pass finds NaN (propagates), +inf, all -inf rows
    if np.isnan(mx).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(mx).any():
        raise ValueError("logits contain +inf")
    if np.isneginf(mx).any():
        raise ValueError("a row of logits is entirely -inf: no token can be sampled")
    return a, mx


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Turn logits into the sampling distribution: temperature, then top-k, then top-p, then renormalise.

    logits: `# [..., V]` float16/32/64 (ints accepted). -inf marks masked tokens (probability 0); NaN, +inf and
        all -inf rows raise ValueError.
    Returns float64 probabilities `# [..., V]`, each row summing to 1 (up to rounding).

    - temperature 0 (greedy): one-hot at the first maximal logit (numpy argmax); top-k / top-p are irrelevant.
    - top-k: keeps every token whose logit is >= the k-th largest logit of its row. **Ties at the boundary are all
      kept** (so a row may keep more than k tokens), the rule Hugging Face's TopKLogitsWarper uses. Keeping ties makes
      the result depend only on the logit values, never on token order or on the partition algorithm. The set is
      chosen on the input logits (dividing by a temperature > 0 preserves their order).
    - top-p: on the distribution left after temperature and top-k, keeps the smallest set of most probable tokens
      whose mass is >= top_p (at least one token), i.e. every token whose probability is >= that of the boundary
      token, **again keeping all tokens tied with the boundary token**. The mass test has TOP_P_TOL slack.
    Vectorised over the leading dims. Cost for V = 151,936: a few O(V) passes (exp, np.argpartition); only the
    top-k survivors, or a small candidate set holding the nucleus, are ever sorted.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    shape = np.shape(logits)
    a, mx = _as_logits(logits)  # [rows, V] input dtype, [rows, 1] float64
    V = shape[-1]
    rows = np.arange(a.shape[0])

    if params.greedy:
        out = np.zeros(a.shape, dtype=np.float64)
        out[rows, np.argmax(a, axis=-1)] = 1.0
        return out.reshape(shape)

    T = params.temperature
    k = params.top_k
    top_idx = None  # [rows, k] the k largest logits of each row (unordered), when top-k is active
    kth = None  # [rows, 1] the k-th largest logit of each row
    if 0 < k < V:
        # Chosen on the input logits: dividing by T > 0 keeps the order (and does not invent ties).
        top_idx = np.argpartition(a, V - k, axis=-1)[:, V - k:]
        top_z = np.take_along_axis(a, top_idx, axis=-1)  # [rows, k]
        kth = top_z.min(axis=-1, keepdims=True)
        if (np.count_nonzero(a >= kth, axis=-1) == k).all():
            # Usual case, no ties with the k-th: everything below works on the k survivors only.
            w = np.exp((top_z.astype(np.float64) - mx) / T)  # [rows, k], max entry exactly 1
            if params.top_p < 1.0:
                w *= w >= _nucleus_threshold(w, w.sum(axis=-1, keepdims=True), params.top_p)
            w /= w.sum(axis=-1, keepdims=True)
            out = np.zeros(a.shape, dtype=np.float64)
            np.put_along_axis(out, top_idx, w, axis=-1)
            return out.reshape(shape)

    # Temperature: subtract the row max first, then divide, so the largest logit becomes exactly 0 and nothing can
    # overflow whatever the temperature (a tiny T sends the rest towards -inf, i.e. towards greedy).
    z = np.subtract(a, mx, dtype=np.float64)  # [rows, V] float64, a new array: worked on in place below
    if kth is not None:
        z[a < kth] = -np.inf  # top-k with ties: every token tied with the k-th largest is kept
    if T != 1.0:
        z /= T
    e = np.exp(z, out=z)  # [rows, V] unnormalised; -inf -> 0; the row max is exp(0) = 1, so row sums are >= 1
    if params.top_p < 1.0:
        total = e.sum(axis=-1, keepdims=True)  # [rows, 1]
        cand_idx = top_idx if top_idx is not None else _nucleus_candidates(e, total, params.top_p)
        if cand_idx is None:  # flat rows: the nucleus is (nearly) the whole vocabulary
            e *= e >= _nucleus_threshold(e, total, params.top_p)
        else:
            cand = np.take_along_axis(e, cand_idx, axis=-1)  # [rows, m]
            thresh = _nucleus_threshold(cand, total, params.top_p)  # [rows, 1]
            if (thresh > cand.min(axis=-1, keepdims=True)).all():
                # Every token outside the candidates weighs <= their minimum < thresh: the nucleus is among them.
                w = np.where(cand >= thresh, cand, 0.0)
                w /= w.sum(axis=-1, keepdims=True)
                out = np.zeros(a.shape, dtype=np.float64)
                np.put_along_axis(out, cand_idx, w, axis=-1)
                return out.reshape(shape)
            e *= e >= thresh  # the nucleus reaches the candidates' minimum: tokens tied with it may lie outside
    e /= e.sum(axis=-1, keepdims=True)
    return e.reshape(shape)


def softmax_prob(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Plain softmax probability (temperature 1, no truncation) of `tokens # [rows]` under `logits # [rows, V]`.

    The drafting confidence of HAT eq. 5: it does not depend on the sampling parameters (under greedy decoding the
    warped distribution is one-hot, so it would carry no information). Returns float64 `# [rows]`.
    """
    a, mx = _as_logits(logits)
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.shape[0] != a.shape[0]:
        raise ValueError(f"{tokens.shape[0]} tokens for {a.shape[0]} rows of logits")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= a.shape[1]):
        raise ValueError(f"tokens outside [0, {a.shape[1]})")
    norm = np.exp(a - mx).sum(axis=-1, dtype=np.float64)  # [rows]
    return np.exp(a[np.arange(a.shape[0]), tokens].astype(np.float64) - mx[:, 0]) / norm


def _nucleus_candidates(e: np.ndarray, total: np.ndarray, top_p: float) -> np.ndarray | None:
    """Indices `# [rows, m]` (unordered) of the m largest weights of each row, m large enough that they hold >= top_p
    of every row's mass; None if that takes the whole vocabulary.

    e: `# [rows, V]` non-negative weights; total: `# [rows, 1]` their row sums. Starts at _TOP_P_FIRST_CANDIDATES
    and grows x8 (np.argpartition is O(V) per try).
    """
    V = e.shape[-1]
    m = _TOP_P_FIRST_CANDIDATES
    while m < V:
        idx = np.argpartition(e, V - m, axis=-1)[:, V - m:]
        if (np.take_along_axis(e, idx, axis=-1).sum(axis=-1, keepdims=True) >= (top_p - TOP_P_TOL) * total).all():
            return idx
        m *= 8
    return None


def _nucleus_threshold(cand: np.ndarray, total: np.ndarray, top_p: float) -> np.ndarray:
    """Per row, the weight of the last token the top-p nucleus needs (tokens in descending order). `# [rows, 1]`.

    cand: `# [rows, m]` the m largest weights of each row, unordered (may be the whole row); total: `# [rows, 1]`
    the row sums of all weights. Keeping every weight >= the returned one keeps the nucleus plus ties with its last
    token. If the candidates never reach top_p of the total (rounding, or mass held by tokens tied with the k-th
    largest that are not among the top-k candidates) the smallest candidate is returned, i.e. all of them are kept.
    """
    cand = np.sort(cand, axis=-1)[:, ::-1]  # [rows, m] descending
    reached = np.cumsum(cand, axis=-1) >= (top_p - TOP_P_TOL) * total
    pos = np.where(reached.any(axis=-1), np.argmax(reached, axis=-1), cand.shape[-1] - 1)
    return np.take_along_axis(cand, pos[:, None], axis=-1)


def _check_probs(probs: np.ndarray, name: str = "probs") -> np.ndarray:
    a = np.asarray(probs)
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name} must be a real float array, got dtype {a.dtype}")
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {a.shape}")
    if a.size:
        lo = a.min(axis=-1)
        if np.isnan(lo).any():
            raise ValueError(f"{name} contain NaN")
        if (lo < 0).any():
            raise ValueError(f"{name} contain negative values")
        if not np.isfinite(a).all():
            raise ValueError(f"{name} contain inf")
    return a


def sample(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling with given uniforms: one token per row.

    probs: `# [..., V]` non-negative weights. Rows need not be normalised (the draw is from probs / row sum, so the
        residual max(p - q, 0) can be sampled without dividing), but each row must have positive mass.
    u: `# [...]` (probs.shape[:-1]) uniforms in [0, 1), e.g. `rng.random(shape)`.
    Returns int64 token ids `# [...]`: the first index i with cdf[i] > u * cdf[V-1], cdf = float64 cumsum.
    A zero-probability token is never returned: cdf does not move at such a token, so it can only be "hit" when
    u * total rounds up to total (possible only for a subnormal total, since u <= 1 - 2^-53); that case is clamped
    to the last index with positive probability.
    """
    a = _check_probs(probs)
    uu = np.asarray(u, dtype=np.float64)
    if uu.shape != a.shape[:-1]:
        raise ValueError(f"u must have shape {a.shape[:-1]} (probs.shape[:-1]), got {uu.shape}")
    if uu.size and (np.isnan(uu).any() or (uu < 0).any() or (uu >= 1).any()):
        raise ValueError("u must hold uniforms in [0, 1)")
    V = a.shape[-1]
    cdf = np.cumsum(a, axis=-1, dtype=np.float64)  # [..., V]
    total = cdf[..., -1]
    if (total <= 0).any():
        raise ValueError("a row of probs has zero total mass: nothing to sample")
    x = uu * total
    idx = np.count_nonzero(cdf <= x[..., None], axis=-1).astype(np.int64)  # cdf is non-decreasing
    over = idx >= V
    if over.any():  # u * total rounded to >= total: take the last token with positive probability
        last_pos = V - 1 - np.argmax(a[..., ::-1] > 0, axis=-1)
        idx = np.where(over, last_pos, idx)
    return idx


def sample_rng(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`sample(probs, rng.random(probs.shape[:-1]))`: one draw per row from a numpy Generator."""
    shape = np.shape(probs)[:-1]
    return sample(probs, rng.random(shape))
