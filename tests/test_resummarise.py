"""hat-bench resummarise: a stored report's summary recomputed from its own records with the current interval rule,
written beside the original under one key with its provenance; nothing else in the file changes."""
from __future__ import annotations

import json

import pytest

from profiles.bench import bench_engines, bench_hat
from profiles.bench.bench import main
from profiles.bench.resummarise import kind, resummarise
from tests.test_bench_intervals_system import _engines_inputs
from tests.test_bench_intervals_token import _hat_row


def _hat_report() -> dict:
    runs = {"U-shape": [_hat_row(2.0, 0.10, 11, 11), _hat_row(4.0, 0.30, 11, 11)],
            "+SD": [_hat_row(1.0, 0.05, 11, 6, 8, 5), _hat_row(3.0, 0.10, 11, 6, 8, 5)]}
    report = {"links": {"wifi": {"runs": runs}}, "tables": {"wifi": bench_hat.summarise(runs)},
              "trained_parameters": 1234, "provenance": {"git_commit": "a" * 40}}
    report["table4"] = bench_hat.table4(report)
    return report


def test_a_hat_report_is_summarised_again_with_t_intervals_over_two_prompts(tmp_path):
    report = _hat_report()
    for ci in (report["tables"]["wifi"]["+SD"]["ttft_change_ci"], report["table4"]["wifi"]["decode_speedup_ci"]):
        del ci["method"]  # as a report written before the rule: no method
    path = tmp_path / "hat.json"
    path.write_text(json.dumps(report))
    assert main(["resummarise", str(path)]) == 0
    back = json.loads(path.read_text())
    new = back.pop("resummarised")
    assert back == report  # the run's own figures and provenance untouched
    assert new["bench"] == "hat" and "Student-t" in new["rule"] and len(new["provenance"]["git_commit"]) == 40
    change = new["tables"]["wifi"]["+SD"]["ttft_change_ci"]  # per prompt 1/2 and 3/4: mean 0.625 - 1
    assert change["method"] == "t" and change["n"] == 2 and change["mean"] == pytest.approx(-0.375)
    assert change["hi"] - change["lo"] == pytest.approx(2 * 12.7062047 * 0.125)  # t(1) · |0.75 - 0.5| / 2, twice
    speedup = new["table4"]["wifi"]["decode_speedup_ci"]
    assert speedup["method"] == "t" and speedup["mean"] == pytest.approx((2.0 + 3.0) / 2)


def test_an_engines_report_is_summarised_again_and_other_files_are_refused(tmp_path):
    alone, runs = _engines_inputs()
    report = {"max_new_tokens": 64, "alone": alone, "hybrid": runs,
              "summary": bench_engines.summarise(alone, runs, 64)}
    new = resummarise(report)
    assert new["bench"] == "engines" and new["summary"]["goals"] == report["summary"]["goals"]
    assert new["summary"]["alone_ci"]["draft"]["llamacpp"]["method"] == "t"
    with pytest.raises(ValueError, match="hat-bench hat, engines or auto"):
        kind({"summary": {}})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert main(["resummarise", str(path), "--key", "summary"]) == 2  # would overwrite the run's own summary
    assert json.loads(path.read_text()) == report


def test_a_report_with_nan_is_rewritten_as_strict_json_and_says_how_many(tmp_path):
    from hat_split.files import strict_json

    path = tmp_path / "old.json"
    path.write_text('{"rows": [{"acceptance_rate": NaN, "n": 3}, {"acceptance_rate": 0.5}], "x": Infinity}')
    assert main(["resummarise", "--strict-only", str(path)]) == 0
    back = strict_json.loads(path.read_text())  # a strict parser reads it now
    assert back["rows"] == [{"acceptance_rate": None, "n": 3}, {"acceptance_rate": 0.5}] and back["x"] is None
    assert back["strict_json"]["non_finite_written_as_null"] == 2 and back["strict_json"]["provenance"]["git_commit"]
    assert main(["resummarise", "--strict-only", str(path)]) == 0  # again: nothing to count, the record stays
    assert strict_json.loads(path.read_text())["strict_json"]["non_finite_written_as_null"] == 2


def test_an_auto_report_is_summarised_again_with_the_models_error_at_the_same_request(tmp_path):
    """A `hat-bench auto` report's rows summarised again: the phases and protocols as the run had them, and the model's
    error at the same request (auto's llm-only request: predicted 9 against its own 10 tok/s) beside the old figures."""
    from profiles.bench.bench_auto import Phase, summarise

    def row(protocol, steady, ran=(), predicted=None):
        return {"rep": 0, "phase": "lte", "protocol": protocol, "tokens": 32, "total_s": 32 / steady, "ttft_s": 0.3,
                "steady_tokens_per_s": steady, "cloud_s_per_token": 0.02, "up_bytes_per_token": 10.0, "degraded": 0,
                "auto": [{"protocol": p, "tokens": 16} for p in ran], **({"predicted": predicted} if predicted else {})}

    rows = [row("llm", 11.0), row("sd", 8.0), row("auto", 10.0, ("llm", "llm"), {"llm": 9.0, "sd": 7.0})]
    phases = [Phase("lte", "lte")]
    report = {"phases": [p.__dict__ for p in phases], "rows": rows, "summary": summarise(rows, phases, ["llm", "sd"])}
    new = resummarise(report)
    assert new["bench"] == "auto" and list(new["summary"]["lte"]["protocols"]) == ["llm", "sd", "auto"]
    assert new["summary"]["lte"]["model_error_same_request"] == {
        "llm": {"n": 1, "median_abs_error": pytest.approx(0.1), "max_abs_error": pytest.approx(0.1)}}
