"""The small-batch matmul path against cuBLAS and the bytes floor, per layer shape of a preset (default
qwen3-8b) at each tensor-parallel size: ``python benchmarks/gemv_sweep.py --out OUT``.

For each matmul of a decoder layer and the LM head (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``; a
rank's shard at TP n, the sharded dimension divided by n) and each number of rows (decode tokens), it
times our Triton kernel (:mod:`nanovllm.layers.gemv`) over a focused grid of configurations, torch's
paths (``F.linear`` through cuBLAS and through cuBLASLt, ``torch.mv`` at one row, and ``weight @ x.T``,
whose result is the transpose), and the floor: the weight's bytes at the bandwidth of a device-to-device
copy measured in the same run. Every candidate runs back to back from a CUDA graph (as the decode graphs
run them) over enough copies of the weight that none is read from L2. A configuration whose output is
not within one rounding of float32 math is reported and never chosen.

Writes to ``--out`` the results (``gemv_sweep.json`` and its markdown table) and ``tuned_table.py``: the
best configuration of each shape and row bucket that beats cuBLAS, as entries for
:data:`nanovllm.layers.gemv.TUNED` (paste them there). The run keeps to ``--budget-s`` seconds: worker
processes compile every configuration first into Triton's cache (Triton compiles on one thread per
process), and configurations tried past the budget are skipped (counted in the results). ``--dry-run``:
tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (correctness and the files; the times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DRY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=200)
NAME = "gemv_sweep"  # of the results files
L2_COPIES = 3  # weight copies span at least this many L2 caches, so each call reads HBM


def layer_shapes(config: dict[str, Any], tp: int) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of one rank's weight at tensor-parallel size ``tp``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim // tp, hidden),
        "o": (hidden, heads * head_dim // tp),
        "gate_up": (2 * inter // tp, hidden),
        "down": (hidden, inter // tp),
        "lm_head": (-(-config["vocab_size"] // tp), hidden),
    }


def candidate_configs(rows: int, dry: bool) -> list:  # rows: a row bucket
    """Our configurations for a row count: the default first, then a focused grid (registers for one or two
    rows, tensor cores from two up; narrow and wide slabs; split-K variants come from the defaults)."""
    from nanovllm.layers.gemv import GemvConfig

    if dry:
        grid = [GemvConfig(block_n=8, block_k=16), GemvConfig(block_n=16, block_k=32, dot=True),
                GemvConfig(block_n=4, block_k=16, split_k=2)]
        return grid
    registers = [GemvConfig(block_n=n, block_k=k, num_warps=w, num_stages=s)
                 for n, k, w, s in [(4, 512, 4, 1), (8, 512, 4, 3), (8, 1024, 8, 1), (16, 512, 8, 3),
                                    (4, 1024, 4, 2)]]
    dots = [GemvConfig(block_n=n, block_k=k, dot=True, num_warps=w, num_stages=s)
            for n, k, w, s in [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 6),
                               (64, 128, 4, 4), (16, 128, 4, 8)]]
    if rows == 1:
        return registers + dots[:3]
    if rows == 2:
        return registers[1:4] + dots[:4]
    return dots


def with_splits(configs: list, n: int, k: int, sms: int) -> list:
    """Each configuration, plus split-K 2 and 4 where its slabs leave the multiprocessors short of two
    programs each."""
    out = list(configs)
    for config in configs:
        if config.split_k == 1 and -(-n // config.block_n) < 2 * sms:
            for split in (2, 4):
                if k // split >= 2 * config.block_k:
                    out.append(config.__class__(**{**config.knobs(), "split_k": split}))
    return list(dict.fromkeys(out))


class Timer:
    """Seconds per call of ``fn(copy_index)``: on CUDA, ``calls`` calls back to back in one CUDA graph
    (cycling through the weight copies), replayed ``repeats`` times, the median; on the CPU, wall time."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def __call__(self, fn: Callable[[int], Any], copies: int, calls: int) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            for i in range(calls):
                fn(i % copies)
            return (time.perf_counter() - start) / calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(copies):  # warm-up outside the graph (cuBLAS workspaces, autotuned plans)
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % copies)
        graph.replay()
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        del graph
        return statistics.median(times)


def torch_paths(rows: int) -> dict[str, Callable]:
    """torch's ways to compute ``x @ w.T`` (``F.linear`` under cuBLASLt is set around capture)."""
    paths = {"cublas": lambda x, w: F.linear(x, w), "cublaslt": lambda x, w: F.linear(x, w),
             "w@x.T": lambda x, w: w @ x.t()}
    if rows == 1:
        paths["torch.mv"] = lambda x, w: torch.mv(w, x[0])
    return paths


def plan(args: argparse.Namespace, config: dict[str, Any], sms: int) -> list[dict[str, Any]]:
    """Every case (TP size, layer, rows) with its candidate configurations, the default first."""
    from nanovllm.layers.gemv import default_config, row_bucket

    cases = []
    for tp in args.tp:
        for name, (n, k) in layer_shapes(config, tp).items():
            if args.layers and name not in args.layers:
                continue
            for rows in args.rows:
                bucket = row_bucket(rows)
                configs = [default_config(n, k, bucket, sms), *candidate_configs(bucket, args.dry_run)]
                if not args.dry_run:
                    configs = with_splits(configs, n, k, sms)
                cases.append(dict(tp=tp, layer=name, n=n, k=k, rows=rows, configs=configs))
    return cases


def compile_items(cases: list[dict[str, Any]]) -> list[tuple[int, int, int, Any]]:
    """(rows, N, K, configuration) of every distinct kernel the cases launch, as far as Triton's
    specialisation tells them apart (one row or more, padded rows, splits ending inside a tile)."""
    items = {}
    for case in cases:
        for c in case["configs"]:
            rows, k = case["rows"], case["k"]
            per_split = -(-(-(-k // c.split_k)) // c.block_k) * c.block_k
            key = (c, rows == 1, 16 if c.dot else 1 << (rows - 1).bit_length(), k == per_split * c.split_k)
            items.setdefault(key, (rows, case["n"], k, c))
    return list(items.values())


def compile_share(cases: list[dict[str, Any]], dtype: torch.dtype, device: torch.device, share: int,
                  shares: int) -> None:
    """Compile every ``shares``-th kernel of the cases, from the ``share``-th (launching nothing)."""
    from nanovllm.layers import gemv_kernels

    for rows, n, k, c in compile_items(cases)[share::shares]:
        x = torch.zeros(rows, k, dtype=dtype, device=device)
        w = torch.empty(n, k, dtype=dtype, device=device)
        gemv_kernels.gemv(x, w, None, **c.knobs(), compile_only=True)


def compile_in_workers(args: argparse.Namespace, items: int) -> None:
    """Triton compiles in one thread per process: worker processes compile the kernels into Triton's cache
    (one share each), so that the sweep then only loads them. A worker that fails leaves its share to the
    sweep's own process."""
    workers = max(1, min(items, (os.cpu_count() or 2) - 1, 15))
    argv = [sys.executable, __file__, "--out", str(args.out), "--preset", args.preset, "--dtype", args.dtype,
            "--tp", *map(str, args.tp), "--rows", *map(str, args.rows)]
    if args.layers:
        argv += ["--layers", *args.layers]
    procs = [subprocess.Popen([*argv, "--compile-share", str(i), str(workers)]) for i in range(workers)]
    deadline = time.monotonic() + args.budget_s / 2
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> None:
    """The sweep; ``save`` gets the payload so far after each case (a run cut short keeps what it
    measured)."""
    from nanovllm.bench.kernels import copy_bandwidth
    from nanovllm.layers.gemv import gemv, gemv_reference
    from nanovllm.presets import PRESETS

    started = time.monotonic()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = getattr(torch, args.dtype)
    config = DRY_SHAPE if dry else PRESETS[args.preset]
    sms = 132 if dry else torch.cuda.get_device_properties(device).multi_processor_count
    l2 = 0 if dry else torch.cuda.get_device_properties(device).L2_cache_size  # dry: one copy, one call
    timer = Timer(device, repeats=1 if dry else 5)
    bandwidth = copy_bandwidth() * 1e9  # the project's copy rate: the one every other ceiling uses
    gen = torch.Generator(device).manual_seed(0)

    cases = plan(args, config, sms)
    weights_of: dict[tuple[int, int], list[torch.Tensor]] = {}

    def weights(n: int, k: int) -> list[torch.Tensor]:
        if (n, k) not in weights_of:
            weights_of.clear()  # one shape's copies at a time
            copies = max(1, -(-L2_COPIES * l2 // (n * k * dtype.itemsize)))
            weights_of[(n, k)] = [(torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
                                  for _ in range(copies)]
        return weights_of[(n, k)]

    compile_started = time.monotonic()
    if not dry:
        compile_in_workers(args, len(compile_items(cases)))
        compile_share(cases, dtype, device, 0, 1)  # what the workers compiled loads from Triton's cache
    compile_s = time.monotonic() - compile_started

    results, skipped = [], 0
    settings = dict(preset="dry" if dry else args.preset, dtype=args.dtype, tp=args.tp, rows=args.rows,
                    budget_s=args.budget_s)
    for index, case in enumerate(cases):
        # each case's share of the time left: a budget cut skips configurations evenly, not the last cases
        case_end = time.monotonic() + (started + args.budget_s - time.monotonic()) / (len(cases) - index)
        n, k, rows = case["n"], case["k"], case["rows"]
        ws = weights(n, k)
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        ref = gemv_reference(x, ws[0])
        calls = max(len(ws), 1 if dry else min(64, -(-4 * len(ws) * l2 // (n * k * dtype.itemsize))))
        floor_us = n * k * dtype.itemsize / bandwidth * 1e6
        row = dict(tp=case["tp"], layer=case["layer"], n=n, k=k, rows=rows, floor_us=floor_us,
                   weight_mb=n * k * dtype.itemsize / 2**20, torch={}, ours=[])
        for path, fn in torch_paths(rows).items():
            if dry and path == "cublaslt":
                continue
            previous = torch.backends.cuda.preferred_blas_library()
            try:
                if path == "cublaslt":
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                row["torch"][path] = timer(lambda i, fn=fn: fn(x, ws[i]), len(ws), calls) * 1e6
            except RuntimeError as exc:
                row["torch"][path] = None
                row.setdefault("errors", {})[path] = str(exc).splitlines()[0]
            finally:
                torch.backends.cuda.preferred_blas_library(previous)
        for c in case["configs"]:
            if time.monotonic() > case_end and c is not case["configs"][0]:
                skipped += 1
                continue
            out = gemv(x, ws[0], None, c)
            diff = (out.float() - ref.float()).abs()
            ok = bool((diff <= 2**-7 * ref.float().abs() + 1e-3).all())
            us = timer(lambda i, c=c: gemv(x, ws[i], None, c), len(ws), calls) * 1e6
            row["ours"].append(dict(config=c.knobs(), us=us, correct=ok, default=c is case["configs"][0]))
        good = [o for o in row["ours"] if o["correct"]]
        best = min(good, key=lambda o: o["us"]) if good else None
        cublas = row["torch"].get("cublas")
        row["best"] = best
        row["best_torch"] = min((v, p) for p, v in row["torch"].items() if v is not None)[::-1]
        if best is not None:
            row["best_of_floor"] = floor_us / best["us"]
            row["speedup_vs_cublas"] = cublas / best["us"] if cublas else None
        row["cublas_of_floor"] = floor_us / cublas if cublas else None
        results.append(row)
        save(dict(settings=settings, steps=step_totals(results, config.get("num_hidden_layers", 1)),
                  copy_bandwidth_gbs=bandwidth / 1e9, multiprocessors=sms, l2_bytes=l2, compile_s=compile_s,
                  configs_skipped_for_budget=skipped, wall_s=time.monotonic() - started, results=results))
        print(f"tp{row['tp']} {row['layer']:8} rows={rows} floor {floor_us:8.1f} us  cublas "
              f"{cublas or float('nan'):8.1f}  ours {best['us'] if best else float('nan'):8.1f}",
              file=sys.stderr)


def step_totals(results: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """The matmuls of one decode step (every layer's four and the LM head), per TP size and row count, in
    ms: cuBLAS, our best per shape, the faster of the two per shape, and the floor (of the layers swept)."""
    totals: dict[tuple[int, int], dict[str, Any]] = {}
    for r in results:
        times = {"cublas_ms": r["torch"].get("cublas") or float("nan"),
                 "ours_ms": r["best"]["us"] if r.get("best") else float("nan"), "floor_ms": r["floor_us"]}
        times["faster_ms"] = min(times["cublas_ms"], times["ours_ms"])
        total = totals.setdefault((r["tp"], r["rows"]), {"tp": r["tp"], "rows": r["rows"],
                                                        **dict.fromkeys(times, 0.0)})
        count = 1 if r["layer"] == "lm_head" else layers
        for key, us in times.items():
            total[key] += count * us / 1e3
    return list(totals.values())


def tuned_table(payload: dict[str, Any]) -> str:
    """Python source of the TUNED entries: the best correct configuration of each (N, K, row bucket) where it
    beats cuBLAS, else None (linear() keeps F.linear there)."""
    from nanovllm.layers.gemv import row_bucket

    lines = [f"# from benchmarks/gemv_sweep.py, {payload['environment'].get('device', '?')}, "
             f"{payload['environment'].get('date', '?')}: (N, K, row bucket) -> fastest configuration",
             "TUNED = {"]
    for r in payload["results"]:
        best, key = r.get("best"), f"({r['n']}, {r['k']}, {row_bucket(r['rows'])})"
        if best is None or not r.get("speedup_vs_cublas") or r["speedup_vs_cublas"] <= 1.0:
            lines.append(f"    {key}: None,  # tp{r['tp']} {r['layer']}: cuBLAS is faster")
            continue
        knobs = ", ".join(f"{name}={value!r}" for name, value in best["config"].items())
        lines.append(f"    {key}: GemvConfig({knobs}),  # tp{r['tp']} {r['layer']}: "
                     f"{r['speedup_vs_cublas']:.2f}x cuBLAS, {r['best_of_floor']:.2f} of the floor")
    return "\n".join([*lines, "}"]) + "\n"


def markdown(payload: dict[str, Any]) -> str:
    env = payload["environment"]
    lines = [
        "# Small-batch matmul: Triton GEMV vs cuBLAS vs the bytes floor", "",
        f"{env.get('device')}, {env.get('date')}, commit {env.get('commit')}, torch {env.get('torch')}; "
        f"{payload['settings']['dtype']}, preset {payload['settings']['preset']}. Copy bandwidth "
        f"{payload['copy_bandwidth_gbs']:.0f} GB/s; floor = weight bytes at that rate. Times are per call, "
        f"from CUDA graphs, weights not in L2. Compiles {payload['compile_s']:.1f} s; "
        f"{payload['configs_skipped_for_budget']} configurations skipped for the time budget; "
        f"wall {payload['wall_s']:.1f} s.", "",
        "| TP | layer | N x K | rows | floor us | cuBLAS us | best torch | ours us | ours/floor | vs cuBLAS "
        "| best config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        best = r.get("best")
        cublas = r["torch"].get("cublas")
        path, us = r["best_torch"]
        config = ", ".join(f"{k}={v}" for k, v in best["config"].items()) if best else "none correct"
        lines.append(
            f"| {r['tp']} | {r['layer']} | {r['n']} x {r['k']} | {r['rows']} | {r['floor_us']:.1f} | "
            f"{cublas or float('nan'):.1f} | {path} {us:.1f} | {best['us'] if best else float('nan'):.1f} | "
            f"{r.get('best_of_floor', float('nan')):.2f} | "
            f"{r.get('speedup_vs_cublas') or float('nan'):.2f}x | "
            f"{config} |")
    lines += ["", "Matmuls of one decode step (every layer's and the LM head's), ms:", "",
              "| TP | rows | floor | cuBLAS | ours | faster of the two per shape |",
              "|---|---|---|---|---|---|"]
    for t in payload["steps"]:
        lines.append(f"| {t['tp']} | {t['rows']} | {t['floor_ms']:.3f} | {t['cublas_ms']:.3f} | "
                     f"{t['ours_ms']:.3f} | {t['faster_ms']:.3f} |")
    wrong = [(r["tp"], r["layer"], r["rows"], o["config"]) for r in payload["results"] for o in r["ours"]
             if not o["correct"]]
    if wrong:
        lines += ["", f"Configurations with wrong outputs ({len(wrong)}): {wrong[:10]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for the results (JSON, markdown) and tuned_table.py")
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2],
                        help="tensor-parallel sizes (default 1 2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="rows of x (default 1 2 4 8)")
    parser.add_argument("--layers", nargs="+", choices=("qkv", "o", "gate_up", "down", "lm_head"),
                        help="only these matmuls (default all)")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="seconds for the compiles and the sweep; each case gets its share of what is "
                             "left and skips the configurations past it (default 60)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (set it before running)")
    parser.add_argument("--compile-share", type=int, nargs=2, metavar=("I", "OF"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(not 1 <= r <= 16 for r in args.rows):
        parser.error("--rows must be between 1 and 16 (the kernel's range)")
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run runs Triton's interpreter: set TRITON_INTERPRET=1 in the environment")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("the sweep needs a CUDA device (or --dry-run under TRITON_INTERPRET=1)")
    if args.compile_share:  # a compile worker (compile_in_workers)
        from nanovllm.presets import PRESETS

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        compile_share(plan(args, PRESETS[args.preset], sms), getattr(torch, args.dtype), torch.device("cuda"),
                      *args.compile_share)
        return 0
    from nanovllm.bench import environment

    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[dict[str, Any]] = []

    def save(partial: dict[str, Any]) -> None:
        payload = {"environment": env, **partial}
        (args.out / f"{NAME}.json").write_text(json.dumps(payload, indent=1))
        (args.out / f"{NAME}.md").write_text(markdown(payload))
        (args.out / "tuned_table.py").write_text(tuned_table(payload))
        written[:] = [payload]

    run(args, save)
    if written:
        print(markdown(written[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
