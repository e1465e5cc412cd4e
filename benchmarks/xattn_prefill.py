"""``python benchmarks/xattn_prefill.py``: XAttention's prefill speed on the llama-3.1-8b preset, next to dense
in the same run.

Jobs, each in its own process (one engine's GPU memory never shrinks the next one's KV cache):

- ``kernel``: one layer's prefill attention of one prompt on llama-3.1-8b shapes (32 query heads, 8 KV
  heads, head size 128, bfloat16): the dense Triton prefill (a fresh prompt's contiguous keys, and the
  paged kernel behind a 64-token history, which reads the cache as the sparse kernel does), the estimate
  and the selection as a share of dense, and the block-sparse kernel over selections at set densities
  (``ratio``: each row's best blocks by the estimate) and at ``threshold=0.9`` (unless ``--fixed-only``).
  For each KV block size of ``--block-sizes`` (16 by default) the dense paged kernel and the sparse kernel
  read a cache of that block size; ``--configs`` names the sparse kernel's configurations to time
  (``CONFIGS``).
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
from _prefill import (bench_ttft, dense_prefill_ms, density_chart, kernel_ms, paged_prompt, staged_cache, ttft_table,
                     with_ratios)
from nanovllm.bench import markdown_row

PRESET = "llama-3.1-8b"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# kernel_configs' names, and ``staged``: ``default`` over the backend's staged pages of 128 tokens, the copy
# included (where the cache's pages are smaller)
CONFIGS = ("default", "old", "no-tma", "no-fused-scale", "staged")


def kernel_configs():
    """The block-sparse kernel's configurations by the names of ``CONFIGS``: ``default`` (the kernel's own
    rule), ``old`` (the same tiles, no fused scale, no TMA: the kernel before its knobs), and ``default``
    less one knob each."""
    import attrs
    import torch

    from nanovllm_xattn.attention import attention_config

    best = attention_config(HEAD_DIM, torch.bfloat16, torch.device("cuda"), 128)
    return {"default": best, "old": attrs.evolve(best, fused_scale=False, tma=False),
            "no-tma": attrs.evolve(best, tma=False), "no-fused-scale": attrs.evolve(best, fused_scale=False)}


def bench_kernel(contexts: list[int], densities: list[float], stride: int,
                 block_sizes: list[int] = (BLOCK_SIZE,), configs: list[str] = ("default",),
                 fixed_only: bool = False) -> list[dict[str, Any]]:
    """The ``kernel`` job: per context, the dense kernel over contiguous keys once, the estimate and the
    selection, then per KV block size the dense paged kernel and the block-sparse kernel in each of
    ``configs`` (names of :func:`kernel_configs`) over the selections at ``densities`` and (unless
    ``fixed_only``) at the threshold."""
    import torch

    from nanovllm_xattn.attention import block_sparse_attention
    from nanovllm_xattn.config import XAttentionConfig
    from nanovllm_xattn.estimate import block_scores
    from nanovllm_xattn.selection import block_lists, causal_density, select_blocks

    cfg, scale, rows, dev = XAttentionConfig(stride=stride), HEAD_DIM**-0.5, [], "cuda"
    block = cfg.block_size
    named = kernel_configs()
    for n in contexts:
        contiguous = None
        for block_size in block_sizes:
            # the same q, k and v at every block size (the generator starts over); the pages' order differs
            gen = torch.Generator(device=dev).manual_seed(0)
            p = paged_prompt(n, HEADS, KV_HEADS, HEAD_DIM, block_size, gen, dev)
            q, k_cache, v_cache, tables = p.q, p.k_cache, p.v_cache, p.tables
            cu, lens = p.cu_seqlens_q, p.context_lens
            paged = dense_prefill_ms(p, scale, contiguous=contiguous is None)
            thresholds = torch.full((HEADS,), cfg.threshold, device=dev)
            stage = staged_cache(p)

            def scores():
                return block_scores(q, k_cache, tables, cu, lens, scale, cfg.stride, block, n, n)

            def select(s, ratio=None):
                return select_blocks(s, cu, lens, block, KV_HEADS, cfg.head_reduce, thresholds, ratio)

            if contiguous is None:
                contiguous = {"dense_ms": paged.pop("dense_ms")}
            dense_ms = contiguous["dense_ms"]
            estimate_ms = kernel_ms(scores)
            s = scores()
            select_ms = kernel_ms(lambda: block_lists(select(s)))
            base = {"benchmark": "kernel", "context": n, "stride": cfg.stride, "block_size": block,
                    "kv_block_size": block_size, **contiguous, **paged, "estimate_ms": estimate_ms,
                    "select_ms": select_ms, "estimate_share": estimate_ms / dense_ms,
                    "select_share": select_ms / dense_ms}
            for ratio in [*densities, *([] if fixed_only else [None])]:
                mask = select(s, ratio)
                blocks, counts = block_lists(mask)
                selection = f"ratio={ratio}" if ratio else f"threshold={cfg.threshold}"
                density = causal_density(mask, cu, lens, block)
                for config in configs:
                    if config == "staged" and stage is None:
                        continue

                    def sparse(blocks=blocks, counts=counts, config=config):
                        kv = stage() if config == "staged" else (k_cache, v_cache, tables)
                        return block_sparse_attention(q, *kv, cu, lens, blocks, counts, block, scale, n,
                                                      config=named.get(config))  # staged: the kernel's rule

                    sparse_ms = kernel_ms(sparse)
                    rows.append({**base, "selection": selection, "config": config, "density": density,
                                 "sparse_ms": sparse_ms, "ratio": sparse_ms / dense_ms,
                                 "ratio_paged": sparse_ms / paged["dense_paged_ms"]})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del p, q, k_cache, v_cache, s
            torch.cuda.empty_cache()
    return rows


TTFT_POLICIES = ("full", "xattn:ratio=0.2,dense_below=0", "xattn:threshold=0.9,dense_below=0")


def jobs(contexts: list[int], ttft_contexts: list[int], densities: list[float], stride: int,
         ttft_rounds: int = 1, block_sizes: list[int] = (BLOCK_SIZE,), configs: list[str] = ("default",),
         fixed_only: bool = False) -> list[dict]:
    out: list[dict] = [{"kind": "kernel", "contexts": contexts, "densities": densities, "stride": stride,
                        "block_sizes": list(block_sizes), "configs": list(configs), "fixed_only": fixed_only}]
    for context in ttft_contexts:
        out += [{"kind": "ttft", "context": context, "policy": p, "rounds": ttft_rounds}
                for p in TTFT_POLICIES]
    return out


def run_job(job: dict) -> list[dict[str, Any]]:
    if job["kind"] == "kernel":
        return bench_kernel(job["contexts"], job["densities"], job["stride"], job["block_sizes"], job["configs"],
                            job["fixed_only"])
    return bench_ttft(PRESET, job["context"], job["policy"], job["rounds"])


# -- results ---------------------------------------------------------------------------------------------------


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Preset {PRESET} shapes (random weights), bfloat16.", "",
             "## Prefill attention of one prompt, one layer (ms)", "",
             "Density: kept blocks over causal blocks. Dense Triton reads a fresh prompt's contiguous keys; "
             "dense paged is the same kernel through the block table of the row's KV block size, as the sparse "
             "kernel reads. Config: the sparse kernel's (`kernel_configs` in the script).", "",
             "| context | KV block | stride | selection | config | density | dense Triton | dense paged | sparse | "
             "sparse / dense | sparse / paged | estimate | estimate / dense | selection / dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r["benchmark"] == "kernel" and "ratio" in r:
            cells = [r["context"], r.get("kv_block_size", BLOCK_SIZE), r["stride"], r["selection"],
                     r.get("config", "default"), f"{r['density']:.3f}", f"{r['dense_ms']:.2f}",
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
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[BLOCK_SIZE],
                        help="KV cache block sizes of the kernel job (each with its dense paged time)")
    parser.add_argument("--configs", nargs="+", default=["default"], choices=CONFIGS,
                        help="block-sparse kernel configurations the kernel job times (kernel_configs)")
    parser.add_argument("--fixed-only", action="store_true",
                        help="the kernel job times the set densities only, not the threshold selection")
    parser.add_argument("--ttft-contexts", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--ttft-rounds", type=int, default=1,
                        help="prompts timed one after another per ttft job; TTFT is their median")
    parser.add_argument("--only", nargs="+", default=None, help="job kinds to run (kernel, ttft)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="xattn_prefill")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    all_jobs = jobs(args.contexts, args.ttft_contexts, args.densities, args.stride, args.ttft_rounds,
                    args.block_sizes, args.configs, args.fixed_only)
    return run_jobs(jobs_of_kinds(all_jobs, args.only), __file__, Path(args.out), args.name,
                    vars(args) | {"job": None}, with_ratios, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
