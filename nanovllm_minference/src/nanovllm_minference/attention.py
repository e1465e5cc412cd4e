"""MInference sparse prefill attention over the paged KV cache: a Triton kernel and its torch reference.

Both compute, for each query row of a prefill phase, softmax attention over exactly the keys that the
row reads under a :class:`~nanovllm_minference.index.SparseIndex` (see :mod:`nanovllm_minference.index`),
and return ``(out [T, H, D] in q's dtype, lse [T, H] float32)``; ``lse`` is the natural log of the sum of
``exp(scale * q.k)`` over the keys read. A row that reads no key gets out 0 and lse -inf.

The kernel runs one program per (query tile, head, sequence) and feeds one online softmax (base 2)
from three loops, each reading ``KEYS`` keys a step (64, or 32 over head size 128):

1. the head's slash tiles, key tile ``base + offset``: tiles wholly below every row of the query tile
   (and so inside the context) without masks, the tiles on the diagonal with the causal mask;
2. the head's columns, gathered, minus those whose tile is a slash tile (slash_cover), with the causal
   mask;
3. (only for an index with blocks) the key tiles listed for the query tile, split like loop 1.

The ascending lists are first counted against the tile's bounds (tiles below 0, tiles wholly below the
rows, tiles past the last row), so every loop runs over exactly the entries it needs, without branches.
With ``dense_above`` every program first reads the index's work against dense work (computed on the GPU
by the launch before) and, where the index is the denser, runs the loops of dense causal attention
instead: the fallback needs no host sync.
On CPU tensors the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported) with float32 dots: the interpreter's bfloat16 dot is wrong.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl
from nanovllm.attention.backend import check_paged_inputs, prefill_kernel_outputs
from nanovllm.sparse import online_softmax_step, tile_blocks

from nanovllm_minference.index import TILE, SparseIndex, computed_density

LOG2E = 1.4426950408889634
LIST_CHUNK = 1024  # list entries counted per step of the pre-scans: most lists take one step


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
def _key_rows(bt_row, start, end, stride_kb, stride_ks, KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Row offsets (into the K/V head) and positions of keys ``start .. start + KEYS - 1``; keys at or past
    ``end`` do not read the block table (offset 0)."""
    pos = start + tl.arange(0, KEYS)
    phys = tile_blocks(bt_row, start, end, KEYS, BLOCK_SIZE).to(tl.int64)
    return phys * stride_kb + (pos % BLOCK_SIZE) * stride_ks, pos


@triton.jit
def _whole_tiles(
    acc, l_i, m_i, q, K, V, bt_row, entries, n_lo, n_hi, shift, last_pos,
    stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    KEYS: tl.constexpr, LISTED: tl.constexpr, FP32: tl.constexpr,
):
    """Attend without masks to key tiles ``shift + e`` for list entries ``e`` number ``n_lo .. n_hi - 1``
    (``LISTED``; else the entries are the numbers themselves), ``KEYS`` keys a step. The next step's list
    entry and block-table entries are read a step ahead: Triton pipelines a key load whose address waits on
    a load of its own iteration 2 deep, not 3."""
    SUB: tl.constexpr = TILE // KEYS
    if LISTED:
        t_next = shift + tl.load(entries + n_lo, mask=n_lo < n_hi, other=-shift)  # past the list: tile 0
    else:
        t_next = shift + n_lo
    rows_next, _ = _key_rows(bt_row, t_next * TILE, last_pos + 1, stride_kb, stride_ks, KEYS, BLOCK_SIZE)
    for i in range(n_lo * SUB, n_hi * SUB):
        rows = rows_next
        step = i + 1
        if LISTED:
            t_next = shift + tl.load(entries + step // SUB, mask=step < n_hi * SUB, other=-shift)
        else:
            t_next = shift + step // SUB
        rows_next, _ = _key_rows(bt_row, t_next * TILE + (step % SUB) * KEYS, last_pos + 1, stride_kb,
                                 stride_ks, KEYS, BLOCK_SIZE)
        if BLOCK_D == HEAD_DIM:
            k = tl.load(K + rows[:, None] + offs_d[None, :] * stride_kd)
            v = tl.load(V + rows[:, None] + offs_d[None, :] * stride_kd)
        else:
            k = tl.load(K + rows[:, None] + offs_d[None, :] * stride_kd, mask=d_ok[None, :], other=0.0)
            v = tl.load(V + rows[:, None] + offs_d[None, :] * stride_kd, mask=d_ok[None, :],
                        other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, None, scale_log2, False, FP32)
    return acc, l_i, m_i


@triton.jit
def _diagonal_tiles(
    acc, l_i, m_i, q, q_pos, K, V, bt_row, entries, n_lo, n_hi, shift, last_pos,
    stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, KEYS: tl.constexpr, LISTED: tl.constexpr,
    FP32: tl.constexpr,
):
    """As :func:`_whole_tiles`, for tiles that reach the query rows: the causal mask, nothing past
    ``last_pos`` read."""
    SUB: tl.constexpr = TILE // KEYS
    for i in range(n_lo * SUB, n_hi * SUB):
        if LISTED:
            t = shift + tl.load(entries + i // SUB)
        else:
            t = shift + i // SUB
        rows, pos = _key_rows(bt_row, t * TILE + (i % SUB) * KEYS, last_pos + 1, stride_kb, stride_ks, KEYS,
                              BLOCK_SIZE)
        ld = (pos <= last_pos)[:, None] & d_ok[None, :]
        k = tl.load(K + rows[:, None] + offs_d[None, :] * stride_kd, mask=ld, other=0.0)
        v = tl.load(V + rows[:, None] + offs_d[None, :] * stride_kd, mask=ld, other=0.0)
        keep = pos[None, :] <= q_pos[:, None]
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, keep, scale_log2, True, FP32)
    return acc, l_i, m_i


@triton.jit
def _listed_tiles(
    acc, l_i, m_i, q, q_pos, first_pos, last_pos, K, V, bt_row, entries, n_entries, shift,
    stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    KEYS: tl.constexpr, CHUNK: tl.constexpr, FP32: tl.constexpr,
):
    """Attend to the key tiles ``shift + e`` for the entries ``e`` of an ascending list (slash offsets
    with shift = base tile, or listed key tiles with shift = 0). ``K``/``V`` point at the KV head."""
    full_tile = (first_pos + 1) // TILE - 1  # the last tile every row of the query tile reads whole
    last_tile = last_pos // TILE  # tiles past it hold no key any row reads
    j_lo, j_full, j_hi = _count_at_most(entries, n_entries, -1 - shift, full_tile - shift, last_tile - shift,
                                        CHUNK)
    # below every row and inside the context: no masks
    acc, l_i, m_i = _whole_tiles(
        acc, l_i, m_i, q, K, V, bt_row, entries, j_lo, tl.maximum(j_lo, j_full), shift, last_pos,
        stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, True, FP32,
    )
    # the diagonal: causal mask
    return _diagonal_tiles(
        acc, l_i, m_i, q, q_pos, K, V, bt_row, entries, tl.maximum(j_lo, j_full), j_hi, shift, last_pos,
        stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
        BLOCK_SIZE, TILE, KEYS, True, FP32,
    )


# list widths and strides change from step to step: one compiled kernel for all of them
@triton.jit(do_not_specialize=["stride_bt", "num_cols", "num_slash", "cover_r", "num_qtiles", "num_blocks"])
def _sparse_prefill_kernel(
    Q, K, V, Out, Lse,
    cu_q, ctx_lens, block_tables,
    columns, column_counts, slash_tiles, slash_counts, slash_cover, blocks, block_counts, totals,
    scale_log2, dense_above,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_bt, num_cols, num_slash, cover_r, num_qtiles, num_blocks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, KEYS: tl.constexpr, CHUNK: tl.constexpr, HAS_BLOCKS: tl.constexpr,
    FP32: tl.constexpr, GUARDED: tl.constexpr,
):
    # last query tiles first: under a causal mask they have the most keys
    m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    row0 = tl.load(cu_q + s)
    q_len = tl.load(cu_q + s + 1) - row0
    if m * TILE >= q_len:
        return
    ctx_len = tl.load(ctx_lens + s)
    q_start = ctx_len - q_len  # position of the chunk's first row
    first_pos = q_start + m * TILE
    last_pos = q_start + tl.minimum(m * TILE + TILE, q_len) - 1
    base = first_pos // TILE
    kvh = h // GROUP
    head = s * tl.num_programs(1) + h  # (sequence, head) row of the index

    offs_m = m * TILE + tl.arange(0, TILE)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = (row0 + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = q_start + offs_m
    K += kvh * stride_kh
    V += kvh * stride_kh
    bt_row = block_tables + s * stride_bt

    m_i = tl.full([TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE, BLOCK_D], tl.float32)

    dense = False
    if GUARDED:  # totals: the index's work and dense causal work (index_density's); above the share, dense
        dense = tl.load(totals).to(tl.float64) > dense_above * tl.load(totals + 1).to(tl.float64)
    if dense:
        # every key up to the row: the tiles below every row whole, then the diagonal
        full = (first_pos + 1) // TILE
        acc, l_i, m_i = _whole_tiles(
            acc, l_i, m_i, q, K, V, bt_row, slash_tiles, 0, full, 0, last_pos,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, False, FP32,
        )
        acc, l_i, m_i = _diagonal_tiles(
            acc, l_i, m_i, q, q_pos, K, V, bt_row, slash_tiles, full, last_pos // TILE + 1, 0, last_pos,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            BLOCK_SIZE, TILE, KEYS, False, FP32,
        )
    else:
        # 1. slash tiles: key tile base + offset
        acc, l_i, m_i = _listed_tiles(
            acc, l_i, m_i, q, q_pos, first_pos, last_pos, K, V, bt_row,
            slash_tiles + head * num_slash, tl.load(slash_counts + head), base,
            stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, CHUNK, FP32,
        )

        # 2. columns up to the last row's position, KEYS at a time, minus those in slash tiles
        cols = columns + head * num_cols
        _, _, live_cols = _count_at_most(cols, tl.load(column_counts + head), last_pos, last_pos, last_pos,
                                         CHUNK)
        cover = slash_cover + head * (cover_r + 2) + cover_r  # cover[d]: 1 when tile offset d is a slash tile
        for j0 in range(0, live_cols, KEYS):
            offs_j = j0 + tl.arange(0, KEYS)
            live = offs_j < live_cols
            c = tl.load(cols + offs_j, mask=live, other=0)
            d = c // TILE - base
            covered = tl.load(cover + d, mask=live & (d >= -cover_r) & (d <= 1), other=0)
            use = live & (covered == 0)
            phys = tl.load(bt_row + c // BLOCK_SIZE, mask=use, other=0).to(tl.int64)
            rows = phys * stride_kb + (c % BLOCK_SIZE) * stride_ks
            ld = use[:, None] & d_ok[None, :]
            k = tl.load(K + rows[:, None] + offs_d[None, :] * stride_kd, mask=ld, other=0.0)
            v = tl.load(V + rows[:, None] + offs_d[None, :] * stride_kd, mask=ld, other=0.0)
            keep = use[None, :] & (c[None, :] <= q_pos[:, None])
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, keep, scale_log2, True, FP32)

        # 3. block-sparse heads: the key tiles listed for this query tile
        if HAS_BLOCKS:
            tile_row = head * num_qtiles + m
            acc, l_i, m_i = _listed_tiles(
                acc, l_i, m_i, q, q_pos, first_pos, last_pos, K, V, bt_row,
                blocks + tile_row * num_blocks, tl.load(block_counts + tile_row), 0,
                stride_kb, stride_ks, stride_kd, offs_d, d_ok, scale_log2,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, KEYS, CHUNK, FP32,
            )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
             (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    # natural log; -inf for a row that read nothing (m_i = -inf, l_i = 0)
    tl.store(Lse + q_rows * stride_lt + h * stride_lh, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
             mask=m_ok)


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
    grid = (triton.cdiv(max_query_len, TILE), num_heads, num_seqs)
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


def _launch_config(q: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(keys a step, num_warps, num_stages). Over head size 128 a step reads 32 keys, as the dense paged
    kernel's tiles at that size: a 64-key step's K and V stages fill shared memory, one program a
    multiprocessor."""
    if q.device.type != "cuda":
        return TILE, 1, 1
    if q.dtype == torch.float32 or head_dim > 128:  # keep the K/V stages within shared memory
        return TILE // 2, 4, 2
    return TILE, 4, 3


def sparse_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, index: SparseIndex, scale: float,
    max_query_len: int, *, dense_above: float | None = None, config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse prefill attention (Triton): ``(out [T, H, D] in q's dtype, lse [T, H] float32)``.

    ``max_query_len`` (a host int) sizes the grid. ``dense_above``: when the index computes more than this
    share of dense causal work (:func:`~nanovllm_minference.index.computed_density`), the kernel attends to
    every key up to each row instead (dense causal attention). The share is computed on the GPU (a fill and
    one launch) and the kernel reads it there: nothing waits on the host. ``config`` overrides ``(keys a
    step, num_warps, num_stages)`` (benchmarks)."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, index)
    if index.blocks is not None and index.blocks.shape[2] < triton.cdiv(max_query_len, TILE):
        raise ValueError(
            f"index.blocks lists {index.blocks.shape[2]} query tiles but max_query_len {max_query_len} makes "
            f"{triton.cdiv(max_query_len, TILE)}: give one list per query tile of the longest chunk"
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
    num_heads, head_dim = q.shape[1:]
    has_blocks = index.blocks is not None
    columns, slash = index.columns.contiguous(), index.slash_tiles.contiguous()
    column_counts, slash_counts = index.column_counts.contiguous(), index.slash_counts.contiguous()
    cover = index.slash_cover.contiguous()
    if has_blocks:
        blocks, block_counts = index.blocks.contiguous(), index.block_counts.contiguous()
    else:
        blocks, block_counts = column_counts, column_counts  # never read
    keys, warps, stages = config or _launch_config(q, head_dim)
    grid = (triton.cdiv(max_query_len, TILE), num_heads, cu_seqlens_q.shape[0] - 1)
    _sparse_prefill_kernel[grid](
        q, k_cache, v_cache, out, lse,
        cu_seqlens_q, context_lens, block_tables,
        columns, column_counts, slash, slash_counts, cover, blocks, block_counts,
        column_counts if totals is None else totals,  # never read unguarded
        scale * LOG2E, 0.0 if dense_above is None else dense_above,
        *q.stride(), *k_cache.stride(), *out.stride(), *lse.stride(),
        block_tables.stride(0), columns.shape[2], slash.shape[2], index.cover_offset,
        blocks.shape[2] if has_blocks else 0, blocks.shape[3] if has_blocks else 0,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE, KEYS=keys, CHUNK=LIST_CHUNK, HAS_BLOCKS=has_blocks,
        FP32=q.dtype == torch.float32 or q.device.type != "cuda",  # the interpreter's bfloat16 dot is wrong
        GUARDED=totals is not None, num_warps=warps, num_stages=stages,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse prefill attention (torch, any device; the oracle): a dense mask per sequence, float32 softmax.
    Same arguments and results as :func:`sparse_attention`."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, index)
    dense = dense_above is not None and computed_density(index, cu_seqlens_q, context_lens,
                                                         max_query_len) > dense_above
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for s in range(len(ctx)):
        rows = slice(cu[s], cu[s + 1])
        query_len = cu[s + 1] - cu[s]
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


__all__ = ["sparse_attention", "sparse_attention_reference"]
