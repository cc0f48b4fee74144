"""Atomic JSON files: written beside, then renamed over, so a reader never sees half a file (status files that other
processes poll, bundle manifests)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional


def write_json(path: str | os.PathLike, obj: Any, indent: Optional[int] = None) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=indent) + "\n")
    os.replace(tmp, path)
