"""What this installation of hatspec is: its version, the wire protocol it speaks, the Python it runs on, the build a
`hat-flash --software` install recorded, and the engines it can use. `hat-edge version` prints it; `hat-fleet up`
compares every device's with the cloud's before it starts anything. Standard library only (and the wire's constant)."""
from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Dict, Optional

from hat_split.wire.messages import PROTOCOL_VERSION

SOFTWARE_STAMP = "hatspec-software.json"  # in a venv hat-flash --software made: what it installed there
# module → the distributions that may provide it (the first installed one's version is reported)
ENGINES = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu"), "tensorrt": ("tensorrt",), "torch": ("torch",),
           "llama_cpp": ("llama_cpp_python",)}


def hatspec_version() -> str:
    try:
        return metadata.version("hatspec")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the checkout)"


def software_stamp() -> Optional[Dict[str, Any]]:
    """What hat-flash --software recorded in this venv, or None (not installed that way)."""
    try:
        return json.loads((Path(sys.prefix) / SOFTWARE_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _engine(module: str) -> Optional[str]:
    if find_spec(module) is None:
        return None
    for dist in ENGINES[module]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "installed"  # importable without package metadata (JetPack's apt-installed TensorRT bindings)


def describe() -> Dict[str, Any]:
    stamp = software_stamp() or {}
    return {"hatspec": hatspec_version(), "protocol": PROTOCOL_VERSION, "python": platform.python_version(),
            "machine": platform.machine(), "build": stamp.get("build"), "extra": stamp.get("extra"),
            "engines": {m: _engine(m) for m in ENGINES}}


def mismatch(device: Dict[str, Any], cloud: Dict[str, Any]) -> Optional[str]:
    """Why a device cannot work with this cloud (hatspec or protocol version differ), or None."""
    diffs = [f"{what} {device.get(key)} (the cloud: {cloud.get(key)})" for key, what in
             (("hatspec", "hatspec"), ("protocol", "protocol version")) if device.get(key) != cloud.get(key)]
    return "; ".join(diffs) or None
