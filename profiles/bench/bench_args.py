"""Helpers the `hat-bench` subcommands share: comma lists checked against known names, number lists, the distilled
adapter a HAT benchmark needs, and their figures (matplotlib is optional: the JSON is the result)."""
from __future__ import annotations

import os
from typing import Callable, Iterable, List, TypeVar

T = TypeVar("T")
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'hatspec[bench]'): no PNG"


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


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, axes, path: str, legend_fontsize: int = 8) -> str:
    """Legends on the axes that have labelled lines, tight layout, PNG at 110 dpi; returns "" (no note)."""
    import matplotlib.pyplot as plt
    import numpy as np

    for ax in np.ravel(axes):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""
