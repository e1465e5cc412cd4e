"""The split-KV decode's reduce fused into the decode kernel (the last split of each sequence and KV head to
finish merges them all, by a ticket counter) against the ``torch`` reference and the separate reduce kernel:
split counts from two to more than the merge's chunk (empty splits included), GQA groups, head dims 64, 128
and 256, sliding windows, selections per KV head (rows that select nothing), the log-sum-exp written or not,
and every ticket counter back at zero after each launch. On a machine without CUDA the ``interp`` cases run
under Triton's interpreter in a subprocess; on CUDA they run on the GPU, with CUDA-graph cases besides."""

from __future__ import annotations

import os

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.testing import PagedBatch, assert_interpreter_cases_pass

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
KERNELS = pytest.mark.gpu if CUDA else pytest.mark.skipif(not INTERP, reason="in the interpreter's run")

pytest.importorskip("triton")

from nanovllm.attention import triton_kernels as tk  # noqa: E402

TOL, LSE_TOL = 2e-2, 2e-3  # bfloat16 inputs
# (head dim, GQA group); two KV heads each
SHAPES = [(64, 1), (128, 4), (256, 8)]
CONTEXTS = [70, 33, 1] if INTERP else [4097, 1000, 1, 300]
# 2 and 3 splits; more splits than key tiles (empty ones); more than one chunk of the fused merge
SPLITS = (2, 3, 9) if INTERP else (2, 3, 40)
WINDOW = 20 if INTERP else 700


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.fixture
def reduce_launches(monkeypatch):
    """The separate reduce kernel's launches, counted."""
    launches = []
    kernel = tk._reduce_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tk, "_reduce_kernel", Counted())
    return launches


def batch(head_dim: int, group: int, gen) -> tuple[PagedBatch, PhaseMetadata]:
    """A decode batch (its caches hold NaN in every slot no context owns, its tables garbage past each
    sequence's blocks) and the reference's metadata (tables without the garbage, which it would gather)."""
    b = PagedBatch([(1, c) for c in CONTEXTS], 2, group, head_dim, 16, torch.bfloat16, DEVICE, gen)
    tables = torch.where(b.tables < b.k_cache.shape[0], b.tables, -1)
    rows = torch.arange(len(CONTEXTS) + 1, dtype=torch.int32, device=DEVICE)
    return b, PhaseMetadata(rows, b.ctx, tables, 1, max(CONTEXTS))


def decode(b: PagedBatch, splits: int, fused: bool, lse: bool, rows: int = len(CONTEXTS),
           sel: torch.Tensor | None = None, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for the first ``rows`` sequences into NaN-poisoned outputs; afterwards every ticket
    counter of the device is zero."""
    q = b.q[:rows]
    out = torch.full_like(q, float("nan"))
    lse_t = torch.full(q.shape[:2], float("nan"), device=DEVICE) if lse else None
    cfg = tk._decode_config(q.shape[-1], q.dtype, q.device, 16)._replace(fused_reduce=fused)
    tk.attention_decode(q, b.k_cache, b.v_cache, out, lse_t, b.ctx[:rows], b.tables[:rows], sel,
                        max(CONTEXTS), b.scale, num_splits=splits, config=cfg, window=window)
    tickets = tk.decode_tickets(q.device)
    assert tickets is not None and not tickets.any(), "a ticket counter was left above zero"
    return out, lse_t


def check(out, ref, what: str, gen) -> None:
    assert torch.isfinite(out).all(), f"{what}: unwritten or non-finite output (seed {gen.initial_seed()})"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL, f"{what}: relative error {err:.2e} (seed {gen.initial_seed()})"


def check_lse(lse, ref, what: str, gen) -> None:
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), f"{what}: rows without keys differ"
    fin = torch.isfinite(ref)
    err = (lse[fin] - ref[fin]).abs().max().item()
    assert err < LSE_TOL, f"{what}: lse error {err:.2e} (seed {gen.initial_seed()})"


@KERNELS
@pytest.mark.parametrize("head_dim,group", SHAPES, ids=[f"d{d}-g{g}" for d, g in SHAPES])
def test_interp_fused_reduce_whole_contexts(head_dim, group, gen, reduce_launches):
    b, meta = batch(head_dim, group, gen)
    every_block = torch.arange(meta.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    every_block = torch.where(meta.block_tables >= 0, every_block, -1)
    ref, ref_lse = TorchBackend().attend_blocks(b.q, b.k_cache, b.v_cache, meta, every_block, b.ctx, b.scale)
    for splits, lse in zip(SPLITS, (False, True, True), strict=True):
        out, lse_t = decode(b, splits, True, lse)
        check(out, ref, f"fused, {splits} splits", gen)
        if lse:
            check_lse(lse_t, ref_lse, f"fused, {splits} splits", gen)
    assert not reduce_launches, "the fused reduce launched the reduce kernel"
    again, again_lse = decode(b, splits, True, True)  # the counters start from zero again
    assert torch.equal(again, out) and torch.equal(again_lse, lse_t), "a second launch differs"
    separate, separate_lse = decode(b, splits, False, True)
    assert len(reduce_launches) == 1, "the separate reduce runs once"
    check(separate, ref, f"separate, {splits} splits", gen)
    check_lse(separate_lse, ref_lse, f"separate, {splits} splits", gen)


@KERNELS
@pytest.mark.parametrize("head_dim,group", SHAPES, ids=[f"d{d}-g{g}" for d, g in SHAPES])
def test_interp_fused_reduce_window_and_selection(head_dim, group, gen):
    b, meta = batch(head_dim, group, gen)
    ref = TorchBackend().decode(b.q, b.k_cache, b.v_cache, meta, b.scale, window=WINDOW)
    out, lse = decode(b, SPLITS[1], True, True, window=WINDOW)
    check(out, ref, f"fused, window {WINDOW}", gen)
    _, separate_lse = decode(b, SPLITS[1], False, True, window=WINDOW)
    check_lse(lse, separate_lse, f"fused against separate, window {WINDOW}", gen)

    # one list per KV head, shuffled, -1 padded; the first sequence's first KV head selects nothing
    blocks = [-(-c // 16) for c in CONTEXTS]
    sel = torch.full((len(CONTEXTS), 2, max(blocks) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(blocks):
        for h in range(2):
            if s == h == 0:
                continue
            chosen = torch.randperm(n, generator=gen)[: max(1, (2 * n + 2) // 3)]
            sel[s, h, torch.randperm(sel.shape[2], generator=gen)[: chosen.numel()]] = chosen.int()
    sel = sel.to(DEVICE)
    ref, ref_lse = TorchBackend().attend_blocks(b.q, b.k_cache, b.v_cache, meta, sel, b.ctx, b.scale)
    for splits in (SPLITS[0], SPLITS[-1]):
        out, lse = decode(b, splits, True, True, sel=sel)
        check(out, ref, f"fused, selection, {splits} splits", gen)
        check_lse(lse, ref_lse, f"fused, selection, {splits} splits", gen)
        assert torch.all(out[0, :group] == 0), "a row that selects nothing gets 0"


def test_tickets_are_one_zeroed_buffer_per_device_grown_on_demand(monkeypatch):
    monkeypatch.setattr(tk, "_tickets", {})
    monkeypatch.setattr(tk, "_outgrown_tickets", [])
    cpu = torch.device("cpu")
    first = tk.decode_tickets(cpu, 8)
    assert first.dtype == torch.int32 and first.numel() >= max(8, tk.MIN_TICKETS) and not first.any()
    assert tk.decode_tickets(cpu, first.numel()) is first, "reused while large enough"
    grown = tk.decode_tickets(cpu, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    assert tk.decode_tickets(cpu) is grown
    # a CUDA graph captured on the first buffer may still replay: it is kept
    assert any(t is first for t in tk._outgrown_tickets)


@KERNELS
def test_interp_fused_reduce_shares_the_counters_across_batches(gen):
    """Launches of different batch sizes, one after the other, on the one buffer of counters."""
    b, meta = batch(128, 2, gen)
    ref = TorchBackend().decode(b.q, b.k_cache, b.v_cache, meta, b.scale)
    for rows in (len(CONTEXTS), 2, len(CONTEXTS)):
        out, _ = decode(b, 3, True, False, rows=rows)
        check(out, ref[:rows], f"fused, {rows} sequences", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
def test_fused_reduce_in_cuda_graphs(block_size, gen, monkeypatch, reduce_launches):
    """A graph captured with counters large enough uses them at every replay, and still does after the
    counters grow outside it; a capture that would need more counters reduces with the separate kernel."""
    monkeypatch.setattr(tk, "_tickets", {})
    monkeypatch.setattr(tk, "_outgrown_tickets", [])
    monkeypatch.setattr(tk, "MIN_TICKETS", 8)
    dtype, kv_heads, group, head_dim, max_len = torch.bfloat16, 2, 4, 128, 5000
    bs_small, bs_large = 4, 6  # 8 counters, then 12
    pool = -(-max_len // block_size) * bs_large + 4
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).to("cuda")
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).to("cuda")
    q = torch.empty(bs_large, kv_heads * group, head_dim, dtype=dtype, device="cuda")
    lens = torch.ones(bs_large, dtype=torch.int32, device="cuda")
    tables = torch.zeros(bs_large, -(-max_len // block_size), dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def launch(bs, fused_reduce=True):
        cfg = tk._decode_config(head_dim, dtype, q.device, block_size)._replace(fused_reduce=fused_reduce)
        tk.attention_decode(q[:bs], k_cache, v_cache, out[:bs], None, lens[:bs], tables[:bs], None, max_len,
                            scale, config=cfg)

    launch(bs_large, fused_reduce=False)  # compiles the separate reduce's kernels outside the captures
    launch(bs_small)  # compiles the fused one; makes the counters (8) outside any capture
    reduce_launches.clear()
    torch.cuda.synchronize()
    small, large = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(small):
        launch(bs_small)
    assert not reduce_launches
    with torch.cuda.graph(large):  # 12 counters needed, 8 there: no growing inside a capture
        launch(bs_large)
    assert len(reduce_launches) == 1 and tk.decode_tickets(q.device).numel() == 8
    launch(bs_large)  # eager: the counters grow to 12, the graphs keep theirs
    assert tk.decode_tickets(q.device).numel() >= 12
    for graph, bs in ((small, bs_small), (large, bs_large), (small, bs_small)):
        lens.copy_(torch.randint(1, max_len + 1, (bs_large,), generator=gen))
        tables.copy_(torch.randperm(pool, generator=gen)[: tables.numel()].view_as(tables).int())
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        rows = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
        meta = PhaseMetadata(rows, lens[:bs], tables[:bs], 1, max_len)
        ref = TorchBackend().decode(q[:bs], k_cache, v_cache, meta, scale)
        check(out[:bs], ref, f"graph of {bs} sequences", gen)
    torch.cuda.synchronize()
    assert not any(t.any() for t in (*tk._outgrown_tickets, tk.decode_tickets(q.device)))


@pytest.mark.slow
def test_fused_reduce_cases_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, 2 * len(SHAPES) + 1)
