"""``kv_cache_dtype``: keys and values stored as 8-bit floats.

On the CPU: the option's names and refusals, the saturating cast, the torch backend reading an 8-bit cache
as the same values widened, and an engine that holds more tokens in the same memory. On a GPU (``gpu``
marker): the Triton kernels' stores and reads against the torch backend, and an engine whose CUDA graphs
give the tokens of its eager steps."""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.config import EngineConfig
from nanovllm.kv.cache_dtype import CACHE_DTYPES, kv_cache_torch_dtype, to_cache
from nanovllm.plugins import AttentionBackendInfo

CUDA = torch.cuda.is_available()
FP8 = list(CACHE_DTYPES)


def test_fp8_is_vllms_spelling_of_e4m3_and_other_names_are_refused():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8_e4m3', 'fp8_e5m2'"):
        EngineConfig(kv_cache_dtype="int8")
    assert kv_cache_torch_dtype("auto", torch.float16) is torch.float16
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2


@pytest.mark.parametrize("name", FP8)
def test_the_cast_saturates_at_the_largest_finite_value(name):
    dtype = CACHE_DTYPES[name]
    top = torch.finfo(dtype).max
    x = torch.tensor([1e6, -1e6, top, 0.3, -2.0, float("nan")], dtype=torch.bfloat16)
    stored = to_cache(x, dtype).float()
    assert stored[:3].tolist() == [top, -top, top]
    assert stored[3].item() == pytest.approx(0.3, rel=0.13)  # the nearest of 2 or 3 mantissa bits
    assert stored[4].item() == -2.0
    assert stored[5].isnan()  # not a value to saturate
    assert to_cache(x[:5], torch.bfloat16).equal(x[:5])  # the model's dtype: unchanged


def test_a_backend_that_does_not_list_the_dtype_says_so():
    info = AttentionBackendInfo("b", "m:B", "d", kv_cache_dtypes=("auto", "fp8_e4m3"))
    assert info.supports("cuda", "bfloat16", 128, "fp8_e4m3") is None
    assert "kv_cache_dtype fp8_e5m2 is not among auto, fp8_e4m3" in info.supports("cuda", "bfloat16", 128,
                                                                                   "fp8_e5m2")


def _paged(num_seqs: int, lens: list[int], block_size: int, hkv: int, d: int, dtype, device, seed: int = 0):
    """Random keys and values of ``lens`` tokens per sequence in a paged cache of ``dtype`` (blocks shuffled),
    stored through ``to_cache``; with the same values in a cache of the model's dtype (widened)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    total = sum(blocks) + 1
    width = max(blocks)
    raw = torch.randn(2, total, block_size, hkv, d, generator=gen) * 2
    cache = to_cache(raw, dtype).to(device)
    widened = cache.to(torch.bfloat16)
    order = torch.randperm(total - 1, generator=gen) + 1
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    at = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[at:at + n]
        at += n
    return cache, widened, tables.to(device)


@pytest.mark.parametrize("name", FP8)
def test_the_torch_backend_reads_an_8bit_cache_as_its_values_widened(name):
    lens, hkv, group, d, bs = [37, 5, 64], 2, 2, 16, 8
    cache, widened, tables = _paged(3, lens, bs, hkv, d, CACHE_DTYPES[name], torch.device("cpu"))
    q = torch.randn(3, hkv * group, d, dtype=torch.bfloat16)
    meta = PhaseMetadata(torch.arange(4, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), tables, 1,
                         max(lens))
    backend = TorchBackend()
    out = backend.decode(q, cache[0], cache[1], meta, 0.25)
    assert out.dtype == torch.bfloat16
    assert out.equal(backend.decode(q, widened[0], widened[1], meta, 0.25))
    windowed = backend.decode(q, cache[0], cache[1], meta, 0.25, 16)
    assert windowed.equal(backend.decode(q, widened[0], widened[1], meta, 0.25, 16))


@pytest.mark.usefixtures("one_thread")
def test_an_8bit_cache_holds_more_tokens_in_the_same_memory_and_generates(model):
    from nanovllm import LLM, SamplingParams

    options = dict(kv_cache_memory=1 << 22, device="cpu", max_model_len=128, block_size=8)
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **options)
        layer = llm.runner.attention_layers[0]
        blocks[kv_cache_dtype] = llm.runner.num_blocks, layer.k_cache.element_size()
        outputs = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]],
                               SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
    (auto_blocks, auto_bytes), (fp8_blocks, fp8_bytes) = blocks["auto"], blocks["fp8"]
    assert fp8_bytes == 1 and auto_bytes == 4  # float32 on the CPU
    assert fp8_blocks >= 3.9 * auto_blocks


def test_policies_backends_and_offload_that_cannot_keep_8bit_refuse_it_before_loading(model):
    from nanovllm import LLM
    from nanovllm.engine.model_loading import EngineParts, check_kv_cache_dtype
    from nanovllm.plugins import get_plugins
    from nanovllm.selection import BackendChoice, resolve_policies

    with pytest.raises(ValueError, match="leave kv_offloading_size unset"):
        LLM(model, device="cpu", kv_cache_dtype="fp8", kv_offloading_size=1)
    plugins = get_plugins()
    parts = EngineParts(plugins, resolve_policies("full", plugins),
                        BackendChoice(AttentionBackendInfo("slow", "m:B", "d")), ())
    with pytest.raises(ValueError, match="attention backend 'slow' does not read a kv_cache_dtype='fp8_e4m3'"):
        check_kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8"), parts)
    check_kv_cache_dtype(EngineConfig(), parts)  # "auto": every backend
    if "quest" in plugins.registry.sparse_policies:
        with pytest.raises(ValueError, match="sparse policy 'quest' does not read .* sparse_policy='full'"):
            LLM(model, device="cpu", kv_cache_dtype="fp8", sparse_policy="quest")


# -- GPU --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8)
def test_triton_stores_saturate_as_the_torch_cast_does(name):
    from nanovllm.attention import triton_kernels as tk
    from nanovllm.layers.fused_kernels import rope_

    dtype, dev = CACHE_DTYPES[name], torch.device("cuda")
    k = (torch.randn(40, 2, 64, device=dev) * torch.finfo(dtype).max / 2).to(torch.bfloat16)
    v = torch.randn(40, 2, 64, device=dev, dtype=torch.bfloat16)
    kc = torch.zeros(8, 16, 2, 64, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(128, device=dev)[:40]
    tk.store_kv(k, v, kc, vc, slots)
    assert kc.view(-1, 2, 64)[slots].view(torch.uint8).equal(to_cache(k, dtype).view(torch.uint8))
    assert vc.view(-1, 2, 64)[slots].view(torch.uint8).equal(to_cache(v, dtype).view(torch.uint8))
    # RoPE's kernel, writing the rotated keys on the way: the rotated keys (written back in place) cast
    q = torch.randn(40, 4, 64, device=dev, dtype=torch.bfloat16)
    cos_sin = torch.randn(256, 64, device=dev)
    positions = torch.randint(0, 256, (40,), device=dev)
    kc.zero_()
    vc.zero_()
    rope_(q, k, positions, cos_sin, store=(v, kc, vc, slots))
    assert kc.view(-1, 2, 64)[slots].view(torch.uint8).equal(to_cache(k, dtype).view(torch.uint8))
    assert vc.view(-1, 2, 64)[slots].view(torch.uint8).equal(to_cache(v, dtype).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("block_size", [16, 128])
def test_triton_attention_over_an_8bit_cache_matches_the_torch_backend(name, block_size):
    from nanovllm.attention.triton_backend import TritonBackend

    dev, hkv, group, d = torch.device("cuda"), 8, 2, 128
    lens = [1000, 37, 513, 4096, 1]
    cache, _, tables = _paged(len(lens), lens, block_size, hkv, d, CACHE_DTYPES[name], dev)
    q = torch.randn(len(lens), hkv * group, d, device=dev, dtype=torch.bfloat16)
    meta = PhaseMetadata(torch.arange(len(lens) + 1, dtype=torch.int32, device=dev),
                         torch.tensor(lens, dtype=torch.int32, device=dev), tables, 1, max(lens))
    triton_backend, reference = TritonBackend(), TorchBackend()
    for window in (None, 256):
        got = triton_backend.decode(q, cache[0], cache[1], meta, d**-0.5, window)
        want = reference.decode(q, cache[0], cache[1], meta, d**-0.5, window)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # a prefill chunk of 200 tokens after each context's history, read from the cache
    chunk = 200
    query_lens = [min(chunk, n) for n in lens]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qs = torch.randn(int(cu[-1]), hkv * group, d, device=dev, dtype=torch.bfloat16)
    meta = PhaseMetadata(cu, torch.tensor(lens, dtype=torch.int32, device=dev), tables, max(query_lens),
                         max(lens), tuple(query_lens), tuple(lens))
    unused = torch.empty(0, hkv, d, device=dev, dtype=torch.bfloat16)
    triton_backend.reserve_workspace(hkv, d, block_size, CACHE_DTYPES[name], dev, 8192)
    for window in (None, 256):
        got = triton_backend.prefill(qs, unused, unused, cache[0], cache[1], meta, d**-0.5, window)
        want = reference.prefill(qs, unused, unused, cache[0], cache[1], meta, d**-0.5, window)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Gemma3ForCausalLM"])
def test_an_8bit_engine_replays_its_graphs_to_the_tokens_of_its_eager_steps(tiny_model, architecture):
    """Qwen3 in one KV cache group; Gemma 3's sliding windows in several (hybrid KV)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.plugins import get_plugins

    if architecture not in get_plugins().registry.model_families:
        pytest.skip(f"needs the plugin of {architecture}")
    model = tiny_model(architecture)
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(model, kv_cache_dtype="fp8", enforce_eager=eager, max_model_len=512, kv_cache_memory=1 << 26,
                  attention_backend="triton")
        assert llm.runner.attention_layers[0].k_cache.dtype == torch.float8_e4m3fn
        assert bool(llm.runner.cuda_graphs.graphs) is not eager
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert tokens[False] == tokens[True]
