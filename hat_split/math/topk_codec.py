"""Compressed draft distributions for CU-HLM: top-k(t) indices and b-bit probabilities as real packed bits.

Device: keep the k most probable tokens of x (the draft token always among them, CU-HLM §IV-B), quantize each kept
probability to `bits` bits (uniform levels i / (2^bits − 1)), and write indices at ⌈log2 |V|⌉ bits and probabilities
at `bits` bits into byte strings. Cloud: unpack the same bits and rebuild the full distribution by eq. 15 — kept
tokens get their (quantized) probabilities, the rest share the residual mass 1 − Σ kept uniformly.

Both sides call `reconstruct` on the decoded values, so the device knows exactly the x̂ the cloud verifies against;
`cuhlm --exact` samples its draft from that x̂, which makes verification exact again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def index_bits(vocab_size: int) -> int:
    """⌈log2 |V|⌉: bits per token index on the wire."""
    if vocab_size < 2:
        raise ValueError("vocab_size must be >= 2")
    return max(1, math.ceil(math.log2(vocab_size)))


def pack_bits(values: np.ndarray, width: int) -> bytes:
    """Unsigned ints `# [n]` (each < 2^width) → ⌈n·width / 8⌉ bytes, big-endian bit order, zero-padded."""
    v = np.asarray(values, dtype=np.uint64).reshape(-1)
    if not 1 <= width <= 32:
        raise ValueError(f"bit width must be in 1..32, got {width}")
    if v.size and int(v.max()) >> width:
        raise ValueError(f"a value does not fit in {width} bits")
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)  # [width]
    bits = ((v[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8)  # [n, width]
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_bits(data: bytes, width: int, n: int) -> np.ndarray:
    """Inverse of `pack_bits`: `# [n]` int64. ValueError if `data` is not exactly ⌈n·width / 8⌉ bytes."""
    if not 1 <= width <= 32:
        raise ValueError(f"bit width must be in 1..32, got {width}")
    if len(data) != (n * width + 7) // 8:
        raise ValueError(f"{len(data)} bytes cannot hold exactly {n} values of {width} bits")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))[: n * width].reshape(n, width)  # [n, width]
    weights = (1 << np.arange(width - 1, -1, -1, dtype=np.int64))  # [width]
    return bits.astype(np.int64) @ weights


@dataclass(frozen=True)
class TopK:
    """One row's compressed distribution: kept token ids and their probability levels (0 .. 2^bits − 1)."""

    indices: np.ndarray  # [k] int64, ascending
    levels: np.ndarray  # [k] int64
    bits: int


def select(x: np.ndarray, k: int, draft_token: int, bits: int) -> TopK:
    """Top-k of one distribution `x # [V]` with `draft_token` forced in (it replaces the k-th if absent)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    V = x.size
    if not 1 <= k <= V:
        raise ValueError(f"k must be in 1..{V}, got {k}")
    if not 0 <= draft_token < V:
        raise ValueError(f"draft token {draft_token} outside [0, {V})")
    if not 1 <= bits <= 24:
        raise ValueError(f"probability bits must be in 1..24, got {bits}")
    top = np.argpartition(-x, k - 1)[:k] if k < V else np.arange(V)  # [k], unordered
    if draft_token not in top:
        top[np.argmin(x[top])] = draft_token
    top = np.sort(top)
    scale = (1 << bits) - 1
    levels = np.rint(np.clip(x[top], 0.0, 1.0) * scale).astype(np.int64)  # [k]
    d = int(np.searchsorted(top, draft_token))
    levels[d] = max(levels[d], 1)  # the draft token's probability never rounds to 0 (it was sampled, x_d > 0)
    return TopK(top.astype(np.int64), levels, bits)


def reconstruct(row: TopK, vocab_size: int) -> np.ndarray:
    """CU-HLM eq. 15: `# [V]` float64 — kept tokens at their quantized probabilities, the residual spread uniformly
    over the V − k others. If rounding makes the kept mass exceed 1, the kept values are renormalised (residual 0)."""
    kept = row.levels.astype(np.float64) / ((1 << row.bits) - 1)  # [k]
    k = kept.size
    total = kept.sum()
    if total <= 0:
        raise ValueError("a compressed distribution needs positive kept mass")
    x_hat = np.empty(vocab_size, dtype=np.float64)
    if total >= 1.0 or k == vocab_size:
        x_hat.fill(0.0)
        x_hat[row.indices] = kept / total
        return x_hat
    x_hat.fill((1.0 - total) / (vocab_size - k))
    x_hat[row.indices] = kept
    return x_hat


def encode(rows: list[TopK], vocab_size: int) -> tuple[bytes, bytes, np.ndarray, int]:
    """Rows → (packed indices, packed probability levels, indptr `# [L + 1]` int64, bits)."""
    if not rows:
        raise ValueError("nothing to encode")
    bits = rows[0].bits
    if any(r.bits != bits for r in rows):
        raise ValueError("all rows of one message share a bit width")
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([r.indices.size for r in rows], out=indptr[1:])
    idx = np.concatenate([r.indices for r in rows])
    lev = np.concatenate([r.levels for r in rows])
    return pack_bits(idx, index_bits(vocab_size)), pack_bits(lev, bits), indptr, bits


def decode(index_bytes: bytes, level_bytes: bytes, indptr: np.ndarray, bits: int, n_rows: int,
           vocab_size: int) -> list[TopK]:
    """Inverse of `encode`, validating everything a correct encoder cannot produce (ValueError)."""
    indptr = np.asarray(indptr)
    if indptr.dtype != np.int64 or indptr.shape != (n_rows + 1,):
        raise ValueError(f"top-k indptr must be int64 of length {n_rows + 1}")
    if indptr[0] != 0 or np.any(np.diff(indptr) < 1):
        raise ValueError("every top-k row keeps at least one token")
    n = int(indptr[-1])
    if n > n_rows * vocab_size:
        raise ValueError("more kept tokens than the vocabulary holds")
    if not 1 <= bits <= 24:
        raise ValueError(f"probability bits must be in 1..24, got {bits}")
    idx = unpack_bits(index_bytes, index_bits(vocab_size), n)
    lev = unpack_bits(level_bytes, bits, n)
    rows = []
    for a, b in zip(indptr[:-1], indptr[1:]):
        ind = idx[a:b]
        if ind.size and (ind.max() >= vocab_size or np.any(np.diff(ind) <= 0)):
            raise ValueError("top-k indices must be ascending and inside the vocabulary")
        if lev[a:b].sum() <= 0:
            raise ValueError("a compressed distribution needs positive kept mass")
        rows.append(TopK(ind, lev[a:b], bits))
    return rows


def wire_bits(k: int, vocab_size: int, bits: int) -> int:
    """Bits one row costs on the wire: k indices at ⌈log2 |V|⌉ + k probabilities at `bits` (CU-HLM's count)."""
    return k * (index_bits(vocab_size) + bits)
