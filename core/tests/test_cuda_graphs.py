"""The decode graphs: their batch-size buckets, their replay emulated on the CPU (the inputs a replay copies
into the static buffers, and what it gives), and on a GPU decode steps replayed from them giving the tokens
of eager decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm import SamplingParams
from nanovllm.attention.metadata import forward_context
from nanovllm.conformance import Case, _engine, _generate, _prompts, compare_outputs, hybrid_model, tiny_model
from nanovllm.engine.cuda_graphs import MAX_GRAPH_BATCH, CudaGraphRunner
from nanovllm.plugins import get_plugins


def buckets(max_num_seqs: int) -> list[int]:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, device="cpu")
    return CudaGraphRunner(None, config, None, None, None).sizes


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    for max_num_seqs in (1, 3, 16, 40, 256, 1000):
        sizes = buckets(max_num_seqs)
        largest = min(max_num_seqs, MAX_GRAPH_BATCH)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == largest
        # every batch up to the largest has a bucket, and pads by fewer than 16 rows (or doubles below 16)
        for bs in range(1, largest + 1):
            bucket = next(b for b in sizes if b >= bs)
            assert bucket - bs < max(16, bs)


def test_the_cpu_decodes_eagerly(tiny_model):
    from nanovllm import LLM

    llm = LLM(tiny_model(), device="cpu", kv_cache_memory=1 << 24, max_model_len=64)
    assert not llm.runner.cuda_graphs.usable() and llm.runner.cuda_graphs.graphs == {}


@pytest.mark.gpu
def test_decode_steps_replay_the_graphs_and_give_the_eager_tokens(tiny_model, monkeypatch):
    from nanovllm import LLM

    path = tiny_model("Qwen3ForCausalLM")
    prompts = [[5 + i, 17, 3 * i + 1] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 26, max_num_seqs=8)
    replays, padding_errors = [], []
    replay = CudaGraphRunner.replay

    def counted(self, input_ids, *inputs):
        replays.append(input_ids.shape[0])
        return replay(self, input_ids, *inputs)

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    graphs = LLM(path, **options)
    assert sorted(graphs.runner.cuda_graphs.graphs) == graphs.runner.cuda_graphs.sizes == [1, 2, 4, 8]
    with_graphs = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert replays and max(replays) == len(prompts)  # the decode steps of all five ran in the bucket of 8
    eager = LLM(path, enforce_eager=True, **options)
    assert eager.runner.cuda_graphs.graphs == {}
    assert [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == with_graphs
    torch.cuda.synchronize()


class EmulatedGraph:
    """A decode graph on the CPU: a replay runs its bucket's forward pass eagerly over the runner's static
    buffers, which is what a captured graph reads."""

    def __init__(self, runner: CudaGraphRunner, bs: int) -> None:
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        r, bs = self.runner, self.bs
        with forward_context(r._metadata(bs)):
            r.kv_store.begin_capture()
            r.output[:bs] = r.model(r.inputs["input_ids"][:bs], r.inputs["positions"][:bs])
            r.kv_store.end_capture()

    def reset(self) -> None:
        pass


@pytest.fixture
def emulated_graphs(monkeypatch):
    """Engines made after it capture emulated decode graphs on the CPU."""
    def usable(graphs):
        return (graphs.kv_store.can_capture_decode(graphs.hooks.decode.requires_block_selection)
                and not graphs.config.enforce_eager and graphs.hooks.cuda_graph_safe_on(graphs.kv_store))

    def capture(graphs):
        graphs.graphs.update({bs: EmulatedGraph(graphs, bs) for bs in graphs.sizes})

    monkeypatch.setattr(CudaGraphRunner, "usable", usable)
    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)


class StaticWrites(TorchDispatchMode):
    """Counts the ops that write into given tensors' storages (copies and fills of the static buffers)."""

    def __init__(self, storages: dict[int, str]) -> None:
        super().__init__()
        self.storages, self.writes = storages, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (target is not None and func._schema.is_mutable
                and target.untyped_storage().data_ptr() in self.storages):
            self.writes.append(self.storages[target.untyped_storage().data_ptr()])
        return func(*args, **(kwargs or {}))


def graph_and_eager_steps(case: Case, policy: str, monkeypatch):
    """Generate on an engine with emulated decode graphs and on an eager one: four requests of different
    lengths finishing at different steps (so batches shrink, into padded buckets, and tables narrow), the
    longest prompt first. Returns both outputs (with logprobs) and, for each replay, its batch size and the
    static buffers it wrote: ``"tables"`` or ``"slots"`` (any KV cache group's) or ``"other"``."""
    model_dir = hybrid_model() if case.hybrid else tiny_model()
    llm = _engine(case, model_dir, policy, enforce_eager=False, max_num_seqs=4)
    graphs = llm.runner.cuda_graphs
    assert {1, 2, 4} <= set(graphs.graphs)
    storages = {t.untyped_storage().data_ptr(): "other" for t in graphs.inputs.values()}
    for group in range(len(llm.runner.kv_cache_groups)):
        meta = graphs._metadata(4).of_group(group)
        storages[meta.slot_mapping.untyped_storage().data_ptr()] = "slots"
        storages[meta.decode.block_tables.untyped_storage().data_ptr()] = "tables"
    replays, padding_errors = [], []
    replay = CudaGraphRunner.replay

    def counted(self, input_ids, *inputs):
        graph_replay = EmulatedGraph.replay
        with StaticWrites(storages) as writes:
            # the graph's own work is not counted
            monkeypatch.setattr(EmulatedGraph, "replay", lambda g: None)
            replay(self, input_ids, *inputs)
        monkeypatch.setattr(EmulatedGraph, "replay", graph_replay)
        bs = input_ids.shape[0]
        graph_bs = next(b for b in self.sizes if b >= bs)
        for group in range(len(self.kv_store.groups)):
            meta = self._metadata(graph_bs).of_group(group)  # the padding rows write nothing, read one token
            if not ((meta.slot_mapping[bs:] == -1).all() and (meta.decode.context_lens[bs:] == 1).all()
                    and (meta.decode.block_tables[bs:] == 0).all()):
                padding_errors.append((bs, graph_bs, group))
        graph_replay(self.graphs[graph_bs])
        replays.append((bs, writes.writes))
        return self.output[:bs]

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    prompts = _prompts([70, 9, 33, 20], 3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in (6, 30, 18, 12)]
    graphed = _generate(llm, prompts, params)
    assert not padding_errors, f"padding rows that write or read (batch, bucket, group): {padding_errors}"
    eager = _engine(case, model_dir, policy, max_num_seqs=4)
    assert not eager.runner.cuda_graphs.graphs
    return graphed, _generate(eager, prompts, params), replays


@pytest.mark.parametrize(("hybrid", "offload", "policy"), [
    (True, False, "full"), (False, False, "full"),
    # KV offload captures only decode steps that select their blocks on the device
    (True, True, "quest:token_budget=400,skip_layers=0,page_size=4"),
], ids=["hybrid", "uniform", "hybrid-offload-quest"])
def test_emulated_replays_give_the_eager_tokens_copying_each_input_once(hybrid, offload, policy,
                                                                         emulated_graphs, monkeypatch):
    """A decode step's replay copies every KV cache group's slots into the graphs' buffers in one copy, and
    every group's block tables in one (per group, it was a fill and a copy of each); only when the batch
    shrinks or its tables narrow do the rows and entries it no longer covers go back to padding first. The
    replayed steps give the eager engine's tokens, padding rows (3 sequences in the bucket of 4) included."""
    if policy.startswith("quest") and "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("needs the nanovllm-quest plugin")
    case = Case("cuda_graphs", "cpu", "torch", offload=offload, hybrid=hybrid)
    graphed, eager, replays = graph_and_eager_steps(case, policy, monkeypatch)
    compare_outputs("emulated decode graphs against eager", graphed, eager)
    sizes = [bs for bs, _ in replays]
    assert {4, 3, 1} <= set(sizes) and sizes == sorted(sizes, reverse=True)  # shrinking, into padding
    for (bs, writes), before in zip(replays, [None, *sizes], strict=False):
        expected = {"slots": 1, "tables": 1, "other": 3}  # input ids, positions, context lengths
        if before is not None and bs < before:  # rows back to padding first
            expected = {"slots": 2, "tables": 2, "other": 4}
        counts = {kind: writes.count(kind) for kind in expected}
        # tables that narrowed (the longest sequence finished) also go back to padding first
        assert counts in (expected, {**expected, "tables": 2}), (bs, writes)
    steady = [writes for (bs, writes), before in zip(replays, [None, *sizes], strict=False) if bs == before]
    assert steady and all(w.count("tables") == 1 for w in steady)
