"""The built-in ``full`` policy: every block, through the backend's dense kernels (or, with KV offload,
every block streamed in)."""

from __future__ import annotations

import attrs
import torch

from nanovllm.sparse import KV_CACHE_DTYPES, PolicyContext, SparsePolicy


@attrs.define(frozen=True)
class FullConfig:
    """``full`` takes no options."""


class FullAttentionPolicy(SparsePolicy):
    requires_block_selection = False  # the dense kernels read the whole cache through the block table
    cuda_graph_safe = True  # decode is one backend call: capturable when the backend's decode is
    supported_kv_cache_dtypes = KV_CACHE_DTYPES  # the backend reads the cache, whatever it holds

    def compute_chunked_prefill(self, q, k, v, ctx: PolicyContext) -> torch.Tensor:
        return ctx.attend_all(q, k, v)

    def compute_chunked_decode(self, q, ctx: PolicyContext) -> torch.Tensor:
        return ctx.attend_all(q)
