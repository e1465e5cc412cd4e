"""``nanovllm bench kernels``: the attention kernels next to their peers, on the same inputs in one run.

GQA 32 query / 8 KV heads, head dim 128, bf16; each row's ratio to the best peer of its shape (``of_best``).

- Prefill, causal: a fresh prompt of 4K, 16K and 128K tokens (dense: packed keys and values), and a chunk
  with history, 1K over 4K and 4K over 16K and 128K (paged, blocks of 16 and 128). TFLOP/s (4 * heads *
  head_dim * visible query-key pairs) of FlashAttention-4 (where importable), torch SDPA's cuDNN and flash
  kernels (fresh prompts), our Triton kernel, and the ``triton`` and ``flash_attn`` backends' ``prefill``
  (what ``attention_backend`` runs: the ``triton`` backend hands a fresh prompt to cuDNN, and copies a
  context into pages of 128 tokens where the cache's pages are smaller than its key tiles). Each row's
  relative error against SDPA (cuDNN where it runs).
- Paged decode, batch 1, 8 and 64 over 4K, 16K and 128K, blocks of 16 and 128: TB/s of KV read by FA4 and
  the ``triton`` and ``flash_attn`` backends' ``decode`` (naming the kernel the latter chose), each captured
  in a CUDA graph as the engine runs decode (one call on each of up to four input sets a replay, see
  ``decode_rotation``), next to a device-to-device copy measured in the same run.
- Selected decode: the decode kernel over per-KV-head selections (``attend_blocks``' launch) of 128
  blocks of 16 tokens per KV head, contexts 32K and 128K, batch 1 and 8. GB/s of the bytes it reads
  (the selected K/V blocks, q and out) next to the dense decode kernel's GB/s over the whole context
  in the same run, and the speedup in time over dense.

A peer that cannot run a shape is a row with the reason. Medians of triton.testing.do_bench (a call longer
than ``LONG_MS``: the median of three). ``dry``: tiny sizes on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before triton is first imported), which checks this code, not the speed.
"""

from __future__ import annotations

import functools
import math
import os
import statistics

import torch

DRY = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()

from triton.testing import do_bench  # noqa: E402

from nanovllm.attention import triton_backend as tb  # noqa: E402
from nanovllm.attention import triton_kernels as tk  # noqa: E402
from nanovllm.attention.metadata import PhaseMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402

DEV = "cpu" if DRY else "cuda"
SCALE = 64 if DRY else 1  # sizes are divided by this in a dry run
H, HKV, D = (4, 1, 128) if DRY else (32, 8, 128)
PREFILL_LENGTHS = (128,) if DRY else (4096, 16384, 131072)  # and a chunk of a quarter, at most 4K, over each
DECODE_SHAPES = ((1, 300), (3, 40)) if DRY else tuple(
    (b, c) for b in (1, 8, 64) for c in (4096, 16384, 131072))
BLOCK_SIZES = (16,) if DRY else (16, 128)
ROTATION_BYTES = 8 << 30  # the input sets of one decode timing, together
PEER_ROUNDS = 1 if DRY else 2
LONG_MS = 50.0  # calls longer than this are timed three times: do_bench would take seconds each
rows: list[dict] = []  # this process's results; the bench runs it once per process


def ms(fn) -> float:
    if DRY:
        fn()
        return 1.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once() -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    if once() > LONG_MS:
        return statistics.median(once() for _ in range(3))
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(calls: list) -> float:
    """Median ms per call of ``calls``, captured one after the other in one CUDA graph and replayed, so
    that Python's launch overhead (more than a small selection's kernel time) stays out, as in the
    engine's decode graphs. The calls rotate over different inputs, so the L2 cache, which do_bench
    clears before each replay, does not serve one call from another's reads."""
    if DRY:
        for call in calls:
            call()
        return 1.0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / len(calls)


def decode_rotation(set_bytes: int) -> int:
    """How many input sets of ``set_bytes`` a decode timing rotates over (1 to 4, together at most
    ``ROTATION_BYTES``): one call on each set a CUDA-graph replay spreads the replay's start over the calls,
    as a decode graph spreads it over its layers, while every set is read once a replay, so the L2 cache
    serves no call from another's reads."""
    return 1 if DRY else max(1, min(4, ROTATION_BYTES // set_bytes))


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, device=DEV, dtype=torch.bfloat16)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record(kind, name, t_ms, value, unit, note="", **extra):
    rows.append(dict(kind=kind, name=name, ms=round(t_ms, 4), value=round(value, 1), unit=unit, note=note,
                     **extra))


def paged_decode_inputs(batch: int, ctx: int, bs: int, h: int, hkv: int, d: int, gen):
    """A shuffled paged cache holding ``batch`` contexts of ``ctx`` tokens, its block tables and lengths,
    one query per sequence and an output buffer."""
    nblk = -(-ctx // bs)
    pool = batch * nblk
    kc, vc = randn(pool, bs, hkv, d, gen=gen), randn(pool, bs, hkv, d, gen=gen)
    tables = torch.randperm(pool, generator=gen, device=DEV).view(batch, nblk).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = randn(batch, h, d, gen=gen)
    return kc, vc, tables, lens, q, torch.empty_like(q)


def copy_bandwidth() -> float:
    n = (2 << 30) // SCALE**2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    gbs = 2 * n / t / 1e6
    record("copy", "device-to-device 2 GiB (read+write)", t, gbs, "GB/s")
    return gbs


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def paged_cache(k, v, block_size, gen):
    """The keys/values of one sequence scattered over shuffled cache blocks."""
    s, hkv, d = k.shape
    nblk = -(-s // block_size)
    perm = torch.randperm(nblk, generator=gen, device=DEV)
    kc = torch.empty(nblk, block_size, hkv, d, dtype=k.dtype, device=DEV)
    vc = torch.empty_like(kc)
    pad = nblk * block_size - s
    kc[perm] = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(nblk, block_size, hkv, d)
    vc[perm] = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(nblk, block_size, hkv, d)
    return kc, vc, perm.int()[None, :]


# -- the peer table ------------------------------------------------------------------------------------------


def tokens_label(n: int) -> str:
    """``4096`` -> ``"4K"``; counts that are not whole K as they are."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def time_peers(kind: str, shape: str, peers: list[tuple], work: float, unit: str, ref=None,
               timer=lambda calls: ms(calls[0])) -> None:
    """Record ``work`` (FLOPs or bytes) per second, in T, of each peer ``(name, calls, backend)`` of one shape:
    ``calls`` the peer's operation on each input set (the first is checked against ``ref``, ``timer(calls)``
    gives ms a call), ``backend`` the attention backend whose operation it is, else None. The peers are timed in
    ``PEER_ROUNDS`` rounds, in turn and then in the reverse order, and each keeps its fastest round: a GPU's
    clocks drift over a run by more than the peers differ (seconds of tensor-core work lower them). A peer
    that fails is a row with why."""
    timed = []
    for name, calls, backend in peers:
        row = dict(kind=kind, name=f"{shape} {name}", ms=float("nan"), value=float("nan"), unit=unit, note="",
                   shape=shape, peer=name, backend=backend)
        rows.append(row)
        try:
            out = calls[0]()
            row["note"] = "" if ref is None else f"err {rel(out, ref):.1e}"
        except Exception as e:  # a peer that cannot run this shape (FA4's limits, memory): its row says why
            row["note"] = _why(e)
            continue
        timed.append((row, calls))
    best: dict[int, float] = {}  # the rows' positions in ``timed`` -> their fastest ms
    for turn in range(PEER_ROUNDS):
        for i in range(len(timed)) if turn % 2 == 0 else reversed(range(len(timed))):
            row, calls = timed[i]
            if turn and i not in best:
                continue  # it failed in the first round
            try:
                best[i] = min(timer(calls), best.get(i, math.inf))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory in a CUDA graph's capture
                row["note"] = _why(e)
                best.pop(i, None)
    for i, t in best.items():
        # work per ms -> per s, in T
        timed[i][0].update(ms=round(t, 4), value=float(f"{work / t / 1e9:.4g}"))


def flash_attn_peers():
    """(FA4's ``flash_attn_varlen_func``, the ``flash_attn`` backend), or (None, None) and a row saying why
    not: the backend is listed as unavailable, or its plugin is not installed."""
    from nanovllm.plugins import get_plugins

    info = get_plugins().registry.attention_backends.get("flash_attn")
    why = ("the nanovllm-flash-attn plugin is not installed" if info is None else info.unavailable)
    if why is None:
        try:
            from flash_attn.cute import flash_attn_varlen_func
            from nanovllm_flash_attn.backend import FlashAttnBackend

            return flash_attn_varlen_func, FlashAttnBackend()
        except Exception as e:
            why = _why(e)
    record("prefill", "fa4 and the flash_attn backend: not measured", float("nan"), float("nan"), "", why)
    return None, None


def peer_prefill(fa4, flash, gen) -> None:
    """Fresh prompts (dense) and chunks with history (paged) of each length, every peer on the same inputs."""
    triton = tb.TritonBackend()
    scale = D**-0.5
    for length in PREFILL_LENGTHS:
        q_all, k_all, v_all = (randn(length, n, D, gen=gen) for n in (H, HKV, HKV))
        if DRY:
            ref_all = tb._sdpa_causal(q_all.float(), k_all.float(), v_all.float(), scale).to(q_all.dtype)
        else:
            ref_all = tb._sdpa_causal(q_all, k_all, v_all, scale, "priority")  # cuDNN where it runs
        for q_len in (length, min(4096, length // 4)):
            q, k, v, ref = q_all[-q_len:], k_all[-q_len:], v_all[-q_len:], ref_all[-q_len:]
            flops = 4 * H * D * (q_len * (length - q_len) + q_len * (q_len + 1) / 2)
            cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEV)
            lens = torch.tensor([length], dtype=torch.int32, device=DEV)
            if q_len == length:
                shape = tokens_label(length)
                no_table = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
                meta = PhaseMetadata(cu, lens, no_table, q_len, length)
                fresh_prefill(shape, q, k, v, ref, meta, flops, fa4, flash)
                continue
            for bs in BLOCK_SIZES:
                shape = f"{tokens_label(q_len)} over {tokens_label(length)}, blocks of {bs}"
                kc, vc, table = paged_cache(k_all, v_all, bs, gen)
                triton.reserve_workspace(HKV, D, bs, q.dtype, q.device, length)  # as the engine does
                meta = PhaseMetadata(cu, lens, table, q_len, length, (q_len,), (length,))
                out = torch.empty_like(q)

                def kernel(kc=kc, vc=vc, table=table, out=out):
                    tk.attention_rows(q, kc, vc, out, None, cu, lens, table, None, q_len, scale, paged=True,
                                      causal=True)
                    return out
                peers = [("triton", kernel, None),
                         ("triton backend", lambda c=(kc, vc, meta): triton.prefill(q, k, v, *c, scale),
                          "triton")]
                if fa4 is not None:
                    peers[:0] = [("fa4", lambda kc=kc, vc=vc, table=table: fa4(
                        q, kc, vc, cu_seqlens_q=cu, seqused_k=lens, page_table=table, max_seqlen_q=q_len,
                        max_seqlen_k=length, softmax_scale=scale, causal=True)[0], None)]
                    peers.append(("flash_attn backend",
                                  lambda c=(kc, vc, meta): flash.prefill(q, k, v, *c, scale), "flash_attn"))
                time_peers("prefill", shape, [(name, [fn], backend) for name, fn, backend in peers], flops,
                           "TFLOP/s", ref)
                del kc, vc


def fresh_prefill(shape, q, k, v, ref, meta, flops, fa4, flash) -> None:
    """One prompt with nothing cached: the peers over its packed keys and values."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton = tb.TritonBackend()
    scale = D**-0.5
    q_len = q.shape[0]
    cu = meta.cu_seqlens_q
    out = torch.empty_like(q)

    def kernel():
        tk.attention_rows(q, k, v, out, None, cu, None, None, None, q_len, scale, paged=False, causal=True)
        return out
    peers = [("triton", kernel, None),
             ("triton backend", lambda: triton.prefill(q, k, v, k, v, meta, scale), "triton")]
    if not DRY:  # SDPA's fused kernels run on CUDA only
        for name, kind in (("cudnn sdpa", SDPBackend.CUDNN_ATTENTION),
                           ("flash sdpa", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=kind):
                with sdpa_kernel([backend]):
                    return tb._sdpa_causal(q, k, v, scale, "plain")
            peers.insert(0, (name, sdpa, None))
    if fa4 is not None:
        peers.insert(0, ("fa4", lambda: fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=q_len,
                                            max_seqlen_k=q_len, softmax_scale=scale, causal=True)[0], None))
        peers.append(("flash_attn backend", lambda: flash.prefill(q, k, v, k, v, meta, scale), "flash_attn"))
    time_peers("prefill", shape, [(name, [fn], backend) for name, fn, backend in peers], flops, "TFLOP/s", ref)


def peer_decode(fa4, flash, gen, copy_gbs: float) -> None:
    """Paged decode of every shape and block size: FA4 and the backends' decode, each timed as a CUDA graph
    of one call on each of ``decode_rotation`` input sets."""
    triton = tb.TritonBackend()
    scale = D**-0.5
    cu = torch.arange(max(b for b, _ in DECODE_SHAPES) + 1, dtype=torch.int32, device=DEV)
    for batch, ctx in DECODE_SHAPES:
        for bs in BLOCK_SIZES:
            shape = f"batch {batch} at {tokens_label(ctx)}, blocks of {bs}"
            kv_bytes = 2 * batch * ctx * HKV * D * 2  # bf16 K and V
            try:
                sets = [paged_decode_inputs(batch, ctx, bs, H, HKV, D, gen)[:5]
                        for _ in range(decode_rotation(kv_bytes))]
            except torch.OutOfMemoryError as e:
                record("decode", f"{shape}: not measured", float("nan"), float("nan"), "", _why(e))
                continue
            sets = [(q, kc, vc, PhaseMetadata(cu[:batch + 1], lens, tables, 1, ctx))
                    for kc, vc, tables, lens, q in sets]
            ref = (TorchBackend() if DRY else triton).decode(*sets[0], scale)
            peers = [("triton backend", lambda q, kc, vc, meta: triton.decode(q, kc, vc, meta, scale), "triton")]
            if fa4 is not None:
                kernel = "fa4" if flash.decode_runs_fa4(sets[0][0]) else "triton"
                peers[:0] = [("fa4", lambda q, kc, vc, meta: fa4(
                    q, kc, vc, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.context_lens,
                    page_table=meta.block_tables, max_seqlen_q=1, max_seqlen_k=ctx, softmax_scale=scale,
                    causal=True)[0], None)]
                peers.append((f"flash_attn backend ({kernel})",
                              lambda q, kc, vc, meta: flash.decode(q, kc, vc, meta, scale), "flash_attn"))
            peers = [(name, [functools.partial(fn, *inputs) for inputs in sets], backend)
                     for name, fn, backend in peers]
            time_peers("decode", shape, peers, kv_bytes, "TB/s", ref, timer=graph_ms)
            for row in rows[-len(peers):]:
                if math.isfinite(row["value"]):
                    row["note"] += f", {row['value'] * 1e3 / copy_gbs:.2f} of the copy"
            del sets, peers


def rank_rows(kernel_rows: list[dict]) -> None:
    """Each peer row's ratio to the best of its kind and shape (``of_best``)."""
    best: dict[tuple, float] = {}
    for r in kernel_rows:
        if "shape" in r and math.isfinite(r["value"]):
            key = (r["kind"], r["shape"])
            best[key] = max(best.get(key, 0.0), r["value"])
    for r in kernel_rows:
        top = best.get((r.get("kind"), r.get("shape")))
        if top is not None and top > 0 and math.isfinite(r["value"]):
            r["of_best"] = round(r["value"] / top, 3)


def random_head_selection(batch: int, num_kv_heads: int, num_blocks: int, num_selected: int, gen,
                          device) -> torch.Tensor:
    """``[batch, num_kv_heads, num_selected]`` int32 logical blocks out of ``num_blocks``, for each KV
    head its own random ones, ascending, the last block always among them (a decode's newest keys)."""
    scores = torch.rand(batch, num_kv_heads, num_blocks - 1, generator=gen, device=device)
    earlier = scores.topk(num_selected - 1, dim=-1).indices.sort(dim=-1).values
    last = torch.full((batch, num_kv_heads, 1), num_blocks - 1, dtype=earlier.dtype, device=device)
    return torch.cat([earlier, last], dim=-1).int()


def decode_bytes(block_indices: torch.Tensor, kv_lens: torch.Tensor, block_size: int, num_heads: int,
                 head_dim: int, itemsize: int) -> int:
    """Bytes a decode over a per-KV-head selection ``[S, Hkv, k]`` reads and writes: the K and V
    slots of its selected blocks below ``kv_lens``, plus q and out."""
    starts = block_indices.long() * block_size
    tokens = (kv_lens.long()[:, None, None] - starts).clamp(0, block_size) * (block_indices >= 0)
    s = block_indices.shape[0]
    return int(tokens.sum()) * 2 * head_dim * itemsize + 2 * s * num_heads * head_dim * itemsize


def same_bytes_dense(batch: int, ctx: int, bs: int, h: int, hkv: int, d: int, scale: float, gen) -> None:
    """Dense decode over contexts as long as a selection: a kernel this short pays its launch, ramp-up and
    split reduce on few bytes, so this is the fair peer of a selection's GB/s."""
    caches = [paged_decode_inputs(batch, ctx, bs, h, hkv, d, gen) for _ in range(1 if DRY else 16)]
    calls = [lambda c=c: tk.attention_decode(c[4], c[0], c[1], c[5], None, c[3], c[2], None, ctx, scale)
             for c in caches]
    t = graph_ms(calls)
    gbs = decode_bytes(torch.arange(-(-ctx // bs), dtype=torch.int32, device=DEV).expand(batch, hkv, -1),
                       caches[0][3], bs, h, d, caches[0][4].element_size()) / t / 1e6
    record("decode", f"b={batch} ctx={ctx} bs={bs} dense over as many bytes as the selection, graph", t, gbs,
           "GB/s")


def selected_decode(gen) -> None:
    """Decode over per-KV-head selections (``attend_blocks``' launch, with lse) against dense decode over
    the whole context of the same inputs; the selection's output checked against the torch backend."""
    h, hkv, d = (4, 2, 128) if DRY else (32, 8, 128)  # two KV heads at least, for their own selections
    bs = 16
    n_sel = 128 // SCALE  # 2048 tokens per KV head
    scale = d**-0.5
    shapes = [(1, 32768), (1, 131072), (8, 32768), (8, 131072)]
    if DRY:
        shapes = [(1, 32768 // SCALE)]
    block_n = tk._decode_config(d, torch.bfloat16, torch.device(DEV), bs)[0]
    for batch, ctx in shapes:
        nblk = -(-ctx // bs)
        kc, vc, tables, lens, q, out = paged_decode_inputs(batch, ctx, bs, h, hkv, d, gen)
        lse = torch.empty(batch, h, dtype=torch.float32, device=DEV)
        rotation = 1 if DRY else 16  # selections over different blocks, replayed in turn
        sels = [random_head_selection(batch, hkv, nblk, n_sel, gen, DEV) for _ in range(rotation)]
        sel = sels[0]
        everything = torch.arange(nblk, dtype=torch.int32, device=DEV).expand(batch, hkv, -1)
        dense_bytes = decode_bytes(everything, lens, bs, h, d, q.element_size())
        sel_bytes = sum(decode_bytes(x, lens, bs, h, d, q.element_size()) for x in sels) / rotation

        def dense(q=q, kc=kc, vc=vc, out=out, lens=lens, tables=tables, ctx=ctx):
            tk.attention_decode(q, kc, vc, out, None, lens, tables, None, ctx, scale)

        def selected(sel=sel, q=q, kc=kc, vc=vc, out=out, lse=lse, lens=lens, tables=tables):
            tk.attention_decode(q, kc, vc, out, lse, lens, tables, sel, n_sel * bs, scale)

        label = f"b={batch} ctx={ctx} bs={bs}"
        try:
            t_dense = graph_ms([dense] * 4)  # the whole context is far larger than L2: no rotation needed
            dense_gbs = dense_bytes / t_dense / 1e6
            record("decode", f"{label} dense (selected's peer), CUDA graph", t_dense, dense_gbs, "GB/s")
            same_bytes_dense(batch, n_sel * bs, bs, h, hkv, d, scale, gen)
            selected()
            meta = PhaseMetadata(torch.arange(batch + 1, dtype=torch.int32, device=DEV), lens, tables, 1, ctx)
            err = rel(out, TorchBackend().attend_blocks(q, kc, vc, meta, sel, lens, scale)[0])
        except Exception as e:
            record("decode", f"{label} selected {n_sel} blocks per KV head", float("nan"), float("nan"), "",
                   _why(e))
            continue
        n = tk.num_decode_splits(batch, hkv, n_sel * bs, block_n, q.device)
        name = f"{label} selected {n_sel} blocks per KV head splits={n}, graph"
        try:
            t = graph_ms([lambda x=x: selected(x) for x in sels])
        except Exception as e:
            record("decode", name, float("nan"), float("nan"), "", _why(e))
            continue
        gbs = sel_bytes / t / 1e6
        record("decode", name, t, gbs, "GB/s", f"{gbs / dense_gbs:.2f} of dense GB/s, {t_dense / t:.1f}x faster, "
               f"err {err:.1e}", vs_dense=round(gbs / dense_gbs, 3), speedup=round(t_dense / t, 2))
        # The same blocks for every KV head (the [num_seqs, k] form): each block is read whole, 16 tokens x
        # all heads contiguous, where one head's share of a block is 16 pieces of head_dim values apart.
        shared = [x[:, 0].contiguous() for x in sels]
        t = graph_ms([lambda x=x: selected(x) for x in shared])
        gbs = sel_bytes / t / 1e6
        record("decode", f"{label} selected {n_sel} blocks shared by all KV heads (auto), graph", t, gbs, "GB/s",
               f"{gbs / dense_gbs:.2f} of dense GB/s, {t_dense / t:.1f}x faster",
               vs_dense=round(gbs / dense_gbs, 3), speedup=round(t_dense / t, 2))
        del kc, vc, dense, selected


def run() -> list[dict]:
    """Every measurement, as rows ``{kind, name, ms, value, unit, note}``; the peer table's rows also have
    ``shape``, ``peer``, ``backend`` (the attention backend measured, else None) and ``of_best``."""
    from tqdm.auto import tqdm

    gen = torch.Generator(device=DEV).manual_seed(0)
    with tqdm(total=4, desc="kernels", unit="part") as bar:
        copy_gbs = copy_bandwidth()
        fa4, flash = flash_attn_peers()
        bar.update()
        peer_prefill(fa4, flash, gen)
        bar.update()
        peer_decode(fa4, flash, gen, copy_gbs)
        rank_rows(rows)
        bar.update()
        selected_decode(gen)
        bar.update()
    return list(rows)
