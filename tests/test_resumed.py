"""`hat-bench auto --resume` (profiles.bench.resumed): a report written a cell at a time is continued only where it
measures the same thing, and keeps only complete cells; end to end on the real SmolLM2, a finished report extended by
a repetition keeps its rows and a resume with other arguments changes nothing."""
from __future__ import annotations

import json
import os

import pytest

from profiles.bench import resumed

HERE = {"git_commit": "a" * 40, "dirty": [], "machine": {"cpu_model": "AMD EPYC", "simd": ["avx2"], "cpus": 2,
                                                          "node": "vm"}}
ARGS = {"command": "auto", "protocols": "llm,auto", "trace": "loopback,lte", "repetitions": 3, "out": "r.json",
        "resume": True, "max_new_tokens": 32}


def _row(rep, phase, protocol):
    return {"rep": rep, "phase": phase, "protocol": protocol, "tokens": 32}


def _report(rows, **changes):
    prov = {**HERE, **changes.pop("provenance", {})}
    return {"args": {**ARGS, "repetitions": 2, "resume": False, **changes}, "rows": rows, "provenance": prov}


def test_only_cells_with_a_row_of_every_protocol_are_kept_in_their_order():
    rows = [_row(0, "loopback", "llm"), _row(0, "loopback", "auto"), _row(0, "lte", "auto"), _row(0, "lte", "llm"),
            _row(1, "loopback", "auto")]  # the run died during (1, loopback)
    done = resumed.cells_done(rows, ["llm", "auto"])
    assert done == {(0, "loopback"), (0, "lte")}
    assert resumed.kept_rows(rows, done) == rows[:4]
    assert resumed.cells_done(rows, ["llm", "auto", "sd"]) == set()  # a protocol added: no cell is complete


def test_a_report_is_continued_only_on_its_commit_machine_and_arguments():
    rows = [_row(0, "loopback", "llm")]
    resumed.check(_report(rows), "r.json", ARGS, HERE)  # the same: continued (more repetitions allowed)
    # each refusal names what differs, and both sides of it
    cases = [(_report(rows, provenance={"git_commit": "b" * 40}), "ran on commit " + "b" * 40),
             (_report(rows, provenance={"dirty": ["edge_runtime/auto.py"]}), "edge_runtime/auto.py"),
             (_report(rows, provenance={"machine": {**HERE["machine"], "simd": ["avx2", "avx512f"]}}),
              "another machine (simd: ['avx2', 'avx512f'] → ['avx2'])"),
             (_report(rows, provenance={"machine": {**HERE["machine"], "cpus": 16}}), "cpus: 16 → 2"),
             (_report(rows, max_new_tokens=48), "max_new_tokens: 48 → 32"),
             (_report(rows, trace="loopback"), "trace: 'loopback' → 'loopback,lte'")]
    for report, said in cases:
        with pytest.raises(ValueError) as exc:
            resumed.check(report, "r.json", ARGS, HERE)
        assert said in str(exc.value), str(exc.value)
    with pytest.raises(ValueError, match="holds 3 repetitions, more than --repetitions 2"):
        resumed.check(_report([_row(2, "loopback", "llm")]), "r.json", {**ARGS, "repetitions": 2}, HERE)
    # another machine's name alone is no difference (a session's container is named anew); the report's own file
    # among the uncommitted ones is none either: a tracked report changes as it is written
    resumed.check(_report(rows, provenance={"machine": {**HERE["machine"], "node": "other"}}), "r.json", ARGS, HERE)
    mine = {**HERE, "dirty": ["results/r.json"]}
    resumed.check(_report(rows), "/repo/results/r.json", ARGS, mine, repo="/repo")


def test_a_file_that_is_no_report_is_refused_and_left_as_it_is(tmp_path):
    assert resumed.load(str(tmp_path / "none.json"), ARGS, HERE) is None  # nothing to resume: the run starts afresh
    for text in ('{"rows": [', "[1, 2]", '{"rows": [{"rep": "0", "phase": "lte", "protocol": "llm"}]}',
                 '{"args": {}}'):
        path = tmp_path / "r.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="left as it is"):
            resumed.load(str(path), ARGS, HERE)
        assert path.read_text() == text


@pytest.mark.real_models
def test_a_finished_trace_is_extended_by_a_repetition_and_its_rows_kept(smollm2, tmp_path):
    from profiles.bench.bench import main

    out = tmp_path / "auto.json"
    base = ["auto", "--draft", "smollm2-135m", "--target", "smollm2-135m", "--engine", "torch", "--trace", "loopback",
            "--max-new-tokens", "8", "--protocols", "llm", "--chains", "", "--out", str(out)]
    assert main(base + ["--repetitions", "1"]) == 0
    first = json.loads(out.read_text())
    assert first["complete"] and len(first["runs"]) == 1 and [r["rep"] for r in first["rows"]] == [0]
    assert main(base + ["--repetitions", "2", "--resume"]) == 0
    second = json.loads(out.read_text())
    assert second["complete"] and second["rows"][0] == first["rows"][0]  # kept, not run again
    assert [r["rep"] for r in second["rows"]] == [0, 1] and all(r["tokens"] == 8 for r in second["rows"])
    assert second["runs"][0] == first["provenance"] and len(second["runs"]) == 2
    assert second["wall_s"] > first["wall_s"] and second["summary"]["loopback"]["protocols"]["llm"]["n"] == 2
    stamp = os.stat(out).st_mtime_ns
    assert main(base + ["--repetitions", "3", "--resume", "--max-new-tokens", "12"]) == 2  # refused before a load
    assert os.stat(out).st_mtime_ns == stamp and json.loads(out.read_text()) == second
