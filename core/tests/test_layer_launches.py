"""The kernels one decoder layer launches in a batch-1 decode step on the fused path (CUDA, Triton backend),
and that the fused path computes what the separate kernels do.

At batch 1 a decode step is bound by its launches as much as by its matmuls, so a kernel that creeps back
into the layer shows here, on the CPU: Qwen3's layer (q/k norms) runs with the fused path forced on, its
Triton launches counted instead of run and its torch ops counted by a dispatch mode (views and
allocations launch nothing), on its second step (the first may make buffers kept for later ones). The
attention backend's decode kernels are counted apart (they are its own). The ``interp`` cases run the same
layer under Triton's interpreter, fused and not, and compare the bits."""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, forward_context  # noqa: E402
from nanovllm.attention.triton_backend import TritonBackend  # noqa: E402
from nanovllm.kv import PagedLayerKV  # noqa: E402
from nanovllm.layers import GatedActivation, RMSNorm, SiluAndMul, activation, gemv, layernorm  # noqa: E402
from nanovllm.layers import rotary_embedding  # noqa: E402
from nanovllm.layers.decoder import DecoderLayer, SelfAttention  # noqa: E402
from nanovllm.layers.fused import kernels  # noqa: E402
from nanovllm.policies.full import FullAttentionPolicy, FullConfig  # noqa: E402
from nanovllm.policy import PolicyHooks  # noqa: E402
from nanovllm.testing import counting_torch_ops  # noqa: E402

INTERP = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
CONFIG = SimpleNamespace(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
    rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=10000.0, hidden_act="silu",
)
BLOCK_SIZE = 16


class QkNormAttention(SelfAttention):
    """Qwen3's attention: an RMSNorm on each query and key head before RoPE."""

    def __init__(self, config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


def fused_on_the_cpu(monkeypatch) -> None:
    """The layers take their CUDA path on CPU tensors."""
    for module in (activation, gemv, layernorm, rotary_embedding):
        monkeypatch.setattr(module, "use_fused", lambda x: True)


def decode_layer(gemv_on: bool, num_tokens: int = 1, context: int = 21, seed: int = 0):
    """A bfloat16 Qwen3-style layer with random weights on the Triton backend over a paged cache, and its
    inputs: ``(layer, positions, hidden, residual, meta)`` of a decode step of ``num_tokens`` sequences."""
    torch.manual_seed(seed)
    layer = DecoderLayer(CONFIG, 0, QkNormAttention)
    with torch.no_grad():
        for param in layer.parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.1 * noise if param.dim() == 1 else noise / 8)  # norms near one
    layer = layer.to(torch.bfloat16)
    if gemv_on:
        gemv.route_small_batches(layer)
    attn = layer.self_attn.attn
    full = FullAttentionPolicy(FullConfig())
    attn.bind(TritonBackend(), PolicyHooks(full, full))
    num_blocks = num_tokens * 4
    shape = (2, num_blocks, BLOCK_SIZE, CONFIG.num_key_value_heads, CONFIG.head_dim)
    cache = torch.randn(shape).to(torch.bfloat16)
    attn.bind_kv(PagedLayerKV(0, cache[0], cache[1]))
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(num_tokens, 4)
    lens = torch.full((num_tokens,), context, dtype=torch.int32)
    positions = lens.long() - 1
    slots = tables[:, 1].long() * BLOCK_SIZE + positions % BLOCK_SIZE  # each token's slot in its 2nd block
    decode = PhaseMetadata(torch.arange(num_tokens + 1, dtype=torch.int32), lens, tables, 1, context)
    meta = StepMetadata(slots, positions, num_tokens, decode, None)
    hidden = torch.randn(num_tokens, CONFIG.hidden_size).to(torch.bfloat16)
    residual = torch.randn(num_tokens, CONFIG.hidden_size).to(torch.bfloat16)
    return layer, positions, hidden, residual, meta


def layer_launches(monkeypatch, gemv_on: bool) -> tuple[list[str], list[str], list[str]]:
    """``(Triton kernels, torch ops, Triton kernels of the backend's decode)`` of the layer's second decode
    step, each in launch order; the kernels are counted, not run."""
    fused_on_the_cpu(monkeypatch)
    layer, positions, hidden, residual, meta = decode_layer(gemv_on)
    kernels_, in_decode = [], []
    inside = False

    def run(self, *args, grid, warmup, **kwargs):
        (in_decode if inside else kernels_).append(self.fn.__name__)

    monkeypatch.setattr(type(kernels()._rope_kernel), "run", run)
    decode = TritonBackend.decode

    def counted_apart(self, *args, **kwargs):
        nonlocal inside
        inside = True
        try:
            return decode(self, *args, **kwargs)
        finally:
            inside = False

    monkeypatch.setattr(TritonBackend, "decode", counted_apart)
    for _ in range(2):
        kernels_.clear(), in_decode.clear()
        with forward_context(meta), counting_torch_ops() as ops:
            layer(positions, hidden, residual)
    return kernels_, ops, in_decode


# A layer's launches in a batch-1 decode step besides the attention backend's decode, in order: the input
# norm (adding the residual), the qkv matmul, RoPE with the q/k norms and the KV cache store, [decode],
# the o matmul, the post-attention norm (adding the residual), the gate/up matmul with SiLU-and-mul, the
# down matmul. The decode CUDA graphs add a weight prefetch on a side stream before each of three matmuls.
FUSED = ["_rms_norm_kernel", "_gemv_kernel", "_rope_kernel", "_gemv_kernel", "_rms_norm_kernel",
         "_gemv_kernel", "_gemv_kernel"]


def test_a_decode_layer_launches_seven_kernels_besides_attention(monkeypatch):
    launched, ops, in_decode = layer_launches(monkeypatch, gemv_on=True)
    assert launched == FUSED
    assert ops == [], "no torch op in the layer, its attention included"
    assert in_decode and "_store_kv_kernel" not in in_decode, "attention ran, without a KV store of its own"


def test_without_the_gemv_the_matmuls_are_cublas_and_silu_a_kernel(monkeypatch):
    launched, ops, _ = layer_launches(monkeypatch, gemv_on=False)
    assert launched == ["_rms_norm_kernel", "_rope_kernel", "_rms_norm_kernel", "_gated_and_mul_kernel"]
    assert Counter(ops) == {"mm": 4}, ops


def test_the_torch_backend_and_the_host_pool_store_kv_themselves(monkeypatch):
    """The fused store only where the backend's store is the plain write and KV is in the paged GPU cache."""
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.kv import PooledLayerKV

    layer, _, _, _, meta = decode_layer(gemv_on=True)
    attn = layer.self_attn.attn
    with forward_context(meta):
        slots = attn.cache_slots()
        assert slots is not None and slots.k_cache is attn.k_cache and slots.slot_mapping is meta.slot_mapping
        attn.bind(TorchBackend(), attn.hooks)
        assert attn.cache_slots() is None
        attn.bind(TritonBackend(), attn.hooks)
        attn.kv = object.__new__(PooledLayerKV)  # a host-pool layer: cache_slots is the base's
        assert attn.cache_slots() is None
        attn.kv = None  # the memory-profiling run
        assert attn.cache_slots() is None


def run_layer(monkeypatch, fused: bool, num_tokens: int):
    """The layer's output, new residual and KV cache after one decode step under the interpreter, with the
    fused kernels or with the separate ones (the backend's KV store, the activation's own kernel)."""
    fused_on_the_cpu(monkeypatch)
    if not fused:
        monkeypatch.setattr(TritonBackend, "kv_write_fusable", False)
        monkeypatch.setattr(SiluAndMul, "of_projection", GatedActivation.of_projection)
    layer, positions, hidden, residual, meta = decode_layer(gemv_on=True, num_tokens=num_tokens)
    with forward_context(meta):
        out, new_residual = layer(positions, hidden, residual)
    return out, new_residual, layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache


@pytest.mark.skipif(not INTERP, reason="runs under TRITON_INTERPRET=1 (the subprocess case below)")
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_interp_fused_layer_computes_the_same_bits(monkeypatch, num_tokens):
    fused = run_layer(monkeypatch, True, num_tokens)
    monkeypatch.undo()
    separate = run_layer(monkeypatch, False, num_tokens)
    for what, a, b in zip(("output", "residual", "k cache", "v cache"), fused, separate, strict=True):
        assert torch.equal(a, b), what


@pytest.mark.skipif(torch.cuda.is_available() or INTERP, reason="the interp cases, in a subprocess")
def test_layer_launches_under_interpreter():
    from nanovllm.testing import assert_interpreter_cases_pass

    assert_interpreter_cases_pass(__file__, expected=2)


@pytest.mark.gpu
def test_gpu_engine_tokens_unchanged_by_the_fusions(tiny_model, monkeypatch):
    """A tiny Qwen3 in bfloat16 on the Triton backend with the GEMV path, CUDA graphs on: the greedy tokens
    of prompts of several lengths (prefill and decode steps, batches of 1 to 4) are those of the separate
    kernels (the backend's KV store, the activation's own kernel)."""
    import gc

    from nanovllm import LLM, SamplingParams

    path = tiny_model("Qwen3ForCausalLM")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", attention_backend="triton", enable_triton_gemv=True,
                   kv_cache_memory=1 << 26, max_num_seqs=4)
    prompts = [[5 + i, 17, 3 * i + 1] * (3 * i + 1) for i in range(4)]

    def tokens() -> list[list[int]]:
        llm = LLM(path, **options)
        assert llm.runner.cuda_graphs.graphs and llm.runner.backend.kv_write_fusable == fused
        out = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        out += [o.token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)]  # batch 1
        del llm
        gc.collect()
        return out

    fused = True
    with_fusions = tokens()
    fused = False
    monkeypatch.setattr(TritonBackend, "kv_write_fusable", False)
    monkeypatch.setattr(SiluAndMul, "of_projection", GatedActivation.of_projection)
    assert tokens() == with_fusions
