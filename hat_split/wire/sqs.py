"""Quantize-and-sample draft distributions (QS-SD, SQS-SD): supports, lattice rows, the conformal threshold. Pure numpy.

A device drafting with `qs`, `ksqs` or `csqs` turns each draft distribution q `# [V]` into a lattice row:
1. a support X — the whole vocabulary (`qs`, QS-SD), the K most probable tokens (`ksqs`, K-SQS) or {x : q(x) ≥ β_n}
   (`csqs`, C-SQS eq. 6);
2. the lattice point nearest to q renormalised on X (hat_split.math.lattice.nearest): integer counts summing to ℓ;
3. the draft token is sampled from q̂ = counts / ℓ, and exactly (X, counts) is sent (hat_split.math.enumerative bit
   fields).
The cloud verifies against q̂ itself, so the output follows the LLM exactly at any ℓ and K (QS-SD Proposition 1).

`sq` is the lossy prior art (sample, then quantize): the token is drawn from q and q̂ is quantized afterwards, with
one count moved onto the token if the rounding left it at zero. The cloud then verifies a token that was not drawn
from the distribution it is told about, and the output is biased.

`ConformalThreshold` is C-SQS's online update (eq. 8), checkpointed per draft and rolled back to the accepted prefix
when the verdict arrives (Algorithm 1); Lemma 4 bounds β and eq. 9 bounds the running mean of the dropped mass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from hat_split.wire import dist_codec
from hat_split.math import enumerative
from hat_split.math import lattice
from hat_split.wire.dist_codec import MAX_ELL, MAX_SPARSE_K
from hat_split.math.sampling import sample

SUPPORTS = ("full", "topk", "conformal")


@dataclass(frozen=True)
class LatticeRow:
    """One quantized draft distribution: q̂ = counts / ℓ on `support`, zero elsewhere."""

    support: np.ndarray  # [K] int64 token ids, ascending
    counts: np.ndarray  # [K] int64, summing to ℓ
    dropped: float = 0.0  # mass of q outside the support (α_n of SQS), for the conformal update and eq. 9

    @property
    def k(self) -> int:
        return int(self.support.size)

    def dense(self, vocab_size: int, ell: int) -> np.ndarray:
        """q̂ `# [vocab_size]` float64."""
        out = np.zeros(vocab_size, dtype=np.float64)
        out[self.support] = self.counts / ell
        return out

    def prob(self, token: int, ell: int) -> float:
        i = int(np.searchsorted(self.support, token))
        return float(self.counts[i]) / ell if i < self.support.size and self.support[i] == token else 0.0


def quantize_row(q: np.ndarray, ell: int, support: np.ndarray) -> LatticeRow:
    """The lattice point of resolution ℓ nearest to q `# [V]` renormalised on `support` (sorted token ids)."""
    q = np.asarray(q, dtype=np.float64).reshape(-1)
    support = np.asarray(support, dtype=np.int64)
    if support.size == q.size:  # the full vocabulary: no gather, nothing dropped
        return LatticeRow(support, lattice.nearest(q, ell), 0.0)
    kept = q[support]
    mass = float(kept.sum())
    if not mass > 0:  # all of q's mass lies outside the support: spread ℓ over it evenly
        kept = np.ones_like(kept)
    return LatticeRow(support, lattice.nearest(kept, ell), max(0.0, 1.0 - mass))


def force_token(row: LatticeRow, token: int) -> LatticeRow:
    """`sq`: give the sampled token a count of at least 1 (moved from the largest entry) on a full-vocabulary row.
    This is what makes sample-then-quantize biased."""
    if row.support.size <= token or row.support[token] != token:
        raise ValueError("sample-then-quantize needs a full-vocabulary row")
    counts = row.counts.copy()
    if counts[token] == 0:
        counts[int(np.argmax(counts))] -= 1
        counts[token] += 1
    return LatticeRow(row.support, counts, row.dropped)


def row_bits(vocab_size: int, k: int, ell: int, k_varies: bool) -> int:
    """Bits of one row on the wire (SQS eq. 4-5; QS eq. 6 for K = V)."""
    return enumerative.sparse_bits(vocab_size, k, ell, k_varies)


@dataclass
class ConformalThreshold:
    """C-SQS's threshold β_n with the online conformal update (SQS eq. 8) and per-round checkpoints (Algorithm 1).

    During a round every draft calls `observe(dropped)` after its support was cut at the current β. When the verdict
    arrives, `settle(n_accepted, n_drafted)` keeps the updates of the accepted drafts and, after a rejection, of the
    position the cloud resampled (the LLM's token there was drawn against that very row); the updates of the
    rejected drafts after it are undone, so β only ever learns from distributions that shaped the output.
    """

    alpha: float = 0.0005  # target dropped mass α (paper: 0.0005)
    eta: float = 0.001  # learning rate η (paper: 0.001)
    beta: float = 0.01  # β_1^1, the initial threshold
    _trail: List[Tuple[float, float]] = field(default_factory=list)  # (β before, dropped mass) per draft this round
    kept_dropped: List[float] = field(default_factory=list)  # dropped mass of every settled row, in order
    initial_beta: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"conformal α must be in (0, 1), got {self.alpha}")
        if not self.eta > 0:
            raise ValueError(f"conformal η must be > 0, got {self.eta}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"initial threshold β must be in [0, 1], got {self.beta}")
        self.initial_beta = self.beta

    def support(self, q: np.ndarray) -> np.ndarray:
        return lattice.threshold_support(q, self.beta)

    def observe(self, dropped: float) -> None:
        """Eq. 8 after one draft: β ← β − η (dropped − α)."""
        self._trail.append((self.beta, float(dropped)))
        self.beta -= self.eta * (float(dropped) - self.alpha)

    def settle(self, n_accepted: int, n_drafted: int) -> None:
        """The cloud accepted n_accepted of this round's n_drafted drafts: roll β back to what they (and the
        resampled position) taught it."""
        if n_drafted != len(self._trail) or not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"settle({n_accepted}, {n_drafted}) does not match {len(self._trail)} observed drafts")
        keep = min(n_accepted + 1, n_drafted)
        if keep < n_drafted:
            self.beta = self._trail[keep][0]
        self.kept_dropped.extend(d for _, d in self._trail[:keep])
        self._trail.clear()

    def bounds(self) -> Tuple[float, float]:
        """SQS Lemma 4: −η(1−α) ≤ β_n ≤ 1 + ηα for every n (β_1 in [0, 1])."""
        return -self.eta * (1 - self.alpha), 1 + self.eta * self.alpha

    def mean_dropped_bound(self, n: Optional[int] = None) -> float:
        """SQS eq. 9: the mean dropped mass over T settled rows is at most α + (|β_1| + 1 + ηα) / (ηT)."""
        t = len(self.kept_dropped) if n is None else n
        return self.alpha + (abs(self.initial_beta) + 1 + self.eta * self.alpha) / (self.eta * max(t, 1))


@dataclass
class LatticeWire:
    """The device's side of `qs` / `ksqs` / `csqs` / `sq`: support rule, resolution ℓ and the draw (pure numpy)."""

    vocab_size: int
    ell: int = 100  # lattice resolution (SQS §4: 100)
    support_rule: str = "full"  # "full" (qs), "topk" (ksqs), "conformal" (csqs)
    k: int = 16  # ksqs: support size K
    conformal: Optional[ConformalThreshold] = None  # csqs
    sample_first: bool = False  # `sq`: draw the token from q, then quantize (lossy)

    def __post_init__(self) -> None:
        if self.support_rule not in SUPPORTS:
            raise ValueError(f"support must be one of {SUPPORTS}, got {self.support_rule!r}")
        if not 1 <= self.ell <= MAX_ELL:
            raise ValueError(f"lattice resolution ℓ must be in 1..{MAX_ELL}, got {self.ell}")
        if self.support_rule == "topk" and not (1 <= self.k <= min(MAX_SPARSE_K, self.vocab_size)
                                                or self.k == self.vocab_size):
            raise ValueError(f"K must be in 1..{min(MAX_SPARSE_K, self.vocab_size)} or the vocabulary size "
                             f"{self.vocab_size}, got {self.k}")
        if self.support_rule == "conformal" and self.conformal is None:
            self.conformal = ConformalThreshold()

    @property
    def k_varies(self) -> bool:
        return self.support_rule == "conformal"

    @property
    def fixed_k(self) -> int:
        """K as the wire header states it: V for qs, K for ksqs, 0 (each row carries its own) for csqs."""
        return {"full": self.vocab_size, "topk": self.k, "conformal": 0}[self.support_rule]

    def quantize(self, q: np.ndarray) -> LatticeRow:
        q = np.asarray(q, dtype=np.float64).reshape(-1)
        if self.support_rule == "full":
            support = np.arange(q.size)
        elif self.support_rule == "topk":
            support = lattice.topk_support(q, self.k)
        else:
            support = self.conformal.support(q)
            if support.size > MAX_SPARSE_K or _log2_comb(q.size, support.size) >= _log2_comb(
                    self.ell + q.size - 1, self.ell) - _log2_comb(self.ell + support.size - 1, self.ell):
                support = np.arange(q.size)  # naming the support would cost more than sending the whole vocabulary
        return quantize_row(q, self.ell, support)

    def bits(self, row: LatticeRow) -> int:
        return row_bits(self.vocab_size, row.k, self.ell, self.k_varies)

    def sample(self, row: LatticeRow, q: np.ndarray, u: float) -> Tuple[int, LatticeRow, np.ndarray]:
        """Draw the draft token: from q̂ (quantize, then sample), or from q with `sample_first`.
        Returns (token, the row that is sent, the distribution the token was drawn from `# [V]`)."""
        if self.sample_first:
            q = np.asarray(q, dtype=np.float64).reshape(-1)
            token = int(sample(q[None], np.array([u]))[0])
            row, drawn_from = force_token(row, token), q
        else:
            i = int(sample(row.counts[None].astype(np.float64), np.array([u]))[0])
            token, drawn_from = int(row.support[i]), None
        if self.conformal is not None:
            self.conformal.observe(row.dropped)
        return token, row, drawn_from if drawn_from is not None else row.dense(self.vocab_size, self.ell)

    def pack(self, rows: List[LatticeRow]):
        return dist_codec.pack_lattice(rows, self.vocab_size, self.ell, self.fixed_k)

    def settle(self, n_accepted: int, n_drafted: int) -> None:
        if self.conformal is not None:
            self.conformal.settle(n_accepted, n_drafted)



def _log2_comb(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
