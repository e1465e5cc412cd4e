"""The per-layer hot path calls the policies' methods directly, never through pluggy.

The engine resolves once per engine what it calls (``nanovllm.policy.PolicyHooks``): each phase's policy,
and the members that implement each notification hook; the attention layers then call bound methods.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pluggy
import pytest
from nanovllm import SamplingParams
from nanovllm.plugins import SparsePolicyInfo, get_plugins
from nanovllm.policies.full import FullAttentionPolicy
from nanovllm.hookspecs import ObserverSpec
from nanovllm.policy import PolicyHooks
from nanovllm.sparse import POLICY_METHODS, SparsePolicy

CONTRACT = {*POLICY_METHODS, *(n for n in vars(ObserverSpec) if not n.startswith("_"))}

CALLS: list[tuple[str, int, bool]] = []  # (method, layer, is_prefill), appended by the probe policies


class ProbePolicy(SparsePolicy):
    """Attends to every block through the base class's select-then-attend path, recording calls."""

    def select_blocks(self, ctx):
        CALLS.append(("select_blocks", ctx.layer_id, ctx.is_prefill))
        return super().select_blocks(ctx)

    def compute_chunked_prefill(self, q, k, v, ctx):
        CALLS.append(("compute_chunked_prefill", ctx.layer_id, ctx.is_prefill))
        return super().compute_chunked_prefill(q, k, v, ctx)

    def compute_chunked_decode(self, q, ctx):
        CALLS.append(("compute_chunked_decode", ctx.layer_id, ctx.is_prefill))
        return super().compute_chunked_decode(q, ctx)


class DecodeOnlyProbe(ProbePolicy):
    supports_prefill = False


@pytest.fixture
def probe_llm(tiny_model, monkeypatch):
    """``make(policy_name)`` -> an LLM whose sparse policy is one of the probes above."""
    table = get_plugins().registry.sparse_policies
    monkeypatch.setitem(table, "probe", SparsePolicyInfo("probe", f"{__name__}:ProbePolicy", "test"))
    decode_only = SparsePolicyInfo("probe_decode", f"{__name__}:DecodeOnlyProbe", "test")
    monkeypatch.setitem(table, "probe_decode", decode_only)

    def make(name: str):
        from nanovllm import LLM

        return LLM(tiny_model(num_hidden_layers=3), kv_cache_memory=1 << 24, device="cpu", block_size=4,
                   max_num_batched_tokens=16, sparse_policy=name)

    return make


def spy(llm, monkeypatch):
    """Count pluggy dispatches of the contract's names, and record the phases of every step."""
    dispatched = Counter()
    real_call = pluggy.HookCaller.__call__

    def counting_call(self, *args, **kwargs):
        if self.name in CONTRACT:
            dispatched[self.name] += 1
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(pluggy.HookCaller, "__call__", counting_call)

    steps: list[tuple[bool, bool]] = []  # (has decodes, has prefill chunks) of each step, in order
    real_prepare = llm.runner.prepare

    def recording_prepare(seqs, *rest):
        out = real_prepare(seqs, *rest)
        meta = out[0]  # the StepPlan
        steps.append((meta.decode is not None, meta.prefill is not None))
        CALLS.append(("step", len(steps), False))
        return out

    monkeypatch.setattr(llm.runner, "prepare", recording_prepare)
    return dispatched, steps


def calls_by_step() -> list[list[tuple[str, int, bool]]]:
    per_step: list[list] = []
    for call in CALLS:
        if call[0] == "step":
            per_step.append([])
        else:
            per_step[-1].append(call)
    return per_step


def generate(llm):
    prompts = [[5, 6, 7], list(range(10, 40)), list(range(50, 61))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def test_layers_call_the_policy_directly_not_pluggy(probe_llm, monkeypatch):
    llm = probe_llm("probe")
    runner = llm.runner
    policy = runner.hooks.prefill
    assert type(policy) is ProbePolicy and runner.hooks.decode is policy
    layers = runner.attention_layers
    assert len(layers) == 3
    for layer in layers:  # resolved once, at engine build
        hooks = layer.hooks
        assert hooks is runner.hooks and hooks.prefill is policy and hooks.decode is policy
        assert hooks.kv_write == hooks.blocks_allocated == hooks.blocks_selected == ()  # none implemented

    dispatched, steps = spy(llm, monkeypatch)
    CALLS.clear()
    outs = generate(llm)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]

    assert dispatched == Counter(), "the hot path went through pluggy"
    per_step = calls_by_step()
    assert len(per_step) == len(steps) > 5
    assert (True, True) in steps, "no step mixed decodes with prefill chunks"
    layer_ids = [layer.layer_id for layer in layers]
    for (has_decode, has_prefill), calls in zip(steps, per_step, strict=True):
        expected = Counter()
        for layer in layer_ids:
            if has_prefill:
                expected[("compute_chunked_prefill", layer, True)] += 1
                expected[("select_blocks", layer, True)] += 1
            if has_decode:
                expected[("compute_chunked_decode", layer, False)] += 1
                expected[("select_blocks", layer, False)] += 1
        assert Counter(calls) == expected

    # The spy does see a pluggy dispatch when one happens.
    pm = pluggy.PluginManager("nanovllm")
    pm.add_hookspecs(ObserverSpec)
    pm.register(SimpleNamespace(on_blocks_allocated=lambda block_ids: None))
    pm.hook.on_blocks_allocated(block_ids=None)
    assert dispatched == Counter({"on_blocks_allocated": 1})


def test_unsupported_phase_is_bound_to_full_attention(probe_llm, monkeypatch):
    llm = probe_llm("probe_decode")
    runner = llm.runner
    assert type(runner.hooks.decode) is DecodeOnlyProbe
    assert type(runner.hooks.prefill) is FullAttentionPolicy
    for layer in runner.attention_layers:
        assert layer.hooks.prefill is runner.hooks.prefill and layer.hooks.decode is runner.hooks.decode
    dispatched, steps = spy(llm, monkeypatch)
    CALLS.clear()
    generate(llm)
    assert dispatched == Counter()
    assert {name for name, _, _ in CALLS} == {"step", "compute_chunked_decode", "select_blocks"}
    assert all(not is_prefill for name, _, is_prefill in CALLS if name != "step")
    decode_steps = sum(has_decode for has_decode, _ in steps)
    assert sum(name == "compute_chunked_decode" for name, _, _ in CALLS) == 3 * decode_steps


class Notified(SparsePolicy):
    """Overrides one notification hook, and inherits the base class's no-op for the others."""

    def on_kv_write(self, write):
        pass


class Watcher:
    """An observer: implements what it defines, whatever its class."""

    def on_blocks_selected(self, ctx, block_indices):
        pass


def test_notification_hooks_are_the_members_own_bound_methods():
    policy, decode, watcher = Notified(), ProbePolicy(), Watcher()
    hooks = PolicyHooks(policy, decode, [watcher])
    assert hooks.prefill is policy and hooks.decode is decode
    assert hooks.kv_write == (policy.on_kv_write,) and hooks.blocks_selected == (watcher.on_blocks_selected,)
    assert hooks.blocks_allocated == hooks.prefill_offload == hooks.decode_offload == ()  # the base's no-ops
    assert hooks.members == [policy, decode, watcher] and hooks.policies == [policy, decode]
    assert not any(isinstance(v, pluggy.PluginManager) for v in vars(hooks).values())


def test_a_policy_missing_a_method_is_refused_at_start():
    class NotAPolicy:
        requires_block_selection = True

        def select_blocks(self, ctx):
            return ctx

    thing = NotAPolicy()
    with pytest.raises(TypeError, match="NotAPolicy does not implement compute_chunked_prefill"):
        PolicyHooks(thing, thing)


def test_the_contract_is_the_per_layer_methods_and_the_notification_hooks():
    assert CONTRACT == {
        "select_blocks", "compute_chunked_prefill", "compute_chunked_decode", "on_kv_write",
        "on_blocks_allocated", "on_blocks_selected", "on_prefill_offload", "on_decode_offload",
    }
