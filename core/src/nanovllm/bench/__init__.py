"""``nanovllm bench``: the project's benchmarks on shape presets (definitions in ANCHORS.md).

``throughput`` (B1, plus the transformers peer), ``latency`` (B2, eager and with CUDA graphs),
``kernels`` (B3), ``offload`` (B5, the KV offload engine, :mod:`nanovllm.bench.offload`) and ``quality``
(attention quality of sparse policies on the real built-in model, :mod:`nanovllm.bench.quality`). Every measurement runs in its own Python process, so the GPU memory
of one engine never shrinks the next one's KV cache. Results go to
``benchmarks/results/<name>.{json,md,png}`` with the device, date, commit and every setting, next to
the targets and anchors below.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

from nanovllm.utils import JobClock

# Targets on one H100 (issue 3) and anchors (ANCHORS.md): bandwidth floors per device, peers' numbers.
TARGETS: dict[tuple[str, str], dict[str, Any]] = {
    ("throughput", "qwen3-0.6b"): {"target": 18_000, "floor": {"H100": 25_700, "H200": 37_200},
                                   "peer": "vLLM-class 12-15K (H100)"},
    ("throughput", "qwen3-8b"): {"target": 8_000, "floor": {"H100": 11_700}},
    ("throughput", "llama-3.1-8b"): {"floor": {"H100": 12_400}},
    ("latency", "qwen3-0.6b"): {"target": 1.5, "peer": "vLLM on A100 4.2"},
    ("latency", "qwen3-8b"): {"target": 6.0, "floor": {"H100": 5.2}, "peer": "vLLM about 7.0 (H100)"},
}
PREFILL_TARGET = 0.95  # of the cuDNN SDPA TFLOP/s in the same run
DECODE_TARGET = 0.9  # of the copy bandwidth in the same run (2.6 TB/s on an H100)
OFFLOAD_TTFT_TARGET = 1.15  # B5: offload TTFT at most this times the GPU-resident TTFT of the same run
OFFLOAD_GPU_KV_TARGET_GIB = 2.0  # B5: the offload engine's GPU memory for KV (its load slots), GiB
METRIC = {"throughput": "output_tok_per_s", "throughput-transformers": "output_tok_per_s",
          "latency": "ms_per_token", "latency-eager": "ms_per_token"}
LOWER_IS_BETTER = {"ms_per_token"}


def jobs_for(benchmark: str, presets: list[str], hf_num_seqs: int, options: dict[str, Any]) -> list[dict]:
    jobs: list[dict] = []
    if benchmark in ("kernels", "all"):
        jobs.append({"kind": "kernels", "options": {}})
    for preset in presets if benchmark != "kernels" else []:
        if benchmark in ("throughput", "all"):
            jobs.append({"kind": "throughput", "preset": preset, "options": options})
            jobs.append({"kind": "profile", "preset": preset, "options": options})
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
    if kind == "profile":
        return [engine.profile_decode_step(job["preset"], **opts)]
    if kind == "transformers":
        return [engine.bench_transformers(job["preset"], **opts)]
    if kind == "latency":
        return [engine.bench_latency(job["preset"], **opts)]
    if kind == "allreduce":
        from nanovllm.bench import allreduce

        return allreduce.run(**opts)
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
    """``python COMMAND JOB`` (a plugin's benchmark passes its own module and flag): the job's progress bars
    pass through on stderr, the result is the last line of stdout. A failed job is one row with its ``error``
    and the job's fields."""
    proc = subprocess.run([sys.executable, *command, json.dumps(job)], stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return [{**job, "benchmark": job["kind"], "preset": job.get("preset", "-"), "error": f"exit {proc.returncode}"}]
    return json.loads(lines[-1])


def jobs_of_kinds(jobs: list[dict], kinds: list[str] | None) -> list[dict]:
    """The jobs whose kind is one of ``kinds`` (all when None, as for ``--only`` left out); a kind also
    brings the jobs it names before a hyphen (``offload`` brings ``offload-copy``)."""
    return [job for job in jobs if not kinds or job["kind"].partition("-")[0] in kinds]


def run_plugin_jobs(jobs: list[dict], module: str, out: Path, name: str, settings: dict[str, Any],
                    finish: Callable[[list[dict]], list[dict]], markdown: Callable[[dict, str], str],
                    chart: Callable[[dict, Path], None]) -> int:
    """A plugin benchmark's run: each job in its own process (``python -m MODULE --job JOB``), ``NAME.json``
    and ``NAME.md`` written after every job (so that a run cut short keeps what it measured, ``finish``
    adding the ratios), then the chart. Returns 1 if a job failed."""
    env, results, payload = environment(), [], {}
    out.mkdir(parents=True, exist_ok=True)
    clock = JobClock(len(jobs))
    for job in jobs:
        print(f"== {clock.status()} {job}", file=sys.stderr, flush=True)
        results += run_job_in_subprocess(job, ("-m", module, "--job"))
        payload = {"environment": env, "settings": settings, "results": finish(results)}
        (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
        (out / f"{name}.md").write_text(markdown(payload, name))
    if payload:
        chart(payload, out / f"{name}.png")
        print((out / f"{name}.md").read_text())
    return 1 if any("error" in r for r in results) else 0


def environment() -> dict[str, Any]:
    import torch

    commit = os.environ.get("NANOVLLM_COMMIT", "")  # set where the checkout has no usable git
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


def annotate(result: dict[str, Any], device: str) -> dict[str, Any]:
    """Add target, anchors and ratios to one engine result (kernels rows get theirs in :func:`kernel_rows`)."""
    metric = METRIC.get(result["benchmark"])
    if metric is None or metric not in result:
        return result
    value = result[metric]
    ref = dict(TARGETS.get((result["benchmark"], result["preset"]), {}))
    floor = next((f for chip, f in ref.pop("floor", {}).items() if chip in device), None)
    if floor is not None:
        ref["floor"] = floor
    out = {**result, "metric": metric, **ref}
    if "target" in ref:
        ratio = ref["target"] / value if metric in LOWER_IS_BETTER else value / ref["target"]
        out["vs_target"] = ratio  # >= 1 meets it
    if "floor" in ref:
        out["vs_floor"] = ref["floor"] / value if metric in LOWER_IS_BETTER else value / ref["floor"]
    return out


def kernel_rows(rows: list[dict]) -> list[dict]:
    """B3 rows with each Triton row's ratio to its reference in the same run: prefill to cuDNN SDPA,
    decode to the copy bandwidth."""
    cudnn = next((r["value"] for r in rows if r["name"] == "d=128 sdpa cudnn enable_gqa"), None)
    copy = next((r["value"] for r in rows if r["kind"] == "copy"), None)
    out = []
    for r in rows:
        r = dict(r)
        if r["kind"] == "prefill" and "triton" in r["name"] and cudnn:
            r["vs_cudnn"], r["target"] = r["value"] / cudnn, PREFILL_TARGET
        if r["kind"] == "decode" and copy:
            r["vs_copy"], r["target"] = r["value"] / copy, DECODE_TARGET
        out.append(r)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def markdown_row(cells: Iterable[object]) -> str:
    """One line of a markdown table."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(payload: dict[str, Any], title: str) -> str:
    from nanovllm.bench import allreduce, offload, quality

    if quality.is_quality(payload):
        return quality.markdown(payload, title)
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             "Targets are issue 3's, set for one H100; floors (this device's) and peers from ANCHORS.md. "
             "vs_target >= 1 meets it."]
    table = []
    for r in payload["results"]:
        if "error" in r:
            table.append(f"| {r['benchmark']} | {r['preset']} | failed: {r['error']} | | | | | | |")
        elif "metric" in r:
            cells = [r["benchmark"], r["preset"], r["metric"], r[r["metric"]], r.get("target", ""),
                     r.get("vs_target", ""), r.get("floor", ""), r.get("vs_floor", ""), r.get("peer", "")]
            table.append(markdown_row(map(_fmt, cells)))
    if table:
        lines += ["", "| benchmark | preset | metric | measured | target | vs_target | floor | vs_floor | peer |",
                  "|---|---|---|---|---|---|---|---|---|", *table]
    for r in payload["results"]:
        if r["benchmark"] == "kernels" and "rows" in r:
            lines += ["", "| kernel | case | ms | value | unit | vs ref | target | note |", "|---|---|---|---|---|---|---|---|"]
            for k in r["rows"]:
                ref = k.get("vs_cudnn", k.get("vs_copy", ""))
                cells = [k["kind"], k["name"], k["ms"], k["value"], k["unit"], ref, k.get("target", ""), k["note"]]
                lines.append(markdown_row(map(_fmt, cells)))
        if r["benchmark"] == "decode-profile" and "top_kernels" in r:
            lines += ["", f"Full-batch decode step, {r['preset']}, batch {r['batch']}: {r['step_ms_plain']:.2f} ms "
                      f"wall, {r['gpu_ms_per_step']:.2f} ms of GPU kernels ({r['kernel_launches_per_step']} launches), "
                      f"{r['gpu_idle_ms_per_step']:.2f} ms GPU idle; host phases (ms) {r['host_ms_plain']}.", "",
                      "| kernel | ms per step | calls |", "|---|---|---|"]
            lines += [f"| {k['name']} | {k['ms']} | {k['calls']} |" for k in r["top_kernels"]]
    lines += offload.markdown_lines(payload["results"])
    lines += allreduce.markdown_lines(payload["results"])
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> bool:
    """A PNG of the headline numbers against their targets; False when matplotlib is missing."""
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
        panels.append(("output tok/s (B1)  (red: target)", [(f"{r['preset']}\n{'hf' if 'transformers' in r['benchmark'] else 'nanovllm'}",
                                              r["output_tok_per_s"], r.get("target")) for r in thr]))
    lat = [r for r in results if r["benchmark"].startswith("latency")]
    if lat:
        panels.append(("batch-1 ms/token (B2)  (red: target)", [(f"{r['preset']}\n{'eager' if 'eager' in r['benchmark'] else 'graphs'}",
                                                  r["ms_per_token"], r.get("target")) for r in lat]))
    for r in results:
        if r["benchmark"] == "kernels":
            ok = [k for k in r["rows"] if math.isfinite(k["value"])]
            pre = [k for k in ok if k["kind"] == "prefill" and k["name"].startswith("d=128")]
            dec = [k for k in ok if k["kind"] == "copy" or (k["kind"] == "decode" and "default" in k["name"])]
            panels.append(("prefill 16K TFLOP/s (B3)", [(k["name"].removeprefix("d=128 "), k["value"], None) for k in pre]))
            panels.append(("decode GB/s of KV (B3)", [(k["name"].split(" default")[0], k["value"], None) for k in dec]))
    panels += offload.chart_panels(results)
    reduces = [r for r in results if r["benchmark"] == "allreduce"]
    if reduces:
        bars = [(f"{r.get('path', 'nccl')} {r['mode']} batch {r['batch']}", r["us_per_allreduce"], None)
                for r in reduces]
        panels.append(("us per all-reduce of a decode step (B6)", bars))
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for ax, (title, bars) in zip(axes[:, 0], panels, strict=True):
        labels = [b[0] for b in bars]
        ax.barh(labels, [b[1] for b in bars], color="tab:blue")
        for i, b in enumerate(bars):
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
    from nanovllm.bench import offload

    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    annotated = []
    for r in results:
        r = annotate(r, env["device"])
        if r["benchmark"] == "kernels" and "rows" in r:
            r = {**r, "rows": kernel_rows(r["rows"])}
        annotated.append(r)
    payload = {"environment": env, "settings": settings, "results": offload.with_ratios(annotated)}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    (out_dir / f"{name}.md").write_text(markdown(payload, name))
    if not chart(payload, out_dir / f"{name}.png"):
        print("matplotlib is not installed: no chart; draw it later with `nanovllm bench render FILE.json`")
    return path


def render(path: Path) -> None:
    """Redo a results file's ratios (current targets and anchors), markdown table and chart from its JSON,
    e.g. after adding a result measured separately."""
    from nanovllm.bench import offload

    payload = json.loads(path.read_text())
    device = payload["environment"]["device"]
    payload["results"] = offload.with_ratios([annotate(_raw(r), device) for r in payload["results"]])
    path.write_text(json.dumps(payload, indent=1))
    path.with_suffix(".md").write_text(markdown(payload, path.stem))
    if not chart(payload, path.with_suffix(".png")):
        print("matplotlib is not installed: markdown redone, no chart")


def _raw(result: dict[str, Any]) -> dict[str, Any]:
    """A result without the fields :func:`annotate` and B5's ratios add."""
    from nanovllm.bench import offload

    added = {"metric", "target", "floor", "peer", "vs_target", "vs_floor", *offload.ADDED}
    return {k: v for k, v in result.items() if k not in added}


def engine_options(args) -> dict[str, Any]:
    """The engine settings the command line sets for every job (recorded in the results' settings)."""
    options: dict[str, Any] = {}
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    return options


def main(args) -> int:
    if args.benchmark == "render":
        if not args.file:
            raise ValueError("nanovllm bench render needs a results file: nanovllm bench render benchmarks/results/NAME.json")
        render(Path(args.file))
        return 0
    if args.benchmark == "quality":
        return main_quality(args)
    options = engine_options(args)
    if args.benchmark == "allreduce":
        presets = args.presets or ["qwen3-8b"]
        sizes = {"batches": args.allreduce_batches, "steps": args.allreduce_steps}
        jobs = [{"kind": "allreduce", "preset": preset,
                 "options": {"world_size": args.tensor_parallel_size, "preset": preset, **sizes}}
                for preset in presets]
    elif args.benchmark == "offload":
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
    name = args.name or (args.benchmark if args.benchmark in ("offload", "allreduce") else "bench")
    path = write_results(results, Path(args.out), name, settings)
    print(path.with_suffix(".md").read_text())
    return 1 if any("error" in r for r in results) else 0


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
