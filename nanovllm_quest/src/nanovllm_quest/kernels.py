"""Quest's steps as Triton kernels, same signatures and results as :mod:`nanovllm_quest.reference`.

- ``update_metadata``: one program per (new row, KV head) over the rows grouped by bound; the first
  row of each bound's run folds the run's keys into its min/max, so no two programs write one
  anchor and no atomics are needed. Float8 bounds are rounded outward from float32 bits (``_round_fp8``).
- ``page_scores``: one program per (sequence, KV head, tile of pages), taken in steps of up to
  ``SCORE_STEP`` bounds; it reads only the metadata of the tile's anchors (a bound splits into two small
  matmuls, ``relu(q) . max + min(q, 0) . min``; float8 bounds in float16, the query scaled into its range),
  keeps the largest of each page's bounds, and reduces the GQA group's. A program whose pages all lie past
  the sequence's history (a block table as wide as ``max_model_len``) only stores ``-inf``.
- ``top_pages``: one program per (sequence, KV head). The k-th largest score is found by bisection on
  the order-preserving integer image of the float scores (up to 32 counting passes over the row held in
  registers, from the first bit where the row's smallest and largest finite scores differ, ending early at
  a candidate with exactly k scores at or above it; a row of at most k valid pages takes them all,
  unsearched), then the chosen pages are compacted in ascending order with a prefix sum and written as
  their blocks. Ties at the k-th score go to the lower index; they are ranked only in a row where more than
  k scores reach it.
- ``rescore_pages``: one program per (sequence, KV head, tile of nominated pages): the tile's keys in one
  dot with the GQA group's queries, each page's largest logit per head, the group's reduced; forced pages
  stay ``+inf``. ``pick_nominees`` is ``top_pages``' selection over those scores, written as the nominees'
  pages.
- ``group_reduction=mass``: ``page_scores`` and ``rescore_pages`` write each query head's row (its bounds,
  or its log page weights) instead of the group's, since a head's softmax needs its whole row, which spans
  many programs. One program per (sequence, KV head) then turns its heads' rows into the group's summed
  shares (``_shares_kernel``: each head's log-sum-exp, then the shares, forced and padded) and, in
  ``select_pages`` and ``pick_by_keys``, selects from them with ``top_pages``' selection: so a Quest layer
  is two launches with any reduction, four with ``rescore``, each small torch op a launch saved.
Scoring and top-K stay two launches: why the fused alternatives were not kept is in docs/design-notes.md.

No host synchronisation and no data-dependent shape: all are captured in the decode CUDA graphs.
On CPU tensors they run under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first
imported), for tests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from nanovllm.sparse import cdiv, next_power_of_2, num_sms

from nanovllm_quest.reference import PageRows

# bounds per scoring program (16 KB of bf16 metadata at head size 128; pages of one bound by default):
# small tiles make many programs, so that a short batch still spreads over every multiprocessor
SCORE_TILE = 32
# float8 bounds in float16 dots: up to 128 a program (32 KB), halved while the grid has fewer than two
# programs per multiprocessor
SCORE_TILE_FP8 = 128
# bounds scored at a time: a program of more takes them in steps, the next step's loads issued before this
# step's dots, so that reading the metadata overlaps the arithmetic
SCORE_STEP = 64
# a row of up to this many pages (256K tokens at pages of 16) stays in registers; wider rows are read
# again from memory on each pass of the search
MAX_TOPK_TILE = 16384
MAX_UPDATE_ROWS = 64  # new keys an update program folds at a time
RESCORE_ROWS = 64  # keys a rescoring program reads (4 pages of 16)
# logits a shares program holds at a time (its query heads' rows, padded): a row of up to this many stays in
# registers between the two passes, wider ones are read again
SHARES_TILE = 8192
# a kernel's GQA group reduction: 0 the largest, 1 the sum, 2 none (each query head's row, for the shares)
REDUCTIONS = {"max": 0, "sum": 1, "mass": 2}


@triton.jit
def _update_kernel(
    Key, Meta, Anchors, Order, Positions, num_rows,
    stride_kt, stride_kh, stride_mb, stride_mh, stride_mm,
    BOUND_SIZE: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BOUNDS: tl.constexpr, ORDERED: tl.constexpr, FP8: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    anchor = tl.load(Anchors + r)
    prev = tl.where(r > 0, tl.load(Anchors + tl.maximum(r - 1, 0)), -2)
    leader = (anchor >= 0) & (prev != anchor)  # the first row of this anchor's run
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    new_min = tl.full([BLOCK_D], float("inf"), tl.float32)
    new_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
    fresh = tl.zeros([], tl.int32)
    start = r
    go = leader
    while go:  # the run, ROWS rows at a time (rows of a page shared by sequences can outnumber the page)
        # masks compare index vectors with scalar limits (the interpreter cannot AND a scalar into a mask)
        rows = start + tl.arange(0, ROWS)
        same = tl.load(Anchors + rows, mask=rows < num_rows, other=-1) == anchor
        if ORDERED:
            src = tl.load(Order + rows, mask=same, other=0)
        else:
            src = rows
        at_start = tl.load(Positions + src, mask=same, other=1) % BOUND_SIZE == 0  # the bound's first token
        fresh = tl.maximum(fresh, tl.max((same & at_start).to(tl.int32), 0))
        keys = tl.load(
            Key + src.to(tl.int64)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=same[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)
        new_min = tl.minimum(new_min, tl.min(tl.where(same[:, None], keys, float("inf")), 0))
        new_max = tl.maximum(new_max, tl.max(tl.where(same[:, None], keys, float("-inf")), 0))
        start += ROWS
        go = (start < num_rows) & (tl.load(Anchors + tl.minimum(start, num_rows - 1)) == anchor)
    # a program that is not a leader loads and stores nothing: its limits are 0
    bound = tl.where(leader, anchor, 0).to(tl.int64)  # block * BOUNDS + j: min and max in rows 2j, 2j + 1
    base = Meta + bound // BOUNDS * stride_mb + kvh * stride_mh + bound % BOUNDS * 2 * stride_mm + offs_d
    write = offs_d < tl.where(leader, HEAD_DIM, 0)
    keep_old = offs_d < tl.where(leader & (fresh == 0), HEAD_DIM, 0)  # a restarted bound forgets its keys
    old_min = _to_float32(tl.load(base, mask=keep_old, other=0.0), FP8)
    old_max = _to_float32(tl.load(base + stride_mm, mask=keep_old, other=0.0), FP8)
    old_min = tl.where(keep_old, old_min, float("inf"))  # float8 has no infinity: fill after the load
    old_max = tl.where(keep_old, old_max, float("-inf"))
    low = tl.minimum(old_min, new_min)
    high = tl.maximum(old_max, new_max)
    if FP8:  # rounded outward; an unbounded (NaN) page stays unbounded until it restarts
        tl.store(base, _round_fp8(tl.where(old_min != old_min, old_min, low), False), mask=write)
        tl.store(base + stride_mm, _round_fp8(tl.where(old_max != old_max, old_max, high), True), mask=write)
    else:
        tl.store(base, low.to(Meta.dtype.element_ty), mask=write)
        tl.store(base + stride_mm, high.to(Meta.dtype.element_ty), mask=write)


@triton.jit
def _to_float32(x, FP8: tl.constexpr):
    """Metadata as float32; float8's NaN stays NaN (Triton's interpreter reads it as 480). Scoring in 16
    bits converts float8 directly instead, sparing a test and a select per value."""
    if FP8:
        return tl.where((x.to(tl.int8, bitcast=True) & 0x7F) == 0x7F, float("nan"), x.to(tl.float32))
    return x.to(tl.float32)


@triton.jit
def _float16_scaled(x):
    """``x`` times a power of two, as float16, with the inverse power. The largest magnitude lands in [2^14,
    2^15), so a 16-bit ``x`` converts exactly but for values over 2^28 below its largest, and its products
    with float8 values are exact in float32, as a bfloat16 ``x``'s are."""
    x = x.to(tl.float32)
    top = tl.max(tl.max(tl.abs(x), 1), 0)
    exp = tl.maximum((top.to(tl.int32, bitcast=True) >> 23) & 0xFF, 14)  # biased exponent of the largest
    up = ((268 - exp) << 23).to(tl.float32, bitcast=True)  # 2^(141 - exp): the largest to 2^14
    down = ((exp - 14) << 23).to(tl.float32, bitcast=True)
    return (x * up).to(tl.float16), down


@triton.jit
def _round_fp8(x, UP: tl.constexpr):
    """:func:`reference.round_fp8` from float32 bits, without a float8 conversion (Triton's interpreter
    drops a rounding's carry into the exponent): the magnitude truncated to e4m3, plus one unit when
    rounding away from zero leaves a remainder; NaN past the range and for NaN."""
    xb = x.to(tl.int32, bitcast=True)
    negative = xb < 0
    mag = xb & 0x7FFFFFFF
    exp = mag >> 23
    normal = exp >= 121  # |x| >= 2^-6, e4m3's smallest normal
    scaled = tl.abs(x) * 512.0  # e4m3 subnormals are multiples of 2^-9
    whole = tl.floor(scaled)
    units = tl.where(normal, ((exp - 120) << 3) | ((mag >> 20) & 7), whole.to(tl.int32))
    inexact = tl.where(normal, (mag & 0xFFFFF) != 0, scaled != whole)
    if UP:
        away = negative == 0
    else:
        away = negative
    units = tl.where(away, units + inexact.to(tl.int32), tl.minimum(units, 0x7E))
    bits = tl.where(negative, units | 0x80, units)
    bits = tl.where((units > 0x7E) | (mag > 0x7F800000), 0x7F, bits)  # past 448, or NaN
    return bits.to(tl.int8).to(tl.float8e4nv, bitcast=True)


def update_metadata(
    metadata: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, rows: PageRows, bound_size: int
) -> None:
    num_rows, num_kv_heads, head_dim = key.shape
    if num_rows == 0:
        return
    assert key.stride(-1) == 1 and metadata.stride(-1) == 1, "keys and metadata must be contiguous per head"
    ordered = rows.order is not None
    _update_kernel[(num_rows, num_kv_heads)](
        key, metadata, rows.anchor, rows.order if ordered else rows.anchor, positions, num_rows,
        key.stride(0), key.stride(1), metadata.stride(0), metadata.stride(1), metadata.stride(2),
        BOUND_SIZE=bound_size, ROWS=min(next_power_of_2(bound_size), MAX_UPDATE_ROWS),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BOUNDS=metadata.shape[2] // 2,
        ORDERED=ordered, FP8=metadata.dtype == torch.float8_e4m3fn,
        num_warps=2,
    )


@triton.jit
def _score_tile(
    tile_index, q_pos, q_neg, unscale, n, Meta, bt_row, Scores, width, kvh, stride_mb, stride_mh, stride_mm,
    stride_sg, offs_d, d_ok, offs_g, g_ok,
    G_PAD: tl.constexpr, BLOCKS_PER_PAGE: tl.constexpr, BOUNDS: tl.constexpr, BOUNDS_PAD: tl.constexpr,
    TILE: tl.constexpr, REDUCE: tl.constexpr, KEEP_SINK: tl.constexpr, RECENT_PAGES: tl.constexpr,
    FP32: tl.constexpr, FP8: tl.constexpr,
):
    """The scores of tile ``tile_index``'s ``TILE`` pages into ``Scores``, one sequence's row for one KV
    head (``REDUCE`` 0: the group's largest bound, 1: their sum), or, with ``REDUCE`` 2, each query head's
    bound into its row ``stride_sg`` apart, unforced."""
    offs_p = tile_index * TILE + tl.arange(0, TILE)
    valid = offs_p < n
    # one row per (page, bound): the tile's bounds in one dot, then each page's largest
    offs_r = tl.arange(0, TILE * BOUNDS_PAD)
    page_r = tile_index * TILE + offs_r // BOUNDS_PAD
    bound_r = offs_r % BOUNDS_PAD
    row_ok = (page_r < n) & (bound_r < BOUNDS)
    # every column of the block table is read, history or not (the bounds of pages past the history are
    # not loaded), so that this load and the history length's run together rather than one after the other
    in_table = (page_r < width) & (bound_r < BOUNDS)
    phys = tl.load(bt_row + page_r * BLOCKS_PER_PAGE, mask=in_table, other=0)
    phys = tl.maximum(phys, 0).to(tl.int64)
    # a bound's min and max are rows 2j and 2j + 1 of its block's KV head
    rows = phys * stride_mb + 2 * bound_r * stride_mm
    meta = Meta + rows[:, None] + kvh * stride_mh + offs_d[None, :]
    ld = row_ok[:, None] & d_ok[None, :]
    kmin = tl.load(meta, mask=ld, other=0.0)
    kmax = tl.load(meta + stride_mm, mask=ld, other=0.0)
    if FP8 and FP32:  # on the GPU a 16-bit conversion keeps float8's NaN; the interpreter's needs help
        kmin, kmax = _to_float32(kmin, True), _to_float32(kmax, True)
    if FP8 and not FP32:  # float16 operands: float8 converts to float16 in one instruction a pair, to
        # bfloat16 in several; float16 holds every float8 value exactly, so the scores do not change
        kmin, kmax = kmin.to(tl.float16), kmax.to(tl.float16)
    if FP32:  # float32 inputs or the interpreter: exact float32 products
        bound = tl.dot(q_pos.to(tl.float32), tl.trans(kmax.to(tl.float32)), input_precision="ieee")
        bound += tl.dot(q_neg.to(tl.float32), tl.trans(kmin.to(tl.float32)), input_precision="ieee")
    else:  # 16-bit products are exact in the float32 accumulator
        bound = tl.dot(q_pos, tl.trans(kmax.to(q_pos.dtype)))
        bound += tl.dot(q_neg, tl.trans(kmin.to(q_pos.dtype)))
    if FP8 and not FP32:
        bound = bound * unscale
    bound = tl.where(bound != bound, float("inf"), bound)  # an unbounded float8 bound
    if BOUNDS_PAD > 1:
        bound = tl.where((bound_r < BOUNDS)[None, :], bound, float("-inf"))
        bound = tl.max(tl.reshape(bound, [G_PAD, TILE, BOUNDS_PAD]), 2)
    if REDUCE == 2:  # each query head's bounds, for the group's shares (reference.combine_shares)
        bound = tl.where(valid[None, :], bound, float("-inf"))
        tl.store(Scores + offs_g[:, None] * stride_sg + offs_p[None, :], bound,
                 mask=g_ok[:, None] & (offs_p < width)[None, :])
    else:
        if REDUCE == 0:
            score = tl.max(tl.where(g_ok[:, None], bound, float("-inf")), 0)
        else:
            score = tl.sum(tl.where(g_ok[:, None], bound, 0.0), 0)
        forced = offs_p >= n - RECENT_PAGES  # the newest pages (pages past n are not valid)
        if KEEP_SINK:
            forced = forced | (offs_p == 0)
        score = tl.where(valid, tl.where(forced, float("inf"), score), float("-inf"))
        tl.store(Scores + offs_p, score, mask=offs_p < width)


@triton.jit
def _score_kernel(
    Q, Meta, BlockTables, KVLens, Scores, width,
    stride_qs, stride_qh, stride_mb, stride_mh, stride_mm, stride_bt, stride_ss, stride_sh, stride_sg,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCKS_PER_PAGE: tl.constexpr, BOUNDS: tl.constexpr, BOUNDS_PAD: tl.constexpr,
    TILE: tl.constexpr, STEPS: tl.constexpr, REDUCE: tl.constexpr, OUT_ROWS: tl.constexpr,
    KEEP_SINK: tl.constexpr,
    RECENT_PAGES: tl.constexpr, FP32: tl.constexpr, FP8: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.cdiv(tl.load(KVLens + s), PAGE_SIZE)  # history pages of this sequence
    scores = Scores + s * stride_ss + kvh * stride_sh
    first = tl.program_id(2) * (TILE * STEPS)
    offs_g = tl.arange(0, G_PAD)
    if first >= n:  # past the history, as most of a block table wider than the context is: no bounds to read
        offs_p = first + tl.arange(0, TILE * STEPS)
        rows = offs_g < OUT_ROWS  # the one row, or each query head's
        tl.store(scores + offs_g[:, None] * stride_sg + offs_p[None, :],
                 tl.full([G_PAD, TILE * STEPS], float("-inf"), tl.float32),
                 mask=rows[:, None] & (offs_p < width)[None, :])
        return
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + s.to(tl.int64) * stride_qs + (kvh * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )
    unscale = 1.0
    if FP8 and not FP32:  # the float16 dots: the query scaled into float16's range
        q, unscale = _float16_scaled(q)
    zero = tl.zeros_like(q)
    q_pos = tl.where(q > 0, q, zero)
    q_neg = tl.where(q < 0, q, zero)
    bt_row = BlockTables + s * stride_bt
    if STEPS == 1:
        _score_tile(tl.program_id(2), q_pos, q_neg, unscale, n, Meta, bt_row, scores, width, kvh, stride_mb,
                    stride_mh, stride_mm, stride_sg, offs_d, d_ok, offs_g, g_ok, G_PAD, BLOCKS_PER_PAGE,
                    BOUNDS, BOUNDS_PAD, TILE, REDUCE, KEEP_SINK, RECENT_PAGES, FP32, FP8)
    else:  # several tiles, the next one's loads issued while this one is scored
        for i in tl.range(first // TILE, first // TILE + STEPS, num_stages=2):
            _score_tile(i, q_pos, q_neg, unscale, n, Meta, bt_row, scores, width, kvh, stride_mb, stride_mh,
                        stride_mm, stride_sg, offs_d, d_ok, offs_g, g_ok, G_PAD, BLOCKS_PER_PAGE, BOUNDS,
                        BOUNDS_PAD, TILE, REDUCE, KEEP_SINK, RECENT_PAGES, FP32, FP8)


def page_scores(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
    page_size: int, group_reduction: str = "max", keep_sink: bool = False, recent_pages: int = 1,
    scale: float = 1.0,
) -> torch.Tensor:
    scores = _bounds(q, metadata, block_tables, kv_lens, block_size, page_size, group_reduction, keep_sink,
                     recent_pages)
    if group_reduction != "mass":
        return scores
    return _shares(scores, scale, kv_lens=kv_lens, page_size=page_size, keep_sink=keep_sink,
                   recent_pages=recent_pages)[0]


def select_pages(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    block_size: int, page_size: int, k: int, group_reduction: str = "max", keep_sink: bool = False,
    recent_pages: int = 1, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _bounds(q, metadata, block_tables, kv_lens, block_size, page_size, group_reduction, keep_sink,
                     recent_pages)
    if group_reduction != "mass":
        return scores, top_pages(scores, k, kv_lens, block_size, page_size)
    return _shares(scores, scale, k, kv_lens=kv_lens, block_size=block_size, page_size=page_size,
                   keep_sink=keep_sink, recent_pages=recent_pages)


def _bounds(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    block_size: int, page_size: int, group_reduction: str, keep_sink: bool, recent_pages: int,
) -> torch.Tensor:
    """The scoring kernel's scores ``[S, Hkv, P]``, or with ``mass`` each query head's bounds ``[S, Hkv, G,
    P]``, unforced."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = metadata.shape[1]
    group = num_heads // num_kv_heads
    width = cdiv(block_tables.shape[1], page_size // block_size)
    per_head = group_reduction == "mass"  # each head's bounds, combined into shares by _shares
    scores = torch.empty(num_seqs, num_kv_heads, *((group,) if per_head else ()), width, dtype=torch.float32,
                         device=q.device)
    if num_seqs == 0 or width == 0:
        return scores
    assert q.stride(-1) == 1 and metadata.stride(-1) == 1 and block_tables.stride(-1) == 1
    bounds = metadata.shape[2] // 2
    bounds_pad = next_power_of_2(bounds)
    fp8 = metadata.dtype == torch.float8_e4m3fn
    fp32 = q.dtype == torch.float32 or not q.is_cuda
    rows = SCORE_TILE  # bounds a program
    if fp8 and not fp32:  # the float16 dots
        sms = num_sms(q.device)
        rows = SCORE_TILE_FP8
        while rows > SCORE_TILE and num_seqs * num_kv_heads * cdiv(width * bounds_pad, rows) < 2 * sms:
            rows //= 2
    step_rows = min(rows, SCORE_STEP)
    tile = max(1, step_rows // bounds_pad)  # pages a step
    steps = max(1, rows // step_rows)
    grid = (num_seqs, num_kv_heads, cdiv(width, tile * steps))
    _score_kernel[grid](
        q, metadata, block_tables, kv_lens, scores, width,
        q.stride(0), q.stride(1), metadata.stride(0), metadata.stride(1), metadata.stride(2),
        block_tables.stride(0), scores.stride(0), scores.stride(1), width,
        GROUP=group, G_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), PAGE_SIZE=page_size,
        BLOCKS_PER_PAGE=page_size // block_size, BOUNDS=bounds, BOUNDS_PAD=bounds_pad, TILE=tile,
        STEPS=steps, REDUCE=REDUCTIONS[group_reduction], OUT_ROWS=group if per_head else 1,
        KEEP_SINK=keep_sink,
        RECENT_PAGES=max(1, recent_pages), FP32=fp32, FP8=fp8, num_warps=4,
    )
    return scores


@triton.jit
def _rescore_kernel(
    Q, K, BlockTables, KVLens, Nominees, Scores, Out, num_nominees, scale,
    stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ns, stride_nh,
    stride_ss, stride_sh, stride_os, stride_oh, stride_og,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, TILE: tl.constexpr, REDUCE: tl.constexpr,
    FP32: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    kv_len = tl.load(KVLens + s)
    nominees = Nominees + s * stride_ns + kvh * stride_nh
    # one row per (nominated page, slot): the tile's keys in one dot
    offs_r = tl.arange(0, TILE * BS_PAD)
    cand_r = tl.program_id(2) * TILE + offs_r // BS_PAD
    slot_r = offs_r % BS_PAD
    page_r = tl.load(nominees + cand_r, mask=cand_r < num_nominees, other=-1)
    pos_r = page_r * BLOCK_SIZE + slot_r
    row_ok = (page_r >= 0) & (slot_r < BLOCK_SIZE) & (pos_r < kv_len)
    phys_r = tl.load(BlockTables + s * stride_bt + page_r, mask=row_ok, other=0).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + s * stride_qs + (kvh * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_rows = phys_r * stride_kb + slot_r * stride_ks + kvh * stride_kh
    k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32:
        logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(k.to(q.dtype)))
    logits = tl.where(row_ok[None, :], logits, float("-inf"))
    best = tl.max(tl.reshape(logits, [G_PAD, TILE, BS_PAD]), 2)  # [G_PAD, TILE]: each page's best key
    offs_c = tl.program_id(2) * TILE + tl.arange(0, TILE)
    if REDUCE == 2:  # each query head's log page weight, logsumexp of its keys' scaled logits
        top = best * scale
        total = tl.sum(tl.exp(tl.reshape(logits * scale, [G_PAD, TILE, BS_PAD]) - top[:, :, None]), 2)
        weight = tl.where(best > float("-inf"), top + tl.log(total), float("-inf"))
        out = Out + s * stride_os + kvh * stride_oh + offs_g[:, None] * stride_og + offs_c[None, :]
        tl.store(out, weight, mask=g_ok[:, None] & (offs_c < num_nominees)[None, :])
        return
    if REDUCE == 0:
        score = tl.max(tl.where(g_ok[:, None], best, float("-inf")), 0)
    else:
        score = tl.sum(tl.where(g_ok[:, None], best, 0.0), 0)
    page = tl.load(nominees + offs_c, mask=offs_c < num_nominees, other=-1)
    live = page >= 0
    forced = tl.load(Scores + s * stride_ss + kvh * stride_sh + page, mask=live, other=0.0) == float("inf")
    score = tl.where(live, tl.where(forced, float("inf"), score), float("-inf"))
    tl.store(Out + s * stride_os + kvh * stride_oh + offs_c, score, mask=offs_c < num_nominees)


def rescore_pages(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    nominees: torch.Tensor, scores: torch.Tensor, group_reduction: str = "max", scale: float = 1.0,
) -> torch.Tensor:
    exact = _rescore(q, k_cache, block_tables, kv_lens, nominees, scores, group_reduction, scale)
    if group_reduction != "mass":
        return exact
    return _shares(exact, 1.0, nominees=nominees, scores=scores)[0]


def pick_by_keys(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    nominees: torch.Tensor, scores: torch.Tensor, k: int, group_reduction: str = "max", scale: float = 1.0,
) -> torch.Tensor:
    exact = _rescore(q, k_cache, block_tables, kv_lens, nominees, scores, group_reduction, scale)
    if group_reduction != "mass":
        return pick_nominees(exact, nominees, k)
    return _shares(exact, 1.0, k, nominees=nominees, scores=scores)[1]


def _rescore(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    nominees: torch.Tensor, scores: torch.Tensor, group_reduction: str, scale: float,
) -> torch.Tensor:
    """The rescoring kernel's scores ``[S, Hkv, C]`` (forced ``+inf``, padding ``-inf``), or with ``mass``
    each query head's log page weights ``[S, Hkv, G, C]``."""
    num_seqs, num_kv_heads, num_nominees = nominees.shape
    num_heads, head_dim = q.shape[1:]
    group = num_heads // num_kv_heads
    per_head = group_reduction == "mass"  # each head's page weights, combined into shares by _shares
    out = torch.empty(num_seqs, num_kv_heads, *((group,) if per_head else ()), num_nominees,
                      dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    assert scores.is_contiguous() and nominees.stride(-1) == 1
    block_size = k_cache.shape[1]
    bs_pad = next_power_of_2(block_size)
    tile = max(1, RESCORE_ROWS // bs_pad)  # pages a program
    grid = (num_seqs, num_kv_heads, cdiv(num_nominees, tile))
    _rescore_kernel[grid](
        q, k_cache, block_tables, kv_lens, nominees, scores, out, num_nominees, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), nominees.stride(0), nominees.stride(1),
        scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), out.stride(-2),
        GROUP=group, G_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BS_PAD=bs_pad, TILE=tile,
        REDUCE=REDUCTIONS[group_reduction], FP32=q.dtype == torch.float32 or not q.is_cuda, num_warps=4,
    )
    return out


@triton.jit
def _order_keys(scores):
    """Float32 -> uint32 with the floats' order; ``-inf``, NaN and padding -> 0 (never chosen). 32-bit
    keys: the counting passes move and compare half the bytes of int64 keys."""
    bits = tl.where(scores == 0.0, 0, scores.to(tl.int32, bitcast=True))  # -0.0 ties with 0.0, as in torch
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    keys = (ordered ^ (-2147483648)).to(tl.uint32, bitcast=True)  # flip the sign bit: unsigned order
    return tl.where(scores > float("-inf"), keys, tl.zeros_like(keys))


@triton.jit
def _tile_keys(row, i, offs, width, TILE: tl.constexpr):
    """Order keys of tile ``i`` of a score row (past ``width``: never chosen)."""
    return _order_keys(tl.load(row + i * TILE + offs, mask=i * TILE + offs < width, other=float("-inf")))


@triton.jit
def _min_max_count(lo_a, hi_a, n_a, lo_b, hi_b, n_b):
    return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b), n_a + n_b


@triton.jit
def _search_start(keys, K: tl.constexpr):
    """Where the bisection for the K-th largest of ``keys`` (a row's order keys) may start: the bits that the
    row's smallest and largest finite keys share, and the first bit below them. The K-th largest lies between
    those two keys, so it has their shared bits, when fewer than K pages are forced (+inf) and more than K are
    valid. A row of at most K valid pages (a short sequence, a CUDA graph's padding row) takes them all: no
    search, ``(0, -1)``. Otherwise the search starts from the top, ``(0, 31)``. One reduction of three
    values."""
    inf_key = 0xFF800000  # the order key of +inf
    finite = (keys > 0) & (keys < inf_key)
    counts = finite.to(tl.int32) + ((keys == inf_key).to(tl.int32) << 16)  # rows of at most 16K pages
    lo, hi, counts = tl.reduce((tl.where(finite, keys, 0xFFFFFFFF), tl.where(finite, keys, 0), counts), 0,
                               _min_max_count)
    num_finite, num_forced = counts & 0xFFFF, counts >> 16
    # the highest bit where they differ, from float32's exponent (-127 when equal); rounding can make it one
    # higher, which costs a pass and keeps the start right
    diff = (lo ^ hi).to(tl.float32)
    first = tl.maximum(((diff.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -1)
    num_valid = num_forced + num_finite
    ok = (num_forced < K) & (num_valid > K) & (first < 31)
    shared = hi & ~((tl.full([], 1, tl.uint32) << (first + 1).to(tl.uint32)) - 1)
    start = tl.where(num_valid <= K, -1, tl.where(ok, first, 31))
    return tl.where(ok, shared, 0).to(tl.uint32), start


@triton.jit
def _select_row(
    row, out, width, history_blocks, names,
    K: tl.constexpr, OUT_PAD: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
    BLOCKS_PER_PAGE: tl.constexpr, NAMED: tl.constexpr,
):
    """The blocks of the ``K`` best pages of one score row (``width`` pages) into ``out`` (``K *
    BLOCKS_PER_PAGE`` entries): pages ascending, each as its blocks below ``history_blocks``, -1 padded.
    ``NAMED``: entry ``i`` of the row is page ``names[i]`` (ascending), not page ``i``."""
    offs = tl.arange(0, TILE)
    # the K-th largest key, bit by bit from the top: the largest t with at least K keys >= t. A candidate
    # with exactly K keys at or above it selects the same K keys and ends the search early, saving the
    # passes over the remaining bits
    if NUM_TILES == 1:  # a row in registers, searched from below the bits its finite keys share: the bits
        # above are the same in every key, so they need no pass
        keys = _tile_keys(row, 0, offs, width, TILE)
        t, bit = _search_start(keys, K)
    else:
        t = tl.zeros([], tl.uint32)
        bit = tl.full([], 31, tl.int32)
    exact = tl.zeros([], tl.int32)
    while (bit >= 0) & (exact == 0):
        cand = t | (tl.full([], 1, tl.uint32) << bit)
        if NUM_TILES == 1:
            count = tl.sum((keys >= cand).to(tl.int32), 0)
        else:
            count = tl.zeros([], tl.int32)
            for i in range(NUM_TILES):
                count += tl.sum((_tile_keys(row, i, offs, width, TILE) >= cand).to(tl.int32), 0)
        t = tl.where(count >= K, cand, t)
        exact = (count == K).to(tl.int32)
        bit -= 1
    # the keys at or above t (t == 0: fewer than K valid, all of them). Where more than K are (the search
    # never met a candidate with exactly K), the ties at t are ranked by index and the first are taken until
    # K are: that costs a count, a prefix sum and two sums a tile, which the usual row skips
    ranked = (t > 0) & (exact == 0)
    ties_left = tl.zeros([], tl.int32)
    if ranked:
        if NUM_TILES == 1:
            above = tl.sum((keys > t).to(tl.int32), 0)
        else:
            above = tl.zeros([], tl.int32)
            for i in range(NUM_TILES):
                tile = _tile_keys(row, i, offs, width, TILE)
                above += tl.sum((tile > t).to(tl.int32), 0)
        ties_left = K - above
    written = tl.zeros([], tl.int32)
    for i in range(NUM_TILES):
        if NUM_TILES == 1:
            tile = keys
        else:
            tile = _tile_keys(row, i, offs, width, TILE)
        if ranked:
            tie = (tile == t).to(tl.int32)
            tie_rank = tl.cumsum(tie, 0) - tie
            take = ((tile > t) | ((tie == 1) & (tie_rank < ties_left))).to(tl.int32)
            ties_left -= tl.sum(tie * (tie_rank < ties_left).to(tl.int32), 0)
        else:
            take = (tile >= tl.maximum(t, 1)).to(tl.int32)
        slot = (written + tl.cumsum(take, 0) - take) * BLOCKS_PER_PAGE
        for j in tl.static_range(BLOCKS_PER_PAGE):
            if NAMED:
                block = tl.load(names + i * TILE + offs, mask=take == 1, other=-1) * BLOCKS_PER_PAGE + j
            else:
                block = (i * TILE + offs) * BLOCKS_PER_PAGE + j
            tl.store(out + slot + j, tl.where(block < history_blocks, block, -1).to(tl.int32), mask=take == 1)
        if NUM_TILES > 1:
            written += tl.sum(take, 0)
        elif t == 0:
            written = tl.sum(take, 0)
        else:  # exactly K taken
            written = tl.full([], K, tl.int32)
    offs_k = tl.arange(0, OUT_PAD)
    tl.store(out + offs_k, tl.full([OUT_PAD], -1, tl.int32),
             mask=(offs_k >= written * BLOCKS_PER_PAGE) & (offs_k < K * BLOCKS_PER_PAGE))


@triton.jit
def _topk_kernel(
    Scores, Out, KVLens, width, stride_sr, stride_or,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, K: tl.constexpr, OUT_PAD: tl.constexpr,
    TILE: tl.constexpr, NUM_TILES: tl.constexpr, BLOCKS_PER_PAGE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    history_blocks = tl.cdiv(tl.load(KVLens + r // NUM_KV_HEADS), BLOCK_SIZE)
    _select_row(Scores + r * stride_sr, Out + r * stride_or, width, history_blocks, Scores, K, OUT_PAD, TILE,
                NUM_TILES, BLOCKS_PER_PAGE, False)


@triton.jit
def _pick_kernel(Scores, Names, Out, width, stride_sr, stride_nr, stride_or,
                 K: tl.constexpr, OUT_PAD: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    _select_row(Scores + r * stride_sr, Out + r * stride_or, width, 2147483647, Names + r * stride_nr, K,
                OUT_PAD, TILE, NUM_TILES, 1, True)


def pick_nominees(exact: torch.Tensor, nominees: torch.Tensor, k: int) -> torch.Tensor:
    num_seqs, num_kv_heads, width = exact.shape
    out = torch.empty(num_seqs, num_kv_heads, k, dtype=torch.int32, device=exact.device)
    if out.numel() == 0:
        return out
    assert exact.is_contiguous() and nominees.is_contiguous()
    tile = min(next_power_of_2(max(width, 16)), MAX_TOPK_TILE)
    _pick_kernel[(num_seqs * num_kv_heads,)](
        exact, nominees, out, width, width, width, k,
        K=k, OUT_PAD=next_power_of_2(k), TILE=tile, NUM_TILES=cdiv(width, tile),
        num_warps=8 if tile >= 4096 else 4,
    )
    return out


def top_pages(scores: torch.Tensor, k: int, kv_lens: torch.Tensor, block_size: int, page_size: int) -> torch.Tensor:
    num_seqs, num_kv_heads, width = scores.shape
    out = torch.empty(num_seqs, num_kv_heads, k * (page_size // block_size), dtype=torch.int32,
                      device=scores.device)
    if out.numel() == 0:
        return out
    assert scores.is_contiguous()
    tile = min(next_power_of_2(max(width, 16)), MAX_TOPK_TILE)
    per_page = page_size // block_size
    _topk_kernel[(num_seqs * num_kv_heads,)](
        scores, out, kv_lens, width, width, out.shape[-1],
        NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size, K=k, OUT_PAD=next_power_of_2(k * per_page),
        TILE=tile, NUM_TILES=cdiv(width, tile), BLOCKS_PER_PAGE=per_page,
        num_warps=8 if tile >= 4096 else 4,
    )
    return out


@triton.jit
def _head_logits(row, i, offs_g, g_ok, offs, width, stride_lg, scale, TILE: tl.constexpr):
    """Tile ``i`` of each query head's logits times ``scale``, ``[G_PAD, TILE]``; ``-inf`` past ``width`` and
    for the padding heads."""
    cols = i * TILE + offs
    x = tl.load(row + offs_g[:, None] * stride_lg + cols[None, :],
                mask=g_ok[:, None] & (cols < width)[None, :], other=float("-inf"))
    return x * scale


@triton.jit
def _head_lse(x, top, total):
    """The running log-sum-exp of each head's finite logits (its largest ``top`` and the sum ``total`` of
    exponentials below it) with the tile ``x`` added. ``-inf`` and padding have no weight; a largest of
    ``-inf`` is taken as 0, as torch's ``logsumexp`` does, so that no ``inf - inf`` is formed."""
    z = tl.where((x > float("-inf")) & (x < float("inf")), x, float("-inf"))
    new = tl.maximum(top, tl.max(z, 1))
    base = tl.where(new == float("-inf"), 0.0, new)
    total = total * tl.exp(top - base) + tl.sum(tl.exp(z - base[:, None]), 1)
    return new, total


@triton.jit
def _store_shares(
    x, lse, i, offs, width, r, Names, Scores, KVLens, Out, stride_nr, stride_sr, stride_or,
    TILE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NOMINEES: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KEEP_SINK: tl.constexpr, RECENT_PAGES: tl.constexpr,
):
    """Tile ``i`` of the group's shares from its heads' logits ``x`` and log-sum-exps ``lse`` (0 for a head
    without finite logits): :func:`reference.combine_shares`, then forced and padded as
    :func:`reference.force_pages` (pages by position) or :func:`reference.rescored` (``NOMINEES``)."""
    finite = (x > float("-inf")) & (x < float("inf"))
    share = tl.where(finite, x - lse[:, None], float("-inf"))
    top = tl.max(share, 0)
    base = tl.where(top == float("-inf"), 0.0, top)
    combined = tl.log(tl.sum(tl.exp(share - base[None, :]), 0)) + base
    combined = tl.where(tl.max((x == float("inf")).to(tl.int32), 0) > 0, float("inf"), combined)
    cols = i * TILE + offs
    if NOMINEES:
        page = tl.load(Names + r * stride_nr + cols, mask=cols < width, other=-1)
        live = page >= 0
        forced = tl.load(Scores + r * stride_sr + page, mask=live, other=0.0) == float("inf")
        score = tl.where(live, tl.where(forced, float("inf"), combined), float("-inf"))
    else:
        n = tl.cdiv(tl.load(KVLens + r // NUM_KV_HEADS), PAGE_SIZE)
        forced = cols >= n - RECENT_PAGES
        if KEEP_SINK:
            forced = forced | (cols == 0)
        score = tl.where(cols < n, tl.where(forced, float("inf"), combined), float("-inf"))
    tl.store(Out + r * stride_or + cols, score, mask=cols < width)


@triton.jit
def _shares_kernel(
    Logits, Names, Scores, KVLens, Out, Selected, width, scale,
    stride_lr, stride_lg, stride_nr, stride_sr, stride_or, stride_selr,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, TILE: tl.constexpr,
    NUM_TILES: tl.constexpr, NOMINEES: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KEEP_SINK: tl.constexpr, RECENT_PAGES: tl.constexpr, K: tl.constexpr, OUT_PAD: tl.constexpr,
    SELECT_TILE: tl.constexpr, SELECT_TILES: tl.constexpr, BLOCKS_PER_PAGE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = Logits + r * stride_lr
    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g < GROUP
    offs = tl.arange(0, TILE)
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    if NUM_TILES == 1:  # the row stays in registers for the shares
        x = _head_logits(row, 0, offs_g, g_ok, offs, width, stride_lg, scale, TILE)
        top, total = _head_lse(x, top, total)
    else:
        for i in range(NUM_TILES):
            x = _head_logits(row, i, offs_g, g_ok, offs, width, stride_lg, scale, TILE)
            top, total = _head_lse(x, top, total)
    lse = tl.log(total) + tl.where(top == float("-inf"), 0.0, top)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # a head without finite logits has no shares
    if NUM_TILES == 1:
        _store_shares(x, lse, 0, offs, width, r, Names, Scores, KVLens, Out, stride_nr, stride_sr, stride_or,
                      TILE, NUM_KV_HEADS, NOMINEES, PAGE_SIZE, KEEP_SINK, RECENT_PAGES)
    else:
        for i in range(NUM_TILES):
            x = _head_logits(row, i, offs_g, g_ok, offs, width, stride_lg, scale, TILE)
            _store_shares(x, lse, i, offs, width, r, Names, Scores, KVLens, Out, stride_nr, stride_sr,
                          stride_or, TILE, NUM_KV_HEADS, NOMINEES, PAGE_SIZE, KEEP_SINK, RECENT_PAGES)
    if K > 0:
        tl.debug_barrier()  # the selection reads the row back in another layout: other threads' stores
        out, selected = Out + r * stride_or, Selected + r * stride_selr
        if NOMINEES:
            _select_row(out, selected, width, 2147483647, Names + r * stride_nr, K, OUT_PAD, SELECT_TILE,
                        SELECT_TILES, 1, True)
        else:
            history_blocks = tl.cdiv(tl.load(KVLens + r // NUM_KV_HEADS), BLOCK_SIZE)
            _select_row(out, selected, width, history_blocks, out, K, OUT_PAD, SELECT_TILE, SELECT_TILES,
                        BLOCKS_PER_PAGE, False)


def _shares(
    logits: torch.Tensor, scale: float, k: int = 0, *, kv_lens: torch.Tensor | None = None,
    nominees: torch.Tensor | None = None, scores: torch.Tensor | None = None, block_size: int = 1,
    page_size: int = 1, keep_sink: bool = False, recent_pages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``group_reduction=mass`` in one launch: each query head's log-weights ``logits [S, Hkv, G, W]`` times
    ``scale`` combined into the group's shares, forced and padded, ``[S, Hkv, W]``; with ``k`` also the
    ``k`` best, as :func:`top_pages` selects them. The candidates are history pages (forced by position, as
    :func:`page_scores`; ``kv_lens`` the histories), or with ``nominees`` the nominated pages, forced where
    ``scores`` is ``+inf`` and selected as :func:`pick_nominees` does."""
    num_seqs, num_kv_heads, group, width = logits.shape
    per_page = page_size // block_size
    out = torch.empty(num_seqs, num_kv_heads, width, dtype=torch.float32, device=logits.device)
    selected = torch.empty(num_seqs, num_kv_heads, k * per_page, dtype=torch.int32, device=logits.device)
    if out.shape[0] * out.shape[1] == 0:
        return out, selected if k else None
    assert logits.is_contiguous()
    named = nominees is not None
    if named:
        assert nominees.is_contiguous() and scores.is_contiguous()
    g_pad = max(2, next_power_of_2(group))
    tile = min(next_power_of_2(max(width, 16)), max(16, SHARES_TILE // g_pad))
    select_tile = min(next_power_of_2(max(width, 16)), MAX_TOPK_TILE)
    _shares_kernel[(num_seqs * num_kv_heads,)](
        # the arguments of the other kind of candidates are not read: any tensor fills them
        logits, nominees if named else logits, scores if named else logits, logits if named else kv_lens, out,
        selected if k else out, width, scale,
        logits.stride(1), logits.stride(2), width if named else 0, scores.shape[-1] if named else 0, width,
        selected.shape[-1],
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad, TILE=tile, NUM_TILES=cdiv(width, tile),
        NOMINEES=named, BLOCK_SIZE=block_size, PAGE_SIZE=page_size, KEEP_SINK=keep_sink,
        RECENT_PAGES=max(1, recent_pages), K=k, OUT_PAD=next_power_of_2(max(k * per_page, 1)),
        SELECT_TILE=select_tile, SELECT_TILES=cdiv(width, select_tile), BLOCKS_PER_PAGE=per_page,
        num_warps=8 if max(select_tile, g_pad * tile) >= 4096 else 4,
    )
    return out, selected if k else None
