"""How every benchmark draws its PNG: matplotlib off-screen, laid out tight, saved at 120 dpi, closed."""

from pathlib import Path
from typing import Any


def new(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (7, 3.5)) -> tuple[Any, Any]:
    """(figure, axes) as `plt.subplots` gives them, on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize)


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
