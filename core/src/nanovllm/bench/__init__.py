"""``nanovllm bench``: what a user measures of the engine, on shape presets with random weights.

``throughput`` (nano-vLLM's bench.py workload, optionally with transformers on the same prompts),
``latency`` (batch-1 decode, eager and with CUDA graphs), ``kernels`` (the attention kernels' table),
``all`` (those three), ``offload`` (the KV offload engine, :mod:`nanovllm.bench.offload`), ``kv`` (a model's
KV layout: bytes per token per KV cache group, read off its config, :mod:`nanovllm.bench.kv`), ``quality``
(attention quality of sparse policies on a real model, :mod:`nanovllm.bench.quality`) and ``serve`` (a
load generator against a live server, :mod:`nanovllm.bench.serve`). Every measurement runs in its own
Python process, so the GPU memory of one engine never shrinks the next one's KV cache. Results go to
``OUT/NAME.{json,md,png}`` with the device, date, commit and every setting.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nanovllm.utils import JobClock

# each engine benchmark's headline number
METRIC = {"throughput": "output_tok_per_s", "throughput-transformers": "output_tok_per_s",
          "latency": "ms_per_token", "latency-eager": "ms_per_token"}


def jobs_for(benchmark: str, presets: list[str], hf_num_seqs: int, options: dict[str, Any]) -> list[dict]:
    """The jobs of ``throughput``, ``latency``, ``kernels`` or ``all`` (the three) on each preset."""
    jobs: list[dict] = []
    if benchmark in ("kernels", "all"):
        jobs.append({"kind": "kernels", "options": {}})
    for preset in presets if benchmark != "kernels" else []:
        if benchmark in ("throughput", "all"):
            jobs.append({"kind": "throughput", "preset": preset, "options": options})
            if hf_num_seqs:
                jobs.append({"kind": "transformers", "preset": preset, "options": {"num_seqs": hf_num_seqs}})
        if benchmark in ("latency", "all"):
            for eager in (True, False):
                jobs.append({"kind": "latency", "preset": preset, "options": {**options, "eager": eager}})
    return jobs


def run_job(job: dict) -> list[dict]:
    """One job in this process; returns its result rows."""
    from nanovllm.bench import engine

    kind, opts = job["kind"], job["options"]
    if kind == "kernels":
        from nanovllm.bench import kernels

        return [{"benchmark": "kernels", "preset": "-", "rows": kernels.run(**opts)}]
    if kind == "throughput":
        return [engine.bench_throughput(job["preset"], **opts)]
    if kind == "transformers":
        return [engine.bench_transformers(job["preset"], **opts)]
    if kind == "latency":
        return [engine.bench_latency(job["preset"], **opts)]
    if kind == "quality":
        from nanovllm.bench import quality

        return quality.run(**opts)
    if kind.startswith("offload-"):
        from nanovllm.bench import offload

        if kind == "offload-copy":
            return [offload.bench_copy(**opts)]
        if kind == "offload-small":
            return [offload.bench_small_gpu(job["preset"], **opts)]
        return [offload.bench_decode(job["preset"], offload=kind == "offload-decode", **opts)]
    raise ValueError(f"unknown benchmark job {kind!r}")


def run_job_in_subprocess(job: dict, command: tuple[str, ...] = ("-m", "nanovllm.bench")) -> list[dict]:
    """``python COMMAND JOB``: the job's progress bars pass through on stderr, its result rows are the last
    line of stdout. A failed job is one row with its ``error`` and the job's fields."""
    proc = subprocess.run([sys.executable, *command, json.dumps(job)], stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return [{**job, "benchmark": job["kind"], "preset": job.get("preset", "-"), "error": f"exit {proc.returncode}"}]
    return json.loads(lines[-1])


def environment() -> dict[str, Any]:
    """The device, date, commit, torch and Python of this run (``NANOVLLM_COMMIT`` where git is unusable)."""
    import torch

    commit = os.environ.get("NANOVLLM_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            pass
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def fmt(v: Any) -> str:
    """A table cell: integers with thousands separators, floats to 3 decimals below 10, else whole."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def markdown_row(cells: Iterable[object]) -> str:
    """One line of a markdown table."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(payload: dict[str, Any], title: str) -> str:
    from nanovllm.bench import kv, offload, quality

    if quality.is_quality(payload):
        return quality.markdown(payload, title)
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}."]
    table = []
    for r in payload["results"]:
        metric = METRIC.get(r["benchmark"])
        if "error" in r:
            table.append(markdown_row([r["benchmark"], r["preset"], f"failed: {r['error']}", ""]))
        elif metric in r:
            table.append(markdown_row(map(fmt, [r["benchmark"], r["preset"], metric, r[metric]])))
    if table:
        lines += ["", "| benchmark | preset | metric | measured |", "|---|---|---|---|", *table]
    for r in payload["results"]:
        if r["benchmark"] == "kernels" and "rows" in r:
            lines += ["", "| kernel | case | ms | value | unit | of best | note |", "|---|---|---|---|---|---|---|"]
            lines += [markdown_row(map(fmt, [k["kind"], k["name"], k["ms"], k["value"], k["unit"],
                                             k.get("of_best", ""), k["note"]])) for k in r["rows"]]
    lines += offload.markdown_lines(payload["results"])
    lines += kv.markdown_lines(payload["results"])
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> bool:
    """A PNG of the headline numbers; False when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from nanovllm.bench import offload, quality

    if quality.is_quality(payload):
        return quality.chart(payload, path)
    results = [r for r in payload["results"] if "error" not in r]
    panels = []
    thr = [r for r in results if r["benchmark"].startswith("throughput")]
    if thr:
        panels.append(("output tok/s", [(f"{r['preset']}\n{'hf' if 'transformers' in r['benchmark'] else 'nanovllm'}",
                                         r["output_tok_per_s"], None) for r in thr]))
    lat = [r for r in results if r["benchmark"].startswith("latency")]
    if lat:
        panels.append(("batch-1 ms/token", [(f"{r['preset']}\n{'eager' if 'eager' in r['benchmark'] else 'graphs'}",
                                             r["ms_per_token"], None) for r in lat]))
    for r in results:
        if r["benchmark"] == "kernels":  # the peer table: each row's ratio to the best peer of its shape
            for kind in ("prefill", "decode"):
                bars = [(k["name"], k["of_best"], None) for k in r["rows"] if k["kind"] == kind and "of_best" in k]
                if bars:
                    panels.append((f"{kind}: ratio to the best peer of the shape", bars))
    panels += offload.chart_panels(results)
    if not panels:
        return False
    heights = [max(3.2, 0.14 * len(bars)) for _, bars in panels]  # a long table's bars keep readable labels
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, bars) in zip(axes[:, 0], panels, strict=True):
        ax.barh([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
        for i, b in enumerate(bars):  # a reference value of the same run, where the panel has one
            if b[2]:
                ax.plot([b[2], b[2]], [i - 0.4, i + 0.4], color="tab:red", lw=2)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
    env = payload["environment"]
    fig.suptitle(f"nanovllm bench - {env['device']} - {env['date']} - {env['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(results: list[dict[str, Any]], out_dir: Path, name: str, settings: dict[str, Any]) -> Path:
    """``NAME.json`` (environment, settings, rows), ``NAME.md`` and, with matplotlib, ``NAME.png``."""
    from nanovllm.bench import offload

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "settings": settings, "results": offload.with_ratios(results)}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    _write_views(payload, path)
    return path


def render(path: Path) -> None:
    """Redo a results file's ratios, markdown table and chart from its JSON, e.g. after adding a result
    measured separately."""
    from nanovllm.bench import offload

    payload = json.loads(path.read_text())
    raw = [{k: v for k, v in r.items() if k not in offload.ADDED} for r in payload["results"]]
    payload["results"] = offload.with_ratios(raw)
    path.write_text(json.dumps(payload, indent=1))
    _write_views(payload, path)


def _write_views(payload: dict[str, Any], path: Path) -> None:
    path.with_suffix(".md").write_text(markdown(payload, path.stem))
    if not chart(payload, path.with_suffix(".png")):
        print("no chart (matplotlib is not installed, or nothing to draw); the table is in "
              f"{path.with_suffix('.md')}")


def engine_options(args) -> dict[str, Any]:
    """The engine settings the command line sets for every job (recorded in the results' settings)."""
    options: dict[str, Any] = {}
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    return options


def main(args) -> int:
    if args.benchmark == "render":
        if not args.file:
            raise ValueError("nanovllm bench render needs a results file: nanovllm bench render benchmarks/results/NAME.json")
        render(Path(args.file))
        return 0
    if args.benchmark == "quality":
        return main_quality(args)
    if args.benchmark == "kv":
        return main_kv(args)
    options = engine_options(args)
    if args.benchmark == "offload":
        from nanovllm.bench import offload

        presets = args.presets or ["llama-3.1-8b"]
        sizes = {"contexts": args.contexts, "batches": args.batches, "steps": args.decode_steps,
                 "copy_mib": args.copy_mib, "small_kv_gib": args.small_kv_gib}
        jobs = offload.jobs(presets, **sizes, engine_options=options)
    else:
        presets, sizes = args.presets or ["qwen3-0.6b"], {}
        jobs = jobs_for(args.benchmark, presets, args.hf_num_seqs, options)
    results: list[dict] = []
    clock = JobClock(len(jobs))
    for job in jobs:
        print(f"== {clock.status()} {job['kind']} {job.get('preset', '')} {job['options'] or ''}", file=sys.stderr,
              flush=True)
        results += run_job_in_subprocess(job)
    settings = {"benchmark": args.benchmark, "presets": presets, "hf_num_seqs": args.hf_num_seqs, **sizes, **options}
    name = args.name or (args.benchmark if args.benchmark == "offload" else "bench")
    path = write_results(results, Path(args.out), name, settings)
    print(path.with_suffix(".md").read_text())
    return 1 if any("error" in r for r in results) else 0


def main_kv(args) -> int:
    """``nanovllm bench kv``: each model's KV layout, computed here from its config (nothing runs)."""
    from nanovllm.bench.kv import kv_layout

    models = [*(args.presets or []), *([args.model] if args.model else [])] or ["qwen3-0.6b"]
    options = {"dtype": args.dtype, "device": args.device}
    results = [kv_layout(model, args.context, **options) for model in models]
    settings = {"benchmark": "kv", "presets": models, "context": args.context, **options}
    path = write_results(results, Path(args.out), args.name or "kv", settings)
    print(path.with_suffix(".md").read_text())
    return 0


def main_quality(args) -> int:
    """``nanovllm bench quality``: one job (capture once, every policy) in its own process."""
    from nanovllm.quality.evaluate import make_policy

    policies = args.policy or ["full"]
    for selection in policies:  # a bad name or option fails here, before a process starts
        make_policy(selection)
    if args.text is not None:
        from nanovllm.quality.corpus import file_text

        file_text(args.text)  # so does a missing text file
    options = {"policies": policies, "layers": args.layers, "tokens": args.tokens,
               "queries": args.queries, "top_k": args.top_k, "device": args.device, "model": args.model,
               "seed": args.seed, "ppl_tail": args.ppl_tail, "text_file": args.text, "dtype": args.dtype}
    print(f"== quality {options}", file=sys.stderr, flush=True)
    results = run_job_in_subprocess({"kind": "quality", "options": options})
    path = write_results(results, Path(args.out), args.name or "quality", {"benchmark": "quality", **options})
    print(path.with_suffix(".md").read_text())
    return 1 if any("error" in r for r in results) else 0
