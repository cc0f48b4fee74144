"""Where a benchmark figure came from: the commit it ran on (and whether the tree differed from it), the command, the
time, the machine and the versions of what did the work. Every `hat-bench` report is written through `write_report`,
which stamps this under "provenance", so a figure in results/ or docs/ can be traced to code and rerun.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Dict, List, Optional

from hat_split.files.atomic import write_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("torch", "transformers", "llama_cpp_python", "onnxruntime", "numpy", "pyzmq")


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=REPO,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict:
    """{git_commit: 40 hex digits or "unknown", dirty: tracked files that differ from it (at most 20 named)}."""
    commit = _git("rev-parse", "HEAD") or "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no")
    dirty: List[str] = [line[3:] for line in changed.splitlines()] if changed else []
    return {"git_commit": commit, "dirty": dirty[:20], "dirty_files": len(dirty)}


def machine() -> dict:
    out = {"node": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
           "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            out["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    if "torch" in sys.modules:  # never import torch for this: a torch-free bench stays torch-free
        torch = sys.modules["torch"]
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def versions() -> Dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def provenance() -> dict:
    return {**git_state(), "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions()}


def write_report(path: str, report: dict, indent: int = 1) -> None:
    """`report` with its provenance (kept when the caller stamped one already), atomically as JSON at `path`."""
    report.setdefault("provenance", provenance())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, report, indent=indent)
