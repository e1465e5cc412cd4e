"""Sliding-window attention in the backends: the ``torch`` reference against a brute-force masked
softmax, and the Triton kernels against the reference at every chunk boundary.

A window ``W`` lets the query at position ``p`` see keys ``p - W + 1 .. p`` (transformers' sliding
window). Every case also fills the cache blocks that lie wholly before the first key tile any query's
window reaches with NaN: a kernel that read them (masking rather than skipping them) fails. On CUDA the
cases run at GPU sizes (``gpu`` marker), head sizes 128 and 256 included; without CUDA a subprocess runs
this file's ``interp`` cases under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import pytest
import torch

from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
INTERP_TILE = 16  # the interpreter's key tile (triton_kernels._prefill_config / _decode_config)

# (dtype, head_dim, group, block_size, window)
GPU_CONFIGS = [
    (torch.bfloat16, 256, 4, 16, 512), (torch.bfloat16, 256, 1, 256, 100), (torch.float16, 128, 2, 16, 37),
    (torch.bfloat16, 64, 8, 16, 1), (torch.float32, 256, 2, 16, 300),
]
INTERP_CONFIGS = [
    (torch.float32, 32, 2, 8, 5), (torch.bfloat16, 64, 1, 16, 16), (torch.float16, 32, 4, 16, 23),
    (torch.float32, 256, 2, 8, 12),
]
# (query length, context length) per sequence: fresh prompts, later chunks behind a history many windows
# long (a prefix hit or an earlier chunk), a one-token chunk, chunks shorter than the window
GPU_PREFILL = [(300, 300), (77, 2000), (1, 700), (129, 385), (600, 1100)]
INTERP_PREFILL = [(20, 20), (7, 60), (1, 41), (17, 50), (40, 90)]
GPU_DECODE = [1, 17, 513, 1000, 4097]
INTERP_DECODE = [1, 5, 17, 70, 33]


def _cfg_id(c) -> str:
    dt, d, g, bs, w = c
    return f"{str(dt).removeprefix('torch.')}-d{d}-g{g}-bs{bs}-w{w}"


PARAMS = [pytest.param("cuda", *c, id="gpu-" + _cfg_id(c), marks=pytest.mark.gpu) for c in GPU_CONFIGS] + [
    pytest.param("cpu", *c, id="interp-" + _cfg_id(c)) for c in (INTERP_CONFIGS if INTERP else [])
]
cases = pytest.mark.parametrize("device,dtype,head_dim,group,block_size,window", PARAMS)


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)  # the seed is in every failure message


class Case:
    """Random paged KV for a batch, blocks shuffled in a pool, tables padded with -1; the new tokens are
    stored in the cache as the attention layer stores them."""

    def __init__(self, q_lens, ctx_lens, dtype, head_dim, group, block_size, device, gen, num_kv_heads=2):
        self.scale = head_dim**-0.5
        self.block_size = block_size
        nblk = [-(-c // block_size) for c in ctx_lens]
        total = sum(nblk) + 2
        perm = torch.randperm(total, generator=gen)
        tables = torch.full((len(q_lens), max(nblk) + 1), -1, dtype=torch.int32)
        i = 0
        for j, n in enumerate(nblk):
            tables[j, :n] = perm[i : i + n].int()
            i += n

        def rnd(*shape):
            return torch.randn(*shape, generator=gen).to(dtype).to(device)

        self.k_cache = rnd(total, block_size, num_kv_heads, head_dim)
        self.v_cache = rnd(total, block_size, num_kv_heads, head_dim)
        t = sum(q_lens)
        self.q = rnd(t, num_kv_heads * group, head_dim) * 2
        self.k, self.v = rnd(t, num_kv_heads, head_dim), rnd(t, num_kv_heads, head_dim)
        slots = [int(tables[j, p // block_size]) * block_size + p % block_size
                 for j in range(len(q_lens)) for p in range(ctx_lens[j] - q_lens[j], ctx_lens[j])]
        TorchBackend().store_kv(self.k, self.v, self.k_cache, self.v_cache,
                                torch.tensor(slots, dtype=torch.long, device=device))
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        self.meta = PhaseMetadata(cu, lens, tables.to(device), max(q_lens), max(ctx_lens))
        self.q_lens, self.ctx_lens, self.tables = q_lens, ctx_lens, tables

    def brute_force(self, window: int) -> torch.Tensor:
        """Each query row over its sequence's keys, masked causally and by the window, one softmax."""
        out, row = [], 0
        for j, (n, ctx) in enumerate(zip(self.q_lens, self.ctx_lens, strict=True)):
            phys = self.tables[j, : -(-ctx // self.block_size)].long().to(self.k_cache.device)
            k = self.k_cache[phys].flatten(0, 1)[:ctx].float()  # [ctx, Hkv, D]
            v = self.v_cache[phys].flatten(0, 1)[:ctx].float()
            q = self.q[row : row + n].float()
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = torch.arange(ctx - n, ctx)[:, None]
            k_pos = torch.arange(ctx)[None, :]
            seen = (k_pos <= q_pos) & (k_pos > q_pos - window)
            probs = scores.masked_fill(~seen.to(scores.device), float("-inf")).softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", probs, v))
            row += n
        return torch.cat(out).to(self.q.dtype)

    def poison_before(self, first_seen: list[int], tile: int) -> None:
        """NaN into every block of sequence ``j`` that lies wholly before the key tile holding position
        ``first_seen[j]``: the kernels must never read those pages."""
        for j, pos in enumerate(first_seen):
            start = pos // tile * tile
            for b in range(start // self.block_size):
                self.k_cache[int(self.tables[j, b])] = float("nan")
                self.v_cache[int(self.tables[j, b])] = float("nan")


def _check(out, ref, dtype, what, gen):
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output (seed {gen.initial_seed()})"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert err < TOL[dtype], f"{what}: relative error {err:.2e} (seed {gen.initial_seed()})"


def test_torch_reference_is_the_masked_softmax():
    """The oracle itself: the torch backend's windowed prefill and decode against brute force, with
    windows smaller and larger than a block, and a window that covers everything (equal to no window)."""
    gen = torch.Generator().manual_seed(0)
    c = Case([20, 7, 1, 17], [20, 60, 41, 50], torch.float32, 16, 2, 8, "cpu", gen)
    args = (c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    for window in (1, 5, 8, 13, 100):
        _check(TorchBackend().prefill(*args, window=window), c.brute_force(window), torch.float32,
               f"torch prefill, window {window}", gen)
    assert torch.allclose(TorchBackend().prefill(*args, window=100), TorchBackend().prefill(*args))
    assert not torch.allclose(TorchBackend().prefill(*args, window=13), TorchBackend().prefill(*args))
    d = Case([1] * 4, [1, 9, 30, 64], torch.float32, 16, 2, 8, "cpu", gen)
    for window in (1, 6, 16):
        _check(TorchBackend().decode(d.q, d.k_cache, d.v_cache, d.meta, d.scale, window=window),
               d.brute_force(window), torch.float32, f"torch decode, window {window}", gen)


def _tile(device, dtype, head_dim, max_query_len: int | None = None) -> int:
    """The key tile of the prefill kernel (``max_query_len`` given) or of the decode kernel: the kernels
    read whole tiles, so pages before the tile holding a window's first key may be poisoned."""
    if device != "cuda":
        return INTERP_TILE
    from nanovllm.attention import triton_kernels as tk

    if max_query_len is None:
        return tk._decode_config(head_dim, dtype, torch.device(device), 16)[0]
    return tk._prefill_config(head_dim, dtype, torch.device(device), max_query_len)[1]


@cases
def test_prefill_window(device, dtype, head_dim, group, block_size, window, gen):
    """Chunks at every kind of boundary (fresh, behind a long history, one token) through the paged
    kernel, against the reference; blocks before each chunk's first window never read."""
    from nanovllm.attention import triton_backend as tb

    lens = GPU_PREFILL if device == "cuda" else INTERP_PREFILL
    c = Case([q for q, _ in lens], [k for _, k in lens], dtype, head_dim, group, block_size, device, gen)
    args = (c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    ref = TorchBackend().prefill(*args, window=window)
    tile = _tile(device, dtype, head_dim, c.meta.max_query_len)
    c.poison_before([max(k - q - window + 1, 0) for q, k in lens], tile)
    _check(tb.TritonBackend().prefill(*args, window=window), ref, dtype, "windowed prefill", gen)


@cases
def test_prefill_fresh_window(device, dtype, head_dim, group, block_size, window, gen):
    """One sequence with nothing cached: the kernel over the dense new keys (SDPA takes no window)."""
    from nanovllm.attention import triton_backend as tb

    n = 700 if device == "cuda" else 45
    c = Case([n], [n], dtype, head_dim, group, block_size, device, gen)
    # as in a model that norms k and not v: k contiguous, v a view into the wider projection output
    v = torch.cat([c.v, torch.full_like(c.v, float("nan"))], dim=-1)[..., :head_dim]
    args = (c.q, c.k, v, c.k_cache, c.v_cache, c.meta, c.scale)
    ref = TorchBackend().prefill(*args, window=window)
    _check(tb.TritonBackend().prefill(*args, window=window), ref, dtype, "windowed fresh prefill", gen)


@cases
def test_decode_window(device, dtype, head_dim, group, block_size, window, gen):
    """Decode over contexts shorter and many times longer than the window, in one split and several;
    the pages before the window are never read."""
    from nanovllm.attention import triton_backend as tb
    from nanovllm.attention import triton_kernels as tk

    ctx = GPU_DECODE if device == "cuda" else INTERP_DECODE
    c = Case([1] * len(ctx), ctx, dtype, head_dim, group, block_size, device, gen)
    ref = TorchBackend().decode(c.q, c.k_cache, c.v_cache, c.meta, c.scale, window=window)
    c.poison_before([max(n - window, 0) for n in ctx], _tile(device, dtype, head_dim))
    out = tb.TritonBackend().decode(c.q, c.k_cache, c.v_cache, c.meta, c.scale, window=window)
    _check(out, ref, dtype, "windowed decode", gen)
    for splits in (1, 3):
        out = torch.full_like(c.q, float("nan"))
        tk.attention_decode(c.q, c.k_cache, c.v_cache, out, None, c.meta.context_lens, c.meta.block_tables,
                            None, c.meta.max_context_len, c.scale, num_splits=splits, window=window)
        _check(out, ref, dtype, f"windowed decode ({splits} splits)", gen)


@pytest.mark.gpu
def test_decode_window_cuda_graph(gen):
    """Windowed decode captured once at head size 256, replayed with other lengths and tables."""
    from nanovllm.attention import triton_backend as tb

    dtype, device, group, head_dim, kv_heads, block_size, window = torch.bfloat16, "cuda", 4, 256, 1, 16, 512
    max_len, bs = 5000, 6
    pool = -(-max_len // block_size) * bs + 4
    backend = tb.TritonBackend()
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q = torch.empty(bs, kv_heads * group, head_dim, dtype=dtype, device=device)
    lens = torch.ones(bs, dtype=torch.int32, device=device)
    tables = torch.zeros(bs, -(-max_len // block_size), dtype=torch.int32, device=device)
    meta = PhaseMetadata(torch.arange(bs + 1, dtype=torch.int32, device=device), lens, tables, 1, max_len)
    scale = head_dim**-0.5
    backend.decode(q, k_cache, v_cache, meta, scale, window=window)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, meta, scale, window=window)
    for _ in range(2):
        new_lens = torch.randint(1, max_len + 1, (bs,), generator=gen)
        new_lens[0] = max_len
        lens.copy_(new_lens)
        tables.copy_(torch.randperm(pool, generator=gen)[: tables.numel()].view_as(tables).int())
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        ref = TorchBackend().decode(q, k_cache, v_cache, meta, scale, window=window)
        _check(out, ref, dtype, "windowed decode in a CUDA graph", gen)


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the gpu cases; the subprocess, the cases")
def test_window_kernels_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    pytest.importorskip("triton")
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == 3 * len(INTERP_CONFIGS), tail
