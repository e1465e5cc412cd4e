"""Where a decode step's time goes, on a shape preset with random weights: ``python benchmarks/decode_profile.py``.

The throughput benchmark's prompts (``nanovllm bench throughput``) are prefilled and decode steps are timed:
wall clock per step, the host phases (scheduling, input preparation, sampling, waiting for the GPU), and the
GPU kernels of five profiled steps, the slowest first. ``--whole-run``: instead, the throughput benchmark's
whole run, step by step (the sequences running, their context, the GPU's time a step) with the kernels of a
few windows of steps. Each preset runs in a process of its own; results go to ``OUT/NAME.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import _plot
from _jobs import job_main, run_jobs
from nanovllm.bench.engine import sync, throughput_workload


def profile_decode_step(preset: str, steps: int = 30, num_seqs: int = 256, temperature: float = 0.6,
                        top: int = 12, **engine_options: Any) -> dict[str, Any]:
    """Where one full-batch decode step of the throughput workload goes (its first ``num_seqs`` prompts; 1: a
    batch-1 step, as the latency benchmark times them): the prompts are prefilled, then
    decode steps are timed (wall clock per step; the host phases without and with a synchronisation
    after each, which separates host work from waiting; ``wait_and_apply`` is where the host waits
    for the GPU) and five are profiled (GPU kernel time). ``temperature``: every request's (the latency
    benchmark decodes greedily: 0); ``top``: how many kernels the result lists, the slowest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import LLM, SamplingParams

    llm = LLM(preset, max_model_len=4096, **engine_options)
    prompts, _ = throughput_workload(num_seqs=num_seqs)
    for p in prompts:  # every sequence outlives the profiled steps
        llm.add_request(p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=1024))
    sched, runner = llm.scheduler, llm.runner
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        llm.step()
    for _ in range(5):
        llm.step()
    sync()
    phases = {"schedule": (sched, "schedule"), "prepare": (runner, "prepare"), "sampler": (runner, "sampler"),
              "wait_and_apply": (llm.llm_engine, "_apply_pending")}
    result: dict[str, Any] = {"benchmark": "decode-profile", "preset": preset, "batch": len(sched.running),
                              "cuda_graphs": bool(runner.cuda_graphs.graphs)}
    for synced in (False, True):
        spent = dict.fromkeys(phases, 0.0)
        originals = {name: getattr(obj, attr) for name, (obj, attr) in phases.items()}

        def timed(name, fn, synced=synced, spent=spent):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                if synced:
                    sync()
                spent[name] += time.perf_counter() - start
                return out
            return wrapper

        for name, (obj, attr) in phases.items():
            setattr(obj, attr, timed(name, originals[name]))
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync()
        step_ms = 1000 * (time.perf_counter() - start) / steps
        for name, (obj, attr) in phases.items():
            setattr(obj, attr, originals[name])
        label = "synced" if synced else "plain"
        result[f"step_ms_{label}"] = step_ms
        result[f"host_ms_{label}"] = {k: round(1000 * v / steps, 3) for k, v in spent.items()}
    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            llm.step()
        sync()
    kernels = [(e.key, e.self_device_time_total / n / 1000, e.count // n) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[1])
    result["gpu_ms_per_step"] = sum(k[1] for k in kernels)
    result["kernel_launches_per_step"] = sum(k[2] for k in kernels)
    result["gpu_idle_ms_per_step"] = result["step_ms_plain"] - result["gpu_ms_per_step"]
    result["top_kernels"] = [{"name": k[0][:80], "ms": round(k[1], 3), "calls": k[2]} for k in kernels[:top]]
    return result


WINDOWS = (40, 300, 550, 800, 950)  # the whole run's profiled steps: full batch, then the batch shrinking


def profile_run(preset: str, windows: tuple[int, ...] = WINDOWS, window_steps: int = 4,
                **engine_options: Any) -> dict[str, Any]:
    """The throughput benchmark's run stepped by hand: per step the sequences running and the sum of their
    contexts before it, and the GPU's time from its start to the next step's (CUDA events queued at each
    step's start: with async scheduling a step is queued behind the one running, so this is the GPU's time
    a step); ``kv_floor_ms``: those contexts' K and V at the device-to-device copy rate, measured after the
    run (:func:`nanovllm.bench.kernels.copy_bandwidth`, the rate the kernel benchmarks compare with). The
    kernels of ``window_steps`` steps from each step in ``windows`` (torch.profiler, CUDA only: it adds a
    little to those steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import LLM, SamplingParams
    from nanovllm.bench.kernels import copy_bandwidth
    from nanovllm.bench.kv import engine_groups

    llm = LLM(preset, max_model_len=4096, **engine_options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, as the benchmark's
    prompts, max_tokens = throughput_workload()
    for p, m in zip(prompts, max_tokens, strict=True):
        llm.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m))
    kv_bytes = sum(g["kv_bytes_per_token"] for g in engine_groups(llm))
    sched = llm.scheduler
    steps, events, kernels = [], [], {}
    prof, first = None, 0
    sync()
    while sched.waiting or sched.running:
        if len(steps) in windows:
            prof, first = profile(activities=[ProfilerActivity.CUDA]), len(steps)
            prof.start()
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        context = sum(s.num_tokens for s in sched.running)
        steps.append({"step": len(steps), "running": len(sched.running), "waiting": len(sched.waiting),
                      "context": context})
        llm.step()
        if prof is not None and len(steps) == first + window_steps:
            sync()
            prof.stop()
            times: dict[str, list] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    entry = times.setdefault(e.name[:80], [0.0, 0])
                    entry[0] += e.device_time_total / 1000 / window_steps
                    entry[1] += 1
            kernels[first] = [{"name": k, "ms": round(t, 3), "calls": n // window_steps}
                              for k, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:10]]
            prof = None
    events.append(torch.cuda.Event(enable_timing=True))
    events[-1].record()
    sync()
    copy_tbps = copy_bandwidth() / 1e3
    for step, start, end in zip(steps, events, events[1:], strict=False):
        step["gpu_ms"] = round(start.elapsed_time(end), 4)
        step["kv_floor_ms"] = round(step["context"] * kv_bytes / copy_tbps / 1e9, 4)
    return {"benchmark": "decode-run", "preset": preset, "kv_bytes_per_token": kv_bytes,
            "copy_tbps": copy_tbps, "gpu_s": sum(s["gpu_ms"] for s in steps) / 1000, "steps": steps,
            "windows": kernels, "window_steps": window_steps}


def beside_windows(r: dict[str, Any]) -> set[int]:
    """The steps whose GPU time the profiling changed: each window's steps, and the one before it (the
    profiler starts between that step's start and the window's)."""
    return {i for w in r["windows"] for i in range(int(w) - 1, int(w) + r["window_steps"])}


def run_markdown(r: dict[str, Any]) -> list[str]:
    """A whole run's table: its steps by the sequences running (those with a prompt still waiting apart)."""
    buckets: dict[str, list[float]] = {}
    left_out = beside_windows(r)
    for s in r["steps"]:
        if s["step"] in left_out:
            continue
        low = max(0, s["running"] - 1) // 32 * 32  # batches in bands of 32 sequences
        key = "prompts waiting" if s["waiting"] else f"{low + 1}-{low + 32}"
        b = buckets.setdefault(key, [0, 0.0, 0.0])
        b[0] += 1
        b[1] += s["gpu_ms"]
        b[2] += s["kv_floor_ms"]
    kib = r["kv_bytes_per_token"] / 1024
    lines = ["", f"{r['preset']}: {len(r['steps'])} steps, {r['gpu_s']:.3f} s of GPU time, the table without "
             f"the {len(left_out)} steps the profiled windows slowed; K and V at {kib:.0f} KiB a token read "
             f"at {r['copy_tbps']:.2f} TB/s for comparison.", "",
             "| sequences running | steps | GPU s | ms a step | their K and V at the copy rate, ms "
             "| the rest, ms |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {n} | {t / 1000:.3f} | {t / n:.2f} | {f / n:.2f} | {(t - f) / n:.2f} |"
              for k, (n, t, f) in buckets.items()]
    lines += ["", "| window from step | running | largest kernels, ms a step (calls) |", "|---|---|---|"]
    lines += [f"| {w} | {r['steps'][int(w)]['running']} | "
              + ", ".join(f"{k['name'][:32]} {k['ms']} ({k['calls']})" for k in ks[:6]) + " |"
              for w, ks in r["windows"].items()]
    return lines


def run_chart(payload: dict[str, Any], path: Path) -> None:
    """GPU time a step against its K and V at the copy rate, over the whole run."""
    runs = [r for r in payload["results"] if r.get("benchmark") == "decode-run"]
    if not runs:
        return
    fig, axes = _plot.subplots(1, len(runs), figsize=(8 * len(runs), 3.6), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        left_out = beside_windows(r)
        shown = [s for s in r["steps"] if not s["waiting"] and s["step"] not in left_out]
        ax.plot([s["step"] for s in shown], [s["gpu_ms"] for s in shown], lw=0.8, label="GPU time a step")
        ax.plot([s["step"] for s in shown], [s["kv_floor_ms"] for s in shown], lw=0.8,
                label="its K and V at the copy rate")
        ax.set(xlabel="step", ylabel="ms", title=f"{r['preset']}: decode steps")
        ax.legend(fontsize=7)
    _plot.save(fig, path, path.stem, payload["environment"])


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}."]
    for r in payload["results"]:
        if "error" in r:
            lines += ["", f"{r['preset']}: failed ({r['error']})"]
            continue
        if r["benchmark"] == "decode-run":
            lines += run_markdown(r)
            continue
        lines += ["", f"Decode step, {r['preset']}, batch {r['batch']}: {r['step_ms_plain']:.2f} ms wall, "
                  f"{r['gpu_ms_per_step']:.2f} ms of GPU kernels ({r['kernel_launches_per_step']} launches), "
                  f"{r['gpu_idle_ms_per_step']:.2f} ms GPU idle; host phases (ms) {r['host_ms_plain']}, with a "
                  f"synchronisation after each {r['host_ms_synced']}.", "",
                  "| kernel | ms per step | calls |", "|---|---|---|"]
        lines += [f"| {k['name']} | {k['ms']} | {k['calls']} |" for k in r["top_kernels"]]
    return "\n".join(lines) + "\n"


def run_job(job: dict) -> list[dict[str, Any]]:
    if job["kind"] == "run":
        return [profile_run(job["preset"], **job["options"])]
    return [profile_decode_step(job["preset"], job["steps"], job["num_seqs"], job["temperature"],
                                **job["options"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/decode_profile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--presets", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--num-seqs", type=int, default=256, help="sequences decoded together (1: batch 1)")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--temperature", type=float, default=0.6, help="0: greedy, as the latency benchmark")
    parser.add_argument("--whole-run", action="store_true",
                        help="the throughput benchmark's whole run, step by step, instead of one step")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="decode_profile")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    options = {"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size > 1 else {}
    jobs = [{"kind": "run" if args.whole_run else "profile", "preset": p, "steps": args.steps,
             "num_seqs": args.num_seqs, "temperature": args.temperature, "options": options}
            for p in args.presets]
    return run_jobs(jobs, __file__, Path(args.out), args.name, vars(args) | {"job": None}, list, markdown,
                    run_chart)


if __name__ == "__main__":
    sys.exit(main())
