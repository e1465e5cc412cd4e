"""Tensor parallelism's speed, TP1 next to TPn in one run: ``python benchmarks/tp_bench.py --tensor-parallel-size 2``.

Jobs, each in its own process (``nanovllm bench``'s jobs, one engine each, so that one engine's GPU memory
never shrinks the next one's KV cache), every row marked with its ``tensor_parallel_size``:

- ``latency``: batch-1 decode of each ``--presets`` at TP1 and at TPn (a prompt of 128 tokens, 512 greedy
  tokens, CUDA graphs): the median ms per decode step.
- ``throughput``: B1, nano-vLLM's bench.py workload (256 sequences, 100-1024 tokens in and out), of each
  ``--presets`` at TP1 and at TPn: output tokens/s.
- ``large``: ``--large-preset`` (a model no single GPU holds, default llama-3.1-70b) at TPn alone: batch-1
  decode, B1 throughput, and ``ttft``: one prompt of ``--ttft-context`` tokens (default 32768), the time
  until its first token, then ``--ttft-decode-steps`` decode steps at that context (ms per step).

Results go to ``OUT/NAME.{json,md}`` after every job (a run cut short keeps what it measured);
``benchmarks/tp_summary.py OUT`` sets the TPn rows against TP1's and the targets.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from _jobs import job_main, jobs_of_kinds, run_jobs
from nanovllm.bench import markdown_row

METRICS = {"latency": ("ms_per_token", "ms/token"), "throughput": ("output_tok_per_s", "tok/s"),
           "ttft": ("ttft_s", "s to the first token")}


def jobs(tp: int, presets: list[str], large_preset: str, ttft_context: int, ttft_decode_steps: int) -> list[dict]:
    """Per preset its TP1 and TPn latency jobs, then throughput's, then the large preset's at TPn."""
    if tp < 2:
        raise ValueError(f"--tensor-parallel-size {tp}: give 2 or more, the TPn measured next to TP1")
    out: list[dict] = []
    for kind, options in (("latency", {"eager": False}), ("throughput", {})):
        out += [{"kind": kind, "preset": p, "options": {**options, "tensor_parallel_size": size}}
                for p in presets for size in (1, tp)]
    at_tp = {"tensor_parallel_size": tp}
    out += [{"kind": "large-latency", "preset": large_preset, "options": {"eager": False, **at_tp}},
            {"kind": "large-throughput", "preset": large_preset, "options": at_tp},
            {"kind": "large-ttft", "preset": large_preset,
             "options": {"context": ttft_context, "batch": 1, "steps": ttft_decode_steps, **at_tp}}]
    return out


def run_job(job: dict) -> list[dict[str, Any]]:
    """The ``nanovllm bench`` job behind ``job`` (``large-*``: latency, throughput, or the GPU-resident
    decode measurement as ``ttft``), its rows marked with the tensor-parallel size."""
    from nanovllm import bench

    kind = job["kind"].removeprefix("large-")
    inner = {**job, "kind": "offload-resident" if kind == "ttft" else kind}
    rows = bench.run_job(inner)
    for row in rows:
        row["tensor_parallel_size"] = job["options"]["tensor_parallel_size"]
        if kind == "ttft":
            row["benchmark"] = "ttft"
    return rows


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.", "",
             "| benchmark | preset | TP | measure | value |", "|---|---|---|---|---|"]
    for r in payload["results"]:
        tp = r.get("tensor_parallel_size", r.get("options", {}).get("tensor_parallel_size", "?"))
        if "error" in r:
            lines.append(markdown_row([r["benchmark"], r["preset"], tp, "failed", r["error"]]))
            continue
        metric, unit = METRICS[r["benchmark"]]
        lines.append(markdown_row([r["benchmark"], r["preset"], tp, unit, f"{r[metric]:,.3f}"]))
        if r["benchmark"] == "ttft":
            lines.append(markdown_row(["ttft", r["preset"], tp, f"decode ms/step at {r['prompt_len']:,} tokens",
                                       f"{r['decode_ms_per_step']:,.3f}"]))
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> None:
    """None: benchmarks/tp_summary.py draws the run's speedups."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/tp_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="TPn, measured next to TP1")
    parser.add_argument("--presets", nargs="+", default=["qwen3-8b", "llama-3.1-8b"],
                        help="presets of the latency and throughput jobs")
    parser.add_argument("--large-preset", default="llama-3.1-70b", help="the preset of the large jobs (TPn only)")
    parser.add_argument("--ttft-context", type=int, default=32768, help="prompt tokens of the large TTFT job")
    parser.add_argument("--ttft-decode-steps", type=int, default=32, help="decode steps timed after that prompt")
    parser.add_argument("--only", nargs="+", choices=["latency", "throughput", "large"], default=None,
                        help="job kinds to run (default: all three)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="tp_bench")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    chosen = jobs_of_kinds(jobs(args.tensor_parallel_size, args.presets, args.large_preset, args.ttft_context,
                                args.ttft_decode_steps), args.only)
    return run_jobs(chosen, __file__, Path(args.out), args.name, vars(args) | {"job": None}, list, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
