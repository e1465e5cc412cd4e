"""Our Triton attention kernels over a focused grid of their knobs, next to a device copy and cuDNN SDPA
measured in the same run, to choose the defaults in ``core/src/nanovllm/attention/triton_kernels.py``.

GQA 32 query / 8 KV heads, head dim 128, bf16, on one GPU:

- paged decode, batch 1 at 128K, 8 at 16K and 64 at 4K, pages of 16 and 128: TB/s of KV read (a CUDA graph
  of one call on each of four input sets, as the engine runs decode layer after layer) and its ratio to the
  copy (bytes read + written);
- B1's decode step (``nanovllm bench throughput``, nano-vLLM's bench.py workload, on qwen3-0.6b): its 256
  sequences at their prompt and 24 decoded tokens (contexts of 131-1048), GQA 16/8, split as its decode
  graphs split them (``max_keys`` its max_model_len), pages of 16 and 128; rated like the other decode shapes,
  over the bytes of KV it reads; in the workload's order and longest first (as the engine orders a step's
  decode rows);
- causal prefill over a 16K context, packed keys and through the paged cache (pages of 16 and 128; the whole
  prompt, and a 4K chunk behind 12K of history): TFLOP/s (4 * heads * head_dim * visible query-key pairs)
  and its ratio to cuDNN SDPA on the packed prompt of that context; with ``--long`` the packed 128K prompt.

Each knob setting (a :class:`DecodeConfig` / :class:`PrefillConfig`) differs from the default in one or
two knobs; its output is checked against the default's (decode, paged prefill) or cuDNN's (packed prefill),
and a setting off by more than 2e-2 is marked wrong and never best. The variants compile first in parallel
worker processes (Triton's disk cache then serves the timed process). After the main pass, each group's best
settings of two knob axes (decode: kernel and splits; prefill: tiles and structure) are timed together
against the default again. The run stops timing when ``--budget`` seconds have passed, keeping what it
measured. Writes ``OUT/NAME.json`` and ``OUT/NAME.md``: every row, the best setting per shape, and the
defaults to paste (one decode setting per page size, because the decode kernel's compiled knobs must not
follow the batch; prefill settings for packed and paged keys). ``--kinds``, ``--pages`` and ``--variants``
narrow the grid (the packed prompt stays with any prefill: its cuDNN rate anchors the paged rows; the default
setting stays with any variants: the others' ratios are to it); ``--b1``: B1's decode step alone, over the
settings worth trying at its batch (``B1_VARIANTS``, unless ``--variants`` names others).

    python benchmarks/kernel_sweep.py --out OUT [--name kernel_sweep] [--budget 80] [--long]
        [--kinds decode prefill] [--pages 16 128] [--variants "page ahead" ...] [--b1]
    TRITON_INTERPRET=1 python benchmarks/kernel_sweep.py --out OUT   # dry: tiny sizes on the CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from nanovllm.attention import triton_kernels as tk
from nanovllm.attention.triton_backend import _sdpa_causal
from nanovllm.bench import environment
from nanovllm.bench.engine import throughput_workload
from nanovllm.bench.kernels import (DEV, DRY, copy_bandwidth, decode_rotation, graph_ms, ms, paged_cache,
                                    paged_decode_inputs, randn, rel)

H, HKV, D = (4, 2, 32) if DRY else (32, 8, 128)
SCALE = D**-0.5
WRONG = 2e-2  # relative error against the reference beyond which a setting is wrong
# (batch, context) of decode; (queries, context) of prefill; page sizes
DECODE_SHAPES = ((2, 70),) if DRY else ((1, 131072), (8, 16384), (64, 4096))
PREFILL_PROMPT = 48 if DRY else 16384
PREFILL_CHUNK = 16 if DRY else 4096
LONG_PROMPT = 131072
PAGES = (16,) if DRY else (16, 128)  # dry: pages as large as the interpreter's key tile (TMA applies)
# B1's decode step as its decode graph runs it: qwen3-0.6b's GQA (16 query heads over 8 KV heads), each
# sequence at its prompt and B1_DECODED tokens (contexts 131-1048, mean 582, as in a profiled step), and the
# split count its graphs get from max_keys = its max_model_len. Dry: fewer, shorter sequences (whose 32 groups
# still fill the 4 waves of "one split from 4 waves" on the interpreter's 4 multiprocessors).
B1_BATCH = 16 if DRY else 256
B1_HEADS = 2 * HKV
B1_DECODED = 24
B1_SHRINK = 32 if DRY else 1  # contexts and max_model_len divided by this
B1_MAX_MODEL_LEN = 4096 // B1_SHRINK

# Decode settings: knobs that differ from the default (fields of DecodeConfig). The first is the default.
DECODE_VARIANTS = {
    "default": {},
    "1 program/SM": dict(programs_per_sm=1),
    "4 programs/SM, 128 splits": dict(programs_per_sm=4, max_splits=128),
    "8 programs/SM, 256 splits": dict(programs_per_sm=8, max_splits=256),
    "wave fit": dict(wave_fit=True),
    "wave fit, 3 programs/SM, 128 splits": dict(wave_fit=True, programs_per_sm=3, max_splits=128),
    "wave fit, 5 programs/SM, 128 splits": dict(wave_fit=True, programs_per_sm=5, max_splits=128),
    "page ahead": dict(page_ahead=True),
    "page ahead, 3 programs/SM, 128 splits": dict(page_ahead=True, programs_per_sm=3, max_splits=128),
    "page ahead, wave fit, 3 programs/SM, 128 splits": dict(page_ahead=True, wave_fit=True, programs_per_sm=3,
                                                            max_splits=128),
    # the default path keeps one tile in flight whatever num_stages; reading pages ahead lets stages count
    "page ahead, 4 stages": dict(page_ahead=True, num_stages=4),
    "page ahead, 4 stages, wave fit": dict(page_ahead=True, num_stages=4, wave_fit=True),
    "page ahead, block_n 32, 4 stages, wave fit, 4 programs/SM, 128 splits": dict(
        page_ahead=True, block_n=32, num_stages=4, wave_fit=True, programs_per_sm=4, max_splits=128),
    "block_n 32": dict(block_n=32),
    "block_n 128": dict(block_n=128),
    "8 warps": dict(num_warps=8),
    "block_n 128, 8 warps, 2 stages": dict(block_n=128, num_warps=8, num_stages=2),
    # B1's batch: its (sequence, KV head) groups fill several waves without splitting the keys
    "one split from 4 waves": dict(one_split_waves=4),
    "split at every batch": dict(one_split_waves=0, full_wave_programs=0),
    "one split from 4 waves only": dict(full_wave_programs=0),
    "one split from 4 waves, block_n 32": dict(one_split_waves=4, block_n=32),
    "one split from 4 waves, page ahead": dict(one_split_waves=4, page_ahead=True),
    # a sequence's KV heads side by side in the grid: their programs read the same rows of its pages
    "heads inner": dict(heads_inner=True),
    "heads inner, page ahead": dict(heads_inner=True, page_ahead=True),
    "one split from 4 waves, heads inner": dict(one_split_waves=4, heads_inner=True),
    "one split from 4 waves, heads inner, page ahead": dict(one_split_waves=4, heads_inner=True,
                                                            page_ahead=True),
    "2 warps": dict(num_warps=2),
    "2 stages": dict(num_stages=2),
    "4 stages": dict(num_stages=4),
    # TMA: on by default over pages of a tile or more; these try it off, and the depths its loads allow
    "no tma, 4 stages": dict(tma=False, num_stages=4),
    "block_n 32, 4 stages": dict(block_n=32, num_stages=4),
    "3 programs/SM, 2 stages": dict(programs_per_sm=3, num_stages=2),
    "3 programs/SM, 2 stages, heads inner": dict(programs_per_sm=3, num_stages=2, heads_inner=True),
    "3 programs/SM, 2 stages, 2 warps": dict(programs_per_sm=3, num_stages=2, num_warps=2),
    "3 programs/SM, 2 stages, 128 splits": dict(programs_per_sm=3, num_stages=2, max_splits=128),
    "heads inner, 3 programs/SM, 128 splits": dict(heads_inner=True, programs_per_sm=3, max_splits=128),
}
# the settings ``--b1`` tries at B1's decode step: fewer splits, and the kernel knobs that matter for short
# contexts (the combined pass then joins the best of each axis)
B1_VARIANTS = ("one split from 4 waves", "split at every batch", "one split from 4 waves, block_n 32",
               "one split from 4 waves, page ahead", "block_n 32", "2 warps", "8 warps", "2 stages",
               "4 stages", "page ahead", "page ahead, 4 stages", "one split from 4 waves, heads inner",
               "one split from 4 waves, heads inner, page ahead")
# Prefill settings (fields of PrefillConfig); TMA only where the keys allow it (packed, or pages >= block_n).
PREFILL_VARIANTS = {
    "default": {},
    "tma": dict(tma=True),
    "heads first": dict(heads_first=True),
    "tma, heads first": dict(tma=True, heads_first=True),
    "128x64": dict(block_m=128, block_n=64),
    "2 stages": dict(num_stages=2),
    "tma, 128x64": dict(tma=True, block_m=128, block_n=64),
    "fused scale": dict(fused_scale=True),
    "tma, fused scale": dict(tma=True, fused_scale=True),
    "tma, fused scale, heads first": dict(tma=True, fused_scale=True, heads_first=True),
    # plain loads, whose pages are read a tile ahead, with a deeper pipeline (128x128 has no room for 4)
    "128x64, 4 stages": dict(block_m=128, block_n=64, num_stages=4),
}
LONG_VARIANTS = ("default", "tma", "tma, fused scale, heads first")  # 128K: a third of a second a call
if DRY:  # the interpreter is slow: a few settings that go through every kernel path
    DECODE_VARIANTS = {k: DECODE_VARIANTS[k] for k in
                       ("default", "page ahead, wave fit, 3 programs/SM, 128 splits",
                        "one split from 4 waves")}
    B1_VARIANTS = ("one split from 4 waves",)  # B1's many programs are slow here: the path it adds
    PREFILL_VARIANTS = {k: PREFILL_VARIANTS[k] for k in ("default", "tma, fused scale, heads first")}


def decode_config(variant: str, block_size: int) -> tk.DecodeConfig:
    base = tk._decode_config(D, torch.bfloat16, torch.device(DEV), block_size)
    return base._replace(**DECODE_VARIANTS[variant])


def prefill_config(variant: str, paged: bool) -> tk.PrefillConfig:
    base = tk._prefill_config(D, torch.bfloat16, torch.device(DEV), PREFILL_PROMPT, paged)
    return base._replace(**PREFILL_VARIANTS[variant])


# ----------------------------------------------------------------------------------------------------------
# the shapes: each builds its inputs and returns {variant: [call on each input set]} for the variants asked,
# calls returning their output (each has its own output buffer, allocated here)
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def b1_contexts(longest_first: bool = False) -> tuple[int, ...]:
    """The context lengths of B1's decode step: each of its prompts (drawn as ``nanovllm bench throughput``
    draws them) and ``B1_DECODED`` tokens; in the workload's order, or sorted longest first."""
    prompts, _ = throughput_workload()
    contexts = tuple((len(p) + B1_DECODED) // B1_SHRINK for p in prompts[:B1_BATCH])
    return tuple(sorted(contexts, reverse=True)) if longest_first else contexts


def mixed_decode_inputs(contexts: tuple[int, ...], block_size: int, heads: int, gen):
    """A shuffled paged cache holding one sequence of each length in ``contexts``, its block tables (padded
    with block 0, which no sequence reads) and lengths, and one query per sequence."""
    blocks = [-(-c // block_size) for c in contexts]
    kc, vc = (randn(sum(blocks), block_size, HKV, D, gen=gen) for _ in range(2))
    perm = torch.randperm(sum(blocks), generator=gen, device=DEV).int().cpu()
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    for row, piece in zip(tables, perm.split(blocks), strict=True):
        row[:len(piece)] = piece
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    return kc, vc, tables.to(DEV), lens, randn(len(contexts), heads, D, gen=gen)


def decode_shape(batch: int, ctx: int | str, block_size: int, heads: int, gen, variants: list[str]):
    """``ctx``: every sequence's context length, or ``"B1"``: B1's decode step (``batch`` of its sequences,
    split as its decode graphs split them; ``"B1 longest first"``: its sequences sorted by length). Each
    variant runs on each of ``decode_rotation`` input sets, timed together in one CUDA graph."""
    if ctx in ("B1", "B1 longest first"):
        contexts = b1_contexts(longest_first=ctx != "B1")
        max_keys, tokens = B1_MAX_MODEL_LEN, sum(contexts)
        build = functools.partial(mixed_decode_inputs, contexts, block_size, heads, gen)
    else:
        max_keys, tokens = ctx, batch * ctx
        build = functools.partial(paged_decode_inputs, batch, ctx, block_size, heads, HKV, D, gen)
    sets = [build()[:5] for _ in range(decode_rotation(2 * tokens * HKV * D * 2))]

    def call(variant, kc, vc, tables, lens, q):
        out = torch.empty_like(q)

        def run():
            tk.attention_decode(q, kc, vc, out, None, lens, tables, None, max_keys, SCALE,
                                config=decode_config(variant, block_size))
            return out
        return run
    return {v: [call(v, *inputs) for inputs in sets] for v in variants}


def prefill_shape(q_len: int, ctx: int, block_size: int | None, gen, variants: list[str]):
    """``block_size`` None: packed keys (then ``q_len == ctx``). One input set: a prefill is long enough
    that its launch does not count."""
    k_all, v_all = randn(ctx, HKV, D, gen=gen), randn(ctx, HKV, D, gen=gen)
    q = randn(q_len, H, D, gen=gen)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEV)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    if block_size is not None:
        kc, vc, table = paged_cache(k_all, v_all, block_size, gen)

    def call(variant):
        out = torch.empty_like(q)
        cfg = prefill_config(variant, block_size is not None)

        def run():
            if block_size is None:
                tk.attention_rows(q, k_all, v_all, out, None, cu, None, None, None, q_len, SCALE, paged=False,
                                  causal=True, config=cfg)
            else:
                tk.attention_rows(q, kc, vc, out, None, cu, lens, table, None, q_len, SCALE, paged=True,
                                  causal=True, config=cfg)
            return out
        return [run]
    sdpa_mode = "plain" if DRY else "cudnn"  # dry: the CPU's SDPA stands in
    calls = {v: call(v) for v in variants}
    if block_size is None:
        return {"cudnn sdpa": [lambda: _sdpa_causal(q, k_all, v_all, SCALE, sdpa_mode)]} | calls
    return calls


def shapes(long: bool, kinds=("decode", "prefill"), pages=PAGES, only=None) -> list[dict]:
    """Every shape of the sweep (of ``kinds``, where ``"b1"`` is B1's decode step alone and ``"decode"``
    includes it; paged ones over ``pages``; with ``only``, just those variants and the default): kind, label,
    its work per call (bytes or FLOPs), and how to build it."""
    def chosen(variants) -> list[str]:
        return [v for v in variants if only is None or v == "default" or v in only]

    decodes = [(batch, ctx, H, ctx * batch, DECODE_VARIANTS) for batch, ctx in DECODE_SHAPES]
    decodes = decodes if "decode" in kinds else []
    if {"decode", "b1"} & set(kinds):
        b1_variants = ("default", *B1_VARIANTS) if DRY else DECODE_VARIANTS
        decodes += [(B1_BATCH, b1, B1_HEADS, sum(b1_contexts()), b1_variants)
                    for b1 in ("B1", "B1 longest first")]
    out = []
    for batch, ctx, heads, keys, variants in decodes:
        gqa = "" if heads == H else f" gqa={heads}/{HKV}"
        for bs in pages:
            out.append(dict(kind="decode", label=f"b={batch} ctx={ctx}{gqa} bs={bs}", unit="TB/s",
                            work=2 * keys * HKV * D * 2, build=(decode_shape, batch, ctx, bs, heads),
                            variants=chosen(variants)))
    if "prefill" not in kinds:
        return out
    prefills = [(PREFILL_PROMPT, PREFILL_PROMPT, None)]
    prefills += [(PREFILL_PROMPT, PREFILL_PROMPT, bs) for bs in pages]
    prefills += [(PREFILL_CHUNK, PREFILL_PROMPT, bs) for bs in pages]
    if long and not DRY:
        prefills.append((LONG_PROMPT, LONG_PROMPT, None))
    for q_len, ctx, bs in prefills:
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2
        keys = "packed" if bs is None else f"paged bs={bs}"
        out.append(dict(kind="prefill", label=f"q={q_len} ctx={ctx} {keys}", unit="TFLOP/s",
                        work=4 * H * D * pairs, build=(prefill_shape, q_len, ctx, bs),
                        variants=chosen(LONG_VARIANTS if q_len == LONG_PROMPT else PREFILL_VARIANTS),
                        long=q_len == LONG_PROMPT))
    return out


# ----------------------------------------------------------------------------------------------------------
# compiling ahead, in parallel
# ----------------------------------------------------------------------------------------------------------


def _compile_key(shape: dict, variant: str) -> tuple:
    """What Triton compiles a variant for: the kind, the page size (None: packed keys), the query heads of
    decode (its GQA group) and the compiled knobs (the split count is a runtime argument). Shapes and
    variants of one key share the compiled kernels."""
    block_size = shape["build"][3]
    if shape["kind"] == "decode":
        cfg = decode_config(variant, block_size)._replace(programs_per_sm=0, max_splits=0)
        return "decode", block_size, shape["build"][4], tuple(cfg)
    if variant == "cudnn sdpa":
        return "cudnn", block_size
    return shape["kind"], block_size, tuple(prefill_config(variant, block_size is not None))


def cuda_alive() -> bool:
    """False once a kernel has broken this process's CUDA context (every later call would fail)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=DEV).add_(1).item() == 2
    except Exception:  # noqa: BLE001 - a sticky CUDA error
        return False


def _compile_part(args: tuple) -> dict:
    """Worker: run once every (shape, variant) whose compile key falls to this worker, so that Triton compiles
    it into its disk cache. Returns how many ran, and the compile key that broke the worker's CUDA context
    (the worker stops there), if one did."""
    index, workers, long, kinds, pages, only = args
    every = shapes(long, kinds, pages, only)
    keys = sorted({_compile_key(sh, v) for sh in every for v in sh["variants"]}, key=str)
    mine = {key for i, key in enumerate(keys) if i % workers == index}
    gen = torch.Generator(device=DEV).manual_seed(0)
    done = 0
    for shape in every:
        todo = [v for v in shape["variants"] if _compile_key(shape, v) in mine]
        if not todo:
            continue
        fn, *build_args = shape["build"]
        calls = fn(*build_args, gen, todo)
        for variant in todo:
            try:
                calls[variant][0]()
                torch.cuda.synchronize()
                done += 1
            except Exception as e:  # noqa: BLE001 - the timed run records why, unless the context broke
                if not cuda_alive():
                    why = f"{type(e).__name__}: {e}"[:160]
                    return dict(done=done, fatal=(_compile_key(shape, variant), why))
        del calls
    return dict(done=done, fatal=None)


def compile_ahead(workers: int, timeout: float, long: bool, kinds=("decode", "prefill"),
                  pages=PAGES, only=None) -> tuple[str, dict]:
    """Compile every variant in ``workers`` processes; whatever is not done by ``timeout`` seconds compiles in
    the timed process instead. Returns a note and ``{compile key: why}`` of the keys that broke a worker's
    CUDA context, which the timed process must not run."""
    import multiprocessing as mp

    start = time.perf_counter()
    done, fatal, finished = 0, {}, 0
    pool = mp.get_context("spawn").Pool(workers)
    try:
        parts = [(i, workers, long, kinds, pages, only) for i in range(workers)]
        results = pool.imap_unordered(_compile_part, parts)
        for _ in range(workers):
            part = results.next(max(0.1, start + timeout - time.perf_counter()))
            done += part["done"]
            finished += 1
            if part["fatal"]:
                fatal[part["fatal"][0]] = part["fatal"][1]
    except Exception as e:  # noqa: BLE001 - a timeout or a lost worker only costs compile time later
        print(f"compile workers: {type(e).__name__} {e}", file=sys.stderr, flush=True)
    finally:
        pool.terminate()
        pool.join()
    note = (f"{done} kernel runs compiled by {finished} of {workers} workers in "
            f"{time.perf_counter() - start:.1f} s"
            + (f"; {len(fatal)} settings broke a CUDA context and were not timed" if fatal else ""))
    return note, fatal


# ----------------------------------------------------------------------------------------------------------
# timing, ranking, output
# ----------------------------------------------------------------------------------------------------------


def empty_row(shape: dict, variant: str, note: str = "") -> dict:
    """A row of ``shape`` and ``variant``, with its setting, not measured yet."""
    row = dict(kind=shape["kind"], shape=shape["label"], variant=variant, ms=None, value=None,
               unit=shape["unit"], err=None, note=note)
    if variant != "cudnn sdpa":
        block_size = shape["build"][3]
        if shape["kind"] == "decode":
            cfg = decode_config(variant, block_size)
        else:
            cfg = prefill_config(variant, block_size is not None)
            if cfg.tma and block_size is not None and block_size % cfg.block_n and not note:
                row["note"] = "pages smaller than the key tile: plain loads"
        row["config"] = cfg._asdict()
    return row


def in_turn(every: list[dict]) -> list[dict]:
    """The order of measuring: the targets' first shapes early (a run cut short keeps them), and each
    context's packed prefill (whose cuDNN rate anchors its paged rows) before its paged ones."""
    def rank(shape: dict) -> tuple:
        label = shape["label"]
        if shape["kind"] == "decode":  # batch 1: 0, batch 8: 2, batch 64 and B1's 256: 16
            return (min(int(label.split()[0][2:]) // 8 * 2, 16), label)
        step = 1 if label.endswith("packed") else 3 if label.startswith(f"q={PREFILL_PROMPT}") else 17
        return (step + (100 if shape.get("long") else 0), label)
    return sorted(every, key=rank)


class ContextLost(RuntimeError):
    """A kernel broke the CUDA context: nothing more can run in this process."""


def measure(shape: dict, gen, deadline: float, copy_tbps: float, anchors: dict, fatal: dict) -> list[dict]:
    """Time every variant of one shape (cuDNN first where it runs: its output is then the reference, else the
    default's is). ``fatal``: compile keys not to run, with why."""
    fn, *build_args = shape["build"]
    calls = fn(*build_args, gen, shape["variants"])
    rows, ref = [], None
    for variant, group in calls.items():
        row = empty_row(shape, variant)
        rows.append(row)
        why_not = fatal.get(_compile_key(shape, variant))
        if why_not:
            row["note"] = f"not run: it broke a compile worker's CUDA context ({why_not})"
            continue
        if time.perf_counter() > deadline:
            row["note"] = "skipped: out of time"
            continue
        try:
            out = group[0]()
            if ref is None:
                ref = out.clone()
            row["err"] = float(f"{rel(out, ref):.2e}")
            t = graph_ms(group) if shape["kind"] == "decode" else ms(group[0])
        except Exception as e:  # noqa: BLE001 - a setting that cannot run: its row says why
            row["note"] = f"{type(e).__name__}: {str(e)[:160]}"
            if not DRY and not cuda_alive():
                rest = list(calls)[list(calls).index(variant) + 1:]
                rows += [empty_row(shape, v, "not run: the CUDA context was lost") for v in rest]
                raise ContextLost(rows) from e
            continue
        row["ms"] = round(t, 4)
        row["value"] = float(f"{shape['work'] / t / 1e9:.4g}")
        if row["err"] > WRONG:
            row["note"] = "wrong: off the reference"
    # the packed prompt's cuDNN rate anchors every prefill row of that context
    context = shape["label"].split()[1]
    cudnn = next((r for r in rows if r["variant"] == "cudnn sdpa"), None)
    if cudnn is not None and cudnn["value"]:
        anchors[context] = cudnn["value"]
    default = next((r for r in rows if r["variant"] == "default" and r["value"]), None)
    for r in rows:
        if r["value"] is None:
            continue
        if shape["kind"] == "decode":
            r["of_copy"] = float(f"{r['value'] / copy_tbps:.3g}")
        elif context in anchors:
            r["of_cudnn"] = float(f"{r['value'] / anchors[context]:.3g}")
        if default:
            r["vs_default"] = float(f"{r['value'] / default['value']:.3g}")
    del calls
    return rows


def _good(r: dict) -> bool:
    return r["value"] is not None and not r["note"].startswith("wrong") and r["variant"] != "cudnn sdpa"


def target(shape: str) -> float:
    """The issue's target for a shape: decode as a share of the copy (batch 1: 0.85, larger: 0.92), prefill
    as a share of cuDNN on the packed prompt (0.9)."""
    if shape.startswith("b="):
        return 0.85 if shape.startswith("b=1 ") else 0.92
    return 0.9


def best_per_shape(rows: list[dict]) -> dict[str, dict]:
    """Per shape, the fastest setting that ran right, with the default's and the best's share of the anchor
    (copy or cuDNN) next to the target."""
    best: dict[str, dict] = {}
    for r in rows:
        if _good(r) and (r["shape"] not in best or r["value"] > best[r["shape"]]["value"]):
            best[r["shape"]] = r
    out = {}
    for shape, r in best.items():
        default = next((d for d in rows if d["shape"] == shape and d["variant"] == "default" and _good(d)),
                       {})
        anchor = "of_copy" if r["kind"] == "decode" else "of_cudnn"
        out[shape] = dict(variant=r["variant"], value=r["value"], unit=r["unit"],
                          vs_default=r.get("vs_default"), default_of_anchor=default.get(anchor),
                          best_of_anchor=r.get(anchor), target=target(shape), config=r.get("config"))
    return out


def _geomean_choice(rows: list[dict], shapes_of_group: set[str]) -> dict | None:
    """The variant with the best geometric mean of ``vs_default`` over a group of shapes; only variants that
    ran right on every shape of the group (a shape measured twice counts its last row)."""
    scores: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["shape"] in shapes_of_group and _good(r) and r.get("vs_default"):
            scores.setdefault(r["variant"], {})[r["shape"]] = r["vs_default"]
    full = {v: list(by_shape.values()) for v, by_shape in scores.items() if set(by_shape) == shapes_of_group}
    if not full:
        return None
    variant = max(full, key=lambda v: sum(map(math.log, full[v])))
    config = next(r["config"] for r in rows if r["variant"] == variant and r["shape"] in shapes_of_group)
    return dict(variant=variant, geomean_vs_default=round(math.exp(sum(map(math.log, full[variant]))
                                                                   / len(full[variant])), 3), config=config)


def groups_of(rows: list[dict]) -> dict[str, set[str]]:
    """The shapes that share one default: decode per page size (the kernel's compiled knobs must not follow
    the batch), prefill over packed keys, prefill over paged keys (both page sizes, with and without
    history)."""
    decode = {r["shape"] for r in rows if r["kind"] == "decode"}
    prefill = {r["shape"] for r in rows if r["kind"] == "prefill"}
    groups = {f"{'DECODE_LARGE_PAGES' if bs >= 64 else 'DECODE'} (bs={bs})":
              {s for s in decode if s.endswith(f" bs={bs}")} for bs in PAGES}
    groups["PREFILL_LONG (packed)"] = {s for s in prefill if s.endswith("packed")
                                       and not s.startswith(f"q={LONG_PROMPT}")}
    groups["PREFILL_LONG_PAGED"] = {s for s in prefill if "paged" in s}
    return {name: group for name, group in groups.items() if group}


# each kind's knobs on two axes, whose best settings the combined pass puts together
AXES = {"decode": ({"block_n", "num_warps", "num_stages", "page_ahead", "heads_inner", "tma"},
                   {"programs_per_sm", "max_splits", "wave_fit", "one_split_waves", "full_wave_programs"}),
        "prefill": ({"block_m", "block_n", "num_warps", "num_stages"},
                    {"tma", "heads_first", "fused_scale"})}


def combined_variants(rows: list[dict]) -> dict[str, tuple[str, dict]]:
    """Per group, the best variant of each knob axis put together (when both beat the default and the union
    is not a variant already): ``{group: (name, knobs)}``."""
    out = {}
    for group_name, group in groups_of(rows).items():
        kind = "decode" if group_name.startswith("DECODE") else "prefill"
        variants = DECODE_VARIANTS if kind == "decode" else PREFILL_VARIANTS
        best = []
        for axis in AXES[kind]:
            on_axis = [r for r in rows if r["variant"] == "default"
                       or (r["variant"] in variants and variants[r["variant"]].keys() <= axis)]
            choice = _geomean_choice(on_axis, group)
            if choice and choice["variant"] != "default" and choice["geomean_vs_default"] > 1.0:
                best.append(choice["variant"])
        if len(best) == 2:
            knobs = variants[best[0]] | variants[best[1]]
            if knobs not in variants.values():
                out[group_name] = (f"{best[0]} + {best[1]}", knobs)
    return out


def recommend(rows: list[dict]) -> dict[str, dict]:
    """The defaults to paste, per group of :func:`groups_of`."""
    out = {}
    for name, group in groups_of(rows).items():
        choice = _geomean_choice(rows, group)
        if choice:
            cls = "DecodeConfig" if name.startswith("DECODE") else "PrefillConfig"
            fields = ", ".join(f"{k}={v!r}" for k, v in choice["config"].items())
            choice["paste"] = f"{cls}({fields})"
            out[name] = choice
    return out


def markdown(result: dict, name: str) -> str:
    env = result["environment"]
    lines = [f"# {name}", "",
             f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, triton "
             f"{result['triton']}. GQA {H}q/{HKV}kv, d={D}, bf16. Copy {result['copy_tbps']} TB/s. "
             f"{result['compile']}; {result['wall_s']} s in all.", "",
             "## Defaults to paste (best geometric mean over the group's shapes)", "",
             "| group | variant | vs default | setting |", "|---|---|---|---|"]
    for group, c in result["recommended"].items():
        lines.append(f"| {group} | {c['variant']} | {c['geomean_vs_default']} | `{c['paste']}` |")
    lines += ["", "## Best per shape", "",
              "Share: of the copy (decode) or of cuDNN on the packed prompt of the context (prefill).", "",
              "| shape | best variant | value | vs default | default's share | best's share | target |",
              "|---|---|---|---|---|---|---|"]
    for shape, b in result["best"].items():
        lines.append(f"| {shape} | {b['variant']} | {b['value']} {b['unit']} | {b['vs_default']} | "
                     f"{b['default_of_anchor'] or ''} | {b['best_of_anchor'] or ''} | {b['target']} |")
    lines += ["", "## Every row", "",
              "| kind | shape | variant | ms | value | of copy / of cuDNN | vs default | err | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = r.get("of_copy", r.get("of_cudnn", ""))
        value = "-" if r["value"] is None else f"{r['value']} {r['unit']}"
        t = "-" if r["ms"] is None else r["ms"]
        err = "" if r["err"] is None else r["err"]
        lines.append(f"| {r['kind']} | {r['shape']} | {r['variant']} | {t} | {value} | {ratio} | "
                     f"{r.get('vs_default', '')} | {err} | {r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="kernel_sweep")
    parser.add_argument("--budget", type=float, default=80.0, help="seconds of wall time, compiling included")
    parser.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes that compile the variants first (0: compile while timing)")
    parser.add_argument("--long", action="store_true", help="also the packed 128K prompt (about 10 s more)")
    parser.add_argument("--kinds", nargs="+", choices=("decode", "prefill"), default=("decode", "prefill"),
                        help="only these kernels' shapes")
    parser.add_argument("--pages", nargs="+", type=int, default=PAGES,
                        help="only paged shapes over these page sizes (any prefill keeps the packed prompt)")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="only these settings (DECODE_VARIANTS, PREFILL_VARIANTS names) and the default")
    parser.add_argument("--b1", action="store_true",
                        help="only B1's decode step, over B1_VARIANTS unless --variants names settings")
    args = parser.parse_args(argv)
    if args.b1:
        args.kinds = ("b1",)
        args.variants = args.variants or list(B1_VARIANTS)
    only = None if args.variants is None else tuple(args.variants)
    unknown = sorted(set(only or ()) - set(DECODE_VARIANTS) - set(PREFILL_VARIANTS))
    if unknown:
        parser.error(f"--variants {unknown}: not a setting of this sweep; choose from "
                     f"{sorted(set(DECODE_VARIANTS) | set(PREFILL_VARIANTS))}")
    start = time.perf_counter()
    deadline = start + args.budget - 3  # the last writes
    args.out.mkdir(parents=True, exist_ok=True)
    compile_note, fatal = "no compile workers", {}
    if not DRY and args.workers > 0:
        compile_note, fatal = compile_ahead(args.workers, 0.45 * args.budget, args.long, tuple(args.kinds),
                                            tuple(args.pages), only)
        print(compile_note, file=sys.stderr, flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    copy_tbps = copy_bandwidth() / 1e3
    result = dict(environment=environment(), triton=triton.__version__, heads=H, kv_heads=HKV, head_dim=D,
                  copy_tbps=round(copy_tbps, 3), compile=compile_note, dry=DRY, rows=[])
    anchors: dict[str, float] = {}
    lost = False

    def run(shape: dict) -> None:
        nonlocal lost
        print(f"{time.perf_counter() - start:5.1f} s {shape['kind']} {shape['label']}: "
              f"{len(shape['variants'])} settings", file=sys.stderr, flush=True)
        if lost:
            result["rows"] += [empty_row(shape, v, "not run: the CUDA context was lost")
                               for v in shape["variants"]]
        else:
            try:
                result["rows"] += measure(shape, gen, deadline, copy_tbps, anchors, fatal)
            except ContextLost as e:
                result["rows"] += e.args[0]
                lost = True
        result["best"] = best_per_shape(result["rows"])
        result["recommended"] = recommend(result["rows"])
        result["wall_s"] = round(time.perf_counter() - start, 1)
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{args.name}.md").write_text(markdown(result, args.name))

    every = in_turn(shapes(args.long, tuple(args.kinds), tuple(args.pages), only))
    for shape in every:
        if not shape.get("long"):
            run(shape)
    # the best of each knob axis together, against the default again, on the shapes of its group
    for group_name, (name, knobs) in combined_variants(result["rows"]).items():
        (DECODE_VARIANTS if group_name.startswith("DECODE") else PREFILL_VARIANTS)[name] = knobs
        group = groups_of(result["rows"])[group_name]
        for shape in every:
            if shape["label"] in group:
                run(dict(shape, variants=["default", name]))
    for shape in every:
        if shape.get("long"):
            run(shape)
    print(markdown(result, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
