"""Temperature-perturbation uncertainty (U-HLM eq. 6-7): exact match probabilities, seeded, same law as the paper's."""
from __future__ import annotations

import numpy as np
import pytest

from hat_split.math.uncertainty import (
    PerturbationConfig, match_probabilities, perturbation_uncertainty, sampled_uncertainty_reference,
)

CFG = PerturbationConfig()  # M = 20, θmax = 2


def test_match_probabilities_equal_a_direct_softmax():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 500)) * 3
    z[1, 7] = -np.inf  # masked token
    tokens = np.array([int(np.argmax(z[0])), 7, 42])
    thetas = np.array([[0.0, 0.3, 1.0, 2.0]] * 3)
    got = match_probabilities(z, tokens, thetas)
    for b in range(3):
        for m, th in enumerate(thetas[b]):
            if th == 0:
                want = float(tokens[b] == np.argmax(z[b]))
            else:
                w = np.exp((z[b] - z[b].max()) / th)
                want = w[tokens[b]] / w.sum()
            assert got[b, m] == pytest.approx(want, rel=1e-5, abs=1e-12)


def test_zero_for_a_one_hot_distribution():
    z = np.full((2, 1000), -np.inf)
    z[:, 5] = 0.0  # the only possible token
    assert np.all(perturbation_uncertainty(z, np.array([5, 5]), CFG, np.random.default_rng(1)) == 0)
    peaked = np.zeros((1, 1000))
    peaked[0, 5] = 200.0  # every temperature in [0, 2] keeps all mass on token 5
    assert perturbation_uncertainty(peaked, np.array([5]), CFG, np.random.default_rng(1))[0] == 0


def test_grows_with_entropy():
    rng = np.random.default_rng(2)
    base = rng.normal(size=(1, 2000))
    base[0, 0] = base.max() + 1.0
    means = []
    for scale in (8.0, 3.0, 1.0, 0.3):  # sharper → flatter
        u = [perturbation_uncertainty(base * scale, np.array([0]), CFG, np.random.default_rng(s))[0]
             for s in range(200)]
        means.append(np.mean(u))
    assert all(a < b for a, b in zip(means, means[1:])), means


def test_deterministic_under_a_seed_and_vectorised_over_rows():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(4, 300)) * 2
    toks = z.argmax(axis=1)
    a = perturbation_uncertainty(z, toks, CFG, np.random.default_rng(9))
    b = perturbation_uncertainty(z, toks, CFG, np.random.default_rng(9))
    assert np.array_equal(a, b) and a.shape == (4,)
    assert set(np.round(a * CFG.n_samples, 9)) <= set(range(CFG.n_samples + 1))  # multiples of 1/M


def test_same_law_as_sampling_whole_tokens():
    """Mean and spread of u match the literal procedure (sample M tokens, count mismatches) over many trials."""
    rng = np.random.default_rng(4)
    z = rng.normal(size=(1, 60)) * 1.5
    token = int(np.argsort(z[0])[-2])  # the second most likely token: u is far from 0 and 1
    fast = np.array([perturbation_uncertainty(z, np.array([token]), CFG, np.random.default_rng(s))[0]
                     for s in range(3000)])
    slow = np.array([sampled_uncertainty_reference(z, token, CFG, np.random.default_rng(10_000 + s))
                     for s in range(3000)])
    se = np.sqrt(fast.var() / fast.size + slow.var() / slow.size)
    assert abs(fast.mean() - slow.mean()) < 4 * se
    assert abs(fast.std() - slow.std()) < 0.1 * slow.std()


def test_bad_input_is_refused():
    z = np.zeros((2, 10))
    with pytest.raises(ValueError, match="outside"):
        perturbation_uncertainty(z, np.array([0, 10]), CFG, np.random.default_rng(0))
    with pytest.raises(ValueError, match="thetas"):
        match_probabilities(z, np.array([0, 1]), np.zeros((3, 4)))
    with pytest.raises(ValueError, match="NaN"):
        match_probabilities(np.full((1, 3), np.nan), np.array([0]), np.ones((1, 2)))
    for bad in (dict(n_samples=0), dict(theta_max=0.0), dict(theta_max=float("inf"))):
        with pytest.raises(ValueError):
            PerturbationConfig(**bad)
