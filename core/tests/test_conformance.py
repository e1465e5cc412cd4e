"""The conformance kit on the built-in ``full`` policy and the Quest-style test policy, and the kit's own
ability to fail: policies that break one rule each are caught by the check about that rule."""

from __future__ import annotations

import unittest

import pytest
import torch
from nanovllm.conformance import Case, cases, run_case
from nanovllm.plugins import get_plugins, reload_plugins
from nanovllm.policy import PolicyContext
from quest_style import Plugin, QuestStylePolicy

GPU_CASES = [pytest.param(c, marks=pytest.mark.gpu) if c.device == "cuda" else c for c in cases()]


@pytest.fixture(scope="module")
def registered():
    """quest_style and the broken policies below, registered in-process like installed plugins."""
    plugins = get_plugins()
    plugins.register(Plugin(), "quest-style")
    table = plugins.registry.sparse_policies
    for name, cls in BROKEN.items():
        table[name] = type(table["quest_style"])(name, f"{__name__}:{cls.__name__}", "test",
                                                 table["quest_style"].config)
    yield
    reload_plugins()


@pytest.fixture(autouse=True)
def _threads(one_thread, registered):
    yield


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_full_passes(case):
    run_case(case, "full")


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_quest_style_with_a_covering_budget_passes(case):
    run_case(case, "quest_style:budget_blocks=1000", small_budget="quest_style:budget_blocks=3")


def test_the_kit_covers_every_check():
    assert {c.check for c in cases()} == {
        "prefill", "decode", "chunked_prefill", "prefix_cache", "preemption", "mixed_lengths",
        "selection_contract", "metadata", "small_budget", "cuda_graphs", "no_host_sync",
    }


# -- the kit catches broken policies --------------------------------------------------------------------


class SmallBudget(QuestStylePolicy):
    """Not broken: a budget that does not cover every block must change the result."""


class Descending(QuestStylePolicy):
    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        blocks = super().select_blocks(ctx)
        return blocks.flip(-1)  # -1 padding first, blocks descending


class Int64Selection(QuestStylePolicy):
    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        return super().select_blocks(ctx).long()


class ForgetsResets(QuestStylePolicy):
    """Keeps min/max across reallocations: stale keys of a block's earlier owner stay in its bounds."""

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        pass


class DropsOldest(QuestStylePolicy):
    """Skips the first history block: the answer changes even with a covering budget."""

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        blocks = super().select_blocks(ctx)  # ascending: the first entry is block 0 wherever there is history
        return torch.cat([blocks[..., 1:], torch.full_like(blocks[..., :1], -1)], dim=-1)


class SyncsOnAllocation(QuestStylePolicy):
    """Resets its metadata by assigning a scalar at tensor indices: a copy from pageable memory, a sync."""

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        self.key_min[:, block_ids] = float("inf")
        self.key_max[:, block_ids] = float("-inf")


class PastTheHistory(QuestStylePolicy):
    """Wrong only on the sparse path: a budget below the history shifts the chosen blocks up by one."""

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        blocks = super().select_blocks(ctx)
        sparse = (ctx.num_history_blocks > self.config.budget_blocks)[:, None, None]
        return torch.where(sparse & (blocks >= 0), blocks + 1, blocks)


class IgnoresItsSelection(QuestStylePolicy):
    """Selects a few blocks, then decodes over every one."""

    def compute_chunked_decode(self, q: torch.Tensor, ctx: PolicyContext) -> torch.Tensor:
        return ctx.attend_all(q)


class Doubles(QuestStylePolicy):
    """Selects nothing and computes its own attention, twice too large: no longer an average of values."""

    requires_block_selection = False

    def compute_chunked_prefill(self, q, k, v, ctx: PolicyContext) -> torch.Tensor:
        return 2 * ctx.attend_all(q, k, v)


class DenseAnyway(QuestStylePolicy):
    """A budget that never takes effect: the small-budget check has nothing sparse to check."""

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        return ctx.all_history_blocks()


BROKEN = {"small_budget": SmallBudget, "descending": Descending, "int64_selection": Int64Selection,
          "forgets_resets": ForgetsResets, "drops_oldest": DropsOldest,
          "syncs_on_allocation": SyncsOnAllocation, "past_the_history": PastTheHistory,
          "ignores_its_selection": IgnoresItsSelection, "doubles": Doubles, "dense_anyway": DenseAnyway}
CPU = {c.check: c for c in cases() if c.device == "cpu"}


@pytest.mark.parametrize(
    ("policy", "check", "message"),
    [
        ("small_budget:budget_blocks=2", "decode", "tokens .* differ from full|logprob"),
        ("descending:budget_blocks=1000", "selection_contract",
         "Descending.select_blocks .*(-1 padding must come only at the end|must be strictly ascending)"),
        ("int64_selection:budget_blocks=1000", "selection_contract", "dtype torch.int64, not torch.int32"),
        ("forgets_resets:budget_blocks=1000", "metadata", "differs from a recomputation over the cache"),
        ("drops_oldest:budget_blocks=1000", "chunked_prefill", "differ from full|logprob"),
        ("past_the_history:budget_blocks=3", "small_budget", "PastTheHistory.select_blocks .*goes beyond"),
        ("ignores_its_selection:budget_blocks=3", "small_budget",
         "IgnoresItsSelection.compute_chunked_decode: the output differs from attention over the blocks"),
        ("doubles:budget_blocks=3", "small_budget",
         "Doubles.compute_chunked_prefill: an output lies outside"),
        ("dense_anyway:budget_blocks=3", "small_budget", "the policy's output equals dense attention"),
    ],
)
def test_the_kit_fails_a_broken_policy(policy, check, message):
    with pytest.raises(AssertionError, match=message):
        run_case(CPU[check], policy, small_budget=policy)


def test_the_small_budget_check_needs_a_small_budget():
    with pytest.raises(unittest.SkipTest, match="small_budget="):
        run_case(CPU["small_budget"], "quest_style:budget_blocks=1000")


@pytest.mark.gpu
def test_the_kit_fails_a_policy_that_syncs_in_decode():
    with pytest.raises(AssertionError, match="waited for the GPU"):
        run_case(Case("no_host_sync", "cuda", "triton"), "syncs_on_allocation:budget_blocks=1000")


def test_policy_metadata_counts_against_the_kv_budget():
    from nanovllm import LLM
    from nanovllm.conformance import tiny_model

    options = dict(device="cpu", kv_cache_memory=1 << 20, block_size=4, max_model_len=128)
    dense = LLM(tiny_model(), sparse_policy="full", **options).runner
    quest = LLM(tiny_model(), sparse_policy="quest_style", **options).runner
    layers, kv_heads, head_dim = len(quest.attention_layers), quest.num_kv_heads, quest.head_dim
    kv = 2 * layers * 4 * kv_heads * head_dim * 4  # K and V of a block of 4 float32 tokens, every layer
    metadata = 2 * layers * kv_heads * head_dim * 4  # the policy's float32 min and max per block
    assert dense.num_blocks == (1 << 20) // kv
    assert quest.num_blocks == (1 << 20) // (kv + metadata) < dense.num_blocks


def test_the_kit_fails_a_store_that_hands_policies_another_pools_blocks(monkeypatch):
    """Under KV offload a hybrid model's window layers keep their KV in a GPU pool of their own, whose block
    ids name other blocks of the policies' metadata: a store that told the per-block hooks of their writes
    is caught by the kit's block-id check (a policy's metadata write there would land past its end)."""
    from nanovllm.kv.store import HostKVStore, KVStore

    def bind_every_layer(store, kv_write, blocks_allocated=(), decode_offload=(), prefill_offload=()):
        KVStore.bind(store, kv_write, blocks_allocated)  # the window layers' writes reach the hooks too

    case = Case("decode", "cpu", "torch", offload=True, hybrid=True)
    run_case(case, "full")  # the store as it is: passes
    monkeypatch.setattr(HostKVStore, "bind", bind_every_layer)
    with pytest.raises(AssertionError, match=r"on_kv_write \(layer \d\): .* are not blocks of the store"):
        run_case(case, "full")
