"""The selection rule (threshold, ratio, forced blocks, GQA reductions), the block lists, and the slices
of long chunks: invariants on random scores."""

from __future__ import annotations

import pytest
import torch

from nanovllm_xattn.config import XAttentionConfig
from nanovllm_xattn.layout import first_query_blocks, num_key_blocks, num_query_blocks
from nanovllm_xattn.policy import chunk_slices
from nanovllm_xattn.selection import block_lists, causal_blocks, causal_density, select_blocks, threshold_mask

BLOCK = 64


def _phase(q_lens, ctx_lens):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cu, torch.tensor(ctx_lens, dtype=torch.int32)


def _scores(cu, lens, heads, seed=0):
    """Random block scores, zero outside the causal blocks, like the estimate's."""
    gen = torch.Generator().manual_seed(seed)
    rows = num_query_blocks(int((cu[1:] - cu[:-1]).max()), BLOCK)
    cols = num_key_blocks(int(lens.max()), BLOCK)
    scores = torch.rand(len(lens), heads, rows, cols, generator=gen) ** 4
    causal, _ = causal_blocks(scores, first_query_blocks(cu, lens, BLOCK), lens, BLOCK)
    return scores * causal


@pytest.fixture
def phase():
    return _phase([300, 64, 1000], [1000, 700, 1000])  # chunked (q0 > 0, not block aligned) and whole


def _forced(scores, cu, lens, sink=True, recent=True):
    causal, diagonal = causal_blocks(scores, first_query_blocks(cu, lens, BLOCK), lens, BLOCK)
    forced = torch.zeros_like(causal)
    forced[..., 0] = sink
    return causal, (forced | (diagonal & recent)) & causal


@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_threshold_keeps_the_fewest_blocks_that_reach_it(phase, threshold):
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    causal, forced = _forced(scores, cu, lens)
    keep = threshold_mask(scores, causal, forced, torch.full((2,), threshold))
    assert not (keep & ~causal).any(), "a block past the diagonal or in a padding row"
    assert (keep | ~forced).all(), "a forced block dropped"
    total = scores.sum(-1)
    kept = (scores * keep).sum(-1)
    real = causal.any(-1).expand_as(total)
    assert (kept[real] >= threshold * total[real] * (1 - 1e-6)).all()
    # fewest: without its weakest unforced block each row falls short
    free = keep & ~forced
    weakest = torch.where(free, scores, float("inf")).amin(-1)
    has_free = free.any(-1)
    assert has_free.any()
    assert (kept - weakest < threshold * total)[has_free].all()


def test_threshold_one_keeps_every_causal_block_even_with_zero_scores(phase):
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    scores[..., 3:] = 0  # underflowed mass must still be kept at threshold 1
    causal, forced = _forced(scores, cu, lens)
    assert torch.equal(threshold_mask(scores, causal, forced, torch.ones(2)), causal.expand_as(scores))


def test_forced_blocks_are_kept_at_any_threshold(phase):
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    causal, forced = _forced(scores, cu, lens)
    keep = threshold_mask(scores, causal, forced, torch.full((2,), 1e-6))
    assert torch.equal(keep, forced.expand_as(keep)), "a tiny threshold keeps the forced blocks only"
    causal, none = _forced(scores, cu, lens, sink=False, recent=False)
    keep = threshold_mask(scores, causal, none, torch.full((2,), 1e-6))
    assert torch.equal(keep.sum(-1), causal.any(-1).expand(keep.shape[:-1]).long()), "one best block per real row"


def test_recent_blocks_end_at_the_diagonal(phase):
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    keep = select_blocks(scores, cu, lens, BLOCK, 1, "mean", torch.full((2,), 1e-6), keep_sink=False,
                         recent_blocks=3)
    first = first_query_blocks(cu, lens, BLOCK)
    for s, r in zip(*torch.nonzero(keep[:, 0].any(-1)).T.tolist(), strict=True):
        diagonal = int(first[s]) + r
        assert torch.nonzero(keep[s, 0, r]).flatten().tolist() == list(range(max(diagonal - 2, 0), diagonal + 1))


@pytest.mark.parametrize("dense_last_rows", [1, 2])
@pytest.mark.parametrize("ratio", [None, 0.25])
def test_last_rows_read_every_causal_block(phase, dense_last_rows, ratio):
    """Each sequence's last rows keep every causal block at a threshold that keeps almost nothing; the
    other rows select as without them."""
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    tiny = torch.full((2,), 1e-6)
    keep = select_blocks(scores, cu, lens, BLOCK, 1, "mean", tiny, ratio, dense_last_rows=dense_last_rows)
    plain = select_blocks(scores, cu, lens, BLOCK, 1, "mean", tiny, ratio)
    causal, _ = causal_blocks(scores, first_query_blocks(cu, lens, BLOCK), lens, BLOCK)
    query_block = first_query_blocks(cu, lens, BLOCK)[:, None] + torch.arange(scores.shape[2])[None, :]
    last = (query_block > ((lens.long() - 1) // BLOCK)[:, None] - dense_last_rows)[:, None, :, None] & causal
    assert int(last.any(-1).sum()) == dense_last_rows * len(lens), "every sequence has its last rows here"
    assert torch.equal(keep & last, last), "a last row dropped a causal block"
    assert torch.equal(keep & ~last, plain & ~last), "a row before the last ones changed"
    assert not torch.equal(plain & last, last), "the plain rule keeps every block anyway: the check is void"


def test_ratio_keeps_a_fixed_share_of_each_row(phase):
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    causal, forced = _forced(scores, cu, lens, sink=False, recent=False)
    keep = threshold_mask(scores, causal, forced, torch.full((2,), 0.9), ratio=0.25)
    n_causal = causal.sum(-1).expand(keep.shape[:-1])
    assert torch.equal(keep.sum(-1), (n_causal * 0.25).ceil().long())
    # the kept blocks are the best ones
    worst_kept = torch.where(keep, scores, float("inf")).amin(-1)
    best_dropped = torch.where(causal & ~keep, scores, float("-inf")).amax(-1)
    assert (worst_kept >= best_dropped).all()


@pytest.mark.parametrize("reduce", ["mean", "max", "union", "majority", "global_majority", "none"])
def test_gqa_reductions(phase, reduce):
    cu, lens = phase
    heads, kv_heads = 8, 2
    scores = _scores(cu, lens, heads, seed=1)
    threshold = torch.full((heads,), 0.8)
    mask = select_blocks(scores, cu, lens, BLOCK, kv_heads, reduce, threshold)
    assert mask.shape[1] == (heads if reduce == "none" else kv_heads)
    causal, forced = _forced(scores, cu, lens)
    own = threshold_mask(scores, causal, forced, threshold).view(len(lens), kv_heads, 4, *scores.shape[-2:])
    if reduce == "union":
        assert torch.equal(mask, own.any(2))
    elif reduce == "majority":
        assert torch.equal(mask, own.sum(2) >= 3)
    elif reduce == "global_majority":
        assert torch.equal(mask, (own.sum((1, 2)) >= 5)[:, None].expand_as(mask))
    elif reduce == "none":
        assert torch.equal(mask, own.flatten(1, 2))
    else:
        pooled = scores.view(len(lens), kv_heads, 4, *scores.shape[-2:])
        pooled = pooled.mean(2) if reduce == "mean" else pooled.amax(2)
        assert torch.equal(mask, threshold_mask(pooled, causal, forced, threshold[:kv_heads]))
    assert (mask | ~forced).all()


def test_group_uses_its_largest_threshold(phase):
    cu, lens = phase
    scores = _scores(cu, lens, 4)
    low = select_blocks(scores, cu, lens, BLOCK, 2, "mean", torch.tensor([0.5, 0.5, 0.5, 0.5]))
    mixed = select_blocks(scores, cu, lens, BLOCK, 2, "mean", torch.tensor([0.5, 1.0, 0.5, 0.5]))
    causal, _ = causal_blocks(scores, first_query_blocks(cu, lens, BLOCK), lens, BLOCK)
    assert torch.equal(mixed[:, 0], causal[:, 0])
    assert torch.equal(mixed[:, 1], low[:, 1])


def test_planted_blocks_are_found(phase):
    """Rows whose mass sits in a few planted blocks keep exactly those (plus the forced ones)."""
    cu, lens = phase
    scores = _scores(cu, lens, 2) * 1e-4
    first = first_query_blocks(cu, lens, BLOCK)
    causal, forced = _forced(scores, cu, lens)
    gen = torch.Generator().manual_seed(3)
    planted = (torch.rand(scores.shape, generator=gen) < 0.15) & causal
    scores = scores + planted * 1.0
    keep = select_blocks(scores, cu, lens, BLOCK, 2, "none", torch.full((2,), 0.95))
    has_planted = planted.any(-1)  # rows without any keep noise blocks up to the threshold
    assert has_planted.sum() > 10
    assert torch.equal(keep[has_planted], (planted | forced.expand_as(planted))[has_planted])
    assert first.tolist() == [700 // BLOCK, 636 // BLOCK, 0]


def test_block_lists_are_ascending_with_counts(phase):
    cu, lens = phase
    scores = _scores(cu, lens, 2)
    mask = select_blocks(scores, cu, lens, BLOCK, 1, "union", torch.full((2,), 0.7))
    blocks, counts = block_lists(mask)
    assert torch.equal(counts, mask.sum(-1).int())
    for s, g, r in zip(*torch.nonzero(counts).T.tolist(), strict=True):
        row = blocks[s, g, r, : counts[s, g, r]]
        assert torch.equal(row.long(), torch.nonzero(mask[s, g, r]).flatten())
    assert 0 < causal_density(mask, cu, lens, BLOCK) < 1


@pytest.mark.parametrize("estimate_chunk", [64, 150, 256, 5000])
def test_slices_cover_every_row_once_at_block_boundaries(phase, estimate_chunk):
    cu, lens = phase
    max_q = int((cu[1:] - cu[:-1]).max())
    slices = chunk_slices(cu, lens, max_q, BLOCK, estimate_chunk)
    if estimate_chunk >= max_q:
        assert len(slices) == 1 and slices[0].rows is None
        return
    seen = torch.cat([part.rows for part in slices])
    assert torch.equal(seen.sort().values, torch.arange(int(cu[-1])))
    for part in slices:
        q_lens = part.cu_seqlens_q[1:] - part.cu_seqlens_q[:-1]
        assert int(q_lens.max()) <= part.max_query_len
        q0 = part.context_lens - q_lens
        later = q0 > (lens - (cu[1:] - cu[:-1]))  # every slice but a sequence's first starts on a block
        assert (q0[later & (q_lens > 0)] % BLOCK == 0).all()
        # the slice's rows are the positions q0 .. context - 1 of its sequences
        for s in range(len(lens)):
            rows = part.rows[part.cu_seqlens_q[s]: part.cu_seqlens_q[s + 1]] - cu[s]
            assert torch.equal(rows + lens[s] - (cu[s + 1] - cu[s]), torch.arange(int(q0[s]), int(part.context_lens[s])))


def test_config_checks_its_options():
    XAttentionConfig(threshold=1, stride=16)
    for bad in (dict(threshold=0), dict(threshold=1.5), dict(stride=3), dict(stride=128), dict(block_size=32),
                dict(head_reduce="vote"), dict(ratio=0), dict(keep_sink=1), dict(threshold_path=""),
                dict(dense_last_rows=-1), dict(dense_last_rows=True)):
        with pytest.raises(ValueError):
            XAttentionConfig(**bad)
