"""hat's measured cost rule for where a chain draft ends (hat_split.math.draft_stop), on hand-made streams: known
acceptance and round costs give known draft lengths; a drafter whose drafts the cloud keeps rejecting stops drafting."""
import math

import numpy as np
import pytest

from hat_split.math.draft_stop import (PROBE_EVERY, AcceptanceByConfidence, DraftGate, DraftStop, EtaReads,
                                       RoundCostFit, RoundCosts, eta_chain_over_text, eta_chain_pool, eta_tail,
                                       evidence_weights, read_agreement)


def test_acceptance_starts_at_the_drafts_own_probability_and_follows_what_is_verified():
    a = AcceptanceByConfidence()
    assert a.rate(0.93) == pytest.approx(0.95) and a.rate(0.31) == pytest.approx(0.35) and a.rate(1.0) == 0.95
    over = AcceptanceByConfidence()  # an overconfident drafter: its 0.9-probability drafts are mostly rejected
    for _ in range(200):
        over.observe([0.92], 0)
    assert over.rate(0.95) < 0.05 and over.rate(0.5) == pytest.approx(0.55)  # only the bin it was seen in moves
    good = AcceptanceByConfidence()
    for _ in range(200):
        good.observe([0.45, 0.45], 2)
    assert good.rate(0.41) > 0.95


def test_only_the_drafts_put_to_the_test_count():
    """Of a chain with 1 accepted, the first counts accepted, the second rejected, the rest never tested."""
    a = AcceptanceByConfidence()
    a.observe([0.15, 0.55, 0.95, 0.95], 1)
    assert a.seen.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    assert a.accepted.tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    a.observe([], 0)  # a round that sent no draft changes nothing
    assert a.seen.sum() == 2
    with pytest.raises(ValueError, match="3 accepted of 2 drafts"):
        a.observe([0.5, 0.5], 3)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got nan"):
        a.rate(float("nan"))


def test_the_cost_line_is_recovered_from_rounds_of_different_lengths():
    fit = RoundCostFit(1.0, 0.5)  # a prior far off
    for i in range(300):
        k = i % 4
        fit.observe(k, 0.2 + 0.05 * k)
    base, per_draft = fit.line()
    assert base == pytest.approx(0.2, abs=0.02) and per_draft == pytest.approx(0.05, abs=0.01)
    assert fit.cost(3) == pytest.approx(0.35, abs=0.03)


def test_rounds_of_one_length_keep_the_prior_slope():
    fit = RoundCostFit(0.2, 0.0)
    for _ in range(100):
        fit.observe(1, 0.30)
    assert fit.line() == pytest.approx((0.2, 0.1), abs=0.01)  # the data's level through the prior's k = 0 point
    never_negative = RoundCostFit(0.3, 0.0)
    for k in (0, 1, 2, 3) * 20:
        never_negative.observe(k, 0.3 - 0.02 * k)  # longer rounds faster: noise, not a negative cost
    assert never_negative.line()[1] == 0.0
    with pytest.raises(ValueError, match="a round of 1 drafts in nan s"):
        fit.observe(1, float("nan"))
    with pytest.raises(ValueError, match="must be > 0"):
        RoundCostFit(0.0, 0.1)


def test_a_rounds_cost_is_built_from_its_measured_parts():
    """per_draft = the draft step + the verification's slope + the uplink; base = the rest + the verification of one
    position. Rounds whose verification grows 20 ms a draft, with 50 ms draft steps and 150 ms of link."""
    costs = RoundCosts.first(1, 0.05 + 0.1 + 0.12 + 0.02, 0.05, 0.12, wire_s=0.001)
    assert costs.line() == pytest.approx((0.12 + 0.12, 0.05 + 0.001))  # the verification flat until measured
    for i in range(300):
        k = i % 3
        verify = 0.1 + 0.02 * k
        costs.observe(k, 0.15 + 0.05 * k + verify, 0.05 if k else None, verify, wire_s=0.001)
    base, per_draft = costs.line()
    assert base == pytest.approx(0.25, abs=0.01) and per_draft == pytest.approx(0.071, abs=0.005)
    with pytest.raises(ValueError, match="a round of nan s"):
        costs.observe(1, float("nan"), 0.05, 0.1)


def test_a_draft_is_kept_while_it_lowers_the_expected_time_per_token():
    """R(k) = 0.2 + 0.05 k, a(c) = c's bin middle: 0.95, 0.95 repay their cost, a 0.35 after them does not
    (P3 · R(2) = 0.9025 · 0.35 · 0.30 = 0.095 < c · E(2) = 0.05 · 2.855 = 0.143)."""
    stop = DraftStop(AcceptanceByConfidence(), RoundCostFit(0.2, 0.05))
    assert [stop.admit(c) for c in (0.97, 0.96, 0.33)] == [True, True, False]
    assert stop.drafts == 2 and stop.expected == pytest.approx(1 + 0.95 + 0.95 ** 2)
    assert stop.offered == [0.97, 0.96, 0.33]
    free = DraftStop(AcceptanceByConfidence(), RoundCostFit(0.2, 0.0))  # a free draft is always worth sending
    assert all(free.admit(0.05) for _ in range(8))
    dear = DraftStop(AcceptanceByConfidence(), RoundCostFit(0.2, 0.25))  # costs more than a round: never
    assert not dear.admit(0.99) and dear.drafts == 0


def test_the_threshold_follows_the_cost_ratio():
    """The first draft is kept iff a(c) > per_draft / base: the confidence it takes rises with the draft's cost."""
    def lowest_kept(per_draft):
        for c in np.arange(0.0, 1.0, 0.1):
            if DraftStop(AcceptanceByConfidence(), RoundCostFit(1.0, per_draft)).admit(float(c) + 0.01):
                return round(float(c), 1)
        return math.inf
    assert [lowest_kept(x) for x in (0.01, 0.2, 0.5, 0.9)] == [0.0, 0.2, 0.5, 0.9]


def test_a_drafter_the_cloud_keeps_rejecting_stops_drafting_and_probes():
    """First drafts at probability ~0.8, all rejected: after a few rounds the rule refuses them, and the gate skips
    the draft step in all rounds but one in PROBE_EVERY; a good drafter's step always runs."""
    acc, costs, gate = AcceptanceByConfidence(), RoundCostFit(0.25, 0.06), DraftGate()
    sent = []
    for _ in range(40):
        stop = DraftStop(acc, costs)
        kept = stop.admit(0.81)
        gate.observe(0.81)
        acc.observe([0.81] if kept else [], 0)
        sent.append(kept)
    assert sent[0] and not any(sent[-30:])
    runs = []
    for _ in range(3 * PROBE_EVERY):
        runs.append(gate.worth(acc, costs, 0.03))
        if runs[-1]:  # a probe: the step ran, its draft seen (and refused)
            gate.observe(0.81)
    assert runs == ([False] * (PROBE_EVERY - 1) + [True]) * 3
    probe = DraftStop(acc, costs, probe=True)  # a probe sends its first draft, not a second one that does not pay
    assert probe.admit(0.81) and not probe.admit(0.81)
    good_acc, good_gate = AcceptanceByConfidence(), DraftGate()
    for _ in range(40):
        good_acc.observe([0.81], 1)
        good_gate.observe(0.81)
    assert all(good_gate.worth(good_acc, costs, 0.03) for _ in range(20))
    assert DraftGate().worth(acc, costs, 0.03)  # nothing seen yet: run the step


def test_the_config_names_what_it_refuses():
    from edge_runtime.config import SplitConfig

    assert SplitConfig(draft_stop="cost").draft_stop == "cost"
    with pytest.raises(ValueError, match="draft_stop must be one of eta, cost, got 'fast'"):
        SplitConfig(draft_stop="fast")
    with pytest.raises(ValueError, match="sizes chains; a draft tree is sized by tree_nodes"):
        SplitConfig(draft_stop="cost", tree_nodes=8)


def test_an_eta_chain_over_a_read_text_commits_its_accepted_drafts_and_one_and_sends_until_eta():
    """By hand. All agreed, all sure, depth 4 over 10 tokens: two rounds of 4 drafts and 5 tokens. A rejection at
    position 1 ends what the round commits (2: one accepted and the target's) and what the text can say it sends
    (2, to and with the rejected draft); that draft is sure (0.9 >= η) and short of the depth, so the round went on
    past it with room for 6 more, counted apart (what it sends there is along its own text, not the one read); the
    next round, from position 2, drafts that one alone (0.3 < η), accepted: 2 tokens, 1 sent; the third, from 4,
    reaches the text's end before its drafts do: not a whole round, kept apart as cut (its 4 drafts accepted and
    sure: it commits and sends at least 5; a text that ends at a round's end cuts none). A round whose rejected
    draft is below η, or at the depth,
    ends there and is not counted as going on. Beside them, the positions after one the draft named (its own token
    ends their context) and of those the ones at least η: every position after an agreed one but the last."""
    whole = eta_chain_over_text([True] * 10, [0.9] * 10, 4, 0.4)
    assert whole == EtaReads(2, 10, 8, (0, 0, 0), 9, 9) and whole.went_on() == 0 and whole.past() == 0.0
    agreed = [True, False, True, True, True, True, True, True]
    sure = [0.9, 0.9, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9]
    went = (0, 0, 0, 0, 0, 1, 0)  # room for 6 past the rejected draft
    assert eta_chain_over_text(agreed, sure, 8, 0.4) == EtaReads(2, 4, 3, went, 6, 6, cut=5)
    assert eta_chain_over_text(agreed, sure, 8, 0.0) == EtaReads(1, 2, 2, went, 6, 6, cut=7)  # without η: the
    # second round drafts on to the text's end, cut after 6 drafts
    assert eta_chain_over_text([False] * 3, [0.2] * 3, 8, 0.4) == EtaReads(3, 3, 3, (0,) * 7, 0, 0)  # each below η
    assert eta_chain_over_text([False, True], [0.9, 0.9], 2, 0.4) == EtaReads(1, 1, 1, (1,), 0, 0, cut=2)  # room 1
    assert eta_chain_over_text([True, False, True], [0.9] * 3, 2, 0.4) == EtaReads(1, 2, 2, (0,), 1, 1, cut=2)  # depth
    assert eta_chain_over_text([True, True, True], [0.9, 0.3, 0.9], 8, 0.4) == EtaReads(1, 3, 2, (0,) * 7, 2, 1)
    assert eta_chain_over_text([], [], 8, 0.4) == EtaReads(0, 0, 0, (0,) * 7, 0, 0)
    with pytest.raises(ValueError, match="2 agreements for 1"):
        eta_chain_over_text([True, True], [0.5], 8, 0.4)
    with pytest.raises(ValueError, match="depth >= 1"):
        eta_chain_over_text([True], [0.5], 0, 0.4)
    with pytest.raises(ValueError, match="η in"):
        eta_chain_over_text([True], [0.5], 8, float("nan"))


def test_an_eta_chain_over_reads_runs_over_each_stretch_of_consecutive_positions_apart():
    """By hand. One read of 10 consecutive sure, agreed positions at depth 4: two whole rounds (the text ends
    with the second: none cut), 9 positions after an agreed one. The same 10 marks with a gap after position 4 (a
    drafting round between two reads) are two stretches of 5: each one whole round of 4 drafts and 5 tokens, none
    across the gap, 4 positions after an agreed one each; a stretch of 3 is cut after its 3 drafts (at least 4 to
    come). Two reads sum; no reads, nothing. `chain`: an i.i.d. chain's tokens over as many rounds at the agreement
    of the positions those rounds covered: 5 a round at agreement 1; a stretch of 6 with its second position
    rejected at depth 2 runs two whole rounds (2 and 3 tokens: positions 0-4, 4 of 5 agreed) and is cut in its
    third: 2 × (1 + 0.8 + 0.64)."""
    from hat_split.math.draft_stop import eta_chain_over_reads

    whole = [(p, True, 0.9) for p in range(10)]
    assert eta_chain_over_reads([whole], 4, 0.4) == EtaReads(2, 10, 8, (0, 0, 0), 9, 9, 10.0)
    gapped = [(p, True, 0.9) for p in range(5)] + [(p, True, 0.9) for p in range(9, 14)]
    assert eta_chain_over_reads([gapped], 4, 0.4) == EtaReads(2, 10, 8, (0, 0, 0), 8, 8, 10.0)
    assert eta_chain_over_reads([gapped[:5], gapped[5:]], 4, 0.4) == EtaReads(2, 10, 8, (0, 0, 0), 8, 8, 10.0)
    assert eta_chain_over_reads([gapped[:3], gapped[5:]], 4, 0.4) == EtaReads(1, 5, 4, (0, 0, 0), 6, 6, 5.0, 4)
    mixed = [(20 + p, p != 1, 0.9) for p in range(6)]
    got = eta_chain_over_reads([mixed], 2, 0.4)
    assert got[:6] == (2, 5, 4, (0,), 4, 4) and got.chain == pytest.approx(2 * 2.44)
    assert eta_chain_over_reads([mixed, whole], 2, 0.4).chain == pytest.approx(2 * 2.44 + 3 * 3.0)
    assert eta_chain_over_reads([], 4, 0.4) == eta_chain_over_reads([()], 4, 0.4) == EtaReads(0, 0, 0, (0,) * 3,
                                                                                              0, 0, 0.0)


def test_what_a_round_sends_past_its_rejected_draft_is_a_geometric_tail_at_the_drafts_onward_confidence():
    """By hand. Past its rejected draft a round drafts along its own text, each draft going on with probability c
    (the share of positions after one the draft named that are at least η): with room for m more it sends
    1 + c + ... + c^(m - 1). c = 1: all m; c = 0: the one; c = 0.5, m = 3: 1.75. Rounds with rooms 3 and 1 at the
    counts' own c (3 of 4): 1 + 0.75 + 0.5625 and 1. Counts sum and scale (the prompts' reads worth fewer rounds)."""
    assert eta_tail(1.0, 6) == 6.0 and eta_tail(0.0, 6) == 1.0 and eta_tail(0.5, 3) == pytest.approx(1.75)
    assert eta_tail(0.7, 0) == 0.0
    for c, m in ((1.2, 3), (-0.1, 3), (float("nan"), 3), (0.5, -1)):
        with pytest.raises(ValueError, match="a tail needs"):
            eta_tail(c, m)
    counts = EtaReads(4, 9, 6, (1, 0, 1), 4, 3)
    assert counts.went_on() == 2 and counts.past() == pytest.approx(1 + 0.75 + 0.5625 + 1)
    assert counts.past(onward=0.0) == 2.0 and counts.past(onward=1.0) == 4.0
    assert EtaReads(4, 9, 6, (1, 0, 1), 0, 0).past() == 2.0  # no position after a named one: the rejected's next alone
    more = counts.plus(EtaReads(1, 2, 1, (0, 1), 1, 0, 2.5))
    assert more == EtaReads(5, 11, 7, (1, 1, 1), 5, 3, 2.5)
    half = counts.times(0.5)
    assert (half.rounds, half.tokens, half.sent, half.rooms, half.onward, half.sure) == (2, 4.5, 3, (0.5, 0, 0.5), 2,
                                                                                          1.5)


def test_the_prompts_texts_are_weighed_by_how_likely_each_makes_the_requests_own_evidence():
    """A text's agreement is its Beta(1 + agreed, 1 + rejected) mean; texts are weighed by α^accepted (1 − α)^rejected
    of the request's own drafts, scaled to a mean of 1, and their η-chain counts pooled so. By hand: agreements 1/2
    and 1/4 against 2 accepted and 1 rejected: 1/8 and 3/64, i.e. 16/11 and 6/11."""
    assert read_agreement([(0, True, 0.9), (1, True, 0.9), (2, False, 0.9), (3, True, 0.2)]) == pytest.approx(4 / 6)
    assert read_agreement([]) == 0.5 and read_agreement([(0, True, 1.0)]) == pytest.approx(2 / 3)
    assert evidence_weights([0.5, 0.25], 2, 1) == pytest.approx([16 / 11, 6 / 11])
    assert evidence_weights([0.5, 0.25], 0, 0) == [1.0, 1.0] and evidence_weights([], 3, 4) == []
    far = evidence_weights([0.95, 0.6], 0, 400)  # much evidence of a hard prompt: the easy text all but drops out
    assert far[0] < 1e-100 and far[1] == pytest.approx(2.0)
    for alphas, acc, rej in (([1.0], 1, 1), ([0.0], 1, 1), ([math.nan], 1, 1), ([0.5], -1, 0), ([0.5], 0, math.inf),
                             ([0.5], math.nan, 0)):
        with pytest.raises(ValueError):
            evidence_weights(alphas, acc, rej)
    a = EtaReads(2, 10, 8, (1, 0, 0), 4, 3, 12.0)
    b = EtaReads(4, 6, 5, (0, 0, 2), 2, 0, 8.0)
    pooled = eta_chain_pool([(a, 0.5), (b, 0.25)], 2, 1, 4)
    want = a.times(16 / 11).plus(b.times(6 / 11))
    assert pooled.rounds == pytest.approx(56 / 11) and pooled.chain == pytest.approx(240 / 11)
    for got, expected in zip(pooled, want):
        assert got == pytest.approx(expected)
    assert tuple(eta_chain_pool([(a, 0.5), (b, 0.25)], 0, 0, 4)) == tuple(a.plus(b))
    empty = eta_chain_pool([], 5, 5, 4)
    assert empty.rounds == 0 and empty.rooms == (0, 0, 0)
