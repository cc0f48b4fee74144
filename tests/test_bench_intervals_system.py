"""Issue 28's intervals and interleaving in `hat-bench edge`, `hat-bench engines` and the soak's summary, on hand-made
rows and stand-in engines (no model is loaded): every mean over prompts, rounds or requests has its 95 % interval, n
and method beside it (a t interval below 8 values), a ratio of two systems is the interval of paired per-prompt
ratios, and the systems take
turns on every prompt in an order rotated by one per prompt."""
from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import pytest

from profiles.bench import bench_edge, bench_engines
from profiles.bench.stats import t_ci
from profiles.bench.soak_check import hostile_sides, print_summary
from profiles.bench.soak_check import summarise as soak_summary


def _within(ci: dict, values, n: int) -> None:
    """`ci` is {"mean", "lo", "hi", "n", "method"} of `values` by the rule: the mean and n; below 8 values the t
    interval (stats.t_ci), from 8 a bootstrap inside the values' range."""
    assert ci["n"] == n == len(values) and ci["mean"] == pytest.approx(statistics.mean(values))
    if n < 8:
        assert ci["method"] == "t" and (ci["lo"], ci["hi"]) == pytest.approx(t_ci(values)[1:])
        return
    eps = 1e-9 * max(abs(v) for v in values)  # the tokens' times are sums: last-digit rounding
    assert ci["method"] == "bootstrap" and min(values) - eps <= ci["lo"] <= ci["mean"] <= ci["hi"] <= max(values) + eps


def test_the_order_rotates_by_one_per_prompt_so_every_system_leads_alike():
    systems = ["a", "b", "c"]
    orders = [bench_engines.rotated(systems, i) for i in range(6)]
    assert orders[:4] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(sorted(o) == systems for o in orders)
    assert [o[0] for o in orders] == ["a", "b", "c"] * 2  # prompt i starts at system i mod k
    assert bench_edge.rotated(("x", "y"), 3) == ["y", "x"] and bench_engines.rotated([], 2) == []


# -- hat-bench edge -------------------------------------------------------------------------------------------

def _edge_round(tps: float, prefill_s: float, tokens=(1, 2, 3, 4)) -> dict:
    return {"prefill_s": prefill_s, "latency_s": [1.0 / tps] * len(tokens), "tokens": list(tokens)}


def test_edge_reports_tokens_per_s_and_vs_llamacpp_with_intervals_paired_by_round():
    # the machine drifts from round to round; torch is half llama.cpp's speed in every round
    runs = {"torch-fp32": [_edge_round(50.0, 0.02), _edge_round(40.0, 0.03), _edge_round(60.0, 0.01)],
            "llamacpp": [_edge_round(100.0, 0.01), _edge_round(80.0, 0.01), _edge_round(120.0, 0.01)]}
    b = bench_edge.summarise(runs, 4, {"llamacpp": {"gguf": "m.gguf"}})
    t = b["torch-fp32"]
    assert t["tokens_per_s"] == pytest.approx(50.0) and t["vs_llamacpp"] == pytest.approx(0.5)  # medians as before
    _within(t["tokens_per_s_ci"], [50.0, 40.0, 60.0], 3)
    _within(t["prefill_ms_ci"], [20.0, 30.0, 10.0], 3)
    vs = t["vs_llamacpp_ci"]  # paired by round: the drift cancels, the interval is the ratio itself
    assert vs["n"] == 3 and vs["mean"] == pytest.approx(0.5) and vs["lo"] == pytest.approx(0.5) == vs["hi"]
    assert b["llamacpp"]["gguf"] == "m.gguf" and b["llamacpp"]["vs_llamacpp_ci"]["mean"] == pytest.approx(1.0)
    table = bench_edge.format_table(b)
    assert "50.0 ± 24.8 (n=3, t)" in table and "0.50 ± 0.00 (n=3, t)" in table  # s = 10, t(df 2) 4.303 / sqrt(3)


def test_edge_alone_has_no_ratio_and_one_round_no_interval():
    b = bench_edge.summarise({"torch-fp32": [_edge_round(50.0, 0.02)]}, 4)
    ci = b["torch-fp32"]["tokens_per_s_ci"]
    assert ci == {"mean": pytest.approx(50.0), "lo": None, "hi": None, "n": 1, "method": None}
    assert "vs_llamacpp_ci" not in b["torch-fp32"]
    assert "50.0 (n=1)" in bench_edge.format_table(b)


def test_edge_backends_take_turns_rotated_per_round(monkeypatch):
    import torch

    order, reports = [], []

    def measure(dec, prompt, n):
        order.append(dec.info["name"])
        return _edge_round(10.0, 0.01, tokens=range(n))

    torch_names = iter(["torch-fp32", "torch-int8"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave this process's torch as it is
    monkeypatch.setattr(bench_edge, "load_model", lambda model, dtype: SimpleNamespace(model=model, tokenizer=None))
    monkeypatch.setattr(bench_edge, "quantize_weights", lambda model, kind: None)
    monkeypatch.setattr(bench_edge, "validation_prompts", lambda tok, n, min_tokens, max_tokens: [[1] * min_tokens])
    monkeypatch.setattr(bench_edge, "CausalLM", lambda model: model)
    monkeypatch.setattr(bench_edge, "_lm_decoder",
                        lambda lm, info: bench_edge.Decoder(None, None, {**info, "name": next(torch_names)}))
    monkeypatch.setattr(bench_edge, "_ensure_llamacpp", lambda: None)
    monkeypatch.setattr(bench_edge, "_llamacpp_decoder",
                        lambda model, threads, n_ctx: bench_edge.Decoder(None, None, {"name": "llamacpp"}))
    monkeypatch.setattr(bench_edge, "measure", measure)
    monkeypatch.setattr(bench_edge, "write_report", lambda path, report: reports.append(report))
    monkeypatch.setattr(bench_edge, "cpu_name", lambda: "cpu")
    args = argparse.Namespace(model="m", backends="torch-fp32,torch-int8,llamacpp", bundle="", threads=1,
                              prompt_tokens=8, new_tokens=4, repeats=4, out="unused.json")
    assert bench_edge.run(args) == 0
    k = ["torch-fp32", "torch-int8", "llamacpp"]
    assert order[:3] == k  # one warm-up each, then round r starts at backend r mod 3
    assert order[3:] == [*k, *k[1:], k[0], k[2], *k[:2], *k]
    backends = reports[0]["backends"]
    assert list(backends) == k and all(b["tokens_per_s_ci"]["n"] == 4 for b in backends.values())
    assert all(b["vs_llamacpp_ci"]["mean"] == pytest.approx(1.0) for b in backends.values())


# -- hat-bench engines ----------------------------------------------------------------------------------------

def _engine_row(tps, decode, drafted=0, accepted=0, rejected=0, rounds=1, gamma=0, eta=0.0, n=64):
    return {"n": n, "tokens_per_s": tps, "decode_tokens_per_s": decode, "drafted": drafted, "accepted": accepted,
            "rejected": rejected, "rounds": rounds, "gamma": gamma, "eta": eta,
            "share": {"device": 0.4, "cloud": 0.5, "link_and_overhead": 0.1}}


def _engines_inputs():
    # three prompts of very different speed; per prompt sd is 1.2x llm and 1.1x llama-speculative
    llm = [10.0, 20.0, 40.0]
    alone = {"depth": 100, "tokens_per_s": {
        "draft": {"llamacpp": [45.0, 90.0, 60.0], "llama-bench": [50.0, 100.0, 60.0],
                  "llama-bench-prompt": [200.0, 210.0, 190.0]},
        "target": {"llamacpp": [30.0, 31.0], "llama-bench": [40.0], "llama-bench-prompt": [100.0]}}}
    runs = {"loopback": {
        "llamacpp/llm": [_engine_row(x, 2 * x) for x in llm],
        "llamacpp/sd_g4": [_engine_row(1.2 * x, 2.4 * x, drafted=20, accepted=a, rejected=2, rounds=5, gamma=4)
                           for x, a in zip(llm, (10, 14, 18))],
        "llama-speculative/sd_g4": [{"tokens_per_s": 1.2 * x / 1.1, "decode_tokens_per_s": 2.4 * x / 1.1,
                                     "drafted": 20, "accepted": 15} for x in llm]}}
    return alone, runs


def test_engines_summary_keeps_its_medians_and_adds_intervals_over_prompts():
    alone, runs = _engines_inputs()
    s = bench_engines.summarise(alone, runs, n=64)
    assert s["alone"]["draft"]["llamacpp"] == 60.0  # the median, as before
    _within(s["alone_ci"]["draft"]["llamacpp"], [45.0, 90.0, 60.0], 3)
    assert s["alone_ci"]["target"]["llama-bench"] == {"mean": 40.0, "lo": None, "hi": None, "n": 1, "method": None}
    sd = s["hybrid"]["loopback"]["llamacpp/sd_g4"]
    assert sd["tokens_per_s"] == pytest.approx(24.0) and sd["acceptance"] == pytest.approx(42 / 60)
    _within(sd["tokens_per_s_ci"], [12.0, 24.0, 48.0], 3)
    _within(sd["decode_tokens_per_s_ci"], [24.0, 48.0, 96.0], 3)
    _within(sd["acceptance_ci"], [0.5, 0.7, 0.9], 3)
    assert "acceptance_ci" not in s["hybrid"]["loopback"]["llamacpp/llm"]
    _within(s["hybrid"]["loopback"]["llama-speculative/sd_g4"]["acceptance_ci"], [0.75] * 3, 3)


def test_engines_goal_ratios_are_intervals_of_paired_per_prompt_ratios():
    alone, runs = _engines_inputs()
    s = bench_engines.summarise(alone, runs, n=64)
    g, ci = s["goals"], s["goals_ci"]
    assert set(ci) == {k for k in g if not k.startswith("best_sd_") or "_vs_" in k}
    for what in ("request", "decode"):  # paired, the prompts' spread cancels: every per-prompt ratio is the same
        llm = ci[f"best_sd_vs_llamacpp_llm_{what} (>= 1.5)"]
        assert llm["n"] == 3 and llm["mean"] == pytest.approx(1.2) and llm["lo"] == pytest.approx(1.2)
        assert llm["hi"] == pytest.approx(1.2) and g[f"best_sd_vs_llamacpp_llm_{what} (>= 1.5)"] == pytest.approx(1.2)
        spec = ci[f"best_sd_vs_best_llama_speculative_{what} (>= 1.0)"]
        assert spec["n"] == 3 and spec["lo"] == pytest.approx(1.1) == spec["hi"]
    ratios = [45.0 / 50.0, 90.0 / 100.0, 60.0 / 60.0]  # engine vs llama-bench, turn by turn
    _within(ci["draft_engine_vs_llama_bench (>= 0.9)"], ratios, 3)
    assert ci["target_engine_vs_llama_bench"] is None  # 2 engine samples against 1 llama-bench: nothing to pair
    assert ci["cloud_llm_decode_vs_llama_bench_target (>= 0.9)"] is None
    table = bench_engines.format_table(s)
    assert "1.20 ± 0.00 (n=3, t)" in table and "60.0  65.0 ± " in table and "(n=3, t)" in table


def test_engines_summary_still_reads_single_rows_and_pairs_nothing_unequal():
    assert bench_engines.ratio_ci([1.0, 2.0], [1.0]) is None and bench_engines.ratio_ci([], []) is None
    assert bench_engines.ratio_ci([1.0], [0.0]) is None
    one = bench_engines.ratio_ci([3.0], [2.0])
    assert one == {"mean": 1.5, "lo": None, "hi": None, "n": 1, "method": None}


def test_hybrid_systems_and_their_rotation_keep_llama_speculative_beside_its_gamma():
    systems = bench_engines.hybrid_systems(["torch", "llamacpp"], [(4, 0.0), (8, 0.5)], speculative=True)
    assert systems == [(None, "torch"), (None, "llamacpp"), ((4, 0.0), "torch"), ((4, 0.0), "llamacpp"),
                       ((4, 0.0), "llama-speculative"), ((8, 0.5), "torch"), ((8, 0.5), "llamacpp")]
    assert len(bench_engines.hybrid_systems(["torch"], [(4, 0.0)], speculative=False)) == 2
    assert [bench_engines.run_label(v) for v, _ in systems[::2]] == ["llm", "sd_g4", "sd_g4", "sd_g8_eta0.5"]


class _Result:
    def __init__(self, tps):
        self.tokens, self.n, self.total_s, self.ttft_s, self.open_s = [1] * 4, 4, 4 / tps, 0.1, 0.0
        self.drafted = self.accepted = self.rejected = 0
        self.rounds, self.device_compute_s, self.cloud_compute_s = 4, 0.0, 0.0
        self.tps = tps

    def summary(self):
        return {"tokens_per_s": self.tps, "after_open_tokens_per_s": self.tps}


def test_the_engines_hybrid_loop_runs_every_system_per_prompt_in_rotated_turns(monkeypatch):
    calls = []

    class Runtime:
        def __init__(self, engine):
            self.engine, self.config = engine, SimpleNamespace(draft_len=0, draft_stop_prob=0.0)

        def generate(self, ids, protocol, params, n, seed=None):
            if n != 4:  # not the warm-up
                calls.append((ids[0], self.engine, protocol, self.config.draft_len if protocol == "sd" else 0))
            return _Result(10.0)

    class Bed:
        def __init__(self, target, cloud_args, threads, link):
            self.engine = cloud_args[1]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def link_config(self):
            return None

        def runtime(self, config):
            return Runtime(self.engine)

    def speculative(tools, args, text, gamma):
        calls.append((int(text), "llama-speculative", "sd", gamma))
        return {"tokens_per_s": 9.0, "decode_tokens_per_s": 9.0, "drafted": 4, "accepted": 3}

    monkeypatch.setattr(bench_engines, "Rig", Bed)
    monkeypatch.setattr(bench_engines, "EdgeConfig", lambda **kw: kw)
    monkeypatch.setattr(bench_engines, "llama_speculative", speculative)
    monkeypatch.setattr(bench_engines, "dataclasses", SimpleNamespace(
        replace=lambda c, **kw: SimpleNamespace(**{**vars(c), **kw})))
    args = argparse.Namespace(target="t", draft="d", threads=1, max_new_tokens=8)
    ids = [[0], [1], [2], [3]]
    out = bench_engines.hybrid(args, ids, ["0", "1", "2", "3"], tools="tools", engines=["torch", "llamacpp"],
                               links=["loopback"], variants=[(4, 0.0)])
    systems = [("torch", "llm", 0), ("llamacpp", "llm", 0), ("torch", "sd", 4), ("llamacpp", "sd", 4),
               ("llama-speculative", "sd", 4)]
    for i in range(len(ids)):  # prompt i: every system once, starting at system i mod k
        turn = [c[1:] for c in calls if c[0] == i]
        assert turn == systems[i % 5:] + systems[:i % 5]
    runs = out["loopback"]
    assert list(runs) == ["torch/llm", "llamacpp/llm", "torch/sd_g4", "llamacpp/sd_g4", "llama-speculative/sd_g4"]
    assert all(len(rows) == len(ids) for rows in runs.values())
    assert [r["gamma"] for r in runs["llamacpp/sd_g4"]] == [4] * 4


def test_the_engines_models_alone_rotate_engines_and_llama_bench_per_prompt_and_round(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave this process's torch as it is

    def decode_rate(lm, x, n):
        calls.append((x[0], lm))
        return 10.0

    def llama_bench(tools, gguf, n, depth, threads):
        calls.append((None, "llama-bench"))
        return 20.0, 200.0

    monkeypatch.setattr(bench_engines, "load_model", lambda name, dtype: SimpleNamespace(model=name))
    monkeypatch.setattr(bench_engines, "CausalLM", lambda model: "torch")
    monkeypatch.setattr(bench_engines, "LlamaCppLM", lambda path, settings: "llamacpp")
    monkeypatch.setattr(bench_engines, "gguf_path", lambda name: name)
    monkeypatch.setattr(bench_engines, "decode_rate", decode_rate)
    monkeypatch.setattr(bench_engines, "llama_bench_rates", llama_bench)
    args = argparse.Namespace(threads=1, draft="d", target="t", repeats=2, max_new_tokens=4)
    alone = bench_engines.models_alone(args, [[0], [1]], "tools", ["torch", "llamacpp"])
    k = ["torch", "llamacpp", "llama-bench"]
    order = [c[1] for c in calls]
    per_role = len(k) * 2  # two prompts a round and role
    # round 1 draft: prompts 0, 1; round 1 target; round 2 draft: prompts 2, 3 (the rotation goes on); round 2 target
    expected = []
    for r in range(2):
        for _ in ("draft", "target"):
            for i in range(2):
                expected += bench_engines.rotated(k, r * 2 + i)
    assert order == expected and len(order) == 4 * per_role
    assert [c[0] for c in calls if c[1] == "torch"] == [0, 1] * 4  # each prompt once per round and role
    rates = alone["tokens_per_s"]["draft"]
    assert {len(v) for v in rates.values()} == {4} and list(rates) == ["torch", "llamacpp", "llama-bench",
                                                                       "llama-bench-prompt"]


# -- hat-bench soak -------------------------------------------------------------------------------------------

def _soak_record(ttft, tokens=3, tbt=0.1, hostile_on=None, done=True, interruptions=0):
    times = [ttft + j * tbt for j in range(tokens)]
    return {"hostile_on": hostile_on, "protocol": "sd", "policy": "wait",
            "response": {"times": times},
            "verdict": {"completed": done, "tokens": tokens, "interruptions": interruptions, "degraded": 0,
                        "queue_s": 0.01, "delivered": True, "finals": 1, "error": None if done else "lost",
                        "reference": {"match": "exact"}}}


def test_soak_summary_adds_mean_intervals_over_requests_beside_its_percentiles(capsys):
    records = [_soak_record(t, tbt=b, interruptions=int(t > 1.5)) for t, b in
               ((1.0, 0.1), (2.0, 0.2), (1.5, 0.1), (3.0, 0.3))] + [_soak_record(9.0, done=False)]
    s = soak_summary(records, [], [], 100.0)
    assert s["ttft_s"]["p50"] == pytest.approx(1.75) and s["ttft_s"]["n"] == 4  # the percentiles stay
    _within(s["ttft_s_ci"], [1.0, 2.0, 1.5, 3.0], 4)
    _within(s["tbt_s_ci"], [0.1, 0.2, 0.1, 0.3], 4)
    _within(s["ttft_after_queue_s_ci"], [0.99, 1.99, 1.49, 2.99], 4)
    _within(s["ttft_s_interrupted_ci"], [2.0, 3.0], 2)
    _within(s["ttft_s_uninterrupted_ci"], [1.0, 1.5], 2)
    assert s["queue_s_ci"]["mean"] == pytest.approx(0.01) and s["queue_s_ci"]["n"] == 4
    for key in ("ttft_s", "tbt_s", "queue_s", "ttft_after_queue_s", "ttft_s_interrupted", "ttft_s_uninterrupted"):
        assert s[f"{key}_ci"]["mean"] == pytest.approx(s[key]["mean"]) and s[f"{key}_ci"]["n"] == s[key]["n"]
    print_summary({"summary": s, "memory": []})
    out = capsys.readouterr().out
    assert " ttft_s " in out and "1875 ± " in out and "(n=4, t) (95 %)" in out


def test_soak_hostile_sides_have_mean_intervals_and_one_request_none():
    sides = hostile_sides([_soak_record(1.0, hostile_on=False), _soak_record(2.0, hostile_on=False),
                           _soak_record(3.0, hostile_on=True), _soak_record(9.0, hostile_on=True, done=False)])
    _within(sides["without"]["ttft_s_ci"], [1.0, 2.0], 2)
    assert sides["with"]["ttft_s_ci"] == {"mean": pytest.approx(3.0), "lo": None, "hi": None, "n": 1, "method": None}
    assert sides["with"]["tbt_s_ci"]["mean"] == pytest.approx(0.1) and sides["p99_ttft_ratio"] is not None
    empty = hostile_sides([])
    assert empty["with"]["ttft_s_ci"] == {"mean": None, "lo": None, "hi": None, "n": 0, "method": None}
