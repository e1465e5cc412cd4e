"""FlashAttention-4 next to our Triton kernels and torch SDPA, on the same inputs in one run (GPU, FA4 installed).

GQA 32 query / 8 KV heads, head dim 128, bf16:

- causal prefill of one fresh sequence of 4K and 16K tokens, and the last 4K chunk of a 16K context (paged,
  with history): TFLOP/s (4 * heads * head_dim * visible query-key pairs) of FA4 (packed keys, and paged
  with blocks of 16 and 128), the ``flash_attn`` backend's ``prefill``, the Triton kernel (packed and
  paged) and SDPA's cuDNN and flash kernels; each row's relative error against SDPA's output (cuDNN), or
  with history the torch backend's;
- paged decode, batch 1 at 128K, 8 at 16K, 64 at 4K, blocks of 16 and 128: TB/s of KV read of FA4, the
  Triton backend's split-KV decode and the ``flash_attn`` backend's decode (naming the kernel its batch rule
  chose), each captured in a CUDA graph as the engine runs decode, next to a device-to-device copy (bytes
  read + written) measured in the same run.

Medians of triton.testing.do_bench. Writes ``OUT/NAME.json`` and prints the table with each row's ratio to
the best peer of its shape.

    python benchmarks/fa4_peers.py --out gpu_out [--name fa4_peers]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
from pathlib import Path

import torch
from nanovllm.attention import triton_kernels as tk
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.attention.triton_backend import TritonBackend, _sdpa_causal
from nanovllm.bench.kernels import (DEV, DRY, copy_bandwidth, graph_ms, ms, paged_cache, paged_decode_inputs,
                                    randn, rel)

H, HKV, D = (4, 1, 128) if DRY else (32, 8, 128)
PREFILL = ((64, 64), (96, 160)) if DRY else ((4096, 4096), (16384, 16384), (4096, 16384))  # (queries, context)
DECODE = ((1, 300), (3, 40)) if DRY else ((1, 131072), (8, 16384), (64, 4096))  # (batch, context)
SCALE = D**-0.5
rows: list[dict] = []


def row(kind: str, shape: str, peer: str, fn, work: float, unit: str, ref=None, timer=ms, note: str = "") -> None:
    """Time ``fn`` and record ``work`` (FLOPs or bytes) per second; a peer that fails is a row with why."""
    try:
        out = fn()
        err = rel(out, ref) if ref is not None else None
        t = timer(fn)
        value = work / t / 1e9  # per ms -> per s, in T
        rows.append(dict(kind=kind, shape=shape, peer=peer, ms=round(t, 4), value=round(value, 3), unit=unit,
                         err=None if err is None else float(f"{err:.2e}"), note=note))
    except Exception as e:  # a peer that cannot run this shape: its row says why
        rows.append(dict(kind=kind, shape=shape, peer=peer, ms=None, value=None, unit=unit, err=None,
                         note=f"{type(e).__name__}: {str(e)[:200]}"))


def prefill(fa4, flash, gen) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for q_len, ctx in PREFILL:
        shape = f"q={q_len} ctx={ctx}"
        k_all, v_all = randn(ctx, HKV, D, gen=gen), randn(ctx, HKV, D, gen=gen)
        q = randn(q_len, H, D, gen=gen)
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2
        flops = 4 * H * D * pairs
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEV)
        lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        k, v = k_all[ctx - q_len:], v_all[ctx - q_len:]
        fresh = q_len == ctx
        ref = None
        if fresh:
            ref = _sdpa_causal(q, k, v, SCALE, "priority")  # cuDNN where it runs
            row("prefill", shape, "fa4 packed", lambda: fa4(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=q_len, max_seqlen_k=q_len,
                softmax_scale=SCALE, causal=True)[0], flops, "TFLOP/s", ref)
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                def sdpa(backend=backend):
                    with sdpa_kernel([backend]):
                        return _sdpa_causal(q, k, v, SCALE, "plain")
                row("prefill", shape, f"sdpa {name}", sdpa, flops, "TFLOP/s", ref)
            out = torch.empty_like(q)

            def triton_packed():
                tk.attention_rows(q, k, v, out, None, cu, None, None, None, q_len, SCALE, paged=False, causal=True)
                return out
            row("prefill", shape, "triton packed", triton_packed, flops, "TFLOP/s", ref)
        for bs in (16, 128):
            kc, vc, table = paged_cache(k_all, v_all, bs, gen)
            meta = PhaseMetadata(cu, lens, table, q_len, ctx)
            if ref is None:  # with history: the torch backend (float32 scores) is the reference
                ref = TorchBackend().prefill(q, k, v, kc, vc, meta, SCALE)
            row("prefill", shape, f"fa4 paged bs={bs}", lambda kc=kc, vc=vc, table=table: fa4(
                q, kc, vc, cu_seqlens_q=cu, seqused_k=lens, page_table=table, max_seqlen_q=q_len, max_seqlen_k=ctx,
                softmax_scale=SCALE, causal=True)[0], flops, "TFLOP/s", ref)
            out = torch.empty_like(q)

            def triton_paged(kc=kc, vc=vc, table=table):
                tk.attention_rows(q, kc, vc, out, None, cu, lens, table, None, q_len, SCALE, paged=True, causal=True)
                return out
            row("prefill", shape, f"triton paged bs={bs}", triton_paged, flops, "TFLOP/s", ref)
            row("prefill", shape, f"flash_attn backend bs={bs}", lambda kc=kc, vc=vc, meta=meta: flash.prefill(
                q, k, v, kc, vc, meta, SCALE), flops, "TFLOP/s", ref)
            del kc, vc


def decode(fa4, flash, gen, copy_tbps: float) -> None:
    triton = TritonBackend()
    for batch, ctx in DECODE:
        for bs in (16, 128):
            shape = f"b={batch} ctx={ctx} bs={bs}"
            kc, vc, tables, lens, q, _ = paged_decode_inputs(batch, ctx, bs, H, HKV, D, gen)
            cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
            meta = PhaseMetadata(cu, lens, tables, 1, ctx)
            kv_bytes = 2 * batch * ctx * HKV * D * 2
            ref = triton.decode(q, kc, vc, meta, SCALE)
            on_fa4 = flash.decode_runs_fa4(q, kc, meta)
            for peer, fn in (
                ("fa4", lambda: fa4(q, kc, vc, cu_seqlens_q=cu, seqused_k=lens, page_table=tables, max_seqlen_q=1,
                                    max_seqlen_k=ctx, softmax_scale=SCALE, causal=True)[0]),
                ("triton backend", lambda: triton.decode(q, kc, vc, meta, SCALE)),
                (f"flash_attn backend ({'fa4' if on_fa4 else 'triton'})", lambda: flash.decode(q, kc, vc, meta, SCALE)),
            ):
                row("decode", shape, peer, fn, kv_bytes, "TB/s", ref, timer=lambda fn: graph_ms([fn]))
                if rows[-1]["value"] is not None:
                    rows[-1]["note"] = f"{rows[-1]['value'] / copy_tbps:.2f} of the copy"
            del kc, vc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--name", default="fa4_peers")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_varlen_func as fa4
    from nanovllm_flash_attn.backend import FlashAttnBackend

    gen = torch.Generator(device=DEV).manual_seed(0)
    flash = FlashAttnBackend()
    copy_tbps = copy_bandwidth() / 1e3
    device = "cpu (dry run)" if DRY else torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, fa4=md.version("flash-attn-4"),
                  commit=os.environ.get("NANOVLLM_COMMIT"), heads=H, kv_heads=HKV, head_dim=D, dtype="bfloat16",
                  copy_tbps=round(copy_tbps, 3), rows=rows)
    path = Path(args.out) / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for phase in (lambda: prefill(fa4, flash, gen), lambda: decode(fa4, flash, gen, copy_tbps)):
        phase()
        rank_rows()
        path.write_text(json.dumps(result, indent=2))  # after each phase: a run cut short keeps the first
    print(f"{device}, torch {result['torch']}, FA4 {result['fa4']}, copy {copy_tbps:.2f} TB/s")
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:8.3f} {r['unit']}"
        print(f"{r['kind']:8} {r['shape']:24} {r['peer']:30} {value:>16} {r['of_best'] or '':>6} "
              f"{'' if r['err'] is None else 'err ' + str(r['err'])} {r['note']}")


def rank_rows() -> None:
    """Each row's ratio to the best peer of its shape."""
    best: dict[tuple, float] = {}
    for r in rows:
        if r["value"] is not None:
            key = (r["kind"], r["shape"])
            best[key] = max(best.get(key, 0.0), r["value"])
    for r in rows:
        top = best.get((r["kind"], r["shape"]))
        r["of_best"] = round(r["value"] / top, 3) if r["value"] is not None and top else None

if __name__ == "__main__":
    main()
