"""Payloads of the stateful fuzzer (profiles.bench.fuzz_state): valid draft distributions of every wire format and
hidden states of every hidden format, and their broken variants (wrong shapes, dtypes, values, fields). Pure numpy
over hat_split.wire's codecs: what a correct device would send, then what a broken or hostile one might.
"""
from __future__ import annotations

import random
from typing import List, Tuple

import msgspec
import numpy as np

from hat_split.math import topk_codec
from hat_split.wire import dist_codec, sqs
from hat_split.wire import messages as P
from hat_split.wire.hidden_codec import HIDDEN_FORMATS, encode_hidden

DIST_FORMATS = ("dense", "sparse", "topk", "lattice")


def tokens(rng: random.Random, n: int, vocab: int) -> np.ndarray:
    """n random token ids `# [n]` int32."""
    return np.asarray([rng.randrange(vocab) for _ in range(n)], np.int32)


def dist(rng: random.Random, fmt: str, length: int, vocab: int) -> Tuple[P.DistPayload, np.ndarray]:
    """A valid payload of `length` draft distributions in `fmt` and drafts `# [length]` int32 each with positive
    probability under its row, as a correct device sends them."""
    gen = np.random.default_rng(rng.randrange(2**32))
    draft = tokens(rng, length, vocab)
    q = gen.random((length, vocab)) ** 4  # [L, vocab] uneven, all positive
    q[np.arange(length), draft] += 1.0 / vocab  # the drafts keep a probability no rounding loses
    q /= q.sum(axis=1, keepdims=True)
    if fmt == "dense":
        return dist_codec.pack(dist_codec.quantize(q, rng.choice(dist_codec.WIRE_DTYPES)), "dense"), draft
    if fmt == "sparse":
        keep = gen.random((length, vocab)) < 0.1  # [L, vocab]
        keep[np.arange(length), draft] = True
        values = dist_codec.quantize(np.where(keep, q, 0.0), rng.choice(dist_codec.WIRE_DTYPES))
        return dist_codec.pack(values, "sparse"), draft
    if fmt == "topk":
        k, bits = rng.randrange(1, 17), rng.randrange(1, 9)
        rows = [topk_codec.select(q[i], k, int(draft[i]), bits) for i in range(length)]
        return dist_codec.pack_topk(rows, vocab), draft
    ell, k = rng.choice([1, 4, 16, 256]), rng.choice([0, 1, 8, vocab])
    size = k or rng.randrange(1, 20)
    rows = [sqs.quantize_row(q[i], ell, np.sort(gen.choice(vocab, size, replace=False))) for i in range(length)]
    draft = np.asarray([rng.choice(r.support[r.counts > 0].tolist()) for r in rows], np.int32)
    return dist_codec.pack_lattice(rows, vocab, ell, k), draft


def broken_dist(rng: random.Random, payload: P.DistPayload, length: int, vocab: int) -> P.DistPayload:
    """`payload` with one thing wrong that only the cloud's checks can see: a shape, a dtype, a value, a field."""
    v = payload.values
    what = rng.choice(["shape", "dtype", "values", "fields", "format"])
    if what == "format":
        return msgspec.structs.replace(payload, format=rng.choice([f for f in DIST_FORMATS + ("??",)
                                                                    if f != payload.format]))
    if what == "fields":
        return msgspec.structs.replace(payload, bits=rng.choice([0, 25, 1 << 20, payload.bits + 1]),
                                       ell=rng.choice([0, 5000, payload.ell + 1]),
                                       k=rng.choice([0, 2, 5000, vocab + 1]),
                                       indptr=_bent(rng, payload.indptr), indices=_bent(rng, payload.indices))
    if what == "shape":
        return msgspec.structs.replace(payload, values=_reshaped(rng, v, length, vocab))
    if what == "dtype":
        dtype = rng.choice(["float64", "int32", "uint8", "float16", "int8"])
        return msgspec.structs.replace(payload, values=np.zeros(v.shape, dtype) if v.size else np.zeros(3, dtype))
    bad = np.array(v, copy=True)  # values: NaN, infinity, negative, all zero, or bytes of noise
    if bad.size == 0:
        return payload
    if bad.dtype.kind == "f":
        bad.reshape(-1)[rng.randrange(bad.size)] = rng.choice([np.nan, np.inf, -1.0, 0.0])
        if rng.random() < 0.3:
            bad[...] = 0
    else:
        noise = np.random.default_rng(rng.randrange(99)).bytes(bad.nbytes)
        bad[...] = np.frombuffer(noise, bad.dtype).reshape(bad.shape)
    return msgspec.structs.replace(payload, values=bad)


def hidden(rng: random.Random, n: int, width: int, fmt: str = "") -> P.HiddenPayload:
    """A valid payload of n shallow states `# [n, width]` in `fmt` (random one of HIDDEN_FORMATS if not given)."""
    gen = np.random.default_rng(rng.randrange(2**32))
    return encode_hidden(gen.standard_normal((n, width)).astype(np.float32), fmt or rng.choice(HIDDEN_FORMATS))


def broken_hidden(rng: random.Random, payload: P.HiddenPayload, width: int) -> P.HiddenPayload:
    """`payload` with a wrong shape, dtype, format label, non-finite value or int8 side field."""
    v = payload.values
    what = rng.choice(["shape", "dtype", "format", "values", "int8"])
    if what == "shape":
        return msgspec.structs.replace(payload, values=_reshaped(rng, v, v.shape[0], width))
    if what == "dtype":
        dtype = rng.choice([d for d in ("float16", "float32", "int8", "float64", "int32") if d != v.dtype.name])
        return msgspec.structs.replace(payload, values=v.astype(dtype))
    if what == "format":
        return msgspec.structs.replace(payload, format=rng.choice([f for f in HIDDEN_FORMATS + ("bf16",)
                                                                    if f != payload.format]))
    if what == "values" and v.dtype.kind == "f":
        bad = np.array(v, copy=True)
        bad.reshape(-1)[rng.randrange(bad.size)] = rng.choice([np.nan, np.inf, -np.inf])
        return msgspec.structs.replace(payload, values=bad)
    n, k = v.shape[0], min(8, width)  # int8's side fields, whatever the format says
    return msgspec.structs.replace(
        payload, scales=rng.choice([None, np.full(n, np.inf, np.float32), np.ones(n + 1, np.float32)]),
        outlier_idx=rng.choice([None, np.full((n, k), width, np.int32), np.full((n, k), -1, np.int32)]),
        outliers=rng.choice([None, np.zeros((n, k), np.float32), np.full((n, k), np.nan, np.float16)]))


def _reshaped(rng: random.Random, v: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """An array of v's dtype in a shape one off from [rows, cols]: a row or column more or less, 1-D, 3-D, empty."""
    shape = rng.choice([(rows + 1, cols), (max(rows - 1, 0), cols), (rows, cols + 1), (rows, max(cols - 1, 0)),
                        (rows * cols,), (1, rows, cols), (0,), (rows, 0)])
    return np.zeros(shape, v.dtype)


def _bent(rng: random.Random, arr) -> object:
    """An index array made wrong: reversed, shortened, negative, the wrong dtype, or absent."""
    if not isinstance(arr, np.ndarray) or arr.size == 0:
        return rng.choice([None, np.zeros(2, np.int64), np.asarray([-1, 5], np.int64)])
    return rng.choice([arr[::-1].copy(), arr[:-1].copy(), -arr - 1, arr.astype(np.float32), None, arr])


def byte_flips(rng: random.Random, frames: List[bytes]) -> List[bytes]:
    """The frames with 1-8 bits flipped in the tensor payloads (frames 1..), the header left intact; a message with
    no payload bytes gets its header's last bytes flipped instead."""
    out = [bytes(f) for f in frames]
    payload = [i for i in range(1, len(out)) if out[i]]
    i = rng.choice(payload) if payload else 0
    f = bytearray(out[i])
    lo = 0 if i else max(P.PREAMBLE_LEN, len(f) - 8)
    for _ in range(rng.randrange(1, 9)):
        f[rng.randrange(lo, len(f))] ^= 1 << rng.randrange(8)
    out[i] = bytes(f)
    return out
