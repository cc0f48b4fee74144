"""Exact speculative verification: accept a prefix of the drafts, then one resampled or bonus token.

Terms (draft q, target p, accepted / rejected / resampled / bonus) are defined in `hat_split.math.sampling`. The rule,
Leviathan et al. 2023 Algorithm 1 = Chen et al. 2023 Algorithm 2 = QS-SD eqs. (1)-(3), for each batch row:

    for l = 1 .. L:   accept x_l  iff  u_l * q_l(x_l) < p_l(x_l)        (u_l ~ U[0,1), i.e. prob. min(1, p_l/q_l))
    first rejection at l:   emit a token ~ norm(max(p_l - q_l, 0))       (resampled)
    all L accepted:         emit a token ~ p_{L+1}                         (bonus)

so every row yields its N accepted drafts plus exactly one cloud token, and the emitted sequence is distributed
exactly as if the target had sampled it autoregressively (QS-SD eq. (4)).

Pure functions over numpy arrays (STYLE.md lesson 1): no model, no I/O. The randomness comes in as explicit uniforms
(`speculative_verify`) or from one numpy Generator with a documented draw order (`verify_rng`), so a seeded session
is reproducible, and a batch gives the same answer as its rows verified one by one with the same uniforms.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from hat_split.math.sampling import sample

__all__ = [
    "VerifyResult",
    "speculative_verify",
    "verify_rng",
    "acceptance_rate",
    "expected_accepted",
    "expected_tokens",
    "expected_tokens_beta",
    "alpha_for_tokens",
    "ideal_speedup",
    "PROB_SUM_ATOL",
]

# How far a distribution's sum may be from 1. Wide enough for float16/float32 softmax over a 152k vocabulary and for
# the quantized / top-k-reconstructed draft distributions of QS-SD and CU-HLM; narrow enough to catch logits sent
# where probabilities were expected, or a distribution truncated without renormalising.
PROB_SUM_ATOL = 1e-3


@dataclass
class VerifyResult:
    """Outcome of one batched verification."""

    n_accepted: np.ndarray  # [batch] int64: accepted drafts N, 0 <= N <= draft_len of the row
    tokens: np.ndarray  # [batch, L+1] int64: the N accepted drafts, then the resampled-or-bonus token, then -1s

    def row(self, i: int) -> list[int]:
        """The tokens row i commits: its accepted drafts followed by the resampled or bonus token (N + 1 ids)."""
        n = int(self.n_accepted[i])
        return [int(t) for t in self.tokens[i, : n + 1]]


def _real_array(a: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a real float array, got dtype {arr.dtype}")
    return arr


def _check_uniforms(u: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    uu = _real_array(u, name).astype(np.float64, copy=False)
    if uu.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {uu.shape}")
    if uu.size and (np.isnan(uu).any() or (uu < 0).any() or (uu >= 1).any()):
        raise ValueError(f"{name} must hold uniforms in [0, 1)")
    return uu


def _check_dists(d: np.ndarray, used: np.ndarray, name: str, atol: float) -> None:
    """d `# [B or 1, n, V]`; used `# [B, n]` bool: which rows are read. Unused (padding) rows are not checked."""
    if d.shape[0] == 1 and used.shape[0] != 1:
        used = used.any(axis=0, keepdims=True)
    if not used.any():
        return
    sub = d.reshape(-1, d.shape[-1]) if used.all() else d[used]  # [n_used, V]; no copy in the common case
    lo = sub.min(axis=-1)
    if np.isnan(lo).any():
        raise ValueError(f"{name} contains NaN")
    if (lo < 0).any():
        raise ValueError(f"{name} contains negative probabilities")
    s = sub.sum(axis=-1, dtype=np.float64)
    if not np.isfinite(s).all():
        raise ValueError(f"{name} contains inf")
    bad = np.abs(s - 1.0) > atol
    if bad.any():
        raise ValueError(
            f"{name} rows must be probability distributions summing to 1 (atol {atol}); "
            f"{int(bad.sum())} row(s) do not, e.g. sum = {s[bad][0]!r} (logits passed instead of probabilities?)"
        )


def speculative_verify(
    draft_tokens: np.ndarray,
    q: np.ndarray,
    p: np.ndarray,
    accept_u: np.ndarray,
    resample_u: np.ndarray,
    draft_lens: np.ndarray | None = None,
    *,
    sum_atol: float = PROB_SUM_ATOL,
) -> VerifyResult:
    """Verify a batch of drafts against the target with the exact speculative sampling rule (module docstring).

    draft_tokens: `# [B, L]` int token ids x_1..x_L (entries past a row's draft_len are ignored, e.g. -1 padding).
    q: `# [B, L, V]` (or `# [1, L, V]`, shared by all rows): the draft distributions the drafts were sampled from.
    p: `# [B, L+1, V]` (or `# [1, L+1, V]`): target distributions; row j is for draft j's position, row L (row
        draft_lens[b] for a ragged row) for the bonus token.
    accept_u: `# [B, L]` uniforms in [0, 1) for the accept tests; resample_u: `# [B]` uniforms in [0, 1) for the
        resampled or bonus token (a row uses exactly one of the two).
    draft_lens: `# [B]` optional ints in [0, L]: row b only uses its first draft_lens[b] drafts (ragged batch).
    sum_atol: tolerance on each used distribution summing to 1.

    A draft is accepted iff accept_u * q(x) < p(x), i.e. with probability exactly min(1, p(x)/q(x)), with no
    division. After the first rejection, at position l, the emitted token is drawn from max(p_l - q_l, 0) by inverse
    CDF (`sampling.sample`, no normalising division needed). If that residual is all zero the token is drawn from p_l
    instead. Under exact arithmetic this cannot happen: a rejection needs q_l(x) > u * q_l(x) >= p_l(x), and since
    both sum to 1 some other token then has p_l > q_l. Residual mass can only vanish when p_l <= q_l everywhere,
    i.e. p_l == q_l, which never rejects (u < 1). It can only arise from inputs whose sums are off by rounding, and
    then p_l is the distribution the residual tends to.

    Raises ValueError on inconsistent shapes, token ids outside [0, V), a draft whose own q probability is 0 (it
    cannot have been sampled from q), distributions with NaN / negative entries / sums away from 1, uniforms outside
    [0, 1) and draft_lens outside [0, L]. Only the rows that are read (given draft_lens) are checked.
    Vectorised over the batch and the draft positions; memory O(B * V) beyond the inputs.
    """
    x = np.asarray(draft_tokens)
    if x.ndim != 2:
        raise ValueError(f"draft_tokens must have shape [B, L], got {x.shape}")
    if x.size and not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"draft_tokens must be integer token ids, got dtype {x.dtype}")
    B, L = x.shape
    q = _real_array(q, "q")
    p = _real_array(p, "p")
    if q.ndim != 3 or p.ndim != 3:
        raise ValueError(f"q must be [B, L, V] and p [B, L+1, V], got q {q.shape}, p {p.shape}")
    V = p.shape[2]
    if V < 1:
        raise ValueError("vocabulary size V must be >= 1")
    if q.shape[0] not in (1, B) or q.shape[1] != L or q.shape[2] != V:
        raise ValueError(
            f"q must have shape [B={B} or 1, L={L}, V={V}] (draft_tokens {x.shape}, p {p.shape}), got {q.shape}"
        )
    if p.shape[0] not in (1, B) or p.shape[1] != L + 1:
        raise ValueError(f"p must have shape [B={B} or 1, L+1={L + 1}, V] (draft_tokens {x.shape}), got {p.shape}")
    accept_u = _check_uniforms(accept_u, (B, L), "accept_u")
    resample_u = _check_uniforms(resample_u, (B,), "resample_u")

    if draft_lens is None:
        lens = np.full(B, L, dtype=np.int64)
    else:
        lens = np.asarray(draft_lens)
        if lens.shape != (B,):
            raise ValueError(f"draft_lens must have shape [B={B}], got {lens.shape}")
        if lens.size and not np.issubdtype(lens.dtype, np.integer):
            raise ValueError(f"draft_lens must be integers, got dtype {lens.dtype}")
        lens = lens.astype(np.int64)
        if ((lens < 0) | (lens > L)).any():
            raise ValueError(f"draft_lens must lie in [0, L={L}], got min {lens.min()} max {lens.max()}")

    pos = np.arange(L)
    valid = pos[None, :] < lens[:, None]  # [B, L] drafts that exist
    x = x.astype(np.int64)
    if ((x < 0) | (x >= V))[valid].any():
        raise ValueError(f"draft_tokens hold token ids outside [0, V={V})")
    _check_dists(q, valid, "q", sum_atol)
    _check_dists(p, np.arange(L + 1)[None, :] <= lens[:, None], "p", sum_atol)

    xs = np.where(valid, x, 0)  # [B, L] safe gather indices
    qb = np.broadcast_to(q, (B, L, V))
    pb = np.broadcast_to(p, (B, L + 1, V))
    qx = np.take_along_axis(qb, xs[:, :, None], axis=2)[:, :, 0].astype(np.float64)  # [B, L] q_l(x_l)
    px = np.take_along_axis(pb[:, :L], xs[:, :, None], axis=2)[:, :, 0].astype(np.float64)  # [B, L] p_l(x_l)
    if (valid & (qx <= 0)).any():
        raise ValueError(
            "a draft token has probability 0 under its own q: q must be the distribution it was sampled from"
        )

    accepted = (accept_u * qx < px) & valid  # [B, L]
    n_acc = np.cumprod(accepted, axis=1).sum(axis=1).astype(np.int64)  # [B] length of the accepted prefix

    rows = np.arange(B)
    rejected = n_acc < lens  # [B] True: resample at position n_acc; False: bonus from p row lens (= n_acc)
    dist = pb[rows, n_acc].astype(np.float64)  # [B, V] p at the emitted position
    if rejected.any():
        r = rows[rejected]
        resid = np.maximum(dist[r] - qb[r, n_acc[r]], 0.0)  # [n_rej, V]
        empty = resid.sum(axis=-1) <= 0  # only with rounding-level mis-normalised inputs; see docstring
        dist[r] = np.where(empty[:, None], dist[r], resid)
    new = sample(dist, resample_u)  # [B]

    tokens = np.where(pos[None, :] < n_acc[:, None], x, -1)  # [B, L]
    tokens = np.concatenate([tokens, np.full((B, 1), -1, dtype=np.int64)], axis=1)  # [B, L+1]
    tokens[rows, n_acc] = new
    return VerifyResult(n_accepted=n_acc, tokens=tokens)


def verify_rng(
    draft_tokens: np.ndarray,
    q: np.ndarray,
    p: np.ndarray,
    rng: np.random.Generator,
    draft_lens: np.ndarray | None = None,
    *,
    sum_atol: float = PROB_SUM_ATOL,
) -> VerifyResult:
    """`speculative_verify` with uniforms from `rng`, drawn in this fixed order (part of seeded determinism):
    first `accept_u = rng.random((B, L))`, then `resample_u = rng.random(B)`. The full (B, L) block is drawn even
    for ragged rows, so the generator advances by B * (L + 1) doubles whatever is accepted."""
    shape = np.shape(draft_tokens)
    if len(shape) != 2:
        raise ValueError(f"draft_tokens must have shape [B, L], got {shape}")
    B, L = shape
    accept_u = rng.random((B, L))
    resample_u = rng.random(B)
    return speculative_verify(draft_tokens, q, p, accept_u, resample_u, draft_lens, sum_atol=sum_atol)


def acceptance_rate(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """beta = sum_v min(p(v), q(v)) = 1 - TV(p, q): probability that a draft sampled from q is accepted against p.

    p, q: `# [..., V]`. Returns `# [...]` float64. Leviathan et al. 2023 call it beta (acceptance rate) and its
    expectation over positions alpha: the alpha of `expected_tokens` / `ideal_speedup`.
    """
    return np.minimum(np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)).sum(axis=-1)


def acceptance_of_samples(p_drawn: np.ndarray, q_at: np.ndarray) -> np.ndarray:
    """Unbiased estimates of beta from tokens x the target sampled itself: min(1, q(x) / p(x)) each.

    p_drawn: `# [n]` p(x), each token's probability under the distribution it was drawn from (> 0: it was drawn);
    q_at: `# [n]` q(x), the draft's probability of the same token from the same prefix. For x ~ p,
    E[min(1, q(x) / p(x))] = sum_v p(v) min(1, q(v) / p(v)) = sum_v min(p(v), q(v)) = beta (`acceptance_rate`), so the
    mean over the target's own tokens (protocol `llm`) estimates what sd's drafts would have had accepted there,
    without a draft. At temperature 0 p(x) = 1 and q(x) is 1 where the draft's argmax names x: the count of agreements.
    Returns `# [n]` float64 in [0, 1]."""
    p = _real_array(p_drawn, "p_drawn").astype(np.float64)
    q = _real_array(q_at, "q_at").astype(np.float64)
    if p.ndim != 1 or p.shape != q.shape:
        raise ValueError(f"p_drawn and q_at must be [n] of one length, got {p.shape} and {q.shape}")
    if not ((p > 0) & (p <= 1)).all():
        raise ValueError("p_drawn must be in (0, 1]: each token was drawn from it")
    if not ((q >= 0) & (q <= 1)).all():
        raise ValueError("q_at must be in [0, 1]")
    return np.minimum(1.0, q / p)


def _check_alpha_gamma(alpha: float, gamma: int) -> tuple[float, int]:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"alpha must be a real number in [0, 1], got {alpha!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral) or int(gamma) < 0:
        raise ValueError(f"gamma (draft length) must be an int >= 0, got {gamma!r}")
    return float(alpha), int(gamma)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted by one verification of gamma drafts with i.i.d. acceptance rate alpha:
    (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023, eq. (1)); gamma + 1 at alpha = 1."""
    a, g = _check_alpha_gamma(alpha, gamma)
    if a == 1.0:
        return float(g + 1)
    if a == 0.0:
        return 1.0
    # 1 - a^(g+1) without cancellation near a = 1: -expm1((g+1) log a), with log a = log1p(a - 1) there (a - 1 is
    # exact); below 1/2 log a itself (a - 1 rounds to -1 for a below 1e-16, where log1p has no value)
    log_a = math.log(a) if a < 0.5 else math.log1p(a - 1.0)
    return -math.expm1((g + 1) * log_a) / (1.0 - a)


def expected_tokens_beta(a: float, b: float, gamma: int, scale: float = 1.0) -> float:
    """`expected_tokens` of a chain of gamma drafts whose acceptance rate is not known but believed
    alpha = scale * x, x ~ Beta(a, b): E[sum_{k=0..gamma} alpha^k] = sum_k scale^k E[x^k], with
    E[x^k] = prod_{j<k} (a + j) / (a + b + j). a, b: pseudo-counts of accepted and rejected drafts (b = 0: x = 1).

    Higher than `expected_tokens` at the mean alpha (alpha^k is convex): a chain of 8 on prompts whose own alpha
    spreads 0.6 to 1.0 commits some 15 % more a round than a prompt of their mean alpha would (Jensen)."""
    for name, v in (("a", a), ("b", b), ("scale", scale)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)) or float(v) < 0:
            raise ValueError(f"{name} must be a finite real >= 0, got {v!r}")
    if not float(a) + float(b) > 0:
        raise ValueError(f"a + b must be > 0 (pseudo-counts of a Beta), got a = {a!r}, b = {b!r}")
    if float(scale) > 1.0:
        raise ValueError(f"scale must be in [0, 1] (an acceptance rate's factor), got {scale!r}")
    _, g = _check_alpha_gamma(0.0, gamma)
    a, b, scale = float(a), float(b), float(scale)
    term, total = 1.0, 1.0
    for j in range(g):
        term *= scale * (a + j) / (a + b + j)
        total += term
    return total


def alpha_for_tokens(tau: float, gamma: int) -> float:
    """The alpha whose chains of gamma commit tau tokens a round: `expected_tokens`(alpha, gamma) = tau (bisection: it
    grows with alpha)."""
    _, g = _check_alpha_gamma(0.0, gamma)
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not 1.0 <= float(tau) <= g + 1:
        raise ValueError(f"a chain of {g} commits 1 to {g + 1} tokens a round, not {tau!r}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, g) < tau else (lo, mid)
    return (lo + hi) / 2


def expected_accepted(alpha: float, gamma: int) -> float:
    """Expected number of accepted drafts N out of gamma, acceptance rate alpha (i.i.d.):
    sum_{i=1..gamma} alpha^i = alpha (1 - alpha^gamma) / (1 - alpha) = expected_tokens - 1; gamma at alpha = 1."""
    return expected_tokens(alpha, gamma) - 1.0


def ideal_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement factor of speculative decoding over target-only decoding:
    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) (Leviathan et al. 2023, Theorem 3.8), where c is the cost of
    one draft step relative to one target step; (gamma + 1) / (gamma c + 1) at alpha = 1. Ignores the link."""
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not (math.isfinite(float(c)) and float(c) >= 0):
        raise ValueError(f"c (draft/target cost ratio) must be a finite real >= 0, got {c!r}")
    return expected_tokens(alpha, gamma) / (gamma * float(c) + 1.0)
