"""The ``oracle`` evaluation mode: XAttention's selection with the exact attention mass in place of the
estimate, to tell what the estimate costs from what the block budget costs.

- ``oracle="mass"``: the selection rule unchanged (forced blocks, threshold, ``head_reduce``) on the exact
  block masses: the fewest blocks whose true mass reaches the threshold.
- ``oracle="counts"``: per row and selection head, as many blocks as the estimate's selection keeps, the
  forced ones first, then those with the most true mass (the mean over a GQA group's query heads).

Both compute every query's full softmax over its keys (torch, a chunk times its context of scores per
head): slow, for quality measurements only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanovllm_xattn.attention import context_rows, query_chunks, rows_per_slice
from nanovllm_xattn.layout import num_key_blocks, num_query_blocks


def true_block_scores(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float, block: int,
                      max_query_len: int, max_context_len: int,
                      host_lens: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """``[S, H, num_query_blocks, num_key_blocks]`` float32: each query row's softmax over its causal keys,
    summed over the (query block, key block) pair. A row sums to its number of queries in the chunk (the
    estimate's to ``block / stride``); the threshold rule reads shares of the row only. ``host_lens``: the
    lengths as host ints (see :func:`~nanovllm_xattn.attention.query_chunks`)."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    device = q.device
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    scores = torch.zeros(context_lens.shape[0], num_heads, num_query_blocks(max_query_len, block),
                         num_key_blocks(max_context_len, block), dtype=torch.float32, device=device)
    for s, first_row, q_len, ctx in query_chunks(cu_seqlens_q, context_lens, host_lens):
        q0 = ctx - q_len
        num_blocks = -(-ctx // block)
        key_pos = torch.arange(ctx, device=device)
        k = context_rows(k_cache, block_tables[s], ctx, kv_head)  # [ctx, H, D]
        step = rows_per_slice(num_heads, ctx)
        for start in range(0, q_len, step):
            q_pos = torch.arange(q0 + start, min(q0 + start + step, ctx), device=device)
            rows = q[first_row + start: first_row + start + len(q_pos)].float()
            logits = torch.einsum("qhd,khd->hqk", rows, k) * scale
            future = key_pos[None, None, :] > q_pos[None, :, None]
            probs = logits.masked_fill(future, float("-inf")).softmax(-1)
            per_block = torch.nn.functional.pad(probs, (0, num_blocks * block - ctx)).view(
                num_heads, len(q_pos), num_blocks, block).sum(-1)  # [H, rows, key blocks]
            scores[s, :, :, :num_blocks].index_add_(1, q_pos // block - q0 // block, per_block)
    return scores


def keep_counts(true_scores: torch.Tensor, counts: torch.Tensor, causal: torch.Tensor,
                forced: torch.Tensor) -> torch.Tensor:
    """``[S, Hs, R, N]`` bool: per row, the ``counts`` ``[S, Hs, R]`` causal blocks ranked first, the forced
    ones before the others and those by ``true_scores`` ``[S, Hs, R, N]``."""
    forced = forced & causal
    priority = torch.where(forced, float("inf"), true_scores).masked_fill(~causal, -1.0)
    order = priority.argsort(-1, descending=True)
    keep_ranked = torch.arange(true_scores.shape[-1], device=true_scores.device) < counts[..., None]
    return torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked) & causal


def per_selection_head(true_scores: torch.Tensor, num_selection_heads: int) -> torch.Tensor:
    """``[S, Hs, R, N]``: the query heads' true block masses averaged over each group sharing a selection."""
    num_seqs, num_heads, rows, cols = true_scores.shape
    group = num_heads // num_selection_heads
    return true_scores.view(num_seqs, num_selection_heads, group, rows, cols).mean(2)
