"""MInference sparse prefill attention over the paged KV cache: a Triton kernel and its torch reference.

Both compute, for each query row of a prefill phase, softmax attention over exactly the keys that the
row reads under a :class:`~nanovllm_minference.index.SparseIndex` (see :mod:`nanovllm_minference.index`),
and return ``(out [T, H, D] in q's dtype, lse [T, H] float32)``; ``lse`` is the natural log of the sum of
``exp(scale * q.k)`` over the keys read. A row that reads no key gets out 0 and lse -inf.

The kernel runs one program per (query rows, head, sequence): one query tile of the index, or two (the
knob ``block_m`` of :class:`SparseKernelConfig`), and feeds one online softmax (base 2) from three loops,
each reading ``keys`` keys a step:

1. the head's slash tiles, key tile ``base + offset`` for the rows of a query tile with base ``base``
   (two query tiles: bases ``b`` and ``b + 1``, and each key tile of the union of their tiles loaded once,
   the rows of the query tile that does not read it left out at a few operations a row): tiles wholly
   below every row (and so inside the context) without masks, their keys loaded as dense prefill loads
   them (through TMA where a page holds a whole step), then the tiles on the diagonal with the causal mask;
2. the head's columns, minus those whose tile is a slash tile of the row's query tile (slash_cover), with
   the causal mask: their keys and values gathered from the cache beforehand by one launch, into rows that
   the loop reads in order (a gather inside the loop waits on two loads a step);
3. (only for an index with blocks) the key tiles listed for each query tile, split like loop 1.

The ascending lists are first counted against the tiles' bounds (tiles below 0, tiles wholly below the
rows, tiles past the last row), so every loop runs over exactly the tiles it needs, without branches; the
next step's list entries and block-table entries are read a step ahead.
With ``dense_above`` every program first reads the index's work against dense work (computed on the GPU
by the launch before) and, where the index is the denser, runs the loops of dense causal attention
instead: the fallback needs no host sync.
On CPU tensors the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported) with float32 dots: the interpreter's bfloat16 dot is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import attrs
import torch
import triton
import triton.language as tl
from nanovllm.attention.backend import check_paged_inputs, prefill_kernel_outputs
from nanovllm.sparse import (
    attention_scores,
    cdiv,
    host_lengths,
    max_shared_memory,
    next_power_of_2,
    online_softmax_accumulate,
    online_softmax_step,
    online_softmax_step_fused_scale,
    paged_kv_descriptors,
    tile_blocks,
    unmasked_kv,
)

from nanovllm_minference.index import TILE, SparseIndex, computed_density

LOG2E = 1.4426950408889634
LIST_CHUNK = 1024  # list entries counted per step of the pre-scans: most lists take one step
PAST = tl.constexpr(1 << 24)  # a key tile past every list (its first key still fits an int32)
# two query tiles and two stages of whole key tiles at head size 256 take about 192 KiB (Hopper has 227)
WIDE_TILES_SHARED_MEMORY = 200 * 1024


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _count_at_most(entries, n, bound_a, bound_b, bound_c, CHUNK: tl.constexpr):
    """How many of the first ``n`` entries of an ascending list are <= each bound; padding is never read."""
    count_a = tl.full([], 0, tl.int32)
    count_b = tl.full([], 0, tl.int32)
    count_c = tl.full([], 0, tl.int32)
    for j0 in range(0, n, CHUNK):
        offs = j0 + tl.arange(0, CHUNK)
        e = tl.load(entries + offs, mask=offs < n, other=2147483647)
        count_a += tl.sum((e <= bound_a).to(tl.int32), 0)
        count_b += tl.sum((e <= bound_b).to(tl.int32), 0)
        count_c += tl.sum((e <= bound_c).to(tl.int32), 0)
    return count_a, count_b, count_c


@triton.jit
def _count_adjacent(entries, lo, hi, cover, cover_r, CHUNK: tl.constexpr):
    """How many slash offsets ``e``, list entries number ``lo .. hi - 1``, have ``e - 1`` among the offsets
    too (``cover[e - 1]``)."""
    count = tl.full([], 0, tl.int32)
    for j0 in range(lo, hi, CHUNK):
        offs = j0 + tl.arange(0, CHUNK)
        ok = offs < hi
        prev = tl.load(entries + offs, mask=ok, other=0) - 1
        adjacent = tl.load(cover + prev, mask=ok & (prev >= -cover_r) & (prev <= 1), other=0)
        count += tl.sum(adjacent.to(tl.int32), 0)
    return count


@triton.jit
def _union_next(list_a, ia, a_hi, shift_a, list_b, ib, b_hi, shift_b, LISTED: tl.constexpr,
                TWO: tl.constexpr):
    """The next key tile of the ascending union of tiles ``shift_a + a`` (entries ``a`` of ``list_a`` number
    ``ia .. a_hi - 1``; not ``LISTED``: the numbers themselves) and, with ``TWO``, ``shift_b + b`` (of
    ``list_b``): ``(tile, list a has it, list b has it, ia, ib)`` past it. Past both lists: tile 0 (a tile
    every sequence has), neither list."""
    if LISTED:
        ta = shift_a + tl.load(list_a + ia, mask=ia < a_hi, other=PAST)
    else:
        ta = shift_a + tl.where(ia < a_hi, ia, PAST)
    if TWO:
        tb = shift_b + tl.load(list_b + ib, mask=ib < b_hi, other=PAST)
    else:
        tb = shift_b + PAST
    t = tl.minimum(ta, tb)
    in_a = (ta == t) & (t < PAST)
    in_b = (tb == t) & (t < PAST)
    return tl.where(t < PAST, t, 0), in_a, in_b, ia + in_a.to(tl.int32), ib + in_b.to(tl.int32)


@triton.jit
def _rows_step(acc, l_i, m_i, q, k, v, row_ok, scale_log2, FUSED_SCALE: tl.constexpr, FP32: tl.constexpr):
    """One key tile of the online softmax (base 2) that only the rows ``row_ok`` read, every key of it: the
    other rows keep their state, at the cost of a few operations a row, none a score. ``FUSED_SCALE``: the
    scale applied inside the exponent (the row maximum taken before scaling; the same for a positive
    scale)."""
    qk = attention_scores(q, k, FP32)
    if FUSED_SCALE:
        m_tile = tl.max(qk, 1) * scale_log2
    else:
        qk = qk * scale_log2
        m_tile = tl.max(qk, 1)
    m_new = tl.where(row_ok, tl.maximum(m_i, m_tile), m_i)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    m_sub = tl.where(row_ok, m_use, float("inf"))  # the other rows: exp2(-inf) = 0
    if FUSED_SCALE:
        p = tl.math.exp2(qk * scale_log2 - m_sub[:, None])
    else:
        p = tl.math.exp2(qk - m_sub[:, None])
    acc, l_i = online_softmax_accumulate(acc, l_i, p, alpha, v, FP32)
    return acc, l_i, m_new


@triton.jit
def _key_tiles(
    acc, l_i, m_i, q, q_pos, rows_b, K, V, desc_k, desc_v, kv_col, bt_row,
    list_a, a_lo, a_hi, shift_a, list_b, b_lo, b_hi, shift_b, num_tiles, last_pos,
    stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    KEYS: tl.constexpr, LISTED: tl.constexpr, TWO: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
    FUSED_SCALE: tl.constexpr, FP32: tl.constexpr,
):
    """Attend to ``num_tiles`` key tiles, the union of two lists' tiles (:func:`_union_next`), ``KEYS`` keys a
    step. With ``TWO`` the rows ``rows_b`` read the tiles of list b only, the others those of list a only;
    without, every row reads every tile. ``MASKED``: the causal mask, no key past ``last_pos`` read; else the
    tiles lie below every row (TMA loads with ``TMA``). The next step's list entries and block-table entries
    are read a step ahead: Triton pipelines a key load whose address waits on a load of its own iteration 2
    deep, not 3."""
    SUB: tl.constexpr = TILE // KEYS
    offs_k = tl.arange(0, KEYS)
    t, in_a, in_b, ia, ib = _union_next(list_a, a_lo, a_hi, shift_a, list_b, b_lo, b_hi, shift_b, LISTED, TWO)
    start_next = t * TILE
    phys_next = tile_blocks(bt_row, start_next, last_pos + 1, KEYS, BLOCK_SIZE).to(tl.int64)
    for i in range(0, num_tiles * SUB):
        start, phys, a_cur, b_cur = start_next, phys_next, in_a, in_b
        # the next step: the tile's next KEYS keys, or the union's next tile
        t, a2, b2, ia2, ib2 = _union_next(list_a, ia, a_hi, shift_a, list_b, ib, b_hi, shift_b, LISTED, TWO)
        new_tile = (i + 1) % SUB == 0
        start_next = tl.where(new_tile, t * TILE, start + KEYS)
        in_a = tl.where(new_tile, a2, a_cur)
        in_b = tl.where(new_tile, b2, b_cur)
        ia = tl.where(new_tile, ia2, ia)
        ib = tl.where(new_tile, ib2, ib)
        phys_next = tile_blocks(bt_row, start_next, last_pos + 1, KEYS, BLOCK_SIZE).to(tl.int64)
        if KEYS <= BLOCK_SIZE:  # one page: a scalar block plus the slots
            rows = phys * stride_kb + (start % BLOCK_SIZE + offs_k) * stride_ks
        else:
            rows = phys * stride_kb + ((start + offs_k) % BLOCK_SIZE) * stride_ks
        kv_ptrs = rows[:, None] + offs_d[None, :] * stride_kd
        if MASKED:
            pos = start + offs_k
            ld = (pos <= last_pos)[:, None] & d_ok[None, :]
            k = tl.load(K + kv_ptrs, mask=ld, other=0.0)
            v = tl.load(V + kv_ptrs, mask=ld, other=0.0)
            keep = pos[None, :] <= q_pos[:, None]
            if TWO:
                keep = keep & tl.where(rows_b, b_cur, a_cur)[:, None]
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, keep, scale_log2, True, FP32)
        else:
            if TMA:  # a page holds the step's keys (KEYS divides BLOCK_SIZE)
                row = (phys * BLOCK_SIZE + start % BLOCK_SIZE).to(tl.int32)  # descriptor offsets are int32
                k = desc_k.load([row, kv_col])
                v = desc_v.load([row, kv_col])
            else:
                k, v = unmasked_kv(K, V, rows, offs_d, d_ok, stride_kd, HEAD_DIM, BLOCK_D)
            if TWO:
                acc, l_i, m_i = _rows_step(acc, l_i, m_i, q, k, v, tl.where(rows_b, b_cur, a_cur), scale_log2,
                                           FUSED_SCALE, FP32)
            elif FUSED_SCALE:
                acc, l_i, m_i = online_softmax_step_fused_scale(acc, l_i, m_i, q, k, v, scale_log2, FP32)
            else:
                acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, None, scale_log2, False, FP32)
    return acc, l_i, m_i


# list widths and strides change from step to step: one compiled kernel for all of them
@triton.jit(do_not_specialize=["stride_bt", "num_cols", "num_slash", "cover_r", "num_qtiles", "num_blocks"])
def _sparse_prefill_kernel(
    Q, K, V, Out, Lse, desc_k, desc_v, StagedK, StagedV,
    cu_q, ctx_lens, block_tables,
    columns, column_counts, slash_tiles, slash_counts, slash_cover, blocks, block_counts, totals,
    scale_log2, dense_above,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_bt, num_cols, num_slash, cover_r, num_qtiles, num_blocks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_M: tl.constexpr, KEYS: tl.constexpr, CHUNK: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, FP32: tl.constexpr, GUARDED: tl.constexpr, TMA: tl.constexpr,
    FUSED_SCALE: tl.constexpr,
):
    PAIR: tl.constexpr = BLOCK_M // TILE  # query tiles of the index a program computes: 1 or 2
    TWO: tl.constexpr = PAIR == 2
    # last query tiles first: under a causal mask they have the most keys
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * PAIR
    h = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    row0 = tl.load(cu_q + s)
    q_len = tl.load(cu_q + s + 1) - row0
    if m0 * TILE >= q_len:
        return
    ctx_len = tl.load(ctx_lens + s)
    q_start = ctx_len - q_len  # position of the chunk's first row
    first_pos = q_start + m0 * TILE
    last_pos = q_start + tl.minimum(m0 * TILE + BLOCK_M, q_len) - 1
    base = first_pos // TILE  # query tile m0's base key tile; m0 + 1's is base + 1
    full_tile = (first_pos + 1) // TILE - 1  # the last key tile every row reads whole
    last_tile = last_pos // TILE  # tiles past it hold no key any row reads
    kvh = h // GROUP
    head = s * tl.num_programs(1) + h  # (sequence, head) row of the index

    offs_m = m0 * TILE + tl.arange(0, BLOCK_M)
    rows_b = tl.arange(0, BLOCK_M) >= TILE  # the rows of query tile m0 + 1
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = (row0 + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = q_start + offs_m
    K += kvh * stride_kh
    V += kvh * stride_kh
    kv_col = kvh * HEAD_DIM
    bt_row = block_tables + s * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    dense = False
    if GUARDED:  # totals: the index's work and dense causal work (index_density's); above the share, dense
        dense = tl.load(totals).to(tl.float64) > dense_above * tl.load(totals + 1).to(tl.float64)
    if dense:
        # every key up to the row: the tiles below every row whole, then the diagonal
        acc, l_i, m_i = _key_tiles(
            acc, l_i, m_i, q, q_pos, rows_b, K, V, desc_k, desc_v, kv_col, bt_row,
            slash_tiles, 0, full_tile + 1, 0, slash_tiles, 0, 0, 0, full_tile + 1, last_pos,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, False, False, False, TMA, FUSED_SCALE, FP32,
        )
        acc, l_i, m_i = _key_tiles(
            acc, l_i, m_i, q, q_pos, rows_b, K, V, desc_k, desc_v, kv_col, bt_row,
            slash_tiles, full_tile + 1, last_tile + 1, 0, slash_tiles, 0, 0, 0, last_tile - full_tile,
            last_pos,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, False, False, True, False, FUSED_SCALE, FP32,
        )
    else:
        # 1. slash tiles: key tile base + offset for the rows of query tile m0, and (TWO) base + 1 + offset
        # for those of m0 + 1; a tile both read is read once. The ascending list is counted against the bounds
        # first (tiles below 0, tiles wholly below the rows, tiles past the last row): no branch in the loops
        slash = slash_tiles + head * num_slash
        num = tl.load(slash_counts + head)
        cover = slash_cover + head * (cover_r + 2) + cover_r  # cover[d]: 1 when tile offset d is a slash tile
        a_lo, a_full, a_hi = _count_at_most(slash, num, -1 - base, full_tile - base, last_tile - base, CHUNK)
        b_lo, b_full, b_hi = a_lo, a_lo, a_lo
        both_whole, both_diag = 0, 0
        if TWO:
            b_lo, b_full, b_hi = _count_at_most(slash, num, -2 - base, full_tile - base - 1,
                                                last_tile - base - 1, CHUNK)
            both_whole = _count_adjacent(slash, a_lo, a_full, cover, cover_r, CHUNK)
            both_diag = _count_adjacent(slash, a_full, a_hi, cover, cover_r, CHUNK)
        acc, l_i, m_i = _key_tiles(
            acc, l_i, m_i, q, q_pos, rows_b, K, V, desc_k, desc_v, kv_col, bt_row,
            slash, a_lo, a_full, base, slash, b_lo, b_full, base + 1,
            (a_full - a_lo) + (b_full - b_lo) - both_whole, last_pos,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, True, TWO, False, TMA, FUSED_SCALE, FP32,
        )
        acc, l_i, m_i = _key_tiles(
            acc, l_i, m_i, q, q_pos, rows_b, K, V, desc_k, desc_v, kv_col, bt_row,
            slash, a_full, a_hi, base, slash, b_full, b_hi, base + 1,
            (a_hi - a_full) + (b_hi - b_full) - both_diag, last_pos,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, True, TWO, True, False, FUSED_SCALE, FP32,
        )

        # 2. columns up to the last row's position, KEYS at a time, minus those in a slash tile of the row's
        # query tile: their keys and values from the rows staged for the head, in list order
        cols = columns + head * num_cols
        staged = head * num_cols * BLOCK_D
        _, _, live_cols = _count_at_most(cols, tl.load(column_counts + head), last_pos, last_pos, last_pos,
                                         CHUNK)
        for j0 in range(0, live_cols, KEYS):
            offs_j = j0 + tl.arange(0, KEYS)
            live = offs_j < live_cols
            c = tl.load(cols + offs_j, mask=live, other=0)
            d = c // TILE - base
            use = live & (tl.load(cover + d, mask=live & (d >= -cover_r) & (d <= 1), other=0) == 0)
            keep = use[None, :]
            if TWO:
                covered_b = tl.load(cover + d - 1, mask=live & (d - 1 >= -cover_r) & (d <= 2), other=0)
                keep = tl.where(rows_b[:, None], (live & (covered_b == 0))[None, :], keep)
            keep = keep & (c[None, :] <= q_pos[:, None])
            kv_ptrs = staged + offs_j[:, None] * BLOCK_D + offs_d[None, :]
            k = tl.load(StagedK + kv_ptrs, mask=live[:, None], other=0.0)
            v = tl.load(StagedV + kv_ptrs, mask=live[:, None], other=0.0)
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, keep, scale_log2, True, FP32)

        # 3. block-sparse heads: the key tiles listed for each query tile, read by its rows (with TWO: as
        # list b, list a empty)
        if HAS_BLOCKS:
            for p in tl.static_range(PAIR):
                first_p = first_pos + p * TILE
                if first_p <= last_pos:
                    last_p = tl.minimum(first_p + TILE - 1, last_pos)
                    tile_row = head * num_qtiles + m0 + p
                    listed = blocks + tile_row * num_blocks
                    lo, full, hi = _count_at_most(listed, tl.load(block_counts + tile_row), -1,
                                                  (first_p + 1) // TILE - 1, last_p // TILE, CHUNK)
                    rows_p = tl.arange(0, BLOCK_M) // TILE == p
                    whole_end, diag_end = full, hi  # list a's: without TWO, the list; with, nothing
                    if TWO:
                        whole_end, diag_end = lo, full
                    acc, l_i, m_i = _key_tiles(
                        acc, l_i, m_i, q, q_pos, rows_p, K, V, desc_k, desc_v, kv_col, bt_row,
                        listed, lo, whole_end, 0, listed, lo, full, 0, full - lo, last_p,
                        stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
                        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, True, TWO, False, TMA, FUSED_SCALE, FP32,
                    )
                    acc, l_i, m_i = _key_tiles(
                        acc, l_i, m_i, q, q_pos, rows_p, K, V, desc_k, desc_v, kv_col, bt_row,
                        listed, full, diag_end, 0, listed, full, hi, 0, hi - full, last_p,
                        stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
                        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, True, TWO, True, False, FUSED_SCALE, FP32,
                    )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
             (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    # natural log; -inf for a row that read nothing (m_i = -inf, l_i = 0)
    tl.store(Lse + q_rows * stride_lt + h * stride_lh, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
             mask=m_ok)


@triton.jit(do_not_specialize=["stride_bt", "num_cols"])
def _stage_columns_kernel(
    K, V, StagedK, StagedV, ctx_lens, block_tables, columns, column_counts,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_bt, num_cols,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr,
):
    """One program per (``KEYS`` list entries, head, sequence): the keys and values of the head's columns,
    gathered from the paged cache into rows ``[head, entry]`` of ``StagedK``/``StagedV`` (``BLOCK_D`` wide,
    zero past the head size), so that the sparse kernel reads them at addresses its loop count gives. Rows
    past the head's count are not written: the sparse kernel never reads them."""
    h = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    head = s * tl.num_programs(1) + h
    offs_j = tl.program_id(0) * KEYS + tl.arange(0, KEYS)
    offs_d = tl.arange(0, BLOCK_D)
    c = tl.load(columns + head * num_cols + offs_j, mask=offs_j < num_cols, other=0)
    live = (offs_j < tl.load(column_counts + head)) & (c < tl.load(ctx_lens + s))
    phys = tl.load(block_tables + s * stride_bt + c // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    src = phys * stride_kb + (c % BLOCK_SIZE) * stride_ks + (h // GROUP) * stride_kh
    ld = live[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (head * num_cols + offs_j)[:, None] * BLOCK_D + offs_d[None, :]
    tl.store(StagedK + dst, tl.load(K + src[:, None] + offs_d[None, :] * stride_kd, mask=ld, other=0.0),
             mask=live[:, None])
    tl.store(StagedV + dst, tl.load(V + src[:, None] + offs_d[None, :] * stride_kd, mask=ld, other=0.0),
             mask=live[:, None])


def _staged_columns(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, columns: torch.Tensor, column_counts: torch.Tensor,
                    keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[S, H, NV, D']`` in the cache's dtype, allocated per call: every head's columns
    read from the cache in list order (one launch), ``D'`` the head size padded to a power of two."""
    num_seqs, num_heads, num_cols = columns.shape
    head_dim = k_cache.shape[3]
    block_d = next_power_of_2(head_dim)
    staged_k = torch.empty(num_seqs, num_heads, num_cols, block_d, dtype=k_cache.dtype, device=k_cache.device)
    staged_v = torch.empty_like(staged_k)
    if staged_k.numel():
        _stage_columns_kernel[(cdiv(num_cols, keys), num_heads, num_seqs)](
            k_cache, v_cache, staged_k, staged_v, context_lens, block_tables, columns, column_counts,
            *k_cache.stride(), block_tables.stride(0), num_cols,
            GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1],
            KEYS=keys,
        )
    return staged_k, staged_v


@triton.jit(do_not_specialize=["num_cols", "num_slash", "num_qtiles"])
def _density_kernel(
    cu_q, ctx_lens, columns, column_counts, slash_tiles, slash_counts, block_counts, totals,
    num_cols, num_slash, num_qtiles,
    TILE: tl.constexpr, CHUNK: tl.constexpr, HAS_BLOCKS: tl.constexpr,
):
    """One program per (query tile, head, sequence), as the sparse kernel's grid: the work its query tile
    does, added to ``totals[0]``; the sequence's dense causal work for every head to ``totals[1]``."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    head = s * tl.num_programs(1) + h
    q_len = (tl.load(cu_q + s + 1) - tl.load(cu_q + s)).to(tl.int64)
    ctx_len = tl.load(ctx_lens + s).to(tl.int64)
    q_start = ctx_len - q_len
    if (m == 0) & (h == 0):
        dense = (q_start + 1) * q_len + q_len * (q_len - 1) // 2
        tl.atomic_add(totals + 1, dense * tl.num_programs(1))
    first = q_start + m * TILE
    rows = tl.minimum(first + TILE, ctx_len) - first
    if rows > 0:
        base = first // TILE
        last = (first + rows - 1) // TILE
        # slash offsets d with 0 <= base + d <= last; columns up to the tile's last row
        before, upto, _ = _count_at_most(slash_tiles + head * num_slash, tl.load(slash_counts + head),
                                         -base - 1, last - base, 0, CHUNK)
        row_cols, num_row_cols = columns + head * num_cols, tl.load(column_counts + head)
        cols, _, _ = _count_at_most(row_cols, num_row_cols, first + rows - 1, 0, 0, CHUNK)
        work = (upto - before).to(tl.int64) * TILE * rows + cols.to(tl.int64) * rows
        if HAS_BLOCKS:
            work += tl.load(block_counts + head * num_qtiles + m).to(tl.int64) * TILE * rows
        tl.atomic_add(totals, work)


def _density_totals(index: SparseIndex, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                    max_query_len: int) -> torch.Tensor:
    """``[2]`` int64 on the device: the index's work and dense causal work (a fill and one launch)."""
    num_seqs, num_heads = index.columns.shape[:2]
    totals = torch.zeros(2, dtype=torch.int64, device=context_lens.device)
    has_blocks = index.blocks is not None
    block_counts = index.block_counts.contiguous() if has_blocks else totals
    columns, slash = index.columns.contiguous(), index.slash_tiles.contiguous()
    grid = (cdiv(max_query_len, TILE), num_heads, num_seqs)
    if min(grid) > 0:
        _density_kernel[grid](
            cu_seqlens_q, context_lens, columns, index.column_counts.contiguous(), slash,
            index.slash_counts.contiguous(), block_counts, totals,
            columns.shape[2], slash.shape[2], block_counts.shape[2] if has_blocks else 0,
            TILE=TILE, CHUNK=LIST_CHUNK, HAS_BLOCKS=has_blocks,
        )
    return totals


def index_density(index: SparseIndex, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                  max_query_len: int) -> torch.Tensor:
    """:func:`~nanovllm_minference.index.computed_density` (its torch reference) as a float64 device scalar,
    from one launch instead of the torch version's fifty-odd small kernels."""
    totals = _density_totals(index, cu_seqlens_q, context_lens, max_query_len)
    return totals[0].double() / totals[1].double()


def _one_of(*allowed: int):
    def check(_inst, attribute, value) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name}={value}: use one of {allowed} ({attribute.metadata['what']})")

    return check


@attrs.frozen
class SparseKernelConfig:
    """The sparse kernel's knobs; none changes a result beyond float rounding.

    ``block_m`` query rows a program: ``TILE`` (one query tile of the index) or ``2 * TILE`` (two, each
    reading its own tiles, a key tile both read loaded once). ``keys`` a step: ``TILE``, or a half or a
    quarter of it. ``num_warps``; ``num_stages``, Triton's software pipeline depth. ``fused_scale``: tiles
    below every row apply the softmax scale inside the exponent's multiply-add, one float operation a score
    fewer (rounding differs in the last bits). ``tma``: those tiles come through tensor-memory (TMA) loads
    where a KV page holds whole steps (pages of ``keys`` keys or a multiple; Hopper and later, or the
    interpreter; a head size that is a power of two); elsewhere it is ignored."""

    block_m: int = attrs.field(validator=_one_of(TILE, 2 * TILE),
                               metadata={"what": "one or two of the index's query tiles"})
    keys: int = attrs.field(validator=_one_of(TILE, TILE // 2, TILE // 4),
                            metadata={"what": "a key tile or a part of it"})
    num_warps: int
    num_stages: int
    fused_scale: bool = False
    tma: bool = False


def kernel_config(head_dim: int, dtype: torch.dtype, device: torch.device, has_blocks: bool = False,
                  block_size: int = 16) -> SparseKernelConfig:
    """The kernel's knobs for a launch, by device, dtype, head size and KV cache ``block_size`` (tokens a
    page; 16, the engine's default, unless given): one query tile a program and plain loads off CUDA (the
    interpreter). On CUDA, 16-bit and head size up to 128: the fused scale and TMA loads, with one query tile
    a program over 4 warps where a page holds whole key tiles (``block_size`` a multiple of 64) or the index
    has block-sparse heads (``has_blocks``: two query tiles would read their listed tiles one after the
    other, each with the other's rows idle); over smaller pages, the dense prefill kernel's long-prompt
    choice, 128 query rows a program over 8 warps. Over head size 128 or in float32 a step reads 32 keys, to
    keep the K/V stages within shared memory; but in 16-bit, without block-sparse heads, on a device with
    the shared memory for them (Hopper), two query tiles and whole key tiles over 8 warps in two stages, as
    the dense kernel does at that head size."""
    if device.type != "cuda":
        return SparseKernelConfig(TILE, TILE, 1, 1)
    if (head_dim > 128 and dtype != torch.float32 and not has_blocks
            and max_shared_memory(device) >= WIDE_TILES_SHARED_MEMORY):
        return SparseKernelConfig(2 * TILE, TILE, 8, 2, fused_scale=True)
    if dtype == torch.float32 or head_dim > 128:
        return SparseKernelConfig(TILE, TILE // 2, 4, 2, fused_scale=True)
    if has_blocks or block_size % TILE == 0:
        return SparseKernelConfig(TILE, TILE, 4, 3, fused_scale=True, tma=True)
    return SparseKernelConfig(2 * TILE, TILE, 8, 3, fused_scale=True, tma=True)


def sparse_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, index: SparseIndex, scale: float,
    max_query_len: int, *, dense_above: float | None = None, config: SparseKernelConfig | tuple | None = None,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse prefill attention (Triton): ``(out [T, H, D] in q's dtype, lse [T, H] float32)``.

    ``max_query_len`` (a host int) sizes the grid; ``host_lens``, the reference's, goes unused (the kernel
    reads the lengths on the device). ``dense_above``: when the index computes more than this
    share of dense causal work (:func:`~nanovllm_minference.index.computed_density`), the kernel attends to
    every key up to each row instead (dense causal attention). The share is computed on the GPU (a fill and
    one launch) and the kernel reads it there: nothing waits on the host. ``config`` (a
    :class:`SparseKernelConfig` or its leading fields) overrides :func:`kernel_config` (benchmarks, tests)."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, index)
    num_heads, head_dim = q.shape[1:]
    if config is None:
        cfg = kernel_config(head_dim, q.dtype, q.device, index.blocks is not None, k_cache.shape[1])
    else:
        cfg = config if isinstance(config, SparseKernelConfig) else SparseKernelConfig(*config)
    if index.blocks is not None and index.blocks.shape[2] < cdiv(max_query_len, TILE):
        raise ValueError(
            f"index.blocks lists {index.blocks.shape[2]} query tiles but max_query_len {max_query_len} makes "
            f"{cdiv(max_query_len, TILE)}: give one list per query tile of the longest chunk"
        )
    index_tensors = [t for t in attrs.astuple(index, recurse=False) if t is not None]
    out, lse, launch = prefill_kernel_outputs(
        _sparse_prefill_kernel, "sparse_attention", q, cu_seqlens_q,
        [*index_tensors, block_tables, cu_seqlens_q, context_lens], "the index, block tables and lengths",
    )
    if not launch:
        return out, lse
    totals = None
    if dense_above is not None:
        totals = _density_totals(index, cu_seqlens_q, context_lens, max_query_len)
    has_blocks = index.blocks is not None
    columns, slash = index.columns.contiguous(), index.slash_tiles.contiguous()
    column_counts, slash_counts = index.column_counts.contiguous(), index.slash_counts.contiguous()
    cover = index.slash_cover.contiguous()
    if has_blocks:
        blocks, block_counts = index.blocks.contiguous(), index.block_counts.contiguous()
    else:
        blocks, block_counts = column_counts, column_counts  # never read
    descs = paged_kv_descriptors(k_cache, v_cache, cfg.keys) if cfg.tma else None
    staged = _staged_columns(k_cache, v_cache, block_tables, context_lens, columns, column_counts, cfg.keys)
    grid = (cdiv(max_query_len, cfg.block_m), num_heads, cu_seqlens_q.shape[0] - 1)
    _sparse_prefill_kernel[grid](
        q, k_cache, v_cache, out, lse, *(descs or (k_cache, v_cache)), *staged,
        cu_seqlens_q, context_lens, block_tables,
        columns, column_counts, slash, slash_counts, cover, blocks, block_counts,
        column_counts if totals is None else totals,  # never read unguarded
        scale * LOG2E, 0.0 if dense_above is None else dense_above,
        *q.stride(), *k_cache.stride(), *out.stride(), *lse.stride(),
        block_tables.stride(0), columns.shape[2], slash.shape[2], index.cover_offset,
        blocks.shape[2] if has_blocks else 0, blocks.shape[3] if has_blocks else 0,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE, BLOCK_M=cfg.block_m, KEYS=cfg.keys, CHUNK=LIST_CHUNK,
        HAS_BLOCKS=has_blocks,
        FP32=q.dtype == torch.float32 or q.device.type != "cuda",  # the interpreter's bfloat16 dot is wrong
        GUARDED=totals is not None, TMA=descs is not None, FUSED_SCALE=cfg.fused_scale,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------


def _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, index: SparseIndex) -> None:
    check_paged_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {tuple(k_cache.stride())} and v_cache strides "
                         f"{tuple(v_cache.stride())}: the kernel reads both through one layout; pass "
                         "contiguous caches of one shape")
    num_seqs, num_heads = cu_seqlens_q.shape[0] - 1, q.shape[1]
    heads = (num_seqs, num_heads)
    for name in ("columns", "slash_tiles", "slash_cover"):
        tensor = getattr(index, name)
        if tensor.dim() != 3 or tuple(tensor.shape[:2]) != heads:
            raise ValueError(f"index.{name} {tuple(tensor.shape)}: expected [{num_seqs}, {num_heads}, width]")
    for name in ("column_counts", "slash_counts"):
        shape = tuple(getattr(index, name).shape)
        if shape != heads:
            raise ValueError(f"index.{name} {shape}: expected [{num_seqs}, {num_heads}]")
    if index.slash_cover.shape[2] < 2:
        raise ValueError("index.slash_cover is narrower than 2: it covers tile offsets -R..1, R >= 0")
    if (index.blocks is None) != (index.block_counts is None):
        raise ValueError("index.blocks and index.block_counts: give both or neither")
    if index.blocks is not None and (
        index.blocks.dim() != 4 or tuple(index.blocks.shape[:2]) != heads
        or tuple(index.block_counts.shape) != tuple(index.blocks.shape[:3])
    ):
        raise ValueError(
            f"index.blocks {tuple(index.blocks.shape)}, block_counts {tuple(index.block_counts.shape)}: "
            f"expected [{num_seqs}, {num_heads}, M, NB] and [{num_seqs}, {num_heads}, M]"
        )


def _dense_mask(index: SparseIndex, s: int, q_start: int, query_len: int, ctx_len: int) -> torch.Tensor:
    """[H, query_len, ctx_len] bool: the keys each row of sequence ``s`` reads, straight from the lists."""
    device = index.columns.device
    num_heads = index.columns.shape[1]
    rows = torch.arange(query_len, device=device)
    keys = torch.arange(ctx_len, device=device)
    row_pos = q_start + rows
    query_tile = rows // TILE
    base = (q_start + TILE * query_tile) // TILE  # [rows]
    key_tile = keys // TILE
    num_key_tiles = -(-ctx_len // TILE)
    heads = torch.arange(num_heads, device=device)[:, None]

    def listed(entries: torch.Tensor, counts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """[..., hi - lo] bool: which of lo..hi-1 the first ``counts`` entries of each list name."""
        real = torch.arange(entries.shape[-1], device=device) < counts[..., None]
        real &= (entries >= lo) & (entries < hi)
        hits = torch.zeros(*entries.shape[:-1], hi - lo + 1, dtype=torch.bool, device=device)
        # entries that are padding or out of range land in the extra last slot, dropped below
        hits.scatter_(-1, torch.where(real, entries - lo, hi - lo).long(), True)
        return hits[..., :-1]

    # slash: tile offsets range over -(num_key_tiles - 1) .. num_key_tiles - 1 here
    span = num_key_tiles
    slash = listed(index.slash_tiles[s], index.slash_counts[s], -span, span)  # [H, 2 * span]
    offset = key_tile[None, :] - base[:, None] + span  # [rows, keys]
    mask = slash[:, offset]
    mask |= listed(index.columns[s], index.column_counts[s], 0, ctx_len)[:, None, :]
    if index.blocks is not None:
        num_query_tiles = -(-query_len // TILE)
        if index.blocks.shape[2] < num_query_tiles:
            raise ValueError(
                f"index.blocks lists {index.blocks.shape[2]} query tiles but sequence {s} has "
                f"{num_query_tiles}: give one list per query tile of the longest chunk"
            )
        blocks = listed(index.blocks[s, :, :num_query_tiles], index.block_counts[s, :, :num_query_tiles], 0,
                        num_key_tiles)  # [H, query tiles, key tiles]
        mask |= blocks[heads[:, :, None], query_tile[None, :, None], key_tile[None, None, :]]
    return mask & (keys[None, :] <= row_pos[:, None])


def sparse_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, index: SparseIndex, scale: float,
    max_query_len: int, *, dense_above: float | None = None,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse prefill attention (torch, any device; the oracle): a dense mask per sequence, float32 softmax.
    Same arguments and results as :func:`sparse_attention`; ``host_lens``, the query and context lengths as
    host ints (``PhaseMetadata.host_lens``), saves reading them from the tensors."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, index)
    dense = dense_above is not None and computed_density(index, cu_seqlens_q, context_lens,
                                                         max_query_len) > dense_above
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    host_lens = host_lengths(cu_seqlens_q, context_lens, host_lens)
    query_lens, ctx = host_lens
    for s, (first_row, query_len) in enumerate(zip(accumulate(query_lens, initial=0), query_lens)):
        rows = slice(first_row, first_row + query_len)
        if query_len == 0:
            continue
        pos = torch.arange(ctx[s], device=q.device)
        phys = block_tables[s].long()[pos // block_size]
        k = k_cache[phys, pos % block_size].float().repeat_interleave(group, dim=1)  # [C, H, D]
        v = v_cache[phys, pos % block_size].float().repeat_interleave(group, dim=1)
        mask = _dense_mask(index, s, ctx[s] - query_len, query_len, ctx[s]).to(q.device)
        if dense:  # every key up to the row
            row_pos = ctx[s] - query_len + torch.arange(query_len, device=q.device)
            mask = (pos[None, :] <= row_pos[:, None])[None].expand_as(mask)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf for a row that reads nothing
        probs = torch.where(mask, torch.exp(scores - row_lse[..., None]), 0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        lse[rows] = row_lse.T
    return out, lse


__all__ = ["sparse_attention", "sparse_attention_reference", "SparseKernelConfig", "kernel_config"]
