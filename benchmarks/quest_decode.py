"""``python benchmarks/quest_decode.py``: Quest's decode speed on the llama-3.1-8b preset, next to dense in the
same run.

Jobs, each in its own process (one engine's GPU memory never shrinks the next one's KV cache):

- ``attention``: decode attention per layer on llama-3.1-8b shapes (32 query heads, 8 KV heads, head
  size 128, bfloat16, blocks of 16): the dense Triton decode kernel against Quest's three steps (scoring,
  top-K, attention over the selected blocks per KV head), at each context, batch and budget. Layers with
  their own KV are captured one after another in one CUDA graph, as in the engine's decode graph, and the
  replay time is divided by their number; L2 is cold at each replay. A one-layer graph is timed too: its
  replay adds the graph's own launch to every layer. Each Quest page size (``--page-sizes``),
  metadata dtype (``auto`` laid out as the policy does on this GPU) and bound size of a page of one block
  (``--bound-sizes``) is timed on the same caches, and each ``--rescores`` factor at pages of one block
  (the bound's nominees ranked again by their keys). The ceiling is ``1 / (1 / page_size + budget /
  context)``, the ratio of the bytes read.
- ``decode``: the engine end to end, KV on the GPU, CUDA graphs: ``steps`` decode steps after prefilling
  ``batch`` prompts of ``context`` tokens (32K and 128K at batch 1, 32K at batch 8, those of ``--contexts``
  and ``--batches``), with ``full`` and with Quest (also at each other page size, metadata dtype, bound
  size and rescore factor asked for).
- ``offload``: the same with the KV cache in pinned host memory (the ``skip_layers`` resident on the GPU),
  with the offload engine's selection cache and without it; with the host-to-device copy rate of the same
  run, the floors of the bytes each Quest step selects and of those it moves (the selection cache loads only
  the selected head blocks it lacks). Each of these policies also runs with its KV on the GPU: the offload's
  own time is the difference.
- ``reuse`` (only when asked for: ``--only reuse``; it needs the built-in model's weights): how much of
  Quest's decode selections the selection cache reuses on the real SmolLM2 (8K context) in the engine with
  offload: a natural English text found on this machine (``REUSE_PROMPT_TOKENS`` tokens), then
  ``REUSE_STEPS`` greedy decode steps, at each of ``--budgets``. That share is a property of the model's
  attention, which random weights do not have; it says how many of the selected bytes a real model still
  moves.

Random weights give near-uniform attention: that changes what Quest selects, never what it costs. Quality
is measured on a real model with ``nanovllm bench quality``.

Engine decode of 8 sequences of 32K tokens, ``full`` against Quest::

    python benchmarks/quest_decode.py --only decode --contexts 32768 --batches 8 --decode-steps 32
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from _jobs import job_main, jobs_of_kinds, run_jobs
from _plot import save, subplots
from nanovllm.bench import markdown_row

PRESET = "llama-3.1-8b"
REUSE_PROMPT_TOKENS, REUSE_STEPS = 7600, 96  # SmolLM2's 8,192 positions hold both
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


# -- attention kernels ----------------------------------------------------------------------------------


def bench_attention(contexts: list[int], batches: list[int], budgets: list[int], page_sizes: list[int],
                    metadata_dtypes: list[str] = ("auto",), bound_sizes: list[int] = (),
                    rescores: list[int] = ()) -> list[dict[str, Any]]:
    import torch
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.triton_backend import TritonBackend
    from nanovllm.bench.kernels import graph_ms

    backend, scale, rows = TritonBackend(), HEAD_DIM**-0.5, []
    variants = metadata_variants(page_sizes, metadata_dtypes, bound_sizes, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for context in contexts:
        for batch in batches:
            width = context // BLOCK_SIZE
            num_blocks = batch * width
            shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
            layers = []
            for _ in range(layers_in_graph(context, batch)):
                k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
                v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
                tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, width).int()
                metadata = {key: page_metadata(k_cache, tables, *key) for key in variants}
                lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                meta = PhaseMetadata(torch.arange(batch + 1, dtype=torch.int32, device="cuda"), lens, tables, 1,
                                     context)
                q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
                layers.append(Layer(q, k_cache, v_cache, metadata, meta))

            def dense(x):
                return backend.decode(x.q, x.k_cache, x.v_cache, x.meta, scale)

            dense_ms = graph_ms([partial(dense, x) for x in layers])
            dense_one_ms = graph_ms([partial(dense, layers[0])])
            for key in variants:
                for rescore in [1, *(r for r in rescores if r > 1 and key[0] == BLOCK_SIZE)]:
                    for budget in budgets:
                        rows.append(bench_quest(layers, backend, scale, context, batch, budget, key, dense_ms,
                                                dense_one_ms, rescore))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del layers
            torch.cuda.empty_cache()
    return rows


def metadata_variants(page_sizes: list[int], metadata_dtypes: list[str], bound_sizes: list[int],
                      device: torch.device) -> list[tuple[int, str, int]]:
    """``(page, "kv" | "fp8", bound size)`` of each configuration as the policy lays it out on ``device``
    (``bound_layout``): the page's default bound, and each of ``bound_sizes`` that divides a page of one
    block; ``auto`` resolves as the policy's, float8 halves where float8 is available."""
    from nanovllm_quest.config import QuestConfig
    from nanovllm_quest.policy import bound_layout

    variants: dict[tuple[int, str, int], None] = {}
    for page in page_sizes:
        bounds = [None, *(b for b in sorted(bound_sizes) if page == BLOCK_SIZE and page % b == 0)]
        for kind in metadata_dtypes:
            for bound in bounds:
                # the layout does not depend on the budget; any of at least a page passes its check
                config = QuestConfig(token_budget=page, page_size=page, metadata_dtype=kind, bound_size=bound)
                layout = bound_layout(config, BLOCK_SIZE, device)
                variants[(page, "fp8" if layout.float8 else "kv", layout.bound_size)] = None
    return list(variants)


def bench_quest(layers: list, backend, scale: float, context: int, batch: int, budget: int,
                metadata_key: tuple[int, str, int], dense_ms: float, dense_one_ms: float, rescore: int = 1
                ) -> dict[str, Any]:
    """One row: Quest's steps at one budget, page size, metadata dtype, bound size and rescore factor over
    the layers' caches, against their dense time (scoring, then the selection: top-K, or with rescore the
    nominees' top-K, their rescoring and the pick; then the attention over the selection)."""
    from nanovllm.bench.kernels import graph_ms

    from nanovllm_quest import kernels
    from nanovllm_quest.policy import rescore_selection

    page, kind, bound = metadata_key
    k = budget // page

    def score(x):
        return kernels.page_scores(x.q, x.metadata[metadata_key], x.meta.block_tables, x.meta.context_lens,
                                   BLOCK_SIZE, page)

    def top(x, scores):
        if rescore == 1:
            return kernels.top_pages(scores, k, x.meta.context_lens, BLOCK_SIZE, page)
        return rescore_selection(kernels, x.q, x.k_cache, x.meta.block_tables, x.meta.context_lens, scores, k,
                                 rescore)

    def attend(x, sel):
        return backend.attend_blocks(x.q, x.k_cache, x.v_cache, x.meta, sel, x.meta.context_lens, scale)

    def quest(x):
        return attend(x, top(x, score(x)))

    scores = [score(x) for x in layers]
    selections = [top(x, s) for x, s in zip(layers, scores, strict=True)]
    quest_ms = graph_ms([partial(quest, x) for x in layers])
    row = {
        "benchmark": "attention", "context": context, "batch": batch, "budget": budget, "page_size": page,
        "metadata_dtype": kind, "bound_size": bound, "rescore": rescore,
        "layers_in_graph": len(layers),
        "dense_us": 1000 * dense_ms, "quest_us": 1000 * quest_ms,
        "score_us": 1000 * graph_ms([partial(score, x) for x in layers]),
        "topk_us": 1000 * graph_ms([partial(top, x, s) for x, s in zip(layers, scores, strict=True)]),
        "attend_us": 1000 * graph_ms([partial(attend, x, sel) for x, sel in zip(layers, selections, strict=True)]),
        "dense_one_layer_us": 1000 * dense_one_ms,
        "quest_one_layer_us": 1000 * graph_ms([partial(quest, layers[0])]),
        "speedup": dense_ms / quest_ms,
        "ceiling": 1 / (1 / page + budget / context),
    }
    row["speedup_one_layer"] = row["dense_one_layer_us"] / row["quest_one_layer_us"]
    return row


def page_metadata(k_cache, tables, page: int, metadata_dtype: str = "kv", bound: int | None = None):
    """Quest's metadata of a cache whose sequences fill their block tables, as the policy keeps it: each
    page's min/max at its anchor (the physical block of its first logical block), ``[blocks, KV heads, 2,
    D]``; bounds of ``bound`` tokens below a page of one block, ``[blocks, KV heads, 2 * bounds, D]``;
    ``fp8``: rounded outward to float8."""
    import torch

    from nanovllm_quest import reference

    if bound is not None and bound < page:  # pages of one block: every block is an anchor
        sub = k_cache.unflatten(1, (page // bound, bound))  # [blocks, bounds, bound, KV heads, D]
        metadata = torch.stack([sub.amin(2), sub.amax(2)], dim=3).transpose(1, 2).flatten(2, 3)
    else:
        per_page = page // BLOCK_SIZE
        bounds = torch.stack([k_cache.amin(1), k_cache.amax(1)], dim=2)  # per block: [blocks, KV heads, 2, D]
        logical = bounds[tables.long()]  # [batch, width, KV heads, 2, D]
        logical = logical.view(tables.shape[0], -1, per_page, *logical.shape[2:])
        pages = torch.stack([logical[..., 0, :].amin(2), logical[..., 1, :].amax(2)], dim=-2)
        metadata = torch.empty_like(bounds)
        metadata[tables[:, ::per_page].long()] = pages
    if metadata_dtype == "fp8":
        low = reference.round_fp8(metadata[:, :, reference.MIN::2].float(), up=False)
        high = reference.round_fp8(metadata[:, :, reference.MAX::2].float(), up=True)
        return torch.stack([low, high], dim=3).flatten(2, 3)
    return metadata


class Layer(NamedTuple):
    q: Any
    k_cache: Any
    v_cache: Any
    metadata: Any
    meta: Any


def layers_in_graph(context: int, batch: int) -> int:
    """Layers of distinct KV captured in one graph, as in the engine's decode graph (the graph's launch
    is paid once, and no layer's reads are in L2 for the next); about 16 GiB of KV at most."""
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    return max(1, min(8, (16 << 30) // kv_bytes))


# -- the engine ---------------------------------------------------------------------------------------------


def bench_engine(
    kind: str, context: int, batch: int, policy: str, steps: int, **options: Any
) -> list[dict[str, Any]]:
    from nanovllm.bench import offload as b5

    row = b5.bench_decode(PRESET, context, batch, steps, kind == "offload", sparse_policy=policy, **options)
    return [{**row, "benchmark": kind, "policy": policy, "options": options}]


def jobs(contexts: list[int], batches: list[int], budgets: list[int], budget: int, steps: int,
         page_sizes: list[int] = (16,), metadata_dtypes: list[str] = ("auto",),
         bound_sizes: list[int] = (), rescores: list[int] = (), quest_options: str = "") -> list[dict]:
    quest = f"quest:token_budget={budget}" + (f",{quest_options}" if quest_options else "")
    # the engine at larger pages, other metadata dtypes and smaller bounds too
    variants = [f"{quest},page_size={p}" for p in page_sizes if p != BLOCK_SIZE]
    variants += [f"{quest},metadata_dtype={kind}" for kind in metadata_dtypes if kind != "auto"]
    variants += [f"{quest},bound_size={b}" + ("" if kind == "auto" else f",metadata_dtype={kind}")
                 for b in bound_sizes if b < BLOCK_SIZE for kind in metadata_dtypes]
    variants += [f"{quest},rescore={r}" for r in rescores if r > 1]
    out: list[dict] = [{"kind": "attention", "contexts": contexts, "batches": batches, "budgets": budgets,
                        "page_sizes": list(page_sizes), "metadata_dtypes": list(metadata_dtypes),
                        "bound_sizes": list(bound_sizes), "rescores": list(rescores)}]
    cold = {"kv_offloading_reuse_selections": False}
    offloaded = (("full", 3, {}), (quest, steps, {}), (quest, steps, cold), (quest + ",skip_layers=0", steps, {}))
    for context, batch in [(32768, 1), (131072, 1), (32768, 8)]:
        if context in contexts and batch in batches:
            out += [{"kind": "decode", "context": context, "batch": batch, "policy": p, "steps": steps}
                    for p in ("full", quest, *variants)]
    out.append({"kind": "offload-copy"})
    # each offloaded policy also with its KV on the GPU: the offload's own time is the difference
    out += [{"kind": "offload-resident", "context": 131072, "batch": 1, "policy": p, "steps": steps}
            for p in dict.fromkeys(p for p, _, _ in offloaded)]
    out += [{"kind": "offload", "context": 131072, "batch": 1, "policy": p, "steps": s, "options": o}
            for p, s, o in offloaded]
    return out


def bench_reuse(budgets: list[int]) -> list[dict[str, Any]]:
    """The ``reuse`` job: per budget, the selected head blocks the offload engine's cache loaded and reused
    over ``REUSE_STEPS`` decode steps after a ``REUSE_PROMPT_TOKENS``-token natural text, on SmolLM2."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.quality.corpus import corpus_tokens

    rows = []
    for budget in budgets:
        # a pool of 4 GiB, so that the load slots (capped at the pool's size) hold a 2,048-token selection of
        # every offloaded layer in float32
        llm = LLM("default", max_model_len=8192, kv_offloading_size=4.0, sparse_policy=f"quest:token_budget={budget}")
        ids, text = corpus_tokens(llm.get_tokenizer(), REUSE_PROMPT_TOKENS)
        prompt = [{"prompt_token_ids": ids}]
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the prompt's KV
        counts = llm.runner.kv.engine.cache_counts  # the host store's offload engine
        before = counts.tolist()
        params = SamplingParams(temperature=0, max_tokens=REUSE_STEPS + 1, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)  # a prefix-cache hit, then the decode steps
        loaded, reused = (now - then for now, then in zip(counts.tolist(), before, strict=True))
        if loaded + reused == 0:
            raise RuntimeError(f"at budget {budget} the selections did not fit the load slots: no decode step "
                               "went through the selection cache")
        rows.append({"benchmark": "reuse", "budget": budget, "text": text.name, "prompt_tokens": len(ids),
                     "decode_steps": REUSE_STEPS, "device": str(llm.runner.device), "dtype": str(llm.runner.dtype),
                     "loaded_head_blocks": loaded, "reused_head_blocks": reused,
                     "reused_share": reused / (loaded + reused)})
        del llm
    return rows


def run_job(job: dict) -> list[dict[str, Any]]:
    if job["kind"] == "reuse":
        return bench_reuse(job["budgets"])
    if job["kind"] == "attention":
        return bench_attention(job["contexts"], job["batches"], job["budgets"], job.get("page_sizes", [BLOCK_SIZE]),
                               job.get("metadata_dtypes", ["auto"]), job.get("bound_sizes", []),
                               job.get("rescores", []))
    if job["kind"] == "offload-copy":
        from nanovllm.bench import offload as b5

        return [b5.bench_copy()]
    return bench_engine(job["kind"], job["context"], job["batch"], job["policy"], job["steps"],
                        **job.get("options", {}))


# -- results ---------------------------------------------------------------------------------------------------


def with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Quest's rows against the dense row of the same kind, context and batch; offload rows against the floor
    of the bytes they move, as a whole step and as the offload's own time (the step over the same policy's
    step with the KV on the GPU, in the same run)."""
    copy = next((r for r in results if r.get("benchmark") == "offload-copy" and "h2d_gbs" in r), None)
    out = []
    for r in results:
        r = dict(r)
        if "decode_ms_per_step" in r and r.get("policy", "full") != "full":
            dense = next((d for d in results if d.get("policy") == "full" and "decode_ms_per_step" in d
                          and (d["benchmark"], d["context"], d["batch"]) == (r["benchmark"], r["context"], r["batch"])),
                         None)
            if dense is not None:
                r["speedup"] = dense["decode_ms_per_step"] / r["decode_ms_per_step"]
            if r["benchmark"] == "offload" and copy is not None:
                r["selected_bytes_per_step"] = quest_offload_bytes(r)
                r["selected_floor_ms"] = r["selected_bytes_per_step"] / copy["h2d_gbs"] / 1e6
                r["vs_selected_floor"] = r["decode_ms_per_step"] / r["selected_floor_ms"]
                loaded, reused = r.get("cache_loaded_head_blocks_per_step", 0), r.get("cache_reused_head_blocks_per_step", 0)
                if loaded + reused:  # through the selection cache: only its loads cross PCIe
                    r["reused_share"] = reused / (loaded + reused)
                    r["h2d_bytes_per_step"] = loaded * head_block_bytes(r)
                else:
                    r["h2d_bytes_per_step"] = r["selected_bytes_per_step"]
                r["floor_ms"] = r["h2d_bytes_per_step"] / copy["h2d_gbs"] / 1e6
                r["vs_floor"] = r["decode_ms_per_step"] / r["floor_ms"]
        elif r["benchmark"] == "offload" and copy is not None and "kv_tokens_per_step" in r:
            r["floor_ms"] = r["kv_tokens_per_step"] * r["kv_bytes_per_token"] / copy["h2d_gbs"] / 1e6
            r["vs_floor"] = r["decode_ms_per_step"] / r["floor_ms"]
        if r["benchmark"] == "offload" and "floor_ms" in r:
            r |= offload_own_time(r, results)
        out.append(r)
    return out


def offload_own_time(row: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, float]:
    """An offload row's step less its policy's step with the KV on the GPU (the ``offload-resident`` row of
    the same context and batch), against the floor of the bytes it moves; nothing without that row."""
    key = ("offload-resident", row["policy"], row["context"], row["batch"])
    resident = next((d for d in results if "decode_ms_per_step" in d
                     and (d["benchmark"], d.get("policy"), d.get("context"), d.get("batch")) == key), None)
    if resident is None:
        return {}
    own = row["decode_ms_per_step"] - resident["decode_ms_per_step"]
    return {"resident_ms_per_step": resident["decode_ms_per_step"], "offload_ms_per_step": own,
            "offload_vs_floor": own / row["floor_ms"]}


def head_block_bytes(row: dict[str, Any]) -> float:
    """K and V of one KV head of one block of one layer."""
    return row["kv_bytes_per_token"] / 32 / KV_HEADS * BLOCK_SIZE  # llama-3.1-8b: 32 layers


def quest_offload_bytes(row: dict[str, Any]) -> float:
    """Host-to-device bytes of one Quest step: the sparse layers read ``token_budget`` tokens per KV head;
    the dense (``skip_layers``) layers' KV is resident on the GPU and does not cross PCIe."""
    options = dict(kv.split("=") for kv in row["policy"].partition(":")[2].split(",") if kv)
    skip = int(options.get("skip_layers", 2))
    budget = int(options["token_budget"])
    layers = 32  # llama-3.1-8b
    per_layer_token = row["kv_bytes_per_token"] / layers
    tokens = row["kv_tokens_per_step"]
    return per_layer_token * (layers - skip) * min(budget, tokens) * row["batch"]


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Preset {PRESET} (random weights), blocks of {BLOCK_SIZE}, bfloat16.", "",
             "## Decode attention per layer (us; layers in one CUDA graph, cold L2)", "",
             "Columns `one layer`: a graph of one layer, whose replay adds the graph launch to the layer.", "",
             "Page label `r`: the factor of `rescore`; its top-K column is the whole selection (the "
             "nominees' top-K, their rescoring by their keys and the pick among them).", "",
             "| context | batch | budget | page | layers | dense | Quest | score | top-K | attend | "
             "speedup | ceiling | dense, one layer | Quest, one layer | speedup, one layer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r["benchmark"] == "attention":
            page = page_label(r)
            cells = [r["context"], r["batch"], r["budget"], page, r["layers_in_graph"],
                     f"{r['dense_us']:.1f}", f"{r['quest_us']:.1f}", f"{r['score_us']:.1f}", f"{r['topk_us']:.1f}",
                     f"{r['attend_us']:.1f}", f"{r['speedup']:.2f}x", f"{r['ceiling']:.1f}x", f"{r['dense_one_layer_us']:.1f}",
                     f"{r['quest_one_layer_us']:.1f}", f"{r['speedup_one_layer']:.2f}x"]
            lines.append(markdown_row(cells))
    lines += ["", "## Decode in the engine (ms per step)", "",
              "| KV | context | batch | policy | ms/step | speedup vs full | floor ms | vs floor |",
              "|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r["benchmark"] in ("decode", "offload"):
            if "error" in r or "skipped" in r:
                lines.append(f"| {r['benchmark']} | {r['context']} | {r['batch']} | {r['policy']} | "
                             f"{r.get('error') or r.get('skipped')} | | | |")
                continue
            policy = r["policy"] + "".join(f", {k}={v}" for k, v in r.get("options", {}).items())
            cells = ["GPU" if r["benchmark"] == "decode" else "host pool", r["context"], r["batch"], policy,
                     f"{r['decode_ms_per_step']:.2f}", f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                     f"{r['floor_ms']:.2f}" if "floor_ms" in r else "",
                     f"{r['vs_floor']:.2f}" if "vs_floor" in r else ""]
            lines.append(markdown_row(cells))
    reuse = [r for r in payload["results"] if r["benchmark"] == "reuse"]
    if reuse:
        lines += ["", "## Selected head blocks the selection cache reuses (SmolLM2, KV offloaded)", "",
                  "| budget | text | prompt tokens | decode steps | device, dtype | loaded | reused | reused share |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['budgets']} | {r['error']} | | | | | | |" if "error" in r else
                  f"| {r['budget']} | {r['text']} | {r['prompt_tokens']} | {r['decode_steps']} | {r['device']}, "
                  f"{r['dtype']} | {r['loaded_head_blocks']} | {r['reused_head_blocks']} | {r['reused_share']:.3f} |"
                  for r in reuse]
    offload = [r for r in payload["results"] if "selected_floor_ms" in r]
    if offload:
        lines += ["", "## Quest under offload: the bytes selected and the bytes moved", "",
                  "The selection cache loads only the selected head blocks its layer's region lacks; the floors "
                  "are the PCIe time of the selected bytes and of the moved bytes at this run's copy rate.", "",
                  "| policy | selection cache | reused | MB selected | MB moved | ms/step | selected floor | vs it | "
                  "moved floor | vs it |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in offload:
            reused = f"{r['reused_share']:.3f}" if "reused_share" in r else "-"
            cells = [r["policy"], selection_cache(r), reused,
                     f"{r['selected_bytes_per_step'] / 1e6:.1f}", f"{r['h2d_bytes_per_step'] / 1e6:.1f}",
                     f"{r['decode_ms_per_step']:.2f}", f"{r['selected_floor_ms']:.2f}", f"{r['vs_selected_floor']:.2f}",
                     f"{r['floor_ms']:.2f}", f"{r['vs_floor']:.2f}"]
            lines.append(markdown_row(cells))
    own = [r for r in payload["results"] if "offload_ms_per_step" in r]
    if own:
        lines += ["", "## The offload's own time", "",
                  "A step with the KV in the host pool, less the same policy's step with the KV on the GPU "
                  "in this run: the time the offload adds, against the floor of the bytes it moves.", "",
                  "| policy | selection cache | ms/step | KV on the GPU | offload's own | moved floor | "
                  "vs it |",
                  "|---|---|---|---|---|---|---|"]
        times = ("decode_ms_per_step", "resident_ms_per_step", "offload_ms_per_step", "floor_ms",
                 "offload_vs_floor")
        for r in own:
            cells = [r["policy"], selection_cache(r), *(f"{r[key]:.2f}" for key in times)]
            lines.append(markdown_row(cells))
    copy = next((r for r in payload["results"] if r["benchmark"] == "offload-copy"), None)
    if copy and "h2d_gbs" in copy:
        lines += ["", f"Pinned host-to-device copy rate of this run: {copy['h2d_gbs']:.1f} GB/s (the floors' rate)."]
    return "\n".join(lines) + "\n"


def selection_cache(row: dict[str, Any]) -> str:
    """Whether an offload row's decode used the selection cache ('-' for dense: it selects nothing)."""
    if row["policy"] == "full":
        return "-"
    return "on" if row.get("options", {}).get("kv_offloading_reuse_selections", True) else "off"


def page_label(row: dict[str, Any]) -> str:
    """``16``, ``16 fp8``, ``16/8`` (pages of 16 scored by bounds of 8 tokens), ``16/8 fp8 r4`` (the bound's
    4 x budget best pages rescored by their keys)."""
    page = row.get("page_size", BLOCK_SIZE)
    bound = row.get("bound_size", page)
    fp8 = " fp8" if row.get("metadata_dtype") == "fp8" else ""
    rescore = f" r{row['rescore']}" if row.get("rescore", 1) > 1 else ""
    return f"{page}" + (f"/{bound}" if bound != page else "") + fp8 + rescore


def chart(payload: dict[str, Any], path: Path) -> None:
    att = [r for r in payload["results"] if r["benchmark"] == "attention"]
    eng = [r for r in payload["results"] if "speedup" in r and r["benchmark"] != "attention"]
    # an engine-only run gets no attention panel
    fig, axes = subplots(2 if att else 1, 1, figsize=(10, 7 if att else 3.8), squeeze=False)
    axes = list(axes[:, 0])
    if att:
        labels = [f"{r['context'] // 1024}K x{r['batch']} b{r['budget']} p{page_label(r)}" for r in att]
        axes[0].barh(labels, [r["speedup"] for r in att], color="tab:blue", label="Quest / dense")
        axes[0].scatter([r["ceiling"] for r in att], labels, color="black", marker="|", s=200,
                        label="ceiling")
        axes[0].set_title("decode attention speedup over dense (per layer, layers in one graph)",
                          fontsize=10)
        axes[0].legend(fontsize=8)
    bottom = axes[-1]
    labels = [f"{r['benchmark']} {r['context'] // 1024}K x{r['batch']}\n{r['policy']}"
              + ("".join(f",{k}={v}" for k, v in r.get("options", {}).items())) for r in eng]
    bottom.barh(labels, [r["speedup"] for r in eng], color="tab:green")
    bottom.set_title("end-to-end decode speedup over full", fontsize=10)
    for ax in axes:
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
    save(fig, path, "quest_decode", payload["environment"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/quest_decode.py", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--budgets", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--page-sizes", nargs="+", type=int, default=[BLOCK_SIZE],
                        help="Quest page sizes (multiples of the block size, 16) of the attention job, and "
                        "of the decode job's Quest rows besides the default page")
    parser.add_argument("--metadata-dtypes", nargs="+", default=["auto"], choices=["auto", "kv", "fp8"],
                        help="Quest metadata dtypes of the attention job (at each page size; auto: what the "
                        "policy picks on this GPU), and of the decode job's Quest rows besides the default")
    parser.add_argument("--bound-sizes", nargs="+", type=int, default=[],
                        help="Quest bound sizes (divisors of the block size, 16) of the "
                        "attention job at pages of one block, and of the decode job's Quest rows (at each "
                        "metadata dtype)")
    parser.add_argument("--rescores", nargs="+", type=int, default=[],
                        help="Quest rescore factors above 1 of the attention job at pages of one block, and "
                        "of the decode job's Quest rows")
    parser.add_argument("--budget", type=int, default=2048, help="token budget of the engine runs")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--quest-options", default="",
                        help="more Quest options of the engine runs, e.g. 'group_reduction=max,rescore=1'")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks of the engine runs (decode, offload), one GPU each")
    parser.add_argument("--only", nargs="+", default=None,
                        help="job kinds to run (attention, decode, offload; default: these three; reuse only "
                        "when named)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="quest_decode")
    args = parser.parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    chosen = jobs_of_kinds(jobs(args.contexts, args.batches, args.budgets, args.budget, args.decode_steps,
                           args.page_sizes, args.metadata_dtypes, args.bound_sizes, args.rescores,
                                args.quest_options), args.only)
    if args.only and "reuse" in args.only:
        chosen.append({"kind": "reuse", "budgets": args.budgets})
    if args.tensor_parallel_size > 1:  # the engine runs; the attention job times one GPU's kernels
        for job in chosen:
            if job["kind"] in ("decode", "offload", "offload-resident"):
                job["options"] = {**job.get("options", {}), "tensor_parallel_size": args.tensor_parallel_size}
    return run_jobs(chosen, __file__, Path(args.out), args.name, vars(args) | {"job": None},
                    with_ratios, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
