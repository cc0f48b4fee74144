"""Every file in results/ says where it came from: each JSON carries "provenance" (a calibration file in its free
field, extra.provenance) and each line of a .jsonl its own, with the commit, the command and the machine; a stamp
added afterwards from the git history says so."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _stamp_ok(stamp, where: str) -> None:
    assert isinstance(stamp, dict), f"{where}: no provenance"
    assert {"git_commit", "command", "machine"} <= set(stamp), f"{where}: provenance without {stamp.keys()}"
    assert stamp["git_commit"] == "unknown" or len(stamp["git_commit"]) == 40, where
    written = "finished_utc" in stamp or "started_utc" in stamp
    assert written or "added" in stamp.get("recorded", ""), f"{where}: neither the run's stamp nor marked as added"


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_results_json_carries_provenance(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    stamp = data.get("provenance")
    if stamp is None and str(data.get("format", "")).startswith("hatspec-calibration/"):
        stamp = data.get("extra", {}).get("provenance")  # the calibration format refuses unknown top-level fields
    _stamp_ok(stamp, str(path))


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.jsonl")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_record_of_a_resumable_run_carries_provenance(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines
    for i, line in enumerate(lines):
        _stamp_ok(json.loads(line).get("provenance"), f"{path}:{i + 1}")
