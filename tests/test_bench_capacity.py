"""`hat-bench capacity` (profiles.bench.bench_capacity): the time between tokens a commit's tokens share, and the
capacity read off the cells (the largest fleet such that every size up to it met the SLA). The emulated device's
played-back draft is tested end to end in tests/test_recorded_draft.py."""
from __future__ import annotations

import argparse

import pytest

from profiles.bench.bench_capacity import between_tokens, capacity, run


def test_the_tokens_of_a_commit_share_its_gap():
    # 8 tokens at 1.0 s (the first commit: TTFT's), 8 at 1.4 s, 2 at 1.5 s
    assert between_tokens([(1.0, 8), (1.4, 8), (1.5, 2)]) == pytest.approx([0.05] * 8 + [0.05] * 2)
    assert between_tokens([(1.0, 8)]) == []


def test_capacity_is_the_largest_fleet_within_the_sla():
    def cell(protocol, n, ok, tps):
        return {"protocol": protocol, "devices": n, "within_sla": ok, "cloud_tokens_per_s": tps}

    cells = [cell("llm", 1, True, 8.0), cell("llm", 2, True, 9.0), cell("llm", 4, False, 9.5),
             cell("sd", 1, True, 7.0), cell("sd", 2, False, 8.0), cell("sd", 4, True, 12.0),
             cell("auto", 1, False, 1.0)]
    got = capacity(cells, ["llm", "sd", "auto"])
    assert got["llm"] == {"devices": 2, "cloud_tokens_per_s": 9.0}
    assert got["sd"]["devices"] == 1  # within the SLA at every size up to it: 4 passing after 2 failed is noise
    assert got["auto"] == {"devices": 0, "cloud_tokens_per_s": 0.0}


@pytest.mark.parametrize("field,value,message", [
    ("devices", "0,2", "positive sizes"), ("devices", "1,two", "comma-separated fleet sizes"),
    ("requests", 0, "--requests"), ("gamma", 2, "--gamma"),
    ("cloud_cores", 99, "--cloud-cores")])
def test_bad_arguments_are_refused_before_anything_starts(field, value, message):
    args = argparse.Namespace(protocols="llm,sd,auto", devices="1,2", requests=1, gamma=8, draft_len=4,
                              cloud_cores=1)
    setattr(args, field, value)
    with pytest.raises(ValueError, match=message):
        run(args)
