"""The public API of sparse-attention policy plugins, version :data:`API_VERSION`.

A policy distribution imports from nanovllm only this module and the attention backend's API
(:mod:`nanovllm.attention.backend`). Here, in one place:

- :class:`SparsePolicy`, the base class: the flags the engine reads and the per-layer methods it calls
  directly (``select_blocks``, ``compute_chunked_prefill``, ``compute_chunked_decode``), and the set-up
  methods it calls once per engine.
- The notification hooks, :class:`ObserverSpec` (pluggy hook specifications): what the engine tells the
  selected policies and any observers (new keys written, blocks allocated, blocks selected, host-store
  traffic with KV offload).
- Registration: :data:`hookimpl` marks the ``register_*`` hooks of a plugin's entry-point module; a
  policy or observer declares the API version it was written for there
  (``registry.add_sparse_policy(name, target, config=..., api_version="1.0")``).
- What a policy sees: :class:`PolicyContext` (one layer and one phase of a step), :class:`KVWrite` (new
  keys and values), :class:`KVTransfer` (what the host store moved), the step metadata types
  :class:`PhaseMetadata` and :class:`StepMetadata`, and the selection contract (:func:`selection_problem`,
  :func:`check_selection`, :class:`PolicyContractError`).
- Kernel helpers a plugin's Triton kernels may use: ``tile_blocks``, ``unmasked_kv``, ``attention_scores``,
  ``online_softmax_step``, ``online_softmax_step_fused_scale`` and ``online_softmax_accumulate``
  (``@triton.jit`` functions), ``num_sms``, ``max_shared_memory``,
  ``is_interpreted`` and :func:`paged_kv_descriptors`; :func:`host_lengths` (a phase's lengths as host ints);
  ``cdiv`` and ``next_power_of_2`` for a launch's grid and block sizes on the host (Triton's own functions of
  those names go through its constexpr wrapper there).

Importing this module imports no torch: the names that need it (the context, the types and the kernel
helpers) are loaded on first use. A plugin's registration module can therefore import :data:`hookimpl`
from here and still be listed by ``nanovllm plugins`` without torch.

Versions are ``"MAJOR.MINOR"``. The minor version grows when names are added; the major version grows
when a name is removed or renamed or a behaviour changes incompatibly. A plugin written for ``X.Y`` runs
on an API ``X.Z`` with ``Z >= Y``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.hookspecs import ObserverSpec, argument_problems, hookimpl
from nanovllm.kernel_sizes import cdiv, next_power_of_2

if TYPE_CHECKING:
    import torch

    from nanovllm.kv.store import KVTransfer, KVWrite
    from nanovllm.policy import PolicyContext

API_VERSION = "1.5"

POLICY_FLAGS = ("supports_prefill", "supports_decode", "requires_block_selection", "cuda_graph_safe")
POLICY_METHODS = ("select_blocks", "compute_chunked_prefill", "compute_chunked_decode")


class APIVersionError(RuntimeError):
    """A plugin declares a policy API version this nanovllm does not provide."""


def _parse_version(version: str, what: str) -> tuple[int, int]:
    major, dot, minor = str(version).partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise APIVersionError(f"{what} declares policy API version {version!r}; write it as 'MAJOR.MINOR', "
                              f"e.g. {API_VERSION!r}")
    return int(major), int(minor)


def check_api_version(declared: str, what: str = "this plugin") -> None:
    """Raise :class:`APIVersionError`, naming ``what`` and the fix, unless code written for policy API
    ``declared`` (``"MAJOR.MINOR"``) runs on this one: the same major version as :data:`API_VERSION` and a
    minor version no newer than its."""
    major, minor = _parse_version(declared, what)
    have_major, have_minor = _parse_version(API_VERSION, "nanovllm")
    if major == have_major and minor <= have_minor:
        return
    if (major, minor) > (have_major, have_minor):
        fix = f"upgrade nanovllm to a release that provides policy API {major}.{minor} or a later {major}.x"
    else:
        fix = f"upgrade the plugin to a release written for policy API {have_major}.x"
    raise APIVersionError(f"{what} is written for policy API {declared}, and this nanovllm provides "
                          f"{API_VERSION} (nanovllm.sparse.API_VERSION): {fix}")


class SparsePolicy:
    """Base class of sparse-attention policies; subclass it and override what differs.

    ``config`` is the policy's attrs config instance built from the selection string (``None`` for a
    policy registered without one). Per layer and phase the engine builds a :class:`PolicyContext`, calls
    ``select_blocks`` when ``requires_block_selection`` (the result, checked by :func:`check_selection`,
    goes to ``ctx.selected_blocks``), then ``compute_chunked_prefill`` or ``compute_chunked_decode``. It
    calls these methods directly, positionally, on the instance. Each call covers the whole batch of one
    phase in one layer: tensors in, tensors out, no Python loop over sequences. The defaults attend to the
    selected history blocks (prefill: plus the chunk itself, merged by log-sum-exp), so a policy that only
    chooses blocks overrides ``select_blocks`` alone.

    The flags, read by the engine at start:

    - ``supports_prefill`` / ``supports_decode`` (default true): the phases it can run; a phase that no
      selected policy covers runs ``full``.
    - ``requires_block_selection`` (default true): the engine calls ``select_blocks`` before each
      ``compute_chunked_*`` and puts the result in ``ctx.selected_blocks``; false for policies that
      override the computation or read everything.
    - ``cuda_graph_safe`` (default false): decode, and the policy's notification hooks called inside the
      forward pass, may be captured in CUDA graphs: no host sync, no shapes that depend on device values.
      An unsure policy runs eagerly.
    - ``supported_kv_cache_dtypes`` (default ``("auto",)``): the ``kv_cache_dtype`` options whose caches the
      policy reads (``"fp8_e4m3"``, ``"fp8_e5m2"``: 8-bit floats, widened to the query's dtype on loading);
      the engine refuses the others at start.

    Per-block metadata is kept from the notification hooks (:class:`ObserverSpec`): ``on_kv_write`` and
    ``on_blocks_allocated``. A policy that leaves them as the base class's no-ops is not called for them.
    """

    supports_prefill: bool = True
    supports_decode: bool = True
    requires_block_selection: bool = True
    cuda_graph_safe: bool = False
    supported_kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def __init__(self, config: Any = None) -> None:
        self.config = config

    # -- set-up, once per engine ----------------------------------------------------------------------

    def metadata_bytes_per_block(
        self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> int:
        """Device bytes of the per-block metadata ``initialize`` will allocate, per KV block, on the same
        ``device`` (default 0). The engine sizes the KV cache with them, so metadata stays inside the
        memory budget."""
        return 0

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """The layers this policy always attends to densely over the whole history (default none). With
        KV offload the engine keeps their KV resident in a paged GPU cache, read and written as without
        offload, so their whole history does not cross PCIe every step; the GPU memory for it comes out of
        the same budget as the load slots."""
        return frozenset()

    def check_offload(self) -> None:
        """Called at start when KV offload is on (``kv_offloading_size``), before the pool is allocated. A
        policy whose options need every key on the GPU raises ``ValueError`` here, naming the fix, so
        ``LLM(...)`` fails instead of a later step."""

    def initialize(
        self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        """Called once the KV cache exists, before any step; allocate per-block metadata here."""

    # -- per layer and phase ----------------------------------------------------------------------------

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        """The history blocks each sequence attends to, for one layer and one phase (default: all).

        Called by the engine when ``requires_block_selection`` is true; the result goes to
        ``ctx.selected_blocks`` before ``compute_chunked_*``. Logical block indices (block ``j`` holds
        tokens ``[j * block_size, (j + 1) * block_size)``), int32, strictly ascending, padded with -1 at
        the end, each below ``ctx.num_history_blocks``: ``[num_seqs, k]`` shared by all heads, or
        ``[num_seqs, num_kv_heads, k]`` per KV head. The engine checks these rules outside CUDA graphs
        (:func:`check_selection`; ``NANOVLLM_CHECK_SELECTIONS=0`` turns it off).

        The history is the sequence before this step's chunk in prefill (a prompt prefilled in one chunk,
        without a prefix-cache hit, has none: nothing to choose), the whole sequence in decode. Sparsity
        inside a prefill chunk belongs to ``compute_chunked_prefill``.
        """
        return ctx.all_history_blocks()

    def compute_chunked_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext
    ) -> torch.Tensor:
        """Attention output ``[num_tokens, num_heads, head_dim]`` of the batch's prefill chunks.

        ``q``, ``k``, ``v`` are the chunks' new tokens (already in the cache); the history is in the cache.
        The default attends to the selected history blocks and to the chunk itself, causally, and merges
        the two by log-sum-exp."""
        hist_out, hist_lse = ctx.attend_blocks(q, self._selection(ctx))
        return ctx.merge(hist_out, hist_lse, *ctx.attend_chunk(q, k, v))[0]

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        """Attention output ``[num_seqs, num_heads, head_dim]``: one query per sequence over its whole
        history, the query's own key included. The default attends to the selected blocks."""
        return ctx.attend_blocks(q, self._selection(ctx))[0]

    def _selection(self, ctx: PolicyContext) -> torch.Tensor:
        """The engine's selection, or this policy's own when called outside the engine."""
        return ctx.selected_blocks if ctx.selected_blocks is not None else self.select_blocks(ctx)

    # -- notification hooks (ObserverSpec): no-ops the engine does not call --------------------------

    def on_kv_write(self, write: KVWrite) -> None:
        """See :meth:`ObserverSpec.on_kv_write`."""

    def on_prefill_offload(self, transfer: KVTransfer) -> None:
        """See :meth:`ObserverSpec.on_prefill_offload` (a notification: nothing to do by default)."""

    def on_decode_offload(self, transfer: KVTransfer) -> None:
        """See :meth:`ObserverSpec.on_decode_offload` (a notification: nothing to do by default)."""

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        """See :meth:`ObserverSpec.on_blocks_allocated`."""

    def block_metadata(self, layer_id: int, block_ids: torch.Tensor) -> torch.Tensor | None:
        """The per-block metadata of physical ``block_ids`` at ``layer_id`` (first dimension follows
        ``block_ids``), or ``None`` when the policy keeps none (the default). The conformance kit compares
        it with the metadata a fresh instance derives from the cache in one ``on_kv_write``."""
        return None


def contract_problems(member: object) -> list[str]:
    """One line for each method of ``member`` (a policy or observer, class or instance) named like a
    per-layer method or a notification hook whose argument names are not all among those the contract
    passes: the names of :class:`SparsePolicy`'s per-layer methods and of :class:`ObserverSpec`'s hooks."""
    return argument_problems(member, SparsePolicy, POLICY_METHODS) + argument_problems(member, ObserverSpec)


def host_lengths(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                 host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
                 ) -> tuple[Sequence[int], Sequence[int]]:
    """``(query lengths, context lengths)`` per sequence as host ints: ``host_lens`` when given
    (``PhaseMetadata.host_lens``), else read back from the tensors (a host sync on the GPU)."""
    if host_lens is not None:
        return host_lens
    return (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist(), context_lens.tolist()


def paged_kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, box_rows: int) -> tuple | None:
    """Tensor-memory-accelerator (TMA) descriptors of paged caches ``[num_blocks, block_size, Hkv, D]``, seen
    as 2-D ``[num_blocks * block_size, Hkv * D]``: a kernel loads the ``box_rows`` keys of one KV head from
    row ``block * block_size + slot``, column ``kv_head * D``, with ``desc.load([row, col])``. None where they
    cannot serve (then load through pointers): a GPU before Hopper, CPU tensors outside Triton's
    interpreter, a head size that is not a power of two, pages that do not hold whole boxes
    (``block_size % box_rows``), or a layout whose rows are not evenly strided, 16-byte aligned runs."""
    from nanovllm.attention.triton_kernels import _kv_descriptors

    return _kv_descriptors(k_cache, v_cache, True, box_rows)


# -- names that need torch, loaded on first use ---------------------------------------------------------

# name -> module, or (module, the name there)
_LAZY = {
    "PolicyContext": "nanovllm.policy",
    "KVWrite": "nanovllm.kv.store",
    "KVTransfer": "nanovllm.kv.store",
    "PolicyContractError": "nanovllm.policy",
    "check_selection": "nanovllm.policy",
    "selection_problem": "nanovllm.policy",
    "PhaseMetadata": "nanovllm.attention.metadata",
    "StepMetadata": "nanovllm.attention.metadata",
    "tile_blocks": "nanovllm.attention.triton_kernels",
    "online_softmax_step": "nanovllm.attention.triton_kernels",
    "online_softmax_step_fused_scale": "nanovllm.attention.triton_kernels",
    "online_softmax_accumulate": "nanovllm.attention.triton_kernels",
    "unmasked_kv": "nanovllm.attention.triton_kernels",
    "attention_scores": "nanovllm.attention.triton_kernels",
    "num_sms": "nanovllm.attention.triton_kernels",
    "max_shared_memory": "nanovllm.attention.triton_kernels",
    "is_interpreted": "nanovllm.attention.triton_kernels",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = target if isinstance(target, tuple) else (target, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "API_VERSION", "APIVersionError", "check_api_version", "hookimpl", "KV_CACHE_DTYPES", "ObserverSpec",
    "SparsePolicy",
    "POLICY_FLAGS", "POLICY_METHODS", "cdiv", "contract_problems", "host_lengths", "next_power_of_2",
    "paged_kv_descriptors", *_LAZY,
]
