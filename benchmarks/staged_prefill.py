"""Prefill over pages of 16 from staged contexts against through the block table:
``python benchmarks/staged_prefill.py --out D`` (a CUDA GPU with TMA: Hopper or later).

Kernels: one chunk of ``q`` queries over a ``ctx``-token context in a shuffled paged cache (GQA 32/8, head
dim 128, bf16), the ``triton`` backend's ``prefill`` with its contexts staged (forced) and read through the
block table: the median GPU time of each, the host's time a call (200 calls back to back, no sync between
them), and whether the default rule (``stages_phase``) stages that shape. Engine: the time to the first
token of a ``--prompt``-token prompt in chunks of 8,192 tokens over pages of 16, for each preset, the
contexts staged (the default) and not, alternating over ``--rounds`` rounds (median of three each). Writes
``NAME.json``, ``NAME.md`` and the speed-ups' chart ``NAME.png`` (``--name``) to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from nanovllm.attention import triton_backend as tb
from nanovllm.attention import triton_kernels as tk
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.bench import environment
from nanovllm.bench.kernels import paged_cache

H, HKV, D = 32, 8, 128
CONTEXTS = (4096, 16384, 131072)
QUERIES = (128, 256, 512, 1024, 2048, 4096)


def host_ms(fn, calls: int = 200) -> float:
    """The host's time a call, the GPU left to run behind it."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def kernel_rows() -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for ctx in CONTEXTS:
        k_all, v_all = (torch.randn(ctx, HKV, D, device=dev, generator=gen).bfloat16() for _ in "kv")
        k_cache, v_cache, table = paged_cache(k_all, v_all, 16, gen)
        staged = tb.TritonBackend()
        staged.stage_contexts = True
        staged.reserve_workspace(HKV, D, 16, torch.bfloat16, dev, ctx)
        paged = tb.TritonBackend()
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        for q_len in (q for q in QUERIES if q < ctx):
            q = torch.randn(q_len, H, D, device=dev, generator=gen, dtype=torch.bfloat16)
            k, v = k_all[-q_len:], v_all[-q_len:]
            cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
            meta = PhaseMetadata(cu, lens, table, q_len, ctx, (q_len,), (ctx,))
            rule = tk.stages_phase(q_len, ctx)
            forced, tk.stages_phase = tk.stages_phase, lambda *lens: True

            def run_staged(q=q, k=k, v=v, meta=meta):
                return staged.prefill(q, k, v, k_cache, v_cache, meta, D**-0.5)

            def run_paged(q=q, k=k, v=v, meta=meta):
                return paged.prefill(q, k, v, k_cache, v_cache, meta, D**-0.5)
            try:
                ref = run_paged().float()
                err = ((run_staged().float() - ref).norm() / ref.norm()).item()
                row = dict(ctx=ctx, q_len=q_len, rule_stages=rule, rel_diff=err)
                for name, fn in (("staged", run_staged), ("paged", run_paged)):
                    row[f"{name}_ms"] = round(do_bench(fn, warmup=50, rep=300, return_mode="median"), 4)
                    row[f"{name}_host_ms"] = round(host_ms(fn), 4)
            finally:
                tk.stages_phase = forced
            row["speedup"] = round(row["paged_ms"] / row["staged_ms"], 3)
            rows.append(row)
            print(row, flush=True)
        del k_cache, v_cache, staged, paged
    return rows


def ttft_rows(presets: list[str], prompt: int, rounds: int) -> list[dict]:
    from nanovllm import LLM, SamplingParams

    rows = []
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ids = torch.randint(0, 30000, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    for preset in presets:
        for turn in range(rounds):
            for stage in (None, False):
                tb.TritonBackend.stage_contexts = stage
                try:
                    llm = LLM(preset, max_model_len=prompt + 16, max_num_batched_tokens=8192, block_size=16,
                              gpu_memory_utilization=0.5, enable_prefix_caching=False)
                    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)  # warm-up
                    times = []
                    for _ in range(3):
                        start = time.perf_counter()
                        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                        times.append(time.perf_counter() - start)
                finally:
                    tb.TritonBackend.stage_contexts = None
                rows.append(dict(preset=preset, prompt=prompt, round=turn, staged=stage is None,
                                 ttft_s=round(sorted(times)[1], 4), times_s=[round(t, 4) for t in times]))
                print(rows[-1], flush=True)
                del llm
                gc.collect()
                torch.cuda.empty_cache()
    return rows


def markdown(payload: dict, name: str) -> str:
    env = payload["environment"]
    lines = [f"# {name}\n\n{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}. "
             "GQA 32/8, head dim 128, bf16, pages of 16 tokens.\n",
             "| context | queries | staged ms | paged ms | speed-up | host ms a call, staged / paged | "
             "the rule stages it |", "|---|---|---|---|---|---|---|"]
    for r in payload["kernels"]:
        lines.append(f"| {r['ctx']:,} | {r['q_len']:,} | {r['staged_ms']:.3f} | {r['paged_ms']:.3f} | "
                     f"{r['speedup']:.2f}x | {r['staged_host_ms']:.3f} / {r['paged_host_ms']:.3f} | "
                     f"{'yes' if r['rule_stages'] else 'no'} |")
    lines += ["", f"Time to the first token, a {payload['prompt']:,}-token prompt in 8K chunks (median of "
              "three):", "", "| preset | round | staged s | through the table s | speed-up |", "|---|---|---|---|---|"]
    by = {(r["preset"], r["round"], r["staged"]): r["ttft_s"] for r in payload["ttft"]}
    for preset, turn, _ in sorted(k for k in by if k[2]):
        on, off = by[(preset, turn, True)], by[(preset, turn, False)]
        lines.append(f"| {preset} | {turn} | {on:.3f} | {off:.3f} | {off / on:.3f}x |")
    return "\n".join(lines) + "\n"


def chart(payload: dict, path: Path, name: str) -> None:
    """Speed-up of staged over in place per shape, one line per context, the shapes the rule stages marked."""
    from _plot import save, subplots

    fig, ax = subplots(figsize=(7, 4))
    for ctx in sorted({r["ctx"] for r in payload["kernels"]}):
        rows = [r for r in payload["kernels"] if r["ctx"] == ctx]
        line, = ax.plot([r["q_len"] for r in rows], [r["speedup"] for r in rows], marker="o",
                        label=f"context {ctx:,}")
        staged = [r for r in rows if r["rule_stages"]]
        ax.scatter([r["q_len"] for r in staged], [r["speedup"] for r in staged], s=90, facecolors="none",
                   edgecolors=line.get_color())
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("queries in the chunk (circled: the rule stages it)")
    ax.set_ylabel("in place ms / staged ms")
    ax.legend(fontsize=8)
    save(fig, path, name, payload["environment"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="staged_prefill")
    parser.add_argument("--presets", nargs="*", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not tk.stages_paged_contexts(D, torch.bfloat16, torch.device("cuda"), 16):
        parser.error("the contexts are staged only on a CUDA GPU with TMA loads (Hopper or later)")
    payload = {"environment": environment(), "prompt": args.prompt, "kernels": kernel_rows(),
               "ttft": ttft_rows(args.presets, args.prompt, args.rounds)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(payload, args.name))
    chart(payload, args.out / f"{args.name}.png", args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
