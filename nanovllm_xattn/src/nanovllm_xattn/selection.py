"""From block scores to block lists: XAttention's threshold rule, GQA reductions, and the lists the
attention kernel reads.

Per query-block row (see :mod:`nanovllm_xattn.layout`) the forced blocks (key block 0 with
``keep_sink``, the diagonal, or the ``recent_blocks`` ending at it, with ``keep_recent``) come first, then the others by score, best first; the
row keeps every block up to and including the one whose cumulative score reaches ``threshold`` times the
row's total. The last ``dense_last_rows`` rows of each sequence's chunk force every causal block: a row
sums the mass of its block's queries, so a few late queries that attend far back (the prompt's end, the
question whose answer is the first sampled token) hold too small a share of their row's mass to survive
the threshold. Blocks right of the diagonal are never kept, and a threshold of 1 keeps every causal block.

:func:`select_blocks` and :func:`block_lists` run Triton kernels on CUDA tensors
(:mod:`nanovllm_xattn.selection_kernels`: one launch each, nothing read back to the host) and their torch
references, :func:`select_blocks_reference` and :func:`block_lists_reference`, elsewhere.
"""

from __future__ import annotations

import torch

from nanovllm_xattn.config import HEAD_REDUCTIONS
from nanovllm_xattn.layout import first_query_blocks


def causal_blocks(scores: torch.Tensor, first_block: torch.Tensor, context_lens: torch.Tensor,
                  block: int, recent: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(causal [S, 1, R, N], recent [S, 1, R, N])`` bool: the key blocks each row may read (none for
    padding rows) and each row's ``recent`` blocks ending at its diagonal (by default the diagonal)."""
    rows, cols = scores.shape[-2:]
    device = scores.device
    query_block = first_block[:, None] + torch.arange(rows, device=device)[None, :]  # [S, R]
    real = (query_block * block < context_lens.long()[:, None])[:, None, :, None]
    kb = torch.arange(cols, device=device)
    causal = (kb[None, None, :] <= query_block[:, :, None])[:, None] & real
    behind = query_block[:, :, None] - kb[None, None, :]
    return causal, ((behind >= 0) & (behind < recent))[:, None] & real


def threshold_mask(scores: torch.Tensor, causal: torch.Tensor, forced: torch.Tensor,
                   threshold: torch.Tensor, ratio: float | None = None) -> torch.Tensor:
    """``[S, Hx, R, N]`` bool: the blocks each row keeps. ``threshold`` is ``[Hx]`` (per head of
    ``scores``); with ``ratio`` each row keeps that fraction of its causal blocks instead (at least the
    forced ones)."""
    forced = forced & causal
    scores = scores.float().masked_fill(~causal, 0.0)
    # forced blocks first, then the others by score, blocks past the diagonal last
    priority = torch.where(forced, float("inf"), scores).masked_fill(~causal, -1.0)
    order = priority.argsort(dim=-1, descending=True, stable=True)  # ties: the lower block first
    ranked = scores.gather(-1, order)
    if ratio is None:
        total = ranked.sum(-1, keepdim=True)
        before = ranked.cumsum(-1) - ranked
        keep_ranked = before < threshold.view(1, -1, 1, 1) * total
        keep_ranked |= (threshold >= 1).view(1, -1, 1, 1)
    else:
        n_causal = causal.sum(-1, keepdim=True)
        n_keep = torch.maximum((n_causal * ratio).ceil().long(), forced.sum(-1, keepdim=True))
        keep_ranked = (torch.arange(scores.shape[-1], device=scores.device) < n_keep).expand_as(scores)
    keep = torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)
    return (keep | forced) & causal


def allowed_and_forced(scores: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                       block: int, keep_sink: bool, keep_recent: bool, recent_blocks: int,
                       dense_last_rows: int = 0, chunk_context_lens: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(causal, forced)``, each ``[S, 1, R, N]`` bool: the blocks each row may read, and those it always
    keeps (key block 0 with ``keep_sink``, the ``recent_blocks`` ending at the diagonal with
    ``keep_recent``, every causal block of each sequence's last ``dense_last_rows`` rows). The last rows
    are counted from ``chunk_context_lens`` (default ``context_lens``): the whole chunk's ends when these
    rows are a slice of it, so that slicing does not change the selection."""
    first = first_query_blocks(cu_seqlens_q, context_lens, block)
    causal, recent = causal_blocks(scores, first, context_lens, block, recent_blocks)
    forced = torch.zeros_like(causal)
    if keep_sink:
        forced[..., 0] = True
    if keep_recent:
        forced |= recent
    if dense_last_rows:
        query_block = first[:, None] + torch.arange(scores.shape[-2], device=scores.device)[None, :]  # [S, R]
        ends = context_lens if chunk_context_lens is None else chunk_context_lens
        last_block = (ends.long()[:, None] - 1) // block
        forced |= (query_block > last_block - dense_last_rows)[:, None, :, None] & causal
    return causal, forced


def _on_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``t``'s device (CUDA); the torch references serve the others."""
    return t.is_cuda


def select_blocks(scores: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block: int,
                  num_kv_heads: int, head_reduce: str, threshold: torch.Tensor, ratio: float | None = None,
                  keep_sink: bool = True, keep_recent: bool = True, recent_blocks: int = 1,
                  dense_last_rows: int = 0, chunk_context_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, Hs, R, N]`` bool, the kept blocks (:func:`select_blocks_reference`): on CUDA one Triton launch
    (:func:`~nanovllm_xattn.selection_kernels.select_mask`, equal up to the rounding of a row's sums)."""
    args = (scores, cu_seqlens_q, context_lens, block, num_kv_heads, head_reduce, threshold, ratio, keep_sink,
            keep_recent, recent_blocks, dense_last_rows, chunk_context_lens)
    if _on_triton(scores):
        from nanovllm_xattn.selection_kernels import MAX_KEY_BLOCKS, select_mask

        if scores.shape[-1] <= MAX_KEY_BLOCKS:
            return select_mask(*args)
    return select_blocks_reference(*args)


def select_blocks_reference(scores: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block: int, num_kv_heads: int, head_reduce: str, threshold: torch.Tensor,
                            ratio: float | None = None, keep_sink: bool = True, keep_recent: bool = True,
                            recent_blocks: int = 1, dense_last_rows: int = 0,
                            chunk_context_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, Hs, R, N]`` bool, the kept blocks: per KV head (``Hs = num_kv_heads``) or, with ``head_reduce
    = "none"``, per query head. ``scores`` is ``[S, H, R, N]`` and ``threshold`` ``[H]`` per query head; a
    reduction over a group uses the largest threshold of its heads."""
    num_seqs, num_heads, rows, cols = scores.shape
    group = num_heads // num_kv_heads
    causal, forced = allowed_and_forced(scores, cu_seqlens_q, context_lens, block, keep_sink, keep_recent,
                                        recent_blocks, dense_last_rows, chunk_context_lens)
    if head_reduce == "none":
        return threshold_mask(scores, causal, forced, threshold, ratio)
    grouped = scores.view(num_seqs, num_kv_heads, group, rows, cols)
    group_threshold = threshold.view(num_kv_heads, group).amax(-1)
    if head_reduce == "mean":
        return threshold_mask(grouped.mean(2), causal, forced, group_threshold, ratio)
    if head_reduce == "max":
        return threshold_mask(grouped.amax(2), causal, forced, group_threshold, ratio)
    own = threshold_mask(scores, causal, forced, threshold, ratio).view(num_seqs, num_kv_heads, group, rows, cols)
    if head_reduce == "union":
        return own.any(2)
    if head_reduce == "majority":
        return own.sum(2) * 2 > group  # forced blocks: every head keeps them
    if head_reduce == "global_majority":  # the seed fork's vote, one selection for every head
        return (own.sum((1, 2)) * 2 > num_heads)[:, None].expand(-1, num_kv_heads, -1, -1)
    raise ValueError(f"head_reduce={head_reduce!r}: use one of {', '.join(HEAD_REDUCTIONS)}")


def block_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [S, Hs, R, W] int32, counts [S, Hs, R] int32)``: each row's kept key blocks in ascending
    order, ``W`` at least the longest list (padding past a row's count is never read). On CUDA one Triton
    launch and ``W = N`` (:func:`~nanovllm_xattn.selection_kernels.list_blocks`: no host read); elsewhere
    :func:`block_lists_reference`."""
    if _on_triton(mask):
        from nanovllm_xattn.selection_kernels import list_blocks

        return list_blocks(mask)
    return block_lists_reference(mask)


def block_lists_reference(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_lists` in torch, ``W`` the longest list (read back to the host)."""
    counts = mask.sum(-1)
    width = max(int(counts.max()), 1) if mask.numel() else 1
    cols = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.int32)
    blocks = torch.where(mask, cols, torch.iinfo(torch.int32).max).sort(-1).values[..., :width]
    return blocks.contiguous(), counts.to(torch.int32)


def causal_density(mask: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                   block: int) -> float:
    """Kept blocks over causal blocks, over every row and head: the share of dense block work."""
    first = first_query_blocks(cu_seqlens_q, context_lens, block)
    causal, _ = causal_blocks(mask, first, context_lens, block)
    return float(mask.sum()) / max(float(causal.expand_as(mask).sum()), 1.0)
