"""Pieces the sparse-prefill plugins' benchmarks share: time-to-first-token rows against ``full`` at the same
context, their table, and the kernel chart of time over density with the target line."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def ttft_speedup(row: dict[str, Any], results: list[dict[str, Any]]) -> float | None:
    """``full``'s TTFT over this row's, at the same context; None without both."""
    if row.get("benchmark") != "ttft" or "ttft_s" not in row or row.get("policy") == "full":
        return None
    dense = next((d for d in results if d.get("benchmark") == "ttft" and d.get("policy") == "full"
                  and d.get("context") == row["context"] and "ttft_s" in d), None)
    return None if dense is None else dense["ttft_s"] / row["ttft_s"]


def ttft_table(results: list[dict[str, Any]], heading: str) -> list[str]:
    """The markdown section of the TTFT rows (an error in place of a time where a job failed)."""
    lines = ["", f"## {heading}", "", "| context | policy | TTFT s | speedup vs full |", "|---|---|---|---|"]
    for r in results:
        if r["benchmark"] == "ttft":
            result = r.get("error") or f"{r['ttft_s']:.3f}"
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
            lines.append(f"| {r['context']} | {r['policy']} | {result} | {speed} |")
    return lines


def density_chart(payload: dict[str, Any], path: Path, name: str, xlabel: str, ylabel: str, slack: float) -> None:
    """Kernel rows (``density``, ``ratio``), one line per context, and the target ``density + slack``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernel = [r for r in payload["results"] if r["benchmark"] == "kernel" and "ratio" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({r["context"] for r in kernel}):
        pts = sorted((r["density"], r["ratio"]) for r in kernel if r["context"] == n)
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{n // 1024}K")
    xs = [0, max((r["density"] for r in kernel), default=1)]
    ax.plot(xs, [x + slack for x in xs], "r--", label=f"target: density + {slack}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    env = payload["environment"]
    ax.set_title(f"{name} - {env['device']} - {env['date']} - {env['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
