"""`hat-bench soak` (issue 9): the answer checker on its own, and a short soak on the real model (CI's version of the
10-minute command: three devices, link cuts, every answer checked against the model's greedy one)."""
from __future__ import annotations

import json

import pytest

from profiles.bench.soak_check import compare, slope_mb_per_min

REF = [1, 2, 3, 4, 5, 6, 7, 8]


def test_compare_tells_exact_duplicated_lost_and_other():
    assert compare(REF, REF) == {"match": "exact"}
    assert compare([1, 2, 3, 4, 3, 4, 5, 6], REF) == {"match": "duplicated", "at": 4, "run": 2}
    assert compare([1, 2, 5, 6, 7, 8], REF)["match"] == "lost"  # 3, 4 skipped
    assert compare([1, 2, 3], REF) == {"match": "lost", "at": 3, "run": 5}  # ended early
    assert compare(REF + [9], REF) == {"match": "duplicated", "at": 8, "run": 1}  # went on past the end
    assert compare([1, 2, 9, 4, 5, 6, 7, 8], REF) == {"match": "other", "at": 2}
    assert compare([1, 2, 3, 9, 9], REF, upto=3) == {"match": "exact"}  # the rest was the device's own (degrade)
    assert compare([1, 7, 3, 9], REF, upto=3)["match"] == "other"


def test_slope_is_in_mb_per_minute():
    assert slope_mb_per_min([(0, 100.0), (60, 110.0), (120, 120.0)]) == pytest.approx(10.0)
    assert slope_mb_per_min([(0, 100.0)]) is None


@pytest.mark.real_models
def test_a_short_soak_loses_and_repeats_nothing(tmp_path):
    from hat_split.models.registry import is_installed
    from profiles.bench.bench import main

    if not is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed")
    out = tmp_path / "soak.json"
    rc = main(["soak", "--devices", "3", "--hosts", "1", "--draft", "model", "--protocols", "sd,llm",
               "--duration", "20", "--rate", "0.4", "--max-tokens", "12", "--prompts", "4", "--max-prompt-tokens",
               "96", "--cut-rate", "0.4", "--cut-seconds", "0.5,4", "--long-cuts", "0.25", "--long-cut-seconds", "8",
               "--session-timeout", "5", "--heartbeat", "1", "--sample-every", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    s = report["summary"]
    assert rc == 0, s
    assert s["requests"] >= 3 and s["completed"] == s["requests"] and s["lost"] == s["duplicated"] == 0
    assert s["lost_tokens"] == 0 and s["delivery_inconsistent"] == 0 and s["cuts"] >= 1
    assert s["reference_exact"] + s["by_policy"].get("degrade", {}).get("completed", 0) >= s["completed"] - \
        s["reference_other"]
    assert report["memory"][-1]["cloud"]["open"] == 0 and report["memory"][-1]["cloud"]["kv_positions"] == 0
    assert set(report["memory"][-1]["rss_mb"]) == {"cloud", "host-0", "driver"}
