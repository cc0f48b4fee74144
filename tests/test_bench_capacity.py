"""`hat-bench capacity` (profiles.bench.bench_capacity): the time between tokens a commit's tokens share, and the
capacity read off the cells (the largest fleet such that every size up to it met the SLA). The emulated device's
played-back draft is tested end to end in tests/test_recorded_draft.py."""
from __future__ import annotations

import argparse

import pytest

from profiles.bench.bench_capacity import Column, between_tokens, capacity, column, parse_slas, run, step_seconds_of


def test_the_tokens_of_a_commit_share_its_gap():
    # 8 tokens at 1.0 s (the first commit: TTFT's), 8 at 1.4 s, 2 at 1.5 s
    assert between_tokens([(1.0, 8), (1.4, 8), (1.5, 2)]) == pytest.approx([0.05] * 8 + [0.05] * 2)
    assert between_tokens([(1.0, 8)]) == []


def test_capacity_is_the_largest_fleet_within_the_sla():
    def cell(protocol, n, ttft, tbt, tps, failed=0):
        return {"protocol": protocol, "devices": n, "failed": failed, "cloud_tokens_per_s": tps,
                "ttft_s": {"n": 9, "p99": ttft}, "tbt_s": {"n": 90, "p99": tbt}}

    cells = [cell("llm", 1, 1.0, 0.05, 8.0), cell("llm", 2, 2.0, 0.2, 9.0), cell("llm", 4, 5.0, 0.3, 9.5),
             cell("sd", 1, 1.0, 0.1, 7.0), cell("sd", 2, 2.0, 0.4, 8.0), cell("sd", 4, 2.0, 0.2, 12.0),
             cell("auto", 1, 1.0, 0.05, 1.0, failed=1)]
    got = capacity(cells, ["llm", "sd", "auto"], 4.0, 0.25)
    assert got["llm"] == {"devices": 2, "cloud_tokens_per_s": 9.0}
    assert got["sd"]["devices"] == 1  # within the SLA at every size up to it: 4 passing after 2 failed is noise
    assert got["auto"] == {"devices": 0, "cloud_tokens_per_s": 0.0}  # a failed request is outside any SLA
    assert capacity(cells, ["llm", "sd"], 6.0, 0.5) == {"llm": {"devices": 4, "cloud_tokens_per_s": 9.5},
                                                        "sd": {"devices": 4, "cloud_tokens_per_s": 12.0}}
    assert parse_slas("4:250, 6:500") == [(4.0, 0.25), (6.0, 0.5)]
    for bad in ("4", "4:x", "0:250", ""):
        with pytest.raises(ValueError, match="--sla"):
            parse_slas(bad)


def test_the_clouds_step_seconds_are_read_off_its_metrics_page():
    page = ("# HELP hatspec_cloud_step_seconds compute time\n# TYPE hatspec_cloud_step_seconds histogram\n"
            'hatspec_cloud_step_seconds_bucket{le="0.01"} 3.0\nhatspec_cloud_step_seconds_count 12.0\n'
            "hatspec_cloud_step_seconds_sum 4.25\n")
    assert step_seconds_of(page) == 4.25
    with pytest.raises(ValueError, match="no hatspec_cloud_step_seconds_sum"):
        step_seconds_of("hatspec_cloud_batch_tokens_sum 3.0\n")


def test_an_auto_column_may_name_the_requests_sla_or_the_clouds_fleet_pace():
    assert column("auto@4") == Column("auto", sla=4.0) and column("auto@2.5") == ("auto", 2.5, 0.0)
    assert column("llm") == ("llm", 0.0, 0.0)
    assert column("auto~2") == Column("auto", fleet_pace=2.0)  # on a cloud with the operator's pace


@pytest.mark.parametrize("field,value,message", [
    ("devices", "0,2", "positive sizes"), ("devices", "1,two", "comma-separated fleet sizes"),
    ("requests", 0, "--requests"), ("gamma", 2, "--gamma"),
    ("cloud_cores", 99, "--cloud-cores"), ("sla", "4-250", "--sla"), ("protocols", "llm,warp", "warp"),
    ("protocols", "llm,sd@4", "a pace goes with auto"), ("protocols", "auto@fast", "auto@P"),
    ("protocols", "auto@0", "auto@P"), ("protocols", "llm~2", "auto~P"), ("protocols", "auto~1e5", "auto~P"),
    ("protocols", "auto~nan", "auto~P"), ("branch_margin", -1.0, "--branch-margin"),
    ("branch_margin", float("nan"), "--branch-margin")])
def test_bad_arguments_are_refused_before_anything_starts(field, value, message):
    args = argparse.Namespace(protocols="llm,sd,auto", devices="1,2", requests=1, gamma=8, draft_len=4,
                              cloud_cores=1, sla="4:250", branch_margin=1.0)
    setattr(args, field, value)
    with pytest.raises(ValueError, match=message):
        run(args)


def test_an_auto_cell_counts_the_tokens_of_each_choice():
    """What auto ran in a cell (`auto_tokens`): tokens summed per protocol and knob over every request's segments,
    sd's trees and η-chains by their shape, llm's chunk left out, the most first."""
    from edge_runtime.auto import Segment, tokens_by_choice

    segs = [Segment("sd", 4, "r", tokens=5), Segment("llm", 8, "r", tokens=12),
            Segment("sd", 8, "r", tokens=3, tree=(8, 8, 1)), Segment("sd", 4, "r", tokens=9),
            Segment("sd", 8, "r", tokens=2, tree=(8, 8, 1), eta=0.4), Segment("llm", 4, "r", tokens=1)]
    dicts = [s.as_dict() for s in segs] + [{"protocol": "slm", "knob": 0, "tokens": 2, "rounds": 0, "reason": "cut"}]
    assert tokens_by_choice(dicts) == {"sd γ=4": 14, "llm": 13, "sd tree 8x8x1": 3, "sd η-chain γ≤8 η=0.4": 2, "slm": 2}
    assert list(tokens_by_choice(dicts))[:2] == ["sd γ=4", "llm"] and tokens_by_choice([]) == {}
