"""The engine's side of sparse-attention policies: what a policy sees for one layer and phase
(:class:`PolicyContext`), the check of its selections, and the policies and observers of one engine
(:class:`PolicyHooks`), which the attention layers call directly.

Plugins reach these names through the public policy API, :mod:`nanovllm.sparse`, which also holds the
base class :class:`nanovllm.sparse.SparsePolicy`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import attrs
import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.kv.store import KVStore, LayerKV, PagedLayerKV
from nanovllm.sparse import SparsePolicy, contract_problems


@attrs.define(slots=True)
class PolicyContext:
    """What a policy sees for one layer and one phase of a step.

    Every read of the history goes through the layer's KV store ``kv`` (:class:`nanovllm.kv.LayerKV`),
    which offers the same operations whether the history is in the paged GPU cache or, with KV offload, in
    the host pool (where it streams in what they read): a policy that reads through them has one code path
    for both. ``k_cache`` / ``v_cache`` are the store's paged view of the layer (with offload, the pool in
    that layout: device-addressable, read across PCIe); read them through the methods below. ``kv``
    defaults to the paged GPU cache over ``k_cache`` / ``v_cache``.
    """

    layer_id: int
    is_prefill: bool
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] of this phase
    meta: PhaseMetadata
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], this layer
    v_cache: torch.Tensor
    scale: float
    backend: AttentionBackend
    selected_blocks: torch.Tensor | None = None  # set by the engine from select_blocks
    new_keys: torch.Tensor | None = None  # [num_tokens, num_kv_heads, head_dim]: this phase's new tokens
    new_values: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [num_tokens] their positions
    kv: LayerKV = attrs.field(
        default=attrs.Factory(lambda ctx: PagedLayerKV(ctx.layer_id, ctx.k_cache, ctx.v_cache), takes_self=True)
    )

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

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

    # -- reads of the history, on either store ----------------------------------------------------------

    def attend_blocks(
        self, q: torch.Tensor, block_indices: torch.Tensor, kv_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of ``q`` over the selected history blocks (see ``AttentionBackend.attend_blocks``;
        ``kv_lens`` defaults to ``history_lens``). With offload only these blocks cross PCIe, one KV head
        at a time where the selection is per head."""
        return self.kv.attend_blocks(self, q, block_indices, self.history_lens if kv_lens is None else kv_lens)

    def attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of each prefill chunk over its own new tokens, causal (always on the GPU)."""
        return self.backend.attend_chunk(q, k, v, self.meta, self.scale)

    def merge(self, out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine two partial attentions over disjoint keys by log-sum-exp."""
        return self.backend.merge(out_a, lse_a, out_b, lse_b)

    def attend_all(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Dense causal attention over the whole context: the backend's paged kernels on the GPU cache;
        with offload, every history block streamed in (prefill: merged with the chunk, ``k``/``v``)."""
        return self.kv.attend_all(self, q, k, v)

    def read_blocks(self, block_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[num_seqs, k, block_size, num_kv_heads, head_dim]`` of logical blocks
        ``[num_seqs, k]`` (-1: zeros), this step's tokens included, on the query's device. With offload
        they are read from the pool across PCIe."""
        return self.kv.read_blocks(self, block_indices)

    def read_keys(self, block_indices: torch.Tensor) -> torch.Tensor:
        """The keys alone of :meth:`read_blocks`: half the bytes, for estimates that score keys."""
        return self.kv.read_blocks(self, block_indices, values=False)[0]

    def read_paged(
        self, blocks: torch.Tensor | Callable[[], torch.Tensor], values: bool = True, width: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(k_cache, v_cache, block_tables)`` through which the logical blocks marked in ``blocks``
        (``[num_seqs, n]`` bool, or a function returning it, called only when the store copies) can be read
        by logical block, so a kernel written for the paged cache runs unchanged on both stores. On the GPU
        cache: the cache itself and the phase's block tables, every block readable, nothing copied. With
        offload: only the marked blocks cross PCIe, into a compact paged cache of their own, ``width``
        blocks a sequence (default: the most any sequence marks, read back with a host sync; give it to
        stay inside CUDA graphs); unmarked blocks map to block 0, never read them. ``values=False`` reads
        the keys alone (``v_cache`` is None)."""
        return self.kv.read_paged(self, blocks, values, width)

    def read_staged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(k_cache, v_cache, block_tables)``: a prefill phase's whole contexts copied out of the paged GPU
        cache into the attention backend's pages of 128 tokens (``AttentionBackend.staged_cache``), where
        that pays: on Hopper with cache pages smaller than 128 tokens, the ``triton`` backend copies large
        phases whose contexts fit its workspace, and a kernel that loads whole key tiles of a page through
        TMA can then run. None elsewhere (read through :meth:`read_paged`), always with KV offload. Read with
        the phase's ``cu_seqlens_q`` and ``context_lens``; valid for this layer's call."""
        return self.kv.read_staged(self)


# -- the selection contract -----------------------------------------------------------------------------

CHECK_SELECTIONS_ENV = "NANOVLLM_CHECK_SELECTIONS"
_PAD_LAST = torch.iinfo(torch.int32).max  # -1 padding sorts after every block index


class PolicyContractError(RuntimeError):
    """A policy's method returned what the contract (:mod:`nanovllm.sparse`) forbids."""


def selection_checks_enabled() -> bool:
    """Whether engines check every selection outside CUDA graphs: ``NANOVLLM_CHECK_SELECTIONS``, on
    unless it is ``0``."""
    return os.environ.get(CHECK_SELECTIONS_ENV, "1").strip() != "0"


def selection_problem(ctx: PolicyContext, blocks: object, values: bool = True) -> str | None:
    """The rule of ``select_blocks``' result that ``blocks`` breaks for ``ctx``, or ``None``: a tensor on
    the query's device, int32, shape ``[num_seqs, k]`` or ``[num_seqs, num_kv_heads, k]``, and with
    ``values`` each row block indices strictly ascending, below ``ctx.num_history_blocks``, then -1
    padding. The value rules cost a few vectorised operations and, on a GPU, one host sync."""
    if not isinstance(blocks, torch.Tensor):
        return f"returned {type(blocks).__name__}, not a torch.Tensor"
    if blocks.dtype != torch.int32:
        return f"returned dtype {blocks.dtype}, not torch.int32"
    if blocks.device != ctx.query.device:
        return f"returned a tensor on {blocks.device}; the queries are on {ctx.query.device}"
    num_seqs, num_kv_heads = ctx.meta.num_seqs, ctx.num_kv_heads
    heads = blocks.shape[1:-1]
    if blocks.dim() not in (2, 3) or blocks.shape[0] != num_seqs or heads not in ((), (num_kv_heads,)):
        return (f"returned shape {list(blocks.shape)}; expected [num_seqs={num_seqs}, k] (all heads) or "
                f"[num_seqs, num_kv_heads={num_kv_heads}, k] (per KV head)")
    if not values or blocks.numel() == 0:
        return None
    limit = ctx.num_history_blocks.view(num_seqs, *([1] * (blocks.dim() - 1)))
    key = torch.where(blocks < 0, _PAD_LAST, blocks)
    unordered = (key[..., 1:] <= key[..., :-1]) & (key[..., 1:] != _PAD_LAST)
    if not bool((blocks < -1).any() | (blocks >= limit).any() | unordered.any()):
        return None
    return _first_broken_row(blocks, limit.expand_as(blocks[..., :1]))


def _first_broken_row(blocks: torch.Tensor, limit: torch.Tensor) -> str:
    """The first row that breaks a value rule, and how (the error path: plain Python on the host)."""
    per_head = blocks.dim() == 3
    rows, limits = blocks.reshape(-1, blocks.shape[-1]).tolist(), limit.reshape(-1).tolist()
    for r, (row, n) in enumerate(zip(rows, limits, strict=True)):
        where = f"sequence {r}"
        if per_head:
            where = f"sequence {r // blocks.shape[1]}, KV head {r % blocks.shape[1]}"
        valid = [b for b in row if b != -1]
        if any(b < -1 for b in row):
            return f"{where}: {row}: entries are block indices >= 0 or -1 padding"
        if row[: len(valid)] != valid:
            return f"{where}: {row}: -1 padding must come only at the end"
        if valid != sorted(set(valid)):
            return f"{where}: {row}: block indices must be strictly ascending"
        if valid and valid[-1] >= n:
            return (f"{where}: {row}: block {valid[-1]} goes beyond the {n} history blocks "
                    "(ctx.num_history_blocks)")
    raise AssertionError("selection_problem found a broken rule that _first_broken_row does not")


def check_selection(policy: object, ctx: PolicyContext, blocks: object) -> None:
    """Raise :class:`PolicyContractError` naming the policy, the layer and phase, and the rule, unless
    ``blocks`` keeps the contract of ``select_blocks``. Inside a CUDA-graph capture only the shape, dtype
    and device are checked (the values would need a host sync; replays run no Python)."""
    tensor = isinstance(blocks, torch.Tensor)
    capturing = tensor and blocks.is_cuda and torch.cuda.is_current_stream_capturing()
    problem = selection_problem(ctx, blocks, values=not capturing)
    if problem is not None:
        cls = type(policy)
        raise PolicyContractError(
            f"{cls.__qualname__}.select_blocks ({cls.__module__}) broke the selection contract at layer "
            f"{ctx.layer_id}, {'prefill' if ctx.is_prefill else 'decode'}: {problem}. The rules are in "
            "nanovllm.sparse.SparsePolicy.select_blocks"
        )


# -- the policies and observers of one engine ---------------------------------------------------------


def check_hook_arguments(member: object, label: str) -> None:
    """Raise ``TypeError`` naming ``label`` and the method when a per-layer method or notification hook of
    ``member`` (a policy or observer, class or instance) takes argument names the contract does not pass."""
    problems = contract_problems(member)
    if problems:
        raise TypeError(f"{label}: {'; '.join(problems)} (nanovllm.sparse)")


def implements(member: object, hook: str) -> bool:
    """Whether ``member`` has a method ``hook`` of its own: an observer's, or a policy's override of
    :class:`SparsePolicy`'s no-op (which the engine never calls, so a policy without metadata costs nothing
    per layer)."""
    method = getattr(member, hook, None)
    return callable(method) and getattr(method, "__func__", None) is not getattr(SparsePolicy, hook, None)


def _checked_phase(policy: SparsePolicy, compute: str) -> SparsePolicy:
    """``policy``, once it has the methods the attention layers call for its phase."""
    wanted = ("select_blocks", compute) if policy.requires_block_selection else (compute,)
    for name in wanted:
        if not callable(getattr(policy, name, None)):
            raise TypeError(f"policy {type(policy).__name__} does not implement {name}")
    return policy


class PolicyHooks:
    """What one engine calls on its policies and observers, resolved once: the policy of each phase
    (``prefill``, ``decode``: the same instance when one policy runs both), whose per-layer methods the
    attention layers call directly, and for each notification hook (:class:`nanovllm.hookspecs.ObserverSpec`)
    a tuple of the bound methods of the members that implement it, in the order prefill policy, decode
    policy, observers. ``check_selections`` (default: ``NANOVLLM_CHECK_SELECTIONS``) turns on the check of
    every selection outside CUDA graphs (:func:`check_selection`)."""

    def __init__(
        self, prefill: SparsePolicy, decode: SparsePolicy, observers: Iterable[object] = (),
        check_selections: bool | None = None,
    ) -> None:
        self.members: list[object] = []
        for member in (prefill, decode, *observers):
            if not any(member is m for m in self.members):
                check_hook_arguments(member, f"{type(member).__module__}.{type(member).__qualname__}")
                self.members.append(member)
        self.check_selections = selection_checks_enabled() if check_selections is None else check_selections
        self.prefill = _checked_phase(prefill, "compute_chunked_prefill")
        self.decode = _checked_phase(decode, "compute_chunked_decode")
        self.kv_write = self._calls("on_kv_write")
        self.prefill_offload = self._calls("on_prefill_offload")
        self.decode_offload = self._calls("on_decode_offload")
        self.blocks_allocated = self._calls("on_blocks_allocated")
        self.blocks_selected = self._calls("on_blocks_selected")

    def implementers(self, hook: str) -> list[object]:
        """The members that implement notification hook ``hook``."""
        return [m for m in self.members if implements(m, hook)]

    def _calls(self, hook: str) -> tuple[Callable, ...]:
        return tuple(getattr(m, hook) for m in self.implementers(hook))

    def cuda_graph_safe_on(self, store: KVStore) -> bool:
        """Whether the decode policy and every implementer of a hook that ``store`` calls inside a decode
        forward pass declare ``cuda_graph_safe``: the offload notifications count only on a store that
        calls them (a paged GPU cache never does)."""
        inside = ["on_kv_write", "on_blocks_selected"] + ["on_decode_offload"] * store.notifies_offload
        members = [self.decode, *(m for name in inside for m in self.implementers(name))]
        return all(getattr(m, "cuda_graph_safe", False) for m in members)

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """The layers a selected policy runs dense (``SparsePolicy.dense_layers``): resident under offload."""
        return frozenset().union(*(p.dense_layers(num_layers) for p in self.policies))

    @property
    def policies(self) -> list[SparsePolicy]:
        """The distinct policy instances (one when a single policy runs both phases)."""
        return [self.prefill] if self.prefill is self.decode else [self.prefill, self.decode]
