"""XAttention block-sparse prefill attention over the paged KV cache: a Triton kernel and its torch reference.

Both take, per sequence, selection head and row of the block grid (see :mod:`nanovllm_xattn.layout`), a list
of key blocks: ``blocks [S, Hs, R, Wb]`` whose first ``block_counts [S, Hs, R]`` entries are absolute key
blocks, strictly ascending, each at most the row's query block. Query head ``h`` uses the lists of selection
head ``h // (H // Hs)``. The query at position ``p`` attends with softmax to the keys ``c <= p`` whose block
``c // block`` is in its row's list. Both return ``(out [T, H, D] in q's dtype, lse [T, H] float32)``;
``lse`` is the natural log of the sum of ``exp(scale * q.k)`` over the keys read. A row that reads no key
gets out 0 and lse -inf.

The kernel runs one program per (head, query tile, sequence), heads fastest and the last tiles first.
Query tiles are aligned to absolute positions (tile ``m`` of a sequence starts at ``(q0 // BLOCK_M + m) *
BLOCK_M``, rows outside the chunk masked), so a tile lies in one query block and reads one list. It feeds
one online softmax (base 2, the core's ``online_softmax_step``) from two loops:

1. without masks: every key tile of the blocks below the diagonal (every row of the tile sees every key of
   them), then the key tiles of the diagonal block that end before the tile's first row. The loop is
   flattened over ``(entry, key tile in the block)``, so it is one long loop the compiler can pipeline and
   the diagonal prefix costs no extra loop: its iterations read the diagonal entry, the list's last.
2. with the causal mask: the diagonal block's key tiles from the query tile's first row to its last row
   (nothing past the last row is read). Only when the list ends with the diagonal block.

Keys are read through the block table with per-key addresses, so the cache block size may be smaller or
larger than a key tile; with :class:`BlockSparseConfig`'s ``tma`` and pages that hold whole key tiles, the
unmasked tiles come through tensor-memory loads instead. Entries past a list's count, and block-table
entries past a sequence's context, are never read. On CPU tensors the kernel runs under Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported) with float32 dots: the interpreter's
bfloat16 dot is wrong.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import accumulate

import attrs
import torch
import triton
import triton.language as tl
from nanovllm.attention.backend import check_paged_inputs, prefill_kernel_outputs
from nanovllm.sparse import (
    cdiv,
    host_lengths,
    next_power_of_2,
    num_sms,
    online_softmax_step,
    online_softmax_step_fused_scale,
    paged_kv_descriptors,
    tile_blocks,
)

from nanovllm_xattn.layout import num_query_blocks

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _key_slots(bt_row, start_n, last_pos, BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr):
    """Physical cache blocks, slots in them and positions of the keys ``start_n .. start_n + BLOCK_N - 1``.
    ``start_n`` is a multiple of ``BLOCK_N`` and at most ``last_pos``; keys past ``last_pos`` do not read
    the block table."""
    pos = start_n + tl.arange(0, BLOCK_N)
    phys = tile_blocks(bt_row, start_n, last_pos + 1, BLOCK_N, KV_BLOCK).to(tl.int64)
    return phys, pos % KV_BLOCK, pos


@triton.jit
def _listed_tile_start(entries, it, count, stride_le, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first key of the ``it``-th key tile of the listed blocks (``BLOCK // BLOCK_N`` tiles a block);
    0, a key every sequence has, past the ``count`` tiles."""
    key_block = tl.load(entries + (it // (BLOCK // BLOCK_N)) * stride_le, mask=it < count, other=0)
    return key_block * BLOCK + (it % (BLOCK // BLOCK_N)) * BLOCK_N


# list strides change with the selection's width and the block tables' width: one compiled kernel for all
@triton.jit(do_not_specialize=["stride_bt", "stride_ls", "stride_lg", "stride_lr", "stride_cs", "stride_cg"])
def _block_sparse_kernel(
    Q, K, V, Out, Lse, desc_k, desc_v,
    cu_q, ctx_lens, block_tables, blocks, block_counts,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od, stride_osplit,
    stride_lt, stride_lh, stride_lsplit,
    stride_bt,
    stride_ls, stride_lg, stride_lr, stride_le,
    stride_cs, stride_cg, stride_cr,
    GROUP: tl.constexpr, SEL_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_BLOCK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32: tl.constexpr, SAME_LAYOUT: tl.constexpr, SPLITS: tl.constexpr, TMA: tl.constexpr,
    FUSED_SCALE: tl.constexpr,
):
    # heads fastest, last query tiles first: every head's longest programs (the latest rows, and the last rows
    # that read every causal block) start in the first wave, not after another head's lighter tiles
    h = tl.program_id(0)
    m = tl.num_programs(1) - 1 - tl.program_id(1)
    s = (tl.program_id(2) // SPLITS).to(tl.int64)
    split = tl.program_id(2) % SPLITS
    row0 = tl.load(cu_q + s)
    q_len = tl.load(cu_q + s + 1) - row0
    ctx = tl.load(ctx_lens + s)
    q0 = ctx - q_len  # position of the chunk's first query
    tile_start = (q0 // BLOCK_M + m) * BLOCK_M
    if (q_len == 0) | (tile_start >= ctx):
        return
    last_pos = tl.minimum(tile_start + BLOCK_M, ctx) - 1  # the tile's last query: no key past it is read
    query_block = tile_start // BLOCK
    g = h // SEL_GROUP
    entries = blocks + s * stride_ls + g * stride_lg + (query_block - q0 // BLOCK) * stride_lr
    count = tl.load(block_counts + s * stride_cs + g * stride_cg + (query_block - q0 // BLOCK) * stride_cr)
    last_entry = tl.load(entries + (count - 1) * stride_le, mask=count > 0, other=-1)
    has_diag = last_entry == query_block
    # the diagonal block: its key tiles before diag_lo are below every row of the tile, the rest masked
    diag_lo = (tile_start // BLOCK_N) * BLOCK_N
    diag_hi = tl.where(has_diag & (split == SPLITS - 1), last_pos + 1, diag_lo)  # in the last split
    num_unmasked = (count - has_diag.to(tl.int32)) * (BLOCK // BLOCK_N)
    num_unmasked += tl.where(has_diag, (diag_lo - query_block * BLOCK) // BLOCK_N, 0)
    # this split's share of the unmasked tiles: a long list is read by SPLITS programs at once
    per_split = tl.cdiv(num_unmasked, SPLITS)
    it_lo = split * per_split
    it_hi = tl.minimum(it_lo + per_split, num_unmasked)

    offs_m = tile_start + tl.arange(0, BLOCK_M)  # positions of the tile's rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = (offs_m >= q0) & (offs_m < ctx)
    d_ok = offs_d < HEAD_DIM
    q_rows = (row0 + offs_m - q0).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    kvh = h // GROUP
    K += kvh * stride_kh
    V += kvh * stride_vh
    bt_row = block_tables + s * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1. key tiles every row sees in full, (entry, tile in block) flattened; the diagonal's prefix at the end.
    # The next tile's list entry and block-table entries are read a tile ahead: Triton pipelines a key load
    # whose address waits on a load of its own iteration 2 deep, not 3
    start_next = _listed_tile_start(entries, it_lo, num_unmasked, stride_le, BLOCK, BLOCK_N)
    phys_next, _, _ = _key_slots(bt_row, start_next, last_pos, BLOCK_N, KV_BLOCK)
    for it in range(it_lo, it_hi):
        start_n = start_next
        phys = phys_next
        start_next = _listed_tile_start(entries, it + 1, num_unmasked, stride_le, BLOCK, BLOCK_N)
        phys_next, _, _ = _key_slots(bt_row, start_next, last_pos, BLOCK_N, KV_BLOCK)
        if TMA:  # a page holds the whole tile (BLOCK_N divides KV_BLOCK): ``phys`` is a scalar
            row = (phys * KV_BLOCK + start_n % KV_BLOCK).to(tl.int32)  # descriptor offsets are int32
            k = desc_k.load([row, kvh * HEAD_DIM])
            v = desc_v.load([row, kvh * HEAD_DIM])
        else:
            if BLOCK_N <= KV_BLOCK:  # one page: one scalar address plus the slots
                k_rows = phys * stride_kb + (start_n % KV_BLOCK + offs_n) * stride_ks
            else:
                k_rows = phys * stride_kb + ((start_n + offs_n) % KV_BLOCK) * stride_ks
            k_off = k_rows[:, None] + offs_d[None, :] * stride_kd
            k_ptrs = K + k_off
            if SAME_LAYOUT:  # the engine's K and V caches: one address computation for both
                v_ptrs = V + k_off
            else:
                slot = (start_n + offs_n) % KV_BLOCK
                v_ptrs = V + (phys * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :] * stride_vd
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if FUSED_SCALE:
            acc, l_i, m_i = online_softmax_step_fused_scale(acc, l_i, m_i, q, k, v, scale_log2, FP32)
        else:
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, None, scale_log2, False, FP32)

    # 2. the diagonal block from the tile's first row to its last: causal mask
    for start_n in range(diag_lo, diag_hi, BLOCK_N):
        phys, slot, pos = _key_slots(bt_row, start_n, last_pos, BLOCK_N, KV_BLOCK)
        ld = (pos <= last_pos)[:, None] & d_ok[None, :]
        k = tl.load(K + (phys * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :] * stride_kd,
                    mask=ld, other=0.0)
        v = tl.load(V + (phys * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :] * stride_vd,
                    mask=ld, other=0.0)
        keep = pos[None, :] <= offs_m[:, None]
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, keep, scale_log2, True, FP32)

    # with SPLITS > 1, each split's own (out, lse) in float32, for _merge_splits_kernel
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out_rows = split * stride_osplit + q_rows * stride_ot + h * stride_oh
    tl.store(Out + out_rows[:, None] + offs_d[None, :] * stride_od,
             (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    # natural log; -inf for a row that read nothing (m_i = -inf, l_i = 0)
    tl.store(Lse + split * stride_lsplit + q_rows * stride_lt + h * stride_lh,
             (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=m_ok)


@triton.jit
def _merge_splits_kernel(
    Part, PartLse, Out, Lse, num_rows,
    stride_psplit, stride_pt, stride_ph, stride_lsplit, stride_lt, stride_ot, stride_oh, stride_olt,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Program (rows ``BLOCK_T``, head ``h``): the splits' outputs weighted by their share of each row's
    softmax, ``exp(lse_k - lse)``; a row that read nothing keeps out 0, lse -inf."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    t_ok = t < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    ok = t_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for k in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(PartLse + k * stride_lsplit + t * stride_lt + h, mask=t_ok,
                                  other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for k in tl.static_range(SPLITS):
        w = tl.exp(tl.load(PartLse + k * stride_lsplit + t * stride_lt + h, mask=t_ok, other=float("-inf"))
                   - m_safe)
        part = tl.load(Part + k * stride_psplit + (t * stride_pt + h * stride_ph)[:, None] + offs_d[None, :],
                       mask=ok, other=0.0)
        total += w
        acc += w[:, None] * part
    total_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(Out + (t * stride_ot + h * stride_oh)[:, None] + offs_d[None, :],
             (acc / total_safe[:, None]).to(Out.dtype.element_ty), mask=ok)
    tl.store(Lse + t * stride_olt + h, m + tl.log(total), mask=t_ok)


@attrs.frozen
class BlockSparseConfig:
    """The block-sparse kernel's knobs; none changes a result beyond float rounding.

    ``block_m`` query rows a program and ``block_n`` keys a step: powers of two no larger than the selection
    block, so a query tile lies in one query block and a key tile in one key block. ``num_warps``;
    ``num_stages``, Triton's software pipeline depth. ``fused_scale``: the unmasked tiles apply the softmax
    scale inside the exponent's multiply-add, one float operation a score fewer (rounding differs in the last
    bits). ``tma``: the unmasked key tiles come through tensor-memory (TMA) loads where a KV page holds whole
    key tiles (pages of ``block_n`` keys or a multiple; Hopper and later, or the interpreter; a head size that
    is a power of two); elsewhere it is ignored."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    fused_scale: bool = False
    tma: bool = False


def attention_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                     block: int) -> BlockSparseConfig:
    """The kernel's knobs for a launch, by device, dtype and head size (``block`` caps the tiles): small tiles
    and plain loads off CUDA (the interpreter); on CUDA the dense prefill kernel's long-prompt choices."""
    if device.type != "cuda":
        return BlockSparseConfig(min(16, block), min(16, block), 1, 1)
    if dtype == torch.float32 or head_dim > 128:  # keep the K/V stages within shared memory
        return BlockSparseConfig(min(64, block), min(32, block), 4, 2, fused_scale=True)
    # 16-bit: large tiles (``block`` caps them), so each program reads long runs of a selected block;
    # three stages overlap the next tiles' loads with this tile's math
    return BlockSparseConfig(min(128, block), min(64 if head_dim <= 64 else 128, block), 8, 3,
                             fused_scale=True, tma=True)


def kv_splits(num_programs: int, device: torch.device) -> int:
    """Programs that share each query tile's list: 4 when the launch has fewer than 8 programs a
    multiprocessor, else 1. A program reads its list's tiles one after another, so with few programs the
    longest list sets the kernel's time (a last row that reads every causal block, while the other rows read
    a share): split, it takes a quarter of that. With many programs the long lists overlap the others'
    work, and splitting would only add the merge. 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return 4 if num_programs < 8 * num_sms(device) else 1


def _dot_fp32(q: torch.Tensor) -> bool:
    """float32 products: float32 inputs, or the interpreter, whose bfloat16 dot is wrong."""
    return q.dtype == torch.float32 or q.device.type != "cuda"


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def block_sparse_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, blocks: torch.Tensor, block_counts: torch.Tensor,
    block: int, scale: float, max_query_len: int, *, config: BlockSparseConfig | tuple | None = None,
    splits: int | None = None, host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse prefill attention (Triton): ``(out [T, H, D] in q's dtype, lse [T, H] float32)``.

    ``max_query_len`` (a host int) sizes the grid; nothing is read back from the device (``host_lens``, the
    reference's, goes unused: the kernel reads the lengths on the device). ``config`` (a
    :class:`BlockSparseConfig` or its leading fields) overrides :func:`attention_config` and ``splits``
    :func:`kv_splits` (tuning, tests). With more than one split, each query tile's list is read by that many
    programs, each into a float32 buffer of its own, and a second launch merges them by their
    log-sum-exp."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, blocks, block_counts, block,
                  max_query_len)
    out, lse, launch = prefill_kernel_outputs(
        _block_sparse_kernel, "block_sparse_attention", q, cu_seqlens_q,
        (k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, blocks, block_counts),
        "the caches, block tables, lengths and block lists",
    )
    if not launch:
        return out, lse
    num_heads, head_dim = q.shape[1:]
    if config is None:
        cfg = attention_config(head_dim, q.dtype, q.device, block)
    else:
        cfg = config if isinstance(config, BlockSparseConfig) else BlockSparseConfig(*config)
    block_m, block_n = cfg.block_m, cfg.block_n
    if not all(_is_power_of_two(tile) and tile <= block for tile in (block_m, block_n)):
        raise ValueError(
            f"config tiles BLOCK_M {block_m}, BLOCK_N {block_n}: both must be powers of two no larger than "
            f"block {block}"
        )
    # a chunk's tiles start at the tile holding its first query: one more than its length needs, at most
    num_seqs, m_tiles = cu_seqlens_q.shape[0] - 1, cdiv(max_query_len + block_m - 1, block_m)
    splits = splits or kv_splits(num_heads * m_tiles * num_seqs, q.device)
    if splits < 1:
        raise ValueError(f"splits={splits}: give at least 1")
    part, part_lse = out, lse
    if splits > 1:
        part = torch.empty(splits, *q.shape, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, *lse.shape, dtype=torch.float32, device=q.device)
    descs = paged_kv_descriptors(k_cache, v_cache, block_n) if cfg.tma else None
    _block_sparse_kernel[(num_heads, m_tiles, num_seqs * splits)](
        q, k_cache, v_cache, part, part_lse, *(descs or (k_cache, v_cache)),
        cu_seqlens_q, context_lens, block_tables, blocks, block_counts,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *part.stride()[-3:], part.stride(0) if splits > 1 else 0,
        *part_lse.stride()[-2:], part_lse.stride(0) if splits > 1 else 0,
        block_tables.stride(0), *blocks.stride(), *block_counts.stride(),
        GROUP=num_heads // k_cache.shape[2], SEL_GROUP=num_heads // blocks.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim), KV_BLOCK=k_cache.shape[1], BLOCK=block,
        BLOCK_M=block_m, BLOCK_N=block_n,
        FP32=_dot_fp32(q), SAME_LAYOUT=k_cache.stride() == v_cache.stride(), SPLITS=splits,
        TMA=descs is not None, FUSED_SCALE=cfg.fused_scale,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        rows = 16
        _merge_splits_kernel[(cdiv(q.shape[0], rows), num_heads)](
            part, part_lse, out, lse, q.shape[0],
            part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_T=rows,
            num_warps=4 if q.device.type == "cuda" else 1,
        )
    return out, lse


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------


def _check_inputs(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, blocks, block_counts, block: int,
    max_query_len: int,
) -> None:
    check_paged_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if not (_is_power_of_two(block) and block >= 64):
        raise ValueError(f"block {block}: use a power of two >= 64 (128 by default)")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if blocks.dim() != 4 or blocks.shape[0] != num_seqs or block_counts.shape != blocks.shape[:3]:
        raise ValueError(
            f"blocks {tuple(blocks.shape)}, block_counts {tuple(block_counts.shape)}: expected "
            f"[{num_seqs}, Hs, R, width] and [{num_seqs}, Hs, R]"
        )
    if blocks.is_floating_point() or block_counts.is_floating_point():
        raise ValueError(
            f"blocks {blocks.dtype}, block_counts {block_counts.dtype}: give integer (int32) lists"
        )
    num_sel_heads, rows = blocks.shape[1:3]
    if num_sel_heads == 0 or num_heads % num_sel_heads:
        raise ValueError(
            f"{num_sel_heads} selection heads for {num_heads} query heads: the selection heads must divide "
            f"the query heads (one per KV head, {num_kv_heads}, or one per query head, {num_heads})"
        )
    if rows < num_query_blocks(max_query_len, block):
        raise ValueError(
            f"blocks has {rows} rows but max_query_len {max_query_len} needs "
            f"{num_query_blocks(max_query_len, block)} (layout.num_query_blocks): give a list per row"
        )


def _listed_blocks(blocks: torch.Tensor, counts: torch.Tensor, first_block: int, num_key_blocks: int,
                   s: int) -> torch.Tensor:
    """[Hs, rows, num_key_blocks] bool: which key blocks each row's list names, after checking the lists
    (strictly ascending, each in 0 .. the row's query block)."""
    width = blocks.shape[-1]
    counts = counts.long()
    entries = blocks.long()
    real = torch.arange(width, device=blocks.device) < counts[..., None]
    query_block = first_block + torch.arange(blocks.shape[1], device=blocks.device)
    bad_count = (counts < 0) | (counts > width)
    out_of_range = real & ((entries < 0) | (entries > query_block[None, :, None]))
    not_ascending = real[..., 1:] & (entries[..., 1:] <= entries[..., :-1])
    if bad_count.any() or out_of_range.any() or not_ascending.any():
        raise ValueError(
            f"sequence {s}: a block list breaks the contract (0 <= count <= {width}; the first count entries "
            "strictly ascending key blocks, each at most the row's query block)"
        )
    listed = torch.zeros(*blocks.shape[:2], num_key_blocks + 1, dtype=torch.bool, device=blocks.device)
    # padding past the counts lands in the extra last slot, dropped below
    listed.scatter_(-1, torch.where(real, entries, num_key_blocks), True)
    return listed[..., :-1]


def context_rows(cache: torch.Tensor, block_table: torch.Tensor, ctx: int, kv_head: torch.Tensor) -> torch.Tensor:
    """``[ctx, H, D]`` float32: a sequence's first ``ctx`` cached rows of the paged ``cache`` through its
    ``block_table``, each query head reading its KV head (``kv_head`` ``[H]``)."""
    key_pos = torch.arange(ctx, device=kv_head.device)
    kv_block_size = cache.shape[1]
    phys = block_table.to(kv_head.device).long()[key_pos // kv_block_size]
    return cache[phys, key_pos % kv_block_size].float()[:, kv_head]


def query_chunks(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                 host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
                 ) -> Iterator[tuple[int, int, int, int]]:
    """``(sequence, first query row, queries, context length)`` of each sequence with queries in the step; a
    chunk's queries are the last ``queries`` positions of its context. ``host_lens``: the query and context
    lengths as host ints (``PhaseMetadata.host_lens``); without them they are read from the tensors."""
    host_lens = host_lengths(cu_seqlens_q, context_lens, host_lens)
    first_rows = accumulate(host_lens[0], initial=0)
    for s, (first_row, q_len, ctx) in enumerate(zip(first_rows, *host_lens)):
        if q_len > 0:
            yield s, first_row, q_len, ctx


def rows_per_slice(num_heads: int, ctx: int) -> int:
    """Query rows taken at a time by the torch references, so their ``[H, rows, ctx]`` scores stay within
    about 256 MB."""
    return max(1, 2**26 // (num_heads * ctx))


def block_sparse_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, blocks: torch.Tensor, block_counts: torch.Tensor,
    block: int, scale: float, max_query_len: int, *,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse prefill attention (torch, any device; the oracle and the CPU path): a dense mask per
    sequence, float32 softmax. Same arguments and results as :func:`block_sparse_attention`; it also checks
    the lists it reads and raises ValueError on an entry that breaks the contract. ``host_lens``: the query
    and context lengths as host ints (see :func:`query_chunks`)."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, blocks, block_counts, block,
                  max_query_len)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    device = q.device
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    sel_head = torch.arange(num_heads, device=device) // (num_heads // blocks.shape[1])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=device)
    for s, first_row, q_len, ctx in query_chunks(cu_seqlens_q, context_lens, host_lens):
        q0 = ctx - q_len
        first_block = q0 // block
        rows = (ctx - 1) // block - first_block + 1  # the rows this chunk uses
        num_key_blocks = -(-ctx // block)
        listed = _listed_blocks(blocks[s, :, :rows].to(device), block_counts[s, :, :rows].to(device),
                                first_block, num_key_blocks, s)  # [Hs, rows, key blocks]
        key_pos = torch.arange(ctx, device=device)
        k, v = (context_rows(cache, block_tables[s], ctx, kv_head) for cache in (k_cache, v_cache))
        step = rows_per_slice(num_heads, ctx)
        for start in range(0, q_len, step):
            q_pos = torch.arange(q0 + start, min(q0 + start + step, ctx), device=device)
            t = slice(first_row + start, first_row + start + len(q_pos))
            row = q_pos // block - first_block
            mask = listed[sel_head[:, None, None], row[None, :, None], (key_pos // block)[None, None, :]]
            mask &= key_pos[None, None, :] <= q_pos[None, :, None]  # [H, rows, ctx]
            scores = torch.einsum("qhd,khd->hqk", q[t].float(), k) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # -inf for a row that reads nothing
            probs = torch.where(mask, torch.exp(scores - row_lse[..., None]), 0.0)
            out[t] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
            lse[t] = row_lse.T
    return out, lse


__all__ = ["block_sparse_attention", "block_sparse_attention_reference", "attention_config",
           "BlockSparseConfig", "context_rows",
           "query_chunks", "rows_per_slice"]
