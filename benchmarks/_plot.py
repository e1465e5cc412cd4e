"""What the benchmark scripts' charts share: matplotlib without a display, and a chart's title, layout and
file. Raises ``ImportError`` without matplotlib (:func:`_jobs.run_jobs` then writes no chart). Not a script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``matplotlib.pyplot.subplots(*args, **kwargs)`` on the file-only backend, so a GPU machine without a
    display can draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig: Any, path: Path, name: str, env: dict[str, Any] | None) -> None:
    """Title ``fig`` with ``name`` and the run's device, date and commit (those ``env``, the results'
    ``environment``, holds), lay it out, write it to ``path`` (PNG, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    stamp = [str(env[key]) for key in ("device", "date", "commit") if key in (env or {})]
    fig.suptitle(" - ".join([name, *stamp]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
