"""The hook specifications of nanovllm: the whole contract between the core and its plugins.

There are two kinds of hooks, both under the pluggy project name ``"nanovllm"``.

Registration hooks are called once per process, on the global plugin manager
(:mod:`nanovllm.plugins`). A plugin is a module named by an entry point in the group ``nanovllm``;
it implements any of them with ``@hookimpl`` and adds named entries to the :class:`Registry` it
receives. Entries point at lazy ``"package.module:Name"`` targets, so listing plugins imports no
torch::

    from nanovllm.hookspecs import hookimpl

    @hookimpl
    def register_sparse_policies(registry):
        registry.add_sparse_policy("local", "my_pkg.local:LocalPolicy", config="my_pkg.local:LocalConfig")

Runtime hooks are the sparse-policy interface. The engine registers the selected policy instance on
a per-engine plugin manager and binds the implementations once (:func:`bind_policy_hooks`), so the
per-layer hot path pays a bound method call, not a pluggy dispatch. Each call covers the whole batch
of one phase in one layer: tensors in, tensors out, no Python loop over sequences.
Policies usually subclass :class:`nanovllm.policy.SparsePolicy`, whose methods already have the
names below; their implementations need no decorator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from nanovllm.plugins import Registry
    from nanovllm.policy import PolicyContext

PROJECT_NAME = "nanovllm"
ENTRY_POINT_GROUP = "nanovllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegistrationSpec:
    """Called once per process for every loaded plugin."""

    @hookspec
    def register_model_families(self, registry: Registry) -> None:
        """Map Hugging Face ``architectures`` names to lazy model classes.

        ``registry.add_model_family("Qwen3ForCausalLM", "nanovllm_qwen3.model:Qwen3ForCausalLM")``
        """

    @hookspec
    def register_attention_backends(self, registry: Registry) -> None:
        """Add attention backends with what they support.

        ``registry.add_attention_backend("torch", "pkg.mod:Backend", devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16"), head_sizes=None)``; ``None`` means any.
        """

    @hookspec
    def register_sparse_policies(self, registry: Registry) -> None:
        """Add sparse-attention policies: ``registry.add_sparse_policy(name, policy, config=...)``."""


class PolicySpec:
    """The runtime sparse-policy interface, one call per layer per step for a whole phase batch.

    ``ctx`` (:class:`nanovllm.policy.PolicyContext`) holds the layer, the phase, the paged cache of
    the layer, the batch's block tables and lengths, and the attention backend.
    """

    @hookspec(firstresult=True)
    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        """Choose the history blocks each sequence attends to.

        Returns logical block indices ``[num_seqs, k]`` (int32, ascending, padded with -1): index
        ``j`` names the sequence's j-th block, holding tokens ``[j * block_size, (j + 1) * block_size)``.
        ``ctx.num_history_blocks`` says how many blocks each sequence has before the current tokens.
        """

    @hookspec(firstresult=True)
    def compute_chunked_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PolicyContext
    ) -> torch.Tensor:
        """Attention output ``[num_tokens, num_heads, head_dim]`` for the prefill chunks of the batch.

        ``q``, ``k``, ``v`` are the new tokens (already written to the cache); the history is in the cache.
        """

    @hookspec(firstresult=True)
    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        """Attention output ``[num_seqs, num_heads, head_dim]`` for one new token per sequence."""


RUNTIME_HOOKS = ("select_blocks", "compute_chunked_prefill", "compute_chunked_decode")


class _PolicyPluginManager(pluggy.PluginManager):
    """Per-engine manager: methods named like a runtime hook are implementations, decorated or not."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name in RUNTIME_HOOKS and callable(getattr(plugin, name, None)):
            return {}
        return opts


def make_policy_manager() -> pluggy.PluginManager:
    """A fresh per-engine plugin manager carrying the runtime policy hooks."""
    pm = _PolicyPluginManager(PROJECT_NAME)
    pm.add_hookspecs(PolicySpec)
    return pm


def bind_policy_hooks(pm: pluggy.PluginManager, policy: object) -> dict[str, Any]:
    """Resolve each runtime hook once to the bound method of ``policy`` registered on ``pm``.

    The attention layers call these bound methods directly: pluggy is consulted here, not per layer.
    """
    bound = {}
    for name in RUNTIME_HOOKS:
        impls = [i for i in getattr(pm.hook, name).get_hookimpls() if i.plugin is policy]
        if not impls:
            raise TypeError(f"policy {type(policy).__name__} does not implement {name}")
        bound[name] = impls[0].function
    return bound
