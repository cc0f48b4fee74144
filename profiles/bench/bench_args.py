"""Helpers the `hat-bench` subcommands share: comma lists checked against known names, number lists, the distilled
adapter a HAT benchmark needs, speculative-decoding variants γ@η, the machine's CPU for reports, the llama.cpp install
script (figures: hat_split.files.figures)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable, List, Tuple, TypeVar

from hat_split.models.registry import default_adapter_dir

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
    """The adapter directory (default: where hat-distill writes it, `default_adapter_dir`); ValueError when `needed`
    and none is there."""
    path = given or str(default_adapter_dir(model, m))
    if needed and not os.path.exists(os.path.join(path, "adapter.json")):
        raise ValueError(f"no adapter at {path!r}: run hat-distill --model {model} --m {m} first")
    return path


def parse_variants(text: str) -> List[Tuple[int, float]]:
    """"3,4,8@0.5" → [(3, 0.0), (4, 0.0), (8, 0.5)]: (γ, η) per sd run."""
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        gamma, _, eta = item.partition("@")
        try:
            v = (int(gamma), float(eta) if eta else 0.0)
        except ValueError:
            raise ValueError(f"{item!r} is not γ or γ@η (e.g. 4 or 8@0.5)") from None
        if v[0] < 1 or not 0.0 <= v[1] < 1.0:
            raise ValueError(f"{item!r}: γ must be >= 1 and η in [0, 1)")
        out.append(v)
    if not out:
        raise ValueError("give at least one γ")
    return out


def variant_name(gamma: int, eta: float) -> str:
    return f"g{gamma}" + (f"_eta{eta:g}" if eta else "")


LLAMACPP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_llamacpp.sh"


def cpu_name() -> str:
    """The CPU model and its logical CPUs, for a report (the platform where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return sys.platform
