"""Sparse-attention policies: the base class third-party policies subclass, and the context they see.

A policy decides which history blocks each query attends to (``select_blocks``) and computes the
attention of a phase (``compute_chunked_prefill`` / ``compute_chunked_decode``). The defaults here
attend to the selected history blocks plus the current chunk and merge the two by log-sum-exp, so a
policy that only selects blocks overrides ``select_blocks`` alone. See :mod:`nanovllm.hookspecs`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import PhaseMetadata


@attrs.define(frozen=True, slots=True)
class PolicyContext:
    """What a policy sees for one layer and one phase of a step."""

    layer_id: int
    is_prefill: bool
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] of this phase
    meta: PhaseMetadata
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], this layer
    v_cache: torch.Tensor
    scale: float
    backend: AttentionBackend

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def total_kv_lens(self) -> torch.Tensor:
        """KV length of each sequence including this step's tokens."""
        return self.meta.context_lens

    @property
    def history_lens(self) -> torch.Tensor:
        """Tokens the selection covers: before the chunk in prefill, all of them in decode."""
        if self.is_prefill:
            return self.meta.context_lens - self.meta.query_lens
        return self.meta.context_lens

    @property
    def num_history_blocks(self) -> torch.Tensor:
        return (self.history_lens + self.block_size - 1) // self.block_size

    def all_history_blocks(self) -> torch.Tensor:
        """Logical indices of every history block, ``[num_seqs, max_blocks]``, -1 padded."""
        n = self.meta.block_tables.shape[1]
        idx = torch.arange(n, device=self.meta.block_tables.device, dtype=torch.int32)
        return torch.where(idx[None, :] < self.num_history_blocks[:, None], idx, -1)


class SparsePolicy:
    """Base class of sparse-attention policies; subclass it and override what differs.

    ``config`` is the policy's attrs config instance built from the selection string.
    """

    supports_prefill: bool = True
    supports_decode: bool = True
    requires_block_selection: bool = True

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def initialize(
        self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        """Called once the KV cache exists; allocate per-block metadata here."""

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        return ctx.all_history_blocks()

    def compute_chunked_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext
    ) -> torch.Tensor:
        backend = ctx.backend
        blocks = self.select_blocks(ctx)
        hist_out, hist_lse = backend.attend_blocks(
            q, ctx.k_cache, ctx.v_cache, ctx.meta, blocks, ctx.history_lens, ctx.scale
        )
        cur_out, cur_lse = backend.attend_chunk(q, k, v, ctx.meta, ctx.scale)
        return backend.merge(hist_out, hist_lse, cur_out, cur_lse)[0]

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        blocks = self.select_blocks(ctx)
        out, _ = ctx.backend.attend_blocks(
            q, ctx.k_cache, ctx.v_cache, ctx.meta, blocks, ctx.history_lens, ctx.scale
        )
        return out
