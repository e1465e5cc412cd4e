"""The Triton selection (``select_mask``, ``list_blocks``) against its torch references
(``select_blocks_reference``, ``block_lists_reference``), on CUDA (``gpu``: the realistic shapes, every
reduction) and at small sizes under Triton's interpreter in a subprocess (``test_kernels_under_interpreter``).

The scores are random, zero outside the causal blocks (as the estimate's), over sequences with chunks that
start off the block grid, a single-row chunk, a sequence with no query and padding rows. The kernel may add
in another order than torch, so a row at the threshold's edge may keep one block more or one fewer: every row
that differs must differ by one block, in at most one row in a thousand (none at all under the interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.testing import assert_interpreter_cases_pass  # noqa: E402
from nanovllm_xattn.layout import first_query_blocks, num_key_blocks, num_query_blocks  # noqa: E402
from nanovllm_xattn.selection import (  # noqa: E402
    block_lists,
    block_lists_reference,
    causal_blocks,
    select_blocks,
    select_blocks_reference,
)
from nanovllm_xattn.selection_kernels import list_blocks, select_mask  # noqa: E402

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"


def phase(lens, device):
    """``(cu_seqlens_q, context_lens)`` of ``(query length, context length)`` pairs."""
    q_lens = torch.tensor([q for q, _ in lens])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    return cu.to(device), torch.tensor([c for _, c in lens], dtype=torch.int32, device=device)


def random_scores(lens, heads, block, device, seed=0):
    cu, ctx = phase(lens, "cpu")
    gen = torch.Generator().manual_seed(seed)
    rows = num_query_blocks(max(q for q, _ in lens), block)
    cols = num_key_blocks(max(c for _, c in lens), block)
    scores = torch.rand(len(lens), heads, rows, cols, generator=gen) ** 4
    causal, _ = causal_blocks(scores, first_query_blocks(cu, ctx, block), ctx, block)
    return (scores * causal).to(device), cu.to(device), ctx.to(device)


def assert_selections_agree(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    assert got.shape == want.shape and got.dtype == torch.bool
    differ = (got != want).sum(-1)
    if exact:
        assert not differ.any(), f"{int((differ > 0).sum())} rows differ"
        return
    assert int(differ.max()) <= 1, "a row differs by more than the block at the threshold's edge"
    rows = int((differ > 0).sum())
    assert rows * 1000 <= max(differ.numel(), 1000), f"{rows} rows differ"
    assert want.any(), "nothing selected: the check is void"


def assert_lists_agree(mask: torch.Tensor, blocks: torch.Tensor, counts: torch.Tensor) -> None:
    want_blocks, want_counts = block_lists_reference(mask.cpu())
    assert torch.equal(counts.cpu(), want_counts)
    width = want_blocks.shape[-1]
    real = torch.arange(width) < want_counts[..., None]
    assert torch.equal(torch.where(real, blocks.cpu()[..., :width], -1), torch.where(real, want_blocks, -1))


# (head_reduce, ratio, keep_sink, recent_blocks, dense_last_rows, thresholds): every reduction, the ratio
# rule, the forced blocks on and off, a threshold of 1 on one head
GPU_MODES = [
    ("mean", None, True, 1, 1, None), ("mean", None, False, 2, 0, None), ("max", None, True, 1, 2, None),
    ("none", None, True, 1, 1, "mixed"), ("union", None, True, 1, 0, None),
    ("majority", None, True, 1, 1, None), ("global_majority", None, True, 1, 0, None),
    ("mean", 0.25, True, 1, 1, None), ("majority", 0.4, False, 3, 0, None), ("mean", None, True, 1, 1, "ones"),
]
INTERP_MODES = [("mean", None, True, 2, 1, None), ("max", 0.3, False, 1, 0, None),
                ("majority", None, True, 1, 0, None), ("none", None, True, 1, 2, "mixed")]
# (query length, context length) per sequence at block 128 (GPU) and 64 (interpreter)
GPU_LENS = [[(8192, 32768)], [(3000, 3000), (1000, 9100), (1, 2049), (0, 300), (700, 4000)]]
INTERP_LENS = [(150, 400), (40, 100), (0, 50)]
GPU_SHAPES = [(4, 1), (32, 8)]  # Gemma 3 270M's full-attention layers, and a GQA model's


def thresholds(kind, heads, device):
    if kind == "mixed":
        return torch.tensor([1.0, 0.6, 0.95, 0.8] * (heads // 4 or 1), device=device)[:heads]
    return torch.full((heads,), 1.0 if kind == "ones" else 0.9, device=device)


def check_modes(modes, lens, heads, kv_heads, block, device, exact):
    scores, cu, ctx = random_scores(lens, heads, block, device)
    for reduce, ratio, sink, recent, last, kind in modes:
        args = (scores, cu, ctx, block, kv_heads, reduce, thresholds(kind, heads, device), ratio, sink, True,
                recent, last)
        want = select_blocks_reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        got = select_mask(*args)
        assert_selections_agree(got.cpu(), want, exact)
        assert_lists_agree(got, *list_blocks(got))


GPU_PARAMS = [pytest.param(lens, heads, kv_heads, id=f"gpu-{heads}x{kv_heads}-{len(lens)}seqs",
                           marks=pytest.mark.gpu)
              for lens in GPU_LENS for heads, kv_heads in GPU_SHAPES]


@pytest.mark.parametrize("lens,heads,kv_heads", GPU_PARAMS)
def test_selection_kernels_match_the_references_on_gpu(lens, heads, kv_heads):
    check_modes(GPU_MODES, lens, heads, kv_heads, 128, "cuda", exact=False)


@pytest.mark.gpu
def test_dispatch_runs_the_kernels_on_gpu_and_reads_nothing_back():
    """``select_blocks`` and ``block_lists`` on CUDA tensors are the kernels' launches: the lists are as
    wide as the mask (no host read sizes them)."""
    scores, cu, ctx = random_scores(GPU_LENS[1], 8, 128, "cuda")
    mask = select_blocks(scores, cu, ctx, 128, 2, "mean", thresholds(None, 8, "cuda"), dense_last_rows=1)
    blocks, counts = block_lists(mask)
    assert blocks.shape == mask.shape and blocks.is_cuda
    assert_lists_agree(mask, blocks, counts)


@pytest.mark.skipif(not INTERP, reason="runs under Triton's interpreter (test_kernels_under_interpreter)")
def test_interp_selection_kernels_match_the_references():
    check_modes(INTERP_MODES, INTERP_LENS, 2, 1, 64, "cpu", exact=True)


@pytest.mark.skipif(not INTERP, reason="runs under Triton's interpreter (test_kernels_under_interpreter)")
def test_interp_lists_of_an_empty_and_a_full_row():
    mask = torch.zeros(1, 1, 2, 20, dtype=torch.bool)
    mask[0, 0, 1] = True
    blocks, counts = list_blocks(mask)
    assert counts.tolist() == [[[0, 20]]] and blocks[0, 0, 1].tolist() == list(range(20))


def test_kernels_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, 2)
