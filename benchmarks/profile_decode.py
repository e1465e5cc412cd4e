"""Where one decode step of the B1 workload goes: host phases, GPU kernels, launches.

Loads the B1 prompts, steps until every sequence is decoding, then times decode steps phase by phase
(host wall time, and GPU time with a synchronisation after each phase) and profiles a few with
torch.profiler. Usage: python benchmarks/profile_decode.py [--preset qwen3-0.6b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.bench import throughput_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()

    llm = LLM(args.preset, max_model_len=4096, enforce_eager=args.eager)
    prompts, max_tokens = throughput_workload()
    for p in prompts:  # every sequence runs past the profiled steps
        llm.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024))
    sched, runner = llm.scheduler, llm.runner
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        llm.step()
    for _ in range(5):
        llm.step()
    torch.cuda.synchronize()

    phases: dict[str, float] = {}

    def timed(name, fn, sync):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            if sync:
                torch.cuda.synchronize()
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
            return r
        return wrapper

    report = {"preset": args.preset, "batch": len(sched.running), "cuda_graphs": bool(runner.graphs)}
    originals = {
        "schedule": (sched, "schedule"), "prepare": (runner, "prepare"),
        "sampling_tensors": (runner, "_sampling_tensors"), "sampler": (runner, "sampler"),
    }
    for sync in (False, True):
        phases.clear()
        saved = {}
        for name, (obj, attr) in originals.items():
            saved[name] = getattr(obj, attr)
            setattr(obj, attr, timed(name, saved[name], sync))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / args.steps
        for name, (obj, attr) in originals.items():
            setattr(obj, attr, saved[name])
        label = "synced" if sync else "plain"
        report[label] = {"step_ms": 1000 * total, **{k: 1000 * v / args.steps for k, v in phases.items()}}

    from torch.profiler import ProfilerActivity, profile

    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            llm.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(
        ((e.key, e.device_time_total / n / 1000, e.count // n) for e in events if e.device_time_total > 0
         and e.device_type.name == "CUDA"),
        key=lambda x: -x[1],
    )
    report["gpu_ms_per_step"] = sum(k[1] for k in kernels)
    report["top_kernels"] = [{"name": k[0][:90], "ms": round(k[1], 3), "calls": k[2]} for k in kernels[:20]]
    print(json.dumps(report, indent=1))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_{args.preset}{'_eager' if args.eager else ''}.json").write_text(
            json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
