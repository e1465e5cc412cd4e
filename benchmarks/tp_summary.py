"""Tensor parallelism's speedup from one `scripts/tp_check.sh` run: TP2 over TP1 measured in the same run.

    python benchmarks/tp_summary.py OUT_DIR [--name b6]

reads the ``b6_latency_tp{1,2}`` and ``b6_throughput_tp{1,2}`` results files in OUT_DIR (``nanovllm bench``
JSON) and writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` there: per preset and benchmark, TP1, TP2, the
speedup. A benchmark missing at either size is left out, and said so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _plot import save, subplots

METRICS = {"latency": "ms_per_token", "throughput": "output_tok_per_s"}  # lower, higher is better


def _results(out_dir: Path, name: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    path = out_dir / f"{name}.json"
    if not path.exists():
        return None, []
    payload = json.loads(path.read_text())
    return payload["environment"], payload["results"]


def summarize(out_dir: Path) -> dict[str, Any]:
    """The speedup rows, the environment of the run, and what was missing."""
    rows, missing, environment = [], [], None
    for benchmark, metric in METRICS.items():
        by_size = {}
        for tp in (1, 2):
            env, results = _results(out_dir, f"b6_{benchmark}_tp{tp}")
            environment = environment or env
            by_size[tp] = {r["preset"]: r[metric] for r in results
                           if r["benchmark"] == benchmark and metric in r and "error" not in r}
        for preset in sorted(by_size[1].keys() | by_size[2].keys()):
            if preset not in by_size[1] or preset not in by_size[2]:
                missing.append(f"{benchmark} {preset} at TP{1 if preset not in by_size[1] else 2}")
                continue
            tp1, tp2 = by_size[1][preset], by_size[2][preset]
            speedup = tp1 / tp2 if benchmark == "latency" else tp2 / tp1
            rows.append({"benchmark": benchmark, "preset": preset, "metric": metric, "tp1": tp1, "tp2": tp2,
                         "speedup": speedup})
    return {"environment": environment, "rows": rows, "missing": missing}


def markdown(summary: dict[str, Any], title: str) -> str:
    env = summary["environment"] or {}
    lines = [f"# {title}", "",
             f"{env.get('device', '?')}, {env.get('date', '?')}, commit {env.get('commit', '?')}. "
             "TP2 over TP1 measured in the same run.", "",
             "| benchmark | preset | metric | TP1 | TP2 | TP2 speedup |",
             "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['benchmark']} | {r['preset']} | {r['metric']} | {r['tp1']:,.3f} | "
                     f"{r['tp2']:,.3f} | {r['speedup']:.3f}x |")
    if summary["missing"]:
        lines += ["", "Not in this run: " + "; ".join(summary["missing"]) + "."]
    return "\n".join(lines) + "\n"


def chart(summary: dict[str, Any], path: Path) -> bool:
    rows = summary["rows"]
    if not rows:
        return False
    try:
        fig, ax = subplots(figsize=(8, 0.6 * len(rows) + 1.2))
    except ImportError:
        return False
    labels = [f"{r['benchmark']} {r['preset']}" for r in rows]
    ax.barh(labels, [r["speedup"] for r in rows], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("TP2 speedup over TP1")
    save(fig, path, "tensor parallel", summary["environment"])
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/tp_summary.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--name", default="b6")
    args = parser.parse_args(argv)
    summary = summarize(args.out_dir)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary, args.name)
    (args.out_dir / f"{args.name}.md").write_text(text)
    chart(summary, args.out_dir / f"{args.name}.png")
    print(text, end="")


if __name__ == "__main__":
    main()
