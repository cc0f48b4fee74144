"""The cost model (hat_split.math.costmodel) against hand-computed rounds and the closed forms it generalises:
Leviathan et al.'s ideal speedup and QS-SD's round latency (eq. 9)."""
from __future__ import annotations

import math
import random

import pytest

from hat_split.math.costmodel import (CloudCosts, CostCurve, DeviceCosts, Link, WireSizes, best_knob, phase_wait,
                                      predict, predict_hat_tree, predict_tree)
from hat_split.math.verify import expected_tokens, ideal_speedup


def _cloud(t=0.1):
    """A cloud whose step costs t seconds at any size up to 64 positions."""
    return CloudCosts(CostCurve(((1, t), (64, t))))


def test_sd_without_link_or_overheads_is_leviathans_ideal_speedup():
    T, c = 0.2, 0.15
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for gamma in (1, 4, 8):
            flat = CostCurve(((1, T), (64, T)))  # a verify of γ + 1 positions costs one step (the formula's premise)
            p = predict("sd", gamma, 10, Link(), DeviceCosts(draft_step_s=c * T), CloudCosts(flat), WireSizes(),
                        alpha)
            assert p.tokens_per_s * T == pytest.approx(ideal_speedup(alpha, gamma, c), rel=1e-12)


def test_sd_round_is_qs_sd_eq_9():
    """L T_SLM + L (⌈log2 V⌉ + b) / C_u + T_LLM + (⌈log2 L⌉ + ⌈log2 V⌉) / C_d, preambles neglected (QS-SD eq. 7-9)."""
    V, b, L, T_slm, T_llm, Cu, Cd = 151936, 24, 5, 0.03, 0.25, 2e6, 8e6
    bits_v = math.ceil(math.log2(V))
    wire = WireSizes(up_per_draft=(bits_v + b) / 8, down_round=(math.ceil(math.log2(L)) + bits_v) / 8)
    p = predict("sd", L, 10, Link(0.0, Cu, Cd), DeviceCosts(draft_step_s=T_slm), _cloud(T_llm), wire, alpha=0.5)
    eq9 = L * T_slm + L * (bits_v + b) / Cu + T_llm + (math.ceil(math.log2(L)) + bits_v) / Cd
    assert p.round_s == pytest.approx(eq9, rel=1e-12)
    assert p.tokens_per_round == pytest.approx(expected_tokens(0.5, L))


def test_ksqs_is_sd_with_its_own_rows_and_acceptance():
    """ksqs's round is QS-SD eq. 9 with each row's lattice code for b: at equal bytes and α it is sd's round; at
    T > 0 over LTE, sd's dense float16 rows (2 V bytes) cost more uplink than the code's few dozen bytes save in
    acceptance, and the best γ follows."""
    V, L, T_slm, T_llm, Cu, Cd = 151936, 4, 0.03, 0.25, 5e6, 20e6
    link, dev, cloud = Link(0.05, Cu, Cd), DeviceCosts(draft_step_s=T_slm), _cloud(T_llm)
    code = WireSizes(up_per_draft=4 + 70)  # an id and a 16-point lattice code
    same = [predict(name, L, 10, link, dev, cloud, code, alpha=0.7) for name in ("sd", "ksqs")]
    assert same[0].round_s == same[1].round_s and same[0].tokens_per_round == same[1].tokens_per_round
    ksqs = predict("ksqs", L, 10, link, dev, cloud, code, alpha=0.65)
    eq9 = L * T_slm + 0.05 + L * 8 * 74 / Cu + T_llm
    assert ksqs.round_s == pytest.approx(eq9, rel=1e-12) and ksqs.up_bytes_per_token == pytest.approx(
        L * 74 / expected_tokens(0.65, L))
    sd = best_knob("sd", range(1, 9), 10, link, dev, cloud, WireSizes(up_per_draft=4 + 2 * V), alpha=0.7)
    best = best_knob("ksqs", range(1, 9), 10, link, dev, cloud, code, alpha=0.65)
    assert best.tokens_per_s > 2 * sd.tokens_per_s and best.knob > sd.knob


def test_hand_computed_rounds_of_every_protocol():
    link = Link(rtt_s=0.02, up_bps=8e6, down_bps=16e6)  # 1 MB/s up, 2 MB/s down
    curve = CostCurve(((1, 0.1), (4, 0.16)))  # 0.1 s for 1 position, +0.02 s per position up to 4, then +0.02
    cloud = CloudCosts(curve, wait_s=0.01, middle_share=0.5)
    dev = DeviceCosts(draft_step_s=0.03, local_step_s=0.05, prefill_s=0.001, round_s=0.004, split_step_s=0.02,
                      hat_draft_s=0.025, hat_verify_s=0.01, watts=10.0, shares_host=True)
    wire = WireSizes(up_round=100, up_per_draft=1000, down_round=50, down_per_token=10, hidden=3000)

    sd = predict("sd", 3, 20, link, dev, cloud, wire, alpha=0.5)
    n = 1 + 0.5 + 0.25 + 0.125  # E(0.5, 3)
    up, down = 100 + 3 * 1000, 50 + n * 10
    cloud_s = 0.16  # g(4)
    round_s = 3 * 0.03 + 0.004 + (0.02 + up / 1e6 + down / 2e6) + 0.01 + cloud_s
    assert sd.tokens_per_round == pytest.approx(n) and sd.round_s == pytest.approx(round_s)
    assert sd.cloud_s_per_token == pytest.approx(cloud_s / n)
    assert sd.joules_per_token == pytest.approx(10 * (3 * 0.03 + 0.004) / n)
    prompt = (0.02 + (20 * 4 + 100) / 1e6 + 50 / 2e6) + 0.01 + (0.16 + 0.02 * 16) + 20 * 0.001  # g(20) extrapolated
    assert sd.ttft_s == pytest.approx(prompt + round_s)

    llm = predict("llm", 4, 20, link, dev, cloud, wire)
    assert llm.round_s == pytest.approx(0.004 + 0.02 + 100 / 1e6 + (50 + 40) / 2e6 + 0.01 + 4 * 0.1)
    assert llm.tokens_per_round == 4 and llm.cloud_s_per_token == pytest.approx(0.1)

    slm = predict("slm", 0, 20, link, dev, None, wire)
    assert slm.tokens_per_s == pytest.approx(20.0) and slm.up_bytes_per_token == 0 and slm.cloud_s_per_token == 0
    assert slm.ttft_s == pytest.approx(20 * 0.001 + 0.05)

    u = predict("ushape", 0, 20, link, dev, cloud, wire)
    assert u.round_s == pytest.approx(0.02 + 0.004 + 0.02 + 3100 / 1e6 + 3050 / 2e6 + 0.01 + 0.5 * 0.1)
    assert u.up_bytes_per_token == 3100

    hat = predict("hat", 2, 20, link, dev, cloud, wire, alpha=0.6)
    n = 1 + 0.6 + 0.36
    assert hat.tokens_per_round == pytest.approx(n)
    assert hat.round_s == pytest.approx(2 * 0.025 + 0.01 + 0.004 + 0.02 + (3 * 3000 + 100) / 1e6
                                        + (3 * 3000 + 50) / 2e6 + 0.01 + 0.5 * (0.1 + 0.02 * 2))


def test_the_best_draft_length_follows_the_link():
    """A slow uplink with dense rows: short drafts; a free link and high acceptance: long ones."""
    dev, cloud = DeviceCosts(draft_step_s=0.02), _cloud(0.2)
    dense = WireSizes(up_per_draft=300_000)
    slow = best_knob("sd", range(1, 9), 10, Link(0.01, 20e6, 50e6), dev, cloud, dense, alpha=0.7)
    free = best_knob("sd", range(1, 9), 10, Link(), dev, cloud, WireSizes(up_per_draft=8), alpha=0.9)
    assert slow.knob < free.knob and free.knob == 8


@pytest.mark.parametrize("bad", [dict(rtt_s=float("nan")), dict(up_bps=-1.0), dict(down_bps=float("inf")),
                                 dict(rtt_s=True)])
def test_bad_inputs_are_refused_naming_the_field(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"Link.{name}"):
        Link(**bad)
    with pytest.raises(ValueError, match="positions must increase"):
        CostCurve(((4, 0.1), (2, 0.2)))
    with pytest.raises(ValueError, match="seconds >= 0"):
        CostCurve(((1, -0.1),))
    with pytest.raises(ValueError, match="DeviceCosts.draft_step_s"):
        DeviceCosts(draft_step_s=float("nan"))
    with pytest.raises(ValueError, match="no cost model for protocol 'qs'"):
        predict("qs", 1, 5, Link(), DeviceCosts(), _cloud(), WireSizes())
    with pytest.raises(ValueError, match="hidden state"):
        predict("hat", 2, 5, Link(), DeviceCosts(), _cloud(), WireSizes(), alpha=0.5)
    with pytest.raises(ValueError, match="local step time"):
        predict("slm", 0, 5, Link(), DeviceCosts(), None, WireSizes())


def test_a_tree_round_is_a_chain_round_with_its_measured_tokens():
    """A chain of γ is the tree of γ nodes and depth γ: with the chain's E(α, γ) the two predictions are one; a tree
    pays a draft step per level, a row per node up and a verify of its nodes + 1 positions."""
    link, dev = Link(rtt_s=0.05, up_bps=8e6, down_bps=16e6), DeviceCosts(draft_step_s=0.01, round_s=0.002)
    wire = WireSizes(100, 8, 100, 4)
    cloud = CloudCosts(CostCurve(((1, 0.01), (17, 0.012), (65, 0.03))))
    chain = predict("sd", 4, 64, link, dev, cloud, wire, alpha=0.7)
    same = predict_tree(4, 4, expected_tokens(0.7, 4), 64, link, dev, cloud, wire)
    assert (same.round_s, same.tokens_per_s, same.ttft_s) == pytest.approx(
        (chain.round_s, chain.tokens_per_s, chain.ttft_s), rel=1e-12)
    tree = predict_tree(32, 8, 5.0, 64, link, dev, cloud, wire)
    g33 = 0.012 + (33 - 17) / (65 - 17) * (0.03 - 0.012)  # the curve between its points
    want = 8 * 0.01 + 0.002 + 0.05 + 8 * (100 + 32 * 8) / 8e6 + 8 * (100 + 5 * 4) / 16e6 + g33
    assert tree.round_s == pytest.approx(want, rel=1e-12) and tree.tokens_per_round == 5.0
    assert tree.protocol == "sd_tree" and tree.knob == 32
    with pytest.raises(ValueError, match="nodes >= depth"):
        predict_tree(4, 8, 2.0, 64, link, dev, cloud, wire)
    # η ends a chain of 8 after 3.5 drafts on average: 3.5 nodes up and 4.5 positions verified, the same drafting
    short = predict_tree(8, 8, 3.0, 64, link, dev, cloud, wire, sent=3.5)
    g45 = 0.01 + (4.5 - 1) / (17 - 1) * (0.012 - 0.01)
    want = 8 * 0.01 + 0.002 + 0.05 + 8 * (100 + 3.5 * 8) / 8e6 + 8 * (100 + 3 * 4) / 16e6 + g45
    assert short.round_s == pytest.approx(want, rel=1e-12) and short.up_bytes_per_token == pytest.approx(128 / 3)
    for bad in (0.5, 8.5, float("nan")):
        with pytest.raises(ValueError, match="sends 1..8 of them"):
            predict_tree(8, 8, 3.0, 64, link, dev, cloud, wire, sent=bad)


def test_the_steps_a_round_meets_are_its_own_step_or_the_reports_longer():
    """cadence_s: a busy cloud's steps as a round meets them, the longer of the others' step the cloud reports and
    the round's own (the others' work in it); none without others' work; NaN or negative refused. A round is priced
    by it: sd γ 4 (0.508 s of drafting on a slow board, a 4 ms link) on a cloud whose own steps take 0.58 s where the
    report says 0.40 waits to the end of one step, not of two; llm's chunk of 8 waits by one step of g(1)."""
    from hat_split.math.costmodel import cadence_s

    assert cadence_s(0.4, 0.58) == 0.58 and cadence_s(0.5, 0.3) == 0.5 and cadence_s(0.0, 0.58) == 0.0
    for bad in ((float("nan"), 0.5), (0.4, -0.1), (0.4, float("inf"))):
        with pytest.raises(ValueError, match="cadence_s needs"):
            cadence_s(*bad)
    link, dev = Link(rtt_s=0.004), DeviceCosts(draft_step_s=0.127)
    curve = CostCurve(((1, 0.55), (5, 0.58), (9, 0.6)))
    p = predict("sd", 4, 10, link, dev, CloudCosts(curve, step_s=0.4, duty=1.0), WireSizes(), alpha=0.8)
    ahead = 4 * 0.127 + 0.004
    assert p.round_s == pytest.approx(ahead + (0.58 - ahead) + 0.58)  # one step of its own length, then its own
    llm = predict("llm", 8, 10, link, dev, CloudCosts(curve, step_s=0.4, duty=1.0), WireSizes())
    assert llm.round_s == pytest.approx(0.004 + (0.55 - 0.004) + 8 * 0.55)
    # a split protocol whose middle part holds no layers (φ = 0): no step of its own, the report's steps
    ushape = predict("ushape", 0, 10, link, DeviceCosts(split_step_s=0.01),
                     CloudCosts(curve, middle_share=0.0, step_s=0.4, duty=1.0), WireSizes(hidden=100.0))
    assert ushape.round_s == pytest.approx(0.4)  # the link and the device's part, then the wait to the step's end


def test_a_jittery_clouds_phase_wait_is_its_mean_over_the_phases_it_may_meet():
    """With steps of relative standard deviation σ (jitter) a request x seconds on meets the steps' grid within a
    window of width √12 · σ · s · √max(1, x/s) around x: the wait is s⌈t/s⌉ − t's mean over it — the sawtooth itself
    without jitter or inside one step, s/2 over a whole step, the hand-computed mean across a step's end, a Monte
    Carlo's — and a round is priced with it; a negative or NaN jitter is refused."""
    s = 0.5
    j = lambda half, x: half / (0.5 * math.sqrt(12.0) * s * math.sqrt(max(1.0, x / s)))  # noqa: E731 σ of a half-width
    assert phase_wait(0.3, s, 0.0) == phase_wait(0.3, s) == pytest.approx(0.2)
    assert phase_wait(0.3, s, j(0.1, 0.3)) == pytest.approx(0.2)  # [0.2, 0.4]: linear inside a step
    assert phase_wait(0.5, s, j(0.1, 0.5)) == pytest.approx((0.005 + 0.045) / 0.2)  # [0.4, 0.6]: across its end
    assert phase_wait(1.0, s, j(0.25, 1.0)) == pytest.approx(0.25)  # [0.75, 1.25]: a whole step, s/2
    rng = random.Random(7)
    x, jitter = 0.84, 0.18
    half = 0.5 * math.sqrt(12.0) * jitter * s * math.sqrt(x / s)
    draws = [x + rng.uniform(-half, half) for _ in range(100_000)]
    assert phase_wait(x, s, jitter) == pytest.approx(sum(phase_wait(t, s) for t in draws) / len(draws), abs=0.003)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="phase_wait needs"):
            phase_wait(0.3, s, bad)
    with pytest.raises(ValueError, match="CloudCosts.jitter"):
        CloudCosts(CostCurve(((1, 0.5),)), jitter=-1.0)
    link, dev, flat = Link(rtt_s=0.02), DeviceCosts(draft_step_s=0.07), CostCurve(((1, 0.5), (64, 0.5)))
    p = predict("sd", 8, 10, link, dev, CloudCosts(flat, step_s=s, duty=1.0, jitter=jitter), WireSizes(), alpha=0.8)
    assert p.round_s == pytest.approx(0.58 + phase_wait(0.58, s, jitter) + 0.5)


def test_phase_wait_and_a_round_in_phase_with_a_cloud_stepping_back_to_back():
    """A request x seconds after its last reply left waits for the step in progress: s⌈x/s⌉ − x; a round then costs
    whole steps of the others' work and its own step; the prompt waits half a step; duty scales the phase wait (0:
    a cloud that does not say, its wait_s alone)."""
    assert phase_wait(0.3, 0.5) == pytest.approx(0.2) and phase_wait(0.5, 0.5) == pytest.approx(0.0)
    assert phase_wait(0.6, 0.5) == pytest.approx(0.4) and phase_wait(1.3, 0.5) == pytest.approx(0.2)
    assert phase_wait(0.0, 0.5) == 0.0 and phase_wait(0.3, 0.0) == 0.0
    for bad in ((-0.1, 0.5), (0.3, -1.0), (float("nan"), 0.5), (0.3, float("inf"))):
        with pytest.raises(ValueError, match="phase_wait needs"):
            phase_wait(*bad)
    link, dev, wire = Link(rtt_s=0.02), DeviceCosts(draft_step_s=0.07), WireSizes()
    flat = CostCurve(((1, 0.5), (64, 0.5)))
    stepping = CloudCosts(flat, step_s=0.5, duty=1.0)
    for gamma, steps in ((1, 1), (6, 1), (7, 2), (8, 2)):  # 0.07 γ + 0.02 within 0.5 s, or not
        p = predict("sd", gamma, 10, link, dev, stepping, wire, alpha=0.8)
        assert p.round_s == pytest.approx(0.5 * steps + 0.5), gamma
    assert best_knob("sd", range(1, 9), 10, link, dev, stepping, wire, 0.8).knob == 6
    half = CloudCosts(flat, wait_s=0.25)
    for gamma in (1, 8):  # the mean wait: every draft step costs its time, no step's edge
        p = predict("sd", gamma, 10, link, dev, half, wire, alpha=0.8)
        assert p.round_s == pytest.approx(0.07 * gamma + 0.02 + 0.25 + 0.5)
    some = predict("sd", 8, 10, link, dev, CloudCosts(flat, step_s=0.5, duty=0.4), wire, alpha=0.8)
    assert some.round_s == pytest.approx(0.58 + 0.4 * 0.42 + 0.5)
    assert some.ttft_s - some.round_s == pytest.approx(0.02 + 0.5 * 0.4 * 0.5 + 0.5)
    with pytest.raises(ValueError, match="duty must be a share"):
        CloudCosts(flat, step_s=0.5, duty=1.5)
    credited = predict("sd", 8, 10, link, dev, CloudCosts(flat, step_s=0.5, duty=0.4, wait_credit_s=0.1), wire,
                       alpha=0.8)  # rounds measured to wait 0.1 s less than the phase wait: taken off it ...
    assert credited.round_s == pytest.approx(0.58 + 0.4 * 0.42 - 0.1 + 0.5)
    assert credited.ttft_s - credited.round_s == pytest.approx(some.ttft_s - some.round_s)  # (not the prompt's)
    beyond = predict("sd", 8, 10, link, dev, CloudCosts(flat, step_s=0.5, duty=0.4, wait_credit_s=5.0), wire,
                     alpha=0.8)  # ... as far as it goes: no round is shorter than its parts
    assert beyond.round_s == pytest.approx(0.58 + 0.5)
    with pytest.raises(ValueError, match="wait_credit_s must be a finite number >= 0"):
        CloudCosts(flat, wait_credit_s=-0.1)


def test_a_hat_tree_round_by_hand():
    """A level per draft step, every node's state up and back, the middle part's share of a step over N + 1
    positions, and one head call per row the walk reads (τ); the prompt's states up for the first token."""
    link, dev = Link(rtt_s=0.05, up_bps=8e6, down_bps=16e6), DeviceCosts(hat_draft_s=0.01, hat_verify_s=0.004,
                                                                         round_s=0.002, prefill_s=0.001)
    wire = WireSizes(100, 8, 100, 4, hidden=3072)
    cloud = CloudCosts(CostCurve(((1, 0.01), (17, 0.012), (65, 0.03))), middle_share=0.9)
    tree = predict_hat_tree(16, 4, 2.0, 64, link, dev, cloud, wire)
    g17 = 0.012
    states = 17 * 3072
    want = 4 * 0.01 + 2.0 * 0.004 + 0.002 + 0.05 + 8 * (states + 100) / 8e6 + 8 * (states + 100) / 16e6 + 0.9 * g17
    assert tree.round_s == pytest.approx(want, rel=1e-12) and tree.tokens_per_s == pytest.approx(2.0 / want)
    assert tree.protocol == "hat_tree" and tree.up_bytes_per_token == pytest.approx((states + 100) / 2.0)
    prompt = 0.05 + 8 * (64 * 3072 + 100) / 8e6 + 8 * (100 + 3072) / 16e6 + 0.9 * (0.012 + 47 / 48 * 0.018)
    assert tree.ttft_s == pytest.approx(prompt + 64 * 0.001 + want, rel=1e-12)  # split: the input part first
    with pytest.raises(ValueError, match="hidden state"):
        predict_hat_tree(16, 4, 2.0, 64, link, dev, cloud, WireSizes())
    with pytest.raises(ValueError, match="nodes >= depth"):
        predict_hat_tree(2, 4, 2.0, 64, link, dev, cloud, wire)


def test_a_round_over_a_stretch_is_its_round_then_the_pace_after_it():
    """over_horizon by hand: a round of 2 tokens in 2 s over a stretch of 8 at 2 tok/s after it is 8 tokens in
    2 + 6 / 2 = 5 s; a round that fills the stretch is itself; the ranking over any stretch at least every round's
    tokens is the same (r − τ / S); the per-token figures are the round's. Bad inputs are refused by name."""
    import dataclasses
    import math

    from hat_split.math.costmodel import Prediction, over_horizon

    first = Prediction("sd", 3, 2.0, 2.0, 3.0, 40.0, 20.0, 0.3, 0.1, None, 0.5)
    out = over_horizon(first, 8.0, 2.0)
    assert (out.tokens_per_round, out.round_s) == (8.0, 5.0) and out.tokens_per_s == pytest.approx(8 / 5)
    assert dataclasses.replace(out, tokens_per_round=2.0, round_s=2.0) == first
    chunk = Prediction("llm", 8, 8.0, 7.0, 9.0, 10.0, 30.0, 0.9, 0.0, None, 1.0)
    assert over_horizon(chunk, 8.0, 2.0) == chunk
    assert chunk.tokens_per_s > first.tokens_per_s  # a round each: the chunk
    for stretch in (8.0, 12.0, 40.0):  # over a stretch: the round, 2 − 2 / 2 = 1 s lost against 7 − 8 / 2 = 3
        assert over_horizon(first, stretch, 2.0).tokens_per_s > over_horizon(chunk, stretch, 2.0).tokens_per_s
    for tokens, pace, field in ((1.0, 2.0, "tokens"), (math.nan, 2.0, "tokens"), (8.0, 0.0, "then_tokens_per_s"),
                                (8.0, math.inf, "then_tokens_per_s")):
        with pytest.raises(ValueError, match=field):
            over_horizon(first, tokens, pace)


def test_a_chains_tokens_over_a_beta_belief_by_hand_and_by_sampling():
    """E[Σ α^k] for α ~ Beta(a, b): uniform (Beta(1, 1)) gives Σ 1/(k+1); b = 0 is α = 1; a tight belief is eq. 1 at
    its mean; a spread one is above it (Jensen), and equals a sampled mean; ρ scales α; bad inputs named."""
    from hat_split.math.verify import alpha_for_tokens, expected_tokens_beta
    assert expected_tokens_beta(1, 1, 4) == pytest.approx(1 + 1 / 2 + 1 / 3 + 1 / 4 + 1 / 5)
    assert expected_tokens_beta(3, 0, 8) == 9.0
    assert expected_tokens_beta(0, 5, 8) == 1.0
    assert expected_tokens_beta(8e6, 2e6, 8) == pytest.approx(expected_tokens(0.8, 8), rel=1e-5)
    spread = expected_tokens_beta(6.4, 1.6, 8)
    assert spread > 1.1 * expected_tokens(0.8, 8)
    rng = random.Random(7)
    draws = [rng.betavariate(6.4, 1.6) for _ in range(200_000)]
    assert spread == pytest.approx(sum(expected_tokens(x, 8) for x in draws) / len(draws), rel=5e-3)
    assert expected_tokens_beta(6.4, 1.6, 4, 0.9) == pytest.approx(
        sum(expected_tokens(0.9 * x, 4) for x in draws) / len(draws), rel=5e-3)
    for args, field in (((-1, 1, 4), "a must"), ((1, math.nan, 4), "b must"), ((0, 0, 4), "a \\+ b"),
                        ((1, 1, 4, 1.5), "scale must"), ((1, 1, -1), "gamma")):
        with pytest.raises(ValueError, match=field):
            expected_tokens_beta(*args)
    for gamma in (1, 4, 8):  # the α at which eq. 1 commits those tokens
        for tau in (1.0, 1.54, gamma + 0.5, gamma + 1.0):
            assert expected_tokens(alpha_for_tokens(tau, gamma), gamma) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError, match="1 to 5 tokens"):
        alpha_for_tokens(6.0, 4)
