"""Intervals and interleaving of hat-bench cuhlm, qs and hat on hand-made runs: the `<key>_ci` entries beside the pooled
figures (mean, 95 % lo / hi, n, method: a t interval below 8 values), ratios against a baseline taken per prompt, and
the rotated order in which the systems run on each prompt. No model, no cloud: the runtimes are stand-ins that record
their calls."""
from __future__ import annotations

import argparse
import dataclasses
import math
from types import SimpleNamespace

import pytest

from edge_runtime.config import QSConfig, UncertaintyConfig
from profiles.bench import bench_cuhlm, bench_hat, bench_qs
from profiles.bench.stats import ci_text, interval, paired_ratio, rotated
from tests.test_bench_summary import _hlm_row


def _ok(ci, n):
    """An interval over n values: its keys, n, the rule's method for n, and lo <= mean <= hi."""
    assert set(ci) == {"mean", "lo", "hi", "n", "method"} and ci["n"] == n
    assert ci["method"] == ("t" if n < 8 else "bootstrap")
    assert ci["lo"] <= ci["mean"] <= ci["hi"]


def test_rotated_starts_prompt_i_at_system_i_mod_k():
    names = ["a", "b", "c"]
    assert [rotated(names, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                      ["a", "b", "c"]]
    assert rotated(("x",), 7) == ["x"] and rotated([], 3) == []
    assert names == ["a", "b", "c"]  # not reordered in place


def test_interval_leaves_out_missing_values_and_needs_two_for_a_width():
    ci = interval([1.0, 2.0, None, 3.0, float("nan")])
    _ok(ci, 3)
    assert ci["mean"] == pytest.approx(2.0) and ci["lo"] < ci["hi"]
    assert interval([4.0]) == {"mean": 4.0, "lo": None, "hi": None, "n": 1, "method": None}
    assert interval([]) == {"mean": None, "lo": None, "hi": None, "n": 0, "method": None}


def test_paired_ratio_is_the_mean_of_per_prompt_ratios():
    ci = paired_ratio([2.0, 6.0], [1.0, 2.0])  # ratios 2 and 3; the pooled ratio 8 / 3 would differ
    _ok(ci, 2)
    assert ci["mean"] == pytest.approx(2.5)
    assert paired_ratio([2.0, 6.0, 1.0], [1.0, 0.0, None])["n"] == 1  # no baseline value, or zero: left out
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_ci_text_shows_the_larger_half_width_n_and_method():
    assert ci_text({"mean": 0.5, "lo": 0.4, "hi": 0.7, "n": 8, "method": "bootstrap"}) == "0.50 ± 0.20 (n=8, bootstrap)"
    assert ci_text({"mean": 0.05, "lo": 0.04, "hi": 0.06, "n": 3, "method": "t"}, "{:.0f}", 1e3,
                   with_n=False) == "50 ± 10"
    assert ci_text(interval([0.91, 0.87, 0.95]), form="interval") == "0.91 [0.81, 1.01] (n=3, t)"
    assert ci_text({"mean": 2.0, "lo": None, "hi": None, "n": 1, "method": None}) == "2.00 (n=1)"
    assert ci_text(None) == "-" and ci_text(interval([])) == "-"


def test_cuhlm_summary_has_per_prompt_intervals_beside_the_pooled_figures():
    args = argparse.Namespace(snr_db="-10,10", bandwidth_mhz=10.0, rician_k_db=10.0, seed=0)
    runs = {
        "llm": [{**_hlm_row(10, 2.0, 0, 0, 100), "rounds": 2, "drafted": 0},
                {**_hlm_row(20, 5.0, 0, 0, 100), "rounds": 2, "drafted": 0}],
        "hlm": [_hlm_row(10, 3.0, 10, 0, 10 * 300_000), _hlm_row(20, 4.0, 20, 0, 20 * 200_000)],
        "cuhlm_online": [_hlm_row(10, 1.5, 4, 6, 4 * 200, ks=[3, 9, 30, 4]),
                         _hlm_row(20, 2.0, 5, 15, 5 * 400, ks=[5, 7])],
    }
    acc = {"llm": [0.8, 0.5], "hlm": [0.78, 0.5], "cuhlm_online": [0.76, 0.6]}
    by_prompt = {"cuhlm_online": [[1.0, 0.5, 1.0, 1.0, 0.5, 1.0], [0.25] * 15]}
    flat = {"cuhlm_online": [p for probs in by_prompt["cuhlm_online"] for p in probs]}
    s = bench_cuhlm.summarise(args, runs, flat, acc, by_prompt)
    c = s["variants"]["cuhlm_online"]
    # the pooled figures keep their meaning
    assert c["tokens_per_s"] == pytest.approx(30 / 3.5) and c["transmission_rate"] == pytest.approx(9 / 30)
    assert c["accuracy"] == pytest.approx(0.68) and c["accuracy_vs_llm"] == pytest.approx(0.68 / 0.65)
    for key in ("tokens_per_s", "accuracy", "accuracy_vs_llm", "accuracy_diff_vs_llm", "transmission_rate",
                "skip_rate", "true_skip_rate", "alpha", "k_mean", "up_bytes_per_token", "payload_vs_hlm"):
        _ok(c[key + "_ci"], 2)
    assert c["n_prompts"] == 2
    assert c["tokens_per_s_ci"]["mean"] == pytest.approx((10 / 1.5 + 20 / 2.0) / 2)
    assert c["accuracy_vs_llm_ci"]["mean"] == pytest.approx((0.76 / 0.8 + 0.6 / 0.5) / 2)  # per prompt, paired
    assert c["accuracy_diff_vs_llm_ci"]["mean"] == pytest.approx((-0.04 + 0.1) / 2)
    assert c["payload_vs_hlm_ci"]["mean"] == pytest.approx((80 / 300_000 + 100 / 200_000) / 2)
    assert c["true_skip_rate_ci"]["mean"] == pytest.approx((5 / 6 + 0.25) / 2)
    assert c["transmission_rate_ci"]["mean"] == pytest.approx((0.4 + 0.25) / 2)
    assert c["k_mean_ci"]["mean"] == pytest.approx((11.5 + 6) / 2)
    for fading in ("rayleigh", "rician"):
        for snr, ci in c["throughput_vs_snr_ci"][fading].items():
            _ok(ci, 2)
            assert ci["mean"] == pytest.approx(c["throughput_vs_snr"][fading][snr])
        _ok(c["throughput_vs_snr_per_round_ci"][fading]["10"], 2)
    llm = s["variants"]["llm"]
    assert llm["transmission_rate_ci"] is None and llm["payload_vs_hlm_ci"]["n"] == 2
    assert llm["throughput_vs_snr_ci"]["rayleigh"]["-10"] is None  # a constant of the model, no sample
    assert s["variants"]["hlm"]["true_skip_rate_ci"] is None
    table = bench_cuhlm.format_table(s)
    assert "cuhlm_online" in table and "±" in table and "95 %" in table
    # without per-prompt skip probabilities (the older call) there is no TSR interval, and nothing else changes
    assert bench_cuhlm.summarise(args, runs, flat, acc)["variants"]["cuhlm_online"]["true_skip_rate_ci"] is None


class _Runtime:
    """Records (config field, protocol, prompt, seed) per generate call; answers a fixed row per call."""

    def __init__(self, config, row):
        self.config, self.row, self.calls = config, row, []

    def generate(self, ids, protocol, params, max_new, seed=None):
        self.calls.append((self.config, protocol, ids[0], seed))
        row = {**self.row, "prompt": ids[0], "seed": seed, "protocol": protocol}
        return SimpleNamespace(n=row["n_tokens"], total_s=row["total_s"], skipped=0, up_bytes=0, to_json=lambda: row)


@dataclasses.dataclass(frozen=True)
class _CuhlmConfig:
    uncertainty: UncertaintyConfig


def test_cuhlm_runs_every_variant_per_prompt_in_rotated_order(capsys):
    variants = ["llm", "uhlm", "cuhlm_offline"]
    rt = _Runtime(_CuhlmConfig(UncertaintyConfig()), {"n_tokens": 4, "total_s": 1.0})
    ids = [[10], [11], [12], [13]]
    runs = bench_cuhlm._generate_all(rt, variants, ids, None, 8, 3, UncertaintyConfig(), "loopback")
    order = [(cfg.uncertainty.k_mode, protocol, prompt) for cfg, protocol, prompt, _ in rt.calls]
    expected = [(variant, prompt) for i, prompt in enumerate([10, 11, 12, 13]) for variant in rotated(variants, i)]
    assert [(p, x) for _, p, x in order] == [(bench_cuhlm.VARIANTS[v][0], x) for v, x in expected]
    assert order[2][0] == "offline" and order[3][0] == "online"  # each call gets its own variant's config
    assert list(runs) == variants  # the report keeps the variants' order; each variant's rows in prompt order
    for rows in runs.values():
        assert [r["prompt"] for r in rows] == [10, 11, 12, 13] and [r["seed"] for r in rows] == [3000, 3001, 3002,
                                                                                                  3003]


@dataclasses.dataclass(frozen=True)
class _QSConfig:
    qs: QSConfig
    draft_len: int


def _qs_row(n, total_s, rounds=2, rejected=1, accepted=3, round_log=()):
    return {"n_tokens": n, "total_s": total_s, "rounds": rounds, "rejected": rejected, "accepted": accepted,
            "round_log": list(round_log), "round_up_bytes": [100] * rounds}


def test_qs_runs_every_method_per_prompt_in_rotated_order(capsys):
    methods = ["llm", "qs_static", "ksqs"]
    args = argparse.Namespace(policy_file="policy.npz", budget_bits=5000, max_len=16, draft_len=4, max_new_tokens=8,
                              seed=2)
    rt = _Runtime(_QSConfig(QSConfig(), 4), _qs_row(8, 2.0))
    runs = bench_qs._run_methods(rt, methods, [[20], [21], [22]], SimpleNamespace(temperature=0.5), args, QSConfig())
    calls = [(protocol, prompt, cfg.draft_len) for cfg, protocol, prompt, _ in rt.calls]
    assert calls == [("llm", 20, 4), ("qs", 20, 4), ("ksqs", 20, 16),  # prompt i starts at method i mod 3
                     ("qs", 21, 4), ("ksqs", 21, 16), ("llm", 21, 4),
                     ("ksqs", 22, 16), ("llm", 22, 4), ("qs", 22, 4)]
    assert [r["seed"] for r in runs["ksqs"]] == [2000, 2001, 2002] and list(runs) == methods
    assert "tok/s" in capsys.readouterr().out


def test_qs_summary_has_request_intervals_and_the_per_prompt_speedup_over_llm():
    log = [{"L": 4, "bits": [10, 10, 10, 10], "payload_bits": 36, "ell": 100, "k": [2, 2, 2, 2], "uplink_bps": 1e6,
            "dropped": [0.0, 0.01, 0.0, 0.0], "accepted": 2}]
    runs = {"llm": [_qs_row(10, 2.0), _qs_row(10, 5.0)],
            "qs_static": [_qs_row(10, 1.0, round_log=log), _qs_row(10, 4.0, round_log=log * 2)]}
    t = bench_qs.summarise(runs)
    q = t["qs_static"]
    assert q["tokens_per_s"] == pytest.approx(20 / 5.0)  # pooled, as before
    for key in ("tokens_per_s", "latency_per_token_s", "latency_per_round_s", "resampling_rate", "accepted_per_round",
                "payload_bits_per_draft", "frame_bits_per_draft", "tokens_per_s_vs_llm"):
        _ok(q[key + "_ci"], 2)
    assert q["tokens_per_s_vs_llm_ci"]["mean"] == pytest.approx((2.0 + 1.25) / 2)  # 5/2 x and 5/4 x, per prompt
    assert q["frame_bits_per_draft_ci"]["mean"] == pytest.approx((1600 / 4 + 1600 / 8) / 2)
    assert t["llm"]["tokens_per_s_vs_llm_ci"]["mean"] == pytest.approx(1.0)
    assert "payload_bits_per_draft_ci" not in t["llm"]  # no round log, no bits
    sqs = bench_qs.summarise({"ksqs": runs["qs_static"]}, llm=runs["llm"])  # the baseline from another table
    assert sqs["ksqs"]["tokens_per_s_vs_llm_ci"] == q["tokens_per_s_vs_llm_ci"]
    assert "tokens_per_s_vs_llm_ci" not in bench_qs.summarise({"ksqs": runs["qs_static"]})["ksqs"]


def _hat_row(ttft, tbt, n, rounds, drafted=0, accepted=0, chunks=1):
    return {"ttft_s": ttft, "tbt_s": tbt, "n_tokens": n, "rounds": rounds, "drafted": drafted, "accepted": accepted,
            "up_bytes": 1000 * n, "down_bytes": 500 * n, "prefill_chunks": chunks, "cloud_compute_s": 1.0,
            "device_compute_s": 0.5, "pd_hits": 1, "pd_steps": 4, "tokens": [1] * n}


def test_hat_summary_and_table4_have_intervals_with_changes_per_prompt():
    runs = {"U-shape": [_hat_row(2.0, 0.10, 11, 11), _hat_row(4.0, 0.30, 11, 11), _hat_row(3.0, 0.20, 1, 1)],
            "+SD": [_hat_row(1.0, 0.05, 11, 6, 8, 5), _hat_row(3.0, 0.10, 11, 6, 8, 5),
                    _hat_row(3.0, float("nan"), 1, 1)]}
    t = bench_hat.summarise(runs)
    u, sd = t["U-shape"], t["+SD"]
    assert u["ttft_s"] == 3.0 and sd["ttft_change"] == pytest.approx(7 / 9 - 1)  # pooled, as before
    assert sd["n_requests"] == 3
    _ok(sd["ttft_s_ci"], 3)
    _ok(sd["tbt_s_ci"], 2)  # the one-token request has no TBT
    _ok(sd["tokens_per_round_ci"], 2)
    _ok(sd["accept_length_ci"], 2)
    _ok(sd["up_bytes_per_token_ci"], 3)
    assert sd["accept_length_ci"]["mean"] == pytest.approx(1.0) and "accept_length_ci" not in u
    # changes against U-shape: the per-prompt ratios minus one, not the ratio of the means
    _ok(sd["ttft_change_ci"], 3)
    assert sd["ttft_change_ci"]["mean"] == pytest.approx((0.5 + 0.75 + 1.0) / 3 - 1)
    assert sd["tbt_change_ci"]["n"] == 2 and sd["tbt_change_ci"]["mean"] == pytest.approx((0.5 + 1 / 3) / 2 - 1)
    assert u["tbt_change_ci"]["mean"] == pytest.approx(0.0)
    report = {"tables": {"wifi": t}, "links": {"wifi": {"runs": runs}}, "trained_parameters": 1234}
    row = bench_hat.table4(report)["wifi"]
    assert row["decode_speedup"] == pytest.approx(0.2 / 0.075)  # pooled, as before
    _ok(row["decode_speedup_ci"], 2)
    assert row["decode_speedup_ci"]["mean"] == pytest.approx((2.0 + 3.0) / 2)
    assert row["accept_length_ci"] == sd["accept_length_ci"]
    assert not any(isinstance(v, float) and math.isnan(v) for v in sd["tbt_change_ci"].values())
