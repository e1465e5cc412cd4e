"""The small-batch matmul kernel (``nanovllm.layers.gemv``) against its torch reference: on CUDA (``gpu``),
and at small sizes under Triton's interpreter in a subprocess on machines without CUDA. Shapes are not
multiples of the blocks; every path (registers, tensor cores, split-K) and 1 to 16 rows."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"

pytest.importorskip("triton")

from nanovllm.layers.gemv import (  # noqa: E402
    MAX_ROWS,
    TUNED,
    GemvConfig,
    config_for,
    default_config,
    gemv,
    gemv_reference,
    linear,
    matmul,
    route_small_batches,
    row_bucket,
)

# kernel cases run on CUDA, or in the interpreter subprocess; the rest run everywhere
kernel = pytest.mark.skipif(not (CUDA or INTERP), reason="runs on CUDA, or under TRITON_INTERPRET=1")
CONFIGS = {
    "registers": GemvConfig(block_n=8, block_k=16),
    "registers-split3": GemvConfig(block_n=4, block_k=16, split_k=3),
    "dot": GemvConfig(block_n=16, block_k=32, dot=True, num_stages=2),
    "dot-split2": GemvConfig(block_n=16, block_k=16, split_k=2, dot=True),
}
configs = pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _ints(gen, *shape, dtype):
    """Small integers: every product and sum is exact in float32, whatever the order of addition."""
    return torch.randint(-4, 5, shape, generator=gen).to(dtype).to(DEVICE)


@kernel
@configs
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_interp_float32_is_exact(config, rows, gen):
    x, w, b = _ints(gen, rows, 100, dtype=torch.float32), _ints(gen, 37, 100, dtype=torch.float32), None
    if rows == 3:
        b = _ints(gen, 37, dtype=torch.float32)
    out = gemv(x, w, b, config)
    assert out.shape == (rows, 37) and out.dtype == torch.float32
    assert torch.equal(out.cpu(), gemv_reference(x, w, b).cpu()), f"seed {gen.initial_seed()}"


@kernel
@configs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7])
def test_interp_16_bit_within_one_rounding(config, dtype, rows, gen):
    """Random values: the kernel and the reference sum the same float32 products in different orders, then
    round once, so they differ by at most an ulp of the result (two in the interpreter, which rounds
    toward zero), plus the float32 order's error on results near zero."""
    x = torch.randn(rows, 72, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(45, 72, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(45, generator=gen).to(dtype).to(DEVICE)
    out, ref = gemv(x, w, b, config).float().cpu(), gemv_reference(x, w, b).float().cpu()
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype] * (2 if INTERP else 1)
    magnitude = x.float().abs().cpu() @ w.float().abs().cpu().t() + b.float().abs().cpu()
    assert (out - ref).abs().le(ulp * ref.abs() + 1e-5 * magnitude).all(), f"seed {gen.initial_seed()}"


def _float32_sums_of_16_bit(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``out`` holds ``x @ w.T`` of 16-bit inputs in float32, never rounded to 16 bits: within the float32
    order of addition's error of the reference, and mostly not representable in ``x``'s dtype."""
    assert out.dtype == torch.float32
    out, ref = out.cpu(), gemv_reference(x, w, out_dtype=torch.float32).cpu()
    magnitude = x.float().abs().cpu() @ w.float().abs().cpu().t()
    assert (out - ref).abs().le(1e-5 * magnitude).all()
    assert (out != out.to(x.dtype).float()).float().mean() > 0.9


@kernel
@configs
@pytest.mark.parametrize("rows", [1, 5])
def test_interp_float32_output_of_16_bit_inputs(config, rows, gen):
    x = torch.randn(rows, 72, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(45, 72, generator=gen).to(torch.bfloat16).to(DEVICE)
    _float32_sums_of_16_bit(gemv(x, w, None, config, out_dtype=torch.float32), x, w)


@kernel
def test_interp_uneven_splits_and_tiny_k(gen):
    """Splits that end inside a tile, an empty last split, and K smaller than a tile."""
    for k, config in [(50, GemvConfig(block_n=4, block_k=16, split_k=3)),  # 16+16+18: split 2 short
                      (33, GemvConfig(block_n=4, block_k=16, split_k=4)),  # 16+16+1+0: the last one empty
                      (5, GemvConfig(block_n=8, block_k=16))]:
        x, w = _ints(gen, 2, k, dtype=torch.float32), _ints(gen, 9, k, dtype=torch.float32)
        assert torch.equal(gemv(x, w, None, config).cpu(), gemv_reference(x, w).cpu()), (k, config)


@kernel
def test_interp_default_configs_run(gen):
    """The configuration each row count gets by default computes the right thing (rows padded to a bucket)."""
    w = _ints(gen, 40, 96, dtype=torch.float32)
    for rows in range(1, MAX_ROWS + 1, 3):
        x = _ints(gen, rows, 96, dtype=torch.float32)
        assert torch.equal(gemv(x, w).cpu(), gemv_reference(x, w).cpu()), rows


@kernel
def test_interp_gemv_runs_its_default_where_the_table_keeps_cublas(gen, monkeypatch):
    x, w = _ints(gen, 2, 48, dtype=torch.float32), _ints(gen, 24, 48, dtype=torch.float32)
    monkeypatch.setitem(TUNED, (24, 48, 2), None)
    assert torch.equal(gemv(x, w).cpu(), gemv_reference(x, w).cpu())


@kernel
def test_interp_strided_rows_of_x(gen):
    """x may be a row slice of a wider matrix (unit stride along K only)."""
    wide = _ints(gen, 3, 80, dtype=torch.float32)
    x, w = wide[:, 10:74], _ints(gen, 20, 64, dtype=torch.float32)
    assert torch.equal(gemv(x, w, None, CONFIGS["dot"]).cpu(), gemv_reference(x, w).cpu())


@kernel
@configs
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_interp_gated_output_is_the_activation_of_the_plain_output(config, activation, dtype, rows, gen):
    """``activation`` on a weight of gate rows over up rows: the same bits as the plain kernel's output
    through the activation's kernel (on small integers the matmul is exact whatever its order), a bias
    included on half the cases; and within float32 rounding of torch's activation (where GELU's tanh form
    cancels, below about -4, torch's own value is off by up to 1e-7 of a unit)."""
    from nanovllm.layers import GeluTanhAndMul, SiluAndMul
    from nanovllm.layers import fused_kernels as fk

    fused, module = {"silu": (fk.silu_and_mul, SiluAndMul), "gelu_tanh": (fk.gelu_tanh_and_mul, GeluTanhAndMul)}[
        activation]
    x, w = _ints(gen, rows, 100, dtype=dtype), _ints(gen, 2 * 37, 100, dtype=dtype)
    b = _ints(gen, 2 * 37, dtype=dtype) if rows == 5 else None
    out = gemv(x, w, b, config, activation=activation)
    assert out.shape == (rows, 37) and out.dtype == dtype
    assert torch.equal(out.cpu(), fused(gemv(x, w, b, config)).cpu()), f"seed {gen.initial_seed()}"
    ref = module()(gemv_reference(x, w, b).cpu())
    assert torch.allclose(out.cpu().float(), ref.float(), rtol=2**-6 if dtype != torch.float32 else 1e-6,
                          atol=1e-3 if activation == "gelu_tanh" else 1e-8)


@kernel
@pytest.mark.parametrize("table", [
    GemvConfig(block_n=8, block_k=32), GemvConfig(block_n=32, block_k=16, dot=True),
    GemvConfig(block_n=16, block_k=16, split_k=2, dot=True),
], ids=["registers", "dot", "dot-split2"])
def test_interp_gated_linear_runs_the_tables_configuration(table, gen, monkeypatch):
    """Where linear() would run the kernel, one launch applies the activation too, with the whole matrix's
    configuration (half its output features a program, at least a tensor-core tile); None where linear()
    keeps F.linear. ``use_fused`` forced on: the interpreter's CPU tensors stand in for CUDA ones."""
    from nanovllm.layers import fused_kernels as fk
    from nanovllm.layers import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "use_fused", lambda x: True)
    x, w = _ints(gen, 3, 64, dtype=torch.float32), _ints(gen, 2 * 40, 64, dtype=torch.float32)
    monkeypatch.setitem(TUNED, (80, 64, 4), table)
    launched = []
    run = type(fk._gated_and_mul_kernel).run

    def counting(self, *args, **kwargs):
        launched.append((self.fn.__name__, kwargs["BLOCK_N"] if "BLOCK_N" in kwargs else None))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(type(fk._gated_and_mul_kernel), "run", counting)
    out = gemv_module.gated_linear(x, w, None, "silu")
    assert torch.equal(out, fk.silu_and_mul(linear(x, w)))
    block_n = max(table.block_n // 2, 16 if table.dot else 1)
    fused_launches = [("_gemv_kernel", block_n)] + [("_split_k_sum_kernel", None)] * (table.split_k > 1)
    assert launched[: len(fused_launches)] == fused_launches
    monkeypatch.setitem(TUNED, (80, 64, 4), None)  # cuBLAS measured faster: no fused launch
    assert gemv_module.gated_linear(x, w, None, "silu") is None


@pytest.mark.skipif(INTERP, reason="compiles for the GPU")
@pytest.mark.parametrize("dot,stages,gated", [(False, 1, 0), (False, 3, 0), (True, 4, 0), (False, 3, 1), (True, 4, 1),
                                              (False, 3, 2), (True, 4, 2)])
def test_kernel_compiles_for_hopper_streaming_the_weights(dot, stages, gated):
    """Without a GPU: Triton compiles the kernel for sm_90 (the H200), plain and with each gated activation
    (GELU's through libdevice's tanh), waiting for the kernel before it (dependent launch). The weight loads
    are 16-byte vectors marked evict-first, or with ``num_stages > 1`` asynchronous copies that many tiles
    ahead."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.layers import gemv_kernels as gk

    pointers = {"X", "W", "B", "Y", "P"}
    constexprs = dict(M=1, BLOCK_M=16 if dot else 1, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, DOT=dot, EVEN_K=True,
                      EVEN_N=True, HAS_BIAS=False, FP32_DOT=False, STAGES=stages, GATED=gated,
                      LIBDEVICE=True, PDL=True)
    names = gk._gemv_kernel.arg_names
    signature = {name: "*bf16" if name in pointers else "constexpr" if name in constexprs else "i32"
                 for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name not in constexprs}
    source = ASTSource(fn=gk._gemv_kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": stages}).asm["ptx"]
    if stages > 1:
        assert "cp.async" in ptx
    else:
        assert re.search(r"ld\.global\.L1::evict_first\S*\.v4\.b32", ptx)
    assert ("mma.sync" in ptx) == dot
    assert "griddepcontrol.wait" in ptx and "launch_dependents" not in ptx  # waits; never launches early


def test_gemv_refuses_what_it_cannot_run():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv(torch.zeros(17, 16), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"x \[M, K\] by weight \[N, K\]"):
        gemv(torch.zeros(1, 15), w)
    with pytest.raises(ValueError, match="unit stride"):
        gemv(torch.zeros(16, 2).t()[:1], w)
    with pytest.raises(ValueError, match="the kernel applies silu, gelu_tanh"):
        gemv(torch.zeros(1, 16), w, activation="relu")
    with pytest.raises(ValueError, match="gate rows over as many up rows"):
        gemv(torch.zeros(1, 16), torch.zeros(7, 16), activation="silu")


def test_config_checks_its_knobs():
    with pytest.raises(ValueError, match="dot=True needs block_n and block_k of at least 16"):
        GemvConfig(block_n=8, block_k=64, dot=True)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        GemvConfig(block_n=8, block_k=96)
    with pytest.raises(ValueError, match="split_k must be a positive int"):
        GemvConfig(block_n=8, block_k=64, split_k=0)


def test_row_buckets():
    assert [row_bucket(m) for m in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1536, 4096), (151936, 4096), (40, 24)])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
def test_default_configs_fill_the_device(n, k, rows):
    """Valid for every row count; enough programs for the multiprocessors where K allows split-K, and no
    split beyond what K holds (each split at least a few tiles)."""
    sms = 132
    config = default_config(n, k, rows, sms)
    programs = -(-n // config.block_n) * config.split_k
    assert config.dot == (rows > 2)
    assert programs >= sms or k // config.split_k < 8 * config.block_k
    assert config.split_k == 1 or k // config.split_k >= 4 * config.block_k


def test_tuned_entries_win(monkeypatch):
    tuned = GemvConfig(block_n=32, block_k=128, split_k=2, dot=True)
    monkeypatch.setitem(TUNED, (512, 256, 4), tuned)
    assert config_for(512, 256, 3, torch.device("cpu")) is tuned
    assert config_for(512, 256, 5, torch.device("cpu")) == default_config(512, 256, 8, 132)
    monkeypatch.setitem(TUNED, (512, 256, 8), None)  # cuBLAS measured faster: linear() keeps F.linear
    assert config_for(512, 256, 5, torch.device("cpu")) is None


def test_linear_is_f_linear_off_cuda(gen):
    """On CPU tensors (and for more rows than the kernel takes) the path is F.linear itself."""
    x, w = torch.randn(3, 24, generator=gen), torch.randn(10, 24, generator=gen)
    b = torch.randn(10, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_matmul_rounds_once_off_cuda(gen):
    """Without CUDA's mixed-precision matmul, a float32 ``out_dtype`` casts the 16-bit result."""
    x, w = torch.randn(3, 24, generator=gen).bfloat16(), torch.randn(10, 24, generator=gen).bfloat16()
    out = matmul(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, F.linear(x, w).float())
    assert torch.equal(matmul(x, w), F.linear(x, w))


def test_route_small_batches_switches_the_linear_layers_and_lm_head():
    from nanovllm.layers import (
        MergedColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
    )

    model = torch.nn.ModuleList([
        QKVParallelLinear(32, 8, 4, 2), MergedColumnParallelLinear(32, [64, 64]), RowParallelLinear(64, 32),
        ParallelLMHead(100, 32), torch.nn.LayerNorm(32),
    ])
    for module in model:
        torch.nn.init.normal_(module.weight)
    x, wide = torch.randn(2, 32), torch.randn(2, 64)
    before = [model[0](x), model[1](x), model[2](wide), model[3](x)]
    assert route_small_batches(model) == 4
    assert all(m.use_triton_gemv for m in model[:4]) and not hasattr(model[4], "use_triton_gemv")
    after = [model[0](x), model[1](x), model[2](wide), model[3](x)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # CPU: F.linear either way


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_linear_in_a_cuda_graph(dtype, gen):
    """The routed path captures into a CUDA graph (split-K's workspace included) and replays on new inputs;
    the qwen3-8b o_proj shape, split-K and not, against cuBLAS within one rounding."""
    w = torch.randn(4096, 4096, generator=gen).to(dtype).cuda() / 64
    for rows, config in [(1, None), (4, GemvConfig(block_n=16, block_k=256, split_k=4, dot=True))]:
        x = torch.randn(rows, 4096, generator=gen).to(dtype).cuda()
        gemv(x, w, None, config)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv(x, w, None, config)
        x.copy_(torch.randn(rows, 4096, generator=gen).to(dtype))
        graph.replay()
        ref = gemv_reference(x, w)
        assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=1e-3), (rows, config)
        assert torch.allclose(out.float(), F.linear(x, w).float(), rtol=2**-6, atol=1e-2), (rows, config)


@pytest.mark.gpu
@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_gpu_lm_head_gives_float32_sums(routed, rows, gen):
    """A bfloat16 LM head's logits are float32 sums, never rounded to bfloat16: through cuBLAS's
    mixed-precision matmul, and through the kernel (routed, at up to MAX_ROWS rows)."""
    from nanovllm.layers import ParallelLMHead

    head = ParallelLMHead(1000, 256).to(torch.bfloat16).cuda()
    torch.nn.init.normal_(head.weight)
    head.use_triton_gemv = routed
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16).cuda()
    _float32_sums_of_16_bit(head(x), x, head.weight.detach())
    batched = torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16).cuda()  # leading dimensions kept
    assert matmul(batched, head.weight, out_dtype=torch.float32).shape == (2, 3, 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_gated_linear_at_qwen3_8b_gate_up(rows, activation, gen):
    """qwen3-8b's gate/up shape with its table configuration: one launch gives what the plain kernel and the
    activation's kernel give, to the bit in nearly every element (the halved slabs sum each output in the
    same order on the register path; the tensor-core path may round a few differently), all within an
    ulp."""
    from nanovllm.layers import fused_kernels as fk
    from nanovllm.layers import gemv as gemv_module

    x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(2 * 12288, 4096, generator=gen) / 64).to(torch.bfloat16).cuda()
    config = config_for(w.shape[0], 4096, rows, x.device)
    if config is None:
        pytest.skip("the table keeps cuBLAS for this shape")
    out = gemv_module.gated_linear(x, w, None, activation)
    two = {"silu": fk.silu_and_mul, "gelu_tanh": fk.gelu_tanh_and_mul}[activation](gemv(x, w, None, config))
    assert out.shape == two.shape == (rows, 12288)
    diff = (out.float() - two.float()).abs()
    assert (diff <= 2**-7 * two.float().abs() + 1e-6).all(), f"max diff {diff.max():.3g}"
    assert (diff == 0).float().mean() > 0.99


def test_engine_option_routes_the_model(tiny_model, one_thread):
    """``enable_triton_gemv`` (on by default) reaches every linear layer and the LM head; on the CPU they
    still compute with F.linear, so the tokens are those of the option off."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.layers.linear import LinearBase

    path = tiny_model("Qwen3ForCausalLM")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    options = dict(device="cpu", kv_cache_memory=1 << 22, max_model_len=64, max_num_seqs=2)
    routed, plain = LLM(path, **options), LLM(path, enable_triton_gemv=False, **options)
    linears = [m for m in routed.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.use_triton_gemv for m in linears) and routed.runner.model.lm_head.use_triton_gemv
    assert not any(m.use_triton_gemv for m in plain.runner.model.modules() if isinstance(m, LinearBase))
    prompts = [[3, 9, 4], [7, 1]]
    assert ([o.token_ids for o in routed.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Gemma3ForCausalLM"])  # SiLU and GELU-tanh MLPs
def test_gpu_engine_decodes_the_same_tokens_through_the_kernel(arch, tiny_model):
    """On CUDA the decode graphs capture the kernel; float32 greedy tokens equal cuBLAS's."""
    from nanovllm import LLM, SamplingParams

    path = tiny_model(arch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 26, max_num_seqs=8)
    prompts = [[5 + i, 17, 3 * i + 1] for i in range(5)]
    routed = LLM(path, enable_triton_gemv=True, **options)
    assert sorted(routed.runner.cuda_graphs.graphs) == [1, 2, 4, 8]
    tokens = [o.token_ids for o in routed.generate(prompts, params, use_tqdm=False)]
    del routed
    plain = LLM(path, enable_triton_gemv=False, **options)
    assert [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == tokens


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the kernel cases; the subprocess, the interp cases")
def test_gemv_kernels_under_interpreter():
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == len(CONFIGS) * 4 + len(CONFIGS) * 2 * 2 + len(CONFIGS) * 2 + 4 + len(CONFIGS) * 2 * 2 * 2 + 3, tail
