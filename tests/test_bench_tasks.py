"""hat-bench tasks: completion cutting, scoring through the sandbox, GSM8K matching, the summary's intervals and paired
differences, the resume file; and one tiny real run on the Qwen pair."""
from __future__ import annotations

import json

import pytest

from profiles.bench import bench_tasks
from profiles.bench.task_scoring import (CutWatch, append_record, cut_completion, format_table, gsm8k_prompt, load_done,
                                         summarise)
from profiles.bench.tasks import humaneval_problems
from tests.conftest import requires_real_pair


def test_cut_stops_at_the_first_unindented_line():
    body = "    return a + b\n\n    # done\n"
    assert cut_completion(body + "\ndef other():\n    pass\n") == body + "\n"  # blank lines kept
    assert cut_completion(body + "print(add(1, 2))\n") == body
    assert cut_completion(body + "if __name__ == '__main__':\n    main()") == body
    assert cut_completion(body + "class X:\n    pass") == body
    assert cut_completion(body + "```\nSome prose.") == body
    assert cut_completion(body) == body  # nothing to cut
    assert cut_completion("def f():\n    pass") == ""  # a new top-level def at once: an empty body


def test_humaneval_scores_through_the_sandbox():
    problem = humaneval_problems()["HumanEval/0"]
    right = bench_tasks.score("humaneval", problem, problem.canonical_solution + "\n\ndef unrelated():\n    1 / 0\n")
    wrong = bench_tasks.score("humaneval", problem, "    return False\n")
    assert right["score"] == 1.0 and right["detail"] == "passed"
    assert wrong["score"] == 0.0 and wrong["detail"] != "passed"
    assert right["answer"] == problem.canonical_solution + "\n\n"  # the cut dropped the trailing def


def test_gsm8k_scores_the_final_number():
    class P:
        solution = "She has 3 + 4 = 7 apples.\n#### 1,250"

    assert bench_tasks.score("gsm8k", P, "3 + 4 = 7, so 1250 in all.\n#### 1250")["score"] == 1.0
    assert bench_tasks.score("gsm8k", P, "The answer is $1,250.00")["score"] == 1.0  # the last number
    assert bench_tasks.score("gsm8k", P, "#### 1250\nthen 7 more")["score"] == 1.0  # after the last ####
    assert bench_tasks.score("gsm8k", P, "1250 - 7 = 1243")["score"] == 0.0
    assert bench_tasks.score("gsm8k", P, "I do not know.")["score"] == 0.0
    assert "####" in gsm8k_prompt("How many?")


def _rec(task, i, proto, score, n=10, skipped=0, tps=4.0, answer=None):
    return {"task": task, "task_id": f"{task}/{i}", "protocol": proto, "score": score, "n_tokens": n,
            "skipped": skipped, "tokens_per_s": tps, "answer": f"answer {score}" if answer is None else answer}


def test_summary_intervals_and_paired_differences():
    llm = [1, 1, 0, 1, 0, 1, 1, 0]
    uhlm = [1, 0, 0, 1, 0, 1, 0, 0]  # loses two of llm's passes, gains none
    recs = [_rec("gsm8k", i, "llm", s) for i, s in enumerate(llm)]
    recs += [_rec("gsm8k", i, "uhlm", s, skipped=5) for i, s in enumerate(uhlm)]
    cos = {("gsm8k", f"gsm8k/{i}", "uhlm"): 0.5 for i in range(8)}
    out = summarise(recs, cos)["gsm8k"]
    assert out["llm"]["n"] == out["uhlm"]["n"] == 8
    assert out["llm"]["score"]["mean"] == pytest.approx(5 / 8)
    assert out["llm"]["score"]["lo"] < 5 / 8 < out["llm"]["score"]["hi"]
    assert out["llm"]["diff_vs_llm"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0, "n": 8, "method": "bootstrap"}
    assert out["llm"]["score"]["n"] == 8 and out["llm"]["score"]["method"] == "bootstrap"
    d = out["uhlm"]["diff_vs_llm"]
    assert d["mean"] == pytest.approx(-2 / 8) and d["n"] == 8
    assert d["lo"] < -2 / 8 <= d["hi"] <= 0.0  # never a gain: the paired interval stays at or below 0
    assert out["uhlm"]["cosine_vs_llm"] == pytest.approx(0.5) and out["llm"]["cosine_vs_llm"] is None
    assert out["uhlm"]["skip_rate"] == pytest.approx(0.5) and out["llm"]["skip_rate"] == 0.0
    assert out["llm"]["same_answer_as_llm"] == 8 and out["uhlm"]["same_answer_as_llm"] == 6  # the 6 equal scores
    table = format_table({"gsm8k": out})
    assert "uhlm" in table and "-0.250 [" in table and "(n=8, bootstrap)" in table


def test_summary_without_baseline_or_with_one_prompt():
    out = summarise([_rec("humaneval", 0, "slm", 1.0)])["humaneval"]["slm"]
    assert out["n"] == 1 and out["score"] == {"mean": 1.0, "lo": None, "hi": None, "n": 1, "method": None}
    assert out["diff_vs_llm"] is None
    assert "slm" in format_table({"humaneval": {"slm": out}})


def test_uplink_bytes_per_token_and_their_share_of_hlms():
    """Bytes per generated token over the records that counted them (older records did not: they count for nothing,
    and n says how many did), and the share of hlm's where hlm ran."""
    recs = [{**_rec("gsm8k", 0, "hlm", 1.0, n=10), "up_bytes": 3_000_000},
            {**_rec("gsm8k", 1, "hlm", 1.0, n=30), "up_bytes": 9_000_000},  # 300 000 B a token over both
            {**_rec("gsm8k", 0, "cuhlm_online", 1.0, n=10, skipped=5), "up_bytes": 1_000},
            {**_rec("gsm8k", 1, "cuhlm_online", 1.0, n=30, skipped=15), "up_bytes": 2_000},
            _rec("gsm8k", 2, "cuhlm_online", 1.0, n=50, skipped=25),  # written before bytes were kept
            _rec("gsm8k", 0, "llm", 1.0)]
    out = summarise(recs)["gsm8k"]
    assert out["hlm"]["up_bytes_per_token"] == pytest.approx(300_000) and out["hlm"]["bytes_n"] == 2
    assert out["hlm"]["up_bytes_vs_hlm"] == pytest.approx(1.0)
    assert out["cuhlm_online"]["up_bytes_per_token"] == pytest.approx(75) and out["cuhlm_online"]["bytes_n"] == 2
    assert out["cuhlm_online"]["up_bytes_vs_hlm"] == pytest.approx(75 / 300_000)
    assert out["llm"]["up_bytes_per_token"] is None and out["llm"]["up_bytes_vs_hlm"] is None
    table = format_table({"gsm8k": out})
    assert "75 (2)" in table and "0.03%" in table
    no_hlm = summarise([r for r in recs if r["protocol"] != "hlm"])["gsm8k"]["cuhlm_online"]
    assert no_hlm["up_bytes_per_token"] == pytest.approx(75) and no_hlm["up_bytes_vs_hlm"] is None


def test_resume_keeps_matching_records_only(tmp_path):
    path = str(tmp_path / "r.jsonl")
    config = {"max_new_tokens": 24}
    assert load_done(path, config) == {}
    append_record(path, {**_rec("gsm8k", 0, "llm", 1.0), "config": config})
    append_record(path, {**_rec("gsm8k", 1, "llm", 0.0), "config": {"max_new_tokens": 32}})  # other settings
    append_record(path, {**_rec("gsm8k", 0, "llm", 0.0), "config": config})  # a redo: the last one counts
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"task": "gsm8k", "task_')  # a run killed mid-line
    done = load_done(path, config)
    assert list(done) == [("gsm8k", "gsm8k/0", "llm")] and done[("gsm8k", "gsm8k/0", "llm")]["score"] == 0.0


def test_a_humaneval_answer_stops_once_its_cut_is_decided():
    watch = CutWatch()
    for chunk in ["    x = 1\n", "\n", "    return x", "\n\n", "  # still indented\n"]:
        watch.add(chunk)
        assert watch.done() == ""
    watch.add("i")  # an unindented line has begun: the cut cannot move any more
    assert watch.done() == "stop"
    assert cut_completion(watch.text + "f __name__ == '__main__':\n    x()") == cut_completion(watch.text)


@pytest.mark.real_models
@requires_real_pair
def test_tiny_real_run(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")
    from profiles.bench.bench import main

    out = tmp_path / "tasks.json"
    argv = ["tasks", "--prompts", "2", "--tasks", "humaneval,gsm8k", "--protocols", "llm,uhlm,uhlm@answer-refit:0.5",
            "--max-new-tokens", "12", "--engine", "llamacpp", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"humaneval", "gsm8k"}
    for task in summary:
        assert set(summary[task]) == {"llm", "uhlm", "uhlm@answer-refit:0.5"}
        for entry in summary[task].values():
            assert entry["n"] == 2 and entry["diff_vs_llm"]["n"] == 2 and entry["diff_vs_llm"]["method"] == "t"
            assert 0.0 <= entry["score"]["mean"] <= 1.0 and entry["tokens_per_s"] > 0
        llm = summary[task]["llm"]
        assert (llm["diff_vs_llm"]["mean"], llm["diff_vs_llm"]["lo"], llm["diff_vs_llm"]["hi"]) == (0.0, 0.0, 0.0)
        assert llm["cosine_vs_llm"] == pytest.approx(1.0)
    assert report["config"]["engine"] == "llamacpp"
    assert len(report["provenance"]["git_commit"]) == 40 and report["provenance"]["machine"]["cpus"] >= 1
    lines = (tmp_path / "tasks.jsonl").read_text().splitlines()
    assert len(lines) == 12  # 2 tasks × 2 problems × 3 protocols
    for line in lines:  # every record says which commit, command and machine made it
        stamp = json.loads(line)["provenance"]
        assert {k: stamp[k] for k in ("git_commit", "command")} == {k: report["provenance"][k]
                                                                    for k in ("git_commit", "command")}
        assert stamp["machine"]["cpus"] >= 1 and stamp["started_utc"].endswith("+00:00")
        rec = json.loads(line)  # and what it moved: at least the prompt up and a token down, in one round trip or more
        assert rec["up_bytes"] > 0 and rec["down_bytes"] > 0 and rec["round_trips"] >= 1
    assert main(argv) == 0  # a rerun finds everything done and generates nothing
    assert len((tmp_path / "tasks.jsonl").read_text().splitlines()) == 12
    assert [p["name"] for p in report["curve"]["gsm8k"]] != [] and report["matched_random"] == {}  # no randhlm ran
    more = [a if a != "2" else "3" for a in argv] + ["--report-only"]  # a third problem asked for, none generated
    assert main(more) == 0 and len((tmp_path / "tasks.jsonl").read_text().splitlines()) == 12
    assert {e["n"] for t in json.loads(out.read_text())["summary"].values() for e in t.values()} == {2}


def test_operating_points_name_their_settings_and_bad_ones_are_refused():
    from profiles.bench.operating_points import record_config, resolve

    P = bench_tasks.PROTOCOLS
    assert resolve("uhlm", P) == ("uhlm", {})
    assert resolve("uhlm@answer:0.5", P) == ("uhlm", {"skip_rule": "answer", "answer_risk": 0.5})
    assert resolve("cuhlm_online@answer-refit:1", P) == ("cuhlm", {"k_mode": "online", "skip_rule": "answer",
                                                                   "answer_risk": 1.0, "refit": True})
    assert resolve("randhlm@p:0.45", P) == ("randhlm", {"random_skip_prob": 0.45})
    assert resolve("uhlm@token-refit:0.01", P) == ("uhlm", {"refit": True, "token_risk": 0.01})
    for bad, message in [("uhlm@p:0.3", "applies to randhlm, not uhlm"), ("uhlm@answer:x", "needs a number"),
                         ("uhlm@answer:-1", "answer_risk must be"), ("sd@u:0.3", "unknown protocol"),
                         ("llm@u:0.3", "applies to uhlm, cuhlm, not llm"), ("uhlm@eps:1", "unknown operating point"),
                         ("randhlm@p:1.5", "random_skip_prob must be")]:
        with pytest.raises(ValueError, match=message):
            resolve(bad, P)
    from edge_runtime.config import UncertaintyConfig

    old_style = record_config(UncertaintyConfig())  # a record written before the skip rules had these fields
    assert "skip_rule" not in old_style and "refit" not in old_style and "u_threshold" in old_style
    assert record_config(UncertaintyConfig(skip_rule="answer"))["skip_rule"] == "answer"


def test_the_sweeps_curve_and_the_random_point_at_the_nearest_skip_rate():
    """A hand-made sweep: llm, one uncertainty point skipping half the tokens, random points at 30 % and 60 %. The
    curve is ordered by skip rate and the uncertainty point is matched with the 60 % random one, paired on the
    problems both ran."""
    from profiles.bench.operating_points import curve

    recs = []
    for i in range(10):
        recs.append(_rec("gsm8k", i, "llm", 1.0))
        recs.append(_rec("gsm8k", i, "uhlm@answer:0.5", 1.0 if i < 9 else 0.0, skipped=5))
        recs.append(_rec("gsm8k", i, "randhlm@p:0.3", 1.0 if i < 8 else 0.0, skipped=3))
        recs.append(_rec("gsm8k", i, "randhlm@p:0.6", 1.0 if i < 5 else 0.0, skipped=6))
    curves = curve(summarise(recs), bench_tasks.PROTOCOLS)
    assert [(p["name"], p["skip_rate"]) for p in curves["gsm8k"]] == [
        ("randhlm@p:0.3", 0.3), ("uhlm@answer:0.5", 0.5), ("randhlm@p:0.6", 0.6)]
    assert curves["gsm8k"][1]["diff_vs_llm"]["mean"] == pytest.approx(-0.1)
    matched = bench_tasks.match_random(recs, curves)["gsm8k"]
    assert len(matched) == 1 and matched[0]["random"] == "randhlm@p:0.6"
    d = matched[0]["diff_vs_random"]
    assert d["mean"] == pytest.approx(0.4) and d["n"] == 10 and d["lo"] > 0  # 4 problems won, none lost
