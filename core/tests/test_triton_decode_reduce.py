"""The split-KV decode's reduce (``_reduce_kernel`` merges the splits' partials by log-sum-exp, one launch
after the decode kernel) against the ``torch`` reference: split counts from two to more than the key tiles
(empty splits included), GQA groups, head dims 64, 128 and 256, sliding windows, selections per KV head (rows
that select nothing), the log-sum-exp written or not. On a machine without CUDA the ``interp`` cases run under
Triton's interpreter in a subprocess; on CUDA they run on the GPU."""

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
# 2 and 3 splits; more splits than key tiles (empty ones)
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


def decode(b: PagedBatch, splits: int, lse: bool, sel: torch.Tensor | None = None,
           window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch in ``splits`` splits into NaN-poisoned outputs."""
    out = torch.full_like(b.q, float("nan"))
    lse_t = torch.full(b.q.shape[:2], float("nan"), device=DEVICE) if lse else None
    tk.attention_decode(b.q, b.k_cache, b.v_cache, out, lse_t, b.ctx, b.tables, sel, max(CONTEXTS), b.scale,
                        num_splits=splits, window=window)
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
def test_interp_split_reduce_whole_contexts(head_dim, group, gen, reduce_launches):
    b, meta = batch(head_dim, group, gen)
    every_block = torch.arange(meta.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    every_block = torch.where(meta.block_tables >= 0, every_block, -1)
    ref, ref_lse = TorchBackend().attend_blocks(b.q, b.k_cache, b.v_cache, meta, every_block, b.ctx, b.scale)
    for splits, lse in zip(SPLITS, (False, True, True), strict=True):
        out, lse_t = decode(b, splits, lse)
        check(out, ref, f"{splits} splits", gen)
        if lse:
            check_lse(lse_t, ref_lse, f"{splits} splits", gen)
    assert len(reduce_launches) == len(SPLITS), "the reduce runs once a launch"
    again, again_lse = decode(b, splits, True)
    assert torch.equal(again, out) and torch.equal(again_lse, lse_t), "a second launch differs"


@KERNELS
@pytest.mark.parametrize("head_dim,group", SHAPES, ids=[f"d{d}-g{g}" for d, g in SHAPES])
def test_interp_split_reduce_window_and_selection(head_dim, group, gen):
    b, meta = batch(head_dim, group, gen)
    ref = TorchBackend().decode(b.q, b.k_cache, b.v_cache, meta, b.scale, window=WINDOW)
    out, lse = decode(b, SPLITS[1], True, window=WINDOW)
    check(out, ref, f"window {WINDOW}", gen)
    _, one_lse = decode(b, 1, True, window=WINDOW)  # the kernel writes it directly: no reduce
    check_lse(lse, one_lse, f"{SPLITS[1]} splits against one, window {WINDOW}", gen)

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
        out, lse = decode(b, splits, True, sel=sel)
        check(out, ref, f"selection, {splits} splits", gen)
        check_lse(lse, ref_lse, f"selection, {splits} splits", gen)
        assert torch.all(out[0, :group] == 0), "a row that selects nothing gets 0"


@pytest.mark.slow
def test_split_reduce_cases_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, 2 * len(SHAPES))
