"""Quest's three steps in plain torch: the CPU path of the policy and the oracle of the Triton kernels.

Metadata of one layer is ``[num_blocks, num_kv_heads, 2, head_dim]`` in the KV dtype: per physical block
and KV head, the channel-wise minimum (index 0) and maximum (index 1) of the keys written to the block.
Minima and maxima of stored keys are stored keys' values, so they are exact in any dtype.
"""

from __future__ import annotations

import torch

MIN, MAX = 0, 1


def update_metadata(
    metadata: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
    block_size: int,
) -> None:
    """Fold new keys ``[T, Hkv, D]`` into the min/max of their blocks, in place. A row with slot -1 is
    skipped. A block whose first token (``position % block_size == 0``) is among the rows starts afresh,
    so a reallocated block never keeps its previous owner's bounds."""
    keep = slot_mapping >= 0
    blocks = slot_mapping[keep] // block_size
    keys = key[keep].to(metadata.dtype)
    restart = blocks[positions[keep] % block_size == 0]
    metadata[restart, :, MIN] = float("inf")
    metadata[restart, :, MAX] = float("-inf")
    index = blocks[:, None, None].expand_as(keys)
    metadata.select(2, MIN).scatter_reduce_(0, index, keys, "amin")
    metadata.select(2, MAX).scatter_reduce_(0, index, keys, "amax")


def block_scores(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
    group_reduction: str = "max", keep_sink: bool = False,
) -> torch.Tensor:
    """``[S, Hkv, W]`` float32 priority of each logical block (``W`` = block-table width) for the
    decode queries ``q [S, H, D]`` over histories of ``kv_lens`` tokens (``n = ceil(kv_lens / block_size)``
    blocks each).

    A block's bound for query head ``h`` is ``sum_i max(q_i * min_i, q_i * max_i)``, at least ``q . k``
    for every key of the block; the query heads of a GQA group combine by ``group_reduction``. The
    newest block (``n[s] - 1``) and, with ``keep_sink``, block 0 get ``+inf``; blocks at or past ``n[s]``
    get ``-inf``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = metadata.shape[1]
    width = block_tables.shape[1]
    meta = metadata[block_tables.clamp(min=0).long()].float()  # [S, W, Hkv, 2, D]
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    bound = torch.einsum("shgd,swhd->shgw", qg.clamp(min=0), meta[..., MAX, :]) + torch.einsum(
        "shgd,swhd->shgw", qg.clamp(max=0), meta[..., MIN, :]
    )
    score = bound.amax(dim=2) if group_reduction == "max" else bound.sum(dim=2)
    idx = torch.arange(width, device=q.device)
    n = ((kv_lens.long() + block_size - 1) // block_size)[:, None, None]
    forced = idx == n - 1
    if keep_sink:
        forced = forced | (idx == 0)
    score = torch.where(forced, float("inf"), score)
    return torch.where(idx < n, score, float("-inf"))


def top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[S, Hkv, k]`` int32: per row the ``k`` highest-scoring blocks (ties: the lower index), ascending,
    -1 padded; ``-inf`` (and NaN) scores are never chosen."""
    width = scores.shape[-1]
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    ordered = torch.sort(scores, dim=-1, descending=True, stable=True)
    take = min(k, width)
    idx = ordered.indices[..., :take]
    idx = torch.where(ordered.values[..., :take] > float("-inf"), idx, width).sort(dim=-1).values
    idx = torch.where(idx < width, idx, -1).to(torch.int32)
    if take < k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], k - take), -1)], dim=-1)
    return idx
