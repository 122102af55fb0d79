"""PNG figures without a display: a matplotlib `Figure` on the Agg canvas, written atomically.

Reports (evaluate, qa-eval) draw their figures from their JSON summaries alone; nothing here
touches pyplot's global state, so figures can be drawn from worker threads and tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memprune.io import atomic_path


def new_figure(width: float, height: float) -> Any:
    """A matplotlib `Figure` of `width` x `height` inches, not attached to pyplot."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def save_png(fig: Any, path: Path) -> None:
    """Render `fig` on the Agg canvas (tight layout, 110 dpi) and write it to `path` atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
