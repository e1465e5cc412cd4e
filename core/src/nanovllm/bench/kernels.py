"""``nanovllm bench kernels``: the attention kernels' table.

- Prefill: causal, 16K tokens, d=128, 32 query / 8 KV heads, bf16. TFLOP/s (causal FLOPs =
  2 * q_heads * head_dim * S^2) of the triton backend's kernel (dense new k/v, and through the paged
  cache) next to torch SDPA's cuDNN and flash backends on the same inputs.
- Decode: one query per sequence, batch x context >= 128K tokens, paged KV (block sizes 16 and 256).
  GB/s of KV read next to a large device-to-device copy measured in the same run (bytes read +
  written), and SDPA on contiguous KV for one shape.
- Selected decode: the decode kernel over per-KV-head selections (``attend_blocks``' launch) of 128
  blocks of 16 tokens per KV head, contexts 32K and 128K, batch 1 and 8. GB/s of the bytes it reads
  (the selected K/V blocks, q and out) next to the dense decode kernel's GB/s over the whole context
  in the same run, and the speedup in time over dense.

Medians of triton.testing.do_bench.
``dry``: tiny sizes on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before
triton is first imported), which checks this code, not the speed.
"""

from __future__ import annotations

import os

import torch

DRY = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()

from triton.testing import do_bench  # noqa: E402

from nanovllm.attention import triton_backend as tb  # noqa: E402
from nanovllm.attention import triton_kernels as tk  # noqa: E402
from nanovllm.attention.metadata import PhaseMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402

DEV = "cpu" if DRY else "cuda"
SCALE = 64 if DRY else 1  # sizes are divided by this in a dry run
rows: list[dict] = []  # this process's results; the bench runs it once per process


def ms(fn) -> float:
    if DRY:
        fn()
        return 1.0
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


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)


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


def prefill(gen, d: int = 128) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s, h, hkv = (128, 4, 1) if DRY else (16384, 32, 8)  # dry: less than one KV block of 256
    flops = 2 * h * d * s * s
    q, k, v = randn(s, h, d, gen=gen), randn(s, hkv, d, gen=gen), randn(s, hkv, d, gen=gen)
    scale = d**-0.5
    cu = torch.tensor([0, s], dtype=torch.int32, device=DEV)
    lens = torch.tensor([s], dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)

    def tflops(t):
        return flops / t / 1e9

    ref = tb._sdpa_causal(q.float(), k.float(), v.float(), scale) if DRY else tb._sdpa_causal(q, k, v, scale)

    def dense():
        tk.attention_rows(q, k, v, out, None, cu, None, None, None, s, scale, paged=False, causal=True)

    try:
        dense()
        err = rel(out, ref)
        t = ms(dense)
        record("prefill", f"d={d} triton dense default", t, tflops(t), "TFLOP/s", f"err {err:.1e}")
    except Exception as e:  # a kernel that does not fit this GPU (shared memory) is a row with the reason
        record("prefill", f"d={d} triton dense default", float("nan"), float("nan"), "", _why(e))
    for bs in (16, 256):
        kc, vc, table = paged_cache(k, v, bs, gen)

        def paged(kc=kc, vc=vc, table=table):
            tk.attention_rows(q, kc, vc, out, None, cu, lens, table, None, s, scale, paged=True, causal=True)
        try:
            paged()
            err = rel(out, ref)
            t = ms(paged)
            record("prefill", f"d={d} triton paged bs={bs} default", t, tflops(t), "TFLOP/s", f"err {err:.1e}")
        except Exception as e:
            record("prefill", f"d={d} triton paged bs={bs} default", float("nan"), float("nan"), "", _why(e))
        del kc, vc

    qh = q.transpose(0, 1).unsqueeze(0)
    kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))
    kx, vx = (t.repeat_interleave(h // hkv, dim=1) for t in (kh, vh))
    if DRY:
        return
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for label, kk, vv, gqa in (("enable_gqa", kh, vh, True), ("pre-expanded kv", kx, vx, False)):
            def run(kk=kk, vv=vv, gqa=gqa, backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qh, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
            try:
                o = run()
                err = rel(o.squeeze(0).transpose(0, 1), ref)
                t = ms(run)
                record("prefill", f"d={d} sdpa {name} {label}", t, tflops(t), "TFLOP/s", f"err {err:.1e}")
            except Exception as e:
                record("prefill", f"d={d} sdpa {name} {label}", float("nan"), float("nan"), "",
                       f"{type(e).__name__}: {str(e)[:60]}")


def decode(gen, copy_gbs: float) -> None:
    h, hkv, d = (4, 1, 128) if DRY else (32, 8, 128)
    scale = d**-0.5
    shapes = [(1, 131072), (8, 16384), (64, 2048), (256, 512)]
    if DRY:
        shapes = [(b, c // SCALE) for b, c in shapes[:2]]
    for batch, ctx in shapes:
        for bs in (16, 256):
            kc, vc, tables, lens, q, out = paged_decode_inputs(batch, ctx, bs, h, hkv, d, gen)
            kv_bytes = 2 * batch * ctx * hkv * d * 2

            def run(q=q, kc=kc, vc=vc, out=out, lens=lens, tables=tables, ctx=ctx):
                tk.attention_decode(q, kc, vc, out, None, lens, tables, None, ctx, scale)
            try:
                t = ms(run)
                n = tk.num_decode_splits(batch, hkv, ctx, 64, q.device)
                gbs = kv_bytes / t / 1e6
                record("decode", f"b={batch} ctx={ctx} bs={bs} default splits={n}", t, gbs, "GB/s",
                       f"{gbs / copy_gbs:.0%} of copy")
            except Exception as e:
                record("decode", f"b={batch} ctx={ctx} bs={bs} default", float("nan"), float("nan"), "", _why(e))
            del kc, vc, run
    if DRY:
        return
    # SDPA on contiguous KV, one shape, as a peer
    batch, ctx = 8, 16384
    q = randn(batch, h, 1, d, gen=gen)
    k, v = randn(batch, hkv, ctx, d, gen=gen), randn(batch, hkv, ctx, d, gen=gen)
    t = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    gbs = 2 * batch * ctx * hkv * d * 2 / t / 1e6
    record("decode", f"sdpa contiguous b={batch} ctx={ctx} enable_gqa", t, gbs, "GB/s",
           f"{gbs / copy_gbs:.0%} of copy")


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
    """Every measurement, as rows ``{kind, name, ms, value, unit, note}``."""
    from tqdm.auto import tqdm

    gen = torch.Generator(device=DEV).manual_seed(0)
    with tqdm(total=4, desc="kernels", unit="part") as bar:
        copy_gbs = copy_bandwidth()
        bar.update()
        prefill(gen)
        bar.update()
        decode(gen, copy_gbs)
        bar.update()
        selected_decode(gen)
        bar.update()
    return list(rows)
