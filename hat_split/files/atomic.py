"""Atomic JSON files: written beside, then renamed over, so a reader never sees half a file (status files that other
processes poll, bundle manifests)."""
from __future__ import annotations

import os
from typing import Any, Optional
from hat_split.files import strict_json


def write_json(path: str | os.PathLike, obj: Any, indent: Optional[int] = None) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(strict_json.dumps(obj, indent=indent) + "\n")
    os.replace(tmp, path)
