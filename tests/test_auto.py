"""Protocol auto (edge_runtime.auto, edge_runtime.sessions.auto): the controller's choices on hand-set estimates,
the cloud's cost report checked, and requests through a real runtime and cloud — forced switches mid-request keep
the target's greedy tokens, a cut link degrades to the device alone, a private request runs a split protocol, slm
only when allowed."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from edge_runtime.auto import PROBE_EVERY, SWITCH_GAIN, AutoController, Choice
from edge_runtime.acceptance import OPENING_RATIO, Acceptance
from edge_runtime.auto_estimates import GREEDY, OVERHEAD_PRIOR_ROUNDS, AutoEstimates
from edge_runtime.drafter import Drafter
from hat_split.math.chunking import DelayModel
from hat_split.math.costmodel import Link, predict_tree
from hat_split.math.draft_stop import eta_tail
from hat_split.math.verify import expected_tokens, expected_tokens_beta
from hat_split.wire import messages as P
from tests.conftest import refusing_port, serving

PROMPT = [5, 17, 99, 3, 250, 7]


def _estimates(alpha: float, draft_s: float, step_1: float, step_9: float) -> AutoEstimates:
    """Both protocols measured: sd's acceptance and draft step, the cloud's step at 1 and 9 positions."""
    est = AutoEstimates(draft_step_s=draft_s, local_step_s=draft_s, up_round=80.0, down_round=100.0,
                        down_per_token=4.0, measured={"sd": 3, "llm": 3}, up_per_row={("sd", GREEDY): 60.0})
    est.acceptance[("sd", GREEDY)] = Acceptance(accepted=alpha, examined=1.0, rounds=10**9)  # long measured: the
    # prompts' α is `alpha` (ALPHA_BASE's pull faded)
    est.observed = DelayModel()
    est.observed.observe(1, step_1)
    est.observed.observe(9, step_9)
    return est


def _pulled(measured: float, rounds: int) -> float:
    """The prompts' acceptance after `rounds` rounds that measured `measured`: ALPHA_BASE's pull, by hand."""
    from edge_runtime.acceptance import ALPHA_BASE, ALPHA_BASE_ROUNDS

    return (rounds * measured + ALPHA_BASE_ROUNDS * ALPHA_BASE) / (rounds + ALPHA_BASE_ROUNDS)


def _begin_past_opening(est: AutoEstimates, kind: str = GREEDY) -> None:
    """A new request whose opening round is behind it (a round committed): its α is the prompts' from here, not the
    openings' (`Acceptance.opening`, tested on its own)."""
    est.begin_request(kind)
    est.opening = False


def _controller(est: AutoEstimates, **kw) -> AutoController:
    return AutoController(est, kw.pop("eligible", ("sd", "llm")), 8, 8, 20, **kw)


def test_the_controller_follows_the_cost_model():
    """A cheap draft that the target agrees with: sd at a long γ; a draft the target rejects: llm; unmeasured
    protocols are tried first; a small predicted gain does not switch."""
    fast_cloud_verify = dict(step_1=0.2, step_9=0.22)
    sd = _controller(_estimates(0.9, 0.02, **fast_cloud_verify)).decide(Link(0.01))
    assert sd.protocol == "sd" and sd.knob >= 5, sd
    llm = _controller(_estimates(0.05, 0.05, **fast_cloud_verify)).decide(Link(0.01))
    assert llm.protocol == "llm", llm
    fresh = _controller(AutoEstimates()).decide(Link())
    assert fresh.protocol == "sd" and fresh.reason.startswith("measuring")
    # sd measured, llm not: llm is measured a token a round (its overhead and a step; a chunk under load costs seconds)
    est = _estimates(0.9, 0.02, **fast_cloud_verify)
    est.measured.pop("llm")
    first_llm = _controller(est).decide(Link(0.01))
    assert (first_llm.protocol, first_llm.knob) == ("llm", 1), first_llm
    assert first_llm.reason == "measuring llm (one token a round): 0 of 3 rounds"
    # a loaded cloud: verification of 9 positions costs as much as 9 steps, and drafting is no longer worth it
    loaded = _controller(_estimates(0.6, 0.03, step_1=0.2, step_9=1.8)).decide(Link(0.01))
    assert loaded.protocol == "llm", loaded


def test_a_switch_needs_a_clear_gain_and_alternatives_are_probed():
    est = _estimates(0.4, 0.05, step_1=0.2, step_9=0.24)
    c = _controller(est)
    preds = c.predictions(Link(0.01))
    ratio = preds["sd"].tokens_per_s / preds["llm"].tokens_per_s
    assert 1.0 < ratio < 1.10, ratio  # sd a little ahead
    c.record(Choice("llm", 8, "predicted", {}), 8)  # running llm: sd's small edge does not move it
    kept = c.decide(Link(0.01))
    assert kept.protocol == "llm" and kept.reason.endswith("llm kept: sd is within 1.10× of it"), kept.reason
    slow_draft = _estimates(0.1, 0.05, step_1=0.2, step_9=0.24)  # llm clearly ahead: sd no longer runs ...
    c = _controller(slow_draft)
    for _ in range(PROBE_EVERY):
        assert c.decide(Link(0.01)).protocol == "llm"
        c.record(Choice("llm", 8, "predicted", {}), 8)
    fresh = _controller(slow_draft)  # ... until it has been idle PROBE_EVERY rounds of the runtime, across requests,
    assert fresh.decide(Link(0.01)).protocol == "llm"  # never as a request's first round (its TTFT) ...
    fresh.record(Choice("llm", 8, "predicted", {}), 8)
    assert fresh.decide(Link(0.01), behind=40).protocol == "llm"  # ... nor with a long catch-up before its draft
    probe = fresh.decide(Link(0.01), behind=8)
    assert probe.protocol == "sd" and probe.reason.startswith("probing"), probe
    fresh.record(probe, 2)
    assert fresh.decide(Link(0.01)).protocol == "llm"


def test_a_probe_binds_nothing_the_protocol_last_chosen_is_kept():
    """A probe (or a measuring round) between rounds of the protocol chosen does not become the protocol kept: with
    the other protocol within 1.10× ahead of the one chosen, the one chosen runs on after the probe, either way
    round — sd chosen and llm probed, llm chosen and sd probed — and says so; the probed one, clearly ahead, takes
    over. (A one-token probe of llm once took over from a tree this way under load, at 0.57× the tree's row.)"""
    sd_kept = _estimates(0.25, 0.05, step_1=0.2, step_9=0.24)
    c = _controller(sd_kept)
    preds = c.predictions(Link(0.01))
    assert 1.0 < preds["llm"].tokens_per_s / preds["sd"].tokens_per_s < 1.10, preds  # llm a little ahead
    c.record(Choice("sd", 4, "predicted", {}), 2)
    c.record(Choice("llm", 1, f"probing llm (one token): not run for {PROBE_EVERY} rounds", {}), 1)
    kept = c.decide(Link(0.01))
    assert kept.protocol == "sd" and kept.reason.endswith("sd kept: llm is within 1.10× of it"), kept
    llm_kept = _estimates(0.4, 0.05, step_1=0.2, step_9=0.24)  # sd a little ahead
    c = _controller(llm_kept)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    c.record(Choice("sd", 4, f"probing sd: not run for {PROBE_EVERY} rounds", {}), 3)
    c.record(Choice("sd", 4, "measuring sd: 2 of 3 rounds", {}), 3)
    kept = c.decide(Link(0.01))
    assert kept.protocol == "llm" and kept.reason.endswith("llm kept: sd is within 1.10× of it"), kept
    c = _controller(_estimates(0.1, 0.05, step_1=0.2, step_9=0.24))  # llm 1.2× sd: the probe's protocol wins
    c.record(Choice("sd", 4, "predicted", {}), 2)
    c.record(Choice("llm", 1, f"probing llm (one token): not run for {PROBE_EVERY} rounds", {}), 1)
    assert c.decide(Link(0.01)).protocol == "llm"


def test_llms_tokens_are_read_while_the_prompt_may_be_easier_than_the_prompts():
    """The prompts' α 0.5 prices sd at 0.72× llm, out of READ_AHEAD_REACH: at its mean alone nothing would be read and
    the request would never learn its own α. Its belief (8 drafts' worth) is wide, and at its hopeful α (READ_HOPE_Z
    deviations above: 0.71) sd would be within reach, so llm's tokens are read; a prompt whose reads agree brings sd
    within reach at its own price, one whose reads disagree narrows the hope and the reads stop. A draft model so slow
    that sd is out of reach at α = 1 reads nothing."""
    from edge_runtime.auto import READ_AHEAD_REACH
    from edge_runtime.auto_estimates import READ_HOPE_Z

    def fresh(draft_s: float = 0.04):
        est = _estimates(0.5, draft_s, step_1=0.05, step_9=0.1)
        est.begin_request()
        est.opening = False  # past its first round
        return est, _controller(est)

    est, c = fresh()
    preds = c.predictions(Link(0.01))
    assert preds["sd"].tokens_per_s < READ_AHEAD_REACH * preds["llm"].tokens_per_s
    assert not c.sd_within_reach(preds) and c.worth_reading(Link(0.01))
    assert est.alpha_hopeful("sd") == pytest.approx(0.5 + READ_HOPE_Z * math.sqrt(0.25 / 9))
    est.observe_agreement(24, 24)  # an easy prompt: its reads agree
    assert est.alpha == pytest.approx(28 / 32) and c.sd_within_reach(c.predictions(Link(0.01)))
    est, c = fresh()
    for _ in range(3):  # a hard one: a quarter of its tokens agree
        est.observe_agreement(2, 8)
    assert est.alpha_hopeful("sd") < 0.45 and not c.worth_reading(Link(0.01))
    est, c = fresh(draft_s=0.3)
    est.acceptance[("sd", GREEDY)] = Acceptance(accepted=1.0, examined=1.0, rounds=10**9)
    assert est.alpha_hopeful("sd") == 1.0 and not c.worth_reading(Link(0.01))


def test_a_census_request_reads_whatever_the_prices_and_its_reads_measure_the_prompts():
    """The prompts drafted on accepted 0.5, and a draft step so slow that sd is out of reach even at α = 1: no
    request reads, so prompts that have become easier (0.8) would never show it. A census request (drawn at random,
    EdgeConfig.auto_census) reads whatever the prices, and its reads move the prompts' acceptance, a read of n tokens
    weighing as n drafts in its ratio; reads of a request that is not one move only its own α. Nothing drafting
    eligible: nothing read. A census is not an opening's figure. A bad census share is refused, the field named."""
    from edge_runtime.acceptance import ALPHA_POPULATION
    from edge_runtime.config import EdgeConfig

    est = _estimates(0.5, 0.3, step_1=0.05, step_9=0.1)
    c = _controller(est)
    sd = est.acceptance[("sd", GREEDY)]
    _begin_past_opening(est)
    assert not est.census and not c.worth_reading(Link(0.01))
    est.observe_agreement(8, 8)  # read while the request was promising
    assert sd.population == pytest.approx(0.5) and est.alpha == pytest.approx((8 * 0.5 + 8) / 16)
    est.begin_request(census=True)
    est.opening = False
    assert est.census and c.worth_reading(Link(0.01))
    assert not _controller(est, eligible=("llm",)).worth_reading(Link(0.01))
    est.observe_agreement(6.4, 8)
    keep = ALPHA_POPULATION
    assert sd.population == pytest.approx((keep * 0.5 + (1 - keep) * 6.4) / (keep * 1.0 + (1 - keep) * 8))
    assert est.alpha == pytest.approx((8 * sd.population + 6.4) / 16, rel=0.01) and sd.opening_rounds == 0
    for _ in range(200):  # census after census on the easier prompts
        est.observe_agreement(6.4, 8)
    assert sd.population == pytest.approx(0.8, abs=0.005)
    est.begin_request()  # a request that is not one: its reads its own
    est.observe_agreement(0, 8)
    assert sd.population == pytest.approx(0.8, abs=0.005)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="auto_census must be in"):
            EdgeConfig(model="smollm2-135m", auto_census=bad)


def test_a_device_with_few_census_answers_draws_more_census_requests_until_its_pool_is_full(monkeypatch):
    """At temperature 0 the census's reads price the η-chain from the pool of its last CENSUS_KEPT answers: while
    that pool is not full a request is a census with the chance of the pool's empty share, when that is above the
    configured share; a full pool, or a request sampled above temperature 0, draws at the share itself; 0 turns the
    census off whatever the pool. An empty census answer does not count. The runtime draws at that chance."""
    from edge_runtime.auto_estimates import CENSUS_KEPT, AutoEstimates
    from edge_runtime.config import EdgeConfig
    from edge_runtime.runtime import EdgeRuntime

    est = AutoEstimates()
    assert est.census_chance(GREEDY, 0.25) == 1.0 and est.census_chance(GREEDY, 0.0) == 0.0
    assert est.census_chance("T=1", 0.25) == 0.25
    est.census_marks = [((i, True, 0.9),) for i in range(8)] + [()]
    assert est.census_chance(GREEDY, 0.25) == pytest.approx(1 - 8 / CENSUS_KEPT)
    assert est.census_chance(GREEDY, 0.9) == pytest.approx(0.9)
    est.census_marks = [((i, True, 0.9),) for i in range(CENSUS_KEPT * 7 // 8)]
    assert est.census_chance(GREEDY, 0.25) == pytest.approx(0.25) and est.census_chance(GREEDY, 0.0) == 0.0
    est.census_marks = [((i, True, 0.9),) for i in range(CENSUS_KEPT)]
    assert est.census_chance(GREEDY, 0.1) == pytest.approx(0.1) and est.census_chance("T=0.7", 0.1) == 0.1

    class Draws:
        def __init__(self, x):
            self.x = x

        def random(self):
            return self.x

    monkeypatch.undo()  # the runtime's own draw (tests/conftest.py holds it off)
    rt = EdgeRuntime.__new__(EdgeRuntime)
    rt.config = EdgeConfig(model="smollm2-135m", auto_census=0.25)
    rt.auto_estimates = AutoEstimates(census_marks=[((i, True, 0.9),) for i in range(16)])
    for x, greedy, sampled in ((0.2, True, True), (0.3, True, False), (0.49, True, False), (0.51, False, False)):
        rt._census_draws = Draws(x)
        assert rt._census(GREEDY) is greedy and rt._census("T=1") is sampled


def test_a_census_reads_in_the_last_round_what_fits_in_it():
    """In the llm round that ends the request nothing will draft, so only a census reads then (its reads measure the
    prompts), and only what its priced catch-up reads within the round's predicted time: the request's end waits for
    the forward in progress. Nothing to read, no tokens in flight, nothing drafting eligible: no read."""
    est = _estimates(0.5, 0.3, step_1=0.05, step_9=0.1)
    est.observe_catch_up(8, 0.2)
    est.observe_catch_up(32, 0.5)
    c = _controller(est)
    _begin_past_opening(est)
    link = Link(0.01)
    llm = c.predictions(link)["llm"]
    fits = next(n for n in range(64, 0, -1) if est.catch_up_cost(n) <= 8 / llm.tokens_per_s)
    assert 1 < fits < 64 and est.catch_up_cost(fits + 1) > 8 / llm.tokens_per_s  # the measured forwards priced
    assert not c.census_reads_to_the_end(link, None, fits, 8)  # not a census: its reads would move its own α only
    est.begin_request(census=True)
    est.opening = False
    assert c.census_reads_to_the_end(link, None, fits, 8)
    assert not c.census_reads_to_the_end(link, None, fits + 1, 8)  # would hold the request's end
    assert c.census_reads_to_the_end(link, None, fits + 1, 16)  # a longer round holds it
    assert not c.census_reads_to_the_end(link, None, 0, 8) and not c.census_reads_to_the_end(link, None, 4, 0)
    assert not _controller(est, eligible=("llm",)).census_reads_to_the_end(link, None, 4, 8)


def test_a_drafting_protocol_out_of_reach_is_neither_probed_nor_its_tree_measured():
    """sd predicted below READ_AHEAD_REACH of llm (a slow draft step): a probe could switch only were the model more
    than 25 % off, so after PROBE_EVERY rounds llm keeps running, and the configured tree, out of reach even were
    every round to commit its depth + 1, is not measured (each cost 7-15 % of a 32-token request on loopback where
    only llm ran); once the estimates bring sd within reach, the tree is measured and sd probed."""
    from edge_runtime.auto import READ_AHEAD_REACH

    for trees in ((), ((8, 8, 1),)):
        est = _estimates(0.1, 0.3, step_1=0.2, step_9=0.24)
        c = _controller(est, trees=trees)
        preds = c.predictions(Link(0.01))
        assert preds["sd"].tokens_per_s < READ_AHEAD_REACH * preds["llm"].tokens_per_s, preds
        for _ in range(PROBE_EVERY + 4):
            choice = c.decide(Link(0.01), behind=1)
            assert choice.protocol == "llm" and choice.reason.startswith("predicted"), choice
            c.record(choice, 8)
        assert est.idle["sd"] > PROBE_EVERY and est.tree_rounds_of((8, 8, 1)) == 0
        assert not c.sd_within_reach(c.predictions(Link(0.01)))
        est.draft_step_s = 0.05  # the draft step measured faster (a new power mode): sd at 0.84× llm, within reach
        assert c.sd_within_reach(c.predictions(Link(0.01)))
        turn = c.decide(Link(0.01), behind=1)
        assert turn.protocol == "sd", turn
        if trees:  # the tree is measured first (a round of sd's, which probes sd too)
            assert turn.tree == (8, 8, 1) and turn.reason == "measuring sd's tree 8x8x1: 0 of 3 rounds", turn
        else:
            assert turn.tree is None and turn.reason == "probing sd: not run for 24 rounds", turn


def test_a_knob_or_tree_running_is_kept_unless_another_promises_a_clear_gain():
    """sd's chains of γ and its draft trees are one protocol, yet a switch among them needs SWITCH_GAIN too: running
    γ within 1.10× of the best γ, it is kept (and said so); one clearly behind gives way; a tree running is kept
    against a chain within 1.10×; a measuring round binds nothing."""

    est = _estimates(0.8, 0.02, step_1=0.2, step_9=0.26)
    c = _controller(est)
    chains = {p.knob: p.tokens_per_s for _, p in c._candidates(Link(0.01), est.curve())["sd"]}
    best = max(chains, key=chains.get)
    close = next(k for k in sorted(chains, key=lambda k: abs(k - best)) if k != best
                 and chains[best] < SWITCH_GAIN * chains[k])
    far = min(chains, key=chains.get)
    assert chains[best] > SWITCH_GAIN * chains[far], chains
    assert c.decide(Link(0.01)).knob == best
    c.record(Choice("sd", close, "predicted", {}), 3)
    kept = c.decide(Link(0.01))
    assert (kept.protocol, kept.knob, kept.tree) == ("sd", close, None), kept
    assert kept.reason.endswith(f"sd γ={close} kept: sd γ={best} is within 1.10× of it"), kept.reason
    c.record(Choice("sd", far, "predicted", {}), 3)
    assert c.decide(Link(0.01)).knob == best  # a clear gain: the switch
    c.record(Choice("sd", close, "measuring sd: 2 of 3 rounds", {}), 3)
    assert c.decide(Link(0.01)).knob == best  # measuring: nothing to keep
    shape = (8, 8, 1)  # a tree (a chain of 8 here) running, the chains a little ahead of it: kept
    tree = _controller(est, trees=(shape,))
    for tokens in (4, 4, 5):
        est.observe_tree(shape, tokens, 8 * 0.02, 0.26, 80 + 8 * 6, 100, 8 * 0.02 + 0.26 + 0.01 + 0.002, Link(0.01),
                         now=0.0)
        tree.record(Choice("sd", 8, "measuring", {}, shape), tokens)
    # its drafts moved the request's α, and the chains' prices with it
    chains = {p.knob: p.tokens_per_s for _, p in tree._candidates(Link(0.01), est.curve())["sd"] if p.protocol == "sd"}
    best = max(chains, key=chains.get)
    priced = tree.at_tree(shape, Link(0.01))
    assert chains[best] < SWITCH_GAIN * priced.tokens_per_s < SWITCH_GAIN * chains[best], (priced, chains)
    tree.record(Choice("sd", 8, "predicted", {}, shape), 4)
    held = tree.decide(Link(0.01))
    assert held.tree == shape and f"kept: sd γ={best} is within 1.10× of it" in held.reason, held


def test_a_probe_of_llm_decodes_one_token_and_only_within_reach():
    """sd ahead, llm within reach (0.87× sd): after PROBE_EVERY rounds without llm, llm runs one round of a single
    token (its overhead and a step are what a probe measures; a chunk would commit c tokens at the slower rate), then
    sd again. llm out of reach (0.32× sd) is not probed, as a drafting protocol out of reach is not: under load llm at
    0.67× the η-tree was probed in 6 of 16 requests, a round each (the load phases on `e217aad`)."""
    c = _controller(_estimates(0.5, 0.05, step_1=0.2, step_9=0.22))
    for _ in range(PROBE_EVERY):
        choice = c.decide(Link(0.01))
        assert choice.protocol == "sd", choice
        c.record(choice, 2)
    preds = c.predictions(Link(0.01))
    assert 0.8 < preds["llm"].tokens_per_s / preds["sd"].tokens_per_s < 0.9
    probe = c.decide(Link(0.01))
    assert (probe.protocol, probe.knob) == ("llm", 1) and probe.reason.startswith("probing llm (one token)"), probe
    c.record(probe, 1)
    assert c.decide(Link(0.01)).protocol == "sd"
    far = _controller(_estimates(0.9, 0.02, step_1=0.2, step_9=0.22))
    for _ in range(3 * PROBE_EVERY):
        choice = far.decide(Link(0.01))
        assert choice.protocol == "sd", choice
        far.record(choice, 5)
    assert far.estimates.idle.get("llm", 0) >= PROBE_EVERY


def test_a_switch_to_sd_repays_the_draft_catching_up():
    """sd well ahead, but the draft model has 200 tokens to read first: worth it for a long remainder, not for a
    short one; the cost is the measured catch-up rate (a draft step per token before one is measured)."""
    est = _estimates(0.9, 0.02, step_1=0.2, step_9=0.22)
    c = _controller(est)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    preds = c.predictions(Link(0.01))
    saved_per_token = 1 / preds["llm"].tokens_per_s - 1 / preds["sd"].tokens_per_s
    assert est.catch_up_cost(200) == pytest.approx(200 * 0.02)
    est.observe_catch_up(200, 1.0)  # 5 ms a token
    assert est.catch_up_cost(200) == pytest.approx(1.0)
    short = int(0.5 / saved_per_token)  # saves 0.5 s < 1.0 s
    assert c.decide(Link(0.01), behind=200, remaining=short).protocol == "llm"
    long_ = int(2.0 / saved_per_token)
    assert c.decide(Link(0.01), behind=200, remaining=long_).protocol == "sd"
    assert c.decide(Link(0.01), behind=0, remaining=short).protocol == "sd"
    # one token behind (the last draft of a round wholly accepted) is no catch-up, and a few tokens are priced on the
    # line from one draft step to the measured 200-token forward, not as that forward (seen in a trace: "sd would
    # first read 1 tokens (0.57 s)", then llm)
    assert c.decide(Link(0.01), behind=1, remaining=short).protocol == "sd"
    assert est.catch_up_cost(2) == pytest.approx(0.02 + 0.98 / 199)
    assert c.decide(Link(0.01), behind=2, remaining=short).protocol == "sd"
    assert c.decide(Link(0.01), behind=150, remaining=short).protocol == "llm"  # 0.75 s to read, 0.5 s saved
    est.draft_step_s = 2.0  # a step slower than the whole measured forward anchors nothing: flat below it
    assert est.catch_up_cost(2) == pytest.approx(1.0)


def test_a_catch_up_is_priced_as_one_forward_of_its_size():
    """Reading n tokens is one forward: priced from the forwards measured, by size (a rate per token taken from
    1-token reads would price 60 tokens at 60 of them); the read while waiting takes the most that fits its budget."""
    est = _estimates(0.9, 0.02, step_1=0.2, step_9=0.22)
    assert est.catch_up_cost(0) == 0.0 and est.catch_up_cost(2) == pytest.approx(0.04)  # a draft step per token
    est.observe_catch_up(1, 0.02)
    assert est.catch_up_cost(60) == pytest.approx(60 * 0.02)  # one size known: proportional
    est.observe_catch_up(64, 0.2)
    assert est.catch_up_cost(60) == pytest.approx(0.02 + 59 * 0.18 / 63)
    est.observe_catch_up(8, float("nan"))  # a broken timing is not kept
    assert est.catch_up.points() == ((1.0, 0.02), (64.0, 0.2))
    c = _controller(est)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    preds = c.predictions(Link(0.01))
    remaining = int(0.6 / (1 / preds["llm"].tokens_per_s - 1 / preds["sd"].tokens_per_s))  # saves 0.6 s
    assert c.decide(Link(0.01), behind=62, remaining=remaining).protocol == "sd"  # one forward: 0.19 s
    est.catch_up = type(est.catch_up)()
    est.observe_catch_up(1, 0.02)  # 62 reads of one token: 1.24 s, not repaid
    assert c.decide(Link(0.01), behind=62, remaining=remaining).protocol == "llm"


def test_an_uplink_rate_prices_only_the_link_it_was_measured_on():
    """The uplink rate is measured only by large uploads (none at T = 0 or under llm); the round trip by every small
    exchange. A round trip that moved by more than LINK_CHANGE_RATIO (and LINK_CHANGE_S) says the link is another:
    the old rate is not used (0: the uplink taken as free, so the next drafting round measures it), and it is again
    once the round trip is back."""
    from edge_runtime.auto_estimates import LINK_CHANGE_RATIO, LINK_CHANGE_S

    est = AutoEstimates()
    assert est.uplink_at(0.05) == 0.0  # nothing measured
    est.take_uplink(5e6, 0.050)  # LTE: 5 Mbit/s at 50 ms
    assert est.uplink_at(0.050) == est.uplink_at(0.062) == est.uplink_at(0.030) == 5e6  # LTE's jitter: the same link
    assert est.uplink_at(0.0004) == 0.0  # loopback now: LTE's rate would price sd's rows at 5 Mbit/s
    assert est.uplink_at(0.050 * LINK_CHANGE_RATIO * 1.1) == 0.0  # a slower link than the one measured
    assert est.uplink_at(0.050) == 5e6  # back on LTE: the reading holds again
    est.take_uplink(8e8, 0.0004)  # loopback
    assert est.uplink_at(0.0004 + 0.9 * LINK_CHANGE_S) == 8e8  # within the clock's and the scheduler's noise
    assert est.uplink_at(0.004) == 0.0  # WiFi's 4 ms: another link


def test_ksqs_runs_where_sds_dense_rows_cost_the_uplink():
    """A sampling request may run ksqs (exact; its drafts' rows as lattice codes). Acceptance and a row's bytes are
    kept per kind of sampling (a greedy row is one-hot, a sampled one dense): sd is measured again for a sampling
    request, then ksqs, whose acceptance is sd's until its own rounds say otherwise; over a slow uplink ksqs wins
    where sd's dense rows (2 V bytes) cost more than its quantization loses, over a free link sd does; at
    temperature 0 ksqs is not a candidate; a greedy request finds its own figures again."""
    from edge_runtime.acceptance import ALPHA_PRIOR_DRAFTS
    from edge_runtime.auto_estimates import RATIO_PRIOR_ROUNDS, sampling_kind
    from edge_runtime.runtime import auto_eligible
    from hat_split.math.sampling import SamplingParams

    offered = ("sd", "hlm", "llm", "qs", "ksqs", "slm")
    assert auto_eligible(offered, SamplingParams(0.0)) == ["sd", "llm"]
    assert auto_eligible(offered, SamplingParams(0.7)) == ["sd", "ksqs", "llm"]
    assert auto_eligible(("sd", "llm"), SamplingParams(1.0)) == ["sd", "llm"]  # a cloud that does not offer it
    assert sampling_kind(SamplingParams(0.0, 40)) == GREEDY
    assert sampling_kind(SamplingParams(0.7, 40, 0.9)) == "T=0.7 top-k=40 top-p=0.9"
    est = _estimates(0.8, 0.02, step_1=0.2, step_9=0.24)  # greedy figures: sd's rows 60 bytes
    est.begin_request("T=1")
    c = _controller(est, eligible=("sd", "ksqs", "llm"))
    lte = Link(0.03, 5e6, 20e6)
    first = c.decide(lte)
    assert first.protocol == "sd" and first.reason == "measuring sd (T=1): 0 of 3 rounds", first
    dense = 4 + 2 * 49152
    for _ in range(3):  # sd's sampled rounds: 3 of 4 drafts accepted, dense rows
        est.observe_sd(4, 3, 0.08, 0.24, 80 + 4 * dense, 100, 0.9, lte, now=1.0)
    assert est.alpha == pytest.approx(0.75) and est.up_per_draft() == pytest.approx(dense)
    second = c.decide(lte)
    assert second.protocol == "ksqs" and second.reason.startswith("measuring ksqs (T=1)"), second
    assert est.alpha_of("ksqs") == est.alpha  # sd's until ksqs drafted
    for _ in range(3):  # its rounds: 1 of 4 drafts accepted, 60 bytes a row
        est.observe_sd(4, 1, 0.08, 0.24, 80 + 4 * 60, 100, 0.4, lte, now=1.0, protocol="ksqs")
    pop_sd, pop_ksqs = _pulled(0.75, 3), _pulled(0.5, 3)  # each protocol's rounds: 3 of 4 examined, 1 of 2
    rho = (3 * (pop_ksqs / pop_sd) + RATIO_PRIOR_ROUNDS) / (3 + RATIO_PRIOR_ROUNDS)  # ksqs over sd, shrunk toward 1
    prior = (3 * pop_sd + 3 * pop_ksqs / rho) / 6  # the prompts' on sd's scale, both protocols' rounds
    sd_alpha = (ALPHA_PRIOR_DRAFTS * prior + 9 + 3 / rho) / (ALPHA_PRIOR_DRAFTS + 12 + 6)  # with this prompt's
    assert est.alpha == pytest.approx(sd_alpha) and est.alpha_of("ksqs") == pytest.approx(sd_alpha * rho)
    assert est.up_per_draft("ksqs") == pytest.approx(60.0)
    slow_uplink = c.decide(lte)
    assert slow_uplink.protocol == "ksqs" and "ksqs γ=" in slow_uplink.reason, slow_uplink
    free_link = _controller(est, eligible=("sd", "ksqs", "llm")).decide(Link(0.001))
    assert free_link.protocol == "sd", free_link  # the same rows cost nothing: sd's higher acceptance wins
    est.begin_request(GREEDY)  # a greedy request's opening: the greedy prompts' α at OPENING_RATIO (no opening read)
    assert est.alpha == pytest.approx(OPENING_RATIO * 0.8) and est.up_per_draft() == 60.0
    assert est.up_per_draft("ksqs") is None


def test_the_drafting_protocols_share_what_they_learn_of_a_prompt():
    """sd and ksqs draft with the same model on the same prompt: a few ksqs rounds on easy prompts (all accepted) do
    not make ksqs's acceptance 1.00 beside sd's long-measured 0.9 (their ratio is shrunk toward 1 and at most 1),
    and a hard prompt's sd rounds lower ksqs's acceptance too, before ksqs drafts on it."""
    from edge_runtime.acceptance import ALPHA_PRIOR_DRAFTS

    est = AutoEstimates()
    for _ in range(40):  # sd over many prompts: 9 of 10 examined accepted
        est.observe_sd(9, 9, 0.08, 0.2, 300, 100, 0.4, Link(), now=1.0)
        est.observe_sd(1, 0, 0.08, 0.2, 300, 100, 0.4, Link(), now=1.0)
    for _ in range(5):  # ksqs on two easy prompts: 26 of 26
        est.observe_sd(5, 5, 0.08, 0.2, 300, 100, 0.4, Link(), now=1.0, protocol="ksqs")
    _begin_past_opening(est)
    sd, ksqs = est.alpha_of("sd"), est.alpha_of("ksqs")
    assert 0.88 < ksqs <= sd < 0.95, (sd, ksqs)  # the prompts', not 1.00
    for _ in range(3):  # a hard prompt, under sd: 1 of 2 examined
        est.observe_sd(4, 1, 0.08, 0.2, 300, 100, 0.4, Link(), now=2.0)
    assert est.alpha_of("ksqs") < 0.8 and est.alpha_of("ksqs") <= est.alpha_of("sd")
    _begin_past_opening(est)
    assert est.alpha_of("ksqs") > 0.85  # the next prompt starts from the prompts' prior again
    bad = AutoEstimates()  # degenerate: only ksqs ran, every draft rejected; bounded, never NaN
    for _ in range(4):
        bad.observe_sd(4, 0, 0.08, 0.2, 300, 100, 0.4, Link(), now=1.0, protocol="ksqs")
    assert bad.alpha_of("sd") == bad.alpha_of("ksqs") == pytest.approx(  # the prompts' (pulled) moved by these 0 of 4
        ALPHA_PRIOR_DRAFTS * _pulled(0.0, 4) / (ALPHA_PRIOR_DRAFTS + 4))
    assert AutoEstimates().alpha_of("ksqs") is None


def test_each_prompt_has_its_own_acceptance_with_the_recent_prompts_as_prior():
    """α for a request: the recent prompts' acceptance (a slow moving average) as a prior worth ALPHA_PRIOR_DRAFTS
    drafts, moved by the request's own drafts; a new request starts from the prior again, not from the last prompt's
    end (prompts' α differ: a prompt of α 0.5 after prompts of α 1 says little of the next)."""
    from edge_runtime.acceptance import ALPHA_PRIOR_DRAFTS

    est = AutoEstimates()
    assert est.alpha is None
    for _ in range(12):  # easy prompts: every draft accepted
        est.observe_sd(4, 4, 0.08, 0.2, 300, 100, 0.4, Link(), now=1.0)
    _begin_past_opening(est)
    assert est.alpha == pytest.approx(_pulled(1.0, 12))  # 0.94: twelve rounds read 1.00, ALPHA_BASE pulls
    for _ in range(3):  # a hard prompt: 1 of 4 accepted, 2 examined per round
        est.observe_sd(4, 1, 0.08, 0.2, 300, 100, 0.4, Link(), now=2.0)
    sd = est.acceptance[("sd", GREEDY)]
    prior = _pulled(sd.accepted / sd.examined, 15)
    assert 0.8 < prior < _pulled(1.0, 12)  # the prompts' average moved a little
    assert est.alpha == pytest.approx((ALPHA_PRIOR_DRAFTS * prior + 3) / (ALPHA_PRIOR_DRAFTS + 6))  # this prompt's
    assert est.alpha < 0.8
    _begin_past_opening(est)  # the next prompt starts from the prompts' prior, not the hard one's
    assert est.alpha == pytest.approx(prior)

def test_a_requests_first_round_is_priced_at_the_openings_acceptance():
    """A request's first round drafts the answer's first tokens, which these prompts accept less (0.67 against 0.79 on
    the Qwen pair): until it commits, the request's α is the openings' — OPENING_RATIO times the prompts' before any
    opening is read, moved by the openings read (plain means, then moving averages, as the prompts'), worth
    ALPHA_BASE_ROUNDS against them — and a tree's tokens a round its own first rounds'. Only a request's first round
    is an opening; llm's ends it as well (what sd drafts after it is not the answer's first tokens)."""
    from edge_runtime.acceptance import ALPHA_BASE_ROUNDS

    est = _estimates(0.8, 0.02, step_1=0.2, step_9=0.22)
    sd = est.acceptance[("sd", GREEDY)]
    assert not est.opening and est.alpha == pytest.approx(0.8)  # no request begun: the prompts'
    est.begin_request()
    assert est.opening and sd.opening == pytest.approx(OPENING_RATIO * 0.8)
    assert est.alpha == pytest.approx(OPENING_RATIO * 0.8)
    est.observe_sd(4, 0, 0.08, 0.22, 300, 100, 0.4, Link(), now=1.0)  # the opening: its first draft rejected
    assert not est.opening and (sd.opening_rounds, sd.opening_accepted, sd.opening_examined) == (1, 0.0, 1.0)
    est.observe_sd(4, 4, 0.08, 0.22, 300, 100, 0.4, Link(), now=1.0)  # a later round: no opening
    assert sd.opening_rounds == 1
    est.begin_request()
    est.observe_sd(4, 2, 0.08, 0.22, 300, 100, 0.4, Link(), now=2.0)  # the next request's opening: 2 of 3
    est.begin_request()
    want = (2 * (2 / 4) + ALPHA_BASE_ROUNDS * OPENING_RATIO * sd.population) / (2 + ALPHA_BASE_ROUNDS)
    assert sd.opening == pytest.approx(want) and est.alpha == pytest.approx(want)  # read: 2 of 4 examined
    est.observe_llm(1, 0.2, 80, 100, 0.25, Link(), now=3.0)  # llm opens: what sd drafts next is not an opening
    assert not est.opening
    est.observe_sd(4, 4, 0.08, 0.22, 300, 100, 0.4, Link(), now=3.0)
    assert sd.opening_rounds == 2
    shape = (16, 8, 2)  # a wide tree's tokens a round: its first rounds' at an opening, pulled toward its rounds'
    for tokens in (6, 6, 6):
        est.observe_tree(shape, tokens, 0.1, 0.2, 200, 100, 0.4, Link(), now=4.0, sent=12)
    est.begin_request()
    est.observe_tree(shape, 2, 0.03, 0.2, 100, 100, 0.3, Link(), now=5.0, sent=4)  # its opening: 2
    assert est.tree_opening[(shape, GREEDY)] == (2.0, 1)
    _begin_past_opening(est)
    later = est.tree_tokens_per_round(shape)
    est.begin_request()
    pulled = _pulled_tree(est, shape)  # at the opening's α
    want = (2.0 + ALPHA_BASE_ROUNDS * pulled) / (1 + ALPHA_BASE_ROUNDS)
    assert est.tree_tokens_per_round(shape) == pytest.approx(want)
    assert est.tree_tokens_per_round(shape) < later
    eta = (8, 8, 1)  # the η-chain's: its chain's at the opening's α (times its ratio, none measured: 1)
    opening = est.tree_tokens_per_round(eta)
    assert opening == pytest.approx(_chain(est, 8))
    _begin_past_opening(est)
    assert est.tree_tokens_per_round(eta) == pytest.approx(_chain(est, 8))
    assert est.tree_tokens_per_round(eta) > opening


def _eta_chain_rounds(est: AutoEstimates, tokens_a_round, draft_s: float, link: Link) -> None:
    """Earlier requests' rounds of the η-chain 8x8x1 on a loaded cloud (a verify of 0.5 s): 20 requests, each an
    opening and a later round that commit the same, cycling through `tokens_a_round` (an η-ended chain's first rounds
    commit as much as its others here); each round sends a draft beyond what it commits (the first rejected), at
    `draft_s` a draft."""
    for i in range(20):
        tokens = tokens_a_round[i % len(tokens_a_round)]
        for begin in (est.begin_request, lambda: _begin_past_opening(est)):
            begin()
            est.observe_tree((8, 8, 1), tokens, (tokens + 1) * draft_s, 0.5, 80 + (tokens + 1) * 6, 100,
                             (tokens + 1) * draft_s + 0.51, link, now=0.0, sent=tokens + 1, accepted=tokens - 1)


def test_under_load_a_request_opens_on_the_eta_chain_where_chains_run_later():
    """A loaded cloud (a step of 0.45-0.5 s whatever its positions), the prompts' α 0.8, an η-chain measured at 3.0
    tokens a round (2.8 before chains were priced over the prompts' spread of α, `AutoEstimates.chain_tokens`): past
    the opening a chain of 8 is sd's best, but a request's first round, at the openings' α,
    opens on the η-chain, which drafts in proportion to what it commits (under load a chain of 8 opened four
    requests of eight, drafted eight and committed one; a fixed chain of 8's first token came 0.19-0.97 s after the
    η-chain row's). On the code before, the opening ran the chain of 7 too."""
    shape, link = (8, 8, 1), Link(0.01)
    est = _estimates(0.8, 0.02, step_1=0.45, step_9=0.5)
    _eta_chain_rounds(est, (2, 3, 5, 3, 2), 0.02, link)  # 3.0 tokens a round
    c = _controller(est, eta=0.4)
    est.begin_request()
    opening = c.decide(link)
    assert (opening.protocol, opening.tree) == ("sd", shape) and "α 0.68" in opening.reason, opening
    assert opening.reason.startswith("opening: predicted"), opening.reason
    _begin_past_opening(est)
    later = c.decide(link)
    assert (later.protocol, later.tree) == ("sd", None) and later.knob >= 6 and "α 0.80" in later.reason, later


def test_an_opening_is_priced_over_llms_chunk_not_a_round_each(monkeypatch):
    """A loaded cloud (a step of 0.9-1.0 s, a draft round 0.8 s of waiting beyond its parts), the openings' α 0.50 and
    the prompts' 0.70 (as in the AVX2 trace's record: 0.50 and 0.69): a round each, llm's chunk of 8 is priced above
    sd's best first round, yet it binds 8 tokens at llm's pace where sd's round binds 2-3 and the rounds after it run
    at the request's α. Over one stretch of 8 tokens (the round, then the best pace after it:
    costmodel.over_horizon) the opening runs sd; a round each (the code before) it runs llm, as 5 of 10 loaded
    requests did in that trace, their first chunk 14-17 s into the request."""
    from hat_split.math.costmodel import over_horizon

    link = Link(0.01)
    est = _estimates(0.7, 0.05, step_1=0.9, step_9=1.0)
    est.overhead_s["sd"] = 0.8
    sd = est.acceptance[("sd", GREEDY)]
    sd.opening_accepted, sd.opening_examined, sd.opening_rounds = 0.5, 1.0, 10**9
    c = _controller(est)
    est.begin_request()
    rounds = c._rounds(link, est.curve())
    each = {name: max(p.tokens_per_s for _, p in preds) for name, preds in rounds.items()}
    assert each["llm"] > each["sd"], each  # a round each: llm's chunk ahead
    with monkeypatch.context() as m:
        m.setattr(AutoController, "_stretch", lambda *a: None)  # a round each, as before
        assert c.decide(link).protocol == "llm"
    _begin_past_opening(est)
    pace = max(p.tokens_per_s for p in c.predictions(link).values())
    est.begin_request()
    opening = c.decide(link)
    assert opening.protocol == "sd" and opening.reason.startswith("opening: predicted"), opening
    assert f"over its first 8 tokens, then {pace:.2f} tok/s" in opening.reason, opening.reason
    llm = rounds["llm"][0][1]
    first = next(p for _, p in rounds["sd"] if p.knob == opening.knob)
    by_hand = 8 / (first.round_s + (8 - first.tokens_per_round) / pace)
    assert over_horizon(first, 8, pace).tokens_per_s == pytest.approx(by_hand)
    assert by_hand > llm.tokens_per_s and over_horizon(llm, 8, pace).tokens_per_s == llm.tokens_per_s


def test_the_eta_chain_is_priced_at_its_chains_expectation_at_the_requests_alpha():
    """A chain-shaped tree (the η-chain) commits about a fixed share of its chain's expectation at the prompt's α (the
    Qwen pair: 0.84 ± 0.08 over 56 requests whose tokens a round went from 2.1 to 8): it is priced at that share, its
    rounds' tokens over the expectation at the α each was priced at (non-opening rounds; openings apart), pulled
    toward 1 as ALPHA_BASE_ROUNDS rounds, times its chain's expectation at the request's α now. A one-token round
    moves it exactly as it moves the chains, through α. At low power under load (a draft step of 0.12 s, a verify of
    1.1 s) a request whose η-chain opening commits one token stays on the η-chain; on the code before, its tokens a
    round fell by a third at once (two rounds' prior against one) and a chain of 5 took over (the load+power phase,
    0.91-0.92× the η-chain's row in stop 80's traces)."""
    from edge_runtime.acceptance import ALPHA_BASE_ROUNDS

    shape, link = (8, 8, 1), Link(0.004)
    est = _estimates(0.8, 0.12, step_1=1.0, step_9=1.1)
    prompts = expected_tokens_beta(8 * 0.8, 8 * 0.2, 8)  # the chain's over the prompts' α 0.8 worth 8 drafts
    assert est.tree_tokens_per_round(shape) == pytest.approx(prompts)  # none measured: the chain's
    _eta_chain_rounds(est, (4, 4, 4, 3, 4), 0.12, link)  # 3.8 tokens a round, each at the prompts' α 0.8 (3.6
    # before chains were priced over the prompts' spread of α: the plain chains then priced 14 % lower)
    ratio = (20 * 3.8 / prompts + ALPHA_BASE_ROUNDS) / (20 + ALPHA_BASE_ROUNDS)
    _begin_past_opening(est)
    assert est.tree_tokens_per_round(shape) == pytest.approx(ratio * prompts)
    c = _controller(est, eta=0.4)
    est.begin_request()
    opening = c.decide(link)
    assert opening.tree == shape and opening.reason.startswith("opening: predicted"), opening
    est.observe_tree(shape, 1, 0.12, 1.1, 86, 100, 1.25, link, now=0.0, sent=1, accepted=0)  # one token
    c.record(opening, 1)
    a = est.alpha
    assert a == pytest.approx((8 * 0.8 + 0) / (8 + 1))  # the prompts' α moved by 0 of 1 draft
    assert est.tree_tokens_per_round(shape) == pytest.approx(ratio * expected_tokens_beta(8 * 0.8, 8 * 0.2 + 1, 8))
    after = c.decide(link)
    assert (after.tree, after.eta) == (shape, 0.4) and after.reason.startswith("predicted sd_tree"), after


def test_the_openings_choice_binds_nothing_after_it():
    """The opening's choice is priced for the first round (the openings' α) and the next round chooses afresh at the
    request's α, with no SWITCH_GAIN to clear: in stop 80's trace a chain of 3 chosen at the openings of low-power
    requests under load was kept for whole requests where the η-chain, within 1.10× above it at the request's α, was
    the faster row. Here the other way round: the opening runs the η-chain, and the chain of 8 then 1.067× ahead
    takes over; on the code before, the η-chain was kept."""
    shape, link = (8, 8, 1), Link(0.01)
    est = _estimates(0.8, 0.03, step_1=0.45, step_9=0.5)  # a loaded cloud
    _eta_chain_rounds(est, (2, 4, 6, 4, 3), 0.03, link)  # 3.8 tokens a round (3.2 before chains were priced over
    # the prompts' spread of α)
    c = _controller(est, eta=0.4)
    est.begin_request()
    opening = c.decide(link)
    assert (opening.tree, opening.reason[:18]) == (shape, "opening: predicted"), opening
    c.record(opening, 1)
    est.opening = False  # its round committed (its figures aside)
    after = c.decide(link)
    best = max(c._candidates(link, est.curve())["sd"], key=lambda sp: sp[1].tokens_per_s)
    held = c.at_tree(shape, link)
    assert best[0] is None and best[1].tokens_per_s < SWITCH_GAIN * held.tokens_per_s, (best, held)
    assert (after.tree, after.knob) == (None, best[1].knob) and after.reason.startswith("predicted"), after
    assert "kept" not in after.reason, after


def test_one_easy_prompt_does_not_make_the_prompts_acceptance_certain(monkeypatch):
    """On a fresh runtime the first prompt's three measuring rounds, every draft accepted, read the prompts' α 1.00
    without ALPHA_BASE's pull, and the next prompt (of its own α) opened at γ 8 on a board where drafting costs (a
    bench run under load: its first round 1 s later than fixed sd's γ 4). With the pull it opens at a middle γ; the
    same estimates without it choose γ 8 (the test can fail)."""
    import edge_runtime.acceptance as acceptance
    import edge_runtime.auto_estimates as estimates

    monkeypatch.setattr(acceptance, "OPENING_RATIO", 1.0)  # the openings' own acceptance aside (tested on its own)

    def opening(base_rounds: float) -> Choice:
        for module in (acceptance, estimates):  # the prompts' α's pull, and a tree's toward its chain's
            monkeypatch.setattr(module, "ALPHA_BASE_ROUNDS", base_rounds)
        est = _estimates(0.5, 0.08, step_1=0.2, step_9=0.22)  # a slow draft step, a verify near a decode's cost
        est.acceptance[("sd", GREEDY)] = Acceptance()
        for _ in range(3):  # one easy prompt: 4 of 4 accepted
            est.acceptance[("sd", GREEDY)].observe(4, 4)
        est.begin_request()
        return _controller(est).decide(Link(0.01))

    pulled, certain = opening(estimates.ALPHA_BASE_ROUNDS), opening(0.0)
    assert certain.protocol == "sd" and certain.knob == 8 and "α 1.00" in certain.reason, certain
    assert pulled.protocol == "sd" and 3 <= pulled.knob <= 5 and "α 0.86" in pulled.reason, pulled


def test_the_first_rounds_are_averaged_not_the_first_one_kept():
    """A moving average that starts at its first observation keeps most of it for some twenty rounds: a first round
    of 0 accepted then 4 of 4 twice read α 0.17 (measured in a bench run). The first rounds are plain means."""
    from edge_runtime.acceptance import posterior

    a = Acceptance()
    for accepted in (0, 4, 4):
        a.observe(4, accepted)
    prompts = _pulled((8 / 3) / ((1 + 4 + 4) / 3), 3)  # 8 accepted of 9 examined, as a mean
    assert a.population == pytest.approx(prompts)
    assert a.alpha == pytest.approx(posterior(prompts, 8, 9))  # the request's own 8 of 9 move it
    for _ in range(200):
        a.observe(4, 0)
    a.begin()
    assert a.alpha < 0.05  # long after, a moving average (the old rounds forgotten)


def test_stale_points_and_a_changed_load_give_way_to_the_report():
    """The device's own points of the cloud's curve expire after STALE_S, or at once when the cloud's report says its
    queue changed state (busy <-> idle); a round whose draft first caught up on tokens it had not seen (sd after llm)
    does not count as draft steps, its catch-up is measured instead."""
    from edge_runtime.auto_estimates import STALE_S
    from hat_split.math.chunking import ALPHA, DRIFT_BOUND, DRIFT_TAU_S

    est = _estimates(0.2, 0.05, step_1=0.2, step_9=0.24)
    est.observed_at = {0: 0.0, 3: 0.0}
    est.reported = ((1.0, 0.05), (9.0, 0.06))  # the cloud now, unloaded
    assert est.curve(now=1.0).step_s(1) == pytest.approx(0.2)  # the device's own point, fresh
    assert est.curve(now=STALE_S + 1).step_s(1) == pytest.approx(0.05)  # expired: the report's
    before = est.draft_step_s
    est.observe_sd(4, 1, 2.0, 0.2, 300, 100, 2.5, Link(), now=STALE_S + 2, caught_up=40)
    assert est.draft_step_s == before and est.catch_up_cost(40) == pytest.approx(2.0 - 4 * before)
    stale = est.observed.g(1)  # the loaded stretch's point (moved by the speed since, like every point)
    price = est.curve(now=STALE_S + 3).step_s(1)  # the curve's at one position without it: the report's, moved
    assert price < 0.5 * stale
    est.observe_llm(8, 8 * 0.04, 90, 130, 0.4, Link(), now=STALE_S + 3)  # the probe after a loaded stretch: its
    moved = price * max(1 / DRIFT_BOUND, 0.04 / price) ** (1.0 - math.exp(-1.0 / DRIFT_TAU_S))  # point restarts
    assert est.curve(now=STALE_S + 3).step_s(1) == pytest.approx(ALPHA * moved + (1 - ALPHA) * 0.04)  # from the
    # curve's price (moved by the speed, bounded), the probe averaged in: not from the stale point
    busy = P.CloudCost([[1.0, 0.05], [9.0, 0.06]], batch_tokens=8.0, queued=3)
    assert est.take_report(P.CloudCost([[1.0, 0.05], [9.0, 0.06]])) and est.observed.points()  # idle, as before
    assert est.take_report(busy) and not est.observed.points()  # loaded now: its report prices until measured
    assert est.curve(now=STALE_S + 4).step_s(1) == pytest.approx(0.06)  # g(1 + 8): the others in the step
    idle_overhead = est.overhead("llm")
    est.observe_llm(8, 8 * 0.5, 90, 130, 4.5, Link(), now=STALE_S + 5)
    assert est.take_report(busy) and est.curve(now=STALE_S + 6).step_s(1) == pytest.approx(0.5)  # still busy: kept
    net, wait = est.overhead_s["llm:busy"], est.reported_wait_s  # the busy cloud's queueing, kept apart from the
    assert net + wait == pytest.approx(0.5)  # idle one's; over its first round pulled toward the idle one
    assert est.overhead("llm") == pytest.approx((net + OVERHEAD_PRIOR_ROUNDS * idle_overhead)
                                                / (1 + OVERHEAD_PRIOR_ROUNDS) + wait)
    assert est.take_report(P.CloudCost([[1.0, 0.05]])) and est.overhead("llm") == pytest.approx(idle_overhead)


def test_a_drift_seen_at_one_size_prices_every_size():
    """The cloud's speed drifts (its host's load): llm's chunks slowing 2x after a pause move the price of a verify
    step, which no round measured since, by as much (SpeedDrift: every point moves by (observed / predicted)^w, w =
    1 − exp(−Δt / τ)), so the protocol that stopped running is not left at its old pace. Right after another step the
    move is a small share (the steps' noise). Kept per size alone (τ huge: no move), the verify keeps its old
    price while llm's rises."""
    from hat_split.math.chunking import ALPHA, DRIFT_TAU_S, SpeedDrift

    def run(speed: SpeedDrift):
        est = _estimates(0.4, 0.03, step_1=0.1, step_9=0.3)
        est.reported = ((1.0, 0.1), (9.0, 0.3))  # the cloud's report at the opening: the same curve
        est.observed_at = {0: 0.0, 3: 0.0}
        est.speed = speed
        c = _controller(est)
        before = c.predictions(Link(0.01), now=1.0)
        assert before["llm"].tokens_per_s > SWITCH_GAIN * before["sd"].tokens_per_s  # llm clearly ahead
        est.observe_llm(8, 8 * 0.2, 90, 130, 1.7, Link(0.01), now=60.0)  # after a pause: 0.2 s a step
        return est, c

    est, c = run(SpeedDrift(at=0.0))
    w = 1.0 - math.exp(-60.0 / DRIFT_TAU_S)
    assert est.curve(now=60.0).step_s(9) == pytest.approx(0.3 * 2.0 ** w)  # the verify, by the same ratio
    moved = 0.1 * 2.0 ** w  # llm's own point, stale: restarted from the curve's price, moved, the chunk averaged in
    assert est.curve(now=60.0).step_s(1) == pytest.approx(ALPHA * moved + (1 - ALPHA) * 0.2)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    assert c.decide(Link(0.01), now=60.0).protocol == "llm"
    price = est.curve(now=61.0).step_s(1)
    est.observe_llm(8, 8 * 0.4, 90, 130, 3.3, Link(0.01), now=61.0)  # a second on: a small share of its 2x
    assert est.curve(now=61.0).step_s(9) == pytest.approx(0.3 * 2.0 ** w * (0.4 / price) ** (1.0 - math.exp(-0.1)))
    est, c = run(SpeedDrift(tau_s=1e12, at=0.0))  # per size alone: the verify keeps its old price
    assert est.curve(now=60.0).step_s(9) == pytest.approx(0.3)
    assert est.curve(now=60.0).step_s(1) == pytest.approx(ALPHA * 0.1 + (1 - ALPHA) * 0.2)


def test_one_slow_step_at_a_stale_size_moves_it_as_any_other():
    """A verify at the curve's pace, then three seconds on one llm chunk at twice its price, llm's point stale (not
    run for minutes): the point restarts from the curve's price at one position, moved by the chunk's small share of
    the speed, and the chunk is averaged in (20 %), so llm is kept. Taken alone — the point replaced by the chunk, as
    it once was — the same chunk priced llm twice as slow and handed the request to sd."""
    from hat_split.math.chunking import ALPHA, DRIFT_TAU_S, SpeedDrift

    est = _estimates(0.6, 0.03, step_1=0.1, step_9=0.3)
    est.reported = ((1.0, 0.1), (9.0, 0.3))
    est.observed_at = {0: 0.0, 3: 0.0}
    est.speed = SpeedDrift(at=0.0)
    c = _controller(est)
    est.observe_sd(8, 2, 8 * 0.03, 0.3, 300, 100, 0.6, Link(0.01), now=60.0)  # the verify: the curve's pace
    assert est.curve(now=60.0).step_s(9) == pytest.approx(0.3)
    est.observe_llm(8, 8 * 0.2, 90, 130, 1.7, Link(0.01), now=63.0)
    w = 1.0 - math.exp(-3.0 / DRIFT_TAU_S)
    assert est.curve(now=63.0).step_s(9) == pytest.approx(0.3 * 2.0 ** w)
    assert est.curve(now=63.0).step_s(1) == pytest.approx(ALPHA * 0.1 * 2.0 ** w + (1 - ALPHA) * 0.2)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    assert c.decide(Link(0.01), now=63.0).protocol == "llm"
    est.observed.restart(1, 0.2)  # the chunk alone
    assert c.decide(Link(0.01), now=63.0).protocol == "sd"


def test_the_speed_drift_is_weighed_by_time_and_bounded():
    """Hand-computed: the first step moves the curve all the way, the next by the share 1 − exp(−Δt / τ), a step
    that says nothing (zero, NaN, infinite) not at all, a stall at most DRIFT_BOUND; τ must be positive."""
    from hat_split.math.chunking import DRIFT_BOUND, SpeedDrift

    s = SpeedDrift(tau_s=10.0)
    assert s.move(0.1, 0.2, now=5.0) == pytest.approx(2.0)
    assert s.move(0.1, 0.2, now=15.0) == pytest.approx(2.0 ** (1.0 - math.exp(-1.0)))
    assert s.move(0.1, 0.05, now=15.0) == 1.0  # at the same instant: no time, no move
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        assert s.move(0.1, bad, now=30.0) == 1.0 and s.move(bad, 0.1, now=30.0) == 1.0
    assert s.move(0.1, 100.0, now=1e6) == pytest.approx(DRIFT_BOUND)
    assert s.move(0.1, 1e-9, now=2e6) == pytest.approx(1.0 / DRIFT_BOUND)
    assert s.move(0.1, 0.2, now=0.0) == 1.0  # a clock that went back: no time
    with pytest.raises(ValueError, match="tau_s"):
        SpeedDrift(tau_s=0.0)


def test_a_busy_clouds_report_starts_the_speeds_clock():
    """A busy cloud's report is its steps of the last moments: the first step after it, a second later and at 0.6 of
    the curve (a step of another batch's make-up), moves every point by 0.6^(1 − exp(−1 / τ)), not all the way. An
    idle cloud's report, or one taken without a time, leaves the clock where it was: that step moves the curve all
    the way (the share of the 101 s since the last step), as the first step after a pause does."""
    from hat_split.math.chunking import DRIFT_TAU_S, SpeedDrift

    curve = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]
    since_report, since_step = (1.0 - math.exp(-dt / DRIFT_TAU_S) for dt in (1.0, 101.0))
    for busy, now, share in ((True, 100.0, since_report), (False, 100.0, since_step), (True, None, since_step)):
        est = _estimates(0.8, 0.01, step_1=0.04, step_9=0.2)
        est.observed, est.speed = DelayModel(), SpeedDrift(at=0.0)  # the report alone; a step seen long ago
        report = P.CloudCost(curve, others=8, others_positions=8.0) if busy else P.CloudCost(curve)
        assert est.take_report(report, now=now) and est.cloud_busy == busy
        verify = est.curve(now=101.0).step_s(16)
        est.observe_llm(1, 0.6 * est.curve(now=101.0).step_s(1), 90, 30, 0.5, Link(0.01), now=101.0)
        assert est.curve(now=101.0).step_s(16) == pytest.approx(verify * 0.6 ** share), (busy, now)


def test_a_busy_clouds_report_prices_every_step_with_the_others_in_it():
    """No round of its own measured under the load yet: the cloud's report (8 other positions in its steps, work
    waiting) alone moves the choice from llm to sd: an llm round's 8 steps each carry the others, a verify once. (A
    wait of one g(μ) per round instead, the others left out, would keep llm: 15.1 against 8.8 tok/s here.)"""
    curve = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]  # a CPU cloud: 20 ms a position past the first
    est = _estimates(0.8, 0.01, step_1=0.04, step_9=0.2)
    est.observed = DelayModel()  # only the report prices the cloud
    assert est.take_report(P.CloudCost(curve))
    c = _controller(est)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    assert c.decide(Link(0.01)).protocol == "llm"  # idle: the cloud's decode step is cheap, its verify is not
    assert est.take_report(P.CloudCost(curve, batch_tokens=8.0, queued=3))
    g = est.curve()
    assert g.step_s(1) == pytest.approx(0.22) and g.step_s(8) == pytest.approx(0.36)  # g(x + 8)
    assert est.reported_wait_s == pytest.approx(0.5 * 0.20)
    busy = c.decide(Link(0.01))
    assert busy.protocol == "sd", busy
    assert est.take_report(P.CloudCost(curve)) and c.decide(Link(0.01)).protocol == "llm"  # the load is gone
    # other devices drafting between verifies, none queued at the instant of the report: busy all the same; their 8
    # positions per step priced, not μ (40 here: the asker's own prompt was the step before its session opened)
    assert est.take_report(P.CloudCost(curve, batch_tokens=40.0, others=8, others_positions=8.0)) and est.cloud_busy
    assert est.curve().step_s(1) == pytest.approx(0.22) and est.reported_wait_s == pytest.approx(0.5 * 0.20)
    assert c.decide(Link(0.01)).protocol == "sd"
    # once sd's round overhead is measured under the load, that overhead holds the wait (the cloud's compute counts
    # only the steps a request is in): wait_s adds nothing more for sd; llm, not measured busy, keeps the report's
    est.observe_sd(4, 4, 4 * 0.01, 0.36, 300, 100, 4 * 0.01 + 0.36 + 0.1, Link(0.01), now=1.0)
    g_before_5 = est.curve().step_s(5)
    assert est.wait_s("sd") == 0.0 and est.wait_s("llm") == pytest.approx(0.1)
    measured = c.at("sd", 4, Link(0.01))
    busy_overhead = est.overhead("sd")
    assert busy_overhead == pytest.approx(0.09)  # the round's 0.1 s beyond its parts, less the link's 0.01
    # the overhead measured under load is kept net of the wait reported then: a report of a lighter load (4 other
    # positions a step: half a step 0.5 * g(4) = 0.5 * 0.1086 s) shortens sd's next round by the change in that wait
    # at once, rather than after several rounds of moving averages measured under the heavier one
    assert est.take_report(P.CloudCost(curve, others=2, others_positions=4.0))
    lighter = c.at("sd", 4, Link(0.01))
    g = est.curve()
    assert est.reported_wait_s == pytest.approx(0.5 * (0.04 + 3 * 0.16 / 7))
    assert lighter.round_s == pytest.approx(measured.round_s - (0.1 - est.reported_wait_s)
                                            - g_before_5 + g.step_s(5))
    assert est.take_report(P.CloudCost(curve, batch_tokens=8.0, queued=3))  # the heavier load again
    assert c.at("sd", 4, Link(0.01)).round_s == pytest.approx(measured.round_s)
    est.overhead_s.pop("sd:busy")
    unmeasured = c.at("sd", 4, Link(0.01))  # the idle overhead and the report's wait
    assert unmeasured.round_s == pytest.approx(measured.round_s - busy_overhead + est.overhead("sd") + 0.1)


def test_a_busy_overhead_from_a_few_rounds_is_pulled_toward_the_idle_one():
    """A round under load measures how its request met the others' steps, a wide spread: one warm-up round made sd's
    busy overhead 0.57 s against an idle 0.03 s and priced sd 29–39 % slow for a whole trace, never run again to
    correct it. Over its first rounds the busy overhead (net of the reported wait) is pulled toward the idle one as
    if OVERHEAD_PRIOR_ROUNDS rounds had measured that, and is as measured once many have; a count unknown (a record
    written before counts were kept) or no idle overhead leaves it as measured; a new power mode starts it over, and
    a mode measured before comes back with its overheads' counts."""
    curve = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]
    est = _estimates(0.8, 0.01, step_1=0.04, step_9=0.2)
    est.observed = DelayModel()
    est.overhead_s["sd"] = 0.02  # idle, established
    assert est.take_report(P.CloudCost(curve, batch_tokens=40.0, others=8, others_positions=8.0))
    wait = est.reported_wait_s
    assert wait == pytest.approx(0.1)
    c = _controller(est)

    def slow_round(now: float) -> None:  # 0.6 s beyond its parts: 0.49 s net of the link's 10 ms and the wait
        est.observe_sd(4, 4, 4 * 0.01, 0.36, 300, 100, 4 * 0.01 + 0.36 + 0.6, Link(0.01), now=now)

    slow_round(1.0)
    assert est.overhead_s["sd:busy"] == pytest.approx(0.49) and est.overhead_rounds["sd:busy"] == 1
    assert est.overhead("sd") == pytest.approx((0.49 + OVERHEAD_PRIOR_ROUNDS * 0.02) / (1 + OVERHEAD_PRIOR_ROUNDS)
                                               + wait)
    one = c.at("sd", 8, Link(0.01))
    est.overhead_rounds.pop("sd:busy")  # as a record without counts has it: established
    assert est.overhead("sd") == pytest.approx(0.49 + wait)
    assert c.at("sd", 8, Link(0.01)).tokens_per_s < 0.75 * one.tokens_per_s
    est.overhead_rounds["sd:busy"] = 1
    for i in range(12):  # the same slow round again and again: the measurements win
        slow_round(2.0 + i)
    assert est.overhead_rounds["sd:busy"] == 13
    assert est.overhead("sd") == pytest.approx((13 * 0.49 + OVERHEAD_PRIOR_ROUNDS * 0.02) / 17 + wait)
    assert est.overhead("sd") > 0.8 * (0.49 + wait)
    est.overhead_s.pop("sd")  # no idle overhead to pull toward
    assert est.overhead("sd") == pytest.approx(0.49 + wait)
    est.overhead_s["sd"] = 0.02
    assert est.take_mode("MAXN") is False and est.take_mode("15W")  # another board: the next round starts it over
    slow_round(20.0)
    assert est.overhead_rounds["sd:busy"] == 1 and est.overhead_s["sd:busy"] == pytest.approx(0.49)
    assert est.take_mode("MAXN") and est.overhead_rounds["sd:busy"] == 13  # MAXN's comes back with its rounds ...
    assert est.take_mode("15W") and est.overhead_rounds["sd:busy"] == 1  # ... and 15W's with its one
    est.mode_rounds.clear()  # a record from before the counts: a mode's overheads come back established
    assert est.take_mode("MAXN") and "sd:busy" not in est.overhead_rounds


def test_a_busy_overhead_below_zero_comes_off_the_phase_wait_it_was_measured_against():
    """Busy rounds measured shorter than their parts and the waits priced (here every busy overhead was −0.03 to
    −0.20 s net of them): the overhead prices at 0 — a round overhead is not below 0 — and what is below comes off the
    phase wait (CloudCosts.wait_credit_s), so sd is priced at what its rounds took; idle, or at 0 or above, no
    credit; a tree without a busy overhead of its own takes sd's."""
    curve = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]
    est = _estimates(0.8, 0.01, step_1=0.04, step_9=0.2)
    est.observed = DelayModel()
    assert est.take_report(P.CloudCost(curve, batch_tokens=40.0, others=8, others_positions=8.0, duty=1.0))
    c = _controller(est)
    est.overhead_s["sd:busy"] = 0.0  # established (no count), net of the waits: the waits as priced
    before = c.at("sd", 4, Link(0.01))
    assert est.wait_credit("sd") == 0.0 and est.cloud(est.curve(), "sd").wait_credit_s == 0.0
    est.overhead_s["sd:busy"] = -0.06  # 60 ms less than that
    credit = 0.06 - est.reported_wait_s
    assert est.overhead("sd") == 0.0 and credit > 0.05
    assert est.wait_credit("sd") == pytest.approx(credit) and est.wait_credit("sd_tree 8x8x1") == pytest.approx(credit)
    assert est.cloud(est.curve(), "sd").wait_credit_s == pytest.approx(credit)
    assert c.at("sd", 4, Link(0.01)).round_s == pytest.approx(before.round_s - 0.06)  # the reported wait and the
    # credit: the 60 ms
    est.overhead_s["sd:busy"] = 0.05  # above 0: priced as the overhead, no credit
    assert est.wait_credit("sd") == 0.0
    est.overhead_s["sd:busy"] = -0.06
    assert est.take_report(P.CloudCost(curve))  # idle again: the idle overhead prices it
    assert est.wait_credit("sd") == 0.0


def test_the_draft_step_is_priced_as_measured_in_the_clouds_state():
    """Where the device shares a host with the cloud (here), a busy cloud slows the draft step (0.046-0.059 s against
    0.037-0.040 idle), and one figure carried it into the idle phases after the load. A step measured while the cloud
    reports itself busy prices busy rounds only; an idle cloud's rounds keep the idle one; a state with none measured
    takes the other's."""
    curve = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]
    est = _estimates(0.8, 0.04, step_1=0.04, step_9=0.2)
    assert est.take_report(P.CloudCost(curve, batch_tokens=40.0, others=8, others_positions=8.0, duty=1.0))
    assert est.draft_step() == 0.04  # busy, none measured busy yet: the idle one
    est.observe_sd(4, 4, 4 * 0.06, 0.22, 300, 100, 0.9, Link(0.01), now=1.0)
    assert est.draft_step_busy_s == pytest.approx(0.06) and est.draft_step_s == 0.04
    assert est.device(False, "sd").draft_step_s == pytest.approx(0.06)
    assert est.take_report(P.CloudCost(curve))  # idle again: the idle step
    assert est.draft_step() == 0.04 and est.device(False, "sd").draft_step_s == 0.04
    est.observe_sd(4, 4, 4 * 0.03, 0.22, 300, 100, 0.6, Link(0.01), now=2.0)
    assert est.draft_step_s == pytest.approx(0.8 * 0.04 + 0.2 * 0.03) and est.draft_step_busy_s == pytest.approx(0.06)
    only_busy = AutoEstimates(draft_step_busy_s=0.05, cloud_busy=False)
    assert only_busy.draft_step() == 0.05 and AutoEstimates().draft_step() is None


def test_where_llm_runs_the_draft_step_is_timed_on_a_one_token_read_every_few_rounds():
    """Where llm wins nothing drafts, and the idle draft step stood at the warm-up's first drafting rounds for whole
    traces (0.031 s on one, 0.042 on another of the same commit). A step is due (`step_probe_due`) when never measured
    by this runtime in the cloud's state now, or STEP_PROBE_ROUNDS llm rounds after its last measurement; a forward of
    one token read while nothing drafts (`observe_step_read`) is a draft step's, averaged into the state's own, and
    a drafting round's step counts as well. A broken timing is not kept."""
    from edge_runtime.auto_estimates import STEP_PROBE_ROUNDS

    curve = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]
    est = _estimates(0.8, 0.04, step_1=0.04, step_9=0.2)  # a record's idle step: 0.04 s
    assert est.take_report(P.CloudCost(curve))
    assert est.step_probe_due()  # never measured by this runtime
    est.observe_step_read(0.03)
    assert not est.step_probe_due() and est.draft_step_s == pytest.approx(0.8 * 0.04 + 0.2 * 0.03)
    for i in range(STEP_PROBE_ROUNDS):
        assert not est.step_probe_due()
        est.observe_llm(8, 8 * 0.04, 90, 130, 0.4, Link(0.01), now=1.0 + i)
    assert est.step_probe_due()
    est.observe_step_read(float("nan"))
    est.observe_step_read(-1.0)
    assert est.step_probe_due() and est.draft_step_s == pytest.approx(0.8 * 0.04 + 0.2 * 0.03)
    est.observe_sd(4, 4, 4 * 0.03, 0.22, 300, 100, 0.6, Link(0.01), now=9.0)  # a drafting round measures it too
    assert not est.step_probe_due()
    assert est.take_report(P.CloudCost(curve, batch_tokens=40.0, others=8, others_positions=8.0, duty=1.0))
    assert est.step_probe_due()  # busy: that state's step, never measured
    est.observe_step_read(0.05)
    assert est.draft_step_busy_s == pytest.approx(0.05) and not est.step_probe_due()
    assert est.take_report(P.CloudCost(curve)) and not est.step_probe_due()  # idle again: measured a round ago


def test_a_reads_agreement_a_rounding_above_its_tokens_is_counted_as_all_of_them():
    """A read's agreed is the drafter's running sum after the read less before it: above temperature 0 a token the
    draft agrees with wholly (min(1, q/p) = 1) can come out 1 + 9e-16, which was refused as more than its one token
    (the request then lost that read). Within rounding it counts as all; beyond, or NaN, it is refused."""
    est = AutoEstimates(kind="T=0.5")
    before = 7.7675025087889
    est.observe_agreement((before + 1.0) - before, 1)
    own = est.acceptance[("sd", "T=0.5")]
    assert (before + 1.0) - before > 1.0 and own.request_examined == 1 and own.request_accepted == 1.0
    est.observe_agreement(1.5, 1)
    est.observe_agreement(float("nan"), 1)
    assert own.request_examined == 1


def test_a_cloud_stepping_back_to_back_is_priced_in_phase_with_its_steps():
    """Other devices keep the cloud stepping back to back (duty 1, steps of 0.5 s with their positions): a round's
    request waits for the step in progress, so a round costs whole steps — drafting up to the step's end is free and
    a draft that passes it waits most of another step. Measured under such a load (2026-11-29, this machine): sd's
    rounds took 1.0 s at γ ≤ 5 and 1.5 s at γ 6–8. The model then prefers the longest draft that fits (γ 6 here:
    0.42 s of drafting and 20 ms of link within 0.5 s) over γ 8 (α 0.8, whose mean wait would have looked cheap),
    and a round measured in phase leaves no overhead beyond the wait it priced. A report without duty (an older
    cloud) keeps the wait of half a step."""
    curve = [[1.0, 0.05], [9.0, 0.06], [20.0, 0.5], [40.0, 0.55]]  # the others' 20 positions a step: 0.5 s
    est = _estimates(0.8, 0.07, step_1=0.04, step_9=0.05)
    est.observed = DelayModel()  # only the report prices the cloud
    assert est.take_report(P.CloudCost(curve, others=8, others_positions=20.0, duty=1.0))
    step = est.reported_step_s
    assert step == pytest.approx(0.5) and est.reported_wait_s == 0.0 and est.reported_duty == 1.0
    c = _controller(est)
    by_gamma = {g: c.at("sd", g, Link(0.02)) for g in range(1, 9)}
    cadence = {g: max(step, est.curve().step_s(g + 1)) for g in by_gamma}  # its steps last as long as its own
    assert all(step <= s < 1.05 * step for s in cadence.values()), cadence  # g(x + 20): a little over g(20)
    fits = max(g for g in range(1, 9) if g * 0.07 + 0.02 + est.overhead("sd") < cadence[g])
    for g, p in by_gamma.items():  # whole steps before its own
        ahead = p.round_s - est.curve().step_s(g + 1)
        assert ahead == pytest.approx(cadence[g] * (1 if g <= fits else 2)), g
    assert max(by_gamma.values(), key=lambda p: p.tokens_per_s).knob == fits
    # a round measured in phase: its residual is the phase wait, and nothing is left as overhead
    g5 = est.curve().step_s(6)
    est.observe_sd(5, 4, 5 * 0.07, g5, 300, 100, g5 + g5, Link(0.02), now=0.0)
    assert est.overhead_s["sd:busy"] == pytest.approx(0.0, abs=1e-9)
    # an older cloud's report (no duty): the wait of half a step, whatever the draft's length
    assert est.take_report(P.CloudCost(curve, others=8, others_positions=20.0))
    assert est.reported_duty == 0.0 and est.reported_wait_s == pytest.approx(0.5 * step)


def test_the_steps_a_round_meets_last_as_long_as_its_own():
    """A busy cloud whose report prices the others' step below what the device's verify steps take (the trace on
    `ed45904` at low power under load: g(μ) 0.40 s by the report, the device's steps 0.55-0.64 s): the steps a round's
    request meets are as long as its own (costmodel.cadence_s), so drafts that fit within one of them are not priced
    a step more. There a round of γ 2 took 1.11 s and one of γ 4 1.16 s (medians, n = 41 and 68): by the report's
    0.40 s steps γ 4 passed a step's end and was priced a step above γ 2, and auto ran γ 2 on 100 of 256 tokens."""
    curve = [[1.0, 0.3], [9.0, 0.32], [20.0, 0.4], [40.0, 0.6]]  # the others' 20 positions a step: 0.40 s
    est = _estimates(0.8, 0.127, step_1=0.04, step_9=0.05)  # a slow board's draft step
    est.observed = DelayModel()
    assert est.take_report(P.CloudCost(curve, others=8, others_positions=20.0, duty=1.0))
    assert est.reported_step_s == pytest.approx(0.4)
    for g in (3, 5):  # the device's own verify steps: 0.55-0.58 s
        est.observed.observe(g, 0.55 if g == 3 else 0.58)
    c = _controller(est)
    two, four = c.at("sd", 2, Link(0.004)), c.at("sd", 4, Link(0.004))
    own2, own4 = est.curve().step_s(3), est.curve().step_s(5)
    assert own2 == pytest.approx(0.55) and own4 == pytest.approx(0.58)
    assert two.round_s - own2 == pytest.approx(own2) and four.round_s - own4 == pytest.approx(own4)  # one step each
    assert four.round_s - two.round_s < 0.1  # γ 4's two more drafts fit: no step more (1.16 against 1.11 s measured)
    from hat_split.math.costmodel import phase_wait
    reported = 4 * 0.127 + est.overhead("sd") + 0.004  # by the report's steps, γ 4 passed one: priced 0.4 s more
    assert reported + phase_wait(reported, 0.4) + own4 - (own2 + 0.4) > 0.3


def test_a_busy_clouds_step_spread_smooths_the_phase_it_prices():
    """The device's verify steps under load wander about the curve (the others' batches differ step to step): their
    relative spread (`step_jitter`, from drafting rounds while the cloud is busy) is the phase wait's jitter
    (costmodel.phase_wait), so a γ whose drafting passes a step's end is priced less than a whole step above one that
    fits — at low power under load the rounds' waits showed no phase at all (docs/AUTO.md "The phase of a jittery
    cloud"). An idle cloud's report, or a change of load, drops it."""
    curve = [[1.0, 0.05], [9.0, 0.06], [20.0, 0.5], [40.0, 0.55]]  # the others' 20 positions a step: 0.5 s
    est = _estimates(0.8, 0.07, step_1=0.04, step_9=0.05)
    est.observed = DelayModel()
    assert est.take_report(P.CloudCost(curve, others=8, others_positions=20.0, duty=1.0))
    assert est.step_jitter == 0.0 and est.step_var is None
    expected = est.curve(0.0).step_s(6)
    for k in range(60):  # verify steps of 6 positions, 20 % off the curve either way
        seconds = expected * (1.2 if k % 2 else 0.8)
        est.observe_sd(5, 4, 5 * 0.07, seconds, 300, 100, 0.5 + seconds, Link(0.02), now=0.0)
    assert 0.12 < est.step_jitter < 0.28
    est.overhead_s["sd:busy"] = 0.0  # these rounds' walls are not the phase's (no credit off it: the jitter alone)
    c = _controller(est)
    smooth = {g: c.at("sd", g, Link(0.02), now=0.0).round_s for g in (7, 8)}  # γ 7's drafting and link, 0.51 s,
    spread, est.step_var = est.step_var, None  # within the steps' 0.51-0.52 s (its own: costmodel.cadence_s); γ 8's not
    sharp = {g: c.at("sd", g, Link(0.02), now=0.0).round_s for g in (7, 8)}
    assert sharp[8] - sharp[7] > 0.4 and smooth[8] - smooth[7] < 0.5 * (sharp[8] - sharp[7])  # a step's edge, blurred
    est.step_var = spread
    assert est.take_report(P.CloudCost(curve, others=0, duty=0.2))  # the load ended: an idle cloud
    assert est.step_jitter == 0.0 and est.step_var is None
    est.observe_sd(5, 4, 5 * 0.07, 0.05, 300, 100, 0.6, Link(0.02), now=1.0)
    assert est.step_var is None  # an idle cloud's steps are not the busy cloud's spread


def test_a_new_power_mode_is_another_board():
    """The board's power mode changes: each of the device's own figures is replaced by its next observation rather
    than averaged with it, α (the models') stays; back in a mode it knows, that mode's figures return; the first
    reading and an unchanged mode change nothing."""
    est = _estimates(0.9, 0.02, step_1=0.2, step_9=0.22)
    est.overhead_s = {"sd": 0.01, "sd:busy": 0.2, "llm": 0.005}
    est.observe_catch_up(10, 0.04)
    assert not est.take_mode("MAXN") and not est.take_mode("MAXN") and not est.restart
    est.observe_sd(4, 4, 4 * 0.04, 0.22, 300, 100, 0.6, Link(), now=1.0)
    assert est.draft_step_s == pytest.approx(0.8 * 0.02 + 0.2 * 0.04)  # averaged (the moving average keeps 0.8)
    assert est.take_mode("MODE_15W")
    est.observe_sd(4, 4, 4 * 0.06, 0.22, 300, 100, 0.6, Link(), now=2.0)  # the slower board's draft step
    assert est.draft_step_s == pytest.approx(0.06) and est.local_step_s == pytest.approx(0.06)  # replaced
    assert est.overhead_s["llm"] == 0.005 and 0.9 < est.alpha < 1.0  # α averaged on (all 4 accepted), not restarted
    est.observe_catch_up(10, 0.1)
    assert est.catch_up_cost(10) == pytest.approx(0.1)  # replaced, not averaged with 0.04
    est.observe_catch_up(10, 0.2)
    assert est.catch_up_cost(10) == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)  # then averaged again
    assert est.take_mode("MAXN") and est.restart == {"ksqs", "ksqs:busy", "draft_step_busy_s"}  # back: MAXN's figures,
    # as measured there (ksqs never ran in it, nor sd while the cloud was busy)
    assert est.draft_step_s == pytest.approx(0.024) and est.catch_up_cost(10) == pytest.approx(0.04)
    assert est.overhead_s["sd:busy"] == 0.2
    assert est.take_mode("MODE_15W") and est.draft_step_s == pytest.approx(0.06)
    assert est.catch_up_cost(10) == pytest.approx(0.12) and "sd:busy" in est.restart  # never measured in this mode


def test_the_draft_reads_ahead_only_while_sd_is_within_reach():
    from edge_runtime.auto import READ_AHEAD_REACH

    unpriced = _controller(AutoEstimates())
    assert unpriced.sd_within_reach(unpriced.predictions(Link(0.01)))  # sd must be measured: its draft must be ready
    close = _controller(_estimates(0.4, 0.05, step_1=0.2, step_9=0.24))
    preds = close.predictions(Link(0.01))
    assert preds["sd"].tokens_per_s >= READ_AHEAD_REACH * preds["llm"].tokens_per_s and close.sd_within_reach(preds)
    far = _controller(_estimates(0.05, 0.05, step_1=0.2, step_9=0.5))
    preds = far.predictions(Link(0.01))
    assert preds["sd"].tokens_per_s < READ_AHEAD_REACH * preds["llm"].tokens_per_s
    llm_only = _controller(AutoEstimates(), eligible=("llm",))
    assert not far.sd_within_reach(preds) and not llm_only.sd_within_reach(llm_only.predictions(Link(0.01)))


def test_the_targets_tokens_read_while_llm_runs_move_the_requests_acceptance():
    """A prompt priced at the prompts' α 0.5 runs llm; the draft model, reading llm's tokens at temperature 0, named
    30 of 30: the request's α moves as if sd had drafted them, and sd wins the prompt back. A sampled request's
    reads (an estimate from each token's drawn probability, fractional) move its own kind's α only; a malformed
    count moves nothing."""
    est = _estimates(0.5, 0.04, step_1=0.1, step_9=0.14)
    _begin_past_opening(est)
    c = _controller(est)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    assert c.decide(Link(0.01)).protocol == "llm"
    est.observe_agreement(3, 2)  # more agreed than compared: refused
    est.observe_agreement(0, 0)
    assert c.decide(Link(0.01)).protocol == "llm" and est.alpha == pytest.approx(_pulled(0.5, 10**9))
    est.observe_agreement(30, 30)
    assert est.alpha == pytest.approx((8 * _pulled(0.5, 10**9) + 30) / (8 + 30))
    back = c.decide(Link(0.01))
    assert back.protocol == "sd" and back.knob >= 4, back
    greedy = est.acceptance[("sd", GREEDY)].request_accepted
    est.begin_request("T=1")
    est.observe_agreement(float("nan"), 4)
    assert ("sd", "T=1") not in est.acceptance
    est.observe_agreement(12.5, 20)
    own = est.acceptance[("sd", "T=1")]
    assert (own.request_accepted, own.request_examined) == (12.5, 20) and own.population is None
    assert est.acceptance[("sd", GREEDY)].request_accepted == 0 and greedy == 30  # begin_request: a new request


def test_a_malformed_list_of_drawn_probabilities_is_refused_by_name_and_the_tokens_stand(caplog):
    """Generated.probs only feeds an estimate: one of the wrong length, not in (0, 1], NaN or not floats is refused
    (logged, naming the field) and nothing is measured on those tokens; none (an older cloud) measures nothing."""
    import numpy as np

    from edge_runtime.sessions.token import checked_probs

    assert checked_probs(np.array([0.5, 1.0], np.float32), 2) == [0.5, 1.0]
    assert checked_probs(None, 2) == [] and not caplog.records
    for bad in (np.array([0.5], np.float32), np.array([0.5, float("nan")]), np.array([0.0, 0.5]),
                np.array([0.5, 1.5]), np.array([1, 1]), np.array([[0.5, 0.5]])):
        caplog.clear()
        assert checked_probs(bad, 2) == []
        assert "Generated.probs refused" in caplog.text, bad


def test_the_first_read_in_a_new_power_mode_rescales_the_draft_step():
    """A new mode never measured: the opening's read of the prompt (it comes whatever auto runs next) says the board
    is three times slower, and the draft step and the device alone are priced at three times the last mode's until
    their own first observations replace them; sd, priced at the old step the best, is no longer. A forward that
    reads a hundred times slower moves them by MODE_RATIO_BOUNDS at most; a mode measured before keeps its own."""
    from edge_runtime.auto_estimates import MODE_RATIO_BOUNDS

    est = _estimates(0.75, 0.04, step_1=0.1, step_9=0.14)
    est.observe_catch_up(10, 0.08)
    est.observe_catch_up(40, 0.2)
    assert not est.take_mode("MAXN")
    c = _controller(est)
    c.record(Choice("sd", 4, "predicted", {}), 4)
    assert c.decide(Link(0.01)).protocol == "sd"
    assert est.take_mode("MODE_15W") and est.draft_step_s == pytest.approx(0.04)  # unmeasured: the last mode's
    est.observe_catch_up(40, 0.6)  # the prompt read in the new mode: three times the full-power board's 0.2 s
    assert est.draft_step_s == pytest.approx(0.12) and est.local_step_s == pytest.approx(0.12)
    assert est.catch_up_cost(40) == pytest.approx(0.6) and "draft_step_s" in est.restart
    assert c.decide(Link(0.01)).protocol == "llm"
    est.observe_catch_up(40, 0.5)  # a second read is this mode's own figure, not another rescaling
    assert est.draft_step_s == pytest.approx(0.12)
    est.observe_sd(4, 3, 4 * 0.1, 0.14, 300, 100, 0.7, Link(), now=1.0)  # drafting measured: replaced
    assert est.draft_step_s == pytest.approx(0.1) and "draft_step_s" not in est.restart
    assert est.take_mode("MAXN") and est.draft_step_s == pytest.approx(0.04)  # a mode it knows: its own figures
    est.observe_catch_up(40, 0.2)
    assert est.draft_step_s == pytest.approx(0.04)
    assert est.take_mode("MODE_10W")
    est.observe_catch_up(40, 100 * est.catch_up_cost(40))  # a forward stretched by something else on the cores
    assert est.draft_step_s == pytest.approx(0.04 * MODE_RATIO_BOUNDS[1])


@pytest.mark.parametrize("bad,field", [
    (P.CloudCost([[1.0, float("nan")]]), r"points\[0\]: seconds"),
    (P.CloudCost([[1.0, 0.1], [1.0, 0.2]]), r"points\[1\]: positions must increase"),
    (P.CloudCost([[0.0, 0.1]]), r"points\[0\]: positions"),
    (P.CloudCost([[1.0, 1e9]]), r"points\[0\]: seconds"),
    (P.CloudCost([[1.0, -0.5]]), r"points\[0\]: seconds"),
    (P.CloudCost([[1.0, 0.1]], queued=-1), "CloudCost.queued"),
    (P.CloudCost([[1.0, 0.1]], others=float("nan")), "CloudCost.others"),
    (P.CloudCost([[1.0, 0.1]], others_positions=-3.0), "CloudCost.others_positions"),
    (P.CloudCost([[1.0, 0.1]], batch_tokens=float("inf")), "CloudCost.batch_tokens"),
    (P.CloudCost([[1.0, 0.1]], duty=float("nan")), "CloudCost.duty"),
    (P.CloudCost([[1.0, 0.1]], duty=1.5), "CloudCost.duty"),
    (P.CloudCost([[1.0, 0.1]], duty=-0.1), "CloudCost.duty"),
    (P.CloudCost([[1.0, 0.1]], pace=float("nan")), "CloudCost.pace"),
    (P.CloudCost([[1.0, 0.1]], pace=-4.0), "CloudCost.pace"),
    (P.CloudCost([[1.0, 0.1]], pace=1e5), "CloudCost.pace"),
    (P.CloudCost([[1.0, 0.1]], pace=True), "CloudCost.pace"),
    (P.CloudCost([["x", 0.1]]), r"points\[0\] must be a \(positions, seconds\) pair"),
])
def test_a_hostile_cost_report_is_refused_and_the_last_good_one_kept(bad, field):
    with pytest.raises(ValueError, match=field):
        P.cost_curve(bad)
    est = AutoEstimates()
    assert est.take_report(P.CloudCost([[1.0, 0.05], [8.0, 0.09]], batch_tokens=3.0))
    good = est.curve()
    assert not est.take_report(bad)
    assert est.bad_reports == 1 and est.curve() == good and field.split(":")[0].replace("\\", "") in \
        est.last_bad_report.replace("\\", "")


def test_the_cloud_report_survives_the_wire():
    cost = P.CloudCost([[1.0, 0.05], [8.0, 0.09]], 2.5, 1, 4096, duty=0.75, pace=6.0)
    frames = P.encode(P.SessionOpened(3, 10, 0.2, cost))
    back = P.decode([bytes(f) for f in frames])
    assert P.cost_curve(back.cost) == ((1.0, 0.05), (8.0, 0.09)) and back.cost.kv_free == 4096
    assert back.cost.duty == 0.75 and back.cost.pace == 6.0
    older = P.decode([bytes(f) for f in P.encode(P.SessionOpened(3, 10, 0.2))])
    assert older.cost is None


# -- through a runtime and a cloud (the real SmolLM2-135M drafts and verifies) --------------------------------------

def _runtime(smollm2, endpoint, overlap_prefill: str = "auto", **link):
    from edge_runtime.config import EdgeConfig, LinkConfig
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.net.security import LinkSecurity

    return EdgeRuntime(EdgeConfig(model="smollm2-135m", overlap_prefill=overlap_prefill, link=LinkConfig(
        endpoint, security=LinkSecurity.plaintext(), **link)), smollm2)


@pytest.fixture
def smollm2_server(smollm2):
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import vocab_fingerprint

    with serving(CausalLM(smollm2.model), vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        yield server


@pytest.mark.real_models
def test_forced_switches_keep_the_targets_greedy_tokens(smollm2, smollm2_server, monkeypatch):
    """sd γ=2 → llm → sd γ=5 → llm → ksqs γ=3 → ... at every round boundary: the target's greedy tokens, the
    segments as run, the cloud's cost report taken."""
    from hat_split.math.sampling import SamplingParams

    script = itertools.cycle([Choice("sd", 2, "forced", {}), Choice("llm", 3, "forced", {}),
                              Choice("sd", 5, "forced", {}), Choice("llm", 1, "forced", {}),
                              Choice("ksqs", 3, "forced", {})])
    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 40, seed=0)
        monkeypatch.setattr(AutoController, "decide", lambda self, link, now=None, behind=0, remaining=0: next(script))
        res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 40, seed=0)
    assert res.tokens == ref.tokens and res.protocol == "auto"
    ran = [(s["protocol"], s["knob"]) for s in res.auto]
    assert len(ran) >= 6 and ran[:4] == [("sd", 2), ("llm", 3), ("sd", 5), ("llm", 1)], ran
    assert sum(s["tokens"] for s in res.auto) == res.n == 40
    assert rt.auto_estimates.reported and rt.auto_estimates.measured.keys() == {"sd", "llm", "ksqs"}


@pytest.mark.real_models
def test_a_sampling_request_measures_ksqs_a_greedy_one_never_runs_it(smollm2, smollm2_server):
    """At T > 0 auto measures ksqs beside sd and llm (its rows as lattice codes: a fraction of sd's bytes a draft);
    at temperature 0 it runs sd and llm only."""
    from hat_split.math.sampling import SamplingParams

    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        greedy = rt.generate(PROMPT, "auto", SamplingParams(0.0), 24, seed=0)
        sampled = rt.generate(PROMPT, "auto", SamplingParams(1.0), 40, seed=0)
        est = rt.auto_estimates
    assert {s["protocol"] for s in greedy.auto} <= {"sd", "llm"}
    assert any(s["protocol"] == "ksqs" and s["reason"].startswith("measuring ksqs") for s in sampled.auto), sampled.auto
    assert sum(s["tokens"] for s in sampled.auto) == sampled.n == 40 and est.measured.get("ksqs", 0) >= 3
    est.begin_request("T=1")  # the sampled request's figures: ksqs's rows a small part of sd's dense ones
    assert 0 < est.up_per_draft("ksqs") < est.up_per_draft("sd") / 20, (est.up_per_draft("ksqs"), est.up_per_draft())


def _scripted(seen, llm_rounds: int = 3):
    """AutoController.decide replaced: `llm_rounds` llm rounds of 3 tokens, then sd γ=4; (protocol, behind) seen."""
    script = itertools.chain([Choice("llm", 3, "forced", {})] * llm_rounds,
                             itertools.cycle([Choice("sd", 4, "forced", {})]))

    def decide(self, link, now=None, behind=0, remaining=0):
        choice = next(script)
        seen.append((choice.protocol, behind))
        return choice
    return decide


def _late_replies(monkeypatch) -> None:
    """Every reply waits for the draft model's reader to run out of tokens (a slow cloud)."""
    import threading
    import time

    from edge_runtime.client import CloudClient

    receive = CloudClient.receive

    def late(self, *args, **kwargs):
        deadline = time.monotonic() + 30.0
        while any(t.name == "hatspec-read-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.002)
        return receive(self, *args, **kwargs)

    monkeypatch.setattr(CloudClient, "receive", late)


@pytest.mark.real_models
def test_the_draft_reads_while_llm_waits(smollm2, smollm2_server, monkeypatch):
    """With cores of its own (overlap_prefill on) the device reads the prompt and llm's tokens into the draft model
    while it waits for the cloud, on the reader's thread (never the session's): when sd comes, only the last llm
    round's tokens are left to read (each reply is held here until the reader has run out of tokens, so the reads
    end whatever this machine's speed); the tokens stay the target's. On a shared host nothing is read while waiting
    (it would slow the cloud): sd reads everything first. With sd out of reach the prompt is still read at the
    opening (a load that makes sd the best is only known from the reply), llm's tokens are not. The opening reads
    the prompt in one forward while sd is within reach (the first round will likely draft and wait for all of it),
    else a few tokens at a time; later reads are always a few at a time. A census request reads llm's tokens even
    with sd out of reach. Before an llm round, when due, the draft step is timed on one token (the session's
    thread, the cloud idle)."""
    import threading

    from edge_runtime.read_ahead import ReadAhead
    from hat_split.math.sampling import SamplingParams

    _late_replies(monkeypatch)
    results = {}
    within_reach, catch_up_of, start_of = AutoController.sd_within_reach, Drafter.catch_up, ReadAhead.start
    from edge_runtime.runtime import EdgeRuntime

    for overlap, reach, census in (("on", True, False), ("off", True, False), ("on", False, False),
                                   ("on", False, True)):
        seen, reads, starts = [], [], []
        monkeypatch.setattr(EdgeRuntime, "_census", lambda self, kind, census=census: census)
        monkeypatch.setattr(AutoController, "decide", _scripted(seen))
        monkeypatch.setattr(AutoController, "sd_within_reach", within_reach if reach else lambda self, preds: False)
        monkeypatch.setattr(Drafter, "catch_up", lambda self, n, **kw: reads.append(
            (threading.current_thread().name, catch_up_of(self, n, **kw), self)) or reads[-1][1])
        monkeypatch.setattr(ReadAhead, "start", lambda self, whole=False: starts.append(whole) or start_of(self, whole))
        with _runtime(smollm2, smollm2_server.endpoint, overlap_prefill=overlap) as rt:
            ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 24, seed=0)
            reads.clear()
            res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 24, seed=0)
        assert res.tokens == ref.tokens, overlap
        results[overlap, reach, census] = (seen, rt.auto_estimates.catch_up, reads, starts)
    seen, catch_up, reads, starts = results["on", True, False]
    assert [b for p, b in seen[:4]] == [0, 3, 3, 3] and seen[3][0] == "sd" and catch_up.known, seen
    probes = [n for name, n, _ in reads if name == "MainThread"]  # the draft step timed once, between rounds
    assert {name for name, _, _ in reads} == {"hatspec-read-ahead", "MainThread"} and probes == [1], reads
    assert sum(n for _, n, _ in reads) == len(PROMPT) + 5
    assert starts[0] is True and not any(starts[1:]) and len(starts) >= 3, starts  # the opening's read whole
    drafter = reads[-1][2]  # at temperature 0 the reads compare: the two llm rounds' 6 tokens, all the draft's
    assert (drafter.agreed, drafter.compared) == (6, 6)  # argmax (the draft is the target here)
    seen, _, reads, starts = results["off", True, False]  # nothing read while waiting; the step timed once
    assert seen[0] == ("llm", len(PROMPT) - 1) and seen[3] == ("sd", len(PROMPT) - 1 - 1 + 9), seen
    assert not starts and [(name, n) for name, n, _ in reads] == [("MainThread", 1)], reads
    seen, _, reads, starts = results["on", False, False]  # llm's tokens are not read, but the draft step is timed
    # before the second llm round (before the first there is nothing to read), not the third (measured)
    assert [b for p, b in seen[:4]] == [0, 3, 5, 8] and seen[3][0] == "sd" and starts == [False], (seen, starts)
    assert [(name, n) for name, n, _ in reads] == [("hatspec-read-ahead", len(PROMPT) - 1), ("MainThread", 1)]
    assert reads[0][2].compared == 1  # the prompt's own, then the probe's one token of the target's
    seen, _, reads, starts = results["on", False, True]  # a census reads llm's tokens all the same
    assert [b for p, b in seen[:4]] == [0, 3, 3, 3] and starts[0] is False and len(starts) >= 3, (seen, starts)
    assert reads[-1][2].compared == 6


@pytest.mark.real_models
def test_a_census_reads_llms_tokens_to_the_last_round(smollm2, smollm2_server, monkeypatch):
    """llm throughout, 3 tokens a round, 24 tokens: a census request reads each round's tokens in the next round,
    the last round included when its read fits in it (AutoController.census_reads_to_the_end): 21 of the 24 tokens
    compared, not the 18 a read that stops a round before the end compares (the answer's opening, which agrees less
    than its whole). A read priced longer than the last round is not begun in it; a request that is not a census
    stops a round before the end as well. The tokens stay the target's."""
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.math.sampling import SamplingParams

    _late_replies(monkeypatch)
    monkeypatch.setattr(AutoController, "sd_within_reach", lambda self, preds: True)
    catch_up_of = Drafter.catch_up
    compared = {}
    for census, cost in ((True, 0.0), (True, 1e6), (False, 0.0)):
        seen, drafters = [], []
        monkeypatch.setattr(EdgeRuntime, "_census", lambda self, kind, census=census: census)
        monkeypatch.setattr(AutoEstimates, "catch_up_cost", lambda self, tokens, cost=cost: cost)
        monkeypatch.setattr(AutoController, "decide", _scripted(seen, llm_rounds=10**6))
        monkeypatch.setattr(Drafter, "catch_up",
                            lambda self, n, **kw: drafters.append(self) or catch_up_of(self, n, **kw))
        with _runtime(smollm2, smollm2_server.endpoint, overlap_prefill="on") as rt:
            ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 24, seed=0)
            res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 24, seed=0)
        assert res.tokens == ref.tokens and len(seen) == 8 and {p for p, _ in seen} == {"llm"}, seen
        compared[census, cost] = drafters[-1].compared
    assert compared == {(True, 0.0): 21, (True, 1e6): 18, (False, 0.0): 18}, compared


@pytest.mark.real_models
def test_at_temperature_1_the_reads_of_llms_tokens_measure_the_drafts_acceptance(smollm2, smollm2_server,
                                                                                 monkeypatch):
    """Above temperature 0 llm's replies carry each token's probability as the target drew it (Generate.probs) and
    the draft's reads add min(1, q(x) / p(x)) per token: the draft here is the target's own model, so each is 1 up
    to the two sides' rounding — p paired with a neighbouring token would read well below. The estimate reaches the
    request's α (T = 0.5: its own kind of sampling)."""
    from hat_split.math.sampling import SamplingParams

    _late_replies(monkeypatch)
    seen, drafters = [], []
    monkeypatch.setattr(AutoController, "decide", _scripted(seen, llm_rounds=10**6))  # llm throughout
    monkeypatch.setattr(AutoController, "sd_within_reach", lambda self, preds: True)
    catch_up_of = Drafter.catch_up
    monkeypatch.setattr(Drafter, "catch_up", lambda self, n, **kw: drafters.append(self) or catch_up_of(self, n, **kw))
    with _runtime(smollm2, smollm2_server.endpoint, overlap_prefill="on") as rt:
        res = rt.generate(PROMPT, "auto", SamplingParams(0.5), 24, seed=0)
        own = rt.auto_estimates.acceptance.get(("sd", "T=0.5"))
    d = drafters[-1]
    assert res.n == 24 and {p for p, _ in seen} == {"llm"}
    assert d.compared >= 12 and d.agreed / d.compared > 0.98, (d.agreed, d.compared)
    assert own is not None and own.request_examined == d.compared and own.request_accepted == pytest.approx(d.agreed)


@pytest.mark.real_models
def test_a_reply_is_not_held_by_the_drafts_read(smollm2, smollm2_server, monkeypatch):
    """Every read of the draft model takes 1.5 s here (a slow board) while the cloud answers in milliseconds: the
    first token still comes at the cloud's pace and llm's rounds go on while the reader works (a read on the session's
    thread held the reply for a whole forward); the request ends with the reader's last forward, and the device's
    compute counts it."""
    import time

    from hat_split.math.sampling import SamplingParams

    seen = []
    monkeypatch.setattr(AutoController, "decide", _scripted(seen, llm_rounds=100))
    monkeypatch.setattr(AutoController, "sd_within_reach", lambda self, preds: True)
    catch_up_of = Drafter.catch_up

    def slow(self, n, **kw):
        read = catch_up_of(self, n, **kw)
        time.sleep(1.5)
        self.kv.forward_s += 1.5
        return read

    monkeypatch.setattr(Drafter, "catch_up", slow)
    with _runtime(smollm2, smollm2_server.endpoint, overlap_prefill="on") as rt:
        rt.generate(PROMPT, "llm", SamplingParams(0.0), 12, seed=0)  # the cloud warm
        res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 12, seed=0)
    assert [s["protocol"] for s in res.auto] == ["llm"] and res.n == 12
    assert res.ttft_s < 1.0, res.ttft_s  # the prompt's read (1.5 s) began before the request left
    assert res.device_compute_s >= 1.5  # the read that outlived the answer's last reply is counted
    assert len(seen) == 4  # four rounds of 3 tokens, all while the prompt's read was in progress


@pytest.mark.real_models
def test_auto_measures_then_chooses_and_says_why(smollm2, smollm2_server):
    """The first request tries each protocol the runtime has not measured; later ones run the predicted best and give
    the prediction. Here the draft is the target itself, so drafting costs what it saves: llm wins (the cost model
    says so from the measurements, not from a rule; on a slow CPU the round trips it saves can make sd win). The
    runtime's llm request taught auto llm's costs already: only sd is measured; a runtime that served both measures no
    protocol. The one thing such a runtime may still measure is auto's own η-chain (a shape no plain sd request runs),
    and only where sd is predicted fastest, in place of sd's best."""
    from hat_split.math.sampling import SamplingParams

    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 32, seed=0)
        assert rt.auto_estimates.measured == {"llm": 4} and rt.auto_estimates.reported
        first = rt.generate(PROMPT, "auto", SamplingParams(0.0), 32, seed=0)
        second = rt.generate(PROMPT, "auto", SamplingParams(0.0), 32, seed=0)
    assert first.tokens == second.tokens == ref.tokens
    assert first.auto[0]["reason"].startswith("measuring sd:") and first.auto[0]["protocol"] == "sd", first.auto
    assert not any(s["reason"].startswith("measuring llm") for s in first.auto)
    assert not any(_measures_a_protocol(s) for s in second.auto), second.auto
    assert any(s["reason"].startswith("predicted") and "tok/s" in s["reason"] for s in second.auto), second.auto
    sd = rt.auto_estimates.acceptance[("sd", GREEDY)]
    assert sd.accepted == sd.examined and rt.auto_estimates.alpha > 0.75  # the draft is the target: all accepted
    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        rt.generate(PROMPT, "sd", SamplingParams(0.0), 32, seed=0)
        rt.generate(PROMPT, "llm", SamplingParams(0.0), 32, seed=0)
        taught = rt.generate(PROMPT, "auto", SamplingParams(0.0), 32, seed=0)
    assert taught.tokens == ref.tokens and not any(_measures_a_protocol(s) for s in taught.auto), taught.auto
    assert any(s["reason"].startswith("predicted") for s in taught.auto), taught.auto


def _measures_a_protocol(step: dict) -> bool:
    """A step that measures a protocol the runtime has not measured enough ("measuring llm …", "measuring sd: …");
    not the η-chain measured in place of sd's predicted best (AutoController._eta_turn), not a probe of one measured
    long ago."""
    reason = step["reason"]
    eta_chain = step["protocol"] == "sd" and step.get("eta", 0) > 0 and reason.startswith("measuring sd's η-chain")
    return reason.startswith("measuring") and not eta_chain


@pytest.mark.real_models
def test_auto_without_a_cloud_runs_the_device_alone(smollm2):
    from hat_split.math.sampling import SamplingParams
    from hat_split.models.lm import CausalLM

    with refusing_port() as nobody:
        with _runtime(smollm2, f"tcp://127.0.0.1:{nobody}", connect_timeout_s=0.3, connect_retries=1) as rt:
            res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 8, seed=0)
    assert res.protocol == "auto" and res.auto[0]["protocol"] == "slm" and "unreachable" in res.auto[0]["reason"]
    assert res.tokens == CausalLM(smollm2.model).greedy(PROMPT, 8) and res.up_bytes == 0


@pytest.mark.real_models
def test_lossy_only_when_allowed(smollm2, smollm2_server):
    """With estimates where the device alone is far faster, auto still runs an exact protocol unless the request
    allows a lossy one."""
    from hat_split.math.sampling import SamplingParams

    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        rt.generate(PROMPT, "auto", SamplingParams(0.0), 16, seed=0)  # measure both
        rt.auto_estimates.local_step_s = 1e-4
        exact = rt.generate(PROMPT, "auto", SamplingParams(0.0), 8, seed=0)
        lossy = rt.generate(PROMPT, "auto", SamplingParams(0.0), 8, seed=0, allow_lossy=True)
    assert {s["protocol"] for s in exact.auto} <= {"sd", "llm"}
    assert [s["protocol"] for s in lossy.auto] == ["slm"] and "lossy allowed" in lossy.auto[0]["reason"]


@pytest.mark.real_models
def test_a_private_request_keeps_token_ids_on_the_device(smollm2, smollm2_server):
    """auto + private runs a split protocol (ushape here: no drafter given), whose greedy tokens are the target's; a
    token protocol named with private is refused before anything runs."""
    from hat_split.math.sampling import SamplingParams
    from hat_split.models.lm import CausalLM

    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 8, seed=0, private=True)
        with pytest.raises(ValueError, match="sends token ids to the cloud"):
            rt.generate(PROMPT, "sd", SamplingParams(0.0), 8, private=True)
    assert res.auto[0]["protocol"] == "ushape" and res.tokens == CausalLM(smollm2.model).greedy(PROMPT, 8)
    assert math.isfinite(rt.split_rates["ushape"])


@pytest.mark.real_models
def test_a_cut_mid_request_degrades_to_the_device_and_comes_back(smollm2, smollm2_server):
    """The link is reset after auto's first commits and comes back once the device has committed three tokens alone
    (the tokens listed in `degraded` and as an slm segment), then auto carries on with the cloud; the same model
    drafts and verifies here, so the whole answer is the target's greedy one. The link comes back on the device's
    own commits, not after a fixed second: on the CI's slowest machine a round's drafting outlasted the second, the
    sockets reconnected unseen, and no round was interrupted."""
    import threading
    import time

    from hat_split.math.sampling import SamplingParams
    from hat_split.models.lm import CausalLM
    from testbed.link_emulator import LinkEmulator

    host, port = smollm2_server.endpoint.split("//")[1].rsplit(":", 1)
    with LinkEmulator("loopback", (host, int(port))) as link:
        with _runtime(smollm2, link.address, backoff_s=0.2, connect_timeout_s=0.5, connect_retries=1,
                      heartbeat_s=1.0, reconnect_timeout_s=60) as rt:
            commits, restored = [], threading.Event()

            def restore():
                if not restored.is_set():
                    restored.set()
                    link.restore()

            def slow_board(tokens, logprobs):  # driven: the cut comes after the first commit; the link is back after
                commits.append(len(tokens))    # the next three commits (the device's alone: the cloud is cut), each
                if len(commits) == 1:          # a slow board's 0.05 s, so it is back before the answer ends
                    link.cut("reset")
                    threading.Timer(30.0, restore).start()  # a device that never noticed: the test fails, not hangs
                elif len(commits) == 4:
                    restore()
                time.sleep(0.05)

            res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 40, seed=0, on_tokens=slow_board)
            restore()
    assert res.tokens == CausalLM(smollm2.model).greedy(PROMPT, 40)
    assert res.interruptions >= 1 and 0 < len(res.degraded) < 40
    assert res.auto[-1]["protocol"] == "slm" and res.auto[-1]["tokens"] == len(res.degraded)
    assert "unreachable" in res.auto[-1]["reason"]
    assert sum(s["tokens"] for s in res.auto) == 40


def test_a_draft_tree_is_measured_then_priced_from_its_own_rounds():
    """With a tree configured, sd's tree runs MEASURE_ROUNDS rounds once sd is measured (its prior: the chain of its
    depth's expected tokens, the least it commits); then it is priced from its own rounds. A cloud whose verify of
    33 positions costs about one step (a GPU with captured graphs) over a 100 ms round trip: the tree's 6 tokens a
    round win over chains and llm; a CPU cloud where 33 positions cost 12 steps: no tree (measured when a round of
    its depth + 1 tokens could reach llm, not measured when even that could not)."""
    shape = (32, 8, 4)
    for step_33, want_tree in ((1.2, False), (0.022, True), (0.6, False)):
        est = _estimates(0.7, 0.005, step_1=0.1 if step_33 > 0.1 else 0.02, step_9=0.3 if step_33 > 0.1 else 0.021)
        est.observed.observe(33, step_33)
        c = _controller(est, trees=(shape,))
        assert est.tree_tokens_per_round(shape) == pytest.approx(expected_tokens_beta(8 * 0.7, 8 * 0.3, 8))
        if step_33 > 1:  # 9 tokens a round at 1.35 s: below READ_AHEAD_REACH of llm's 8.9 tok/s, never measured
            pick = c.decide(Link(0.1))  # (sd's chain of 4, priced over the prompts' spread of α, is 1.02× llm)
            assert pick.tree is None and pick.reason.startswith("predicted") and "tree" not in pick.reason, pick
            continue
        for _ in range(3):
            first = c.decide(Link(0.1))
            assert first.tree == shape and first.knob == 32 and first.reason.startswith("measuring sd's tree"), first
            est.observe_tree(shape, 6, 8 * 0.005, step_33, 80 + 32 * 6, 100, 0.04 + 0.1 + step_33 + 0.002, Link(0.1),
                             now=0.0)
            c.record(first, 6)
        assert est.tree_tokens_per_round(shape) == pytest.approx((2 * _pulled_tree(est, shape) + 18) / 5)
        assert est.tree_up_per_node_of(shape) == 6.0
        pick = c.decide(Link(0.1))
        assert (pick.protocol == "sd" and pick.tree == shape) == want_tree, pick
        assert ("sd_tree 32x8x4" in pick.reason) == want_tree, pick.reason
    from edge_runtime.auto_estimates import sampling_kind
    from hat_split.math.sampling import SamplingParams

    # a sampling request: what greedy rounds taught about the tree does not price it (a sampled tree accepts less and
    # sends a row per node with children); it is measured again under its own kind, and the greedy figures stay
    sampled = sampling_kind(SamplingParams(0.7))
    est.begin_request(sampled)
    assert est.tree_rounds_of(shape) == 0 and est.tree_up_per_node_of(shape) is None
    assert est.tree_tokens_per_round(shape) is None  # not even the chain's prior: sd's α is not known for this kind
    est.observe_tree(shape, 3, 8 * 0.005, 1.2, 80 + 32 * 400, 100, 1.5, Link(0.1), now=0.0)
    assert est.tree_tokens_per_round(shape) == pytest.approx(3.0) and est.tree_up_per_node_of(shape) > 300
    est.begin_request()
    assert est.tree_tokens_per_round(shape) == pytest.approx(_pulled_tree(est, shape))
    assert est.tree_up_per_node_of(shape) == 6.0 and est.tree_rounds_of(shape) == 3
    c = _controller(_estimates(0.7, 0.02, step_1=0.02, step_9=0.021))  # no tree configured: chains only
    assert c.decide(Link(0.1)).tree is None


def test_a_chain_that_eta_ends_is_priced_by_the_nodes_it_sends():
    """A tree of width 1 with η (8x8x1: a chain of at most 8 that ends on its draft's confidence) sends fewer nodes
    than its shape: the estimates keep the nodes a round sent, and the price counts their uploads and positions, not
    the shape's 8. A round that claims more nodes than the shape holds is refused."""
    shape = (8, 8, 1)
    est = _estimates(0.7, 0.005, step_1=0.1, step_9=0.3)
    c = _controller(est, trees=(shape,))
    for sent in (3, 4, 3, 4):
        est.observe_tree(shape, 3, sent * 0.005, 0.15, 80 + sent * 6, 100, 0.3, Link(0.1), now=0.0, sent=sent)
    assert 3.0 < est.tree_sent_of(shape) < 4.0 and est.tree_up_per_node_of(shape) == pytest.approx(6.0)
    priced = c.at_tree(shape, Link(0.1), now=0.0)
    whole = dataclasses.replace(est, tree_sent={})  # the same rounds taken as the shape's 8 nodes each
    assert priced.round_s < _controller(whole, trees=(shape,)).at_tree(shape, Link(0.1), now=0.0).round_s
    per_round = est.tree_tokens_per_round(shape)  # its rounds' 3, pulled a little towards the chain of 8's
    assert priced.up_bytes_per_token == pytest.approx((est.wire().up_round + est.tree_sent_of(shape) * 6.0) / per_round)
    with pytest.raises(ValueError, match="sends 1..8 nodes"):
        est.observe_tree(shape, 3, 0.05, 0.15, 200, 100, 0.3, Link(0.1), now=0.0, sent=9)


def test_the_eta_chains_drafts_move_the_requests_acceptance_of_sds_chains():
    """A prompt auto runs on the η-chain teaches sd's chains its acceptance: each round's accepted nodes, and the
    first rejected, count as the request's own drafts (the prompts' stay the chains'). A tree of width > 1 teaches
    no chain; an accepted count the round cannot hold is refused before anything is kept."""
    from edge_runtime.acceptance import ALPHA_PRIOR_DRAFTS

    eta_chain, wide, link = (8, 8, 1), (8, 4, 2), Link(0.1)
    est = _estimates(0.6, 0.01, step_1=0.05, step_9=0.06)
    _begin_past_opening(est)
    assert est.alpha == pytest.approx(0.6)

    def tree_round(shape, sent, accepted, now=0.0):
        est.observe_tree(shape, accepted + 1, sent * 0.01, 0.06, 80 + sent * 6, 100, 0.3, link, now=now, sent=sent,
                         accepted=accepted)

    for _ in range(3):  # an easy prompt: 5 of 5 sent accepted, then 2 of 5 (2 accepted, the third rejected)
        tree_round(eta_chain, 5, 5)
    tree_round(eta_chain, 5, 2)
    want = (ALPHA_PRIOR_DRAFTS * 0.6 + 17) / (ALPHA_PRIOR_DRAFTS + 18)
    assert est.alpha == pytest.approx(want) and est.alpha > 0.8  # from 0.6
    sd = est.acceptance[("sd", GREEDY)]
    assert sd.population == pytest.approx(0.6) and sd.rounds == 10**9  # the prompts' acceptance: the chains' own
    tree_round(wide, 8, 3)  # a wide tree's path says nothing of a chain's drafts
    assert est.alpha == pytest.approx(want)
    with pytest.raises(ValueError, match="accepts 0..5"):
        tree_round(eta_chain, 5, 6, now=1.0)
    assert est.alpha == pytest.approx(want) and est.tree_rounds_of(eta_chain) == 4  # the refused round kept nothing
    _begin_past_opening(est)  # the next prompt starts from the prompts' again
    assert est.alpha == pytest.approx(0.6)


def test_a_tree_has_its_own_round_overhead_and_drafts_in_the_boards_draft_steps():
    """The η-chain (a tree of width 1) keeps a round overhead of its own, apart from sd's chains' — sd's until its
    own is measured — and per power mode as sd's is; its drafts are sd's draft steps, and its drafting is priced in
    draft steps, so a new power mode prices it with that mode's step."""
    shape, key, link = (8, 8, 1), "sd_tree 8x8x1", Link(0.1)
    est = _estimates(0.8, 0.01, step_1=0.05, step_9=0.06)
    est.overhead_s = {"sd": 0.03}
    assert not est.take_mode("MAXN")
    c = _controller(est, eta=0.4)
    assert est.overhead(key) == 0.03 and est.device(False, key).round_s == 0.03  # sd's, before its own
    sent, residual = 4, 0.2
    wall = sent * 0.02 + 0.06 + link.transfer_s(80 + sent * 60, 100) + residual
    est.observe_tree(shape, 5, sent * 0.02, 0.06, 80 + sent * 60, 100, wall, link, now=0.0, sent=sent)
    assert est.overhead(key) == pytest.approx(residual) and est.overhead("sd") == 0.03  # each its own
    assert est.draft_step_s == pytest.approx(0.8 * 0.01 + 0.2 * 0.02)  # the chain's drafts are draft steps
    assert est.tree_draft_steps[shape] == sent
    # priced at the 5 tokens a round it committed: η's drafts are in proportion to them (`tree_steps_at`), so the
    # 4 it drafted, whatever the request's acceptance does to its tokens a round between the two modes
    fast = c._at_tree(shape, link, est.curve(0.0), tokens=5.0)
    chain = c.at("sd", 4, link, now=0.0)
    assert fast.round_s == pytest.approx(sent * est.draft_step_s + residual + 0.06 + link.transfer_s(
        80 + sent * 60, 100), rel=0.05)
    assert est.take_mode("MODE_15W") and key in est.restart  # the board's figure: measured again in this mode
    est.observe_sd(4, 4, 4 * 0.03, 0.06, 320, 100, 4 * 0.03 + 0.06 + 0.05, link, now=1.0)  # a slower draft step
    assert est.draft_step_s == pytest.approx(0.03)
    slow = c._at_tree(shape, link, est.curve(1.0), tokens=5.0)
    assert slow.round_s - fast.round_s == pytest.approx(sent * (0.03 - (0.8 * 0.01 + 0.2 * 0.02)))  # its drafting
    # in this mode's steps; its overhead the last mode's until measured here, not the chains' of this mode
    assert c.at("sd", 4, link, now=1.0).round_s != pytest.approx(chain.round_s)
    est.observe_tree(shape, 5, sent * 0.03, 0.06, 80 + sent * 60, 100, wall + 0.5, link, now=1.0, sent=sent)
    assert est.overhead(key) == pytest.approx(residual + 0.5 + sent * (0.02 - 0.03))  # replaced, not averaged
    assert est.take_mode("MAXN") and est.overhead(key) == pytest.approx(residual)  # back: that mode's own


def test_an_eta_chain_is_priced_at_what_the_census_read_it_would_commit_and_send():
    """At temperature 0 the census requests' reads (each token: agreed, the draft's confidence) say what the η-chain
    commits and sends a round (draft_stop.eta_chain_over_text): the prompts', carried to the request's prompt as
    their share of an i.i.d. chain's tokens at their own agreement times that chain's at the request's α, pulled
    toward by the request's own reads as ALPHA_BASE_ROUNDS rounds, each stretch of consecutive tokens apart; a
    forward for each draft sent.
    Before the census read 4 rounds, and above temperature 0, as before (its chain's expectation)."""
    shape, link = (8, 8, 1), Link(0.1)
    est = _estimates(0.8, 0.01, step_1=0.05, step_9=0.06)
    est.overhead_s = {"sd": 0.03}
    c = _controller(est, trees=[shape], tree_eta=0.4)
    _begin_past_opening(est)
    before = est.tree_tokens_per_round(shape, 0.4)
    assert est.eta_chain_read(8, 0.4) is None and before == pytest.approx(est.chain_tokens("sd", 8))
    est.begin_request(GREEDY, census=True)
    # 20 tokens, all agreed, every 5th below η: rounds of 5, 4, 4 and 4 drafts committing 6, 5, 5, 5
    text = [(100 + i, True, 0.3 if i % 5 == 4 else 0.9) for i in range(20)]
    est.observe_agreement(20, 20, text[:12])
    est.observe_agreement(8, 8, text[12:])
    assert est.census_marks == [tuple(text)]
    assert est.eta_chain_read(8, 0.4) is None  # the census running is not yet the prompts'
    _begin_past_opening(est)
    # the reads' 4 rounds all agreed: an i.i.d. chain of 8 commits 9 a round there, where these commit 21 of 4 × 9,
    # and send 17; carried to the request at its chain's tokens (its prior alone: nothing of its own yet)
    a, b, _ = est.belief("sd", own=False)
    m = a / (a + b)
    assert a + b == pytest.approx(8) and 0.8 < m < 1.0 and est.belief("sd") == pytest.approx((a, b, 1.0))
    chain = expected_tokens_beta(a, b, 8)
    assert est.eta_chain_read(8, 0.4) == pytest.approx((21 / 36 * chain, 17 / 36 * chain))
    # the request's own reads: two stretches of 3 sure-but-below-η tokens, 2 rounds each (1 draft, 2 tokens); read
    # as one stretch of 6 they would be 3
    own = [(300 + i, True, 0.3) for i in range(3)] + [(310 + i, True, 0.3) for i in range(3)]
    est.observe_agreement(6, 6, own)
    # its 6 agreed of 6 move its α from the prompts' m (the census's 20 agreed moved that above 0.8), worth 8
    # drafts, and its chain's tokens with it; the reads' share of their yardstick carried to that
    assert est.belief("sd") == pytest.approx((8 * m + 6, b, 1.0))
    chain = expected_tokens_beta(8 * m + 6, b, 8)
    assert chain > expected_tokens_beta(a, b, 8)
    tokens, sent = (21 / 36 * chain * 4 + 8) / (4 + 4), (17 / 36 * chain * 4 + 4) / (4 + 4)
    assert est.eta_chain_read(8, 0.4) == pytest.approx((tokens, sent))
    assert est.tree_tokens_per_round(shape, 0.4) == pytest.approx(tokens)
    assert est.tree_tokens_per_round(shape) == pytest.approx(est.chain_tokens("sd", 8))  # one η does not end:
    # its chain's expectation (the reads moved the request's α)
    priced = c._at_tree(shape, link, est.curve(0.0))
    assert priced.tokens_per_round == pytest.approx(tokens)
    device = dataclasses.replace(est.device(False, "sd_tree 8x8x1"), draft_step_s=est.draft_step_s * sent / 8)
    want = predict_tree(8, 8, tokens, 20, link, device, est.cloud(est.curve(0.0), "sd_tree 8x8x1"), est.wire(), sent)
    assert priced.round_s == pytest.approx(want.round_s) and priced.cloud_s_per_token == pytest.approx(
        want.cloud_s_per_token)
    est.acceptance[("sd", "T=1")] = Acceptance(accepted=0.8, examined=1.0, rounds=10 ** 9)
    est.up_per_row[("sd", "T=1")] = 60.0
    _begin_past_opening(est, "T=1")
    est.observe_agreement(3, 6, own)  # above temperature 0 a read has no marks: any given are not kept
    assert est.eta_chain_read(8, 0.4) is None and est.request_marks == []
    assert est.tree_tokens_per_round(shape, 0.4) == pytest.approx(est.chain_tokens("sd", 8))


def test_what_an_eta_chain_sends_past_its_rejected_draft_is_priced_from_the_drafts_confidence_after_its_own_tokens():
    """Whether a round goes on past its first rejected draft the reads say exactly (that draft's confidence is read);
    past it the draft drafts along its own text, which no read saw: each draft there is priced to go on with the
    share c of the read positions after one the draft named (their context ends with its own token, as its own
    text's does) that are at least η, pooled as the reads' rounds are (draft_stop.EtaReads.past). By hand: a census
    of 16 tokens, each 4 a rejected confident draft, two agreed and one below η: 5 rounds, 17 tokens, 13 sent to and
    with a rejection, one round that went on past its rejected draft with room for 7; of the 11 positions after an
    agreed one, 7 at least η. The request's own rounds of the η-chain count as rounds of it (their tokens and their
    drafts sent); on a new request they are no longer its own. A hard prompt's own reads, each rejected draft below
    η: rounds that end there, none priced past it."""
    shape, link = (8, 8, 1), Link(0.1)
    est = _estimates(0.8, 0.01, step_1=0.05, step_9=0.06)
    est.begin_request(GREEDY, census=True)
    est.opening = False
    text = [(100 + i, i % 4 != 0, 0.3 if i % 4 == 3 else 0.9) for i in range(16)]
    est.observe_agreement(12, 16, text)
    _begin_past_opening(est)
    w = 4 / 5  # the census's 5 rounds as ALPHA_BASE_ROUNDS; its part before any rejection carried to the request as
    # its share of an i.i.d. chain's tokens at its 12 agreed of 16
    past = eta_tail(7 / 11, 7)
    assert 1 < past < 7
    c = est.chain_tokens("sd", 8) / expected_tokens(0.75, 8)
    assert est.eta_chain_read(8, 0.4) == pytest.approx((w * c * 17 / 4, (w * c * 13 + w * past) / 4))
    for tokens, sent, accepted in ((2, 3, 1), (5, 4, 4), (1, 1, 0)):
        est.observe_tree(shape, tokens, sent * 0.01, 0.05, 80, 100, sent * 0.01 + 0.2, link, now=0.0, sent=sent,
                         accepted=accepted)
    c = est.chain_tokens("sd", 8) / expected_tokens(0.75, 8)  # their drafts moved the request's α
    assert est.eta_chain_read(8, 0.4) == pytest.approx(((w * c * 17 + 8) / 7, (w * c * 13 + w * past + 8) / 7))
    _begin_past_opening(est)  # a new request: the chain's rounds are no longer its own
    c = est.chain_tokens("sd", 8) / expected_tokens(0.75, 8)
    assert est.eta_chain_read(8, 0.4) == pytest.approx((w * c * 17 / 4, (w * c * 13 + w * past) / 4))
    ctl = _controller(est, trees=[shape], tree_eta=0.4)
    assert ctl._at_tree(shape, link, est.curve(0.0)).tokens_per_round == pytest.approx(w * c * 17 / 4)
    hard = [(200 + i, False, 0.2) for i in range(5)]  # a hard prompt's own reads: each rejected draft below η ends
    est.observe_agreement(0, 5, hard)  # its round there, exactly: 5 rounds of 1 sent, none priced past it; the
    # prompts' part before any rejection carried to its α, which the 5 rejected lowered
    share = w * est.chain_tokens("sd", 8) / expected_tokens(0.75, 8)
    assert est.chain_tokens("sd", 8) < est.chain_tokens("sd", 8, own=False)
    assert est.eta_chain_read(8, 0.4) == pytest.approx(((share * 17 + 5) / (4 + 5), (share * 13 + w * past + 5) / 9))
    sure = [(300 + i, i != 1, 0.9) for i in range(4)]  # its reads go on: a round of 2 drafts that went on past
    est.observe_agreement(3, 4, sure)  # its confident rejected one with room for 6, and 2 more positions after a
    # named one, both sure: c = (w·7 + 2) / (w·11 + 2), the pool's worth its 4 rounds; the text's end cuts the
    # next round after its 2 drafts, accepted and sure: at least 3 tokens and 3 sent to come, no round more
    onward = (w * 7 + 2) / (w * 11 + 2)
    share = w * est.chain_tokens("sd", 8) / expected_tokens(0.75, 8)
    assert est.eta_chain_read(8, 0.4)[0] == pytest.approx((share * 17 + 5 + 2 + 3) / 10)
    assert est.eta_chain_read(8, 0.4)[1] == pytest.approx(
        (share * 13 + 5 + 2 + w * eta_tail(onward, 7) + eta_tail(onward, 6) + 3) / 10)


def test_the_census_texts_are_weighed_by_how_likely_each_makes_the_requests_own_evidence():
    """The prompts' texts price a request's η-chain weighed by how likely each text's agreement makes the request's
    own evidence (draft_stop.eta_chain_pool): a request that has read nothing of its own is priced from them alike;
    one whose reads say its prompt is hard mostly from the hard text, what it sends past a rejection with it. By
    hand: an easy census text of 20 agreed sure tokens (2 whole rounds of 8 drafts, 18 tokens; 19 positions after a
    named one, all sure; agreement 21/22) and a hard one of 16 (5 rounds, 17 tokens, 13 sent, one round that went on
    with room 7; 11 after a named one, 7 sure; agreement 13/18); the request's own 5 rejected reads."""
    est = _estimates(0.8, 0.01, step_1=0.05, step_9=0.06)
    easy = [(100 + i, True, 0.9) for i in range(20)]
    hard = [(200 + i, i % 4 != 0, 0.3 if i % 4 == 3 else 0.9) for i in range(16)]
    for text in (easy, hard):
        est.begin_request(GREEDY, census=True)
        est.opening = False
        est.observe_agreement(sum(m[1] for m in text), len(text), text)
    _begin_past_opening(est)

    def priced(w_e: float, w_h: float, mine_rounds: int) -> tuple:
        rounds, tokens, sent = 2 * w_e + 5 * w_h, 18 * w_e + 17 * w_h, 16 * w_e + 13 * w_h
        yardstick = 18 * w_e + 5 * expected_tokens(0.75, 8) * w_h
        carried = 4 * est.chain_tokens("sd", 8) / yardstick  # the pool as ALPHA_BASE_ROUNDS rounds, carried
        c = (19 * w_e + 7 * w_h) / (19 * w_e + 11 * w_h)
        past = 4 / rounds * w_h * eta_tail(c, 7)
        return ((carried * tokens + mine_rounds) / (4 + mine_rounds),
                (carried * sent + past + mine_rounds) / (4 + mine_rounds))

    alike = est.eta_chain_read(8, 0.4)
    assert alike == pytest.approx(priced(1.0, 1.0, 0))  # nothing of its own: the texts alike
    est.observe_agreement(0, 5, [(300 + i, False, 0.2) for i in range(5)])  # 5 rounds of 1, each ended below η
    e, h = (1 / 22) ** 5, (5 / 18) ** 5
    w_e, w_h = 2 * e / (e + h), 2 * h / (e + h)
    assert w_h > 1.99
    weighed = est.eta_chain_read(8, 0.4)
    assert weighed == pytest.approx(priced(w_e, w_h, 5))
    assert weighed[1] < priced(1.0, 1.0, 5)[1]  # the hard text's rounds send less than the texts' alike


def test_a_draft_that_eta_ends_is_priced_in_steps_in_proportion_to_its_tokens():
    """η ends a draft near where its acceptance ends, so it drafts about what it commits (the η-chain of 8 on the Qwen
    pair: 2.6 drafts a round where it committed 2.25, 7.0 where 8.0). Its draft steps and nodes sent are priced in
    proportion to the tokens a round it is priced at (its measured steps per token committed, within 1..depth): on a
    prompt where it commits little it costs few steps (priced at the prompts' mean steps, its rounds there were
    1.55-1.7 s where they took 1.2 s, and chains of 3 ran in its place at low power under load). A tree that η does
    not end is priced at its measured steps whatever it commits."""
    from edge_runtime.auto_estimates import tree_key
    from hat_split.math.costmodel import predict_tree

    shape, link, key = (8, 8, 1), Link(0.1), "sd_tree 8x8x1"
    est = _estimates(0.6, 0.127, step_1=0.9, step_9=1.0)
    for tokens, sent in ((8, 7), (2, 2)) * 3:  # two prompts' rounds
        est.observe_tree(shape, tokens, sent * 0.127, 0.95, 80 + 60 * sent, 100, sent * 0.127 + 1.0, link, now=0.0,
                         sent=sent)
    steps, done = est.tree_draft_steps[shape], est.tree_step_tokens[shape]
    assert 2.0 < steps < done < 8.0  # moving averages over the same rounds (7 and 2 drafted, 8 and 2 committed)
    assert est.tree_steps_at(shape, 2.0) == pytest.approx(2.0 * steps / done)
    assert est.tree_steps_at(shape, 20.0) == 8.0 and est.tree_steps_at(shape, 0.1) == 1.0  # within 1..depth
    assert est.tree_steps_at((4, 4, 1), 2.0) is None  # not measured
    eta = _controller(est, eta=0.4)  # auto's η-chain
    configured = _controller(est, trees=[shape], tree_eta=0.4)  # a configured tree that the device's η ends ...
    full = _controller(est, trees=[shape])  # ... and one that nothing ends
    curve = est.curve(0.0)
    low = [ctl._at_tree(shape, link, curve, tokens=2.0) for ctl in (eta, configured, full)]
    scaled = 2.0 * steps / done
    device, wire = est.device(False, key), est.wire()
    by_hand = predict_tree(8, 8, 2.0, 20, link,
                           dataclasses.replace(device, draft_step_s=device.draft_step_s * scaled / 8),
                           est.cloud(curve, key),
                           dataclasses.replace(wire, up_per_draft=est.tree_up_per_node_of(shape)),
                           min(8.0, max(1.0, est.tree_sent_of(shape) * scaled / steps)))
    assert low[0].round_s == pytest.approx(by_hand.round_s) and low[1].round_s == pytest.approx(by_hand.round_s)
    assert low[2].round_s - low[0].round_s > 0.99 * (steps - scaled) * est.draft_step_s  # its measured steps
    assert tree_key(shape) == key
    high = eta._at_tree(shape, link, curve, tokens=9.0)  # a prompt it commits its whole depth on: 8 steps
    assert high.round_s - low[0].round_s > (8.0 - scaled) * est.draft_step_s


def _chain(est: AutoEstimates, depth: int) -> float:
    """sd's chain of `depth`: its tokens a round over the belief of the request's α (AutoEstimates.belief)."""
    a, b, _ = est.belief("sd")
    return expected_tokens_beta(a, b, depth)


def _pulled_tree(est: AutoEstimates, shape) -> float:
    """The prompts' tokens a round of `shape` pulled towards the chain of its depth at the request's α, worth
    ALPHA_BASE_ROUNDS rounds against the tree's own (AutoEstimates.tree_tokens_per_round), by hand."""
    from edge_runtime.acceptance import ALPHA_BASE_ROUNDS

    n, chain = est.tree_rounds_of(shape), _chain(est, shape[1])
    return (n * est.tree_tokens[(shape, est.kind)] + ALPHA_BASE_ROUNDS * chain) / (n + ALPHA_BASE_ROUNDS)


def test_one_easy_prompts_tree_rounds_do_not_open_the_next_prompt_on_the_tree():
    """A fresh runtime; one easy prompt's two rounds of a wide tree commit 7 tokens each (the η-chain's in the trace on
    `b4d7ebf`, loopback: the next two prompts opened on the tree, priced 1.1-1.3× llm, and ran at 0.7-0.8× it). The
    next request prices the tree from the prompts' 7 pulled towards the chain of its depth at the prompts' α (worth
    ALPHA_BASE_ROUNDS rounds, as the chains' α is pulled towards ALPHA_BASE): below the 7 that alone would say, and
    no longer above llm; after forty rounds of 6 the pull has faded."""
    shape = (16, 8, 2)  # a wide tree (a chain-shaped one is priced at its chain's α: tested apart)
    est = _estimates(0.75, 0.08, step_1=0.2, step_9=0.34)  # the CPU cloud here: a verify of 9 ≈ 1.7 steps
    c = _controller(est, trees=(shape,))
    for _ in range(2):
        est.observe_tree(shape, 7, 8 * 0.08, 0.34, 80 + 8 * 6, 100, 0.64 + 0.34 + 0.01, Link(0.01), now=0.0)
    est.begin_request()
    assert est.tree_tokens[(shape, GREEDY)] == pytest.approx(7.0)
    assert est.tree_tokens_per_round(shape) == pytest.approx(_pulled_tree(est, shape))
    assert est.tree_tokens_per_round(shape) < 5.0
    tree, llm = c.at_tree(shape, Link(0.01)), c.at("llm", 8, Link(0.01))
    assert tree.tokens_per_s < llm.tokens_per_s, (tree, llm)
    for _ in range(40):
        est.observe_tree(shape, 6, 8 * 0.08, 0.34, 80 + 8 * 6, 100, 0.64 + 0.34 + 0.01, Link(0.01), now=0.0)
    est.begin_request()
    assert est.tree_tokens_per_round(shape) > 5.7


def test_a_trees_tokens_a_round_are_the_requests_own_after_a_few_rounds():
    """The prompts' tokens a round of a tree (a moving average over requests) count as TREE_PRIOR_ROUNDS rounds
    against the request's own: a prompt whose tree commits 2 a round where the prompts' committed 6 is priced at
    its own pace within a few rounds (over lte the moving average alone kept such a prompt on the tree for 14 rounds
    at 0.66 × llm), and the next request starts from the prompts' again."""
    from edge_runtime.auto_estimates import TREE_PRIOR_ROUNDS

    shape = (16, 8, 2)  # a wide tree (a chain-shaped one is priced at its chain's α: tested apart)
    est = _estimates(0.8, 0.005, step_1=0.05, step_9=0.06)
    for _ in range(40):  # earlier requests: 6 tokens a round
        est.observe_tree(shape, 6, 0.04, 0.06, 200, 100, 0.2, Link(0.05), now=0.0, sent=6)
    _begin_past_opening(est)
    population = _pulled_tree(est, shape)
    assert est.tree_tokens_per_round(shape) == pytest.approx(population)
    for k in range(1, 5):
        est.observe_tree(shape, 2, 0.02, 0.06, 150, 100, 0.2, Link(0.05), now=0.0, sent=2)
        want = (TREE_PRIOR_ROUNDS * _pulled_tree(est, shape) + 2 * k) / (TREE_PRIOR_ROUNDS + k)
        assert est.tree_tokens_per_round(shape) == pytest.approx(want)
    assert est.tree_tokens_per_round(shape) < 3.4  # four rounds in: near the prompt's 2, not the prompts' 5.9
    _begin_past_opening(est)
    assert est.tree_tokens_per_round(shape) > 5.5  # the next prompt: the prompts' again


def test_a_trees_first_round_is_not_most_of_its_average():
    """The prompts' tokens a round of a tree are a plain mean over its first rounds, as a chain's acceptance is: a
    first round that committed all 9 tokens, then rounds of 3, read 4.2 after five rounds, where a moving average
    started at the first round (weight 0.98 on the history) read 8.6 — under load auto opened requests on the tree
    at 8–9 tokens a round where they then committed 2–5. The nodes a round sends likewise."""
    from edge_runtime.acceptance import ALPHA_POPULATION, population_ema

    shape = (16, 8, 2)  # a wide tree (a chain-shaped one is priced at its chain's α: tested apart)
    est = _estimates(0.8, 0.005, step_1=0.05, step_9=0.06)
    est.observe_tree(shape, 9, 0.04, 0.06, 200, 100, 0.2, Link(0.05), now=0.0, sent=8)
    for _ in range(4):
        est.observe_tree(shape, 3, 0.04, 0.06, 200, 100, 0.2, Link(0.05), now=0.0, sent=4)
    est.begin_request()
    assert est.tree_tokens[(shape, GREEDY)] == pytest.approx((9 + 4 * 3) / 5)
    assert est.tree_tokens_per_round(shape) == pytest.approx(_pulled_tree(est, shape))  # 4.2, pulled a little
    assert est.tree_sent[(shape, GREEDY)] == pytest.approx((8 + 4 * 4) / 5)
    started_at_the_first = 9.0
    for _ in range(4):
        started_at_the_first = ALPHA_POPULATION * started_at_the_first + (1 - ALPHA_POPULATION) * 3
    assert started_at_the_first > 8.5
    rounds = round(1 / (1 - ALPHA_POPULATION))  # past the plain mean's rounds, the moving average's weight
    assert population_ema(5.0, 3.0, rounds + 10) == pytest.approx(ALPHA_POPULATION * 5 + (1 - ALPHA_POPULATION) * 3)
    assert population_ema(None, 3.0, 1) == 3.0 and population_ema(5.0, 3.0, 2) == pytest.approx(4.0)


def test_the_eta_chain_is_measured_in_place_of_sds_best_and_then_priced_beside_it():
    """auto's η-chain (EdgeConfig.auto_eta): not run while llm is the best; where sd runs anyway it takes sd's place
    for MEASURE_ROUNDS rounds (`measuring sd's η-chain ...`), then is priced by its own rounds — the nodes η let
    through, the tokens they committed — and runs where it beats sd's chains; when it does not, it is probed in
    sd's place after PROBE_EVERY rounds without it. A configured tree of its shape runs instead of it."""
    shape = (8, 8, 1)
    llm_best = _controller(_estimates(0.05, 0.05, step_1=0.2, step_9=0.22), eta=0.4).decide(Link(0.01))
    assert llm_best.protocol == "llm" and llm_best.eta == 0.0, llm_best
    est = _estimates(0.8, 0.005, step_1=0.05, step_9=0.06)
    c = _controller(est, eta=0.4)
    assert c.eta_chain == shape
    for k in range(3):
        choice = c.decide(Link(0.1))
        assert (choice.protocol, choice.knob, choice.tree, choice.eta) == ("sd", 8, shape, 0.4), choice
        assert choice.reason == f"measuring sd's η-chain γ≤8 η=0.4 in place of sd's best: {k} of 3 rounds"
        est.observe_tree(shape, 5, 4 * 0.005, 0.055, 80 + 4 * 60, 100, 0.25, Link(0.1), now=0.0, sent=4)
        c.record(choice, 5)
    assert c.segments[0].as_dict()["eta"] == 0.4 and c.segments[0].as_dict()["tree"] == [8, 8, 1]
    assert est.overhead("sd_tree 8x8x1") > 0.0 == est.overhead("sd")  # its own (sd's chains measured none here)
    est.overhead_s["sd"] = est.overhead("sd_tree 8x8x1")  # the chains' rounds with the η-chain's overhead
    pick = c.decide(Link(0.1))  # 5 tokens for 4 drafts: more than any chain of γ commits at α 0.8
    assert pick.tree == shape and pick.eta == 0.4 and "sd_tree η-chain γ≤8 η=0.4" in pick.reason, pick
    # a prompt on which η ends every chain after one draft, accepted: sd's chains are faster (the drafts say the
    # prompt accepts, the η-chain commits 2 of its chain's 4.3), and the η-chain is probed
    slow = _estimates(0.8, 0.005, step_1=0.05, step_9=0.06)
    slow_c = _controller(slow, eta=0.4)
    for _ in range(3):
        slow.observe_tree(shape, 2, 0.005, 0.05, 80 + 60, 100, 0.2, Link(0.1), now=0.0, sent=1)
        slow_c.record(slow_c.decide(Link(0.1)), 2)
    chain = slow_c.decide(Link(0.1))
    assert chain.protocol == "sd" and chain.tree is None and chain.eta == 0.0, chain
    for _ in range(PROBE_EVERY):
        slow_c.record(chain, 4)
    probe = slow_c.decide(Link(0.1))
    assert probe.tree == shape and probe.reason == "probing sd's η-chain γ≤8 η=0.4: not run for 24 rounds", probe
    assert _controller(est, eta=0.4, trees=(shape,)).eta_chain is None  # the configured tree runs in its place
    assert _controller(est).eta_chain is None
    with pytest.raises(ValueError, match=r"η must be in \[0, 1\), got 1.0"):
        _controller(est, eta=1.0)


def test_several_tree_shapes_are_each_measured_and_the_fastest_is_run():
    """auto_trees: every shape is measured in turn (MEASURE_ROUNDS rounds each, in the configured order), then sd
    runs the one its own rounds price fastest — here the wide tree that commits 6 tokens a round over a narrow one
    that commits 5 or 3, at nearly the same cost — and the other is probed after PROBE_EVERY rounds without it
    while it is within reach (5 tokens a round: 0.83× the wide tree's price), not when it is not (3: 0.5×)."""
    from edge_runtime.auto import PROBE_EVERY

    narrow, wide = (8, 4, 2), (32, 6, 6)
    for narrow_tokens, probed in ((5, True), (3, False)):
        est = _estimates(0.7, 0.005, step_1=0.02, step_9=0.021)
        est.observed.observe(33, 0.022)
        c = _controller(est, trees=(narrow, wide))
        for shape, tokens in ((narrow, narrow_tokens), (wide, 6)):
            for _ in range(3):
                choice = c.decide(Link(0.1))
                assert choice.tree == shape and choice.reason.startswith(
                    f"measuring sd's tree {'{}x{}x{}'.format(*shape)}")
                est.observe_tree(shape, tokens, 4 * 0.005, 0.022, 80 + shape[0] * 6, 100, 0.04 + 0.1 + 0.024,
                                 Link(0.1), now=0.0)
                c.record(choice, tokens)
        pick = c.decide(Link(0.1))
        assert pick.protocol == "sd" and pick.tree == wide and "sd_tree 32x6x6" in pick.reason, pick
        for _ in range(PROBE_EVERY):
            c.record(pick, 6)
        probe = c.decide(Link(0.1))
        if probed:
            assert probe.tree == narrow and probe.reason.startswith("probing sd's tree 8x4x2"), probe
        else:  # out of reach: llm's one-token probe is what runs
            assert probe.tree is None and probe.reason.startswith("probing llm (one token)"), probe


def test_auto_trees_are_read_checked_and_kept_within_the_cloud():
    """EdgeConfig.auto_trees: parsed and deduplicated after tree_nodes' own tree; a malformed or oversized shape is
    refused in one line; the runtime clips each to the cloud's Welcome."""
    from edge_runtime.config import EdgeConfig
    from edge_runtime.runtime import tree_shapes
    from hat_split.wire import messages as P

    config = EdgeConfig(model="m", tree_nodes=8, tree_depth=4, tree_width=2, auto_trees="8x4x2, 32x6x6,16x4x4")
    assert config.tree_shapes == [(8, 4, 2), (32, 6, 6), (16, 4, 4)] and config.max_tree_nodes == 32
    assert EdgeConfig(model="m").max_tree_nodes == 0
    with pytest.raises(ValueError, match="'32x6' is not NODESxDEPTHxWIDTH"):
        EdgeConfig(model="m", auto_trees="32x6")
    with pytest.raises(ValueError, match="auto_trees: 2000x6x6 is beyond 1024 nodes"):
        EdgeConfig(model="m", auto_trees="2000x6x6")
    welcome = P.Welcome(1, "m", 10, "", 60.0, 8, 4096, ["sd"], max_tree_nodes=16, max_tree_depth=5)
    assert tree_shapes(config, welcome) == ((8, 4, 2), (16, 5, 6), (16, 4, 4))


@pytest.mark.real_models
def test_auto_with_a_tree_configured_measures_it_and_keeps_the_targets_tokens(smollm2, smollm2_server, monkeypatch):
    """A device configured for 8-node trees and one more shape: an auto request measures sd, then each tree, and its
    tokens are the target's greedy ones; an sd request's tree rounds teach auto the configured shape. Every shape is
    held within reach (READ_AHEAD_REACH 0): whether a tree could win on this machine's balance is not what is
    tested, and on a slow one it may not."""
    monkeypatch.setattr("edge_runtime.auto.READ_AHEAD_REACH", 0.0)
    from edge_runtime.config import EdgeConfig, LinkConfig
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.math.sampling import SamplingParams
    from hat_split.net.security import LinkSecurity

    config = EdgeConfig(model="smollm2-135m", tree_nodes=8, tree_depth=4, tree_width=2, auto_trees="12x3x4",
                        link=LinkConfig(smollm2_server.endpoint, security=LinkSecurity.plaintext()))
    with EdgeRuntime(config, smollm2) as rt:
        ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 48, seed=0)
        res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 48, seed=0)
        assert res.tokens == ref.tokens
        trees = [s for s in res.auto if s.get("tree") == [8, 4, 2]]
        assert trees and trees[0]["protocol"] == "sd" and trees[0]["reason"].startswith("measuring sd's tree")
        assert any(s.get("tree") == [12, 3, 4] and s["reason"].startswith("measuring sd's tree 12x3x4")
                   for s in res.auto), res.auto  # the second shape measured after the first
        before = rt.auto_estimates.tree_rounds_of((8, 4, 2))
        assert before == sum(s["rounds"] for s in trees), res.auto
        taught = rt.generate(PROMPT, "sd", SamplingParams(0.0), 16, seed=0)
        assert taught.tokens == ref.tokens[:16]
        assert rt.auto_estimates.tree_rounds_of((8, 4, 2)) == before + taught.rounds


@pytest.mark.real_models
def test_the_eta_chain_keeps_the_targets_tokens_and_an_sd_request_of_its_kind_teaches_it(smollm2, smollm2_server,
                                                                                         monkeypatch):
    """auto's η-chain rounds (forced here, between llm and sd rounds) draft chains of at most 8 that η ends, keep the
    target's greedy tokens and are measured as the shape 8x8x1 with the nodes they sent; a fixed sd request whose
    chains are the η-chain's (γ 8, draft_stop_prob = auto_eta) teaches it."""
    from edge_runtime.config import EdgeConfig, LinkConfig
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.math.sampling import SamplingParams
    from hat_split.net.security import LinkSecurity

    shape, eta = (8, 8, 1), 0.4
    script = itertools.cycle([Choice("sd", 8, "forced", {}, shape, eta), Choice("llm", 2, "forced", {}),
                              Choice("sd", 3, "forced", {})])
    config = EdgeConfig(model="smollm2-135m", auto_eta=eta,
                        link=LinkConfig(smollm2_server.endpoint, security=LinkSecurity.plaintext()))
    with EdgeRuntime(config, smollm2) as rt:
        ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 48, seed=0)
        with monkeypatch.context() as m:
            m.setattr(AutoController, "decide", lambda self, link, now=None, behind=0, remaining=0: next(script))
            res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 48, seed=0)
        assert res.tokens == ref.tokens
        chains = [s for s in res.auto if s.get("eta") == eta]
        assert chains and all(s["tree"] == [8, 8, 1] and s["knob"] == 8 for s in chains), res.auto
        est = rt.auto_estimates
        rounds = est.tree_rounds_of(shape)
        assert rounds == sum(s["rounds"] for s in chains) and 1.0 <= est.tree_sent_of(shape) <= 8.0
        rt.config = dataclasses.replace(config, draft_len=8, draft_stop_prob=eta)
        taught = rt.generate(PROMPT, "sd", SamplingParams(0.0), 24, seed=0)
        assert taught.tokens == ref.tokens[:24] and est.tree_rounds_of(shape) == rounds + taught.rounds
        rt.config = dataclasses.replace(config, draft_len=8, draft_stop_prob=0.0)  # whole chains are sd γ 8's
        rt.generate(PROMPT, "sd", SamplingParams(0.0), 16, seed=0)
        assert est.tree_rounds_of(shape) == rounds + taught.rounds


def test_a_chain_is_priced_over_the_prompts_it_may_be_not_at_their_mean():
    """Prompts whose own α spread 0.62-1.0 (the Qwen pair's four in the traces), run in turn, 32 tokens each by sd's
    chains of 4: at each next request's start its chain of 8 is priced within 8 % of what the prompts' own α give it
    on average (4-6 % below over seeds 0-3: the prior's spread of 8 drafts is a little tighter than theirs), where
    eq. 1 at the belief's mean α (the pricing before) is 14-16 % below; a chain of one is
    the same either way (E is linear in α there), and the mean α is unchanged (`posterior`)."""
    import random

    from edge_runtime.acceptance import posterior

    rng = random.Random(3)
    prompts = (1.0, 0.88, 0.72, 0.62)
    truth = sum(expected_tokens(a, 8) for a in prompts) / len(prompts)
    est = AutoEstimates()
    acc = est.acceptance.setdefault(("sd", GREEDY), Acceptance())
    belief, plug = [], []
    for request in range(400):
        est.begin_request()
        est.opening = False  # the rounds past the opening: the openings' own acceptance is apart from this
        if request >= 40:
            a, b, _ = est.belief("sd")
            assert est.alpha == pytest.approx(posterior(acc.population, 0, 0))
            assert est.chain_tokens("sd", 1) == pytest.approx(expected_tokens(est.alpha, 1))
            belief.append(est.chain_tokens("sd", 8) / truth)
            plug.append(expected_tokens(est.alpha, 8) / truth)
        alpha, tokens = prompts[request % len(prompts)], 0
        while tokens < 32:
            accepted = next((i for i in range(4) if rng.random() >= alpha), 4)
            acc.observe(4, accepted)
            tokens += accepted + 1
    assert abs(sum(belief) / len(belief) - 1.0) < 0.08
    assert sum(plug) / len(plug) < 0.88 and sum(belief) / len(belief) > sum(plug) / len(plug) + 0.08
    assert est.alpha_priced("sd", 8) > est.alpha  # what the cost model prices a chain of 8 at
    assert expected_tokens(est.alpha_priced("sd", 8), 8) == pytest.approx(est.chain_tokens("sd", 8))
