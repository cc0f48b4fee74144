"""Draft distributions on the wire: dense or CSR-sparse, float16 or float32 — and exact by construction.

The device rounds each draft distribution to the wire dtype (`quantize`), samples its draft token from the
renormalised rounded values (`dequantize`), and ships exactly those values (`pack`); the cloud unpacks and applies the
same `dequantize`. Whatever the wire format rounds away (float16 mantissa bits, probabilities below float16's smallest
subnormal ≈ 6e-8) is rounded away before sampling on both sides, so speculative verification stays exact (the
"quantize, then sample" principle of QS-SD, §III). Sparse packing drops only exact zeros, so it is lossless; it pays
off whenever top-k / top-p or temperature 0 leave few non-zero entries (greedy rows are one-hot).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from hat_split.math import enumerative
from hat_split.math import topk_codec
from hat_split.wire.messages import DistPayload
from hat_split.math.sampling import sample

WIRE_DTYPES = ("float16", "float32")
MAX_ELL = 4096  # largest lattice resolution on the wire: decoding a row costs O(min(ℓ, K)) big-integer steps
MAX_SPARSE_K = 4096  # largest lattice support short of the whole vocabulary (a larger one costs more bits anyway)


def quantize(q: np.ndarray, dtype: str = "float16") -> np.ndarray:
    """q `# [L, vocab]` probabilities → the values that go on the wire `# [L, vocab]` in `dtype`."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, not {dtype!r}")
    if q.ndim != 2:
        raise ValueError(f"draft distributions must be [L, vocab], got shape {q.shape}")
    q32 = np.ascontiguousarray(q, dtype=np.float32)  # defined as float64 → float32 → wire, on every path
    if dtype == "float32":
        return q32
    return _float32_to_float16(q32)


def _float32_to_float16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 → float16. numpy's cast takes ~7 ms per 151,936-entry row on a 2-core Xeon;
    torch's vectorised cast (same IEEE rounding, checked bit-for-bit in the tests) ~0.02 ms, used when the process
    already has torch loaded (every drafting device does); numpy otherwise."""
    torch = sys.modules.get("torch")
    if torch is None:
        return x.astype(np.float16)
    return torch.from_numpy(x).to(torch.float16).numpy()


def dequantize(values: np.ndarray) -> np.ndarray:
    """Wire values `# [L, vocab]` → float64 distributions `# [L, vocab]`, rows renormalised to sum to 1."""
    q = values.astype(np.float64)
    if not np.all(np.isfinite(q)) or np.any(q < 0):
        raise ValueError("distributions must be finite and non-negative")
    sums = q.sum(axis=1, keepdims=True)  # [L, 1]
    if np.any(sums <= 0):
        raise ValueError("every distribution needs positive mass")
    q /= sums
    return q


def pack(values: np.ndarray, format: str = "auto") -> DistPayload:
    """Wire values `# [L, vocab]` → payload; `format` is "dense", "sparse" or "auto" (the smaller of the two)."""
    if format not in ("dense", "sparse", "auto"):
        raise ValueError(f"format must be 'dense', 'sparse' or 'auto', not {format!r}")
    if format == "dense":
        return DistPayload("dense", values)
    nonzero = _nonzero_mask(values)  # [L, vocab] bool
    if format == "auto":
        itemsize = values.dtype.itemsize
        sparse_bytes = int(nonzero.sum()) * (4 + itemsize) + 8 * (values.shape[0] + 1)
        if sparse_bytes >= values.size * itemsize:
            return DistPayload("dense", values)
    rows, cols = np.nonzero(nonzero)  # row-major: ascending columns within each row
    indptr = np.zeros(values.shape[0] + 1, dtype=np.int64)  # [L + 1]
    np.cumsum(np.bincount(rows, minlength=values.shape[0]), out=indptr[1:])
    return DistPayload("sparse", values[rows, cols], cols.astype(np.int32), indptr)


def _nonzero_mask(values: np.ndarray) -> np.ndarray:
    """values != 0, on the bit pattern for float16 (numpy compares float16 through float32: ~10x slower)."""
    if values.dtype == np.float16:
        return (values.view(np.uint16) & 0x7FFF) != 0
    return values != 0


def unpack(payload: DistPayload, n_rows: int, vocab_size: int) -> np.ndarray:
    """Payload → wire values `# [n_rows, vocab_size]`; ValueError on anything a correct `pack` cannot produce."""
    values = payload.values
    if not isinstance(values, np.ndarray) or values.dtype.name not in WIRE_DTYPES:
        raise ValueError(f"distribution values must be one of {WIRE_DTYPES}")
    if payload.format == "dense":
        if values.shape != (n_rows, vocab_size):
            raise ValueError(f"dense distributions have shape {values.shape}, expected {(n_rows, vocab_size)}")
        return values
    if payload.format != "sparse":
        raise ValueError(f"unknown distribution format {payload.format!r}")
    indices, indptr = payload.indices, payload.indptr
    if not (isinstance(indices, np.ndarray) and indices.dtype == np.int32 and indices.ndim == 1):
        raise ValueError("sparse distributions need 1-D int32 indices")
    if not (isinstance(indptr, np.ndarray) and indptr.dtype == np.int64 and indptr.shape == (n_rows + 1,)):
        raise ValueError(f"sparse distributions need int64 indptr of length {n_rows + 1}")
    if values.ndim != 1 or values.shape != indices.shape:
        raise ValueError("sparse values and indices must be 1-D and of equal length")
    if indptr[0] != 0 or indptr[-1] != values.shape[0] or np.any(np.diff(indptr) < 0):
        raise ValueError("sparse indptr must rise from 0 to the number of values")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= vocab_size):
        raise ValueError(f"sparse indices outside [0, {vocab_size})")
    rows = np.repeat(np.arange(n_rows), np.diff(indptr))  # [nnz]
    if indices.size > 1 and np.any((np.diff(indices) <= 0) & (rows[1:] == rows[:-1])):
        raise ValueError("sparse indices must be strictly ascending within a row")
    dense = np.zeros((n_rows, vocab_size), dtype=values.dtype)
    dense[rows, indices] = values
    return dense


def pack_topk(rows: list, vocab_size: int) -> DistPayload:
    """CU-HLM rows (`topk_codec.TopK`) → a "topk" payload of real packed bits."""
    index_bytes, level_bytes, indptr, bits = topk_codec.encode(rows, vocab_size)
    return DistPayload("topk", np.frombuffer(level_bytes, np.uint8), np.frombuffer(index_bytes, np.uint8), indptr, bits)


def decode_topk(payload: DistPayload, n_rows: int, vocab_size: int) -> list:
    for name in ("values", "indices"):
        arr = getattr(payload, name)
        if not (isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.ndim == 1):
            raise ValueError(f"top-k {name} must be 1-D uint8 bytes")
    return topk_codec.decode(payload.indices.tobytes(), payload.values.tobytes(), payload.indptr, payload.bits,
                             n_rows, vocab_size)


def pack_lattice(rows: list, vocab_size: int, ell: int, k: int) -> DistPayload:
    """Lattice rows (anything with `.support` and `.counts`, e.g. hat_split.wire.sqs.LatticeRow) → a "lattice" payload:
    one enumerative bit stream (hat_split.math.enumerative.encode_sparse per row); k = 0 writes each row's K."""
    writer = enumerative.BitWriter()
    for row in rows:
        if k and row.support.size != k:
            raise ValueError(f"a row has {row.support.size} support tokens, the payload states K = {k}")
        enumerative.encode_sparse(row.support, row.counts, vocab_size, ell, writer, k_varies=not k)
    return DistPayload("lattice", np.frombuffer(writer.to_bytes(), np.uint8), bits=writer.n_bits, ell=ell, k=k)


def decode_lattice(payload: DistPayload, n_rows: int, vocab_size: int) -> list:
    """Payload → [(support `# [K]`, counts `# [K]`)] per row; ValueError on anything pack_lattice cannot produce."""
    values, ell, k = payload.values, payload.ell, payload.k
    if not (isinstance(values, np.ndarray) and values.dtype == np.uint8 and values.ndim == 1):
        raise ValueError("lattice values must be 1-D uint8 bytes")
    if not 1 <= ell <= MAX_ELL:
        raise ValueError(f"lattice resolution ℓ={ell} outside 1..{MAX_ELL}")
    if not (k == 0 or 1 <= k <= MAX_SPARSE_K or k == vocab_size):
        raise ValueError(f"lattice support K={k} is neither 0 (per row), 1..{MAX_SPARSE_K} nor the vocabulary size")
    if not 0 <= payload.bits <= 8 * values.size or values.size != (payload.bits + 7) // 8:
        raise ValueError(f"{payload.bits} bits announced in {values.size} bytes")
    reader = enumerative.BitReader(values.tobytes(), payload.bits)
    rows = []
    for _ in range(n_rows):
        if not k:  # peek K before decoding, so an oversized support is refused before any work
            row_k = reader.read(enumerative.field_bits(vocab_size)) + 1
            if not (row_k <= MAX_SPARSE_K or row_k == vocab_size):
                raise ValueError(f"a lattice row states K={row_k}: neither 1..{MAX_SPARSE_K} nor the vocabulary")
        rows.append(enumerative.decode_sparse(reader, vocab_size, ell, k or row_k))
    if reader.left:
        raise ValueError(f"{reader.left} bits left after {n_rows} lattice rows")
    return rows


def decode_dist(payload: DistPayload, n_rows: int, vocab_size: int) -> np.ndarray:
    """What the cloud verifies against: float64 `# [n_rows, vocab_size]`, identical to the device's sampling rows
    (for "topk": the eq. 15 reconstructions, `topk_codec.reconstruct`; for "lattice": counts / ℓ)."""
    if payload.format == "topk":
        return np.stack([topk_codec.reconstruct(r, vocab_size) for r in decode_topk(payload, n_rows, vocab_size)])
    if payload.format == "lattice":
        out = np.zeros((n_rows, vocab_size), dtype=np.float64)
        for i, (support, counts) in enumerate(decode_lattice(payload, n_rows, vocab_size)):
            out[i, support] = counts / payload.ell
        return out
    return dequantize(unpack(payload, n_rows, vocab_size))


@dataclass
class FloatWire:
    """The device's side of the float wire (`sd`, `hlm`, `uhlm`...): round q to `dtype`, sample from the rounded
    values, send them dense or sparse. Same interface as hat_split.wire.sqs.LatticeWire, so the drafter takes either."""

    dtype: str = "float16"
    format: str = "auto"

    def quantize(self, q: np.ndarray) -> np.ndarray:
        return quantize(np.asarray(q).reshape(1, -1), self.dtype)  # [1, vocab] wire values

    def bits(self, values: np.ndarray) -> int:
        return 8 * values.nbytes

    def sample(self, values: np.ndarray, q: np.ndarray, u: float) -> tuple:
        q_hat = dequantize(values)[0]  # [vocab]: exactly what the cloud will decode
        return int(sample(q_hat[None], np.array([u]))[0]), values, q_hat

    def pack(self, rows: list) -> DistPayload:
        return pack(np.concatenate(rows, axis=0), self.format)

    def settle(self, n_accepted: int, n_drafted: int) -> None:
        """Nothing to roll back."""
