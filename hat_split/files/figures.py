"""Figures beside a JSON result: matplotlib is optional (the JSON is the result), on the file-only Agg backend."""
from __future__ import annotations

NO_MATPLOTLIB = "matplotlib is not installed (pip install 'hatspec[bench]'): no PNG"


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
