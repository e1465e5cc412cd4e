"""The ``xattn`` policy on the CPU (torch references): threshold 1 is dense, planted block clusters are
found, long chunks estimated in slices give the same output, small chunks run dense, the offload path
reads the same keys, and bad options are refused with the fix."""

import json

import pytest
import torch
from nanovllm.kv import PagedLayerKV
from nanovllm.quality import planted
from nanovllm.testing import prefill_context

from nanovllm_xattn import policy as policy_module
from nanovllm_xattn.config import XAttentionConfig
from nanovllm_xattn.layout import first_query_blocks
from nanovllm_xattn.policy import XAttentionPolicy
from nanovllm_xattn.selection import causal_density

BLOCK = 64  # xattn blocks: 4 KV blocks of 16


def xattn(**options) -> XAttentionPolicy:
    return XAttentionPolicy(XAttentionConfig(**{"block_size": BLOCK, "dense_below": 0, **options}))


def run(policy, q, ctx):
    return policy.compute_chunked_prefill(q, ctx.new_keys, ctx.new_values, ctx)


def dense(q, ctx):
    return ctx.attend_all(q, ctx.new_keys, ctx.new_values)


@pytest.mark.parametrize("q_len", [500, 437, 50])
@pytest.mark.parametrize("reduce", ["mean", "none"])
def test_threshold_one_is_dense(q_len, reduce):
    case = planted.needles(num_tokens=500)
    q, ctx = prefill_context(case.q, case.k, case.v, q_len, case.scale)
    torch.testing.assert_close(run(xattn(threshold=1.0, head_reduce=reduce), q, ctx), dense(q, ctx),
                               atol=1e-5, rtol=1e-5)


def test_planted_block_clusters_are_found():
    """Every query attends to a few planted 64-token blocks per KV head: the selection keeps them for
    every row at or past them, stays sparse, and the output is close to dense's."""
    case = planted.block_clusters(num_tokens=1024, block_size=BLOCK, clusters_per_head=2, strength=8.0)
    q, ctx = prefill_context(case.q, case.k, case.v, 1024, case.scale)
    policy = xattn(threshold=0.9, stride=8, dense_last_rows=0)  # the threshold rule alone on every row
    masks = []
    original = policy.select
    policy.select = lambda *a: masks.append(original(*a)) or masks[-1]
    out = run(policy, q, ctx)
    mask = masks[0][0, :, : 1024 // BLOCK]  # [Hkv, R, N], without the padding row
    truth = case.truth[-1].view(case.truth.shape[1], -1, BLOCK).any(-1)  # [Hkv, N]: planted key blocks
    rows = torch.arange(mask.shape[1])[:, None]
    needed = truth[:, None, :] & (torch.arange(truth.shape[1])[None, :] <= rows)[None]  # causal part
    assert (mask | ~needed).all(), "a planted block was dropped"
    assert causal_density(masks[0], ctx.meta.cu_seqlens_q, ctx.meta.context_lens, BLOCK) < 0.5
    # the first rows of a planted block see few of its keys, so some mass outside it is dropped there
    want = dense(q, ctx)
    assert (out - want).norm() / want.norm() < 0.05


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_late_question_reads_its_far_needle(device):
    """Every query attends to the sink; only the chunk's last few queries (a question) attend to one far
    key. Their share of their row's mass is small, so the threshold drops the far block unless the last
    row reads every causal block: then the last block's outputs are dense's (on the GPU up to the Triton
    kernels' float32 dots)."""
    num_tokens, question, needle_at = 1024, 4, 200
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, 2, 32, generator=gen) * 0.3
    k = torch.randn(num_tokens, 1, 32, generator=gen) * 0.3
    v = torch.randn(num_tokens, 1, 32, generator=gen)
    k[0, :, 0] = 1.0
    q[:, :, 0] = 40.0  # the sink
    k[needle_at, :, 1] = 1.0
    q[-question:, :, 1] = 60.0  # the question, past the sink
    q_chunk, ctx = prefill_context(q, k, v, 512, 32**-0.5, device=device)
    want = dense(q_chunk, ctx)
    last_block = slice(-BLOCK, None)  # the chunk ends on a block boundary
    dropped = run(xattn(threshold=0.9, dense_last_rows=0), q_chunk, ctx)
    assert (dropped[-question:] - want[-question:]).abs().max() > 0.1, "the needle was kept anyway"
    kept = run(xattn(threshold=0.9), q_chunk, ctx)
    tolerance = 1e-5 if device == "cpu" else 1e-2
    torch.testing.assert_close(kept[last_block], want[last_block], atol=tolerance, rtol=tolerance)


def test_slices_give_the_output_of_one_estimate():
    """Slices are cut on block boundaries and a query block's scores see only keys up to it, so the
    estimate of a slice is the same as that of the whole chunk: identical selections and output."""
    case = planted.vertical_columns(num_tokens=700)
    q, ctx = prefill_context(case.q, case.k, case.v, 620, case.scale)
    whole = run(xattn(threshold=0.8), q, ctx)
    sliced = run(xattn(threshold=0.8, estimate_chunk=150), q, ctx)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)
    assert first_query_blocks(ctx.meta.cu_seqlens_q, ctx.meta.context_lens, BLOCK).item() == 80 // BLOCK


def test_short_chunks_and_skipped_layers_run_dense(monkeypatch):
    case = planted.needles(num_tokens=300)
    q, ctx = prefill_context(case.q, case.k, case.v, 300, case.scale)

    def forbidden(device):
        raise AssertionError("the sparse path ran")

    monkeypatch.setattr(policy_module, "_ops", forbidden)
    for policy in (XAttentionPolicy(XAttentionConfig(dense_below=301)), xattn(skip_layers=4)):
        torch.testing.assert_close(run(policy, q, ctx), dense(q, ctx))


@pytest.mark.parametrize("options", [dict(threshold=0.5), dict(ratio=0.1, estimate_chunk=64)])
def test_offload_reads_the_keys_the_resident_path_reads(options):
    """Through a store that copies what it reads (the host pool's way), the policy reads every key (no
    values) for the estimate, then only the kept blocks' values, and gives the GPU cache's output. No row
    is forced dense here (``dense_last_rows=0``), so some blocks go unread."""
    case = planted.block_clusters(num_tokens=900, block_size=BLOCK, clusters_per_head=2, strength=8.0)
    q, ctx = prefill_context(case.q, case.k, case.v, 160, case.scale)
    policy = xattn(**options, dense_last_rows=0)
    resident = run(policy, q, ctx)

    reads = []

    class CompactReads(PagedLayerKV):  # the paged cache, read as the host store reads it
        def read_paged(self, ctx, blocks, values=True, width=None):
            present = blocks() if callable(blocks) else blocks
            reads.append((values, int(present.sum())))
            return self.compact_copy(ctx, present, values, width)

    ctx.kv = CompactReads(ctx.layer_id, ctx.k_cache, ctx.v_cache)
    torch.testing.assert_close(run(policy, q, ctx), resident)
    all_blocks = -(-900 // ctx.block_size)
    assert reads[0] == (False, all_blocks), "the estimate reads every key once"
    assert len(reads) == 2 and reads[1][0] and reads[1][1] < all_blocks, "values only of the kept blocks"


def test_a_threshold_table_sets_each_head(tmp_path):
    case = planted.needles(num_tokens=400)
    q, ctx = prefill_context(case.q, case.k, case.v, 400, case.scale)
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps([[1.0] * 4] * 4))  # 4 layers of 4 query heads, all dense
    policy = xattn(threshold_path=str(path), threshold=0.1)
    policy.initialize(4, 2, 64, 32, 16, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(run(policy, q, ctx), dense(q, ctx), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="has 4 layers, the model 6"):
        policy.initialize(6, 2, 64, 32, 16, torch.float32, torch.device("cpu"))
    path.write_text(json.dumps([[1.0] * 3] * 4))
    with pytest.raises(ValueError, match="gives layer 3 3 heads, the model 4"):
        run(xattn(threshold_path=str(path)), q, ctx)
    path.write_text("[[2.0]]")
    with pytest.raises(ValueError, match=r"thresholds in \(0, 1\]"):
        xattn(threshold_path=str(path))


def test_block_size_must_be_a_multiple_of_the_cache_blocks():
    with pytest.raises(ValueError, match="not a multiple of the KV cache's block_size=256"):
        xattn().initialize(2, 2, 64, 32, 256, torch.float32, torch.device("cpu"))


def test_skip_layers_are_the_dense_layers_kept_resident_under_offload():
    assert XAttentionPolicy(XAttentionConfig(skip_layers=3)).dense_layers(2) == {0, 1}
    assert XAttentionPolicy(XAttentionConfig()).dense_layers(32) == frozenset()
