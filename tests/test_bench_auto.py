"""`hat-bench auto` (profiles.bench.bench_auto): the trace's phases, the pace after the first reply, the summary's
ratios and model errors; and one short trace end to end on the real SmolLM2 (a cloud process, a link emulator whose
profile changes, a cut, two load devices)."""
from __future__ import annotations

import json

import pytest

from profiles.bench.bench_auto import (ALPHA_GRID, Phase, at_alpha, chain_rows, paired, parse_trace, priced_as,
                                      steady_rate, summarise, tree_rows)


def test_the_trace_parses_and_refuses_what_it_cannot_run():
    assert parse_trace("loopback, cut:lte,load:wifi-near") == [
        Phase("loopback", "loopback"), Phase("cut:lte", "lte", cut=True), Phase("load:wifi-near", "wifi-near",
                                                                                 load=True)]
    assert parse_trace("load+power:lte") == [Phase("load+power:lte", "lte", load=True, power=True)]
    for bad in ("storm:lte", "load+storm:lte", "+:lte"):
        with pytest.raises(ValueError, match="KINDS one or more of cut, load, power"):
            parse_trace(bad)
    with pytest.raises(ValueError, match="moon-link"):
        parse_trace("moon-link")
    with pytest.raises(ValueError, match="no phase"):
        parse_trace(" , ")


def test_tree_rows_are_named_by_their_shape_and_refuse_what_is_not_one():
    assert tree_rows("16x4x4, 32x6x4") == {
        "sd_t16d4w4": {"tree_nodes": 16, "tree_depth": 4, "tree_width": 4, "draft_stop_prob": 0.0},
        "sd_t32d6w4": {"tree_nodes": 32, "tree_depth": 6, "tree_width": 4, "draft_stop_prob": 0.0}}
    # η ends a shape early: 8x8x1 is a chain of at most 8 that ends on its draft's confidence, named with its η
    assert tree_rows("8x8x1", 0.4) == {
        "sd_t8d8w1_e0.4": {"tree_nodes": 8, "tree_depth": 8, "tree_width": 1, "draft_stop_prob": 0.4}}
    assert tree_rows("") == {}
    with pytest.raises(ValueError, match="NODESxDEPTHxWIDTH"):
        tree_rows("16x4")
    for eta in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="--eta must be in"):
            tree_rows("8x8x1", eta)


def test_the_pace_after_the_first_reply_leaves_out_its_tokens():
    """llm commits 8 tokens a reply: 24 tokens in 3 replies 0.1 s apart are 80 tok/s after the first, not 230."""
    assert steady_rate([(1.0, 8), (1.1, 8), (1.2, 8)]) == pytest.approx(80.0)
    assert steady_rate([(1.0, 8)]) == 0.0


def test_the_summary_compares_auto_with_the_best_fixed_protocol_and_the_model_with_the_measurement():
    def row(phase, protocol, rep, tokens, total, steady, predicted=None):
        return {"rep": rep, "phase": phase, "protocol": protocol, "tokens": tokens, "total_s": total, "ttft_s": 0.3,
                "steady_tokens_per_s": steady, "cloud_s_per_token": 0.02, "up_bytes_per_token": 10.0,
                "degraded": 0, **({"predicted": predicted} if predicted else {})}

    rows = [row("lte", "llm", 0, 32, 4.0, 9.0), row("lte", "sd", 0, 32, 2.0, 18.0),
            row("lte", "auto", 0, 32, 2.2, 16.0, {"sd": 20.0, "llm": 9.9})]
    s = summarise(rows, [Phase("lte", "lte")], ["llm", "sd", "auto"])
    assert s["lte"]["best_fixed"] == "sd" and s["lte"]["auto_over_best_fixed"] == pytest.approx(2.0 / 2.2)
    assert s["lte"]["model_error"]["sd"]["median_abs_error"] == pytest.approx(2 / 18)
    assert s["lte"]["model_error"]["llm"]["median_abs_error"] == pytest.approx(0.1)
    assert s["lte"]["model_error"]["sd"]["phase_mean_error"] == pytest.approx(20 / 18 - 1)  # signed: above
    assert s["lte"]["auto_over_best_fixed_per_request"] == [pytest.approx((32 / 2.2) / (32 / 2.0))]
    assert s["overall"]["protocols"]["auto"]["n"] == 1
    assert s["overall"]["protocols"]["llm"]["drops"] == 0  # a row before drops were kept counts none
    rows[0]["drops"] = 2
    assert summarise(rows, [Phase("lte", "lte")], ["llm", "sd", "auto"])["lte"]["protocols"]["llm"]["drops"] == 2
    assert "median_abs_error_own_alpha" not in s["lte"]["model_error"]["sd"]  # no α grid: only the online figure
    # the model at the request's own α: sd measured 18 tok/s at α 0.7; the grid predicts 10 + 10 α, 17 at α 0.7
    rows[1]["alpha"] = 0.7
    rows[2]["predicted"]["sd_by_alpha"] = [10.0 + 10.0 * a for a in ALPHA_GRID]
    s = summarise(rows, [Phase("lte", "lte")], ["llm", "sd", "auto"])
    assert s["lte"]["model_error"]["sd"]["median_abs_error_own_alpha"] == pytest.approx(1 / 18)
    assert at_alpha(rows[2]["predicted"]["sd_by_alpha"], 0.725) == pytest.approx(17.25)


def test_the_models_error_covers_the_chain_and_draft_tree_rows_at_autos_price_of_their_shape():
    """The η-chain row sd_g8_e0.4 beside the tree row sd_t8d8w1_e0.4 drafts the same chains: both at auto's price of
    the configured tree t8d8w1; alone, at its own η-chain's (g8_e0.4); a chain of γ at sd_by_gamma; others none."""
    both = ["llm", "sd", "sd_g8_e0.4", "sd_t8d8w1_e0.4", "sd_g6", "auto"]
    assert priced_as("sd_t8d8w1_e0.4", both) == ("sd_trees", "t8d8w1")
    assert priced_as("sd_g8_e0.4", both) == ("sd_trees", "t8d8w1")
    assert priced_as("sd_g8_e0.4", ["sd_g8_e0.4"]) == ("sd_trees", "g8_e0.4")
    assert priced_as("sd_t16d4w4", both) == ("sd_trees", "t16d4w4")
    assert priced_as("sd_g6", both) == ("sd_by_gamma", 5)
    assert [priced_as(n, both) for n in ("sd", "llm", "auto", "hlm")] == [None] * 4

    def row(protocol, steady, predicted=None):
        return {"rep": 0, "phase": "lte", "protocol": protocol, "tokens": 32, "total_s": 32 / steady, "ttft_s": 0.3,
                "steady_tokens_per_s": steady, "cloud_s_per_token": 0.02, "up_bytes_per_token": 10.0,
                "degraded": 0, **({"predicted": predicted} if predicted else {})}

    predicted = {"sd": 9.0, "llm": 8.0, "sd_trees": {"t8d8w1": 6.0}, "sd_by_gamma": [5, 6, 7, 8, 9, 12.0]}
    rows = [row("llm", 8.0), row("sd", 10.0), row("sd_g8_e0.4", 8.0), row("sd_t8d8w1_e0.4", 7.5), row("sd_g6", 10.0),
            row("auto", 9.0, predicted)]
    err = summarise(rows, [Phase("lte", "lte")], both)["lte"]["model_error"]
    assert err["sd_g8_e0.4"]["phase_mean_error"] == pytest.approx(6 / 8 - 1)
    assert err["sd_t8d8w1_e0.4"]["median_abs_error"] == pytest.approx(1.5 / 7.5)
    assert err["sd_g6"]["phase_mean_error"] == pytest.approx(0.2)
    assert set(err) == {"llm", "sd", "sd_g8_e0.4", "sd_t8d8w1_e0.4", "sd_g6"}
    del predicted["sd_trees"]  # a report before auto priced trees: the tree rows have no error, the others do
    assert set(summarise(rows, [Phase("lte", "lte")], both)["lte"]["model_error"]) == {"llm", "sd", "sd_g6"}


def test_the_models_error_at_the_same_request_takes_only_requests_of_one_protocol():
    """auto's prediction at its request's end for the protocol it ran throughout, against that request's own pace:
    llm 9 against 10 (10 %), sd's trees 20 against 16 (25 %) and 15 against 16; a request that switched, or kept no
    pace, is left out."""
    from profiles.bench.bench_auto import same_request_errors

    def auto(ran, steady, **predicted):
        return {"protocol": "auto", "steady_tokens_per_s": steady, "predicted": predicted,
                "auto": [{"protocol": p, "tokens": 8} for p in ran]}

    rows = [auto(["llm", "llm"], 10.0, llm=9.0, sd=30.0), auto(["sd"], 16.0, sd=20.0, llm=1.0),
            auto(["sd", "sd"], 16.0, sd=15.0), auto(["sd", "llm"], 10.0, sd=1.0, llm=1.0),
            auto(["llm"], 0.0, llm=5.0), {"protocol": "llm", "steady_tokens_per_s": 10.0}]
    errors = same_request_errors(rows)
    assert errors["llm"] == {"n": 1, "median_abs_error": pytest.approx(0.1), "max_abs_error": pytest.approx(0.1)}
    assert errors["sd"]["n"] == 2 and errors["sd"]["max_abs_error"] == pytest.approx(0.25)
    assert errors["sd"]["median_abs_error"] == pytest.approx((0.25 + 1 / 16) / 2)
    assert same_request_errors([]) == {}


def test_the_clouds_compute_a_token_is_priced_on_the_reported_curve_at_the_rows_own_rounds():
    """The curve auto held (g(1) = 0.1 s, g(5) = 0.2 s) at each fixed row's rounds: llm's 10 decodes over 11 tokens
    against 0.1 s measured (−9 %); sd's 5 rounds of 4 drafts over 21 tokens against 0.05 s (−5 %), its rounds
    recorded or, in an older row, tokens − 1 − accepted; rows of another repetition, auto's own, and a row with no
    cloud seconds are left out."""
    from profiles.bench.bench_auto import cloud_model_error

    est = {"estimates": {"curve": [[1.0, 0.1], [9.0, 0.3]]}}
    base = {"rep": 0, "phase": "lte"}
    rows = [{**base, "protocol": "auto", "predicted": est, "tokens": 21, "drafted": 8, "accepted": 8,
             "cloud_s_per_token": 0.05},
            {**base, "protocol": "llm", "tokens": 11, "drafted": 0, "accepted": 0, "cloud_s_per_token": 0.1},
            {**base, "protocol": "sd", "tokens": 21, "drafted": 20, "accepted": 15, "rounds": 5,
             "cloud_s_per_token": 0.05},
            {**base, "protocol": "sd", "tokens": 21, "drafted": 20, "accepted": 15, "cloud_s_per_token": 0.05},
            {**base, "protocol": "sd", "tokens": 21, "drafted": 20, "accepted": 15, "cloud_s_per_token": 0.0},
            {"rep": 1, "phase": "lte", "protocol": "llm", "tokens": 11, "drafted": 0, "accepted": 0,
             "cloud_s_per_token": 1.0}]
    got = cloud_model_error(rows)
    assert set(got) == {"llm", "sd"} and got["llm"]["n"] == 1 and got["sd"]["n"] == 2
    assert got["llm"]["median_error"] == pytest.approx(1.0 / 1.1 - 1)
    assert got["sd"]["median_error"] == pytest.approx((5 * 0.2 / 21) / 0.05 - 1)
    assert got["sd"]["max_abs_error"] == pytest.approx(1 - (5 * 0.2 / 21) / 0.05)
    assert cloud_model_error([r for r in rows if r["protocol"] != "auto"]) == {}


def test_ratios_are_paired_request_by_request_and_chain_rows_are_named_by_their_draft_length():
    def row(protocol, rep, rate, phase="lte"):
        return {"phase": phase, "rep": rep, "protocol": protocol, "tokens": 32 if rate else 0,
                "total_s": 32 / (rate or 1)}

    rows = [row("sd", 0, 2.0), row("auto", 0, 1.0), row("sd", 1, 4.0), row("auto", 1, 5.0), row("auto", 2, 3.0),
            row("sd", 2, 0.0), row("sd", 0, 8.0, "wifi-far")]  # a request of sd with no tokens: no ratio
    assert paired(rows, "auto", "sd") == [0.5, 1.25]
    assert chain_rows("6, 8e0.4") == {"sd_g6": {"draft_len": 6, "draft_stop_prob": 0.0},
                                      "sd_g8_e0.4": {"draft_len": 8, "draft_stop_prob": 0.4}} and chain_rows("") == {}
    for bad in ("0", "17", "x", "6.5", "8e0", "8e1.5", "8ex", "e0.4"):
        with pytest.raises(ValueError, match="--chains"):
            chain_rows(bad)


def test_the_best_fixed_protocol_is_also_picked_on_the_other_repetitions():
    """Hand-computed: llm runs 4, 4, 10 tok/s in three repetitions, sd 6, 5, 3, auto 5 each. Picked on the same
    requests, llm (5.0 over the phase) is best and auto 1.00x it; picked on the other repetitions, llm for the first
    two (5.71 over the others against sd's 3.75 and 4.00) and sd for the third (llm 4.00, sd 5.45): auto 5/4, 5/4,
    5/3 per request, 96 tokens in 19.2 s against 96 in 26.67 s overall (1.39x). One repetition alone: no pick."""
    from profiles.bench.bench_auto import held_out_best

    def row(protocol, rep, rate):
        return {"phase": "lte", "rep": rep, "protocol": protocol, "tokens": 32, "total_s": 32 / rate,
                "ttft_s": 0.3, "steady_tokens_per_s": rate, "cloud_s_per_token": 0.02, "up_bytes_per_token": 10.0,
                "degraded": 0}

    rates = {"llm": (4.0, 4.0, 10.0), "sd": (6.0, 5.0, 3.0), "auto": (5.0, 5.0, 5.0)}
    rows = [row(p, rep, r) for p, each in rates.items() for rep, r in enumerate(each)]
    held = held_out_best(rows, ["llm", "sd"])
    assert held["picks"] == [["lte", 0, "llm"], ["lte", 1, "llm"], ["lte", 2, "sd"]]
    assert held["per_request"] == [pytest.approx(1.25), pytest.approx(1.25), pytest.approx(5 / 3)]
    assert held["ratio"] == pytest.approx(5.0 / (96 / (8 + 8 + 32 / 3)))
    assert held["interval"]["n"] == 3 and held["interval"]["mean"] == pytest.approx((2.5 + 5 / 3) / 3)
    assert held["interval"]["lo"] < held["interval"]["mean"] < held["interval"]["hi"]
    s = summarise(rows, [Phase("lte", "lte")], ["llm", "sd", "auto"])
    assert s["lte"]["best_fixed"] == "llm" and s["lte"]["auto_over_best_fixed"] == pytest.approx(1.0)
    assert s["lte"]["auto_over_held_out_best"]["ratio"] == pytest.approx(held["ratio"])
    assert s["lte"]["auto_over_best_fixed_interval"]["n"] == 3
    assert held_out_best([r for r in rows if r["rep"] == 0], ["llm", "sd"]) == {}


@pytest.mark.real_models
def test_a_short_trace_runs_end_to_end(smollm2, tmp_path):
    from profiles.bench.bench import main

    out = tmp_path / "auto.json"
    assert main(["auto", "--draft", "smollm2-135m", "--target", "smollm2-135m", "--engine", "torch", "--trace",
                 "loopback,cut:loopback,load+power:wifi-near", "--repetitions", "1", "--max-new-tokens", "24",
                 "--protocols", "llm,auto", "--load-devices", "2", "--cut-s", "1.0", "--chains", "", "--out",
                 str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["phase"] for r in doc["rows"]] == ["loopback"] * 2 + ["cut:loopback"] * 2 + ["load+power:wifi-near"] * 2
    assert all(r["tokens"] == 24 == len(r["token_ids"]) for r in doc["rows"])
    assert doc["rows"][0]["token_ids"] == doc["rows"][1]["token_ids"]  # llm's and auto's loopback answer: the target's
    # a 1 s stall is shorter than the ZMTP heartbeat's 3 s: TCP rides it out, no request reconnects
    assert [r["drops"] for r in doc["rows"]] == [0] * 6
    autos = [r for r in doc["rows"] if r["protocol"] == "auto"]
    assert all(r["auto"] and r["predicted"]["llm"] for r in autos)
    assert set(doc["summary"]) == {"loopback", "cut:loopback", "load+power:wifi-near", "overall"}
    assert doc["summary"]["loopback"]["cloud_model_error"]["llm"]["n"] == 1  # priced on the cloud's reported curve
    modes = [r["predicted"]["estimates"]["power_mode"] for r in autos]
    assert modes == ["MAXN", "MAXN", "MODE_15W"], modes  # the device read the stand-in nvpmodel as on a Jetson


@pytest.mark.real_models
def test_a_trace_with_a_tree_row_runs_end_to_end(smollm2, tmp_path):
    """--trees: a fixed row of sd drafting that tree in every phase, and the shape among auto's candidates, beside the
    default --chains row of auto's η-chain; with a power phase on the torch engine (whose tree model the board's
    slowdown does not reach) it is refused."""
    from profiles.bench.bench import main

    out = tmp_path / "auto.json"
    base = ["auto", "--draft", "smollm2-135m", "--target", "smollm2-135m", "--engine", "torch", "--repetitions", "1",
            "--max-new-tokens", "16", "--protocols", "llm,auto", "--trees", "4x2x2", "--out", str(out)]
    assert main(base + ["--trace", "loopback,lte", "--decisions"]) == 0
    doc = json.loads(out.read_text())
    for row in (r for r in doc["rows"] if r["protocol"] == "auto"):  # --decisions: each choice, with its tokens
        assert sum(d["tokens"] for d in row["decisions"]) == 16 and all(d["candidates"] for d in row["decisions"][1:])
        made = [d["at"] for d in row["decisions"]]  # from the request's start: before its first commit, in order
        assert 0 < made[0] < row["first_commit_after_s"] and made == sorted(made), (made, row["first_commit_after_s"])
    trees = [r for r in doc["rows"] if r["protocol"] == "sd_t4d2w2"]  # the tree row: sd drafting 4-node trees
    assert len(trees) == 2 and all(r["tokens"] == 16 and r["alpha"] is not None for r in trees)
    assert set(doc["summary"]["overall"]["protocols"]) == {"llm", "auto", "sd_t4d2w2", "sd_g8_e0.4"}
    assert all(r["tokens"] == 16 for r in doc["rows"] if r["protocol"] == "sd_g8_e0.4")
    assert main(base + ["--trace", "power:loopback"]) == 2  # refused in one line, before any model loads
    assert main(base + ["--trace", "loopback", "--auto-eta", "1.5"]) == 2
