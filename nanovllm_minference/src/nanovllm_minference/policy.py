"""The ``minference`` policy: sparse prefill over per-head patterns estimated from each chunk's last queries.

Per layer and prefill chunk:

1. **Patterns.** Every query head has one: ``vertical_slash`` (the default), ``a_shape`` or
   ``block_sparse``, from the config or a per-head JSON file.
2. **Estimation** (vertical-slash heads): the softmax of the chunk's last ``last_q`` queries over every
   key so far; column sums rank the vertical lines, diagonal sums the slash lines. Two launches for all
   heads of all sequences.
3. **Index** (:mod:`nanovllm_minference.index`): the best columns become gathered columns, and the
   diagonals slash tiles: by default the best bands of one key tile each (``slash_unit="tile"``: the
   columns' selection, the bands' scores and one index launch), or MInference's best single diagonals
   (``"diagonal"``: ranking, selection and index in one launch).
4. **Attention**: one kernel over the index, causal, grouped KV heads, on the paged cache, the chunk's
   own keys included (they are already in the cache); with ``dense_above``, a launch before it measures
   the index's work, and the kernel runs dense where that is above the limit, without a host sync.

Every read goes through the context's KV store (``ctx.read_paged``), one code path on both stores: on the
GPU cache the kernels read the cache in place; with KV offload the estimate reads every key (no values)
across PCIe, the density check comes before any value is read, and the attention reads only the KV blocks
the index touches, into a compact buffer it addresses through a block table of its own. Chunks whose
sequences are all shorter than ``dense_below`` and the first ``skip_layers`` layers run dense, as does a
chunk whose index would compute more than ``dense_above`` of dense attention's work (a pattern that is
not sparse).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import attrs
import torch
from nanovllm.sparse import PhaseMetadata, PolicyContext, SparsePolicy

from nanovllm_minference.config import MInferenceConfig
from nanovllm_minference.head_config import HeadPattern, layer_heads, load_head_patterns
from nanovllm_minference.index import (
    TILE,
    SparseIndex,
    block_sparse_index,
    computed_density,
    lines_to_index_reference,
    select_index_reference,
    tile_slash_lines,
    top_lines,
)


@attrs.frozen
class LayerPlan:
    """The patterns of one layer's query heads, as the index builder uses them."""

    kinds: tuple[str, ...]  # per query head
    vertical: torch.Tensor  # int64 [H]: columns (a_shape: n_init; block_sparse: key tiles per query tile)
    slash: torch.Tensor  # int64 [H]: diagonals (a_shape: n_local)
    masks: dict[str, torch.Tensor]  # bool [H] per pattern the layer uses, made once
    max_sizes: tuple[int, int]  # the largest vertical and slash sizes, on the host
    min_sizes: tuple[int, int]  # the smallest
    same_sizes: bool  # every head has the largest sizes
    max_top_k: int  # the most key tiles a block-sparse head keeps, on the host (0: none is)

    def heads(self, kind: str) -> torch.Tensor:
        return self.masks[kind]

    def uses(self, kind: str) -> bool:
        return kind in self.masks

    def only(self, kind: str) -> bool:
        """Every head has this pattern."""
        return set(self.masks) == {kind}

    @property
    def reads_keys(self) -> bool:
        """Whether the index needs the keys (the estimate, block scores); A-shape is fixed."""
        return self.uses("vertical_slash") or self.uses("block_sparse")


class MInferencePolicy(SparsePolicy):
    supports_prefill = True
    supports_decode = False
    requires_block_selection = False

    def __init__(self, config: MInferenceConfig | None = None) -> None:
        super().__init__(config or MInferenceConfig())
        path = self.config.config_path
        self.head_patterns = load_head_patterns(path) if path is not None else None
        self._plans: dict[tuple[int, int, torch.device], LayerPlan] = {}

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """The first ``skip_layers`` run dense: under offload their KV stays on the GPU."""
        return frozenset(range(min(self.config.skip_layers, num_layers)))

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        if self.head_patterns is not None and len(self.head_patterns) != num_layers:
            raise ValueError(
                f"config_path {self.config.config_path!r} describes {len(self.head_patterns)} layers, but the "
                f"model has {num_layers}: use the pattern file made for this model"
            )

    # -- the prefill phase ----------------------------------------------------------------------------

    def compute_chunked_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext):
        cfg, meta = self.config, ctx.meta
        if ctx.layer_id < cfg.skip_layers or meta.max_context_len < cfg.dense_below:
            return ctx.attend_all(q, k, v)
        plan = self._plan(ctx.layer_id, q.shape[1], q.device)
        if self._dense_by_budget(plan, meta):
            return ctx.attend_all(q, k, v)
        ops = _ops(q.device)
        # keys are read only for what the index scores with (A-shape needs none)
        key_cache, key_tables = ctx.k_cache, meta.block_tables
        if plan.reads_keys:  # as wide as the longest context (a host int): a copying store reads nothing back
            key_cache, _, key_tables = ctx.read_paged(lambda: _every_block(ctx), values=False,
                                                      width=-(-meta.max_context_len // ctx.block_size))
        index = self.build_index(q, ctx, key_cache, key_tables, ops)
        del key_cache
        dense_above, decided = cfg.dense_above, []

        def touched() -> torch.Tensor:
            # called only by a store that copies: the density is read back (a host sync) before any value
            # is read, and when dense nothing is
            marks = touched_blocks(index, meta.cu_seqlens_q, meta.context_lens, ctx.block_size,
                                   meta.block_tables.shape[1])
            decided.append(dense_above is not None and float(ops.density(
                index, meta.cu_seqlens_q, meta.context_lens, meta.max_query_len)) > dense_above)
            return torch.zeros_like(marks) if decided[0] else marks

        # over small cache pages the backend's staged pages of 128 let the kernel load whole tiles through TMA
        paged = ctx.read_staged() or ctx.read_paged(touched)
        if decided and decided[0]:
            return ctx.attend_all(q, k, v)
        # on the GPU cache the kernel itself runs dense above dense_above (decided on the GPU, no sync)
        return ops.attend(q, *paged, meta.cu_seqlens_q, meta.context_lens, index, ctx.scale,
                          meta.max_query_len, dense_above=None if decided else dense_above,
                          host_lens=meta.host_lens)[0]

    def _dense_by_budget(self, plan: LayerPlan, meta: PhaseMetadata) -> bool:
        """Whether the chunk runs dense before any estimate: every head of the layer is vertical-slash, and
        the keys its budget names (the smallest column budget plus the smallest diagonal one) are more than
        ``dense_above`` of the keys the chunk's rows see (:func:`budget_share`). Its index would then compute
        about that share of dense work or more (tiles round it up), and the dense kernel is faster: the
        estimate is not worth making. A chunk early in a prompt, or a prompt not much longer than the budget,
        runs dense."""
        cfg = self.config
        if cfg.dense_above is None or not plan.only("vertical_slash") or cfg.adaptive_budget is not None:
            return False
        lens = meta.host_lens or ((meta.max_query_len,), (meta.max_context_len,))
        return budget_share(sum(plan.min_sizes), *lens) > cfg.dense_above

    def build_index(self, q: torch.Tensor, ctx: PolicyContext, k_cache: torch.Tensor, tables: torch.Tensor,
                    ops: Ops) -> SparseIndex:
        """The index of every head of every sequence of the chunk, keys read from ``k_cache`` through
        ``tables``."""
        cfg, meta = self.config, ctx.meta
        plan = self._plan(ctx.layer_id, q.shape[1], q.device)
        max_sizes = plan.max_sizes
        if cfg.adaptive_budget is not None and cfg.config_path is None:
            longest = meta.max_context_len * cfg.adaptive_budget
            max_sizes = max(1, int(longest * 0.2)), max(1, int(longest * 0.8))
        adaptive = cfg.adaptive_budget if cfg.config_path is None else None
        scores = None
        if plan.uses("vertical_slash"):
            scores = ops.estimate(q, k_cache, tables, meta.cu_seqlens_q, meta.context_lens, ctx.scale,
                                  cfg.last_q, meta.max_context_len, host_lens=meta.host_lens)
        if plan.only("vertical_slash") and cfg.slash_unit == "tile":
            return self._tile_index(scores, meta, plan, ops, max_sizes, adaptive)
        if plan.only("vertical_slash"):  # the common case: ranking, top lines and index in one launch
            return ops.select(*scores, meta.cu_seqlens_q, meta.context_lens, plan.vertical, plan.slash,
                              cfg.num_sink_tokens, cfg.num_recent_diags, max_sizes, meta.max_context_len,
                              adaptive)
        return self._mixed_index(q, meta, plan, scores, k_cache, tables, ops)

    def _tile_index(self, scores, meta, plan: LayerPlan, ops: Ops, max_sizes: tuple[int, int],
                    adaptive: float | None) -> SparseIndex:
        """The index of a vertical-slash layer whose diagonals are chosen a key tile at a time
        (:func:`~nanovllm_minference.index.tile_slash_lines`); the columns as MInference chooses them."""
        cfg = self.config
        one = torch.ones_like(plan.slash)
        columns = ops.select(*scores, meta.cu_seqlens_q, meta.context_lens, plan.vertical, one,
                             cfg.num_sink_tokens, 1, (max_sizes[0], 1), meta.max_context_len, adaptive)
        starts = meta.context_lens - (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1])
        slash_sizes = plan.slash
        if adaptive is not None:  # the seed fork's share of each sequence's context, [S, 1]
            slash_sizes = (meta.context_lens.double() * adaptive * 0.8).long().clamp(min=1)[:, None]
        offsets, offset_valid = tile_slash_lines(scores[1], starts, meta.context_lens, slash_sizes,
                                                 cfg.num_recent_diags, max_sizes[1])
        slots = torch.arange(columns.columns.shape[-1], device=starts.device)
        return ops.index(columns.columns, slots < columns.column_counts[..., None], offsets, offset_valid, starts,
                         meta.max_context_len)

    def _mixed_index(self, q, meta, plan: LayerPlan, scores, k_cache, tables, ops: Ops) -> SparseIndex:
        """The index of a layer whose heads mix patterns (a per-head file, or A-shape / block-sparse)."""
        cfg = self.config
        lens = meta.context_lens.long()
        num_seqs, num_heads = lens.shape[0], q.shape[1]
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()
        empty = torch.zeros(num_seqs, num_heads, 1, dtype=torch.long, device=q.device)
        none = torch.zeros(num_seqs, num_heads, 1, dtype=torch.bool, device=q.device)
        columns, column_valid, offsets, offset_valid = empty, none, empty, none
        if scores is not None:
            vertical = plan.vertical[None, :].expand(num_seqs, -1)
            slash = plan.slash[None, :].expand(num_seqs, -1)
            lines = top_lines(*scores, meta.context_lens, vertical, slash, cfg.num_sink_tokens,
                              cfg.num_recent_diags, plan.max_sizes, plan.same_sizes)
            columns, column_valid, offsets, offset_valid = _only(plan.heads("vertical_slash"), *lines)
        if plan.uses("a_shape"):
            fixed = _a_shape_lines(plan, lens)
            columns, column_valid, offsets, offset_valid = _either(
                plan.heads("a_shape"), fixed, (columns, column_valid, offsets, offset_valid)
            )
        index = ops.index(columns, column_valid, offsets, offset_valid, lens - q_lens, meta.max_context_len)
        if plan.uses("block_sparse"):
            top_k = torch.where(plan.heads("block_sparse"), plan.vertical, 0)
            keys = _keys_in_order(k_cache, tables, meta.max_context_len)
            blocks, counts = block_sparse_index(q, keys, meta.cu_seqlens_q, meta.context_lens, top_k,
                                                meta.max_query_len, plan.max_top_k)
            index = attrs.evolve(index, blocks=blocks, block_counts=counts)
        return index

    def _plan(self, layer_id: int, num_heads: int, device: torch.device) -> LayerPlan:
        key = (layer_id, num_heads, device)
        if key not in self._plans:
            cfg = self.config
            if self.head_patterns is not None:
                heads = layer_heads(self.head_patterns, layer_id, num_heads)
            elif cfg.pattern == "a_shape":
                heads = [HeadPattern("a_shape", cfg.n_init, cfg.n_local)] * num_heads
            elif cfg.pattern == "block_sparse":
                heads = [HeadPattern("block_sparse", cfg.top_k_blocks, 1)] * num_heads
            else:
                heads = [HeadPattern("vertical_slash", cfg.vertical_size, cfg.slash_size)] * num_heads
            sizes = torch.tensor([[h.vertical_size, h.slash_size] for h in heads], device=device)
            kinds = tuple(h.pattern for h in heads)
            masks = {kind: torch.tensor([k == kind for k in kinds], device=device) for kind in set(kinds)}
            max_sizes = max(h.vertical_size for h in heads), max(h.slash_size for h in heads)
            min_sizes = min(h.vertical_size for h in heads), min(h.slash_size for h in heads)
            same_sizes = all((h.vertical_size, h.slash_size) == max_sizes for h in heads)
            max_top_k = max((h.vertical_size for h in heads if h.pattern == "block_sparse"), default=0)
            self._plans[key] = LayerPlan(kinds, sizes[:, 0].contiguous(), sizes[:, 1].contiguous(), masks,
                                         max_sizes, min_sizes, same_sizes, max_top_k)
        return self._plans[key]


def budget_share(budget: int, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
    """The share of the keys that rows see (a row at position ``p`` sees ``p + 1``) which a budget of
    ``budget`` keys a row covers (all of a row's keys when it sees no more), over every row of the chunks
    (sequence ``s``: the last ``query_lens[s]`` of ``context_lens[s]`` positions); 0 for no rows."""
    covered = seen = 0
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        first = ctx - q_len  # rows see first + 1 .. ctx keys
        capped = min(max(budget, first), ctx)  # rows up to it see at most the budget's keys
        seen += _sum_above(first, ctx)
        covered += _sum_above(first, capped) + budget * (ctx - capped)
    return covered / seen if seen else 0.0


def _sum_above(first: int, last: int) -> int:
    """``first + 1 + ... + last`` (0 when ``last <= first``)."""
    return (last * (last + 1) - first * (first + 1)) // 2 if last > first else 0


def touched_blocks(index: SparseIndex, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                   num_blocks: int) -> torch.Tensor:
    """``[S, num_blocks]`` bool: the logical KV blocks holding a key that some head of the sequence reads."""
    device = context_lens.device
    lens = context_lens.long()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    num_tiles = -(-num_blocks * block_size // TILE)
    last_tile = ((lens - 1) // TILE)[:, None, None]
    dump = num_tiles + 1  # where invalid entries go

    def marks_of(tiles: torch.Tensor, valid: torch.Tensor, value: int = 1) -> torch.Tensor:
        where = torch.where(valid, tiles, dump).flatten(1)
        marks = torch.zeros(lens.shape[0], num_tiles + 2, dtype=torch.long, device=device)
        return marks.scatter_add_(1, where, torch.full_like(where, value))

    # slash tile d covers key tiles base(0) + d .. base(last query tile) + d: a range, marked by its ends
    first_base = ((lens - q_lens) // TILE)[:, None, None]
    last_base = ((lens - 1) // TILE)[:, None, None]
    d = index.slash_tiles.long()
    real = torch.arange(d.shape[-1], device=device) < index.slash_counts[..., None]
    start, end = (first_base + d).clamp(min=0), torch.minimum(last_base + d, last_tile)
    ok = real & (start <= end)
    marks = (marks_of(start, ok) - marks_of(end + 1, ok)).cumsum(-1)
    columns = index.columns.long()
    marks += marks_of(columns // TILE, torch.arange(columns.shape[-1], device=device) < index.column_counts[..., None])
    if index.blocks is not None:
        real = torch.arange(index.blocks.shape[-1], device=device) < index.block_counts[..., None]
        marks += marks_of(index.blocks.long(), real)
    per_key = (marks[:, :num_tiles] > 0).repeat_interleave(TILE, dim=1)[:, : num_blocks * block_size]
    per_key &= torch.arange(per_key.shape[1], device=device)[None, :] < lens[:, None]
    return per_key.view(-1, num_blocks, block_size).any(-1)


def _every_block(ctx: PolicyContext) -> torch.Tensor:
    """``[S, n]`` bool: every KV block of each sequence's context (``n`` from the host's longest context)."""
    num_blocks = -(-ctx.meta.context_lens.long() // ctx.block_size)
    width = -(-ctx.meta.max_context_len // ctx.block_size)
    return torch.arange(width, device=num_blocks.device)[None, :] < num_blocks[:, None]


def _keys_in_order(k_cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """``[S, L, Hkv, D]``: each sequence's keys in position order, from the paged cache."""
    bs = k_cache.shape[1]
    width = -(-length // bs)
    physical = tables[:, :width].long().clamp(min=0)
    return k_cache[physical].flatten(1, 2)


def _a_shape_lines(plan: LayerPlan, lens: torch.Tensor):
    """A-shape as lines: the first ``n_init`` columns and the ``n_local`` nearest diagonals."""
    lines = []
    for sizes, width in zip((plan.vertical, plan.slash), plan.max_sizes, strict=True):
        first = torch.arange(width, device=lens.device)
        valid = first < torch.minimum(sizes[None, :], lens[:, None])[..., None]  # [S, H, width]
        lines += [first.expand_as(valid), valid]
    return tuple(lines)


def _only(heads: torch.Tensor, columns, column_valid, offsets, offset_valid):
    """Lines of the given heads only: the others get none."""
    return columns, column_valid & heads[:, None], offsets, offset_valid & heads[:, None]


def _either(heads: torch.Tensor, chosen, other):
    """Per head: ``chosen`` lines where ``heads``, else ``other`` (lists padded to a common width)."""
    out = []
    for a, b in zip(chosen, other, strict=True):
        width = max(a.shape[-1], b.shape[-1])
        a, b = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (a, b))
        out.append(torch.where(heads[None, :, None], a, b))
    return tuple(out)


class Ops(NamedTuple):
    estimate: Callable
    select: Callable  # the estimate to a SparseIndex (a vertical-slash layer)
    index: Callable  # lines to a SparseIndex (a layer of mixed patterns)
    attend: Callable
    density: Callable  # the index's computed density (a float, or a device scalar)


def _ops(device: torch.device) -> Ops:
    """The Triton kernels on the GPU, their torch references elsewhere."""
    if device.type == "cuda":
        from nanovllm_minference.attention import index_density, sparse_attention
        from nanovllm_minference.estimate import estimate
        from nanovllm_minference.index import lines_to_index, select_index

        return Ops(estimate, select_index, lines_to_index, sparse_attention, index_density)
    from nanovllm_minference.attention import sparse_attention_reference
    from nanovllm_minference.estimate import estimate_reference

    return Ops(estimate_reference, select_index_reference, lines_to_index_reference,
               sparse_attention_reference, computed_density)
