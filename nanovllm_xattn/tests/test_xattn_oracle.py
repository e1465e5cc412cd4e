"""The ``oracle`` evaluation mode on the CPU: exact block masses sum to each row's queries, threshold 1 keeps
every causal block, a threshold's selection holds at least that share of the true mass, and the oracle at
the estimate's counts keeps as many blocks with at least as much true mass."""

import pytest
import torch
from nanovllm.quality import planted
from nanovllm.testing import prefill_context
from nanovllm_xattn.config import XAttentionConfig
from nanovllm_xattn.layout import first_query_blocks
from nanovllm_xattn.oracle import per_selection_head, true_block_scores
from nanovllm_xattn.policy import XAttentionPolicy, _ops, chunk_slices
from nanovllm_xattn.selection import causal_blocks

BLOCK = 64


def case_context(q_len: int):
    case = planted.vertical_columns(num_tokens=600)
    return prefill_context(case.q, case.k, case.v, q_len, case.scale)


def select(q, ctx, **options) -> torch.Tensor:
    """``[1, Hs, R, N]``: the blocks the policy's rows keep over the whole chunk."""
    policy = XAttentionPolicy(XAttentionConfig(**{"block_size": BLOCK, "dense_below": 0, **options}))
    meta = ctx.meta
    (part,) = chunk_slices(meta.cu_seqlens_q, meta.context_lens, meta.max_query_len, BLOCK,
                           meta.max_query_len)
    return policy.select(q, ctx, part, ctx.k_cache, meta.block_tables, _ops(q.device)[0])


def true_scores(q, ctx) -> torch.Tensor:
    meta = ctx.meta
    return true_block_scores(q, ctx.k_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                             ctx.scale, BLOCK, meta.max_query_len, meta.max_context_len)


def causal(q, ctx, scores) -> torch.Tensor:
    meta = ctx.meta
    first = first_query_blocks(meta.cu_seqlens_q, meta.context_lens, BLOCK)
    return causal_blocks(scores, first, meta.context_lens, BLOCK)[0]


@pytest.mark.parametrize("q_len", [600, 437])
def test_true_block_scores_sum_to_each_rows_queries(q_len):
    q, ctx = case_context(q_len)
    scores = true_scores(q, ctx)
    positions = torch.arange(600 - q_len, 600)
    first = (600 - q_len) // BLOCK
    queries = torch.bincount(positions // BLOCK - first, minlength=scores.shape[2]).float()
    torch.testing.assert_close(scores.sum(-1), queries.expand_as(scores.sum(-1)), atol=1e-3, rtol=1e-5)
    assert (scores.masked_fill(causal(q, ctx, scores), 0.0) == 0).all(), "mass right of the diagonal"


@pytest.mark.parametrize("reduce", ["mean", "none"])
def test_threshold_one_keeps_every_causal_block(reduce):
    q, ctx = case_context(437)
    mask = select(q, ctx, threshold=1.0, oracle="mass", head_reduce=reduce)
    assert torch.equal(mask, causal(q, ctx, mask).expand_as(mask))


@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.9])
@pytest.mark.parametrize("reduce", ["mean", "none"])
@pytest.mark.parametrize("forced", [True, False])
def test_selected_true_mass_reaches_the_threshold(threshold, reduce, forced):
    q, ctx = case_context(437)
    mask = select(q, ctx, threshold=threshold, oracle="mass", head_reduce=reduce, keep_sink=forced,
                  keep_recent=forced, dense_last_rows=int(forced))
    mass = per_selection_head(true_scores(q, ctx), mask.shape[1])
    total = mass.sum(-1)
    real = total > 0  # padding rows hold no queries
    share = (mass * mask).sum(-1)[real] / total[real]
    assert (share >= threshold - 1e-5).all()
    assert mask.sum() < causal(q, ctx, mask).expand_as(mask).sum(), "nothing was dropped: the test is vacuous"
    if not forced:  # the fewest: without a row's least block of those kept, the rest miss the threshold
        least = mass.masked_fill(~mask, float("inf")).amin(-1)
        assert ((share - least[real] / total[real]) < threshold).all()


@pytest.mark.parametrize("reduce", ["mean", "none"])
def test_counts_oracle_keeps_the_estimates_counts_with_more_true_mass(reduce):
    q, ctx = case_context(437)
    estimate = select(q, ctx, threshold=0.8, head_reduce=reduce)
    oracle = select(q, ctx, threshold=0.8, head_reduce=reduce, oracle="counts")
    assert torch.equal(oracle.sum(-1), estimate.sum(-1))
    assert not (oracle & ~causal(q, ctx, oracle)).any()
    mass = per_selection_head(true_scores(q, ctx), oracle.shape[1])
    assert ((mass * oracle).sum(-1) >= (mass * estimate).sum(-1) - 1e-5).all()
    first = (600 - 437) // BLOCK
    rows = torch.arange(-(-600 // BLOCK) - first)  # the real rows
    assert oracle[0][:, rows, 0].all(), "the sink block was dropped"
    assert oracle[0][:, rows, rows + first].all(), "a diagonal block was dropped"


def test_oracle_option_is_checked():
    with pytest.raises(ValueError, match="oracle must be null or one of 'mass', 'counts'"):
        XAttentionConfig(oracle="exact")
