"""The attention layer every model uses: write new K/V to the layer's KV store (which tells the KV-write
hooks), unless RoPE's kernel wrote them already (:meth:`Attention.cache_slots`), then hand each phase to its
policy (which reads the store through its context)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, get_forward_context
from nanovllm.kv.cache_dtype import EIGHT_BIT_FLOATS, as_stored
from nanovllm.kv.store import CacheSlots, LayerKV
from nanovllm.policy import PolicyContext, PolicyHooks, check_selection
from nanovllm.sparse import SparsePolicy


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_id: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_id = layer_id
        # a sliding-window layer (keys within the last ``sliding_window`` positions) runs dense over its
        # window through the backend: the sparse policies apply to full-attention layers only
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None
        self.hooks: PolicyHooks | None = None
        self.kv: LayerKV | None = None  # this layer's KV store, once allocated
        self.kv_group = 0  # its KV cache group: whose slots and block tables it reads (StepMetadata.of_group)
        # set only while the runner captures piecewise prefill graphs (nanovllm.engine.prefill_graphs): called
        # instead of attending, and the static buffer the layer's QKV projection writes into, so that the
        # replayed attention call reads its q, k and v where they are
        self.graph_cut: Callable[..., torch.Tensor] | None = None
        self.qkv_out: torch.Tensor | None = None

    def bind(self, backend: AttentionBackend, hooks: PolicyHooks) -> None:
        """Set once per engine by the model runner."""
        self.backend, self.hooks = backend, hooks

    def bind_kv(self, kv: LayerKV) -> None:
        """Set once per engine by the KV store's allocation; ``k_cache`` / ``v_cache`` are its paged view."""
        self.kv = kv
        self.k_cache, self.v_cache = kv.k_cache, kv.v_cache
        self.kv_group = kv.group

    def cache_slots(self) -> CacheSlots | None:
        """Where this step's new keys and values go, for the kernel that makes the keys (RoPE's) to write them
        on the way, saving the backend's store its launch (then ``forward(..., kv_written=True)``). None
        where :meth:`forward` writes them: a backend that stores its own way (torch, the reference), a store
        that is not the paged GPU cache (the host pool), or none yet (the memory-profiling run)."""
        if self.kv is None or not self.backend.kv_write_fusable:
            return None
        meta = get_forward_context()
        return self.kv.cache_slots(meta.of_group(self.kv_group) if self.kv_group else meta)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False
    ) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` for the step's new tokens -> ``[T, H, D]``. ``kv_written``: k
        and v are already in :meth:`cache_slots`."""
        if self.graph_cut is not None:
            return self.graph_cut(self, q, k, v, kv_written)
        meta = get_forward_context()
        if self.kv is None:  # the memory-profiling run, before the store exists
            return self.backend.attend_chunk(q, k, v, meta.prefill, self.scale)[0]
        if self.kv_group:
            meta = meta.of_group(self.kv_group)
        nd = meta.num_decode_tokens
        self.kv.write(k, v, meta, self.backend, kv_written)
        if meta.prefill is None:
            return self._decode(q, k, v, meta)
        if self.k_cache.dtype in EIGHT_BIT_FLOATS:  # a chunk meets its own keys as stored, as later steps do
            k, v = as_stored(k, self.k_cache.dtype), as_stored(v, self.v_cache.dtype)
        if meta.decode is None:
            return self._prefill(q, k, v, meta)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k[:nd], v[:nd], meta)
        out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], meta)
        return out

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        if self.sliding_window is not None:
            return self.backend.decode(q, self.k_cache, self.v_cache, meta.decode, self.scale,
                                       self.sliding_window)
        policy = self.hooks.decode
        rows = slice(0, meta.num_decode_tokens)
        ctx = self._context(policy, q, k, v, meta.decode, meta.positions[rows], False)
        return policy.compute_chunked_decode(q, ctx)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        if self.sliding_window is not None:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta.prefill, self.scale,
                                        self.sliding_window)
        policy = self.hooks.prefill
        positions = meta.positions[meta.num_decode_tokens :]
        ctx = self._context(policy, q, k, v, meta.prefill, positions, True)
        return policy.compute_chunked_prefill(q, k, v, ctx)

    def _context(
        self, policy: SparsePolicy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        phase_meta: PhaseMetadata, positions: torch.Tensor, is_prefill: bool,
    ) -> PolicyContext:
        ctx = PolicyContext(
            self.layer_id, is_prefill, q, phase_meta, self.k_cache, self.v_cache, self.scale, self.backend,
            None, k, v, positions, self.kv,
        )
        if policy.requires_block_selection:
            ctx.selected_blocks = policy.select_blocks(ctx)
            if self.hooks.check_selections:
                check_selection(policy, ctx, ctx.selected_blocks)
            for on_blocks_selected in self.hooks.blocks_selected:
                on_blocks_selected(ctx, ctx.selected_blocks)
        return ctx
