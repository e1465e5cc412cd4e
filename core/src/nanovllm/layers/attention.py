"""The attention layer every model uses: write new K/V to the paged cache, then hand the step to the
engine's sparse policy (which calls the attention backend's kernels)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import get_forward_context
from nanovllm.policy import PolicyContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_id = layer_id
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None
        self.prefill_fn: Callable | None = None
        self.decode_fn: Callable | None = None

    def bind(self, backend: AttentionBackend, prefill_fn: Callable, decode_fn: Callable) -> None:
        """Set once per engine by the model runner: the backend and the policy's bound methods."""
        self.backend, self.prefill_fn, self.decode_fn = backend, prefill_fn, decode_fn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` for the step's new tokens -> ``[T, H, D]``."""
        meta = get_forward_context()
        if self.k_cache.numel() == 0:  # the memory-profiling run, before the cache exists
            return self.backend.attend_chunk(q, k, v, meta.prefill, self.scale)[0]
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if meta.prefill is None:
            return self.decode_fn(q, self._context(q, meta.decode, False))
        if meta.decode is None:
            return self.prefill_fn(q, k, v, self._context(q, meta.prefill, True))
        out = torch.empty_like(q)
        out[:nd] = self.decode_fn(q[:nd], self._context(q[:nd], meta.decode, False))
        qp = q[nd:]
        out[nd:] = self.prefill_fn(qp, k[nd:], v[nd:], self._context(qp, meta.prefill, True))
        return out

    def _context(self, q: torch.Tensor, phase_meta, is_prefill: bool) -> PolicyContext:
        return PolicyContext(
            self.layer_id, is_prefill, q, phase_meta, self.k_cache, self.v_cache, self.scale, self.backend
        )
