"""``attend_blocks`` of the ``torch`` backend (the reference) against a direct float64 computation.

Selections come in both forms: one list of logical blocks per sequence ``[S, k]`` and one per KV head
``[S, Hkv, k]``. The reference builds each sequence's keys position by position from the block table
and masks them explicitly (selected block of this KV head, position below ``kv_lens``). Cache slots
that no head may read (unowned blocks, unselected (block, KV head) slices, slots past ``kv_lens``)
hold NaN, so reading or weighting one of them shows in the output.
"""

from __future__ import annotations

import os

import pytest
import torch
from nanovllm.attention.backend import selection_per_kv_head
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend

HEAD_DIM = 16
NUM_KV_HEADS = 2


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)  # the seed is in every failure message


def _paged_batch(q_lens, ctx_lens, group, block_size, gen):
    """float32 q, a NaN-filled paged cache holding each sequence's keys/values, and the metadata."""
    s = len(q_lens)
    nblk = [-(-c // block_size) for c in ctx_lens]
    pool = sum(nblk) + 2  # two blocks nobody owns
    perm = torch.randperm(pool, generator=gen).int()
    tables = torch.full((s, max(nblk) + 1), -1, dtype=torch.int32)
    start = 0
    for j, n in enumerate(nblk):
        tables[j, :n] = perm[start : start + n]
        start += n
    k_cache = torch.full((pool, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for j, c in enumerate(ctx_lens):
        for p in range(c):
            blk, off = int(tables[j, p // block_size]), p % block_size
            k_cache[blk, off] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen)
            v_cache[blk, off] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=gen) * 2
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = PhaseMetadata(cu, torch.tensor(ctx_lens, dtype=torch.int32), tables, max(q_lens), max(ctx_lens))
    return q, k_cache, v_cache, meta


def _per_head_selection(hist_blocks: list[int], gen) -> torch.Tensor:
    """``[S, Hkv, width]`` ascending, -1 padded at the end, random per KV head. Sequence 0 selects
    nothing; in sequence 1, KV head 0 selects nothing (its other heads do)."""
    width = max(max(hist_blocks), 1)
    sel = torch.full((len(hist_blocks), NUM_KV_HEADS, width), -1, dtype=torch.int32)
    for j, n in enumerate(hist_blocks):
        for h in range(NUM_KV_HEADS):
            if n == 0 or j == 0 or (j == 1 and h == 0):
                continue
            count = int(torch.randint(1, n + 1, (1,), generator=gen))
            sel[j, h, :count] = torch.randperm(n, generator=gen)[:count].sort().values.int()
    return sel


def _poison_unselected(k_cache, v_cache, meta, sel, kv_lens):
    """NaN in every (slot, KV head) the selection does not cover, and past ``kv_lens``."""
    bs = k_cache.shape[1]
    readable = torch.zeros(k_cache.shape[:3], dtype=torch.bool)
    for s in range(meta.num_seqs):
        for h in range(NUM_KV_HEADS):
            for b in sel[s, h][sel[s, h] >= 0].tolist():
                n = min(bs, int(kv_lens[s]) - b * bs)
                readable[int(meta.block_tables[s, b]), :n, h] = True
    k_cache[~readable] = float("nan")
    v_cache[~readable] = float("nan")


def _reference(q, k_cache, v_cache, meta, sel, kv_lens, scale):
    """float64, one sequence at a time, from explicit masks ``[Hkv, kv_len]``: (out, lse)."""
    bs = k_cache.shape[1]
    group = q.shape[1] // NUM_KV_HEADS
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for s in range(meta.num_seqs):
        n = int(kv_lens[s])
        rows = slice(int(meta.cu_seqlens_q[s]), int(meta.cu_seqlens_q[s + 1]))
        pos = torch.arange(n)
        phys = meta.block_tables[s, pos // bs].long()
        k = k_cache[phys, pos % bs].double()  # [n, Hkv, D]
        v = v_cache[phys, pos % bs].double()
        mask = torch.zeros(NUM_KV_HEADS, n, dtype=torch.bool)
        for h in range(NUM_KV_HEADS):
            chosen = sel[s, h][sel[s, h] >= 0]
            mask[h] = torch.isin(pos // bs, chosen)
        for qh in range(q.shape[1]):
            h = qh // group
            if not mask[h].any():
                continue
            kh, vh = k[mask[h], h], v[mask[h], h]
            scores = q[rows, qh].double() @ kh.T * scale
            lse[rows, qh] = torch.logsumexp(scores, dim=-1)
            out[rows, qh] = torch.softmax(scores, dim=-1) @ vh
    return out, lse


def _check(out, lse, ref_out, ref_lse, gen):
    seed = gen.initial_seed()
    assert torch.isfinite(out).all(), f"non-finite output (seed {seed})"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"-inf pattern differs (seed {seed})"
    assert torch.allclose(out.double(), ref_out, atol=1e-5, rtol=1e-4), f"out (seed {seed})"
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=1e-5), f"lse (seed {seed})"


# (query lengths, context lengths): decode tokens over mixed lengths, chunks over selected history
# (the first has no history at all)
PHASES = {
    "decode": ([1] * 5, [1, 17, 70, 33, 48]),
    "chunks": ([5, 3, 8, 1, 4], [5, 40, 41, 18, 36]),
}


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_per_head_selection_matches_float64_reference(phase, group, block_size, gen):
    q_lens, ctx_lens = PHASES[phase]
    q, k_cache, v_cache, meta = _paged_batch(q_lens, ctx_lens, group, block_size, gen)
    kv_lens = meta.context_lens - (meta.query_lens if phase == "chunks" else 0)
    if phase == "decode":
        kv_lens = (kv_lens - torch.tensor([0, 0, 3, 1, 0])).int()  # some selections end before the context
    hist_blocks = [-(-int(n) // block_size) for n in kv_lens]
    sel = _per_head_selection(hist_blocks, gen)
    _poison_unselected(k_cache, v_cache, meta, sel, kv_lens)
    scale = HEAD_DIM**-0.5
    out, lse = TorchBackend().attend_blocks(q, k_cache, v_cache, meta, sel, kv_lens, scale)
    ref_out, ref_lse = _reference(q, k_cache, v_cache, meta, sel, kv_lens, scale)
    assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    _check(out, lse, ref_out, ref_lse, gen)
    # nothing selected: out 0 and lse -inf, for a whole sequence and for one KV head's query heads
    first, second = slice(0, q_lens[0]), slice(q_lens[0], q_lens[0] + q_lens[1])
    assert torch.all(out[first] == 0) and torch.all(torch.isneginf(lse[first]))
    assert torch.all(out[second, :group] == 0) and torch.all(torch.isneginf(lse[second, :group]))
    assert torch.isfinite(lse[second, group:]).all()


@pytest.mark.parametrize("phase", PHASES)
def test_shared_selection_equals_identical_per_head_rows(phase, gen):
    block_size, group = 8, 4
    q_lens, ctx_lens = PHASES[phase]
    q, k_cache, v_cache, meta = _paged_batch(q_lens, ctx_lens, group, block_size, gen)
    kv_lens = meta.context_lens - (meta.query_lens if phase == "chunks" else 0)
    hist_blocks = [-(-int(n) // block_size) for n in kv_lens]
    shared = _per_head_selection(hist_blocks, gen)[:, 1]  # head 1's lists (sequence 0: empty)
    per_head = shared[:, None, :].expand(-1, NUM_KV_HEADS, -1).contiguous()
    scale = HEAD_DIM**-0.5
    backend = TorchBackend()
    out, lse = backend.attend_blocks(q, k_cache, v_cache, meta, shared, kv_lens, scale)
    out_h, lse_h = backend.attend_blocks(q, k_cache, v_cache, meta, per_head, kv_lens, scale)
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h)
    _poison_unselected(k_cache, v_cache, meta, per_head, kv_lens)
    out, lse = backend.attend_blocks(q, k_cache, v_cache, meta, shared, kv_lens, scale)
    _check(out, lse, *_reference(q, k_cache, v_cache, meta, per_head, kv_lens, scale), gen)


def test_selection_forms():
    shared = torch.tensor([[0, 2, -1], [1, -1, -1]], dtype=torch.int32)
    view = selection_per_kv_head(shared, 4)
    assert view.shape == (2, 4, 3) and view.stride(1) == 0 and view.data_ptr() == shared.data_ptr()
    per_head = torch.zeros(2, 4, 3, dtype=torch.int32)
    assert selection_per_kv_head(per_head, 4) is per_head
    for bad in (torch.zeros(2, 3, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"\[num_seqs, num_kv_heads=4, k\]"):
            selection_per_kv_head(bad, 4)


def test_bench_selections_follow_the_contract(gen):
    """B3's selected-decode inputs: per KV head, distinct ascending blocks in range, the last one
    always in; and the bytes it counts are those of the selected slots below kv_lens, plus q and out."""
    pytest.importorskip("triton")
    from nanovllm.bench.kernels import decode_bytes, random_head_selection

    sel = random_head_selection(3, 4, 50, 8, gen, "cpu")
    assert sel.shape == (3, 4, 8) and sel.dtype == torch.int32
    assert (sel[..., 1:] > sel[..., :-1]).all() and sel.min() >= 0 and (sel[..., -1] == 49).all()
    assert not all(torch.equal(sel[0, 0], sel[s, h]) for s in range(3) for h in range(4)), "one list for all"
    # two sequences, one KV head: blocks 0 and 2 of 16 tokens below kv_len 40 (16 + 8 tokens), none
    sel = torch.tensor([[[0, 2, -1]], [[-1, -1, -1]]], dtype=torch.int32)
    kv_lens = torch.tensor([40, 40])
    kv_bytes, q_out_bytes = 24 * 2 * 8 * 2, 2 * (2 * 4 * 8 * 2)
    assert decode_bytes(sel, kv_lens, 16, num_heads=4, head_dim=8, itemsize=2) == kv_bytes + q_out_bytes
