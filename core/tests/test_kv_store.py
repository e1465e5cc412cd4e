"""The KV store: the offload notifications report exactly the bytes the host store moves (checked with the
PCIe byte counter of ``examples/offload_pcie_bytes.py``, on the CPU and, marked ``gpu``, on CUDA), and
``PolicyContext`` reads the same keys and values through either store."""

import importlib.util
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.kv import PagedLayerKV
from nanovllm.policy import PolicyContext
from nanovllm.testing import prefill_context

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "offload_pcie_bytes.py"


def _example():
    spec = importlib.util.spec_from_file_location("offload_pcie_bytes", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_pcie_byte_counter_sees_every_store_and_load_per_layer(tiny_model, device):
    """One sequence, its prompt in one chunk (no history to load), then decode steps that read every
    history block densely: each offloaded layer stores every token once and loads every history block of
    every KV head each decode step; the resident (dense) layers move nothing. Tokens match the run
    without the observer."""
    counter = _example().PCIeBytes()
    prompt, max_tokens = list(range(3, 3 + 37)), 6
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    options = dict(device=device, dtype="float32", block_size=16, max_model_len=256, max_num_seqs=4,
                   kv_offloading_size=0.01, kv_offloading_buffer_size=0.01)
    want = LLM(tiny_model(num_hidden_layers=3), **options).generate([{"prompt_token_ids": prompt}], params,
                                                                   use_tqdm=False)
    llm = LLM(tiny_model(num_hidden_layers=3), observers=[counter], **options)
    assert not llm.runner.cuda_graphs.graphs  # the counter reads sizes back: it is not cuda_graph_safe
    counter.clear()  # the warm-up on CUDA
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids

    engine = llm.runner.kv.engine
    token_bytes = 2 * engine.num_kv_heads * engine.head_dim * engine.pool.element_size()
    written = len(prompt) + max_tokens - 1  # the last sampled token is never written
    history_blocks = sum(-(-(len(prompt) + step) // engine.block_size) for step in range(1, max_tokens))
    assert engine.layers == [0, 1, 2]
    assert dict(counter.stored) == {layer: written * token_bytes for layer in engine.layers}
    assert dict(counter.loaded) == {
        layer: history_blocks * engine.num_kv_heads * engine.head_block_bytes for layer in engine.layers
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_pcie_byte_counter_counts_only_the_global_layers_of_a_hybrid_model(tiny_model, device):
    """Gemma 3 in small: the sliding-window layers keep their windows on the GPU, so only the global layers'
    stores and loads cross PCIe, the same bytes per layer as a model of those layers alone."""
    from nanovllm.plugins import get_plugins
    from nanovllm.testing import HYBRID_BLOCK_SIZE, TINY_CONFIGS

    if "Gemma3ForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-gemma3 plugin")
    counter = _example().PCIeBytes()
    prompt, max_tokens = list(range(3, 3 + 90)), 6  # past the window of 32 tokens
    llm = LLM(tiny_model("Gemma3ForCausalLM"), observers=[counter], device=device, dtype="float32",
              block_size=HYBRID_BLOCK_SIZE, max_model_len=256, max_num_seqs=4, kv_offloading_size=0.01,
              kv_offloading_buffer_size=0.01, kv_cache_memory=1 << 22, skip_tokenizer_init=True)
    counter.clear()  # the warm-up on CUDA
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                 use_tqdm=False)
    engine = llm.runner.kv.engine
    kinds = TINY_CONFIGS["Gemma3ForCausalLM"]["layer_types"]
    assert engine.layers == [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    token_bytes = 2 * engine.num_kv_heads * engine.head_dim * engine.pool.element_size()
    written = len(prompt) + max_tokens - 1
    history_blocks = sum(-(-(len(prompt) + step) // engine.block_size) for step in range(1, max_tokens))
    assert dict(counter.stored) == {layer: written * token_bytes for layer in engine.layers}
    assert dict(counter.loaded) == {
        layer: history_blocks * engine.num_kv_heads * engine.head_block_bytes for layer in engine.layers
    }


def test_the_pcie_byte_counter_counts_nothing_without_offload(tiny_model):
    counter = _example().PCIeBytes()
    llm = LLM(tiny_model(), device="cpu", dtype="float32", kv_cache_memory=16 << 20, observers=[counter])
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not counter.stored and not counter.loaded


def test_both_stores_read_the_same_blocks_through_the_context():
    """``read_paged`` reads in place on the GPU cache (nothing copied, every block readable) and copies
    only the marked blocks where a store must; both give the same keys through their block tables, and the
    compact copy's ``width`` fixes its size without reading the marks back."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 70, 2, 8, generator=g).unbind(0)
    q = torch.randn(70, 4, 8, generator=g)
    _, ctx = prefill_context(q, k, v, 30, 8**-0.5)
    marked = torch.zeros(1, ctx.meta.block_tables.shape[1], dtype=torch.bool)
    marked[0, [0, 2]] = True
    in_place = ctx.read_paged(lambda: pytest.fail("the GPU cache evaluates no marks"))
    assert in_place[0] is ctx.k_cache and in_place[2] is ctx.meta.block_tables
    copy = PagedLayerKV(ctx.layer_id, ctx.k_cache, ctx.v_cache).compact_copy(ctx, marked, True, width=3)
    assert copy[0].shape[0] == 3 and copy[1].shape == copy[0].shape
    for logical in (0, 2):
        physical, compact = ctx.meta.block_tables[0, logical], copy[2][0, logical]
        torch.testing.assert_close(copy[0][compact], ctx.k_cache[physical])
        torch.testing.assert_close(copy[1][compact], ctx.v_cache[physical])
    keys = ctx.read_keys(torch.tensor([[2, -1]], dtype=torch.int32))
    torch.testing.assert_close(keys[0, 0], ctx.k_cache[ctx.meta.block_tables[0, 2]])
    assert (keys[0, 1] == 0).all()
    other = PolicyContext(ctx.layer_id, True, ctx.query, ctx.meta, ctx.k_cache, ctx.v_cache, ctx.scale,
                          TorchBackend())
    assert isinstance(other.kv, PagedLayerKV) and other.kv.k_cache is ctx.k_cache  # the default store


def test_the_backend_reserves_its_workspace_before_the_kv_cache_is_sized(tiny_model, monkeypatch):
    """The engine asks the backend for its workspace once, with the cache's shape, before the memory
    profile that sizes the KV cache (on a GPU the profile then counts it)."""
    from nanovllm.engine import model_runner

    calls = []
    monkeypatch.setattr(TorchBackend, "reserve_workspace",
                        lambda self, *args: calls.append(("workspace", args)))
    allocate = model_runner.allocate_kv_store
    monkeypatch.setattr(model_runner, "allocate_kv_store",
                        lambda *args, **kwargs: calls.append(("kv store", ())) or allocate(*args, **kwargs))
    llm = LLM(tiny_model(), device="cpu", kv_cache_memory=1 << 24, max_model_len=64, block_size=8)
    r = llm.runner
    assert calls == [("workspace", (r.num_kv_heads, r.head_dim, 8, r.dtype, r.device, 64)), ("kv store", ())]
