"""Quest inside the engine with a budget that is really sparse: it selects less than the history, and it
gives the same tokens eagerly and under CUDA graphs, and with the KV cache on the device or offloaded."""

from __future__ import annotations

import pytest
import torch
from nanovllm import LLM, SamplingParams
from nanovllm.conformance import tiny_model
from nanovllm.plugins import get_plugins
from nanovllm.quality.perplexity import DensityMeter

SPARSE = "quest:token_budget=16,skip_layers=1,page_size=4"  # 4 blocks of 4 tokens, from layer 1 on
PAGED = "quest:token_budget=16,skip_layers=1,page_size=8"  # 2 pages of 2 blocks
# 4 blocks of 4 tokens, each scored by its halves; only the newest forced, so that the bounds rank the rest
HALVES = "quest:token_budget=16,skip_layers=1,bound_size=2,recent_pages=1"


def engine(device: str, policy: str = SPARSE, observers=(), offload: bool = False, eager: bool = True) -> LLM:
    if "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    options = dict(device=device, dtype="float32", block_size=4, max_model_len=256, enforce_eager=eager,
                   max_num_seqs=4, attention_backend="torch" if device == "cpu" else "triton")
    if offload:
        options.update(kv_offloading_size=0.01, kv_offloading_buffer_size=0.004)
    else:
        options["kv_cache_memory"] = 2**23
    return LLM(tiny_model(), sparse_policy=policy, observers=list(observers), **options)


def generate(llm: LLM) -> list[list[int]]:
    prompts = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate([90, 33, 140])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_decode_reads_a_fraction_of_the_history():
    meter = DensityMeter()
    generate(engine("cpu", observers=[meter]))
    assert 0.05 < meter.density("decode") < 0.5
    assert meter.density("prefill") is None  # prefill is dense ``full``


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pages_of_several_blocks_on_the_device_cache_and_offloaded(device):
    meter = DensityMeter()
    want = generate(engine(device, PAGED, observers=[meter]))
    assert 0.05 < meter.density("decode") < 0.5
    assert want != generate(engine(device, SPARSE))  # pages select otherwise than blocks
    assert generate(engine(device, PAGED, offload=True)) == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bounds_below_the_page_on_the_device_cache_offloaded_and_in_graphs(device):
    want = generate(engine(device, HALVES))
    page_bounds = f"{SPARSE},recent_pages=1,metadata_dtype=kv"  # the paper's bound: one a page
    assert want != generate(engine(device, page_bounds))  # the halves rank otherwise
    assert generate(engine(device, HALVES, offload=True)) == want
    if device == "cuda":
        assert generate(engine(device, HALVES, eager=False)) == want


def test_the_oracle_with_every_page_of_a_sequence_in_budget_gives_its_dense_tokens():
    """Budget 36 blocks: the prompts of 90 and 33 tokens stay within it while the one of 140 outgrows it,
    so once the batch's block table is wider than the budget the oracle selects, and the two shorter
    sequences keep every page: their tokens are the dense ones."""
    meter = DensityMeter()
    got = generate(engine("cpu", "quest:token_budget=144,skip_layers=1,page_size=4,oracle=true", [meter]))
    assert meter.density("decode") < 1.0  # the longest sequence was sparse in some steps
    assert got[:2] == generate(engine("cpu", "full"))[:2]


@pytest.mark.parametrize("options", ["page_size=16", "bound_size=2"])
def test_page_bounds_hold_under_prefix_sharing_and_preemption(monkeypatch, options):
    """Every decode step, in every sparse layer, each page's bounds (at its anchor) bound every key of the
    page, for every sequence of the step: with prompts that share an anchor block through the prefix cache
    but not the page's later blocks, in one batch, and with preemption (freed and reallocated anchors).
    Bounds over halves of a page of one block likewise bound their halves."""
    from nanovllm.conformance import _kv_bytes, _prefix_prompts, _prompts
    from nanovllm_quest.policy import QuestPolicy
    from test_quest_policy import assert_pages_bound_their_keys

    checked = []
    select = QuestPolicy.select_blocks

    def checking(self, ctx):
        if ctx.layer_id >= self.config.skip_layers:
            lens = ctx.history_lens.tolist()
            metadata = self.metadata[ctx.layer_id - self.config.skip_layers]
            assert_pages_bound_their_keys(metadata, ctx.k_cache, ctx.meta.block_tables, lens, self.page_size,
                                          self.bound_size)
            checked.append(len(lens))
        return select(self, ctx)

    monkeypatch.setattr(QuestPolicy, "select_blocks", checking)
    model = tiny_model()
    llm = LLM(model, sparse_policy=f"quest:token_budget=16,skip_layers=1,{options}", device="cpu",
              dtype="float32", block_size=4, max_model_len=128, enforce_eager=True, max_num_seqs=4,
              attention_backend="torch", kv_cache_memory=_kv_bytes(model, 192), max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(_prefix_prompts([38], 7), params, use_tqdm=False)  # blocks 0-8 cached; page 2 is blocks 8-11
    shared = llm.generate(_prefix_prompts([38, 38, 38], 7)[1:], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 36 for o in shared), "the anchor block 8 is not shared"
    llm.generate(_prompts([30, 45, 60, 25], 5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                 use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert max(checked) > 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offload_gives_the_tokens_of_the_device_cache(device, monkeypatch):
    """The skip layer stays resident on the device under offload; the tokens are those of the device cache,
    and of the run that offloads every layer."""
    from nanovllm.kv import PagedLayerKV
    from nanovllm_quest.policy import QuestPolicy

    want = generate(engine(device))
    llm = engine(device, offload=True)
    assert llm.runner.kv.resident_layers == [0] and llm.runner.kv.engine.layers == [1, 2]
    assert isinstance(llm.runner.attention_layers[0].kv, PagedLayerKV)  # the GPU cache, as without offload
    assert generate(llm) == want
    monkeypatch.setattr(QuestPolicy, "dense_layers", lambda self, num_layers: frozenset())
    llm = engine(device, offload=True)
    assert llm.runner.kv.engine.layers == [0, 1, 2]
    assert generate(llm) == want


def test_skip_layers_are_the_dense_layers():
    from nanovllm_quest.config import QuestConfig
    from nanovllm_quest.policy import QuestPolicy

    assert QuestPolicy(QuestConfig(skip_layers=2)).dense_layers(32) == {0, 1}
    assert QuestPolicy(QuestConfig(skip_layers=0)).dense_layers(32) == frozenset()
    assert QuestPolicy(QuestConfig(skip_layers=40)).dense_layers(32) == set(range(32))


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_tokens():
    assert generate(engine("cuda", eager=False)) == generate(engine("cuda"))


@pytest.mark.gpu
def test_triton_kernels_select_what_the_torch_references_select():
    """The CUDA engine (Triton kernels) and the CPU engine (torch references) on the same float32 model."""
    assert generate(engine("cuda")) == generate(engine("cpu"))
