"""The one-pass sampling kernel against the torch sampler's behaviour: greedy rows are the argmax (ties and
masked tokens included), temperature rows follow softmax(logits / T), each call draws anew, the split of
a row over programs changes nothing; and the sampler takes the kernel only where no option needs the torch
code. On CUDA (``gpu``), and at small sizes under Triton's interpreter in a subprocess on machines without
CUDA."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm.layers import sampler as sampler_module  # noqa: E402
from nanovllm.layers import sampler_kernels as sk  # noqa: E402
from nanovllm.layers.sampler import LogitsProcessing, Sampler  # noqa: E402

DEVICES = [pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)] + (
    [pytest.param("cpu", id="interp")] if INTERP else []
)
on_devices = pytest.mark.parametrize("device", DEVICES)
# the interpreter runs the kernels on numpy, one program at a time: a few thousand columns there
VOCAB = {"cuda": 151_936, "cpu": 5_000}


@on_devices
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_greedy_rows_are_the_argmax_ties_and_masks_included(device, dtype, splits):
    vocab = VOCAB[device]
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-50, 50, (7, vocab), generator=gen).float() / 8  # many exact ties, also in bf16
    logits[1, -1] = logits[1, 0] = 100.0  # tied maxima at both ends: the first wins
    logits[2, 5 * vocab // 6] = 100.0  # the maximum in a later tile than the first
    logits[3] = float("-inf")  # all masked: token 0, as argmax gives
    logits[4, : vocab // 2] = float("-inf")
    logits = logits.to(dtype)
    temperatures = torch.zeros(7)
    got = sk.sample(logits.to(device), temperatures.to(device), splits)
    assert got.dtype == torch.long
    assert torch.equal(got.cpu(), logits.float().argmax(-1))


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws against ``probs``, the tokens expected fewer than 5 times pooled (at
    most 4 degrees of freedom here); no draw of a token of probability 0."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert (counts[expected == 0] == 0).all(), f"drew a token of probability 0: {counts.tolist()}"
    rare = expected < 5
    counts = torch.cat([counts[~rare], counts[rare].sum().view(1)])
    expected = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    seen = expected > 0
    return (((counts - expected) ** 2)[seen] / expected[seen]).sum().item()


# the chi-square statistic with 4 degrees of freedom (or fewer) exceeds this with probability 1e-7
CHI2_4_DOF = 37.0


# the interpreter draws a few hundred times (one program a draw, ~15 ms each), a GPU thousands
DRAWS = {"cuda": 4000, "cpu": 120}


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cuda", torch.float32, id="gpu-fp32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=pytest.mark.gpu),
    *([pytest.param("cpu", torch.bfloat16, id="interp-bf16")] if INTERP else []),
])
def test_draws_follow_the_softmax_at_each_rows_temperature(device, dtype):
    """Rows of two temperatures and greedy rows in one batch; a masked token is never drawn."""
    row = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), 0.5]).to(dtype)
    draws = DRAWS[device]
    temperatures = torch.tensor([0.5, 2.0]).repeat_interleave(draws)
    temperatures[::10] = 0.0
    torch.manual_seed(0)
    tokens = sk.sample(row.to(device).expand(2 * draws, -1), temperatures.to(device)).cpu()  # row stride 0
    assert (tokens[::10] == 2).all(), "greedy rows"
    for t in (0.5, 2.0):
        drawn = tokens[temperatures == t]
        chi2 = _chi_square(drawn, torch.softmax(row.float() / t, dim=-1))
        assert chi2 < CHI2_4_DOF, f"T={t}: chi-square {chi2:.1f}, counts {torch.bincount(drawn).tolist()}"


@on_devices
def test_draws_follow_the_softmax_across_tiles(device):
    """The mass on five tokens in different tiles and sub-tiles (the rest is negligible): each keeps its
    probability (a split draws what the whole row does: the test below)."""
    vocab = VOCAB[device]
    cols = [3, 1500, 3000, vocab // 2 + 7, vocab - 1]
    row = torch.full((vocab,), -30.0)
    row[cols] = torch.tensor([0.0, 0.5, 1.0, -0.5, 0.2])
    draws = DRAWS[device] * 2 // 3
    torch.manual_seed(0)
    tokens = sk.sample(row.to(device).expand(draws, -1), torch.ones(draws, device=device)).cpu()
    assert set(tokens.tolist()) <= set(cols)
    index = torch.tensor([cols.index(t) for t in tokens.tolist()])
    chi2 = _chi_square(index, torch.softmax(row[cols], dim=-1))
    assert chi2 < CHI2_4_DOF, f"chi-square {chi2:.1f}, counts {torch.bincount(index).tolist()}"


@on_devices
def test_each_call_draws_anew_and_a_torch_seed_repeats_a_call(device):
    logits = torch.zeros(16, 1000, device=device)  # uniform: two calls agree on every row with odds 1e-48
    temperatures = torch.ones(16, device=device)
    torch.manual_seed(3)
    first, second = sk.sample(logits, temperatures), sk.sample(logits, temperatures)
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    assert torch.equal(sk.sample(logits, temperatures), first)


@on_devices
def test_the_split_of_a_row_never_changes_the_draw(device):
    vocab = VOCAB[device]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4)).to(device)
    logits[2] = float("-inf")  # all masked at a temperature: token 0 too
    temperatures = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0], device=device)
    drawn = []
    for splits in (1, 2, 3):
        torch.manual_seed(5)
        drawn.append(sk.sample(logits, temperatures, splits))
    assert torch.equal(drawn[0], drawn[1]) and torch.equal(drawn[0], drawn[2])
    assert torch.equal(drawn[0][[1, 4]], logits[[1, 4]].argmax(-1))
    assert drawn[0][2] == 0


@on_devices
def test_strided_rows_and_an_empty_batch(device):
    wide = torch.randn(4, 2 * 700, generator=torch.Generator().manual_seed(6)).to(device)
    logits = wide[:, ::2]  # not contiguous along the vocabulary
    zeros = torch.zeros(4, device=device)
    assert torch.equal(sk.sample(logits, zeros), logits.argmax(-1))
    assert sk.sample(wide[:0], zeros[:0]).shape == (0,)


@triton.jit
def _exponential_kernel(Bits, Out, n, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(Bits + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(Out + offs, sk._exponential_log2e(bits, FAST_LOG), mask=offs < n)


@on_devices
def test_the_noise_is_exponential_to_float_precision_near_zero_too(device):
    """``E = -ln(1 - w)`` for the kernel's ``w`` from given bits, to a relative 1e-4 (the GPU's approximate
    log): also for the smallest ``E`` (``w`` near 0), which decide the race where they fall, and never 0."""
    edges = [0, 1, 2, 3, 2**25 - 2, 2**25 - 1, 2**25, 2**25 + 1, 2**31, 2**32 - 2, 2**32 - 1]
    drawn = torch.randint(0, 2**32, (4000,), generator=torch.Generator().manual_seed(10))
    bits = torch.cat([torch.tensor(edges), drawn])
    out = torch.empty(bits.numel(), device=device)
    grid = (triton.cdiv(bits.numel(), 1024),)
    _exponential_kernel[grid](bits.to(device), out, bits.numel(), BLOCK=1024, FAST_LOG=device == "cuda")
    w = ((bits >> 1).float() + 0.5) * 2.0**-31  # as the kernel rounds it
    expected = -torch.log1p(-w.double()) / math.log(2)
    out = out.cpu().double()
    assert (out > 0).all()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(out), finite)  # w rounded to 1: E = inf, a token that cannot win
    assert torch.allclose(out[finite], expected[finite], rtol=1e-4, atol=0), (out - expected).abs().max()


@pytest.mark.skipif(INTERP, reason="compiles for the GPU")
def test_the_kernels_compile_for_hopper():
    """Without a GPU: Triton compiles both kernels for sm_90 (the H200; the interpreter accepts code the
    compiler refuses). Float32 logits load as 16-byte vectors, and the logs are the approximate one."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx(kernel, pointers: dict, constexprs: dict, aligned: tuple = (), num_warps: int = 1) -> str:
        names = kernel.arg_names
        signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": num_warps}
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    pointers = {"Logits": "*fp32", "Temperatures": "*fp32", "Seed": "*i64", "Out": "*i64",
                "PartBest": "*fp32", "PartIdx": "*i32"}
    code = ptx(sk._sample_kernel, pointers, dict(LANES=1024, SPLIT=True, FAST_LOG=True),
               ("Logits", "n_cols", "stride_row"), num_warps=8)
    assert re.search(r"ld\.global\S*\.v4\.b32", code) and "lg2.approx" in code
    ptx(sk._merge_kernel, {"PartBest": "*fp32", "PartIdx": "*i32", "Out": "*i64"}, dict(SPLITS_PAD=4))


# -- where the sampler takes the kernel ----------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """The sampler on CPU tensors as on CUDA, its kernel replaced by a recorder that returns token 0."""
    calls = []

    def sample(logits, temperatures):
        calls.append(logits)
        return torch.zeros(logits.shape[0], dtype=torch.long)

    monkeypatch.setattr(sampler_module, "use_fused", lambda x: True)
    monkeypatch.setattr(sampler_module, "_kernels", lambda: SimpleNamespace(sample=sample))
    return calls


def test_the_sampler_takes_the_kernel_without_options(kernel_calls):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(7))
    Sampler()(logits, torch.tensor([0.0, 1.0, 0.5]), None, None, [None, None, None])
    Sampler()(logits, torch.tensor([0.0, 1.0, 0.5]))
    assert len(kernel_calls) == 2 and kernel_calls[0] is logits


@pytest.mark.parametrize("option", ["top_k", "top_p", "min_p", "seed", "processing"])
def test_any_option_takes_the_torch_path(kernel_calls, option):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(8))
    temperatures = torch.tensor([0.0, 1.0, 0.5])
    args = dict(top_ks=None, top_ps=None, generators=[None, None, None], min_ps=None, processing=None)
    if option == "top_k":
        args["top_ks"] = torch.tensor([0, 5, 0])
    elif option == "top_p":
        args["top_ps"] = torch.tensor([1.0, 0.9, 1.0])
    elif option == "min_p":
        args["min_ps"] = torch.tensor([0.0, 0.1, 0.0])
    elif option == "seed":
        args["generators"] = [None, torch.Generator().manual_seed(1), None]
    else:  # a bias that makes token 3 every row's argmax
        bias = (torch.arange(3), torch.full((3,), 3), torch.full((3,), 1e4))
        args["processing"] = LogitsProcessing(add=bias)
    sampled = Sampler()(logits, temperatures, **args)
    assert kernel_calls == []
    assert sampled[0] == (3 if option == "processing" else logits[0].argmax())


# -- CUDA only: the sampler's own path, and CUDA graphs ------------------------------------------------------


@pytest.mark.gpu
def test_the_sampler_on_cuda_draws_what_the_kernel_draws():
    logits = torch.randn(32, 151_936, device="cuda", dtype=torch.bfloat16)
    temperatures = torch.rand(32, device="cuda").masked_fill(torch.arange(32, device="cuda") % 4 == 0, 0.0)
    torch.manual_seed(9)
    by_sampler = Sampler()(logits, temperatures, None, None, [None] * 32)
    torch.manual_seed(9)
    assert torch.equal(by_sampler, sk.sample(logits, temperatures))


@pytest.mark.gpu
def test_a_cuda_graph_replays_fresh_draws():
    logits = torch.zeros(256, 151_936, device="cuda")
    logits[:, 17] = 1.0
    temperatures = torch.ones(256, device="cuda")
    temperatures[::2] = 0.0
    sk.sample(logits, temperatures)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sk.sample(logits, temperatures)
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(out.clone())
    assert (replays[0][::2] == 17).all() and (replays[1][::2] == 17).all()
    assert not torch.equal(replays[0][1::2], replays[1][1::2])


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the gpu cases; the subprocess, the interp cases")
def test_sampler_kernels_under_interpreter():
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == 6 + 1 + 1 + 1 + 1 + 1 + 1, tail
