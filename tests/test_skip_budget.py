"""U-HLM's skip rule held to a risk per answer, and its rejection line refitted online (hat_split.math.skip_budget):
hand-made token streams with known rejection rates give known lines and thresholds."""
from __future__ import annotations

import numpy as np
import pytest

from hat_split.math.skip_budget import NEVER, RejectionFit, SkipPolicy, threshold_for_risk_per_token


def test_the_threshold_for_a_risk_per_token_by_hand():
    us = np.array([0.4, 0.1, 0.3, 0.2])  # β̂ = u (a = 1, b = 0): skipping u <= t costs Σu / 4 per token
    assert threshold_for_risk_per_token(us, 1.0, 0.0, 0.08) == 0.2  # (0.1 + 0.2) / 4 = 0.075; with 0.3: 0.15
    assert threshold_for_risk_per_token(us, 1.0, 0.0, 0.25) == 0.4
    assert threshold_for_risk_per_token(us, 1.0, 0.0, 0.01) == NEVER  # 0.1 / 4 = 0.025 already too much
    assert threshold_for_risk_per_token(us, 1.0, -0.25, 0.0) == 0.2  # β̂ clipped at 0 below u = 0.25: free skips
    assert threshold_for_risk_per_token(np.array([]), 1.0, 0.0, 0.5) == NEVER
    with pytest.raises(ValueError, match="risk per token"):
        threshold_for_risk_per_token(us, 1.0, 0.0, float("nan"))


def test_the_answers_budget_sets_the_risk_per_token_and_stops_the_skips():
    """ε = 0.5 over an answer of 100 tokens: 0.005 per token. On uncertainties spread evenly over [0, 1) with
    β̂ = u, skipping u <= t costs about t² / 2 per token, so t = 0.1; and the accountant ends the skips once their
    β̂ add up to ε."""
    rng = np.random.default_rng(0)
    policy = SkipPolicy("answer", 0.5, (1.0, 0.0), epsilon=0.5, memory=4000)
    for u in rng.random(4000):
        policy.decide(float(u), 1.0)
    policy.begin(100)
    assert policy.current == pytest.approx(0.1, abs=0.01)
    decisions = [policy.decide(0.09, 1.0) for _ in range(8)]  # β̂ 0.09 each: 5 fit in 0.5, the sixth would not
    assert decisions == ["skip"] * 5 + ["upload"] * 3 and policy.budget.spent == pytest.approx(0.45)
    policy.begin(100)  # a new answer: a fresh budget
    assert policy.decide(0.09, 1.0) == "skip"
    # the answer's length moves the threshold: 1000 tokens leave 0.0005 each, t² / 2 = 0.0005 → t ≈ 0.032
    policy.begin(1000)
    assert policy.current == pytest.approx(0.032, abs=0.006)


def test_the_refit_recovers_a_known_line_and_forgets_the_old_one():
    rng = np.random.default_rng(1)
    fit = RejectionFit((0.82, -0.06), prior_weight=50, memory=100_000)
    assert fit.line() == pytest.approx((0.82, -0.06))  # no points: the prior
    for u in rng.random(20_000):
        fit.observe(float(u), float(rng.random() < 0.3 * u + 0.1))
    a, b = fit.line()
    assert a == pytest.approx(0.3, abs=0.04) and b == pytest.approx(0.1, abs=0.02)
    short = RejectionFit((0.3, 0.1), prior_weight=50, memory=500)  # a stream that changes: the newest points win
    for u in rng.random(5000):
        short.observe(float(u), float(rng.random() < 0.9 * u))
    a, b = short.line()
    assert a == pytest.approx(0.9, abs=0.15) and b == pytest.approx(0.0, abs=0.08)


def _policy_after(stream_line, n=3000, seed=2):
    """A refitting answer-budget policy calibrated at β = 0.5·u, then fed n tokens whose true rejection rate is
    stream_line(u) (every token uploaded and judged, as uploads and explored skips are)."""
    rng = np.random.default_rng(seed)
    policy = SkipPolicy("answer", 0.5, (0.5, 0.0), epsilon=1.0, refit=True, memory=2000)
    for u in rng.random(n):
        policy.decide(float(u), 1.0)
        policy.observe(float(u), bool(rng.random() < stream_line(u)))
    policy.begin(100)
    return policy


def test_a_harder_stream_makes_the_device_skip_less_and_an_easier_one_more():
    calibrated = _policy_after(lambda u: 0.5 * u, n=0)  # no points yet: the calibration's threshold
    as_calibrated = _policy_after(lambda u: 0.5 * u)
    harder = _policy_after(lambda u: min(1.0, 0.9 * u + 0.1))
    easier = _policy_after(lambda u: 0.15 * u)
    assert calibrated.current == NEVER  # no uncertainties seen yet: nothing to set a threshold on
    assert harder.current < as_calibrated.current < easier.current
    assert as_calibrated.current == pytest.approx(np.sqrt(2 * 0.01 / 0.5), abs=0.04)  # 0.5·t²/2 = 0.01 → t = 0.2
    for p in (harder, as_calibrated, easier):
        assert -1.0 <= p.current <= 1.0 and np.isfinite(p.fit.line()).all()


@pytest.mark.parametrize("stream", ["all accepted", "all rejected", "one u", "three points"])
def test_degenerate_streams_keep_the_threshold_bounded_and_finite(stream):
    policy = SkipPolicy("answer", 0.5, (0.82, -0.06), epsilon=0.5, refit=True, explore=0.05)
    points = {"all accepted": [(u, False) for u in np.linspace(0, 1, 500)],
              "all rejected": [(u, True) for u in np.linspace(0, 1, 500)],
              "one u": [(0.3, i % 2 == 0) for i in range(500)],
              "three points": [(0.2, False), (0.5, True), (0.9, True)]}[stream]
    for u, rejected in points:
        policy.decide(u, 0.5)
        policy.observe(u, rejected)
    policy.begin(64)
    a, b = policy.fit.line()
    assert np.isfinite([a, b, policy.current]).all() and -1.0 <= policy.current <= 1.0
    if stream == "all rejected":
        # every token is rejected: one skip alone would cost more than the answer's ε, so none is taken
        assert policy.current < 0.01 and policy.decide(0.0, 0.5) == "upload"
    if stream == "all accepted":
        assert policy.current > 0.5  # the calibrated line alone allows u <= 0.21 here; the prior keeps a slope
    if stream == "three points":
        assert (a, b) == pytest.approx((0.82, -0.06), abs=0.15)  # the prior still dominates


def test_exploring_uploads_a_share_of_the_would_be_skips():
    policy = SkipPolicy("threshold", 0.5, (0.82, -0.06), refit=True, explore=0.25, token_risk=1.0)
    for u in np.linspace(0.0, 0.2, 40):  # risk 1.0 per token: every seen u may be skipped
        policy.decide(float(u), 1.0)
    policy.begin(10)
    coins = [0.1, 0.3, 0.6, 0.9] * 5
    decisions = [policy.decide(0.1, c) for c in coins]
    assert decisions.count("explore") == 5 and decisions.count("skip") == 15
    fixed = SkipPolicy("threshold", 0.5, (0.82, -0.06), explore=0.25)  # no refit: nothing to explore for
    assert [fixed.decide(0.1, 0.1), fixed.decide(0.6, 0.1)] == ["skip", "upload"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(rule="tokens"), "skip rule must be one of threshold, answer"),
    (dict(epsilon=float("nan")), "answer's risk ε"),
    (dict(explore=1.0), "explore in \\[0, 1\\)"),
    (dict(memory=0), "memory and every"),
])
def test_bad_settings_are_refused_with_their_name(kwargs, message):
    args = dict(rule="answer", threshold=0.5, line=(0.82, -0.06), **{k: v for k, v in kwargs.items() if k != "rule"})
    if "rule" in kwargs:
        args["rule"] = kwargs["rule"]
    with pytest.raises(ValueError, match=message):
        SkipPolicy(**args)
    with pytest.raises(ValueError, match="finite"):
        SkipPolicy("answer", 0.5, (0.82, -0.06)).decide(float("nan"), 0.5)
    with pytest.raises(ValueError, match="prior line must be finite"):
        RejectionFit((float("inf"), 0.0))
