"""Contract v2: every hook and policy flag is documented in docs/writing-plugins.md and used by the engine."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import attrs
import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.hookspecs import ObserverSpec, RegistrationSpec, hookimpl
from nanovllm.plugins import SparsePolicyInfo, get_plugins, reload_plugins
from nanovllm.policies.full import FullAttentionPolicy
from nanovllm.sparse import POLICY_FLAGS, POLICY_METHODS, SparsePolicy

README = (Path(__file__).resolve().parents[2] / "docs" / "writing-plugins.md").read_text()


def hook_names(spec: type) -> list[str]:
    return [n for n in vars(spec) if not n.startswith("_")]


CONTRACT = list(POLICY_METHODS) + hook_names(ObserverSpec)  # what the engine calls on a policy or observer


@pytest.mark.parametrize("name", hook_names(RegistrationSpec) + CONTRACT + list(POLICY_FLAGS))
def test_readme_documents(name):
    assert re.search(rf"`{name}\b", README), f"README.md does not document {name!r}"


def test_flags_are_declared_on_the_base_class():
    # every boolean class attribute of the base class is a documented, tested flag
    assert set(POLICY_FLAGS) == {n for n, v in vars(SparsePolicy).items() if isinstance(v, bool)}
    assert set(hook_names(ObserverSpec)) == {
        "on_kv_write", "on_prefill_offload", "on_decode_offload", "on_blocks_allocated", "on_blocks_selected"
    }
    # every per-layer method is a method of the base class, and none is also a pluggy hook
    assert all(callable(getattr(SparsePolicy, name)) for name in POLICY_METHODS)
    assert not set(POLICY_METHODS) & set(hook_names(ObserverSpec))


CALLS: Counter = Counter()


class Recorder(SparsePolicy):
    """Counts every runtime hook the engine calls on it."""

    def select_blocks(self, ctx):
        CALLS["select_blocks", ctx.is_prefill] += 1
        return super().select_blocks(ctx)

    def compute_chunked_prefill(self, q, k, v, ctx):
        CALLS["compute_chunked_prefill"] += 1
        assert ctx.selected_blocks is not None or not self.requires_block_selection
        return super().compute_chunked_prefill(q, k, v, ctx)

    def compute_chunked_decode(self, q, ctx):
        CALLS["compute_chunked_decode"] += 1
        CALLS["selected_by_engine"] += ctx.selected_blocks is not None
        return super().compute_chunked_decode(q, ctx)

    def on_kv_write(self, write):
        CALLS["on_kv_write"] += 1
        CALLS["prefill_rows_written"] += write.key.shape[0] - write.step.num_decode_tokens

    def on_blocks_allocated(self, block_ids):
        CALLS["on_blocks_allocated"] += 1

    def on_prefill_offload(self, transfer):
        CALLS["on_prefill_offload"] += 1
        assert transfer.is_prefill

    def on_decode_offload(self, transfer):
        CALLS["on_decode_offload"] += 1
        assert not transfer.is_prefill


class DecodeOnly(Recorder):
    supports_prefill = False


class PrefillOnly(Recorder):
    supports_decode = False


class NoSelection(Recorder):
    requires_block_selection = False


class Observer:
    def on_blocks_selected(self, ctx, block_indices):
        CALLS["on_blocks_selected"] += 1


@pytest.fixture
def make_llm(tiny_model, monkeypatch, one_thread):
    table = get_plugins().registry.sparse_policies
    for cls in (Recorder, DecodeOnly, PrefillOnly, NoSelection):
        name = cls.__name__.lower()
        monkeypatch.setitem(table, name, SparsePolicyInfo(name, f"{__name__}:{cls.__name__}", "test"))

    def make(policy, observers=(), offload=False):
        from nanovllm import LLM

        kv = {"kv_offloading_size": 2**-8, "max_num_seqs": 8} if offload else {"kv_cache_memory": 1 << 22}
        return LLM(tiny_model(), device="cpu", block_size=4, max_num_batched_tokens=16, sparse_policy=policy,
                   observers=observers, **kv)

    return make


def run(llm) -> Counter:
    CALLS.clear()
    llm.generate([list(range(3, 30)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return Counter(CALLS)


def test_every_runtime_hook_is_called_by_the_engine(make_llm):
    calls = run(make_llm("recorder", observers=[Observer()]))
    offloaded = run(make_llm("recorder", observers=[Observer()], offload=True))
    assert not calls["on_prefill_offload"] and not calls["on_decode_offload"]  # only with offload
    assert offloaded["on_kv_write"]  # metadata is kept from on_kv_write on both stores
    calls.update(offloaded)
    for hook in CONTRACT:
        assert any(key == hook or (isinstance(key, tuple) and key[0] == hook) for key in calls), hook
    assert calls["select_blocks", True] and calls["select_blocks", False]


def test_supports_flags_send_the_other_phase_to_full(make_llm):
    llm = make_llm("decodeonly")
    assert type(llm.runner.hooks.prefill) is FullAttentionPolicy
    assert type(llm.runner.hooks.decode) is DecodeOnly
    calls = run(llm)
    assert calls["compute_chunked_prefill"] == 0 and calls["compute_chunked_decode"] > 0
    # The decode-only policy still sees the prefill keys: on_kv_write runs in every step, once per layer,
    # with the prompts' rows (27 + 3 tokens, in each of the 2 layers).
    assert calls["on_kv_write"] > calls["compute_chunked_decode"]
    assert calls["prefill_rows_written"] == 2 * (27 + 3)
    llm = make_llm("prefillonly")
    assert type(llm.runner.hooks.decode) is FullAttentionPolicy
    calls = run(llm)
    assert calls["compute_chunked_decode"] == 0 and calls["compute_chunked_prefill"] > 0


def test_requires_block_selection_decides_whether_the_engine_selects(make_llm):
    llm = make_llm("noselection")
    assert not llm.runner.hooks.decode.requires_block_selection
    calls = run(llm)
    assert calls["selected_by_engine"] == 0 and calls["compute_chunked_decode"] > 0
    calls = run(make_llm("recorder"))
    assert calls["selected_by_engine"] == calls["compute_chunked_decode"] > 0


def graph_safe(llm) -> bool:
    return llm.runner.hooks.cuda_graph_safe_on(llm.runner.kv)


def test_cuda_graph_safety_is_read_from_the_policy_and_every_observer(make_llm):
    assert graph_safe(make_llm("full"))
    assert not graph_safe(make_llm("recorder"))  # the default is off
    assert not graph_safe(make_llm("full", observers=[Observer()]))


class OffloadCounter:
    """An observer of the offload notifications alone, not declared graph-safe."""

    def on_decode_offload(self, transfer):
        CALLS["on_decode_offload"] += 1


def test_offload_observers_count_for_graph_safety_only_where_the_store_calls_them(make_llm):
    # which store calls the offload notifications: test_every_runtime_hook_is_called_by_the_engine
    assert graph_safe(make_llm("full", observers=[OffloadCounter()]))  # the paged GPU cache: never
    assert not graph_safe(make_llm("full", observers=[OffloadCounter()], offload=True))  # the host store


def test_base_noop_notification_hooks_cost_nothing(make_llm):
    hooks = make_llm("full").runner.hooks
    assert hooks.kv_write == hooks.blocks_allocated == hooks.blocks_selected == ()


def test_one_prefill_policy_and_one_decode_policy(make_llm):
    llm = make_llm("prefill=recorder;decode=decodeonly")
    assert type(llm.runner.hooks.prefill) is Recorder and type(llm.runner.hooks.decode) is DecodeOnly
    calls = run(llm)
    assert calls["compute_chunked_prefill"] and calls["compute_chunked_decode"]
    llm = make_llm({"decode": "recorder"})
    assert type(llm.runner.hooks.prefill) is FullAttentionPolicy
    assert type(llm.runner.hooks.decode) is Recorder
    llm = make_llm("prefillonly;decodeonly")  # each takes the phase it supports
    assert type(llm.runner.hooks.prefill) is PrefillOnly and type(llm.runner.hooks.decode) is DecodeOnly


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("recorder;decodeonly",
         "both 'recorder' and 'decodeonly' would run the decode phase.*'prefill=recorder;decode=decodeonly'"),
        ("prefill=decodeonly", "'decodeonly' cannot run the prefill phase \\(supports_prefill=False\\)"),
        ("middle=recorder", "'middle' is not a phase"),
        ({"prefill": "recorder", "later": "full"}, "the keys 'prefill' and/or 'decode'"),
        ("prefill=recorder;prefill=full", "both 'recorder' and 'full' would run the prefill phase"),
    ],
)
def test_phase_selection_errors(make_llm, spec, message):
    from nanovllm.selection import SelectionError, resolve_policies

    with pytest.raises(SelectionError, match=message):
        resolve_policies(spec)


def test_a_write_of_whole_blocks_describes_them():
    import torch
    from nanovllm.kv import KVWrite

    cache = torch.randn(6, 4, 2, 8)  # 6 blocks of 4 tokens, 2 KV heads
    write = KVWrite.of_blocks(3, cache, -cache, blocks=[5, 1], counts=[4, 2], starts=[8, 12])
    assert write.block_ids.tolist() == [5, 5, 5, 5, 1, 1] and write.block_fill().tolist() == [4, 4, 4, 4, 2, 2]
    assert write.positions.tolist() == [8, 9, 10, 11, 12, 13] and write.layer_id == 3
    assert torch.equal(write.key, torch.cat([cache[5], cache[1, :2]])) and torch.equal(write.value, -write.key)
    assert write.slot_mapping.tolist() == [20, 21, 22, 23, 4, 5]


def test_kv_write_of_a_sequence_is_its_prefill_through_its_block_table():
    import torch
    from nanovllm.kv import KVWrite

    cache = torch.randn(6, 4, 2, 8)
    write = KVWrite.of_sequence(1, cache, -cache, block_table=[5, 1, 3], num_tokens=10)
    assert write.slot_mapping.tolist() == [20, 21, 22, 23, 4, 5, 6, 7, 12, 13]
    assert write.positions.tolist() == list(range(10)) and write.block_fill().tolist() == [4] * 8 + [2] * 2
    assert torch.equal(write.key, torch.cat([cache[5], cache[1], cache[3, :2]])) and torch.equal(write.value, -write.key)
    prefill = write.step.prefill
    assert prefill.block_tables.tolist() == [[5, 1, 3]] and prefill.query_lens.tolist() == [10]
    assert prefill.context_lens.tolist() == [10] and write.step.decode is None


# -- observer plugins --------------------------------------------------------------------------------------


class BlockCounter:
    """An observer plugin: counts the blocks handed out, and keeps a number from its options."""

    def __init__(self, config=None) -> None:
        self.config = config
        self.allocated = 0

    def on_blocks_allocated(self, block_ids):
        self.allocated += block_ids.numel()


class ObserverPlugin:
    @hookimpl
    def register_observers(self, registry):
        registry.add_observer("block_counter", f"{__name__}:BlockCounter", config=f"{__name__}:CounterConfig")


@attrs.define(frozen=True)
class CounterConfig:
    label: str = "blocks"


@pytest.fixture
def observer_plugin():
    plugins = get_plugins()
    plugins.register(ObserverPlugin(), "observer-test")
    yield plugins
    reload_plugins()


def test_an_observer_plugin_is_registered_listed_and_selected_by_name(observer_plugin, make_llm):
    info = next(p for p in observer_plugin.plugins if p.name == "observer-test")
    assert info.registered == ["observer:block_counter"]
    llm = make_llm("full", observers=["Block_Counter:label=kv"])
    [counter] = [m for m in llm.runner.hooks.members if isinstance(m, BlockCounter)]
    assert counter.config == CounterConfig("kv")
    run(llm)
    assert counter.allocated > 0  # it saw the blocks of the generate call


def test_an_unknown_observer_is_a_clear_error(observer_plugin, make_llm):
    from nanovllm.plugins import PluginError

    with pytest.raises(PluginError, match="unknown observer 'block_countr'. Did you mean 'block_counter'"):
        make_llm("full", observers="block_countr")


# -- every selection is checked at run time ----------------------------------------------------------------


class BadSelection(SparsePolicy):
    """Valid selections in prefill and where every row has one history block (the GPU's start-up warm-up);
    otherwise ``break_rule`` turns the whole history, followed by at least one -1, into a selection that breaks
    one rule in every row."""

    def select_blocks(self, ctx):
        blocks = ctx.all_history_blocks()
        if ctx.is_prefill or bool((ctx.num_history_blocks < 2).all()):  # the GPU's start-up warm-up: 1 block
            return blocks
        padded = torch.cat([blocks, torch.full_like(blocks[:, :1], -1)], dim=1)
        return self.break_rule(padded, ctx.num_history_blocks[:, None])


class PastTheEnd(BadSelection):
    """Block ``num_history_blocks`` where the padding starts: one past the last history block."""

    def break_rule(self, blocks, n):
        return torch.where(torch.arange(blocks.shape[1], device=blocks.device) == n, n.to(torch.int32), blocks)


class LeadingMinusFive(BadSelection):
    def break_rule(self, blocks, n):
        return torch.cat([torch.full_like(blocks[:, :1], -5), blocks[:, 1:]], dim=1)


class Unsorted(BadSelection):
    def break_rule(self, blocks, n):
        return blocks[:, [1, 0, *range(2, blocks.shape[1])]]


class PaddingFirst(BadSelection):
    def break_rule(self, blocks, n):
        return blocks.roll(1, dims=1)


class Int64(BadSelection):
    def break_rule(self, blocks, n):
        return blocks.long()


class OneHeadOfTwo(BadSelection):
    def break_rule(self, blocks, n):
        return blocks[:, None, :]  # [num_seqs, 1, k]: per KV head, yet the model has 2 KV heads

BAD_SELECTIONS = [
    (PastTheEnd, r"block (\d+) goes beyond the \1 history blocks"),
    (LeadingMinusFive, "entries are block indices >= 0 or -1 padding"),
    (Unsorted, "block indices must be strictly ascending"),
    (PaddingFirst, "-1 padding must come only at the end"),
    (Int64, "returned dtype torch.int64, not torch.int32"),
    (OneHeadOfTwo, r"returned shape \[\d+, 1, \d+\]; expected \[num_seqs=\d+, k\]"),
]


def selection_error(llm) -> str:
    """The error that ends a generate call over two prompts of at least two blocks: raised, or where the
    engine ends the failing requests instead, theirs."""
    from nanovllm.policy import PolicyContractError

    try:
        outputs = llm.generate([list(range(3, 30)), list(range(5, 14))],
                               SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    except PolicyContractError as exc:
        return str(exc)
    errors = [getattr(o.outputs[0], "error", None) for o in outputs]
    assert any(errors), "no error: the broken selection went through"
    return next(e for e in errors if e)


def engine_with(policy: type, device: str, monkeypatch, **options):
    from nanovllm import LLM
    from nanovllm.conformance import tiny_model

    name = policy.__name__.lower()
    monkeypatch.setitem(get_plugins().registry.sparse_policies, name,
                        SparsePolicyInfo(name, f"{__name__}:{policy.__name__}", "test"))
    return LLM(tiny_model(), device=device, block_size=4, kv_cache_memory=1 << 22, enforce_eager=True,
               sparse_policy=name, **options)


@pytest.mark.parametrize(("policy", "rule"), BAD_SELECTIONS, ids=lambda p: getattr(p, "__name__", ""))
def test_a_broken_selection_is_an_error_naming_the_policy_and_the_rule(policy, rule, monkeypatch, one_thread):
    message = selection_error(engine_with(policy, "cpu", monkeypatch))
    assert f"{policy.__qualname__}.select_blocks ({__name__}) broke the selection contract" in message
    assert "decode" in message and re.search(rule, message), message


@pytest.mark.gpu
@pytest.mark.parametrize(("policy", "rule"), BAD_SELECTIONS[:3], ids=lambda p: getattr(p, "__name__", ""))
def test_a_broken_selection_is_an_error_on_the_gpu(policy, rule, monkeypatch):
    message = selection_error(engine_with(policy, "cuda", monkeypatch, attention_backend="triton"))
    assert f"{policy.__qualname__}.select_blocks" in message and re.search(rule, message), message


def test_the_selection_check_can_be_turned_off(monkeypatch, one_thread):
    # without the check, a leading -5 is read as padding: the step runs on, silently wrong
    monkeypatch.setenv("NANOVLLM_CHECK_SELECTIONS", "0")
    llm = engine_with(LeadingMinusFive, "cpu", monkeypatch)
    assert not llm.runner.hooks.check_selections
    outputs = llm.generate([list(range(3, 30))], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3


def test_selection_problem_names_the_row_and_checks_values_only_when_asked():
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.policy import PolicyContext, selection_problem

    cache = torch.zeros(8, 4, 2, 8)  # blocks of 4 tokens, 2 KV heads
    lens = torch.tensor([9, 16], dtype=torch.int32)  # decode: 3 and 4 history blocks
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    meta = PhaseMetadata(torch.arange(3, dtype=torch.int32), lens, tables, 1, 16)
    ctx = PolicyContext(0, False, torch.zeros(2, 4, 8), meta, cache, cache, 1.0, None)
    good = torch.tensor([[[0, 2, -1], [1, 2, -1]], [[0, 1, 3], [3, -1, -1]]], dtype=torch.int32)
    assert selection_problem(ctx, good) is None and selection_problem(ctx, good[:, 0]) is None
    bad = good.clone()
    bad[1, 1] = torch.tensor([1, 1, -1])
    assert selection_problem(ctx, bad) == (
        "sequence 1, KV head 1: [1, 1, -1]: block indices must be strictly ascending")
    assert selection_problem(ctx, bad, values=False) is None  # inside a CUDA-graph capture: shape, dtype only
    assert selection_problem(ctx, good[:, :, None]).startswith("returned shape [2, 2, 1, 3]")
    assert selection_problem(ctx, good.tolist()) == "returned list, not a torch.Tensor"
