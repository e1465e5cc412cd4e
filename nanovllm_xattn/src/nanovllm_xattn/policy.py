"""The ``xattn`` policy: block-sparse prefill whose blocks are chosen by strided antidiagonal scores.

Per layer and prefill chunk:

1. **Estimate** (:mod:`nanovllm_xattn.estimate`): every query head scores every (query block, key
   block) pair of the chunk against all keys so far, from the sums of strided antidiagonals.
2. **Selection** (:mod:`nanovllm_xattn.selection`): per query-block row, the fewest key blocks that
   reach ``threshold`` of the row's estimated mass, one selection per KV head (``head_reduce``); the
   last ``dense_last_rows`` rows of each sequence read every causal block.
3. **Attention** (:mod:`nanovllm_xattn.attention`): one kernel over the selected blocks, causal,
   grouped KV heads, on the paged cache, the chunk's own keys included (they are already there); when the
   launch has few programs, each list is read by several and a second launch merges them.

On the GPU the chunk-layer is five or six Triton launches (two for the estimate, two for the selection, one
or two for the attention) and reads nothing back to the host.

A chunk longer than ``estimate_chunk`` queries runs the three steps slice by slice, so the scores never
grow past ``estimate_chunk / block_size`` rows. Every read goes through the context's KV store
(``ctx.read_paged``), one code path on both stores: on the GPU cache the kernels read the cache in place;
with KV offload the estimate reads every key (no values) from the host pool, and the attention only the KV
blocks some selection keeps. Chunks whose sequences are
all shorter than ``dense_below``, and the first ``skip_layers`` layers, run dense.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import accumulate, pairwise

import attrs
import torch
from nanovllm.sparse import PolicyContext, SparsePolicy, host_lengths

from nanovllm_xattn.config import XAttentionConfig
from nanovllm_xattn.oracle import keep_counts, per_selection_head, true_block_scores
from nanovllm_xattn.selection import allowed_and_forced, block_lists, select_blocks


@attrs.frozen
class Slice:
    """Some query rows of a chunk, as a prefill phase of their own: the rows (indices into the chunk),
    their per-sequence boundaries, and the keys they see (up to their last row, which is causal);
    ``host_lens`` the same lengths as host ints (``PhaseMetadata.host_lens``), None where not known."""

    rows: torch.Tensor | None  # None: the whole chunk
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None


class XAttentionPolicy(SparsePolicy):
    supports_prefill = True
    supports_decode = False
    requires_block_selection = False

    def __init__(self, config: XAttentionConfig | None = None) -> None:
        super().__init__(config or XAttentionConfig())
        path = self.config.threshold_path
        self.threshold_table = load_thresholds(path) if path is not None else None
        self._thresholds: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """The first ``skip_layers`` run dense: under offload their KV stays on the GPU."""
        return frozenset(range(min(self.config.skip_layers, num_layers)))

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        cfg = self.config
        if cfg.block_size % block_size:
            raise ValueError(
                f"xattn block_size={cfg.block_size} is not a multiple of the KV cache's block_size={block_size}: "
                f"choose a multiple, e.g. sparse_policy='xattn:block_size={max(block_size, 128)}'"
            )
        if self.threshold_table is not None and len(self.threshold_table) != num_layers:
            raise ValueError(
                f"threshold_path {cfg.threshold_path!r} has {len(self.threshold_table)} layers, the model "
                f"{num_layers}: use a threshold table made for this model"
            )

    def thresholds(self, layer_id: int, num_heads: int, device: torch.device) -> torch.Tensor:
        """``[H]`` float32: each query head's threshold in this layer (made once per layer and device)."""
        key = (layer_id, num_heads, device)
        if key not in self._thresholds:
            if self.threshold_table is None:
                row = [float(self.config.threshold)] * num_heads
            else:
                row = self.threshold_table[layer_id]
                if len(row) != num_heads:
                    raise ValueError(
                        f"threshold_path {self.config.threshold_path!r} gives layer {layer_id} {len(row)} heads, "
                        f"the model {num_heads}: use a threshold table made for this model"
                    )
            self._thresholds[key] = torch.tensor(row, dtype=torch.float32, device=device)
        return self._thresholds[key]

    # -- the prefill phase ----------------------------------------------------------------------------

    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext):
        cfg, meta = self.config, ctx.meta
        if ctx.layer_id < cfg.skip_layers or meta.max_context_len < cfg.dense_below:
            return ctx.attend_all(q, k, v)
        block_scores, attend = _ops(q.device)
        # every block of every context, as wide as the longest (a host int): a copying store reads nothing back
        key_width = -(-meta.max_context_len // ctx.block_size)
        key_cache, _, key_tables = ctx.read_paged(
            lambda: _blocks_up_to(meta.context_lens, ctx.block_size, key_width), values=False, width=key_width
        )
        slices = chunk_slices(meta.cu_seqlens_q, meta.context_lens, meta.max_query_len, cfg.block_size,
                              cfg.estimate_chunk, meta.host_lens)
        masks = [self.select(q, ctx, part, key_cache, key_tables, block_scores) for part in slices]
        del key_cache
        width = meta.block_tables.shape[1]
        # over small cache pages the backend's staged pages of 128 let the kernel load whole tiles through TMA
        k_cache, v_cache, tables = ctx.read_staged() or ctx.read_paged(
            lambda: torch.stack([_touched(m, ctx.block_size, cfg.block_size, width) for m in masks]).any(0)
        )
        outs = []
        for part, mask in zip(slices, masks, strict=True):
            blocks, counts = block_lists(mask)
            part_q = q if part.rows is None else q[part.rows]
            out, _ = attend(part_q, k_cache, v_cache, tables, part.cu_seqlens_q, part.context_lens, blocks, counts,
                            cfg.block_size, ctx.scale, part.max_query_len, host_lens=part.host_lens)
            outs.append(out)
        if len(slices) == 1:
            return outs[0]
        out = torch.empty_like(q)
        for part, part_out in zip(slices, outs, strict=True):
            out[part.rows] = part_out
        return out

    def select(self, q: torch.Tensor, ctx: PolicyContext, part: Slice, key_cache: torch.Tensor,
               key_tables: torch.Tensor, block_scores) -> torch.Tensor:
        """``[S, Hs, R, N]`` bool: the key blocks each query-block row of ``part`` reads."""
        cfg = self.config
        part_q = q if part.rows is None else q[part.rows]
        if cfg.oracle is not None:
            true_scores = true_block_scores(part_q, key_cache, key_tables, part.cu_seqlens_q, part.context_lens,
                                            ctx.scale, cfg.block_size, part.max_query_len,
                                            ctx.meta.max_context_len, part.host_lens)
        if cfg.oracle == "mass":
            scores = true_scores
        else:
            scores = block_scores(part_q, key_cache, key_tables, part.cu_seqlens_q, part.context_lens, ctx.scale,
                                  cfg.stride, cfg.block_size, part.max_query_len, ctx.meta.max_context_len,
                                  host_lens=part.host_lens)
        mask = select_blocks(scores, part.cu_seqlens_q, part.context_lens, cfg.block_size, ctx.num_kv_heads,
                             cfg.head_reduce, self.thresholds(ctx.layer_id, q.shape[1], q.device), cfg.ratio,
                             cfg.keep_sink, cfg.keep_recent, cfg.recent_blocks, cfg.dense_last_rows,
                             ctx.meta.context_lens)
        if cfg.oracle == "counts":
            causal, forced = allowed_and_forced(scores, part.cu_seqlens_q, part.context_lens, cfg.block_size,
                                                cfg.keep_sink, cfg.keep_recent, cfg.recent_blocks,
                                                cfg.dense_last_rows, ctx.meta.context_lens)
            mask = keep_counts(per_selection_head(true_scores, mask.shape[1]), mask.sum(-1), causal, forced)
        return mask


def chunk_slices(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, block: int,
                 estimate_chunk: int, host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
                 ) -> list[Slice]:
    """The chunk as one slice, or cut into slices of ``estimate_chunk`` positions (whole blocks) counted
    from the block of each sequence's first query, so a query block never spans two slices. A sequence
    with no rows in a slice appears there with no queries and no keys. ``host_lens``: the query and context
    lengths as host ints (``PhaseMetadata.host_lens``); cutting without them reads the tensors back."""
    if max_query_len <= estimate_chunk:
        return [Slice(None, cu_seqlens_q, context_lens, max_query_len, host_lens)]
    span = max(estimate_chunk // block, 1) * block
    host_lens = host_lengths(cu_seqlens_q, context_lens, host_lens)
    q_lens, lens = host_lens
    starts = list(accumulate(q_lens, initial=0))[:-1]
    device = cu_seqlens_q.device
    slices = []
    for k in range(-(-(max_query_len + block - 1) // span)):
        rows, cu, kv = [], [0], []
        for start, q_len, ctx_len in zip(starts, q_lens, lens, strict=True):
            q0 = ctx_len - q_len
            base = (q0 // block) * block
            lo, hi = max(q0, base + k * span), min(ctx_len, base + (k + 1) * span)
            hi = max(hi, lo)
            rows.append(torch.arange(start + lo - q0, start + hi - q0))
            cu.append(cu[-1] + hi - lo)
            kv.append(hi if hi > lo else 0)
        if cu[-1]:
            slices.append(Slice(_on_device(torch.cat(rows), device),
                                _on_device(torch.tensor(cu, dtype=torch.int32), device),
                                _on_device(torch.tensor(kv, dtype=torch.int32), device), span,
                                (tuple(b - a for a, b in pairwise(cu)), tuple(kv))))
    return slices


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; to a GPU through pinned memory: a copy from pageable memory waits for the GPU."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def load_thresholds(path: str) -> list[list[float]]:
    """A per-layer, per-head threshold table from JSON: a list of lists of fractions in (0, 1]."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"threshold_path {path!r} cannot be read as JSON ({e}): give a JSON list of per-layer "
                         "lists of per-head thresholds") from None
    ok = isinstance(table, list) and table and all(
        isinstance(row, list) and row and all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 1
                                              for t in row)
        for row in table
    )
    if not ok:
        raise ValueError(f"threshold_path {path!r}: expected a non-empty list of per-layer lists of per-head "
                         "thresholds in (0, 1]")
    return [[float(t) for t in row] for row in table]


def _blocks_up_to(context_lens: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """``[S, width]`` bool: every KV block of each sequence's context (``width`` at least the most blocks)."""
    num_blocks = -(-context_lens.long() // block_size)
    return torch.arange(width, device=num_blocks.device)[None, :] < num_blocks[:, None]


def _touched(mask: torch.Tensor, kv_block_size: int, block: int, width: int) -> torch.Tensor:
    """``[S, width]`` bool: the KV blocks holding a key block some head of some row keeps."""
    per_block = mask.any(dim=(1, 2))  # [S, N]
    kv = per_block.repeat_interleave(block // kv_block_size, dim=1)[:, :width]
    return torch.nn.functional.pad(kv, (0, width - kv.shape[1]))


def _ops(device: torch.device):
    """(block_scores, block_sparse_attention): the Triton kernels on the GPU, their torch references
    elsewhere."""
    if device.type == "cuda":
        from nanovllm_xattn.attention import block_sparse_attention
        from nanovllm_xattn.estimate import block_scores

        return block_scores, block_sparse_attention
    from nanovllm_xattn.attention import block_sparse_attention_reference
    from nanovllm_xattn.estimate import block_scores_reference

    return block_scores_reference, block_sparse_attention_reference
