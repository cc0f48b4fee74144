"""Tests for hat_split.math.sampling and hat_split.math.verify, three ways (STYLE.md lesson 4), all on CPU:

1. statistical: speculative decoding's output frequencies converge to the target p, and not to decoys;
2. hand-built distributions with exact expected answers;
3. greedy end to end: hybrid output equals plain target greedy decoding token for token;
plus warp examples, seeded determinism, batched == per-row, bad inputs and speed.

Statistical thresholds: for n i.i.d. draws from a distribution over K cells, E[TV(empirical, true)] <=
0.5 * sqrt((K - 1) / n) (Cauchy-Schwarz on the per-cell standard deviations), and TV moves by at most 1/n per draw, so
by McDiarmid P(TV > E[TV] + t) <= exp(-2 n t^2). With t = 4 / sqrt(n) a false failure has probability < 1e-13 per
check. Seeds are fixed; HATSPEC_TEST_SEED overrides the base seed to re-check that the thresholds are not luck.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from hat_split.math.sampling import SamplingParams, sample, sample_rng, softmax_prob, warp
from hat_split.math.verify import (
    VerifyResult,
    acceptance_of_samples,
    acceptance_rate,
    expected_accepted,
    expected_tokens,
    ideal_speedup,
    speculative_verify,
    verify_rng,
)

SEED = int(os.environ.get("HATSPEC_TEST_SEED", "20240611"))


# ----------------------------------------------------------------------------------------------------------- helpers
def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a, float) - np.asarray(b, float)).sum())


def empirical(samples: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(np.asarray(samples).ravel(), minlength=k).astype(float) / max(1, np.size(samples))


def tv_bound(n: int, k: int) -> float:
    """TV(empirical of n draws over k cells, truth) stays below this except with probability < 1e-13."""
    return 0.5 * math.sqrt((k - 1) / n) + 4.0 / math.sqrt(n)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def make_pair(kind: str, L: int, V: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Position-dependent, context-independent target P `# [L+1, V]` and draft Q `# [L, V]`."""
    if kind == "same":
        P = rng.dirichlet(np.ones(V), size=L + 1)
        Q = P[:L].copy()
    elif kind == "disjoint":  # nearly disjoint supports: p on the first half, q on the second, 1e-3 leakage
        half = V // 2
        P = np.concatenate([rng.dirichlet(np.ones(half), size=L + 1), np.full((L + 1, V - half), 1e-3)], axis=1)
        Q = np.concatenate([np.full((L, half), 1e-3), rng.dirichlet(np.ones(V - half), size=L)], axis=1)
    elif kind == "peaked_p_flat_q":
        P = softmax(4.0 * rng.standard_normal((L + 1, V)))
        Q = np.ones((L, V))
    elif kind == "flat_p_peaked_q":
        P = np.ones((L + 1, V))
        Q = softmax(4.0 * rng.standard_normal((L, V)))
    elif kind == "dirichlet":
        P = rng.dirichlet(np.full(V, 0.5), size=L + 1)
        Q = rng.dirichlet(np.full(V, 0.5), size=L)
    elif kind == "zeros":  # exact zeros on both sides: p forbids tokens q likes, q never proposes some p tokens
        P = rng.dirichlet(np.ones(V), size=L + 1)
        P[:, :3] = 0.0
        Q = rng.dirichlet(np.ones(V), size=L)
        Q[:, -3:] = 0.0
    else:
        raise AssertionError(kind)
    return P / P.sum(-1, keepdims=True), Q / Q.sum(-1, keepdims=True)


def draft_from(Q: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n independent draft sequences, x_j ~ Q[j] `# [n, L]` (context-independent drafting)."""
    L, V = Q.shape
    return sample(np.broadcast_to(Q, (n, L, V)), rng.random((n, L)))


def perturbed(P: np.ndarray, rng: np.random.Generator, amount: float = 0.15) -> np.ndarray:
    """A decoy: P mixed with another random distribution, TV(P, decoy) <= amount (about amount / 2 in practice)."""
    return (1 - amount) * P + amount * rng.dirichlet(np.ones(P.shape[-1]), size=P.shape[:-1])


# ------------------------------------------------------------------------------------------ 1. statistical exactness
KINDS = ["same", "disjoint", "peaked_p_flat_q", "flat_p_peaked_q", "dirichlet", "zeros"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("L", [1, 3, 8])
def test_output_distribution_converges_to_target(kind: str, L: int) -> None:
    V, N = 12, 100_000
    rng = np.random.default_rng([SEED, KINDS.index(kind), L])
    P_all, Q_all = make_pair(kind, L + 1, V, rng)  # one position more, for rounds that start at position 1
    P, Q = P_all[: L + 1], Q_all[:L]
    x = draft_from(Q, N, rng)
    res = verify_rng(x, Q[None], P[None], rng)  # the batch shares P and Q (batch dim 1 broadcast)
    n_acc, tok = res.n_accepted, res.tokens

    # First output token ~ P[0]: TV shrinks with n and ends below the sample-size bound; decoys stay far away.
    first = tok[:, 0]
    tvs = {n: tv(empirical(first[:n], V), P[0]) for n in (1_000, 10_000, N)}
    print(f"{kind} L={L}: TV(first, p) at 1k/10k/100k = {tvs}")
    for n, d in tvs.items():
        assert d < tv_bound(n, V), (n, d)
    assert tvs[N] < tvs[1_000]
    emp = empirical(first, V)
    decoys = [perturbed(P[0], rng)] + ([Q[0]] if tv(P[0], Q[0]) > 0.05 else [])
    for decoy in decoys:
        gap = tv(P[0], decoy)
        assert tv(emp, decoy) > gap - tvs[N] and tv(emp, decoy) > 3 * tvs[N], (gap, tv(emp, decoy), tvs[N])

    # Number accepted: P(N >= k) = prod_{j<k} beta_j with beta_j = sum_v min(p_j, q_j).
    beta = acceptance_rate(P[:L], Q)
    surv = np.concatenate([[1.0], np.cumprod(beta)])  # P(N >= k), k = 0..L
    pmf = surv - np.concatenate([surv[1:], [0.0]])
    assert tv(empirical(n_acc, L + 1), pmf) < tv_bound(N, L + 1)

    # The last token of a row that reached position k (N >= k) ~ P[k]: conditioning on drafts 0..k-1 being accepted
    # says nothing about position k. (Earlier tokens are biased by that condition: an accepted draft follows
    # min(p, q) / beta, which is why the joint below continues rows instead of selecting them.)
    for k in range(1, L + 1):
        rows = n_acc >= k
        if rows.sum() >= 2_000:
            assert tv(empirical(tok[rows, k], V), P[k]) < tv_bound(int(rows.sum()), V), k

    # Sequence level: the joint of the first two output tokens ~ P[0] x P[1]. Rows that stopped after one token
    # (N = 0) continue with a second round of L drafts starting at position 1.
    second = tok[:, 1].copy()
    stop = n_acc == 0
    m = int(stop.sum())
    if m:
        x2 = draft_from(Q_all[1 : L + 1], m, rng)
        second[stop] = verify_rng(x2, Q_all[None, 1 : L + 1], P_all[None, 1 : L + 2], rng).tokens[:, 0]
    joint = empirical(tok[:, 0] * V + second, V * V)
    d = tv(joint, np.outer(P[0], P[1]).ravel())
    assert d < tv_bound(N, V * V), d
    for decoy in (np.outer(perturbed(P[0], rng), P[1]), np.outer(P[0], Q_all[1])):
        gap = tv(np.outer(P[0], P[1]), decoy)
        if gap > 0.05:
            assert tv(joint, decoy.ravel()) > max(gap - d, 3 * d)


def test_mean_accepted_matches_expected_accepted() -> None:
    """Same (p, q) at every position: E[N] = expected_accepted(beta, L) (Leviathan et al. eq. (1) minus 1)."""
    V, L, N = 10, 5, 100_000
    rng = np.random.default_rng([SEED, 99])
    p = rng.dirichlet(np.ones(V))
    q = rng.dirichlet(np.ones(V))
    P, Q = np.tile(p, (L + 1, 1)), np.tile(q, (L, 1))
    res = verify_rng(draft_from(Q, N, rng), Q[None], P[None], rng)
    beta = float(acceptance_rate(p, q))
    sd = math.sqrt(L * L / 4 / N)  # N is in [0, L]: variance <= L^2 / 4
    assert abs(res.n_accepted.mean() - expected_accepted(beta, L)) < 5 * sd


def test_acceptance_of_the_targets_own_samples_estimates_beta() -> None:
    """min(1, q(x) / p(x)) over x ~ p: by hand; its mean over 10^5 of the target's samples is Σ min(p, q) within five
    standard errors, where two decoys a reader might write are far outside it (q(x) alone: Σ p q; the ratio the
    other way: Σ min(p, p² / q)); at temperature 0 it is the argmax's agreement; bad input is refused by name."""
    assert acceptance_of_samples(np.array([0.5, 0.2, 1.0]), np.array([0.25, 0.6, 0.0])).tolist() == [0.5, 1.0, 0.0]
    V, N = 12, 100_000
    rng = np.random.default_rng([SEED, 7])
    p, q = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    x = sample_rng(np.tile(p, (N, 1)), rng)
    est = acceptance_of_samples(p[x], q[x])
    beta, se = float(acceptance_rate(p, q)), est.std() / math.sqrt(N)
    assert abs(est.mean() - beta) < 5 * se
    for decoy in (q[x], np.minimum(1.0, p[x] / q[x])):
        assert abs(decoy.mean() - beta) > 20 * se, (decoy.mean(), beta, se)
    greedy = acceptance_of_samples(np.ones(3), np.array([1.0, 0.0, 1.0]))  # one-hot q: the draft named x or not
    assert greedy.tolist() == [1.0, 0.0, 1.0]
    for bad_p, bad_q, match in [([0.0], [0.5], "p_drawn"), ([float("nan")], [0.5], "p_drawn"),
                                ([1.5], [0.5], "p_drawn"), ([0.5], [-0.1], "q_at"), ([0.5, 0.5], [0.5], "one length"),
                                (["a"], [0.5], "p_drawn")]:
        with pytest.raises(ValueError, match=match):
            acceptance_of_samples(np.array(bad_p), np.array(bad_q))


def markov_generate(Pm: np.ndarray, Qm: np.ndarray, start: int, T: int, L: int, n: int, rng: np.random.Generator,
                    ragged: bool) -> np.ndarray:
    """Run the full hybrid loop for n independent sequences over a context-dependent (Markov) model pair.

    Target: next-token distribution Pm[last token] `# [V, V]`; draft: Qm[last token]. Each round drafts L tokens
    autoregressively from q (draft_lens random in [0, L] when ragged), verifies them against p conditioned on the
    drafted prefix, and appends accepted + resampled/bonus tokens. Returns `# [n, T]` generated tokens.
    """
    V = Pm.shape[0]
    seqs = np.full((n, T + L + 1), -1, dtype=np.int64)
    length = np.zeros(n, dtype=np.int64)
    last = np.full(n, start, dtype=np.int64)
    while True:
        act = np.nonzero(length < T)[0]
        if act.size == 0:
            return seqs[:, :T]
        m = act.size
        prev = last[act]
        drafts = np.empty((m, L), dtype=np.int64)
        q_rows = np.empty((m, L, V))
        p_rows = np.empty((m, L + 1, V))
        for j in range(L):
            q_rows[:, j], p_rows[:, j] = Qm[prev], Pm[prev]
            drafts[:, j] = prev = sample(Qm[prev], rng.random(m))
        p_rows[:, L] = Pm[prev]
        lens = rng.integers(0, L + 1, size=m) if ragged else None
        res = verify_rng(drafts, q_rows, p_rows, rng, draft_lens=lens)
        count = res.n_accepted + 1
        for k in range(L + 1):
            w = k < count
            seqs[act[w], length[act[w]] + k] = res.tokens[w, k]
        length[act] += count
        last[act] = seqs[act, length[act] - 1]


@pytest.mark.parametrize("ragged", [False, True])
def test_sequence_distribution_with_context(ragged: bool) -> None:
    """Context-dependent drafts and targets: the generated sequences follow the target Markov chain, jointly."""
    V, T, L, N = 6, 5, 3, 60_000
    rng = np.random.default_rng([SEED, 7, int(ragged)])
    Pm = rng.dirichlet(np.full(V, 0.7), size=V)  # target p(next | last)
    Qm = rng.dirichlet(np.full(V, 0.7), size=V)  # draft q(next | last)
    start = 0
    seqs = markov_generate(Pm, Qm, start, T, L, N, rng, ragged)
    assert (seqs >= 0).all()

    # Marginal at every position t: e_start Pm^(t+1).
    dist = np.eye(V)[start]
    for t in range(T):
        dist = dist @ Pm
        d = tv(empirical(seqs[:, t], V), dist)
        assert d < tv_bound(N, V), (t, d)
    # Joint of the first three tokens (crosses verification rounds): p(a|s) p(b|a) p(c|b) over V^3 cells.
    truth = (Pm[start][:, None, None] * Pm[:, :, None] * Pm[None, :, :]).ravel()
    joint = empirical(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], V**3)
    d = tv(joint, truth)
    assert d < tv_bound(N, V**3)
    decoy = (Qm[start][:, None, None] * Qm[:, :, None] * Qm[None, :, :]).ravel()
    print(f"ragged={ragged}: TV(joint3, target)={d:.4f}  TV(joint3, draft chain)={tv(joint, decoy):.4f}")
    assert tv(joint, decoy) > 5 * d


# ------------------------------------------------------------------------------------- 2. hand-built exact answers
def test_always_rejected_then_resampled_with_certainty() -> None:
    q = np.array([[[0.5, 0.5, 0.0]]])  # [B=1, L=1, V=3]
    p = np.array([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])  # [1, 2, 3]; residual (p - q)+ = [0, 0, 0.5]
    for au in (0.0, 0.5, np.nextafter(1.0, 0.0)):
        for ru in (0.0, 0.5, np.nextafter(1.0, 0.0)):
            r = speculative_verify(np.array([[0]]), q, p, np.array([[au]]), np.array([ru]))
            assert isinstance(r, VerifyResult)
            assert r.n_accepted.tolist() == [0] and r.tokens.tolist() == [[2, -1]] and r.row(0) == [2]


def test_accept_threshold_is_exactly_min_one_p_over_q() -> None:
    q = np.array([[[0.8, 0.2]]])
    p = np.array([[[0.4, 0.6], [0.25, 0.75]]])  # p/q at token 0 = 0.5; residual (p - q)+ = [0, 0.4]
    acc = speculative_verify(np.array([[0]]), q, p, np.array([[0.4999999]]), np.array([0.9]))
    assert acc.row(0) == [0, 1]  # accepted, then bonus from p[1]: cdf [0.25, 1], u = 0.9 -> 1
    rej = speculative_verify(np.array([[0]]), q, p, np.array([[0.5]]), np.array([0.0]))
    assert rej.row(0) == [1] and rej.n_accepted[0] == 0  # u = p/q exactly: rejected; resample -> token 1
    # p(x) >= q(x): always accepted, even with u just below 1.
    up = speculative_verify(np.array([[1]]), q, p, np.array([[np.nextafter(1.0, 0.0)]]), np.array([0.1]))
    assert up.row(0) == [1, 0]


def test_bonus_token_and_second_position_rejection() -> None:
    q = np.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])  # [1, L=2, 3]
    p = np.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.25, 0.25, 0.5]]])  # p == q at drafts: always accepted
    for ru, want in ((0.0, 0), (0.2499, 0), (0.25, 1), (0.3, 1), (0.5, 2), (0.99, 2)):
        r = speculative_verify(np.array([[1, 2]]), q, p, np.array([[0.9, 0.9]]), np.array([ru]))
        assert r.n_accepted[0] == 2 and r.row(0) == [1, 2, want], ru
    # Reject at position 2 (p[1] puts nothing on token 2): resample from (p1 - q1)+ = [0.3, 0.7, 0] .
    p2 = p.copy()
    p2[0, 1] = [0.3, 0.7, 0.0]
    r = speculative_verify(np.array([[1, 2]]), q, p2, np.array([[0.9, 0.0]]), np.array([0.5]))
    assert r.n_accepted.tolist() == [1] and r.tokens.tolist() == [[1, 1, -1]]
    # Ragged: draft_lens = 0 takes the bonus from p row 0; draft_lens = 1 from p row 1, and the second draft (-1,
    # padding) is never looked at.
    r = speculative_verify(np.array([[1, -1], [1, -1]]), np.repeat(q, 2, 0), np.repeat(p2, 2, 0),
                           np.array([[0.9, 0.9], [0.9, 0.9]]), np.array([0.4, 0.4]), draft_lens=np.array([0, 1]))
    assert r.row(0) == [0] and r.row(1) == [1, 1]
    assert r.tokens.tolist() == [[0, -1, -1], [1, 1, -1]]


def test_empty_residual_falls_back_to_p() -> None:
    """p <= q everywhere (p sums to 0.9998, within tolerance): the residual is all zero; sample from p instead."""
    q = np.array([[[0.5, 0.5]]])
    p = np.array([[[0.4999, 0.4999], [0.5, 0.5]]])
    r = speculative_verify(np.array([[0]]), q, p, np.array([[0.99999]]), np.array([0.7]))
    assert r.n_accepted[0] == 0 and r.row(0) == [1]


def test_sample_inverse_cdf_and_zero_probability_guard() -> None:
    probs = np.array([0.5, 0.0, 0.5, 0.0])
    assert sample(probs, np.float64(0.0)) == 0
    assert sample(probs, np.float64(0.4999)) == 0
    assert sample(probs, np.float64(0.5)) == 2
    assert sample(probs, np.nextafter(1.0, 0.0)) == 2  # never the trailing zero-probability token
    assert sample(np.array([0.0, 0.0, 1.0]), np.float64(0.0)) == 2  # never a leading zero either
    assert sample(np.array([1e-300, 0.0]), np.float64(0.999)) == 0
    tiny = np.array([0.0, 5e-324, 0.0])  # subnormal total: u * total rounds up to total -> clamped to index 1
    assert sample(tiny, np.float64(0.9)) == 1 and sample(tiny, np.float64(0.0)) == 1
    # Unnormalised weights are fine (the residual is sampled without dividing).
    assert sample(np.array([0.0, 0.2, 0.2]), np.float64(0.5)) == 2
    rng = np.random.default_rng([SEED, 3])
    w = rng.random((2000, 50)) * (rng.random((2000, 50)) < 0.2)
    w[:, 7] += 1e-12  # every row has some mass
    u = np.concatenate([rng.random(1990), np.full(10, np.nextafter(1.0, 0.0))])
    tok = sample(w, u)
    assert tok.dtype == np.int64 and tok.shape == (2000,)
    assert (w[np.arange(2000), tok] > 0).all()


# --------------------------------------------------------------------------------------------------- 3. greedy
def toy_logits(W: np.ndarray, U: np.ndarray, ctx: list[int]) -> np.ndarray:
    """A context-dependent toy 'model': logits = W[last] + U[second to last]. `# [V]`."""
    return W[ctx[-1]] + U[ctx[-2]]


@pytest.mark.parametrize("draft_temperature", [0.0, 1.0])
def test_greedy_hybrid_equals_target_greedy(draft_temperature: float) -> None:
    V, L, T = 40, 4, 60
    rng = np.random.default_rng([SEED, 11])
    Wp, Up = rng.standard_normal((V, V)), rng.standard_normal((V, V))
    Wq, Uq = Wp + 0.6 * rng.standard_normal((V, V)), Up + 0.6 * rng.standard_normal((V, V))  # a decent, wrong draft
    greedy, drafting = SamplingParams(temperature=0.0), SamplingParams(temperature=draft_temperature)
    prompt = [3, 5]

    ref = list(prompt)  # plain target greedy decoding
    while len(ref) < len(prompt) + T:
        ref.append(int(np.argmax(toy_logits(Wp, Up, ref))))

    out, n_rounds, n_acc_total = list(prompt), 0, 0
    while len(out) < len(prompt) + T:
        ctx, drafts, qs = list(out), [], []
        for _ in range(L):
            qj = warp(toy_logits(Wq, Uq, ctx), drafting)
            xj = int(sample_rng(qj, rng))
            drafts.append(xj), qs.append(qj), ctx.append(xj)
        ps = np.stack([warp(toy_logits(Wp, Up, out + drafts[:j]), greedy) for j in range(L + 1)])
        assert ((ps == 0) | (ps == 1)).all() and (ps.sum(-1) == 1).all()  # greedy warp is one-hot
        res = verify_rng(np.array([drafts]), np.stack(qs)[None], ps[None], rng)
        argmaxes = ps.argmax(-1)
        n_match = next((j for j in range(L) if drafts[j] != argmaxes[j]), L)
        assert res.n_accepted[0] == n_match  # exactly the prefix of drafts equal to the target argmaxes
        assert res.row(0) == drafts[:n_match] + [int(argmaxes[n_match])]  # then the target argmax
        out += res.row(0)
        n_rounds += 1
        n_acc_total += n_match
    assert out[: len(ref)] == ref  # token for token
    assert 0 < n_acc_total < n_rounds * L  # non-trivial: some drafts accepted, some rejected


# --------------------------------------------------------------------------------------------------------- warp
def test_warp_temperature() -> None:
    z = np.log(np.array([1.0, 2.0, 4.0]))
    np.testing.assert_allclose(warp(z, SamplingParams()), [1 / 7, 2 / 7, 4 / 7], rtol=1e-12)
    s = 3 + math.sqrt(2)
    np.testing.assert_allclose(warp(z, SamplingParams(temperature=2.0)), [1 / s, math.sqrt(2) / s, 2 / s], rtol=1e-12)
    out = warp(z.astype(np.float32), SamplingParams(temperature=0.5))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, np.array([1, 4, 16]) / 21, rtol=1e-6)
    # A tiny temperature tends to greedy without overflow.
    np.testing.assert_allclose(warp(np.array([1e4, 1e4 - 1, -1e4]), SamplingParams(temperature=1e-6)), [1, 0, 0])


def test_warp_greedy_one_hot_first_argmax() -> None:
    z = np.array([[1.0, 3.0, 3.0, -np.inf], [0.0, 0.0, 0.0, 0.0]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=1, top_p=0.01)):
        assert params.greedy
        np.testing.assert_array_equal(warp(z, params), [[0, 1, 0, 0], [1, 0, 0, 0]])
    assert not SamplingParams(temperature=0.1).greedy


def test_warp_top_k_and_ties() -> None:
    e = np.exp
    out = warp(np.array([1.0, 3.0, 2.0, 0.0]), SamplingParams(top_k=2))
    np.testing.assert_allclose(out, [0, e(3) / (e(3) + e(2)), e(2) / (e(3) + e(2)), 0], rtol=1e-12)
    # Ties with the k-th largest are all kept (documented), whatever their position.
    np.testing.assert_allclose(warp(np.array([2.0, 1.0, 2.0, 2.0]), SamplingParams(top_k=2)), [1 / 3, 0, 1 / 3, 1 / 3])
    np.testing.assert_allclose(warp(np.array([1.0, 2.0, 2.0, 0.0]), SamplingParams(top_k=2)), [0, 0.5, 0.5, 0])
    # k >= V is off; fewer finite logits than k keeps the finite ones.
    z = np.array([0.0, 1.0, -np.inf])
    np.testing.assert_allclose(warp(z, SamplingParams(top_k=5)), warp(z, SamplingParams()))
    np.testing.assert_allclose(warp(z, SamplingParams(top_k=3)), [1 / (1 + e(1)), e(1) / (1 + e(1)), 0])


def test_warp_top_p() -> None:
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(warp(z, SamplingParams(top_p=0.8)), [0.625, 0.375, 0, 0], rtol=1e-12)
    np.testing.assert_allclose(warp(z, SamplingParams(top_p=0.81)), np.array([0.5, 0.3, 0.15, 0]) / 0.95, rtol=1e-12)
    np.testing.assert_allclose(warp(z, SamplingParams(top_p=0.5)), [1, 0, 0, 0])  # mass exactly 0.5 suffices
    np.testing.assert_allclose(warp(z, SamplingParams(top_p=1e-9)), [1, 0, 0, 0])  # always at least one token
    np.testing.assert_allclose(warp(z, SamplingParams(top_p=1.0)), [0.5, 0.3, 0.15, 0.05], rtol=1e-12)
    # Ties with the boundary token are all kept.
    np.testing.assert_allclose(warp(np.log([0.4, 0.3, 0.3]), SamplingParams(top_p=0.5)), [0.4, 0.3, 0.3], rtol=1e-12)
    # Order: top-k first, then top-p on the renormalised survivors. [.4 .3 .2 .1] -> k=2 -> [4/7, 3/7] -> p=.5 -> {0}.
    z4 = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    np.testing.assert_allclose(warp(z4, SamplingParams(top_k=2, top_p=0.5)), [1, 0, 0, 0])
    np.testing.assert_allclose(warp(z4, SamplingParams(top_p=0.5)), [4 / 7, 3 / 7, 0, 0], rtol=1e-12)
    # Temperature first: at T = 0.5 the probabilities become [16, 9, 4, 1] / 30; top_p 0.8 keeps {0, 1}.
    np.testing.assert_allclose(warp(z4, SamplingParams(temperature=0.5, top_p=0.8)), [16 / 25, 9 / 25, 0, 0])


def reference_warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Straightforward full-sort implementation of the documented rules, to cross-check the fast path."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1, logits.shape[-1])
    V = z.shape[-1]
    if params.greedy:
        return np.eye(V)[np.argmax(z, -1)].reshape(logits.shape)
    if 0 < params.top_k < V:
        kth = np.sort(z, -1)[:, V - params.top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
    pr = softmax(z / params.temperature)
    if params.top_p < 1:
        s = np.sort(pr, -1)[:, ::-1]
        reached = np.cumsum(s, -1) >= params.top_p - 1e-12
        pos = np.where(reached.any(-1), np.argmax(reached, -1), V - 1)
        pr = np.where(pr >= s[np.arange(len(s)), pos][:, None], pr, 0.0)
        pr /= pr.sum(-1, keepdims=True)
    return pr.reshape(logits.shape)


def test_warp_matches_reference_on_random_logits_with_ties() -> None:
    rng = np.random.default_rng([SEED, 5])
    cases = [
        rng.standard_normal((3, 4, 3000)) * 3,  # leading dims [3, 4]
        rng.integers(-3, 3, size=(7, 40)).astype(np.float64),  # many ties
        np.where(rng.random((5, 2500)) < 0.3, -np.inf, rng.standard_normal((5, 2500))),  # masked vocab
        (rng.standard_normal((4, 5000)) * 2).astype(np.float16),
    ]
    params = [SamplingParams(t, k, p) for t in (0.0, 0.3, 1.0, 2.5) for k in (0, 1, 3, 50) for p in (1.0, 0.9, 0.3)]
    for z in cases:
        for prm in params:
            got, want = warp(z, prm), reference_warp(z, prm)
            assert got.shape == z.shape and got.dtype == np.float64
            np.testing.assert_array_equal(got > 0, want > 0, err_msg=str(prm))
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15, err_msg=str(prm))
            np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-12)


def test_warp_rejects_bad_logits() -> None:
    with pytest.raises(ValueError, match="NaN"):
        warp(np.array([0.0, np.nan, 1.0]), SamplingParams())
    with pytest.raises(ValueError, match="NaN"):
        warp(np.array([[0.0, 1.0], [np.nan, np.nan]]), SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match=r"\+inf"):
        warp(np.array([0.0, np.inf]), SamplingParams())
    with pytest.raises(ValueError, match="entirely -inf"):
        warp(np.array([[0.0, 1.0], [-np.inf, -np.inf]]), SamplingParams())
    with pytest.raises(ValueError, match="V >= 1"):
        warp(np.zeros((2, 0)), SamplingParams())
    with pytest.raises(ValueError, match="dtype"):
        warp(np.array(["a", "b"]), SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        warp(np.zeros(3), {"temperature": 1.0})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": "0.5"}, "top_p"),
    ],
)
def test_sampling_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_types() -> None:
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), top_p=1)
    assert (type(sp.temperature), type(sp.top_k), type(sp.top_p)) == (float, int, float)
    assert sp == SamplingParams(0.5, 4, 1.0)


# ------------------------------------------------------------------------------------------- seeded determinism
def random_batch(rng: np.random.Generator, B: int, L: int, V: int):
    """B independent rows with their own p and q (context-free), drafts sampled from q, ragged lengths."""
    q = rng.dirichlet(np.full(V, 0.5), size=(B, L))
    p = rng.dirichlet(np.full(V, 0.5), size=(B, L + 1))
    x = sample(q, rng.random((B, L)))
    lens = rng.integers(0, L + 1, size=B)
    return x, q, p, lens


def test_seeded_determinism() -> None:
    x, q, p, lens = random_batch(np.random.default_rng([SEED, 1]), 256, 6, 20)
    a = verify_rng(x, q, p, np.random.default_rng(123), draft_lens=lens)
    b = verify_rng(x, q, p, np.random.default_rng(123), draft_lens=lens)
    np.testing.assert_array_equal(a.n_accepted, b.n_accepted)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # Documented draw order: accept_u = rng.random((B, L)), then resample_u = rng.random(B).
    g = np.random.default_rng(123)
    au, ru = g.random(x.shape), g.random(x.shape[0])
    c = speculative_verify(x, q, p, au, ru, draft_lens=lens)
    np.testing.assert_array_equal(a.tokens, c.tokens)
    # sample_rng / warp are deterministic too.
    pr = warp(np.random.default_rng(4).standard_normal((5, 100)), SamplingParams(0.8, 20, 0.9))
    np.testing.assert_array_equal(sample_rng(pr, np.random.default_rng(9)), sample_rng(pr, np.random.default_rng(9)))
    assert a.tokens.dtype == np.int64 and a.n_accepted.dtype == np.int64


@pytest.mark.parametrize("ragged", [False, True])
def test_batched_equals_per_row(ragged: bool) -> None:
    rng = np.random.default_rng([SEED, 2, int(ragged)])
    B, L, V = 200, 5, 9
    x, q, p, lens = random_batch(rng, B, L, V)
    lens = lens if ragged else None
    au, ru = rng.random((B, L)), rng.random(B)
    batch = speculative_verify(x, q, p, au, ru, draft_lens=lens)
    for i in range(B):
        if ragged:  # a ragged row alone: only its own drafts, its own bonus row
            n = int(lens[i])
            one = speculative_verify(
                x[i : i + 1, :n], q[i : i + 1, :n], p[i : i + 1, : n + 1], au[i : i + 1, :n], ru[i : i + 1]
            )
        else:
            one = speculative_verify(x[i : i + 1], q[i : i + 1], p[i : i + 1], au[i : i + 1], ru[i : i + 1])
        assert batch.row(i) == one.row(0), i
        assert batch.n_accepted[i] == one.n_accepted[0]
    assert (batch.tokens[np.arange(L + 1)[None, :] > batch.n_accepted[:, None]] == -1).all()
    # Sharing p / q through a batch dim of 1 equals repeating them.
    shared = speculative_verify(x, q[:1], p[:1], au, ru, draft_lens=lens)
    rep = speculative_verify(x, np.repeat(q[:1], B, 0), np.repeat(p[:1], B, 0), au, ru, draft_lens=lens)
    np.testing.assert_array_equal(shared.tokens, rep.tokens)


# --------------------------------------------------------------------------------------------------- bad inputs
def good_inputs():
    rng = np.random.default_rng(0)
    B, L, V = 2, 3, 5
    q = rng.dirichlet(np.ones(V), size=(B, L))
    p = rng.dirichlet(np.ones(V), size=(B, L + 1))
    return dict(draft_tokens=np.array([[0, 1, 2], [3, 4, 0]]), q=q, p=p, accept_u=rng.random((B, L)),
                resample_u=rng.random(B))


def with_(**changes):
    d = good_inputs()
    d.update(changes)
    return d


def _set(a: np.ndarray, idx, value) -> np.ndarray:
    a = a.copy()
    a[idx] = value
    return a


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda g: with_(draft_tokens=np.array([0, 1, 2])), r"draft_tokens must have shape \[B, L\]"),
        (lambda g: with_(draft_tokens=np.array([[0.0, 1, 2], [3, 4, 0]])), "integer"),
        (lambda g: with_(q=g["q"][:, :2]), "q must have shape"),
        (lambda g: with_(q=g["q"][..., :4]), "q must have shape"),
        (lambda g: with_(p=g["p"][:, :3]), "p must have shape"),
        (lambda g: with_(p=g["p"][0]), r"q must be \[B, L, V\]"),
        (lambda g: with_(accept_u=g["accept_u"][:, :2]), "accept_u must have shape"),
        (lambda g: with_(resample_u=g["resample_u"][:1]), "resample_u must have shape"),
        (lambda g: with_(accept_u=_set(g["accept_u"], (0, 0), 1.0)), r"uniforms in \[0, 1\)"),
        (lambda g: with_(resample_u=_set(g["resample_u"], 0, -0.1)), r"uniforms in \[0, 1\)"),
        (lambda g: with_(resample_u=_set(g["resample_u"], 0, np.nan)), r"uniforms in \[0, 1\)"),
        (lambda g: with_(draft_tokens=np.array([[0, 1, 5], [3, 4, 0]])), r"outside \[0, V=5\)"),
        (lambda g: with_(draft_tokens=np.array([[0, 1, -1], [3, 4, 0]])), r"outside \[0, V=5\)"),
        (lambda g: with_(q=g["q"] * 2), "summing to 1"),
        (lambda g: with_(p=np.log(g["p"])), "negative"),
        (lambda g: with_(p=_set(g["p"], (1, 3, 2), np.nan)), "NaN"),
        (lambda g: with_(q=_set(g["q"], (0, 0, 0), -0.5)), "negative"),
        (lambda g: with_(q=_set(g["q"], (0, 0), [0, 0.5, 0.5, 0, 0])), "probability 0 under its own q"),
        (lambda g: with_(draft_lens=np.array([1, 4])), r"draft_lens must lie in \[0, L=3\]"),
        (lambda g: with_(draft_lens=np.array([1])), "draft_lens must have shape"),
        (lambda g: with_(draft_lens=np.array([1.0, 2.0])), "draft_lens must be integers"),
        (lambda g: with_(p=_set(g["p"], (0, 0, 0), np.inf)), "inf"),
        (lambda g: with_(q=g["q"].astype(str)), "dtype"),
        (lambda g: with_(q=g["q"][..., :0], p=g["p"][..., :0]), "V must be >= 1"),
    ],
)
def test_verify_rejects_bad_input(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        speculative_verify(**make(good_inputs()))


def test_padding_past_draft_lens_is_ignored() -> None:
    g = good_inputs()
    x = np.array([[0, -1, -1], [3, 4, 99]])
    q = _set(g["q"], (0, 1), np.nan)
    p = _set(g["p"], (0, 3), -7.0)  # row 0 uses p rows 0..1 only
    r = speculative_verify(x, q, p, g["accept_u"], g["resample_u"], draft_lens=np.array([1, 2]))
    assert r.n_accepted[0] <= 1 and r.n_accepted[1] <= 2


def test_sample_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="shape"):
        sample(np.ones((2, 3)) / 3, np.zeros(3))
    with pytest.raises(ValueError, match="zero total mass"):
        sample(np.zeros((1, 3)), np.zeros(1))
    with pytest.raises(ValueError, match="negative"):
        sample(np.array([0.5, -0.1, 0.6]), np.float64(0.1))
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.5, np.nan]), np.float64(0.1))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        sample(np.array([0.5, 0.5]), np.float64(1.0))
    with pytest.raises(ValueError, match="inf"):
        sample(np.array([0.5, np.inf]), np.float64(0.1))
    with pytest.raises(ValueError, match="dtype"):
        sample(np.array(["a", "b"]), np.float64(0.1))


# ------------------------------------------------------------------------------------------------ speedup formulas
def test_expected_tokens_and_speedup() -> None:
    for a in (0.0, 0.3, 0.8, 0.999):
        for g in (0, 1, 4, 16):
            geo = sum(a**i for i in range(g + 1))
            assert math.isclose(expected_tokens(a, g), geo, rel_tol=1e-12)
            assert math.isclose(expected_accepted(a, g), geo - 1, rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(ideal_speedup(a, g, 0.05), geo / (0.05 * g + 1), rel_tol=1e-12)
    assert expected_tokens(1.0, 4) == 5.0 and expected_accepted(1.0, 4) == 4.0
    assert ideal_speedup(1.0, 4, 0.25) == 5.0 / 2.0
    assert math.isclose(ideal_speedup(1 - 1e-13, 4, 0.25), 2.5, rel_tol=1e-9)  # continuous at alpha -> 1
    assert math.isclose(ideal_speedup(0.8, 4, 0.1), (1 - 0.8**5) / (0.2 * 1.4), rel_tol=1e-12)
    for bad in (dict(alpha=1.1, gamma=2, c=0.1), dict(alpha=0.5, gamma=-1, c=0.1), dict(alpha=0.5, gamma=2, c=-1.0),
                dict(alpha=0.5, gamma=2.5, c=0.1)):
        with pytest.raises(ValueError):
            ideal_speedup(**bad)


# --------------------------------------------------------------------------------------------------------- speed
def _best_ms(fn, repeat: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def test_speed_full_vocab() -> None:
    V = 151_936
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((9, V)) * 3).astype(np.float32)
    timings = {}
    for prm in (SamplingParams(0.7, 0, 0.9), SamplingParams(0.7, 50, 1.0), SamplingParams(0.7, 50, 0.9),
                SamplingParams(1.0, 0, 1.0), SamplingParams(0.0)):
        timings[f"warp T={prm.temperature} k={prm.top_k} p={prm.top_p}"] = _best_ms(lambda: warp(logits, prm))
    probs = warp(logits, SamplingParams(0.7, 0, 0.9))
    timings["sample 9 rows"] = _best_ms(lambda: sample_rng(probs, rng))
    q = warp(logits[:8] + rng.standard_normal((8, V)).astype(np.float32), SamplingParams(0.7, 0, 0.9))[None]
    x = sample_rng(q, rng)
    timings["verify B=1 L=8"] = _best_ms(lambda: verify_rng(x, q, probs[None], rng))
    for name, ms in timings.items():
        print(f"{name}: {ms:.2f} ms")
    assert max(timings.values()) < 200.0, timings


def test_softmax_prob_matches_a_direct_softmax_and_checks_its_input():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 5
    tokens = np.array([0, 7, 299, 150])
    expected = np.exp(logits.astype(np.float64))
    expected = (expected / expected.sum(axis=1, keepdims=True))[np.arange(4), tokens]
    assert np.allclose(softmax_prob(logits, tokens), expected, rtol=1e-12)
    assert softmax_prob(np.array([[0.0, -np.inf]]), np.array([1]))[0] == 0.0
    with pytest.raises(ValueError, match="outside"):
        softmax_prob(logits, np.array([0, 1, 2, 300]))
    with pytest.raises(ValueError, match="rows"):
        softmax_prob(logits, np.array([0]))
