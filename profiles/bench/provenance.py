"""Every `hat-bench` report is written through `write_report`, which stamps it with hat_split.files.provenance (the
commit, the dirty tracked files, the command, the time, the machine and its SIMD features, the versions) under
"provenance", so a figure in results/ or docs/ can be traced to code and rerun.
"""
from __future__ import annotations

import os

from hat_split.files.atomic import write_json
from hat_split.files.provenance import REPO, git_state, machine, provenance, versions

__all__ = ["REPO", "git_state", "machine", "provenance", "versions", "write_report"]


def write_report(path: str, report: dict, indent: int = 1) -> None:
    """`report` with its provenance (kept when the caller stamped one already), atomically as JSON at `path`."""
    report.setdefault("provenance", provenance())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, report, indent=indent)
