"""Every hat-bench report carries where it came from: commit, tree state, command, machine, versions."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from profiles.bench.provenance import REPO, write_report


def test_a_report_is_stamped_with_its_commit_and_command(tmp_path):
    out = tmp_path / "sub" / "report.json"
    write_report(str(out), {"figure": 1.5})
    report = json.loads(out.read_text())
    p = report["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    assert report["figure"] == 1.5 and p["git_commit"] == head and re.fullmatch(r"[0-9a-f]{40}", head)
    assert isinstance(p["dirty"], list) and p["dirty_files"] >= len(p["dirty"])
    assert p["machine"]["cpus"] >= 1 and p["command"] and p["finished_utc"].endswith("+00:00")
    assert "numpy" in p["versions"]


def test_a_caller_stamp_is_kept_and_torch_is_never_imported_for_it(tmp_path):
    out = tmp_path / "r.json"
    write_report(str(out), {"provenance": {"git_commit": "from the device"}})
    assert json.loads(out.read_text())["provenance"] == {"git_commit": "from the device"}
    code = ("import sys; from profiles.bench.provenance import provenance; p = provenance(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(p['git_commit'])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
