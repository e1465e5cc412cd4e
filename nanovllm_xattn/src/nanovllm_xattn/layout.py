"""The block grid every part of the policy shares.

Positions are cut into blocks of ``block`` tokens from position 0, for keys and queries alike, so key
block ``b`` and query block ``b`` cover the same positions and block ``b`` is the diagonal of row ``b``.
A prefill chunk of sequence ``s`` holds the queries at positions ``context_len - query_len ..
context_len - 1``; row ``r`` of a per-query-block tensor is query block ``first_query_block(s) + r``,
with ``first_query_block = (context_len - query_len) // block``. Rows past the chunk are padding.
"""

from __future__ import annotations

import torch


def num_query_blocks(max_query_len: int, block: int) -> int:
    """Rows of per-query-block tensors: the most blocks a chunk of ``max_query_len`` queries can touch,
    wherever in a block it starts."""
    return (max_query_len + 2 * block - 2) // block


def num_key_blocks(max_context_len: int, block: int) -> int:
    return -(-max_context_len // block)


def first_query_blocks(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block: int) -> torch.Tensor:
    """``[S]`` int64: the block of each sequence's first query of the chunk."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    return (context_lens.long() - q_lens) // block
