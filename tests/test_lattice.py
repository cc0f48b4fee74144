"""Lattice quantization (hat_split.math.lattice) and its enumerative bit streams (hat_split.math.enumerative)."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hat_split.math import enumerative as E
from hat_split.math import lattice as L


def _compositions(k, ell):
    for bars in itertools.combinations(range(ell + k - 1), k - 1):
        edges = (-1,) + bars + (ell + k - 1,)
        yield np.array([edges[i + 1] - edges[i] - 1 for i in range(k)])


@pytest.mark.parametrize("k,ell", [(2, 5), (3, 4), (4, 6), (5, 3)])
def test_nearest_point_matches_brute_force(k, ell):
    rng = np.random.default_rng(k * 10 + ell)
    points = np.stack(list(_compositions(k, ell)))  # [P, k] every lattice point
    for _ in range(200):
        q = rng.dirichlet(np.full(k, 0.5))
        b = L.nearest(q, ell)
        assert b.sum() == ell and (b >= 0).all()
        best = np.abs(points / ell - q).sum(axis=1).min()  # L1 = 2·TV
        assert np.abs(b / ell - q).sum() == pytest.approx(best, abs=1e-12)


def test_tv_distortion_bound_and_batches():
    rng = np.random.default_rng(1)
    for k, ell in [(10, 7), (100, 64), (1000, 2000), (5000, 100)]:
        q = rng.dirichlet(np.full(k, 0.2), size=8)  # [8, k]
        b = L.nearest(q, ell)
        assert (b.sum(axis=1) == ell).all()
        assert (L.tv_distance(q, b, ell) <= k / (4 * ell) + 1e-12).all()
        np.testing.assert_array_equal(b[3], L.nearest(q[3], ell))  # batched = per row
    with pytest.raises(ValueError):
        L.nearest(np.array([0.5, -0.1]), 4)
    with pytest.raises(ValueError):
        L.nearest(np.array([0.5, 0.5]), 0)


def test_supports():
    q = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    np.testing.assert_array_equal(L.topk_support(q, 2), [1, 3])
    np.testing.assert_array_equal(L.threshold_support(q, 0.12), [1, 3, 4])
    np.testing.assert_array_equal(L.threshold_support(q, 0.9), [1])  # never empty


def test_subset_and_composition_ranks_are_bijections():
    for n in range(7):
        for k in range(n + 1):
            ranks = sorted(E.rank_subset(s) for s in itertools.combinations(range(n), k))
            assert ranks == list(range(math.comb(n, k)))
            for r in range(math.comb(n, k)):
                assert E.rank_subset(E.unrank_subset(r, n, k)) == r
    for k, ell in [(1, 5), (3, 4), (4, 0)]:
        ranks = sorted(E.rank_composition(c) for c in _compositions(k, ell))
        assert ranks == list(range(math.comb(ell + k - 1, k - 1)))


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 200_000), k=st.integers(1, 96), ell=st.integers(1, 512), seed=st.integers(0, 2**31),
       k_varies=st.booleans(), n=st.integers(1, 3))
def test_sparse_round_trip_is_bit_exact_and_costs_the_formula(vocab, k, ell, seed, k_varies, n):
    rng = np.random.default_rng(seed)
    k = min(k, vocab)
    writer, rows = E.BitWriter(), []
    for _ in range(n):
        support = np.sort(rng.choice(vocab, k, replace=False))
        counts = L.nearest(rng.dirichlet(np.full(k, 0.3)), ell)
        E.encode_sparse(support, counts, vocab, ell, writer, k_varies)
        rows.append((support, counts))
    assert writer.n_bits == n * E.sparse_bits(vocab, k, ell, k_varies)
    data = writer.to_bytes()
    assert len(data) == math.ceil(writer.n_bits / 8)
    reader = E.BitReader(data, writer.n_bits)
    for support, counts in rows:
        s2, c2 = E.decode_sparse(reader, vocab, ell, None if k_varies else k)
        np.testing.assert_array_equal(s2, support)
        np.testing.assert_array_equal(c2, counts)
    assert reader.left == 0


def test_bit_counts_are_the_papers_formulas():
    V = 151_936
    assert E.sparse_bits(V, 16, 100, False) == math.ceil(math.log2(math.comb(V, 16))) + math.ceil(
        math.log2(math.comb(115, 15)))
    assert E.sparse_bits(V, 16, 100, True) == E.sparse_bits(V, 16, 100, False) + math.ceil(math.log2(V))
    assert E.sparse_bits(V, V, 8, False) == math.ceil(math.log2(math.comb(V + 7, V - 1)))  # dense: QS eq. 6
    with pytest.raises(ValueError, match="ends early"):
        E.BitReader(b"\x00", 8).read(9)
    with pytest.raises(ValueError, match="not a"):
        E.unrank_subset(math.comb(10, 3), 10, 3)


@pytest.mark.parametrize("ell", [4, 64, 100, 256])
def test_concentrated_points_on_the_full_vocabulary_round_trip(ell):
    """A peaked draft (low temperature) puts almost all of ℓ on one early token: the smallest ranks, where the
    decoder's jump estimate lands below the element (a regression found by hat-bench qs)."""
    vocab = 151_936
    for pos, other in ((0, 1), (1, None), (2, None), (5, vocab - 1), (vocab - 1, 0)):
        b = np.zeros(vocab, np.int64)
        b[pos] = ell
        if other is not None:
            b[pos] -= 1
            b[other] += 1
        np.testing.assert_array_equal(E.unrank_composition(E.rank_composition(b), vocab, ell), b)
