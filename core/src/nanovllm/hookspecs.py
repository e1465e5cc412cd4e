"""The pluggy hook specifications of nanovllm, and the check of an implementation's argument names.

Two kinds of hooks, both under the pluggy project name ``"nanovllm"``:

- Registration hooks (:class:`RegistrationSpec`), called once per process for every plugin module named
  by an entry point in the group ``nanovllm`` (discovery lives in :mod:`nanovllm.plugins`).
- Notification hooks (:class:`ObserverSpec`), what the engine tells the selected policies and any
  observers. A method named like one is an implementation without a decorator. The engine resolves the
  implementers once per engine (:class:`nanovllm.policy.PolicyHooks`) and calls them directly, so the
  per-layer hot path pays a method call, never a pluggy dispatch.

The rest of the sparse-policy contract, the flags and the per-layer methods the engine calls, is
:class:`nanovllm.sparse.SparsePolicy`; :mod:`nanovllm.sparse` is the whole public API of policy plugins.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from nanovllm.plugins import Registry
    from nanovllm.kv.store import KVTransfer
    from nanovllm.kv import KVWrite
    from nanovllm.policy import PolicyContext

PROJECT_NAME = "nanovllm"
ENTRY_POINT_GROUP = "nanovllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegistrationSpec:
    """Called once per process for every loaded plugin; entries name lazy ``"module:Name"`` targets."""

    @hookspec
    def register_model_families(self, registry: Registry) -> None:
        """Map Hugging Face ``architectures`` names to lazy model classes.

        ``registry.add_model_family("Qwen3ForCausalLM", "nanovllm_qwen3.model:Qwen3ForCausalLM")``
        """

    @hookspec
    def register_attention_backends(self, registry: Registry) -> None:
        """Add attention backends with what they support.

        ``registry.add_attention_backend("torch", "pkg.mod:Backend", devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16"), head_sizes=None)``; ``None`` means any. A backend that cannot run on
        this machine (a missing wheel, no suitable GPU) passes ``unavailable="why, and the fix"``: it is listed
        with the reason and selecting it raises it.
        """

    @hookspec
    def register_sparse_policies(self, registry: Registry) -> None:
        """Add sparse-attention policies: ``registry.add_sparse_policy(name, policy, config=...)``."""

    @hookspec
    def register_observers(self, registry: Registry) -> None:
        """Add observers of the runtime hooks (statistics, density logging), chosen per engine with
        ``LLM(..., observers=["name:key=value"])``: ``registry.add_observer(name, target, config=...)``."""


class ObserverSpec:
    """The notification hooks: the engine calls them on the prefill policy, the decode policy and every
    observer that implements them (a policy that leaves :class:`nanovllm.sparse.SparsePolicy`'s no-ops is
    not called). Each call covers a whole batch: tensors in, no Python loop over sequences. Hooks called
    inside the forward pass (all but ``on_blocks_allocated``) are captured in the decode CUDA graphs when
    every implementer declares ``cuda_graph_safe``: then they must not synchronise with the host nor make
    shapes depend on device values.
    """

    @hookspec
    def on_kv_write(self, write: KVWrite) -> None:
        """New keys and values of one layer have landed in its KV store, the paged GPU cache or the host
        pool (every sequence of the step, prefill and decode; the keys are on the GPU either way). Called for the prefill policy, the decode policy and observers alike,
        whichever phase each runs, at a cost proportional to the new tokens. Per-block metadata (Quest's
        key min/max) is kept up to date here. Under KV offload a hybrid model's sliding-window layers, whose
        windows stay on the GPU in a pool of their own (no policy runs on them), do not call it."""

    @hookspec
    def on_prefill_offload(self, transfer: KVTransfer) -> None:
        """With KV offload, a notification of what the host store moves across PCIe for one layer's
        prefill chunks (:class:`nanovllm.kv.KVTransfer`): their new keys and values stored to the pool
        (``kind="store"``), or pool blocks loaded into a GPU slot (``kind="load"``), with the layer. No
        policy needs it to stay correct: ``on_kv_write`` keeps metadata up to date on both stores."""

    @hookspec
    def on_decode_offload(self, transfer: KVTransfer) -> None:
        """As ``on_prefill_offload``, for the decode phase."""

    @hookspec
    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        """Physical blocks ``[n]`` (int64, on the device) were handed out to hold new tokens: reset their
        per-block metadata, in every layer. Called once per step before the forward pass, outside any CUDA
        graph. Queue the reset without a host sync: ``m.index_fill_(1, block_ids, 0.0)``, not
        ``m[:, block_ids] = 0.0``, which copies the scalar from pageable memory and waits for the GPU (the
        conformance kit's ``no_host_sync`` check). A block shared through the prefix cache is not reallocated,
        so its metadata stays. Under KV offload only the host pool's blocks are reported (see
        ``on_kv_write``)."""

    @hookspec
    def on_blocks_selected(self, ctx: PolicyContext, block_indices: torch.Tensor) -> None:
        """Observers only: a policy's ``select_blocks`` returned ``block_indices`` for ``ctx`` (density
        logging, statistics, contract checks)."""


# -- argument names ---------------------------------------------------------------------------------------


def _argument_names(func: object, drop_first: bool) -> list[str]:
    """The names pluggy passes by: parameters without a default (``self`` dropped where it is unbound)."""
    params = [p for p in inspect.signature(func).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [p.name for p in params[int(drop_first):] if p.default is p.empty]


def spec_signature(spec: type, hook: str) -> str:
    """``hook(arg, ...)`` as ``spec`` declares it."""
    return f"{hook}({', '.join(_argument_names(getattr(spec, hook), True))})"


def argument_problems(
    plugin: object, spec: type, hooks: Iterable[str] | None = None, marked_only: bool = False
) -> list[str]:
    """One line for each hook implementation of ``plugin`` (a class, instance or module) whose argument
    names are not all among those ``spec`` declares for the hook: pluggy calls hooks by keyword, so such an
    implementation fails at its first call. Implementations are the callables named like a hook of
    ``spec`` (with ``marked_only``, those marked ``@hookimpl`` alone); ``hooks`` limits which (default:
    every public name of ``spec``)."""
    problems = []
    for hook in hooks if hooks is not None else [name for name in vars(spec) if not name.startswith("_")]:
        func = getattr(plugin, hook, None)
        if not callable(func) or (marked_only and not hasattr(func, f"{PROJECT_NAME}_impl")):
            continue
        unbound = isinstance(plugin, type) and not isinstance(
            inspect.getattr_static(plugin, hook), (staticmethod, classmethod))
        wanted = _argument_names(getattr(spec, hook), True)
        extra = [a for a in _argument_names(func, unbound) if a not in wanted]
        if extra:
            problems.append(f"{hook} takes {', '.join(map(repr, extra))}, which the hook does not pass; "
                            f"the hook's arguments are {spec_signature(spec, hook)}")
    return problems
