"""``python benchmarks/xattn_prefill.py``: XAttention's prefill speed on the llama-3.1-8b preset, next to dense
in the same run.

Jobs, each in its own process (one engine's GPU memory never shrinks the next one's KV cache):

- ``kernel``: one layer's prefill attention of one prompt on llama-3.1-8b shapes (32 query heads, 8 KV
  heads, head size 128, bfloat16, KV blocks of 16): the dense Triton prefill (a fresh prompt's contiguous
  keys, and the paged kernel behind a 64-token history, which reads the cache as the sparse kernel does),
  the estimate and the selection as a share of dense, and the block-sparse kernel over selections at set
  densities (``ratio``: each row's best blocks by the estimate) and at ``threshold=0.9``.
- ``ttft``: the engine end to end: time to the first token of one prompt, ``full`` against XAttention at
  a fixed 20% density (``ratio=0.2``) and at ``threshold=0.9``, KV on the GPU.

Random weights give near-uniform attention, so ``threshold=0.9`` keeps almost every block there: its
density says nothing of a real model's (that is what ``benchmarks/xattn_quality.py`` measures). The ratio
rows measure what the kernel and the engine gain at a given density.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _jobs import job_main, jobs_of_kinds, run_jobs
from _prefill import bench_ttft, dense_prefill_ms, density_chart, kernel_ms, paged_prompt, ttft_table, with_ratios
from nanovllm.bench import markdown_row

PRESET = "llama-3.1-8b"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def bench_kernel(contexts: list[int], densities: list[float], stride: int) -> list[dict[str, Any]]:
    import torch

    from nanovllm_xattn.attention import block_sparse_attention
    from nanovllm_xattn.config import XAttentionConfig
    from nanovllm_xattn.estimate import block_scores
    from nanovllm_xattn.selection import block_lists, causal_density, select_blocks

    cfg, scale, rows, dev = XAttentionConfig(stride=stride), HEAD_DIM**-0.5, [], "cuda"
    block = cfg.block_size
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in contexts:
        p = paged_prompt(n, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, gen, dev)
        q, k_cache, v_cache, tables = p.q, p.k_cache, p.v_cache, p.tables
        cu, lens = p.cu_seqlens_q, p.context_lens
        dense = dense_prefill_ms(p, scale)
        dense_ms, paged_ms = dense["dense_ms"], dense["dense_paged_ms"]
        thresholds = torch.full((HEADS,), cfg.threshold, device=dev)

        def scores():
            return block_scores(q, k_cache, tables, cu, lens, scale, cfg.stride, block, n, n)

        def select(s, ratio=None):
            return select_blocks(s, cu, lens, block, KV_HEADS, cfg.head_reduce, thresholds, ratio)

        estimate_ms = kernel_ms(scores)
        s = scores()
        select_ms = kernel_ms(lambda: block_lists(select(s)))
        base = {"benchmark": "kernel", "context": n, "stride": cfg.stride, "block_size": block, **dense,
                "estimate_ms": estimate_ms, "select_ms": select_ms,
                "estimate_share": estimate_ms / dense_ms, "select_share": select_ms / dense_ms}
        for ratio in [*densities, None]:
            mask = select(s, ratio)
            blocks, counts = block_lists(mask)
            sparse_ms = kernel_ms(lambda blocks=blocks, counts=counts: block_sparse_attention(
                q, k_cache, v_cache, tables, cu, lens, blocks, counts, block, scale, n))
            rows.append({**base, "selection": f"ratio={ratio}" if ratio else f"threshold={cfg.threshold}",
                         "density": causal_density(mask, cu, lens, block), "sparse_ms": sparse_ms,
                         "ratio": sparse_ms / dense_ms, "ratio_paged": sparse_ms / paged_ms})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del p, q, k_cache, v_cache, s
        torch.cuda.empty_cache()
    return rows


TTFT_POLICIES = ("full", "xattn:ratio=0.2,dense_below=0", "xattn:threshold=0.9,dense_below=0")


def jobs(contexts: list[int], ttft_contexts: list[int], densities: list[float], stride: int,
         ttft_rounds: int = 1) -> list[dict]:
    out: list[dict] = [{"kind": "kernel", "contexts": contexts, "densities": densities, "stride": stride}]
    for context in ttft_contexts:
        out += [{"kind": "ttft", "context": context, "policy": p, "rounds": ttft_rounds}
                for p in TTFT_POLICIES]
    return out


def run_job(job: dict) -> list[dict[str, Any]]:
    if job["kind"] == "kernel":
        return bench_kernel(job["contexts"], job["densities"], job["stride"])
    return bench_ttft(PRESET, job["context"], job["policy"], job["rounds"])


# -- results ---------------------------------------------------------------------------------------------------


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Preset {PRESET} shapes (random weights), KV blocks of {BLOCK_SIZE}, bfloat16.", "",
             "## Prefill attention of one prompt, one layer (ms)", "",
             "Density: kept blocks over causal blocks. Dense Triton reads a fresh prompt's contiguous keys; "
             "dense paged is the same kernel through the block table, as the sparse kernel reads.", "",
             "| context | stride | selection | density | dense Triton | dense paged | sparse | sparse / dense | "
             "sparse / paged | estimate | estimate / dense | selection / dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r["benchmark"] == "kernel" and "ratio" in r:
            cells = [r["context"], r["stride"], r["selection"], f"{r['density']:.3f}", f"{r['dense_ms']:.2f}",
                     f"{r['dense_paged_ms']:.2f}", f"{r['sparse_ms']:.2f}", f"{r['ratio']:.3f}",
                     f"{r['ratio_paged']:.3f}", f"{r['estimate_ms']:.2f}",
                     f"{r['estimate_share']:.3f}", f"{r['select_share']:.3f}"]
            lines.append(markdown_row(cells))
    lines += ttft_table(payload["results"], "Time to first token, one prompt, KV on the GPU")
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> None:
    density_chart(payload, path, "xattn_prefill", "block density", "block-sparse / dense Triton kernel time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/xattn_prefill.py", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.1, 0.2, 0.4])
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--ttft-contexts", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--ttft-rounds", type=int, default=1,
                        help="prompts timed one after another per ttft job; TTFT is their median")
    parser.add_argument("--only", nargs="+", default=None, help="job kinds to run (kernel, ttft)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="xattn_prefill")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    all_jobs = jobs(args.contexts, args.ttft_contexts, args.densities, args.stride, args.ttft_rounds)
    return run_jobs(jobs_of_kinds(all_jobs, args.only), __file__, Path(args.out), args.name,
                    vars(args) | {"job": None}, with_ratios, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
