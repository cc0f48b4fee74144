"""Helpers the `hat-bench` subcommands share: comma lists checked against known names, number lists, the distilled
adapter a HAT benchmark needs (figures: hat_split.files.figures)."""
from __future__ import annotations

import os
from typing import Callable, Iterable, List, TypeVar

T = TypeVar("T")


def names(text: str, known: Iterable[str], what: str) -> List[str]:
    """The comma-separated names in `text`; ValueError naming the unknown ones (`what`: e.g. "variant")."""
    known = list(known)
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in known]
    if bad:
        raise ValueError(f"unknown {what}(s) {bad}; choose from {', '.join(known)}")
    return out


def numbers(text: str, kind: Callable[[str], T] = float) -> List[T]:
    """The comma-separated numbers in `text`, each read with `kind`."""
    return [kind(x) for x in text.split(",") if x.strip()]


def adapter_dir(given: str, model: str, m: int, needed: bool) -> str:
    """The adapter directory (default runs/adapters/<model>-m<m>); ValueError when `needed` and none is there."""
    path = given or f"runs/adapters/{model}-m{m}"
    if needed and not os.path.exists(os.path.join(path, "adapter.json")):
        raise ValueError(f"no adapter at {path!r}: run hat-distill --model {model} --m {m} first")
    return path
