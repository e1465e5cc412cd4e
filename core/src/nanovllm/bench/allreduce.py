"""B6's all-reduce time per decode step: ``nanovllm bench allreduce --tensor-parallel-size 2``.

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
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

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
        raise ValueError("nanovllm bench allreduce needs --tensor-parallel-size 2 or more (ranks to all-reduce "
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


def markdown_lines(results: list[dict[str, Any]]) -> list[str]:
    """The results' all-reduce rows as a table (none: no lines)."""
    rows = [r for r in results if r["benchmark"] == "allreduce" and "error" not in r]
    if not rows:
        return []
    first = rows[0]
    lines = ["", f"All-reduces of a decode step: {first['allreduces_per_step']} of [batch, hidden] "
             f"{first['dtype']} ({first['preset']}), {first['world_size']} ranks. Path `symmetric`: the "
             "engine's own all-reduce (symmetric memory up to its buffer, NCCL above); `symmetric+norm`: it, "
             "then the residual add and RMSNorm that follow it in a decoder layer; `fused norm`: both in one "
             "kernel."]
    if first["symmetric_off"]:
        lines.append(f"Symmetric memory not used: {first['symmetric_off']}.")
    lines += ["", "| path | mode | batch | bytes | us per all-reduce | ms per step |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['mode']} | {r['batch']} | {r['bytes_per_allreduce']:,} | "
              f"{r['us_per_allreduce']:.1f} | {r['ms_per_step']:.3f} |" for r in rows]
    return lines
