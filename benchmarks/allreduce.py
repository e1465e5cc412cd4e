"""The all-reduce time of a tensor-parallel decode step: ``python benchmarks/allreduce.py --tensor-parallel-size 2``.

A tensor-parallel decode step all-reduces the hidden states ``[batch, hidden]`` twice per layer (after the
attention and after the MLP). This starts a world of ``world_size`` ranks on this host (one GPU each, NCCL;
gloo on the CPU), rank 0 in the calling process, and times a step's ``2 * num_hidden_layers`` all-reduces
of a preset's shape, back to back: eagerly (one launch each) and, on CUDA, replayed from one CUDA graph that
captured a whole step's, through NCCL and through the engine's ``all_reduce`` (symmetric memory where the
GPUs have peer access). Reported per batch size, path and mode, the median over the steps: microseconds per
all-reduce and milliseconds per step.

In a decoder layer each all-reduce is followed by the residual add and RMSNorm, so with symmetric memory two
more paths time the pair: ``symmetric+norm`` (the all-reduce, then the norm's kernel) and ``fused norm``
(:func:`nanovllm.distributed.all_reduce_rms_norm`, one kernel), which must give the same sums and norms.
Each preset runs in a process of its own; results go to ``OUT/NAME.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _jobs import job_main, run_jobs
from _plot import save, subplots
from nanovllm.distributed import (
    all_reduce,
    all_reduce_rms_norm,
    destroy_tensor_parallel,
    enable_symmetric_all_reduce,
    init_tensor_parallel,
)
from nanovllm.presets import PRESETS

WARMUP_STEPS = 5
START_TIMEOUT_S = 300  # for the other ranks to import torch and join


def step_shape(preset: str) -> tuple[int, int]:
    """(hidden size, all-reduces per decode step) of a preset: two per layer."""
    config = PRESETS[preset]
    return config["hidden_size"], 2 * config["num_hidden_layers"]


def _median_step_seconds(step: Callable[[], None], steps: int, cuda: bool) -> float:
    for _ in range(WARMUP_STEPS):
        step()
    if not cuda:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def _measure(preset: str, batches: list[int], steps: int) -> list[dict[str, Any]]:
    """Every rank runs this in step; rank 0's rows are the result. Each batch is timed through NCCL and, where
    the GPUs allow, through the engine's own ``all_reduce`` (symmetric memory for small tensors), whose sum
    must equal NCCL's."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # a CPU run only checks the benchmark itself
    hidden, per_step = step_shape(preset)
    symmetric_off = enable_symmetric_all_reduce(dtype, device)
    paths: dict[str, Callable[[torch.Tensor], Any]] = {"nccl" if cuda else "gloo": dist.all_reduce}
    weight, eps = torch.ones(hidden, dtype=dtype, device=device), 1e-6
    if symmetric_off is None:
        from nanovllm.layers.fused_kernels import rms_norm

        paths["symmetric"] = all_reduce
        paths["symmetric+norm"] = lambda x: rms_norm(all_reduce(x), weight, eps, x)  # x as the residual
        paths["fused norm"] = lambda x: all_reduce_rms_norm(x, weight, eps, x)
    rows = []
    for batch in batches:
        x = torch.zeros(batch, hidden, dtype=dtype, device=device)  # zeros: sums and residuals stay zero
        fused_takes = False
        if symmetric_off is None:
            probe = torch.randn(batch, hidden, generator=torch.Generator(device).manual_seed(dist.get_rank()),
                                device=device, dtype=dtype)
            expected = probe.clone()
            dist.all_reduce(expected)
            torch.testing.assert_close(all_reduce(probe), expected)
            residual = torch.randn(batch, hidden, generator=torch.Generator(device).manual_seed(7),
                                   device=device, dtype=dtype)
            want = rms_norm(expected, weight, eps, residual.clone())
            got = all_reduce_rms_norm(probe, weight, eps, residual.clone())
            fused_takes = got is not None
            if fused_takes:
                torch.testing.assert_close(got, want)
        for path, reduce in paths.items():
            if path == "fused norm" and not fused_takes:
                continue  # past its buffer: the decoder all-reduces, then norms

            def step(x: torch.Tensor = x, reduce=reduce) -> None:
                for _ in range(per_step):
                    reduce(x)

            modes = {"eager": step}
            if cuda:
                step()  # NCCL sets up its communicator on the first collective, which a capture cannot hold
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                modes["graph"] = graph.replay
            for mode, run in modes.items():
                seconds = _median_step_seconds(run, steps, cuda)
                rows.append({
                    "benchmark": "allreduce", "preset": preset, "path": path, "mode": mode, "batch": batch,
                    "world_size": dist.get_world_size(), "dtype": str(dtype).removeprefix("torch."),
                    "allreduces_per_step": per_step, "bytes_per_allreduce": x.numel() * x.element_size(),
                    "us_per_allreduce": seconds / per_step * 1e6, "ms_per_step": seconds * 1e3,
                    "symmetric_off": symmetric_off,
                })
            if cuda:
                graph.reset()  # before the world is left: NCCL waits for graphs that captured its group
    return rows


def _rank_main(rank: int, world_size: int, port: int, preset: str, batches: list[int], steps: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    init_tensor_parallel(rank, world_size, "cuda" if torch.cuda.is_available() else "cpu", store)
    try:
        _measure(preset, batches, steps)
    finally:
        destroy_tensor_parallel()


def run(world_size: int, preset: str = "qwen3-8b", batches: tuple[int, ...] = (1, 8, 64, 256),
        steps: int = 100) -> list[dict[str, Any]]:
    """Start ``world_size`` ranks (this process is rank 0) and return rank 0's rows."""
    if world_size < 2:
        raise ValueError("the all-reduce benchmark needs --tensor-parallel-size 2 or more (ranks to all-reduce "
                         "between)")
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} needs one GPU per rank, but PyTorch sees "
                         f"{torch.cuda.device_count()}")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_main, args=(rank, world_size, store.port, preset, list(batches), steps),
                             daemon=True) for rank in range(1, world_size)]
    for process in ranks:
        process.start()
    try:
        init_tensor_parallel(0, world_size, "cuda" if torch.cuda.is_available() else "cpu", store)
        try:
            rows = _measure(preset, list(batches), steps)
        finally:
            destroy_tensor_parallel()
    finally:
        for process in ranks:
            process.join(START_TIMEOUT_S)
            if process.is_alive():
                process.kill()
    if any(process.exitcode != 0 for process in ranks):
        raise RuntimeError(f"an all-reduce benchmark rank failed (exit codes {[p.exitcode for p in ranks]}); "
                           "see its output above")
    return rows


def markdown(payload: dict[str, Any], title: str) -> str:
    """The all-reduce rows as a table, and the jobs that failed."""
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}."]
    lines += [f"\nfailed: {r['preset']}: {r['error']}" for r in payload["results"] if "error" in r]
    rows = [r for r in payload["results"] if "error" not in r]
    if not rows:
        return "\n".join(lines) + "\n"
    first = rows[0]
    lines += ["", f"All-reduces of a decode step: {first['allreduces_per_step']} of [batch, hidden] "
             f"{first['dtype']} ({first['preset']}), {first['world_size']} ranks. Path `symmetric`: the "
             "engine's own all-reduce (symmetric memory up to its buffer, NCCL above); `symmetric+norm`: it, "
             "then the residual add and RMSNorm that follow it in a decoder layer; `fused norm`: both in one "
             "kernel."]
    if first["symmetric_off"]:
        lines.append(f"Symmetric memory not used: {first['symmetric_off']}.")
    lines += ["", "| path | mode | batch | bytes | us per all-reduce | ms per step |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['mode']} | {r['batch']} | {r['bytes_per_allreduce']:,} | "
              f"{r['us_per_allreduce']:.1f} | {r['ms_per_step']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> None:
    rows = [r for r in payload["results"] if "error" not in r]
    if not rows:
        return
    fig, ax = subplots(figsize=(10, 0.3 * len(rows) + 1.5))
    ax.barh([f"{r['preset']} {r['path']} {r['mode']} batch {r['batch']}" for r in rows],
            [r["us_per_allreduce"] for r in rows], color="tab:blue")
    ax.set_xlabel("us per all-reduce of a decode step")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    save(fig, path, "allreduce", payload["environment"])


def run_job(job: dict) -> list[dict[str, Any]]:
    return run(job["world_size"], job["preset"], job["batches"], job["steps"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/allreduce.py", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks, one GPU each")
    parser.add_argument("--presets", nargs="+", default=["qwen3-8b"], help="shapes of the all-reduced tensors")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256],
                        help="batch sizes of the [batch, hidden] messages")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per batch and mode")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="allreduce")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    if args.tensor_parallel_size < 2:
        parser.error("--tensor-parallel-size must be 2 or more (ranks to all-reduce between)")
    jobs = [{"kind": "allreduce", "preset": preset, "world_size": args.tensor_parallel_size,
             "batches": args.batches, "steps": args.steps} for preset in args.presets]
    return run_jobs(jobs, __file__, Path(args.out), args.name, vars(args) | {"job": None}, list, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
