"""`hat-bench plan` (profiles.bench.plan): the cost model priced on a Jetson profile, a cloud GPU and a link, from the
GPU check's measured steps and the acceptance measured here. Estimates, but their arithmetic is checked."""
from __future__ import annotations

import json

import pytest

from profiles.bench.plan import MODEL_ERROR, GpuSteps, auto_at_sla, capacity, error_text, measured_error, shape_of


def test_capacity_is_the_most_devices_within_the_sla():
    assert capacity(lambda n: 0.01 * n, 0.5) == 50
    assert capacity(lambda n: 1.0, 0.5) == 0
    assert capacity(lambda n: 0.0, 0.5, most=64) == 64


def test_gpu_steps_scale_the_streaming_part_by_bandwidth_and_keep_the_rest():
    bench = {"copy_GBps": 4000.0, "models": {"m": {"weight_bytes": 4e9, "ways": {"graphs": {
        "decode_tok_s": 200.0, "verify_ms": {"1": 5.5, "4": 6.0}, "batched_tok_s": {"1": 200.0, "64": 1600.0},
        "batched_verify_ms": {"1": 6.0, "64": 48.0}}}}}}
    steps = GpuSteps(bench, "m", gpu_gbs=800.0, measured_gbs=4800.0)
    stream, rest = 4e9 / 4e12, 1 / 200 - 4e9 / 4e12  # 1 ms of weights, 4 ms of the rest on the measured GPU
    assert steps.step_s(1.0, 1.0) == pytest.approx(stream * 6 + rest)  # 6x slower streaming, the same rest
    assert steps.step_s(0.5, 1.0) == pytest.approx(0.5 * (stream * 6 + rest))
    curve = steps.curve(0.01)
    assert curve.step_s(1) == pytest.approx(0.01) and curve.step_s(5) == pytest.approx(0.01 * 6.0 / 5.0)
    assert steps.batched_step_s(0.01, 64, 1) == pytest.approx(0.01 * (64 / 1600) / (1 / 200))  # 8x one step
    assert steps.batched_step_s(0.01, 64, 5) == pytest.approx(0.01 * 0.048 / 0.005)  # 64 sessions × 5: 9.6x
    assert steps.batched_step_s(0.01, 64, 3) == pytest.approx(0.01 * (8 + 9.6) / 2)
    with pytest.raises(ValueError, match="measured no 'x'"):
        GpuSteps(bench, "x", 800.0, 4800.0)


def test_the_plan_runs_on_the_repositorys_measurements(tmp_path, capsys):
    """The default plan (AGX Orin + A6000 over wifi-near, the Qwen pair) from results/gpu and the acceptance files:
    every protocol priced, labelled an estimate, the assumptions written beside the figures."""
    from hat_split.models.registry import is_installed
    from profiles.bench.bench import main

    if not all(is_installed(n) for n in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")):
        pytest.skip("the Qwen pair's configs are not installed")
    out = tmp_path / "plan.json"
    assert main(["plan", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["estimate"] is True and doc["assumptions"]["device_efficiency"] == 0.5
    rows = {r["protocol"]: r for r in doc["protocols"]}
    assert set(rows) == {"llm", "sd", "slm", "ushape", "hat"}
    assert rows["slm"]["devices_at_sla"] is None and rows["llm"]["devices_at_sla"] > 0
    assert rows["ushape"]["up_bytes_per_token"] > 1000 > rows["sd"]["up_bytes_per_token"]
    assert 0.7 < doc["alpha_sd"] < 0.95
    assert doc["hat_tokens_per_round"] == pytest.approx(json.load(open(
        "results/hat/feature_drafter_qwen2.5-coder-1.5b-m2-s1200.json"))["record"]["acceptance_draft_vocab_16384"][
        "sharegpt"]["tokens_per_round"])  # the chain's τ it priced hat with, not a tree shape's
    hat = {(r["shape"], r["cloud_step"]): r for r in doc["hat_trees"]}  # the feature drafter's chain and trees
    assert ("g8", "chain") in hat and ("t64d8w8", "captured") in hat and ("t64d8w8", "eager") in hat
    assert hat["t64d8w8", "captured"]["protocol"] == "hat_tree"
    assert hat["t64d8w8", "captured"]["tokens_per_s"] > hat["t64d8w8", "eager"]["tokens_per_s"]
    assert hat["t64d8w8", "captured"]["up_bytes_per_token"] > hat["g8", "chain"]["up_bytes_per_token"]  # 65 states
    fleet = doc["auto_at_sla"]  # auto under the SLA: at least every protocol's row, which are among its candidates
    assert fleet["devices_at_sla"] >= max(r["devices_at_sla"] for r in rows.values() if r["protocol"] != "slm")
    assert fleet["over_llm"] == pytest.approx(fleet["devices_at_sla"] / rows["llm"]["devices_at_sla"])
    err = doc["assumptions"]["model_error_here"]  # read from the trace named by plan.MODEL_ERROR
    assert err["record"] == MODEL_ERROR and err["phases"] == 7
    assert "sd_phase_mean_at_autos_alpha" in err  # the trace's resummarised summary holds the phases' bias
    assert 0 < err["llm"]["min"] <= err["llm"]["max"] < 1 and err["sd"]["n_per_phase"] == 5
    assert set(err["rows"]) == {"sd_g8_e0.4", "sd_t8d8w1_e0.4"}  # the η-chain's and the η-tree's rows beside them
    out_text = capsys.readouterr().out
    assert "ESTIMATES" in out_text and "hat shape" in out_text
    assert f"one {doc['gpu']} serves {fleet['devices_at_sla']} devices" in out_text
    assert "SpecEdge reports 2.22×" in out_text
    assert "model error here: llm " in out_text and "n = 5 requests each" in out_text and "its phase means" in out_text
    assert "sd_t8d8w1_e0.4 9–17 % at auto's (phase means -18 to +4 %)" in out_text
    assert main(["plan", "--gpu", "nope", "--out", str(out)]) == 2


def test_a_sampled_request_prices_sds_rows_and_ksqs_beside_them(tmp_path):
    """--sampled: sd's draft rows as measured at T = 1 (float16 over their support: thousands of bytes), ksqs's its
    lattice code (tens of bytes, near hat_split.wire.sqs.row_bits), each at its α measured on the same prompts; over
    LTE ksqs is faster than sd and one cloud serves more devices with it (ESTIMATES). A record of another pair is
    refused, naming what to give instead."""
    from hat_split.models.registry import is_installed
    from hat_split.wire.sqs import row_bits
    from profiles.bench.bench import main
    from profiles.bench.plan import measured_sampled

    if not all(is_installed(n) for n in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")):
        pytest.skip("the Qwen pair's configs are not installed")
    out = tmp_path / "plan.json"
    assert main(["plan", "--sampled", "--link", "lte", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["protocol"]: r for r in doc["protocols"]}
    measured = measured_sampled("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
    assert doc["sampled"] and doc["alpha_sd"] == measured["alpha"]["sd"] and doc["alpha_ksqs"] == measured[
        "alpha"]["ksqs"]
    assert 0.5 < doc["alpha_ksqs"] < 0.9 and 0.5 < doc["alpha_sd"] < 0.9
    code = 4 + row_bits(151936, 16, 100, False) / 8  # an id and the code: 41 bytes, the frame's share on top
    assert code < doc["draft_row_bytes"]["ksqs"] < 3 * code < 1000 < doc["draft_row_bytes"]["sd"]
    assert rows["ksqs"]["up_bytes_per_token"] < 200 < 1000 < rows["sd"]["up_bytes_per_token"]
    assert rows["ksqs"]["tokens_per_s"] > rows["sd"]["tokens_per_s"]
    assert rows["ksqs"]["devices_at_sla"] > rows["sd"]["devices_at_sla"]
    err = doc["assumptions"]["model_error_here"]  # the sampled trace's error, ksqs's beside sd's
    assert err["record"] == "results/auto/trace_T1.json" and err["ksqs_at_autos_alpha"]["n_per_phase"] == 5
    greedy = tmp_path / "greedy.json"
    assert main(["plan", "--link", "lte", "--out", str(greedy)]) == 0
    assert "ksqs" not in {r["protocol"] for r in json.loads(greedy.read_text())["protocols"]}
    assert main(["plan", "--sampled", "--draft", "smollm2-135m", "--out", str(greedy)]) == 2


def test_shapes_count_the_parameters_a_step_reads():
    s = shape_of("qwen2.5-1.5b")  # the GPU check's shape: Qwen2.5-1.5B
    assert s.layers == 28 and s.hidden == 1536
    assert 1.3e9 < s.step_params < 1.6e9  # 1.31B in the layers and the (tied) head, the embedding not read


def test_where_each_protocol_wins_on_the_grid():
    """One line per protocol for the demo: where it is the fastest exact protocol and where one cloud serves the most
    devices with it, over Jetson profiles × links (estimates)."""
    from hat_split.models.registry import is_installed
    from profiles.bench.plan import PROTOCOLS, wins

    if not is_installed("qwen2.5-coder-0.5b"):
        pytest.skip("the draft's config is not installed")
    lines = wins(target="qwen2.5-7b", gpu_shape="qwen2.5-7b")
    assert list(lines) == list(PROTOCOLS)
    assert lines["slm"].startswith("slm (lossy): faster than every exact protocol on")
    assert all(lines[p].startswith(f"{p}: fastest exact on ") and "most devices per cloud on" in lines[p]
               for p in PROTOCOLS if p != "slm")


def test_the_model_error_is_read_from_the_trace_per_phase(tmp_path):
    """The least and most over the phases of each protocol's median error, the n a phase, sd at both α."""
    phase = lambda llm, sd, own: {"model_error": {"llm": {"n": 8, "median_abs_error": llm},  # noqa: E731
                                                  "sd": {"n": 6, "median_abs_error": sd,
                                                         "median_abs_error_own_alpha": own}}}
    doc = {"summary": {"a": phase(0.05, 0.2, 0.04), "b": phase(0.15, 0.3, 0.1), "overall": phase(9, 9, 9)},
           "provenance": {"git_commit": "f" * 40}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    err = measured_error(str(path))
    assert err["phases"] == 2 and err["llm"] == {"min": 0.05, "max": 0.15, "n_per_phase": 8, "phases": 2}
    assert (err["sd"]["min"], err["sd"]["max"]) == (0.04, 0.1) and err["sd_at_autos_alpha"]["max"] == 0.3
    assert error_text(err).startswith("llm 5–15 %, sd 4–10 % at the request's α (20–30 % at auto's)")
    assert "2 phases, n = 6 requests each" in error_text(err)
    doc["summary"]["a"]["model_error"]["sd"]["phase_mean_error"] = -0.12  # the phases' bias, signed, where recorded
    doc["summary"]["b"]["model_error"]["sd"]["phase_mean_error"] = 0.03
    path.write_text(json.dumps(doc))
    assert "sd 4–10 % at the request's α (20–30 % at auto's, its phase means -12 to +3 %)" in \
        error_text(measured_error(str(path)))
    doc["resummarised"] = {"summary": {"a": phase(0.01, 0.2, 0.04)}}  # `hat-bench resummarise`'s, when there
    path.write_text(json.dumps(doc))
    assert measured_error(str(path))["llm"]["max"] == 0.01


class _Steps:
    """A cloud whose batched step costs one decode step a session (no batching gain) and a tenth of one for each
    further position a session verifies."""

    def batched_step_s(self, one_step_s, sessions, positions):
        return one_step_s * sessions * (1 + 0.1 * (positions - 1))

    def curve(self, one_step_s):
        from hat_split.math.costmodel import CostCurve

        return CostCurve(((1.0, one_step_s), (64.0, 64 * one_step_s)))


def test_auto_at_sla_takes_the_candidate_that_keeps_the_pace_for_the_most_devices():
    """By hand: each candidate's capacity under the SLA, the largest taken (its knob beside it); a candidate list
    with nothing exact in it is refused."""
    from hat_split.math.costmodel import DeviceCosts, Link, WireSizes
    from profiles.bench.plan import Pricing

    dev = DeviceCosts(draft_step_s=0.002, local_step_s=0.002, prefill_s=0.001, round_s=0.0, split_step_s=0.001,
                      hat_draft_s=0.001, hat_verify_s=0.001, watts=0.0)
    price = Pricing(16, Link(0.01, 1e8, 1e8), dev, WireSizes(100.0, 8.0, 100.0, 4.0, 3072.0), 0.9, 0.5)
    steps, g1 = _Steps(), 0.001
    fleet = auto_at_sla(price, steps, g1, 1.0, 0.05, ["llm", "sd"])
    by_hand = {(name, k): capacity(lambda n: price.shared(price.at(name, k, price_cloud(steps, g1)), steps, g1,
                                                          1.0, n), 0.05)
               for name, knobs in (("llm", (8,)), ("sd", range(1, 9))) for k in knobs}
    assert fleet["devices_at_sla"] == max(by_hand.values()) > by_hand["llm", 8]
    assert by_hand[fleet["protocol"], fleet["knob"]] == fleet["devices_at_sla"]
    assert fleet["joules_per_token"] is None and fleet["census_joules_per_token"] is None  # no watts known
    with pytest.raises(ValueError, match="no exact protocol"):
        auto_at_sla(price, steps, g1, 1.0, 0.05, [])


def test_auto_at_sla_prices_its_census_reads_energy_where_llm_runs():
    """By hand: a device of 10 W whose prefill position takes 1 ms. Where auto runs llm, a quarter of its requests
    are a census whose draft model reads each token as a prefill position: 0.25 × 1 ms × 10 W = 2.5 mJ a token on
    top of llm's own; where sd runs, its drafts are its reads (nothing added); no census, nothing added. A census
    share outside [0, 1] is refused by the plan, the option named."""
    from dataclasses import replace

    from hat_split.math.costmodel import DeviceCosts, Link, WireSizes
    from profiles.bench.plan import Pricing, defaults, plan

    dev = DeviceCosts(draft_step_s=0.002, local_step_s=0.002, prefill_s=0.001, round_s=0.0005, split_step_s=0.001,
                      hat_draft_s=0.001, hat_verify_s=0.001, watts=10.0)
    price = Pricing(16, Link(0.01, 1e8, 1e8), dev, WireSizes(100.0, 8.0, 100.0, 4.0, 3072.0), 0.9, 0.5)
    steps, g1 = _Steps(), 0.001
    own = price.at("llm", 8, price_cloud(steps, g1)).joules_per_token
    llm = auto_at_sla(price, steps, g1, 1.0, 0.05, ["llm"], census=0.25)
    assert llm["census_joules_per_token"] == pytest.approx(0.0025)
    assert llm["joules_per_token"] == pytest.approx(own + 0.0025) and own > 0
    assert auto_at_sla(price, steps, g1, 1.0, 0.05, ["llm"])["joules_per_token"] == pytest.approx(own)
    sd = auto_at_sla(price, steps, g1, 1.0, 0.05, ["llm", "sd"], census=0.25)
    assert sd["protocol"] == "sd" and sd["census_joules_per_token"] == 0.0
    assert sd["joules_per_token"] == pytest.approx(price.at("sd", sd["knob"], price_cloud(steps, g1)).joules_per_token)
    cold = auto_at_sla(replace(price, device=replace(dev, watts=0.0)), steps, g1, 1.0, 0.05, ["llm"], census=0.25)
    assert cold["joules_per_token"] is None
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--auto-census must be in"):
            plan(defaults(auto_census=bad))


def price_cloud(steps, g1):
    from hat_split.math.costmodel import CloudCosts

    return CloudCosts(steps.curve(g1), 0.0, 1.0)
