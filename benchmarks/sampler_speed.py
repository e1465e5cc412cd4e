"""The sampler alone, torch path against the one-pass kernel: ``python benchmarks/sampler_speed.py --out D``.

For each batch (rows of logits) and logits dtype (float32, bfloat16) at a vocabulary of ``--vocab`` (default
Qwen3's 151,936), every row at temperature ``--temperature`` except every fourth, greedy: the median GPU time
of :class:`~nanovllm.layers.sampler.Sampler` on its torch path and on the kernel (at its default split, and
at forced splits), and the logits' bytes over the time. First it checks that the kernel's greedy rows are
torch's argmax. Writes ``NAME.json`` and ``NAME.md`` (``--name``) to ``--out``. ``--dry-run``: tiny
shapes on the CPU under ``TRITON_INTERPRET=1`` (the script's own check; the times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from nanovllm.bench import environment
from nanovllm.layers import sampler, sampler_kernels

SPLITS = (1, 2, 4, 8)


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(rows: int, vocab: int, dtype: torch.dtype, temperature: float, device: str) -> list[dict]:
    logits = torch.randn(rows, vocab, device=device).to(dtype)
    temperatures = torch.full((rows,), temperature, device=device)
    temperatures[::4] = 0.0
    greedy = temperatures == 0
    drawn = sampler_kernels.sample(logits, temperatures)
    assert torch.equal(drawn[greedy], logits.float().argmax(-1)[greedy]), "greedy rows differ from argmax"
    sample = sampler.Sampler()
    use_kernel = sampler.use_fused if device == "cuda" else lambda x: True

    def kernel_path():
        fused, sampler.use_fused = sampler.use_fused, use_kernel
        try:
            return sample(logits, temperatures)
        finally:
            sampler.use_fused = fused

    def torch_path():  # as a step with an option takes it
        fused, sampler.use_fused = sampler.use_fused, lambda x: False
        try:
            return sample(logits, temperatures)
        finally:
            sampler.use_fused = fused

    candidates = {"torch": torch_path, "kernel": kernel_path}
    for s in SPLITS:
        candidates[f"kernel splits={s}"] = lambda s=s: sampler_kernels.sample(logits, temperatures, s)
    results = []
    for name, fn in candidates.items():
        ms = time_ms(fn, device)
        gb_per_s = logits.numel() * logits.element_size() / ms / 1e6
        results.append(dict(rows=rows, vocab=vocab, dtype=str(dtype).removeprefix("torch."), path=name,
                            ms=round(ms, 4), logits_gb_per_s=round(gb_per_s, 1)))
        print(results[-1], flush=True)
    return results


def markdown(payload: dict, name: str) -> str:
    env = payload["environment"]
    lines = [f"# {name}\n\n{env['device']}, {env['date']}, commit {env['commit']}, "
             f"torch {env['torch']}. "
             f"Temperature {payload['temperature']} (every fourth row greedy).\n",
             "| rows | vocab | dtype | path | ms | logits GB/s | vs torch |", "|---|---|---|---|---|---|---|"]
    torch_ms = {(r["rows"], r["dtype"]): r["ms"] for r in payload["results"] if r["path"] == "torch"}
    for r in payload["results"]:
        ratio = torch_ms[(r["rows"], r["dtype"])] / r["ms"]
        lines.append(f"| {r['rows']} | {r['vocab']:,} | {r['dtype']} | {r['path']} | {r['ms']:.4f} | "
                     f"{r['logits_gb_per_s']:,} | {ratio:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="sampler_speed")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 64, 1])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.rows, args.vocab = [3], 5000
    results = []
    for rows in args.rows:
        for dtype in (torch.float32, torch.bfloat16):
            results += measure(rows, args.vocab, dtype, args.temperature, device)
    payload = {"environment": environment(), "temperature": args.temperature, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(payload, args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
