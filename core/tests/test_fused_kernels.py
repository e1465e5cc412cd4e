"""The fused Triton kernels of the small layer ops against the layers' torch code, on fresh random
inputs: on CUDA (``gpu``), and at small sizes under Triton's interpreter in a subprocess on machines
without CUDA. Outputs are NaN-poisoned where the kernels allocate them."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

pytest.importorskip("triton")

from nanovllm.layers import GeluTanhAndMul, GemmaRMSNorm, RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402
from nanovllm.layers import fused_kernels as fk  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
PARAMS = [pytest.param("cuda", dt, id=f"gpu-{str(dt)[6:]}", marks=pytest.mark.gpu) for dt in DTYPES] + [
    pytest.param("cpu", dt, id=f"interp-{str(dt)[6:]}") for dt in (DTYPES if INTERP else [])
]
cases = pytest.mark.parametrize("device,dtype", PARAMS)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _rand(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def _close(out, ref, gen, what, scale=None):
    """Within two ulps of the activation dtype everywhere (ulps of ``scale``, default ``|ref|``); 16-bit
    results on CUDA bit-identical in nearly every element (exp and rsqrt may differ by an ulp). Triton's
    interpreter rounds float32 to bfloat16 toward zero where CUDA rounds to nearest, so there it gets four
    ulps and no exactness."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    dtype, seed = ref.dtype, gen.initial_seed()
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}[dtype]
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (seed {seed})"
    diff = (out - ref).abs()
    if INTERP and dtype == torch.bfloat16:
        ulp *= 2
    scale = ref.abs() if scale is None else scale.float().cpu()
    assert (diff <= 2 * ulp * scale.clamp_min(1.0)).all(), f"{what}: max diff {diff.max():.3g} (seed {seed})"
    if dtype != torch.float32 and not INTERP:
        exact = (diff == 0).float().mean().item()
        assert exact > 0.97, f"{what}: only {exact:.1%} bit-identical (seed {seed})"


@cases
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.parametrize("rows", [5, 37])  # a decode step's few rows (fewer warps a row), a prefill's
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, dtype, hidden, rows, with_residual, gen):
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    norm = norm.to(dtype)
    x = _rand(gen, rows, hidden, dtype=dtype, device="cpu")
    residual = _rand(gen, rows, hidden, dtype=dtype, device="cpu") if with_residual else None
    ref = norm(x, residual)  # CPU tensors: the torch code
    weight = norm.weight.detach().to(device)
    got_res = residual.to(device) if with_residual else None
    got = fk.rms_norm(x.to(device), weight, norm.eps, got_res)
    if with_residual:
        _close(got[0], ref[0], gen, "rms_norm output")
        _close(got[1], ref[1], gen, "rms_norm residual")
        assert got[1] is got_res, "the new residual is written in place"
    else:
        _close(got, ref, gen, "rms_norm")


@cases
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm(device, dtype, with_residual, gen):
    """Gemma's norm (``1 + weight`` in float32, one rounding) against :class:`GemmaRMSNorm`'s torch code,
    at Gemma 3 270M's width, and the layer itself taking the kernel on CUDA."""
    hidden = 640
    norm = GemmaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(hidden, generator=gen))
    norm = norm.to(dtype)
    x = _rand(gen, 37, hidden, dtype=dtype, device="cpu") * 3
    residual = _rand(gen, 37, hidden, dtype=dtype, device="cpu") if with_residual else None
    ref = norm(x, residual)  # CPU tensors: the torch code
    weight = norm.weight.detach().to(device)
    got_res = residual.to(device) if with_residual else None
    got = fk.rms_norm(x.to(device), weight, norm.eps, got_res, unit_offset=True)
    if with_residual:
        _close(got[0], ref[0], gen, "Gemma rms_norm output")
        _close(got[1], ref[1], gen, "Gemma rms_norm residual")
    else:
        _close(got, ref, gen, "Gemma rms_norm")
    if device == "cuda":
        layer = norm.to(device)(x.to(device), residual.to(device) if with_residual else None)
        assert torch.equal(layer[0] if with_residual else layer, got[0] if with_residual else got)


@cases
def test_silu_and_mul(device, dtype, gen):
    x = _rand(gen, 29, 2 * 1500, dtype=dtype, device="cpu") * 3
    ref = SiluAndMul()(x)
    _close(fk.silu_and_mul(x.to(device)), ref, gen, "silu_and_mul")


@cases
def test_gelu_tanh_and_mul(device, dtype, gen):
    x = _rand(gen, 29, 2 * 1500, dtype=dtype, device="cpu") * 3
    x[0, :40] = torch.tensor([0.0, 1e-4, -1e-4, 12.0, -12.0, 40.0, -40.0, 0.5] * 5, dtype=dtype)  # tanh's ends
    ref = GeluTanhAndMul()(x)
    _close(fk.gelu_tanh_and_mul(x.to(device)), ref, gen, "gelu_tanh_and_mul")


def _qk_norms(kind, head_dim, dtype, gen):
    """A query norm and a key norm as a model's q/k norms: ``"plain"`` RMSNorms with weights near one
    (Qwen3), ``"gemma"`` ones scaling by one plus weights near zero (Gemma 3); ``None``: no norms."""
    if kind is None:
        return None, None
    norm_cls, offset = {"plain": (RMSNorm, 1.0), "gemma": (GemmaRMSNorm, 0.0)}[kind]
    norms = tuple(norm_cls(head_dim, eps=1e-6).to(dtype) for _ in range(2))
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(offset + 0.1 * torch.randn(head_dim, generator=gen))
    return norms


def _kernel_norms(norms, device):
    """The kernel's ``(weight, eps)`` pairs of ``_qk_norms``' norms, and its ``unit_offset``."""
    if norms[0] is None:
        return (None, None), False
    return tuple((n.weight.detach().to(device), n.eps) for n in norms), isinstance(norms[0], GemmaRMSNorm)


@cases
# (256, 4, 1): Gemma 3 270M's heads and norms
@pytest.mark.parametrize("head_dim,heads,kv_heads,qk_norm",
                         [(128, 16, 8, "plain"), (64, 6, 2, None), (32, 4, 1, "plain"), (256, 4, 1, "gemma")])
@pytest.mark.parametrize("t", [23, fk.ROPE_WIDE_MAX_TOKENS + 44])  # a decode step's launch, a prefill's
def test_rope_in_place(device, dtype, head_dim, heads, kv_heads, qk_norm, t, gen):
    if device == "cpu" and t > fk.ROPE_WIDE_MAX_TOKENS:
        pytest.skip("the interpreter runs any number of warps alike")
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0)
    qkv = _rand(gen, t, heads + 2 * kv_heads, head_dim, dtype=dtype, device="cpu")
    positions = torch.randint(0, 4096, (t,), generator=gen)
    norms = _qk_norms(qk_norm, head_dim, dtype, gen)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    ref_q, ref_k = rope(positions, q.clone(), k.clone(), *norms)

    dev_qkv = qkv.to(device)
    dq, dk = dev_qkv[:, :heads], dev_qkv[:, heads : heads + kv_heads]
    dev_norms, unit_offset = _kernel_norms(norms, device)
    v_before = dev_qkv[:, heads + kv_heads :].clone()
    out_q, out_k = fk.rope_(dq, dk, positions.to(device), rope.cos_sin.to(device), *dev_norms,
                            unit_offset=unit_offset)
    assert out_q.data_ptr() == dq.data_ptr() and out_k.data_ptr() == dk.data_ptr(), "rotated in place"
    # An output mixes a pair (x1 cos - x2 sin): its rounding error scales with the pair's norm, which the
    # rotation keeps, not with the output itself (which can cancel to near zero).
    _close(out_q, ref_q, gen, "rope q", _pair_norm(ref_q))
    _close(out_k, ref_k, gen, "rope k", _pair_norm(ref_k))
    assert torch.equal(dev_qkv[:, heads + kv_heads :], v_before), "v is left alone"


@cases
@pytest.mark.parametrize("head_dim,heads,kv_heads,qk_norm",
                         [(128, 16, 8, "plain"), (64, 6, 2, None), (256, 4, 1, "gemma")])
def test_rope_stores_the_rotated_keys_and_the_values(device, dtype, head_dim, heads, kv_heads, qk_norm, gen):
    """With ``store``, RoPE's kernel also writes each token's rotated keys and its values to its slot of the
    paged caches, as the torch path's :class:`~nanovllm.kv.store.CacheSlots` write does: tokens in shuffled
    slots of several blocks, two of them with slot -1 (not written). The caches start NaN-poisoned."""
    from nanovllm.kv.store import CacheSlots

    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0)
    t, block_size, num_blocks = 23, 16, 3
    qkv = _rand(gen, t, heads + 2 * kv_heads, head_dim, dtype=dtype, device="cpu")
    positions = torch.randint(0, 4096, (t,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[torch.randperm(t, generator=gen)[:2]] = -1
    norms = _qk_norms(qk_norm, head_dim, dtype, gen)

    def caches(on):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        poison = torch.full(shape, float("nan"), dtype=dtype, device=on)
        return CacheSlots(poison, poison.clone(), slots.to(on))

    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    ref = caches("cpu")
    ref_q, ref_k = rope(positions, q.clone(), k.clone(), *norms, v, ref)  # CPU tensors: the torch code

    dev_qkv = qkv.to(device)
    dq, dk, dv = dev_qkv.split([heads, kv_heads, kv_heads], dim=1)
    dev_norms, unit_offset = _kernel_norms(norms, device)
    got = caches(device)
    out_q, out_k = fk.rope_(dq, dk, positions.to(device), rope.cos_sin.to(device), *dev_norms,
                            (dv, got.k_cache, got.v_cache, got.slot_mapping), unit_offset)
    _close(out_q, ref_q, gen, "rope q", _pair_norm(ref_q))
    _close(out_k, ref_k, gen, "rope k", _pair_norm(ref_k))
    written = slots >= 0
    flat_k, flat_v = (c.view(-1, kv_heads, head_dim).cpu() for c in (got.k_cache, got.v_cache))
    assert torch.equal(flat_k[slots[written]], out_k[written].cpu()), "the rotated keys, at their slots"
    assert torch.equal(flat_v[slots[written]], v[written]), "the values as they are, at their slots"
    unwritten = torch.ones(flat_k.shape[0], dtype=torch.bool)
    unwritten[slots[written]] = False
    assert flat_k[unwritten].isnan().all() and flat_v[unwritten].isnan().all(), "nothing else written"
    ref_flat = ref.k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(ref_flat.isnan(), flat_k.isnan()), "the torch write fills the same slots"
    if device == "cuda":  # the layer takes the kernel: the same bits
        layer_cache = caches(device)
        lq, lk, lv = qkv.to(device).split([heads, kv_heads, kv_heads], dim=1)
        layer_norms = tuple(n.to(device) if n else n for n in norms)
        rope.to(device)(positions.to(device), lq, lk, *layer_norms, lv, layer_cache)
        assert torch.equal(layer_cache.k_cache.nan_to_num(), got.k_cache.nan_to_num())
        assert torch.equal(layer_cache.v_cache.nan_to_num(), got.v_cache.nan_to_num())


@cases
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("with_residual", [False, True])
def test_all_reduce_rms_norm(device, dtype, world, with_residual, gen):
    """The fused all-reduce and RMSNorm against the sum of every rank's share then the torch norm, as rank 1
    of ``world`` simulated ones: the other ranks' shares are already in its buffer (``sync=False``; the
    ranks' flags are the next test's part), and it writes its own into every rank's. Three calls of 37 rows,
    then one of 5: the slot alternates, each program takes several rows, and with fewer rows than programs
    only the programs with a row count the call."""
    hidden, offset, slot = 1000, 96, 40_000
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    norm = norm.to(dtype)
    weight = norm.weight.detach().to(device)
    buffers = [torch.full((offset + 2 * world * slot,), float("nan"), dtype=dtype, device=device)
               for _ in range(world)]
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
    epochs = torch.zeros(8, dtype=torch.int32, device=device)
    for call, rows in enumerate([37, 37, 37, 5]):
        shares = [_rand(gen, rows, hidden, dtype=dtype, device="cpu") for _ in range(world)]
        # the region of rank r in this call's slot (every program with a row has made every call here)
        start = [offset + ((call + 1) % 2 * world + r) * slot for r in range(world)]
        for r in (0, 2):
            if r < world:
                buffers[1][start[r] : start[r] + rows * hidden] = shares[r].flatten().to(device)
        residual = _rand(gen, rows, hidden, dtype=dtype, device="cpu") if with_residual else None
        total = shares[0].float()
        for share in shares[1:]:  # in rank order, in float32, as each rank sums
            total = total + share.float()
        # The interpreter rounds the sum to bfloat16 toward zero. The residual can cancel most of the sum,
        # which makes an ulp of the sum many ulps of the output: round it here as the kernel does.
        if INTERP and dtype == torch.bfloat16:
            total = (total.view(torch.int32) & -65536).view(torch.float32)
        total = total.to(dtype)
        ref = norm(total, None if residual is None else residual.clone())
        got_res = None if residual is None else residual.to(device)
        got = fk.all_reduce_rms_norm(shares[1].to(device), weight, norm.eps, got_res, addresses, epochs, 1,
                                     offset, slot, 0, timeout_s=60, sync=False)
        if with_residual:
            _close(got[0], ref[0], gen, f"all_reduce_rms_norm output, call {call}")
            _close(got[1], ref[1], gen, f"all_reduce_rms_norm residual, call {call}")
            assert got[1] is got_res, "the new residual is written in place"
        else:
            _close(got, ref, gen, f"all_reduce_rms_norm, call {call}")
        counted = [call + 1] * min(rows, 8) + [call] * max(0, 8 - rows)
        assert epochs.tolist() == counted, "each program with a row counts the call"
        for b in buffers:
            assert torch.equal(b[start[1] : start[1] + rows * hidden].cpu(), shares[1].flatten()), \
                "this rank's share is in its region of the call's slot, in every rank's buffer"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_rms_norm_ranks_wait_for_each_other(world, gen):
    """The flags for real: ``world`` ranks simulated on streams of one GPU, 40 calls of 1 to 7 rows launched
    with no synchronisation between them and one rank held back at random before each
    (``torch.cuda._sleep``), so a rank writes its next share while a slower one still reads this one (the
    two slots), and waits for the others. Every rank gets the same bits, the sum's norm, on every call."""
    hidden, offset, slot, dtype = 512, 64, 4096, torch.bfloat16
    flags = (offset + 2 * world * slot) * dtype.itemsize
    buffers = [torch.zeros(offset + 2 * world * slot + 64, dtype=dtype, device="cuda") for _ in range(world)]
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    epochs = [torch.zeros(4, dtype=torch.int32, device="cuda") for _ in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).cuda()
    norm = RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight.cpu())
    rows = [1 + call % 7 for call in range(40)]  # 1 to 7 rows on 4 programs: their counts part and meet
    calls = [([_rand(gen, n, hidden, dtype=dtype, device="cuda") for _ in range(world)],
              _rand(gen, n, hidden, dtype=dtype, device="cuda")) for n in rows]
    # CUDA loads a kernel at its first launch, which waits for the GPU: behind a kernel that spins, forever.
    # So every kernel of the loop runs once first, each rank's fused one with its flags already set.
    torch.cuda._sleep(1)
    for r in range(world):
        for b in buffers:
            b.view(torch.uint8)[flags:].view(torch.int32).fill_(1 << 20)
        fk.all_reduce_rms_norm(calls[0][0][r], weight, 1e-6, calls[0][1].clone(), addresses,
                               torch.zeros_like(epochs[r]), r, offset, slot, flags, timeout_s=60)
        torch.cuda.synchronize()
    for b in buffers:
        b.view(torch.uint8)[flags:].zero_()
    torch.cuda.synchronize()
    outputs = []
    for share, residual in calls:  # no synchronisation between calls: only the flags order the ranks
        late = int(torch.randint(0, world, (1,), generator=gen))
        out = []
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                if r == late:
                    torch.cuda._sleep(int(torch.randint(0, 200_000, (1,), generator=gen)))
                out.append(fk.all_reduce_rms_norm(share[r], weight, 1e-6, residual.clone(), addresses,
                                                  epochs[r], r, offset, slot, flags, timeout_s=60))
        outputs.append(out)
    torch.cuda.synchronize()
    for call, (out, (share, residual)) in enumerate(zip(outputs, calls, strict=True)):
        total = torch.stack(share).float().sum(0).to(dtype).cpu()
        ref = norm(total, residual.cpu())
        for r in range(world):
            same = torch.equal(out[r][0], out[0][0]) and torch.equal(out[r][1], out[0][1])
            assert same, f"rank {r} differs from rank 0 on call {call}"
        _close(out[0][0], ref[0], gen, f"call {call} output")
        _close(out[0][1], ref[1], gen, f"call {call} residual")
    counted = [sum(n > p for n in rows) for p in range(4)]
    assert all(e.tolist() == counted for e in epochs)


TRAPS = """
import torch
from nanovllm.layers import fused_kernels as fk
buffers = [torch.zeros(4096, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
x = torch.ones(1, 256, dtype=torch.bfloat16, device="cuda")
fk.all_reduce_rms_norm(x, x[0], 1e-6, None, addresses, torch.zeros(2, dtype=torch.int32, device="cuda"), 0,
                       0, 256, 4096, timeout_s=0.5)
print("launched", flush=True)
torch.cuda.synchronize()
print("returned", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_all_reduce_rms_norm_traps_when_a_rank_never_comes():
    """Rank 0 of two, alone: its kernel gives up after its timeout and the process fails, instead of
    hanging (in a process of its own: a trap ends the CUDA context)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TRAPS], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["launched"] and done.returncode != 0, done.stdout + done.stderr[-2000:]
    assert "CUDA" in done.stderr, done.stderr[-2000:]


def _pair_norm(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x1^2 + x2^2)`` of the rotated pairs ``(x[..., i], x[..., i + D/2])``, at both positions."""
    x1, x2 = x.float().chunk(2, dim=-1)
    norm = (x1 * x1 + x2 * x2).sqrt()
    return torch.cat([norm, norm], dim=-1)


@cases
def test_l2_prefetch_reads_the_first_bytes_and_changes_nothing(device, dtype, gen):
    """The prefetch kernel changes no value, so it has no torch counterpart: each program's sum must be the
    sum of its 16 KiB of the first ``n_bytes`` (so it read those, and nothing past them); the tensor stays."""
    w = _rand(gen, 9, 2048, dtype=dtype, device=device)
    before = w.clone()
    n_bytes = w.numel() * w.element_size() * 2 // 3 + 2  # a part, its end not on a word
    sink = torch.full((8,), 7, dtype=torch.int32, device=device)
    fk.l2_prefetch(w, n_bytes, sink)
    assert torch.equal(w, before)
    words = w.reshape(-1).view(torch.uint8)[: n_bytes - n_bytes % 4].view(torch.int32).cpu().long()
    sums = [(int(chunk.sum()) + 2**31) % 2**32 - 2**31 for chunk in words.split(4096)]  # int32 wrap-around
    assert len(sums) > 1
    assert sink.cpu().tolist() == sums + [7] * (8 - len(sums))
    with pytest.raises(ValueError, match="prefetch fewer bytes"):
        fk.l2_prefetch(w, n_bytes, sink[:1])


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the gpu cases; the subprocess, the interp cases")
def test_fused_kernels_under_interpreter():
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == len(DTYPES) * (12 + 2 + 1 + 1 + 4 + 3 + 4 + 1), tail
