"""The ``quest`` policy: per decode step and KV head, attend only to the blocks whose keys can score highest.

Quest (Tang et al., ICML 2024) keeps, per KV block and KV head, the channel-wise min and max of the
block's keys. ``sum_i max(q_i * min_i, q_i * max_i)`` bounds ``q . k`` from above for every key of the
block, so the blocks with the largest bounds are the ones that can hold the largest attention weights.
Each decode step scores every history block from its metadata alone (1/block_size of the key bytes),
keeps the ``token_budget // block_size`` best blocks per KV head, the newest block always, and attends
exactly over them.

- Metadata is kept from the KV-write hooks, on the GPU cache and with offload (the new keys are still on
  the GPU there), at a cost proportional to the new tokens; a block's bounds restart when its first token
  is written, which is how a reallocated block is first written, and a block shared through the prefix
  cache keeps them.
- The first ``skip_layers`` layers, and any step whose budget covers the whole block table, run dense.
  A sequence with no more blocks than the budget selects all of them.
- Prefill is not Quest's phase (``supports_prefill=False``): it runs ``full`` or the prefill policy.
- On CUDA the three steps are Triton kernels (:mod:`nanovllm_quest.kernels`), captured in the decode
  graphs; on the CPU their torch references (:mod:`nanovllm_quest.reference`).
- With offload, the metadata stays on the GPU and only the selected head blocks cross PCIe
  (``ctx.attend_blocks``); the ``skip_layers`` are the policy's ``dense_layers``, whose KV the engine
  keeps resident on the GPU, so their whole history does not cross PCIe every step.
"""

from __future__ import annotations

import torch
from nanovllm.policy import KVWrite, PolicyContext, SparsePolicy

from nanovllm_quest import reference
from nanovllm_quest.config import QuestConfig


def _ops(device: torch.device):
    """The Triton kernels on CUDA, the torch references elsewhere (same signatures and results)."""
    if device.type == "cuda":
        from nanovllm_quest import kernels

        return kernels
    return reference


class QuestPolicy(SparsePolicy):
    supports_prefill = False
    supports_decode = True
    requires_block_selection = True
    cuda_graph_safe = True

    def __init__(self, config: QuestConfig | None = None) -> None:
        super().__init__(config if config is not None else QuestConfig())

    def metadata_bytes_per_block(self, num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        sparse_layers = max(0, num_layers - self.config.skip_layers)
        return sparse_layers * num_kv_heads * 2 * head_dim * dtype.itemsize

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """The first ``skip_layers`` run dense: under offload their KV stays on the GPU."""
        return frozenset(range(min(self.config.skip_layers, num_layers)))

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        if self.config.token_budget < block_size:
            raise ValueError(
                f"quest: token_budget={self.config.token_budget} is less than one KV block "
                f"(block_size={block_size}); use token_budget >= {block_size}, e.g. "
                f"sparse_policy='quest:token_budget={64 * block_size}'"
            )
        self.budget_blocks = self.config.token_budget // block_size
        self.block_size = block_size
        self.ops = _ops(torch.device(device))
        sparse_layers = max(0, num_layers - self.config.skip_layers)
        # [layer - skip_layers, block, KV head, min|max, head_dim]; the dense layers keep none
        self.metadata = torch.empty(sparse_layers, num_blocks, num_kv_heads, 2, head_dim, dtype=dtype, device=device)

    # -- metadata ------------------------------------------------------------------------------------

    def on_kv_write(self, write: KVWrite) -> None:
        """Also the offload path's update: the engine calls it in place of ``on_prefill_offload`` and
        ``on_decode_offload``, while the new keys are still on the GPU, so the metadata stays there."""
        layer = write.layer_id - self.config.skip_layers
        if layer >= 0:
            self.ops.update_metadata(self.metadata[layer], write.key, write.slot_mapping, write.positions,
                                     self.block_size)

    def block_metadata(self, layer_id: int, block_ids: torch.Tensor) -> torch.Tensor | None:
        layer = layer_id - self.config.skip_layers
        return self.metadata[layer, block_ids] if layer >= 0 else None

    # -- decode ------------------------------------------------------------------------------------------

    def is_dense(self, ctx: PolicyContext) -> bool:
        """A dense layer, or a budget that covers every block a sequence of this step can have."""
        return ctx.layer_id < self.config.skip_layers or self.budget_blocks >= ctx.meta.block_tables.shape[1]

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        if self.is_dense(ctx):
            return ctx.all_history_blocks()
        scores = self.ops.block_scores(
            ctx.query, self.metadata[ctx.layer_id - self.config.skip_layers], ctx.meta.block_tables,
            ctx.history_lens, self.block_size, self.config.group_reduction, self.config.keep_sink,
        )
        return self.ops.top_blocks(scores, self.budget_blocks)

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        if self.is_dense(ctx):
            return ctx.attend_all(q)
        return ctx.attend_blocks(q, self._selection(ctx))[0]
