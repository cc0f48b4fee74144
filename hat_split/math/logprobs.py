"""Log-probabilities of emitted tokens, as OpenAI-compatible APIs return them (`logprobs`, `top_logprobs`), pure numpy.

`token_logprobs(logits, tokens, k)` takes the raw logits rows a model computed for the positions where `tokens` were
emitted and gives each token's log-probability under the model's own distribution (log-softmax of the raw logits:
before temperature, top-k or top-p, as the APIs report it) and the k most probable tokens of each row, most probable
first (ties: the smaller id first). Computed in float64 and returned as float32.

`Logprobs.source` says whose distribution it is: "target" (the cloud's model, or the device's copy of its head in the
split protocols: what the answer follows) or "draft" (a token the device committed without the target: a skipped
upload, a degraded stretch while the link was down, the device-only protocol).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

MAX_TOP_LOGPROBS = 20  # the most alternatives per token an API request may ask for (OpenAI's limit)
SOURCES = ("target", "draft")


@dataclass(frozen=True)
class Logprobs:
    values: np.ndarray  # [n] float32: each emitted token's log-probability
    top_ids: np.ndarray  # [n, k] int32: the k most probable tokens of each position, most probable first
    top_values: np.ndarray  # [n, k] float32: their log-probabilities
    source: str = "target"

    def __post_init__(self) -> None:
        n = self.values.shape[0]
        if self.values.ndim != 1 or self.top_ids.ndim != 2 or self.top_ids.shape != self.top_values.shape \
                or self.top_ids.shape[0] != n:
            raise ValueError(f"logprobs of {n} tokens need top_ids and top_values of shape [{n}, k], got "
                             f"{self.top_ids.shape} and {self.top_values.shape}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    def __len__(self) -> int:
        return int(self.values.shape[0])

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    def head(self, n: int) -> "Logprobs":
        """The first n tokens' entries."""
        return Logprobs(self.values[:n], self.top_ids[:n], self.top_values[:n], self.source)


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], k: int, source: str = "target") -> Logprobs:
    """`# logits [n, vocab]` raw rows, `tokens` [n] emitted at them, k alternatives per row (0..vocab)."""
    x = np.asarray(logits, dtype=np.float64)
    ids = np.asarray(tokens, dtype=np.int64)
    if x.ndim != 2 or x.shape[0] != ids.shape[0]:
        raise ValueError(f"need one logits row per token: rows {x.shape}, tokens {ids.shape}")
    if not 0 <= k <= x.shape[1]:
        raise ValueError(f"k must be in [0, {x.shape[1]}], got {k}")
    if ids.size and (ids.min() < 0 or ids.max() >= x.shape[1]):
        raise ValueError(f"token ids must be in [0, {x.shape[1]})")
    top = x.max(axis=1, keepdims=True)
    logp = x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))  # [n, vocab]
    rows = np.arange(x.shape[0])
    if k:
        part = np.argpartition(-logp, k - 1, axis=1)[:, :k] if k < x.shape[1] else np.tile(np.arange(x.shape[1]),
                                                                                            (x.shape[0], 1))
        order = np.lexsort((part, -logp[rows[:, None], part]), axis=1)  # by value, then the smaller id
        top_ids = np.take_along_axis(part, order, axis=1)
    else:
        top_ids = np.zeros((x.shape[0], 0), np.int64)
    return Logprobs(logp[rows, ids].astype(np.float32), top_ids.astype(np.int32),
                    logp[rows[:, None], top_ids].astype(np.float32), source)


def concat(parts: List[Logprobs]) -> Logprobs:
    """One Logprobs of several (same k); the source is "draft" only if every part is (per-token sources: `sources`)."""
    if not parts:
        return Logprobs(np.zeros(0, np.float32), np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32))
    return Logprobs(np.concatenate([p.values for p in parts]), np.concatenate([p.top_ids for p in parts]),
                    np.concatenate([p.top_values for p in parts]),
                    "draft" if all(p.source == "draft" for p in parts) else "target")


def sources(parts: List[Logprobs]) -> List[str]:
    """Each token's source, in order."""
    return [p.source for p in parts for _ in range(len(p))]
