"""The ``quest`` policy: per decode step and KV head, attend only to the pages whose keys can score highest.

Quest (Tang et al., ICML 2024) keeps, per page and KV head, the channel-wise min and max of the page's
keys. ``sum_i max(q_i * min_i, q_i * max_i)`` bounds ``q . k`` from above for every key of the page, so
the pages with the largest bounds are the ones that can hold the largest attention weights. Each decode
step scores every history page from its metadata alone (1/page_size of the key bytes), keeps the
``token_budget // page_size`` best pages per KV head, the ``recent_pages`` newest always, and attends
exactly over their blocks. A page is ``page_size`` tokens, a whole number of KV blocks (the paper's page
is 16 tokens, one block at the engine's default block size). With ``bound_size`` below a page of one block,
the page keeps one min/max per ``bound_size`` tokens and scores the largest of those bounds.

- Metadata is kept from the KV-write hooks, on the GPU cache and with offload (the new keys are still on
  the GPU there), at a cost proportional to the new tokens. A page's bounds live at its anchor, the
  physical block of its first logical block; they restart when the page's first token is written, which
  is how a reallocated anchor is first written, and a block shared through the prefix cache keeps them.
  Sequences sharing an anchor whose later blocks differ all widen its bounds: an upper bound for each.
- The first ``skip_layers`` layers, and any step whose budget covers the whole block table, run dense.
  A sequence with no more pages than the budget selects all of them.
- Prefill is not Quest's phase (``supports_prefill=False``): it runs ``full`` or the prefill policy.
- On CUDA the steps are Triton kernels (:mod:`nanovllm_quest.kernels`), captured in the decode graphs;
  on the CPU their torch references (:mod:`nanovllm_quest.reference`).
- With offload, the metadata stays on the GPU and only the selected head blocks cross PCIe
  (``ctx.attend_blocks``); the ``skip_layers`` are the policy's ``dense_layers``, whose KV the engine
  keeps resident on the GPU, so their whole history does not cross PCIe every step.
- The query heads of a GQA group share their KV head's selection; by default (``group_reduction=mass``)
  each head's bounds become its estimated attention shares over the pages, summed over the group.
- ``rescore`` above 1 (3 by default with pages of one block) keeps the bound as a first pass: it nominates
  ``rescore`` times the budget's pages, whose keys then pick the budget (by default each head's exact
  attention share among the nominees). The nominees' keys are read through
  ``ctx.read_paged``: in place on the GPU cache, with offload only the nominated blocks' keys cross PCIe.
- ``oracle=true`` (evaluation only) ranks pages by their exact attention mass instead of the bound, reading
  every history key each step, eagerly.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from nanovllm.sparse import KVWrite, PolicyContext, SparsePolicy, StepMetadata

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
        # the oracle reads every history key through the block table's full width: evaluation, eager only
        self.cuda_graph_safe = not self.config.oracle
        self._rows_key: tuple | None = None  # (step, capturing) of the cached PageRows

    def metadata_bytes_per_block(self, num_layers, num_kv_heads, head_dim, block_size, dtype, device) -> int:
        layout = bound_layout(self.config, block_size, torch.device(device))
        itemsize = reference.FP8.itemsize if layout.float8 else dtype.itemsize
        sparse_layers = max(0, num_layers - self.config.skip_layers)
        return sparse_layers * layout.bounds_per_page * num_kv_heads * 2 * head_dim * itemsize

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """The first ``skip_layers`` run dense: under offload their KV stays on the GPU."""
        return frozenset(range(min(self.config.skip_layers, num_layers)))

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        device = torch.device(device)
        layout = bound_layout(self.config, block_size, device)
        self.block_size, self.page_size, self.bound_size = block_size, layout.page_size, layout.bound_size
        self.blocks_per_page = layout.page_size // block_size
        self.bounds_per_page = layout.bounds_per_page
        self.budget_pages = self.config.token_budget // layout.page_size
        self.rescore = self.config.rescore_factor(layout.page_size, block_size)
        # the forced pages fit the budget, the newest first: a one-page budget keeps the page being written
        self.keep_sink = self.config.keep_sink and self.budget_pages > 1
        self.recent_pages = max(1, min(self.config.recent_pages, self.budget_pages - self.keep_sink))
        self.ops = _ops(device)
        sparse_layers = max(0, num_layers - self.config.skip_layers)
        # [layer - skip_layers, block, KV head, min|max of each bound, head_dim]: a page's bounds at its
        # anchor block, one per bound_size tokens, a KV head's together; the dense layers keep none
        self.metadata = torch.empty(sparse_layers, num_blocks, num_kv_heads, 2 * self.bounds_per_page,
                                    head_dim, dtype=reference.FP8 if layout.float8 else dtype, device=device)

    # -- metadata ------------------------------------------------------------------------------------

    def on_kv_write(self, write: KVWrite) -> None:
        """On either KV store: with offload the new keys are still on the GPU, so the metadata stays there."""
        layer = write.layer_id - self.config.skip_layers
        if layer >= 0:
            self.ops.update_metadata(self.metadata[layer], write.key, write.positions, self._page_rows(write),
                                     self.bound_size)

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        """Bounds below the page start at zero in every layer. A page's first token restarts its first
        bound, and each later bound restarts at its own first token; until then it would keep the block's
        previous owner's keys. Only the newest page has such bounds, and it is always kept, so they never
        rank; clearing them keeps the metadata a function of the cache (what the conformance kit checks)."""
        if self.bounds_per_page > 1 and block_ids.numel():
            # 0 is 0.0 in any format; index_fill_, as an index assignment of a scalar copies it from
            # pageable host memory, which waits for the GPU to drain
            self.metadata.view(torch.uint8).index_fill_(1, block_ids.to(self.metadata.device), 0)

    def _page_rows(self, write: KVWrite) -> reference.PageRows:
        """The step's rows grouped by the bound they fold into, computed once per step for all its layers
        (and again inside a CUDA-graph capture, whose warm-up ran the same step outside it)."""
        capturing = write.key.is_cuda and torch.cuda.is_current_stream_capturing()
        if self._rows_key is None or self._rows_key[0] is not write.step or self._rows_key[1] != capturing:
            self._rows = page_rows(write.step, self.block_size, self.page_size, self.bound_size)
            self._rows_key = (write.step, capturing)
        return self._rows

    def block_metadata(self, layer_id: int, block_ids: torch.Tensor) -> torch.Tensor | None:
        """Per-block bounds with pages of one block. Larger pages keep their bounds at the anchor as a union
        that a shared anchor widens (see :class:`QuestConfig`), which no pass over the cache block by block
        recomputes: the conformance kit's comparison does not apply, and the tests check the bound instead."""
        layer = layer_id - self.config.skip_layers
        if layer < 0 or self.blocks_per_page > 1:
            return None
        return self.metadata[layer, block_ids]

    # -- decode ------------------------------------------------------------------------------------------

    def is_dense(self, ctx: PolicyContext) -> bool:
        """A dense layer, or a budget that covers every page a sequence of this step can have."""
        budget_blocks = self.budget_pages * self.blocks_per_page
        return ctx.layer_id < self.config.skip_layers or budget_blocks >= ctx.meta.block_tables.shape[1]

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        if self.is_dense(ctx):
            return ctx.all_history_blocks()
        lens, cfg, tables = ctx.history_lens, self.config, ctx.meta.block_tables
        if cfg.oracle:
            keys = ctx.read_keys(ctx.all_history_blocks())
            scores = reference.page_masses(ctx.query, keys, lens, self.page_size, ctx.scale,
                                           cfg.group_reduction, self.keep_sink, self.recent_pages)
            return self.ops.top_pages(scores, self.budget_pages, lens, self.block_size, self.page_size)
        # with rescore, the bound nominates rescore x the budget's pages (of one block), and their keys
        # pick the budget among them
        scores, pages = self.ops.select_pages(
            ctx.query, self.metadata[ctx.layer_id - cfg.skip_layers], tables, lens, self.block_size,
            self.page_size, self.rescore * self.budget_pages, cfg.group_reduction, self.keep_sink,
            self.recent_pages, ctx.scale,
        )
        if self.rescore == 1:
            return pages
        # in place on the GPU cache (the marks are not made); with offload only the nominees' keys cross PCIe,
        # a fixed number per sequence: no host sync
        keys, _, key_tables = ctx.read_paged(partial(nominee_marks, pages, tables.shape[1]), values=False,
                                             width=ctx.num_kv_heads * pages.shape[-1])
        return self.ops.pick_by_keys(ctx.query, keys, key_tables, lens, pages, scores, self.budget_pages,
                                     cfg.group_reduction, ctx.scale)

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        if self.is_dense(ctx):
            return ctx.attend_all(q)
        return ctx.attend_blocks(q, self._selection(ctx))[0]


def rescore_selection(
    ops, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    scores: torch.Tensor, budget_pages: int, rescore: int, group_reduction: str = "max", scale: float = 1.0,
) -> torch.Tensor:
    """Pages of one block: the ``budget_pages`` best, by their keys' exact ``q . k``, of the ``rescore x
    budget_pages`` best by ``scores`` (the bound), with ``ops`` the kernels or the torch references; the
    selection of ``select_blocks`` from scores already computed."""
    block_size = k_cache.shape[1]
    nominees = ops.top_pages(scores, rescore * budget_pages, kv_lens, block_size, block_size)
    return ops.pick_by_keys(q, k_cache, block_tables, kv_lens, nominees, scores, budget_pages,
                            group_reduction, scale)


def nominee_marks(nominees: torch.Tensor, width: int) -> torch.Tensor:
    """``[S, width]`` bool: the logical blocks that any KV head of a sequence nominates (``nominees [S, Hkv,
    C]``, -1 padded), for ``ctx.read_paged``."""
    # column 0 is the spare that -1 marks; a scatter of a scalar, since indexed assignment of True copies a
    # host tensor, which a CUDA graph capture forbids
    marks = torch.zeros(nominees.shape[0], width + 1, dtype=torch.bool, device=nominees.device)
    marks.scatter_(1, nominees.flatten(1).long() + 1, True)
    return marks[:, 1:]


class BoundLayout(NamedTuple):
    page_size: int
    bound_size: int
    float8: bool

    @property
    def bounds_per_page(self) -> int:
        return self.page_size // self.bound_size


def float8_available(device: torch.device) -> bool:
    """Triton's float8 e4m3 needs a GPU of compute capability 8.9 or newer; the CPU path is torch's."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def bound_layout(config: QuestConfig, block_size: int, device: torch.device) -> BoundLayout:
    """The page, the tokens under one bound and the bounds' dtype that ``config`` gives with KV blocks of
    ``block_size`` on ``device``, checked. ``metadata_dtype=auto`` is float8 where it is available;
    ``bound_size`` unset halves a page of one block with float8 bounds (two float8 bounds are as many bytes
    as the paper's one 16-bit bound), else it is the page."""
    page = block_size if config.page_size is None else config.page_size
    if page % block_size:
        fit = -(-page // block_size) * block_size
        raise ValueError(
            f"quest: page_size={page} is not a multiple of the KV block size (block_size={block_size}); "
            f"use a multiple of {block_size}, e.g. sparse_policy='quest:page_size={fit}', or a KV "
            f"block_size that divides {page}"
        )
    if config.token_budget < page:
        raise ValueError(
            f"quest: token_budget={config.token_budget} is less than one page (page_size={page}, block_size="
            f"{block_size}); use token_budget >= {page}, e.g. sparse_policy='quest:token_budget={64 * page}'"
        )
    if (config.rescore or 1) > 1 and page != block_size:
        raise ValueError(
            f"quest: rescore={config.rescore} ranks pages of one KV block, but page_size={page} holds "
            f"{page // block_size} blocks of {block_size}; leave page_size unset, or use rescore=1"
        )
    if config.metadata_dtype == "fp8" and not float8_available(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"quest: metadata_dtype=fp8 needs float8 in Triton, on GPUs of compute capability 8.9 or newer "
            f"(Ada, Hopper); this one is {major}.{minor}: use metadata_dtype=kv"
        )
    float8 = config.metadata_dtype == "fp8" or (config.metadata_dtype == "auto" and float8_available(device))
    bound = config.bound_size
    if bound is None:
        bound = page // 2 if float8 and page == block_size and page % 2 == 0 else page
    if bound != page and (page % bound or page != block_size):
        raise ValueError(
            f"quest: bound_size={bound} does not split the page (page_size={page}, block_size={block_size}): "
            f"bounds smaller than a page need pages of one KV block and a bound_size that divides it, "
            f"e.g. sparse_policy='quest:bound_size={block_size // 2 or 1}' with the default page"
        )
    return BoundLayout(page, bound, float8)


def page_rows(step: StepMetadata, block_size: int, page_size: int, bound_size: int | None = None
              ) -> reference.PageRows:
    """Each new row's bound: its page anchor, ``block_tables[seq, position // page_size * blocks_per_page]``
    of its sequence (decode rows: one sequence each; prefill rows: by ``cu_seqlens_q``), grouped by a stable
    sort, since sequences that share an anchor through the prefix cache write to one page in one step. With
    pages of one block the anchor is the row's own block, and a block's rows are already adjacent; with
    bounds smaller than the page (``bound_size``) a row's bound is ``slot // bound_size``, bound
    ``slot % block_size // bound_size`` of its block."""
    slots = step.slot_mapping
    if page_size == block_size:
        return reference.PageRows(torch.where(slots >= 0, slots // (bound_size or block_size), -1), None)
    per_page, nd = page_size // block_size, step.num_decode_tokens
    page_col = step.positions // page_size * per_page
    anchors = []
    for phase, rows in ((step.decode, slice(0, nd)), (step.prefill, slice(nd, slots.shape[0]))):
        if phase is None:
            continue
        tables = phase.block_tables
        count = slots[rows].shape[0]
        if tables.shape[1] == 0:  # the memory-profiling step: no cache, every slot -1
            anchors.append(torch.full_like(slots[rows], -1))
            continue
        seq = torch.arange(count, device=slots.device)  # decode: one row per sequence
        if phase is step.prefill:
            seq = torch.repeat_interleave(seq[: phase.num_seqs], phase.query_lens, output_size=count)
        col = page_col[rows].clamp(max=tables.shape[1] - 1)  # rows of CUDA-graph padding keep old positions
        anchors.append(tables[seq, col].long())
    anchor = torch.where(slots >= 0, torch.cat(anchors), -1)
    order = torch.sort(anchor, stable=True).indices
    return reference.PageRows(anchor[order], order)
