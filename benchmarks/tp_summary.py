"""The summary of one tensor-parallel run (``scripts/tp_check.sh``): every results file in OUT_DIR, read together.

    python benchmarks/tp_summary.py OUT_DIR [--name tp_summary]

- speedups: each latency and throughput row at TPn (``benchmarks/tp_bench.py``) against the same benchmark
  and preset at TP1 of the same run (ms per token: lower is better; tokens/s: higher), with the targets;
- rows at TPn alone (the large preset): batch-1 ms per token (with its target), B1 tokens/s, TTFT;
- Quest's engine decode rows (``benchmarks/quest_decode.py``) under TPn: ms per step, speedup over full;
- the all-reduce rows (``benchmarks/allreduce.py``) at batch 1: microseconds per all-reduce.

Writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` in OUT_DIR and prints the table. A TPn row without its
TP1 row (or the reverse) and a target not measured are listed as such; failed jobs are listed with their
error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _plot import save, subplots

PAIRED = {"latency": "ms_per_token", "throughput": "output_tok_per_s"}  # lower, higher is better
ALONE = {**PAIRED, "ttft": "ttft_s"}
# (benchmark, preset, tensor-parallel size, what is compared, bound): a speedup at least, ms/token at most
TARGETS = [
    ("latency", "qwen3-8b", 2, "speedup", 1.55), ("latency", "qwen3-8b", 4, "speedup", 2.2),
    ("throughput", "qwen3-8b", 2, "speedup", 1.6), ("throughput", "qwen3-8b", 4, "speedup", 2.5),
    ("latency", "llama-3.1-70b", 4, "ms_per_token", 11.0),
]


def tensor_parallel_size(row: dict[str, Any]) -> int:
    """The row's ranks: marked by tp_bench, in the engine settings of quest_decode, or allreduce's world."""
    settings = row.get("settings") or {}
    return int(row.get("tensor_parallel_size") or settings.get("tensor_parallel_size") or row.get("world_size") or 1)


def read_results(out_dir: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The environment of the first results file and the rows of all (``{"environment", "results"}`` JSON)."""
    environment, rows = None, []
    for path in sorted(out_dir.glob("*.json")):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and isinstance(payload.get("results"), list):
            environment = environment or payload.get("environment")
            rows += [{**r, "file": path.stem} for r in payload["results"]]
    return environment, rows


def summarize(out_dir: Path) -> dict[str, Any]:
    environment, rows = read_results(out_dir)
    measured = [r for r in rows if "error" not in r and "skipped" not in r]
    values: dict[tuple[str, str, int], float] = {}
    for r in measured:
        metric = ALONE.get(r["benchmark"])
        if metric in r:
            values[r["benchmark"], r["preset"], tensor_parallel_size(r)] = r[metric]
    speedups, alone, missing = [], [], []
    for (benchmark, preset, tp), value in sorted(values.items()):
        if tp == 1:
            if not any(b == benchmark and p == preset and t > 1 for b, p, t in values):
                missing.append(f"{benchmark} {preset}: TP1 without a TPn row")
            continue
        one = values.get((benchmark, preset, 1)) if benchmark in PAIRED else None
        if one is None:
            alone.append({"benchmark": benchmark, "preset": preset, "tp": tp, "metric": ALONE[benchmark],
                          "value": value})
            continue
        speedup = one / value if benchmark == "latency" else value / one
        speedups.append({"benchmark": benchmark, "preset": preset, "metric": PAIRED[benchmark], "tp": tp,
                         "tp1": one, "tpn": value, "speedup": speedup})
    quest = [{"tp": tensor_parallel_size(r), "context": r["context"], "batch": r["batch"], "policy": r["policy"],
              "decode_ms_per_step": r["decode_ms_per_step"], "speedup": r.get("speedup")}
             for r in measured if r["benchmark"] == "decode" and "decode_ms_per_step" in r]
    allreduce = [{k: r[k] for k in ("preset", "path", "mode", "batch", "world_size", "us_per_allreduce")}
                 for r in measured if r["benchmark"] == "allreduce" and r["batch"] == 1]
    failed = [f"{r['benchmark']} {r.get('preset', '-')} ({r.get('file')}): {r.get('error') or r.get('skipped')}"
              for r in rows if "error" in r or "skipped" in r]
    return {"environment": environment, "speedups": speedups, "alone": alone, "quest": quest,
            "allreduce": allreduce, "targets": targets(speedups, alone), "missing": missing, "failed": failed}


def targets(speedups: list[dict[str, Any]], alone: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it was met (None: not measured in this run)."""
    out = []
    for benchmark, preset, tp, what, bound in TARGETS:
        found = [r[what] if what == "speedup" else r["value"] for r in speedups + alone
                 if (r["benchmark"], r["preset"], r["tp"]) == (benchmark, preset, tp)
                 and (what == "speedup" or r["metric"] == what)]
        value = found[0] if found else None
        met = None if value is None else (value >= bound if what == "speedup" else value <= bound)
        out.append({"benchmark": benchmark, "preset": preset, "tp": tp, "what": what, "bound": bound,
                    "value": value, "met": met})
    return out


def markdown(summary: dict[str, Any], title: str) -> str:
    env = summary["environment"] or {}
    lines = [f"# {title}", "", f"{env.get('device', '?')}, {env.get('date', '?')}, commit {env.get('commit', '?')}. "
             "TPn against TP1 measured in the same run."]
    if summary["speedups"]:
        lines += ["", "| benchmark | preset | metric | TP1 | TPn | n | speedup |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['benchmark']} | {r['preset']} | {r['metric']} | {r['tp1']:,.3f} | {r['tpn']:,.3f} | "
                  f"{r['tp']} | {r['speedup']:.3f}x |" for r in summary["speedups"]]
    if summary["alone"]:
        lines += ["", "| benchmark | preset | TP | metric | value |", "|---|---|---|---|---|"]
        lines += [f"| {r['benchmark']} | {r['preset']} | {r['tp']} | {r['metric']} | {r['value']:,.3f} |"
                  for r in summary["alone"]]
    if summary["quest"]:
        lines += ["", "Engine decode (quest_decode.py):", "", "| TP | context | batch | policy | ms/step | speedup |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['tp']} | {r['context']} | {r['batch']} | {r['policy']} | {r['decode_ms_per_step']:.2f} | "
                  + (f"{r['speedup']:.2f}x |" if r["speedup"] else "- |") for r in summary["quest"]]
    if summary["allreduce"]:
        lines += ["", "All-reduces of one batch-1 decode step (allreduce.py):", "",
                  "| preset | ranks | path | mode | us per all-reduce |", "|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['world_size']} | {r['path']} | {r['mode']} | {r['us_per_allreduce']:.1f} |"
                  for r in summary["allreduce"]]
    lines += ["", "| target | bound | measured | met |", "|---|---|---|---|"]
    for t in summary["targets"]:
        name = f"{t['benchmark']} {t['preset']} TP{t['tp']} {t['what']}"
        bound = f">= {t['bound']}x" if t["what"] == "speedup" else f"<= {t['bound']}"
        value = "not measured" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"| {name} | {bound} | {value} | {'-' if t['met'] is None else 'yes' if t['met'] else 'NO'} |")
    if summary["missing"]:
        lines += ["", "Unpaired: " + "; ".join(summary["missing"]) + "."]
    if summary["failed"]:
        lines += ["", "Failed or skipped:", *[f"- {f}" for f in summary["failed"]]]
    return "\n".join(lines) + "\n"


def chart(summary: dict[str, Any], path: Path) -> bool:
    rows = summary["speedups"]
    if not rows:
        return False
    try:
        fig, ax = subplots(figsize=(8, 0.6 * len(rows) + 1.2))
    except ImportError:
        return False
    labels = [f"{r['benchmark']} {r['preset']} TP{r['tp']}" for r in rows]
    ax.barh(labels, [r["speedup"] for r in rows], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("TPn speedup over TP1")
    save(fig, path, "tensor parallel", summary["environment"])
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/tp_summary.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--name", default="tp_summary")
    args = parser.parse_args(argv)
    summary = summarize(args.out_dir)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary, args.name)
    (args.out_dir / f"{args.name}.md").write_text(text)
    chart(summary, args.out_dir / f"{args.name}.png")
    print(text, end="")


if __name__ == "__main__":
    main()
