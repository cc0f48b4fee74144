"""JSON that every parser reads: what the CLIs, the agent, the benches and results/ write.

Python's json writes NaN and Infinity for non-finite floats; JavaScript's JSON.parse, jq and other strict parsers
refuse them. Here a non-finite number is written as null: a ratio with nothing to divide by ("acceptance_rate" of a
protocol that drafts nothing), an interval that was not computed. numpy scalars and arrays are written as numbers
and lists.
"""
from __future__ import annotations

import json
import math
from typing import Any, IO

import numpy as np


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (dicts, lists and tuples walked; numpy made plain)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return finite(obj.tolist())
    if isinstance(obj, np.generic):
        return finite(obj.item())
    return obj


def dumps(obj: Any, **kwargs) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def dump(obj: Any, f: IO[str], **kwargs) -> None:
    json.dump(finite(obj), f, allow_nan=False, **kwargs)


def loads(text: str) -> Any:
    """A strict parse: NaN, Infinity and -Infinity are refused, as JavaScript's JSON.parse refuses them."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON (a strict parser refuses it)")
    return json.loads(text, parse_constant=refuse)
