"""Enumerative coding of lattice points and supports into exact-length bit fields (QS-SD eq. 6, SQS-SD eq. 1, 2, 5).

Pure Python integers (exact at any size) plus numpy for the arrays.

- A k-subset {c_1 < … < c_k} of {0 … n−1} has the combinatorial-number-system rank Σ_j C(c_j, j) ∈ [0, C(n, k)).
- A lattice point (counts b_1 … b_K ≥ 0, Σ b = ℓ) is a stars-and-bars arrangement: its K − 1 bar positions
  p_i = Σ_{t≤i} b_t + i form a (K−1)-subset of {0 … ℓ+K−2}, so it is ranked as a subset in [0, C(ℓ+K−1, K−1)).
- A field holding one of N values takes ⌈log2 N⌉ bits; `BitWriter` / `BitReader` concatenate fields into bytes.

A sparse quantized distribution is then: [K: ⌈log2 V⌉ bits when K varies] [support: ⌈log2 C(V, K)⌉]
[lattice point: ⌈log2 C(ℓ+K−1, K−1)⌉] — exactly the papers' bit counts, plus at most 7 bits of byte padding per frame.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np


def field_bits(n_values: int) -> int:
    """⌈log2 n⌉: bits of a field that holds one of n values (0 when there is only one)."""
    if n_values < 1:
        raise ValueError("a field needs at least one possible value")
    return (n_values - 1).bit_length()


def rank_subset(elements: Sequence[int]) -> int:
    """Rank of a strictly increasing sequence of non-negative integers in the combinatorial number system."""
    r, prev = 0, -1
    for j, c in enumerate(elements, start=1):
        c = int(c)
        if c <= prev:
            raise ValueError("subset elements must be strictly increasing")
        r += math.comb(c, j)
        prev = c
    return r


def unrank_subset(rank: int, n: int, k: int) -> List[int]:
    """The k-subset of {0 … n−1} with this rank (inverse of rank_subset).

    Decodes from the largest element down with a running binomial C(c, j), updated by exact integer steps
    (C(c−1, j) = C(c, j)·(c−j)/c and C(c−1, j−1) = C(c, j)·j/c); across a long gap it jumps to a float estimate
    of the next element first, so sparse supports of a large vocabulary decode in O(k) big-integer operations.
    """
    if not 0 <= k <= n or not 0 <= rank < math.comb(n, k):
        raise ValueError(f"rank {rank} is not a {k}-subset rank of {n} elements")
    out = [0] * k
    c = n - 1
    binom = math.comb(c, k) if k else 0
    for j in range(k, 0, -1):
        if binom > rank and rank > 0:
            guess = int(math.exp((math.log(rank) + math.lgamma(j + 1)) / j) + (j - 1) / 2) + 2
            if guess < c - _JUMP:
                c = max(guess, j)  # rank > 0: the element is at least j, and C(j, j) = 1 keeps the steps exact
                binom = math.comb(c, j)
                while binom <= rank:  # the estimate fell short: step up, C(c+1, j) = C(c, j)·(c+1)/(c+1−j)
                    up = binom * (c + 1) // (c + 1 - j)
                    if up > rank:
                        break
                    c, binom = c + 1, up
        while binom > rank:
            binom = binom * (c - j) // c
            c -= 1
        out[j - 1] = c
        rank -= binom
        if j > 1:
            binom = binom * j // c if c > 0 else 0
            c -= 1
    return out


_JUMP = 16  # gaps longer than this are crossed with a float estimate instead of one step at a time


def rank_composition(counts: Sequence[int]) -> int:
    """Rank of a lattice point (non-negative counts) among all with the same K and ℓ = Σ counts.

    The point is ranked by its bar positions (a (K−1)-subset of ℓ+K−1 slots) or, when ℓ < K − 1, by its star
    positions (the complementary ℓ-subset): both are bijections onto [0, C(ℓ+K−1, K−1)), and the smaller one costs
    O(min(ℓ, K)) big-integer steps — a full-vocabulary point with a small ℓ ranks as fast as a sparse one.
    """
    b = np.asarray(counts, dtype=np.int64).reshape(-1)
    if b.size < 1 or (b < 0).any():
        raise ValueError("a lattice point needs K >= 1 non-negative counts")
    k, ell = b.size, int(b.sum())
    if ell < k - 1:  # stars: the j-th ball of part i sits at slot before_i + i + j (only non-empty parts matter)
        parts = np.flatnonzero(b)
        n = b[parts]
        before = np.cumsum(n) - n  # balls in earlier parts
        stars = np.repeat(before + parts, n) + (np.arange(ell) - np.repeat(before, n))
        return rank_subset(stars.tolist())
    return rank_subset((np.cumsum(b)[:-1] + np.arange(k - 1)).tolist())  # bar i after part i


def unrank_composition(rank: int, k: int, ell: int) -> np.ndarray:
    """Counts `# [k]` of the lattice point with this rank (inverse of rank_composition)."""
    if k < 1 or ell < 0:
        raise ValueError("need K >= 1 and ℓ >= 0")
    if ell < k - 1:
        stars = np.asarray(unrank_subset(rank, ell + k - 1, ell), dtype=np.int64)
        return np.bincount(stars - np.arange(ell), minlength=k).astype(np.int64)  # part of a star = slot − stars before
    bars = unrank_subset(rank, ell + k - 1, k - 1)
    edges = [-1] + bars + [ell + k - 1]
    return np.array([edges[i + 1] - edges[i] - 1 for i in range(k)], dtype=np.int64)


def composition_bits(k: int, ell: int) -> int:
    return field_bits(math.comb(ell + k - 1, k - 1))


def subset_bits(n: int, k: int) -> int:
    return field_bits(math.comb(n, k))


class BitWriter:
    """Concatenates fixed-width fields (most significant first) into bytes."""

    def __init__(self) -> None:
        self.value = 0
        self.n_bits = 0

    def write(self, value: int, width: int) -> None:
        if width < 0 or not 0 <= value < (1 << width):
            raise ValueError(f"value {value} does not fit in {width} bits")
        self.value = (self.value << width) | int(value)
        self.n_bits += width

    def to_bytes(self) -> bytes:
        pad = -self.n_bits % 8
        return (self.value << pad).to_bytes((self.n_bits + pad) // 8, "big")


class BitReader:
    """Reads fixed-width fields back from BitWriter bytes."""

    def __init__(self, data: bytes, n_bits: int) -> None:
        if n_bits < 0 or n_bits > 8 * len(data):
            raise ValueError(f"{n_bits} bits announced but only {len(data)} bytes given")
        self.value = int.from_bytes(data, "big") >> (8 * len(data) - n_bits)
        self.left = n_bits

    def read(self, width: int) -> int:
        if width > self.left:
            raise ValueError("bit stream ends early")
        self.left -= width
        return (self.value >> self.left) & ((1 << width) - 1)


def encode_sparse(support: np.ndarray, counts: np.ndarray, vocab_size: int, ell: int, writer: BitWriter,
                  k_varies: bool) -> None:
    """One quantized distribution: [K − 1 in ⌈log2 V⌉ bits if k_varies] [support rank] [lattice point rank]."""
    k = len(support)
    if not 1 <= k <= vocab_size or len(counts) != k or int(np.sum(counts)) != ell:
        raise ValueError(f"need 1 <= K <= V, one count per support entry and counts summing to ℓ = {ell}")
    if k_varies:
        writer.write(k - 1, field_bits(vocab_size))
    writer.write(rank_subset(support) if k < vocab_size else 0, subset_bits(vocab_size, k))
    writer.write(rank_composition(counts), composition_bits(k, ell))


def decode_sparse(reader: BitReader, vocab_size: int, ell: int, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(support `# [K]`, counts `# [K]`) written by encode_sparse; k = None reads K from the stream."""
    if k is None:
        k = reader.read(field_bits(vocab_size)) + 1
    if not 1 <= k <= vocab_size:
        raise ValueError(f"support size {k} outside 1..{vocab_size}")
    rank = reader.read(subset_bits(vocab_size, k))
    support = np.arange(vocab_size) if k == vocab_size else np.array(unrank_subset(rank, vocab_size, k))
    counts = unrank_composition(reader.read(composition_bits(k, ell)), k, ell)
    return support.astype(np.int64), counts


def sparse_bits(vocab_size: int, k: int, ell: int, k_varies: bool) -> int:
    """The papers' bit count of one quantized distribution (SQS eq. 1, 2, 5; QS eq. 6 when K = V)."""
    return (field_bits(vocab_size) if k_varies else 0) + subset_bits(vocab_size, k) + composition_bits(k, ell)
