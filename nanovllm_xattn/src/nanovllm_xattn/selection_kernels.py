"""The selection in Triton, one launch for the kept-block mask and one for the block lists, with nothing
read back to the host: the kernels behind :func:`nanovllm_xattn.selection.select_blocks` and
:func:`~nanovllm_xattn.selection.block_lists` on CUDA tensors. Their torch references are
``select_blocks_reference`` and ``block_lists_reference`` beside those functions.

``select_mask``: one program per (query-block row, selection head, sequence). It builds the row's causal
and forced blocks from the lengths, loads the row's scores (a GQA group's pooled, for ``mean`` and
``max``), ranks the blocks as the reference does (forced first, then by score, past the diagonal last, ties
by ascending block) with one sort of 64-bit keys (the float's order bits above the block's index, so each
key is unique), and keeps the first ranked blocks: those whose cumulative score before them is below
``threshold`` times the row's total (or the ``ratio`` share of its causal blocks). As the keys are unique,
the kept blocks are those whose key is at least that of the last one kept: no scatter back to block order.
Voting reductions (``union``, ``majority``, ``global_majority``) run that for each voting head and count
the votes.

The ranking is the reference's exactly; the sums may not be. Triton's scan and reduction add in another
order than torch's cumsum and sum, so a row whose threshold crossing lies within float32 rounding of
``threshold`` times its total may keep one block more or one fewer than the reference. ``mean`` pools a
group by its sum: a row's scale changes neither the ranking nor the shares, only the rounding.

``list_blocks``: one program per row, a prefix sum over the row's mask writes its kept blocks in ascending
order and their count. The lists are as wide as the mask (every key block), so no host read sizes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.sparse import next_power_of_2

from nanovllm_xattn.config import HEAD_REDUCTIONS

MAX_KEY_BLOCKS = 16384  # a row's blocks sorted in one program's registers (2M tokens at blocks of 128)


@triton.jit
def _order_keys(x):
    """float32 -> int32 in the floats' order (-0.0 as 0.0)."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _row_scores(Scores, row, stride_sh, cols, ok, POOL_HEADS: tl.constexpr, POOL_MAX: tl.constexpr):
    """The scores at ``cols`` of ``POOL_HEADS`` heads' rows from ``row``: the one row, or their sum
    (``mean``'s ranking) or max."""
    x = tl.load(Scores + row + cols, mask=ok, other=0.0)
    for i in tl.static_range(1, POOL_HEADS):
        y = tl.load(Scores + row + i * stride_sh + cols, mask=ok, other=0.0)
        if POOL_MAX:
            x = tl.maximum(x, y)
        else:
            x = x + y
    return x


@triton.jit
def _blocks_of(cols, qb, real, in_row, last_row, KEEP_SINK: tl.constexpr, KEEP_RECENT: tl.constexpr,
               RECENT: tl.constexpr):
    """(causal, forced) of the key blocks ``cols`` in the row of query block ``qb``."""
    causal = (cols <= qb) & in_row & real
    forced = tl.zeros_like(causal)
    if KEEP_SINK:
        forced = forced | (cols == 0)
    if KEEP_RECENT:
        forced = forced | (qb - cols < RECENT)
    return causal, (forced | last_row) & causal


@triton.jit
def _keep(Scores, Thresholds, row, head, stride_sh, cols, num_cols, qb, real, last_row, ratio,
          POOL_HEADS: tl.constexpr, POOL_MAX: tl.constexpr, BLOCK_N: tl.constexpr, KEEP_SINK: tl.constexpr,
          KEEP_RECENT: tl.constexpr, RECENT: tl.constexpr, USE_RATIO: tl.constexpr):
    """The blocks one selection keeps (block order): the threshold (or ratio) rule on one score row."""
    in_row = cols < num_cols
    causal, forced = _blocks_of(cols, qb, real, in_row, last_row, KEEP_SINK, KEEP_RECENT, RECENT)
    x = _row_scores(Scores, row, stride_sh, cols, in_row, POOL_HEADS, POOL_MAX)
    priority = tl.where(forced, float("inf"), tl.where(causal, x, -1.0))
    order = tl.where(in_row, _order_keys(priority), -2147483648)
    keys = (order.to(tl.int64) << 32) | (BLOCK_N - 1 - cols).to(tl.int64)  # ties: the lower block first
    ranked_keys = tl.sort(keys, descending=True)
    ranked_cols = BLOCK_N - 1 - (ranked_keys & (BLOCK_N - 1)).to(tl.int32)
    ranked_ok = ranked_cols < num_cols
    ranked_causal, _ = _blocks_of(ranked_cols, qb, real, ranked_ok, last_row, KEEP_SINK, KEEP_RECENT, RECENT)
    ranked = tl.where(ranked_causal, _row_scores(Scores, row, stride_sh, ranked_cols, ranked_ok, POOL_HEADS,
                                                 POOL_MAX), 0.0)
    rank = tl.arange(0, BLOCK_N)
    if USE_RATIO:
        num_causal = tl.sum(causal.to(tl.int32), 0)
        num_keep = tl.maximum(tl.math.ceil(num_causal.to(tl.float32) * ratio).to(tl.int32),
                              tl.sum(forced.to(tl.int32), 0))
    else:
        threshold = tl.load(Thresholds + head)
        for i in tl.static_range(1, POOL_HEADS):  # a pooled group: its largest threshold
            threshold = tl.maximum(threshold, tl.load(Thresholds + head + i))
        before = tl.cumsum(ranked, 0) - ranked
        limit = threshold * tl.sum(ranked, 0)
        num_keep = tl.min(tl.where(before < limit, BLOCK_N, rank), 0)  # the leading ranks below the limit
        num_keep = tl.where(threshold >= 1.0, BLOCK_N, num_keep)
    last_kept = tl.sum(tl.where(rank == num_keep - 1, ranked_keys, 0), 0)
    return ((keys >= last_kept) & (num_keep > 0) | forced) & causal


@triton.jit(do_not_specialize=["num_cols", "stride_ss", "stride_sh", "stride_sr"])
def _select_kernel(
    Scores, Thresholds, cu_q, context_lens, chunk_context_lens, Mask,
    num_cols, stride_ss, stride_sh, stride_sr, ratio,
    SEL_STEP: tl.constexpr, VOTERS: tl.constexpr, POOL_HEADS: tl.constexpr, POOL_MAX: tl.constexpr,
    MAJORITY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, KEEP_SINK: tl.constexpr,
    KEEP_RECENT: tl.constexpr, RECENT: tl.constexpr, DENSE_LAST: tl.constexpr, USE_RATIO: tl.constexpr,
):
    """Program (row ``r``, selection head ``g``, sequence ``s``): ``Mask[s, g, r, :]``. Voter ``v`` reads
    heads ``g * SEL_STEP + v`` onwards (``POOL_HEADS`` of them)."""
    r = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    ctx = tl.load(context_lens + s)
    qb = (ctx - (tl.load(cu_q + s + 1) - tl.load(cu_q + s))) // BLOCK + r  # the row's query block
    real = qb * BLOCK < ctx
    last_row = qb < 0
    if DENSE_LAST > 0:  # the chunk's last rows read every causal block
        last_row = qb > (tl.load(chunk_context_lens + s) - 1) // BLOCK - DENSE_LAST
    cols = tl.arange(0, BLOCK_N)
    votes = tl.zeros([BLOCK_N], tl.int32)
    for v in range(VOTERS):  # a loop, not unrolled: one sort in the code however many voters
        head = g * SEL_STEP + v
        row = s * stride_ss + head * stride_sh + r * stride_sr
        votes += _keep(Scores, Thresholds, row, head, stride_sh, cols, num_cols, qb, real, last_row, ratio,
                       POOL_HEADS, POOL_MAX, BLOCK_N, KEEP_SINK, KEEP_RECENT, RECENT, USE_RATIO).to(tl.int32)
    kept = votes * 2 > VOTERS if MAJORITY else votes > 0
    out = ((s * tl.num_programs(1) + g) * tl.num_programs(0) + r) * num_cols
    tl.store(Mask + out + cols, kept, mask=cols < num_cols)


@triton.jit(do_not_specialize=["num_cols"])
def _lists_kernel(Mask, Blocks, Counts, num_cols, BLOCK_N: tl.constexpr):
    """Program ``row``: the row's kept blocks, ascending, and their count."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    kept = tl.load(Mask + row * num_cols + cols, mask=cols < num_cols, other=0).to(tl.int32)
    slot = tl.cumsum(kept, 0) - kept
    tl.store(Blocks + row * num_cols + slot, cols, mask=kept != 0)
    tl.store(Counts + row, tl.sum(kept, 0))


def _warps(block_n: int, device: torch.device) -> int:
    return 1 if device.type != "cuda" else 4 if block_n <= 1024 else 8


# head_reduce -> (voters, pooled heads, pool by max, majority vote, heads a selection head steps), in groups
def _voting(head_reduce: str, num_heads: int, group: int) -> tuple[int, int, bool, bool, int]:
    return {
        "mean": (1, group, False, False, group),
        "max": (1, group, True, False, group),
        "none": (1, 1, False, False, 1),
        "union": (group, 1, False, False, group),
        "majority": (group, 1, False, True, group),
        "global_majority": (num_heads, 1, False, True, 0),
    }[head_reduce]


def select_mask(
    scores: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block: int,
    num_kv_heads: int, head_reduce: str, threshold: torch.Tensor, ratio: float | None = None,
    keep_sink: bool = True, keep_recent: bool = True, recent_blocks: int = 1, dense_last_rows: int = 0,
    chunk_context_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`nanovllm_xattn.selection.select_blocks_reference` in one Triton launch (CUDA tensors, or CPU
    tensors under Triton's interpreter): ``[S, Hs, R, N]`` bool, equal to the reference up to the rounding of
    a row's sums (the module docstring). At most :data:`MAX_KEY_BLOCKS` key blocks."""
    num_seqs, num_heads, rows, cols = scores.shape
    if head_reduce not in HEAD_REDUCTIONS:
        raise ValueError(f"head_reduce={head_reduce!r}: use one of {', '.join(HEAD_REDUCTIONS)}")
    if cols > MAX_KEY_BLOCKS:
        raise ValueError(f"{cols} key blocks: the Triton selection sorts at most {MAX_KEY_BLOCKS} a row; use "
                         "select_blocks_reference")
    group = num_heads // num_kv_heads
    voters, pool_heads, pool_max, majority, step = _voting(head_reduce, num_heads, group)
    num_sel = num_heads if head_reduce == "none" else num_kv_heads
    mask = torch.empty(num_seqs, num_sel, rows, cols, dtype=torch.bool, device=scores.device)
    if mask.numel() == 0:
        return mask
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    block_n = max(16, next_power_of_2(cols))
    ends = context_lens if chunk_context_lens is None else chunk_context_lens
    _select_kernel[(rows, num_sel, num_seqs)](
        scores, threshold, cu_seqlens_q, context_lens, ends, mask,
        cols, scores.stride(0), scores.stride(1), scores.stride(2), 0.0 if ratio is None else float(ratio),
        SEL_STEP=step, VOTERS=voters, POOL_HEADS=pool_heads, POOL_MAX=pool_max, MAJORITY=majority,
        BLOCK=block, BLOCK_N=block_n, KEEP_SINK=keep_sink, KEEP_RECENT=keep_recent, RECENT=recent_blocks,
        DENSE_LAST=dense_last_rows, USE_RATIO=ratio is not None, num_warps=_warps(block_n, scores.device),
    )
    return mask


def list_blocks(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nanovllm_xattn.selection.block_lists_reference` in one Triton launch: ``(blocks [S, Hs, R, N]
    int32, counts [S, Hs, R] int32)``, each row's first ``count`` entries its kept blocks ascending (the rest
    unwritten, never read), as wide as the mask: no host read."""
    cols = mask.shape[-1]
    blocks = torch.empty(mask.shape, dtype=torch.int32, device=mask.device)
    counts = torch.empty(mask.shape[:-1], dtype=torch.int32, device=mask.device)
    if mask.numel() == 0:
        return blocks, counts.zero_()
    block_n = max(16, next_power_of_2(cols))
    _lists_kernel[(counts.numel(),)](mask.contiguous(), blocks, counts, cols, BLOCK_N=block_n,
                                     num_warps=_warps(block_n, mask.device))
    return blocks, counts
