"""Where a measured figure came from: the commit it ran on (and the tracked files that differed from it), the command,
the time, the machine (CPU model and SIMD features: figures differ between AVX-512 and AVX2-only machines) and the
versions of what did the work. Every `hat-bench` report (profiles.bench.provenance.write_report), `hat-calibrate`'s
file, `hat-distill`'s adapter.json and every record of a resumable run carry it under "provenance", so a figure in
results/ or docs/ can be traced to code and rerun. Stdlib only: a device without torch stamps its files too.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("torch", "transformers", "llama_cpp_python", "onnxruntime", "numpy", "pyzmq")
SIMD_PREFIXES = {"flags": ("sse4", "avx", "fma", "f16c", "amx"),  # x86's /proc/cpuinfo line (not "smep": no SIMD)
                 "Features": ("asimd", "neon", "sve", "sme")}  # Arm's
MAX_DIRTY_NAMED = 20


def _git(*args: str) -> Optional[str]:
    """git's stdout as it is (never stripped: `status --porcelain` lines begin with their status columns)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=REPO,
                              timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def dirty_paths(porcelain_z: str) -> List[str]:
    """The paths of `git status --porcelain -z` output: entries "XY PATH" ended by NUL, a rename or copy followed by
    its origin as an entry of its own (left out here)."""
    entries, out, i = porcelain_z.split("\0"), [], 0
    while i < len(entries):
        entry = entries[i]
        if len(entry) > 3:
            out.append(entry[3:])
            if {"R", "C"} & set(entry[:2]):
                i += 1  # the origin's path follows
        i += 1
    return out


def git_state() -> dict:
    """{git_commit: 40 hex digits or "unknown", dirty: tracked files that differ from it (at most 20 named),
    dirty_files: how many}."""
    commit = (_git("rev-parse", "HEAD") or "").strip() or "unknown"
    dirty = dirty_paths(_git("status", "--porcelain", "-z", "--untracked-files=no") or "")
    return {"git_commit": commit, "dirty": dirty[:MAX_DIRTY_NAMED], "dirty_files": len(dirty)}


def cpu_info(text: str) -> dict:
    """{"cpu_model", "simd"} from /proc/cpuinfo's text: the model name and the SIMD features (SIMD_PREFIXES) among its
    "flags" (x86) or "Features" (Arm), sorted."""
    model, simd = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in SIMD_PREFIXES:
            simd.update(f for f in value.split() if f.startswith(SIMD_PREFIXES[key]))
    return {"cpu_model": model, "simd": sorted(simd)}


def machine() -> dict:
    out = {"node": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
           "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            out.update(cpu_info(f.read()))
    except OSError:
        pass
    if "torch" in sys.modules:  # never import torch for this: a torch-free tool stays torch-free
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


def provenance(time_key: str = "finished_utc") -> dict:
    """This process's stamp: git state, command, the time now under `time_key` ("finished_utc" for a report written at
    the end, "started_utc" for the records of a run stamped at its start), machine, versions."""
    return {**git_state(), "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
            time_key: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions()}
