"""A Quest-style test policy: per-block key min/max kept through the KV-write hook, top-k blocks per KV head.

It exercises the whole contract the way a real metadata-keeping policy does: ``initialize`` allocates the
metadata, ``on_blocks_allocated`` resets it, ``on_kv_write`` folds in the new keys (decodes and prefill
chunks, whichever phase runs), and ``select_blocks`` returns ``[num_seqs, num_kv_heads, k]``. Scores are
Quest's upper bound ``sum_i max(q_i * min_i, q_i * max_i)``, reduced over the query heads of a GQA group
and, in prefill, over the chunk's queries. Everything stays on the device with no host sync, so the
policy is CUDA-graph safe.
"""

from __future__ import annotations

import attrs
import torch
from nanovllm.hookspecs import hookimpl
from nanovllm.kv import KVWrite
from nanovllm.policy import PolicyContext
from nanovllm.sparse import KV_CACHE_DTYPES, SparsePolicy


@attrs.define(frozen=True)
class QuestStyleConfig:
    budget_blocks: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    dense_layers: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # as Quest's skip_layers


class QuestStylePolicy(SparsePolicy):
    supports_prefill = True
    supports_decode = True
    requires_block_selection = True
    cuda_graph_safe = True
    supported_kv_cache_dtypes = KV_CACHE_DTYPES  # its metadata comes from the new keys, before any cache

    def metadata_bytes_per_block(self, num_layers, num_kv_heads, head_dim, block_size, dtype, device) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * 4  # float32 min and max

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        return frozenset(range(min(self.config.dense_layers, num_layers)))

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        # One extra row takes the writes of skipped slots, so no boolean indexing (and no sync) is needed.
        shape = (num_layers, num_blocks + 1, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.key_min = torch.full(shape, float("inf"), dtype=torch.float32, device=device)
        self.key_max = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        self.key_min.index_fill_(1, block_ids, float("inf"))  # not x[:, ids] = inf: that copy syncs
        self.key_max.index_fill_(1, block_ids, float("-inf"))

    def on_kv_write(self, write: KVWrite) -> None:
        rows = torch.where(write.block_ids >= 0, write.block_ids, self.num_blocks)
        keys = write.key.float()
        index = rows[:, None, None].expand_as(keys)
        self.key_min[write.layer_id].scatter_reduce_(0, index, keys, "amin")
        self.key_max[write.layer_id].scatter_reduce_(0, index, keys, "amax")

    def block_metadata(self, layer_id: int, block_ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.key_min[layer_id, block_ids], self.key_max[layer_id, block_ids]], dim=1)

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        if ctx.layer_id < self.config.dense_layers:
            return ctx.attend_all(q)
        return super().compute_chunked_decode(q, ctx)

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        if ctx.layer_id < self.config.dense_layers:
            return ctx.all_history_blocks()
        meta = ctx.meta
        num_seqs, width = meta.block_tables.shape
        hkv = ctx.num_kv_heads
        physical = meta.block_tables.clamp(min=0).long()
        # [S, W, Hkv, D]
        kmin, kmax = self.key_min[ctx.layer_id, physical], self.key_max[ctx.layer_id, physical]
        q = ctx.query.float()
        q = q.view(q.shape[0], hkv, q.shape[1] // hkv, q.shape[2])  # [T, Hkv, G, D]
        seq = torch.repeat_interleave(
            torch.arange(num_seqs, device=q.device), meta.query_lens.long(), output_size=q.shape[0]
        )
        qs = q[:, None]  # [T, 1, Hkv, G, D]
        # [T, W, Hkv, G]
        bound = torch.maximum(qs * kmin[seq][:, :, :, None], qs * kmax[seq][:, :, :, None]).sum(-1)
        row_score = bound.amax(dim=-1)  # over the group's query heads
        score = torch.full((num_seqs, width, hkv), float("-inf"), device=q.device)
        # over the chunk's queries
        score = score.scatter_reduce(0, seq[:, None, None].expand_as(row_score), row_score, "amax")
        score = score.transpose(1, 2)  # [S, Hkv, W]
        n = ctx.num_history_blocks.long()[:, None, None]
        idx = torch.arange(width, device=q.device)
        score = score.masked_fill(idx == n - 1, float("inf"))  # the newest block always stays
        valid = idx < n
        score = torch.where(valid, score, float("-inf"))
        k = min(self.config.budget_blocks, width)
        top = score.topk(k, dim=-1)
        chosen = torch.where(top.values > float("-inf"), top.indices, width)
        chosen = chosen.sort(dim=-1).values
        return torch.where(chosen < width, chosen, -1).to(torch.int32)


class Plugin:
    """Registers the policy in-process: ``get_plugins().register(Plugin(), "quest-style")``."""

    @hookimpl
    def register_sparse_policies(self, registry) -> None:
        registry.add_sparse_policy(
            "quest_style", f"{__name__}:QuestStylePolicy", config=f"{__name__}:QuestStyleConfig"
        )
