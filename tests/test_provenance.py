"""Every hat-bench report, calibration file, adapter and resumable record carries where it came from: commit, tree
state, command, machine (its SIMD features too), versions."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from hat_split.files import provenance as prov
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


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_dirty_tracked_files_come_back_with_their_whole_names(tmp_path, monkeypatch):
    # " M README.md": the first status column is a space, so the name starts at column 3 of the first line; stripping
    # the output before slicing once gave "EADME.md"
    for name in ("README.md", "a b.txt", "old.txt", "untouched.txt"):
        (tmp_path / name).write_text("x\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    (tmp_path / "README.md").write_text("changed\n")
    (tmp_path / "a b.txt").write_text("changed\n")
    _git(tmp_path, "mv", "old.txt", "new.txt")
    (tmp_path / "untracked.txt").write_text("not counted\n")
    monkeypatch.setattr(prov, "REPO", str(tmp_path))
    state = prov.git_state()
    assert sorted(state["dirty"]) == ["README.md", "a b.txt", "new.txt"] and state["dirty_files"] == 3
    assert re.fullmatch(r"[0-9a-f]{40}", state["git_commit"])
    assert prov.dirty_paths(" M README.md\0R  new.txt\0old.txt\0") == ["README.md", "new.txt"]
    assert prov.dirty_paths("") == []


def test_the_machine_names_its_simd_features():
    x86 = "model name\t: AMD EPYC\nflags\t\t: fpu smep sse4_2 avx avx2 fma avx512f avx512_bf16 amx_tile ht\n"
    assert prov.cpu_info(x86) == {"cpu_model": "AMD EPYC",
                                  "simd": ["amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "fma", "sse4_2"]}
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes asimdhp sve\n"
    assert prov.cpu_info(arm) == {"cpu_model": "", "simd": ["asimd", "asimdhp", "sve"]}
    m = prov.machine()
    assert isinstance(m.get("simd", []), list) and m["cpus"] >= 1
    started = prov.provenance("started_utc")
    assert started["started_utc"].endswith("+00:00") and "finished_utc" not in started
