"""The kernel-test helpers of :mod:`nanovllm.testing` that plugins' tests share: the poisoned paged batch and its
dense oracle, the random query/key case of pattern estimates, and the kernel-against-reference check."""

from __future__ import annotations

import unittest

import pytest
import torch
from nanovllm.testing import PagedBatch, assert_kernel_matches_reference, paged_query_keys


def _keys_through_tables(cache, tables, s: int, ctx: int):
    block_size = cache.shape[1]
    pos = torch.arange(ctx)
    return cache[tables[s, pos // block_size].long(), pos % block_size]


def test_paged_batch_owns_its_contexts_and_poisons_the_rest():
    lens = [(5, 20), (9, 9), (0, 7)]
    c = PagedBatch(lens, 2, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert c.q.shape == (14, 4, 8) and c.cu.tolist() == [0, 5, 14, 14] and c.max_query_len == 9
    owned = 0
    for s, (_, ctx) in enumerate(lens):
        assert not _keys_through_tables(c.k_cache, c.tables, s, ctx).isnan().any()
        assert not _keys_through_tables(c.v_cache, c.tables, s, ctx).isnan().any()
        owned += ctx
    assert c.k_cache[..., 0, 0].isfinite().sum() == owned  # every other slot is NaN


def test_dense_causal_is_causal_softmax_attention():
    """One fresh prompt: the oracle equals torch's causal SDPA over the keys read through the table."""
    c = PagedBatch([(12, 12)], 1, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(1))
    out, lse = c.dense_causal()
    k = _keys_through_tables(c.k_cache, c.tables, 0, 12).repeat_interleave(2, dim=1)
    v = _keys_through_tables(c.v_cache, c.tables, 0, 12).repeat_interleave(2, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(
        c.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=c.scale).transpose(0, 1)
    torch.testing.assert_close(out.float(), want, rtol=1e-5, atol=1e-5)
    assert lse[0].tolist() == pytest.approx((c.q[0].double() * k[0].double()).sum(-1).mul(c.scale).tolist())


def test_paged_query_keys_reads_back_through_its_tables():
    case = paged_query_keys([(3, 10), (1, 5)], 1, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(2))
    assert case["q"].shape == (4, 2, 8) and case["cu_seqlens_q"].tolist() == [0, 3, 4]
    tables = case["block_tables"]
    used = [b for s, ctx in enumerate([10, 5]) for b in tables[s, : -(-ctx // 4)].tolist()]
    assert len(set(used)) == len(used) and (tables[0, 3:] == -1).all() and (tables[1, 2:] == -1).all()


def test_kernel_check_fails_on_a_wrong_kernel():
    ref_out = torch.randn(6, 2, 4)
    ref_lse = torch.randn(6, 2)
    ref_out[0, 0], ref_lse[0, 0] = 0, float("-inf")  # a row that reads nothing
    assert_kernel_matches_reference(ref_out.clone(), ref_lse.clone(), ref_out, ref_lse, "same")
    with pytest.raises(AssertionError, match="wrong: relative error"):
        assert_kernel_matches_reference(ref_out + 0.1, ref_lse, ref_out, ref_lse, "wrong")
    lse = ref_lse.clone()
    lse[0, 0] = 0.0
    with pytest.raises(AssertionError, match="rows that read nothing differ"):
        assert_kernel_matches_reference(ref_out, lse, ref_out, ref_lse, "empty")
    with pytest.raises(AssertionError, match="rows with and without keys"):
        assert_kernel_matches_reference(ref_out, ref_lse.abs(), ref_out, ref_lse.abs(), "no empty row")


def test_policy_engine_skips_without_the_plugin_and_runs_full(one_thread):
    from nanovllm.conformance import policy_engine
    from nanovllm.testing import prompt_logprobs

    with pytest.raises(unittest.SkipTest, match="'no_such_policy' is not registered"):
        policy_engine("full;no_such_policy:budget=4", "cpu", 4)
    llm = policy_engine("full", "cpu", 4, max_model_len=128)
    assert llm.config.max_model_len == 128
    logprobs = prompt_logprobs(llm, list(range(3, 40)))
    assert len(logprobs) == 36 and all(lp <= 0 for lp in logprobs)
