"""The Triton kernels against their torch references (:mod:`nanovllm_quest.reference`), on random inputs:
on CUDA (``gpu``), and at small sizes under Triton's interpreter in a subprocess on machines without
CUDA (``test_kernels_under_interpreter``)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_quest import kernels, reference  # noqa: E402

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter cases exist only inside the subprocess that test_kernels_under_interpreter starts
PARAMS = [pytest.param("cuda", dt, id=f"gpu-{str(dt)[6:]}", marks=pytest.mark.gpu)
          for dt in (torch.bfloat16, torch.float32)]
PARAMS += [pytest.param("cpu", torch.float32, id="interp-float32")] if INTERP else []
cases = pytest.mark.parametrize("device,dtype", PARAMS)


def random_write(gen, num_blocks: int, block_size: int, seqs: list[tuple[int, int]], num_kv_heads: int,
                 head_dim: int, dtype):
    """A step's new rows: for each ``(start position, count)`` a run of one sequence's tokens in its own
    randomly numbered blocks, plus a few skipped rows (slot -1). Returns (key, slots, positions)."""
    perm = torch.randperm(num_blocks, generator=gen)
    slots, positions, used = [], [], 0
    for start, count in seqs:
        first, last = start // block_size, (start + count - 1) // block_size
        table = perm[used: used + last + 1].tolist()
        used += last + 1
        for p in range(start, start + count):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
        slots.append(-1)  # padding between runs, as CUDA-graph decode batches have at their end
        positions.append(0)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    return key, torch.tensor(slots), torch.tensor(positions)


@cases
@pytest.mark.parametrize("block_size", [4, 16])
def test_update_metadata(device, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    hkv, d, n = 2, 48, 64
    # decode rows mid-block, a fresh block's first token, chunks starting mid-block and spanning blocks
    seqs = [(5, 1), (2 * block_size, 1), (3, 2 * block_size + 1), (0, 3 * block_size), (block_size - 1, 2)]
    key, slots, pos = random_write(gen, n, block_size, seqs, hkv, d, dtype)
    start = torch.randn(n, hkv, 2, d, generator=gen).to(dtype)  # stale bounds of earlier owners
    want = start.clone()
    reference.update_metadata(want, key, slots, pos, block_size)
    got = start.to(device)
    kernels.update_metadata(got, key.to(device), slots.to(device), pos.to(device), block_size)
    assert torch.equal(got.cpu(), want), "min/max are exact: the kernel must match bit for bit"


@cases
@pytest.mark.parametrize("reduction", ["max", "sum"])
@pytest.mark.parametrize("keep_sink", [False, True])
def test_block_scores(device, dtype, reduction, keep_sink):
    gen = torch.Generator().manual_seed(7)
    seqs, heads, hkv, d, width = 3, 8, 2, 64, 150 if device == "cuda" else 70
    num_blocks = seqs * width
    metadata = torch.randn(num_blocks, hkv, 2, d, generator=gen)
    metadata = torch.stack([metadata.amin(2), metadata.amax(2)], dim=2).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width).int()
    lens = torch.tensor([width * 16 - 5, 1, (width // 2 + 3) * 16], dtype=torch.int32)  # blocks of 16
    n = (lens + 15) // 16
    tables[1:, :] = torch.where(torch.arange(width) < n[1:, None], tables[1:], -1)
    q = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    want = reference.block_scores(q, metadata, tables, lens, 16, reduction, keep_sink)
    finite_blocks = n - 1 - (keep_sink & (n > 1)).int()  # the newest block (and the sink) forced to +inf
    assert torch.equal(torch.isfinite(want).sum(-1), finite_blocks[:, None].expand(-1, hkv))
    got = kernels.block_scores(q.to(device), metadata.to(device), tables.to(device), lens.to(device), 16,
                               reduction, keep_sink).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.sign(), want.sign())
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


@cases
@pytest.mark.parametrize(("width", "k", "tile"), [(37, 8, None), (200, 16, None), (300, 40, 64), (20, 32, None)])
def test_top_blocks(device, dtype, width, k, tile, monkeypatch):
    if tile is not None:  # rows longer than a tile: the looping path
        monkeypatch.setattr(kernels, "MAX_TOPK_TILE", tile)
    gen = torch.Generator().manual_seed(width)
    scores = (torch.randn(4, 3, width, generator=gen) * 4).round()  # many ties
    scores[0, 0, width // 2:] = float("-inf")  # fewer valid blocks than k in some rows
    scores[1, :, :3] = float("inf")  # forced blocks
    scores[2, 1, :] = -0.0
    scores[3, 2, 5] = float("nan")
    want = reference.top_blocks(scores, k)
    got = kernels.top_blocks(scores.to(device), k).cpu()
    assert torch.equal(got, want)


def test_kernels_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    if CUDA or INTERP:
        pytest.skip("runs the interpreter cases in a subprocess on machines without CUDA")
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == 1 * 2 + 4 + 4, tail
