"""Where a decode step's time goes, on a shape preset with random weights: ``python benchmarks/decode_profile.py``.

The throughput benchmark's prompts (``nanovllm bench throughput``) are prefilled and decode steps are timed:
wall clock per step, the host phases (scheduling, input preparation, sampling, waiting for the GPU), and the
GPU kernels of five profiled steps, the slowest first. Each preset runs in a process of its own; results go to
``OUT/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

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


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}."]
    for r in payload["results"]:
        if "error" in r:
            lines += ["", f"{r['preset']}: failed ({r['error']})"]
            continue
        lines += ["", f"Decode step, {r['preset']}, batch {r['batch']}: {r['step_ms_plain']:.2f} ms wall, "
                  f"{r['gpu_ms_per_step']:.2f} ms of GPU kernels ({r['kernel_launches_per_step']} launches), "
                  f"{r['gpu_idle_ms_per_step']:.2f} ms GPU idle; host phases (ms) {r['host_ms_plain']}, with a "
                  f"synchronisation after each {r['host_ms_synced']}.", "",
                  "| kernel | ms per step | calls |", "|---|---|---|"]
        lines += [f"| {k['name']} | {k['ms']} | {k['calls']} |" for k in r["top_kernels"]]
    return "\n".join(lines) + "\n"


def run_job(job: dict) -> list[dict[str, Any]]:
    return [profile_decode_step(job["preset"], job["steps"], job["num_seqs"], job["temperature"],
                                **job["options"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/decode_profile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--presets", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--num-seqs", type=int, default=256, help="sequences decoded together (1: batch 1)")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--temperature", type=float, default=0.6, help="0: greedy, as the latency benchmark")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="decode_profile")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    options = {"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size > 1 else {}
    jobs = [{"kind": "profile", "preset": p, "steps": args.steps, "num_seqs": args.num_seqs,
             "temperature": args.temperature, "options": options} for p in args.presets]
    return run_jobs(jobs, __file__, Path(args.out), args.name, vars(args) | {"job": None}, list, markdown,
                    lambda payload, path: None)


if __name__ == "__main__":
    sys.exit(main())
