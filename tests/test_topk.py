"""CU-HLM uploads: packed bits round-trip, eq. 15 reconstruction, the draft token always kept, k* policies."""
from __future__ import annotations

import numpy as np
import pytest

from hat_split.math import topk_codec as T
from hat_split.math.vocab_size_policy import offline_k, online_k, softplus, tail_l1

V = 151936


def test_bits_round_trip_and_sizes():
    rng = np.random.default_rng(0)
    for width in (1, 3, 8, 18, 32):
        v = rng.integers(0, 2 ** width, size=37, dtype=np.int64)
        data = T.pack_bits(v, width)
        assert len(data) == (37 * width + 7) // 8
        assert np.array_equal(T.unpack_bits(data, width, 37), v)
    assert T.index_bits(V) == 18
    with pytest.raises(ValueError, match="fit"):
        T.pack_bits(np.array([256]), 8)
    with pytest.raises(ValueError, match="exactly"):
        T.unpack_bits(b"\x00" * 3, 8, 4)


def test_reconstruction_is_a_distribution_and_keeps_the_draft_token():
    rng = np.random.default_rng(1)
    x = rng.dirichlet(np.full(1000, 0.05))
    draft = int(np.argsort(x)[10])  # a low-probability token, outside the top 5
    row = T.select(x, 5, draft, bits=8)
    assert draft in row.indices and row.indices.size == 5
    x_hat = T.reconstruct(row, 1000)
    assert x_hat.min() >= 0 and x_hat.sum() == pytest.approx(1.0, abs=1e-12)
    assert x_hat[draft] > 0
    kept = np.isin(np.arange(1000), row.indices)
    assert np.allclose(x_hat[~kept], x_hat[~kept][0])  # eq. 15: the residual is spread uniformly
    others = row.indices[row.indices != draft]
    assert np.all(np.abs(x_hat[others] - x[others]) <= 0.5 / 255 + 1e-12)  # rounded to 8-bit levels
    assert x_hat[draft] == pytest.approx(max(round(x[draft] * 255), 1) / 255)  # never rounded to 0


def test_encode_decode_is_bit_exact_on_a_full_vocabulary():
    rng = np.random.default_rng(2)
    rows = [T.select(rng.dirichlet(np.full(V, 0.01)), k, int(rng.integers(V)), 8) for k in (1, 30, 832)]
    idx, lev, indptr, bits = T.encode(rows, V)
    assert len(idx) == (863 * 18 + 7) // 8 and len(lev) == 863
    back = T.decode(idx, lev, indptr, bits, 3, V)
    for a, b in zip(rows, back):
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.levels, b.levels)
        assert np.array_equal(T.reconstruct(a, V), T.reconstruct(b, V))
    with pytest.raises(ValueError):
        T.decode(idx, lev, np.array([0, 1, 1, 863], np.int64), bits, 3, V)  # an empty row


def test_tail_l1_matches_brute_force():
    rng = np.random.default_rng(3)
    x = rng.dirichlet(np.full(50, 0.3))
    s = np.sort(x)[::-1]
    want = [np.abs(s[k:] - s[k:].sum() / (50 - k)).sum() if k < 50 else 0.0 for k in range(1, 51)]
    assert np.allclose(tail_l1(x), want, atol=1e-12)


def test_online_k_grows_with_estimated_rejection_and_offline_k_meets_theta():
    rng = np.random.default_rng(4)
    x = rng.dirichlet(np.full(5000, 0.02))
    ks = [online_k(x, float(x.max()), beta, theta=0.1) for beta in np.linspace(0, 1, 11)]
    assert all(a <= b for a, b in zip(ks, ks[1:])) and ks[0] >= 1
    assert softplus(0.0, 10.0) == pytest.approx(np.log(2) / 10)
    tails = np.stack([tail_l1(rng.dirichlet(np.full(200, 0.05)))[:100] for _ in range(20)])  # [20, 100]
    tvd = np.full(20, 0.3)
    k = offline_k(tails, tvd, theta=0.1)
    assert (tails[:, k - 1] / 0.3).mean() <= 0.1 and (k == 1 or (tails[:, k - 2] / 0.3).mean() > 0.1)
