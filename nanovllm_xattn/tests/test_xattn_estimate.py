"""Strided antidiagonal block scores: the torch reference against a direct computation from a dense
``q.k^T`` and against the invariants of the scores (row totals, block causality, chunked prefill), and the
Triton ``block_scores`` against the reference, on CUDA (``gpu``) and at small sizes under Triton's
interpreter in a subprocess (``test_block_scores_under_interpreter``)."""

from __future__ import annotations

import os

import pytest
import torch
from nanovllm.testing import assert_interpreter_cases_pass, paged_query_keys
from nanovllm_xattn.estimate import block_scores_reference
from nanovllm_xattn.layout import first_query_blocks, num_key_blocks, num_query_blocks

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

# (query length, context length) per sequence: a fresh prompt, chunked prefill with q0 = 143 (not a
# multiple of any stride or block), one token over a prefix, a chunk starting at 90 crossing blocks
LENS = [(20, 20), (7, 150), (1, 70), (100, 190)]
GPU_LENS = [(3000, 3000), (1000, 4100), (1, 2049), (513, 513), (77, 300)]


def make_case(lens, num_kv_heads, group, head_dim, kv_block_size, dtype, device, gen):
    """:func:`~nanovllm.testing.paged_query_keys` with the longest query and context."""
    case = paged_query_keys(lens, num_kv_heads, group, head_dim, kv_block_size, dtype, device, gen)
    return case | dict(max_query_len=max(q for q, _ in lens), max_context_len=max(c for _, c in lens))


def taking_part_rows(case, stride, block):
    """``[S, num_query_blocks]``: how many reshaped rows of each row's query block take part."""
    cu, ctx_lens = case["cu_seqlens_q"].tolist(), case["context_lens"].tolist()
    want = torch.zeros(len(ctx_lens), num_query_blocks(case["max_query_len"], block))
    for s, ctx in enumerate(ctx_lens):
        q0 = ctx - (cu[s + 1] - cu[s])
        for i in range(q0 // stride, (ctx - 1) // stride + 1) if ctx > q0 else ():
            want[s, i * stride // block - q0 // block] += 1
    return want


def antidiagonal_oracle(case, stride, block):
    """The scores straight from the definition: dense ``q.k^T`` by position, each logit the sum of an
    antidiagonal of its ``stride x stride`` tile, a softmax per reshaped row, sums by block."""
    q, k_cache, tables = case["q"].float(), case["k_cache"].float(), case["block_tables"]
    cu, ctx_lens = case["cu_seqlens_q"].tolist(), case["context_lens"].tolist()
    kv_block_size, heads, kv_heads = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    scores = torch.zeros(len(ctx_lens), heads, num_query_blocks(case["max_query_len"], block),
                         num_key_blocks(case["max_context_len"], block))
    for s, ctx in enumerate(ctx_lens):
        q0 = ctx - (cu[s + 1] - cu[s])
        padded = -(-ctx // stride) * stride
        q_pos = torch.zeros(padded, heads, q.shape[2])
        q_pos[q0:ctx] = q[cu[s]: cu[s + 1]]
        keys = torch.zeros(padded, kv_heads, q.shape[2])
        for c in range(ctx):
            keys[c] = k_cache[int(tables[s, c // kv_block_size]), c % kv_block_size]
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        dense = torch.einsum("phd,chd->hpc", q_pos, keys)  # [H, positions, positions]
        t = torch.arange(stride)
        for i in range(q0 // stride, (ctx - 1) // stride + 1) if ctx > q0 else ():
            j = torch.arange(i + 1)
            anti = dense[:, i * stride + stride - 1 - t, j[:, None] * stride + t]  # [H, i + 1, stride]
            probs = torch.softmax(anti.sum(2) * case["scale"] / stride, dim=1)
            r = i * stride // block - q0 // block
            scores[s, :, r].index_add_(1, j * stride // block, probs)
    return scores


def reference(case, stride, block):
    return block_scores_reference(**case, stride=stride, block=block)


@pytest.mark.parametrize("stride,block,kv_block_size", [(4, 64, 16), (2, 64, 4), (8, 128, 4), (64, 64, 32)])
def test_reference_against_antidiagonal_oracle(stride, block, kv_block_size):
    gen = torch.Generator().manual_seed(stride + block + kv_block_size)
    case = make_case(LENS, num_kv_heads=2, group=2, head_dim=16, kv_block_size=kv_block_size,
                     dtype=torch.float32, device="cpu", gen=gen)
    torch.testing.assert_close(reference(case, stride, block), antidiagonal_oracle(case, stride, block),
                               rtol=1e-5, atol=1e-5)


def check_scores(scores, case, stride, block):
    """Shape and dtype; each row totals its taking-part reshaped rows; nothing right of a row's diagonal,
    past a sequence's keys or in padding rows."""
    num_seqs, heads = case["context_lens"].shape[0], case["q"].shape[1]
    num_rows = num_query_blocks(case["max_query_len"], block)
    num_cols = num_key_blocks(case["max_context_len"], block)
    assert scores.shape == (num_seqs, heads, num_rows, num_cols) and scores.dtype == torch.float32
    scores = scores.cpu()
    assert (scores >= 0).all()
    want = taking_part_rows(case, stride, block)[:, None].expand(-1, heads, -1)
    torch.testing.assert_close(scores.sum(3), want, rtol=1e-4, atol=1e-4)
    row_block = first_query_blocks(case["cu_seqlens_q"], case["context_lens"], block).cpu()[:, None] \
        + torch.arange(num_rows)
    allowed = torch.arange(num_cols) <= row_block[..., None]  # [S, rows, cols]; padding rows sum to 0 above
    assert (scores[~allowed[:, None].expand_as(scores)] == 0).all()


def test_reference_invariants():
    gen = torch.Generator().manual_seed(3)
    case = make_case(LENS, num_kv_heads=2, group=4, head_dim=32, kv_block_size=16, dtype=torch.bfloat16,
                     device="cpu", gen=gen)
    case["max_query_len"], case["max_context_len"] = 130, 300  # padded grid: the extra rows/cols stay 0
    for stride in (2, 8, 64):
        check_scores(reference(case, stride, 64), case, stride, 64)


def test_chunked_prefill_matches_whole_prompt():
    """A chunk's rows are aligned to the END of its keys: its whole query blocks score as the same blocks
    of the prompt scored at once; its partial first block keeps only the rows of the chunk."""
    gen = torch.Generator().manual_seed(7)
    stride, block, prompt, q0 = 4, 64, 250, 77
    whole = make_case([(prompt, prompt)], num_kv_heads=1, group=2, head_dim=16, kv_block_size=16,
                      dtype=torch.float32, device="cpu", gen=gen)
    chunk = dict(whole, q=whole["q"][q0:], max_query_len=prompt - q0,
                 cu_seqlens_q=torch.tensor([0, prompt - q0], dtype=torch.int32))
    got, want = reference(chunk, stride, block), reference(whole, stride, block)
    first = q0 // block
    rows = -(-prompt // block) - first
    torch.testing.assert_close(got[:, :, 1:rows], want[:, :, first + 1: first + rows], rtol=1e-5, atol=1e-6)
    check_scores(got, chunk, stride, block)
    assert got[0, 0, 0].sum() == pytest.approx(block // stride - q0 % block // stride, abs=1e-4)


def test_reference_no_queries():
    gen = torch.Generator().manual_seed(4)
    case = make_case([(1, 5), (2, 9)], num_kv_heads=1, group=1, head_dim=8, kv_block_size=4,
                     dtype=torch.float32, device="cpu", gen=gen)
    case["cu_seqlens_q"] = torch.tensor([0, 0, 0], dtype=torch.int32)
    scores = reference(case, 4, 64)
    assert scores.shape == (2, 1, 2, 1) and not scores.any()


def test_bad_arguments():
    gen = torch.Generator().manual_seed(5)
    case = make_case([(4, 8)], num_kv_heads=1, group=1, head_dim=8, kv_block_size=4, dtype=torch.float32,
                     device="cpu", gen=gen)
    for stride, block, match in [(3, 64, "stride=3"), (128, 128, "stride=128"), (1, 64, "stride=1"),
                                 (4, 32, "block=32"), (4, 96, "block=96")]:
        with pytest.raises(ValueError, match=match):
            reference(case, stride, block)
    with pytest.raises(ValueError, match="max_context_len"):
        block_scores_reference(**dict(case, max_context_len=4), stride=4, block=64)
    with pytest.raises(ValueError, match="head dims must match"):
        block_scores_reference(**dict(case, q=case["q"][:, :, :4]), stride=4, block=64)
    with pytest.raises(ValueError, match="one entry / row per sequence"):
        block_scores_reference(**dict(case, cu_seqlens_q=torch.tensor([0, 2, 4])), stride=4, block=64)


def test_triton_bad_arguments():
    pytest.importorskip("triton")
    from nanovllm_xattn.estimate import block_scores

    gen = torch.Generator().manual_seed(6)
    case = make_case([(4, 8)], num_kv_heads=1, group=1, head_dim=8, kv_block_size=4, dtype=torch.float32,
                     device="cpu", gen=gen)
    with pytest.raises(ValueError, match="larger stride"):
        block_scores(**case, stride=2, block=512)
    if not INTERP:
        with pytest.raises(ValueError, match="CUDA"):
            block_scores(**case, stride=4, block=64)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

GPU_CONFIGS = [  # (dtype, group, kv_block_size, stride, block)
    (torch.bfloat16, 4, 16, 8, 128), (torch.bfloat16, 4, 16, 16, 128), (torch.bfloat16, 4, 256, 4, 128),
    (torch.float16, 1, 16, 2, 64), (torch.bfloat16, 2, 4, 8, 128), (torch.float32, 4, 16, 8, 128),
    (torch.bfloat16, 4, 16, 64, 256), (torch.bfloat16, 4, 16, 64, 64), (torch.bfloat16, 7, 32, 2, 256),
]
GPU_PARAMS = [
    pytest.param("cuda", *c, None, id=f"gpu-{str(c[0])[6:]}-g{c[1]}-kv{c[2]}-s{c[3]}-b{c[4]}",
                 marks=pytest.mark.gpu)
    for c in GPU_CONFIGS
]
# the interpreter cases exist only inside the subprocess that test_block_scores_under_interpreter starts;
# its default tiles are 32 x 32: one case takes 16 x 16 tiles, so that several row and key tiles are used
INTERP_PARAMS = [
    pytest.param("cpu", *c, id=f"interp-{str(c[0])[6:]}-g{c[1]}-kv{c[2]}-s{c[3]}-b{c[4]}")
    for c in [(torch.bfloat16, 2, 16, 4, 64, None), (torch.float32, 1, 4, 8, 64, (16, 16, 1, 1)),
              (torch.float16, 3, 32, 2, 64, None), (torch.float32, 1, 16, 32, 64, None)]
] if INTERP else []


@pytest.mark.parametrize("device,dtype,group,kv_block_size,stride,block,config", GPU_PARAMS + INTERP_PARAMS)
def test_block_scores_against_reference(device, dtype, group, kv_block_size, stride, block, config,
                                        head_dim=None):
    pytest.importorskip("triton")
    from nanovllm_xattn.estimate import block_scores

    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    gpu = device == "cuda"
    case = make_case(GPU_LENS if gpu else LENS, num_kv_heads=8 if gpu else 2, group=group,
                     head_dim=head_dim or (128 if gpu else 32), kv_block_size=kv_block_size, dtype=dtype, device=device,
                     gen=gen)
    case["max_query_len"] += 5  # a padded grid: the extra rows and columns stay 0
    case["max_context_len"] += block
    got = block_scores(**case, stride=stride, block=block, config=config)
    want = reference(case, stride, block)
    check_scores(got, case, stride, block)
    err = (got - want).abs().max().item()  # a row totals block / stride, an entry is at most that
    assert err <= 1e-3 * (block // stride), f"max error {err:.2e} (seed {seed})"
    if gpu:  # the interpreter runs programs one after another
        assert torch.equal(block_scores(**case, stride=stride, block=block), got), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (16, 16, 4, 2)])
def test_block_scores_tile_configs(config):
    """Every tile choice the lead may tune to gives the reference's scores (block 128, stride 8)."""
    from nanovllm_xattn.estimate import block_scores

    gen = torch.Generator().manual_seed(11)
    case = make_case(GPU_LENS, num_kv_heads=8, group=4, head_dim=128, kv_block_size=16, dtype=torch.bfloat16,
                     device="cuda", gen=gen)
    got = block_scores(**case, stride=8, block=128, config=config)
    want = reference(case, 8, 128)
    assert (got - want).abs().max().item() <= 1e-3 * 16


@pytest.mark.gpu
def test_block_scores_chunked_prefill_on_gpu():
    """The chunk-alignment property on the Triton path (q0 = 1003: a multiple of neither the stride nor
    the block)."""
    from nanovllm_xattn.estimate import block_scores

    gen = torch.Generator().manual_seed(12)
    stride, block, prompt, q0 = 8, 128, 3000, 1003
    whole = make_case([(prompt, prompt)], num_kv_heads=8, group=4, head_dim=128, kv_block_size=16,
                      dtype=torch.bfloat16, device="cuda", gen=gen)
    chunk = dict(whole, q=whole["q"][q0:], max_query_len=prompt - q0,
                 cu_seqlens_q=torch.tensor([0, prompt - q0], dtype=torch.int32, device="cuda"))
    got = block_scores(**chunk, stride=stride, block=block)
    want = block_scores(**whole, stride=stride, block=block)
    first, rows = q0 // block, -(-prompt // block) - q0 // block
    torch.testing.assert_close(got[:, :, 1:rows], want[:, :, first + 1: first + rows], rtol=1e-4, atol=1e-4)
    check_scores(got, chunk, stride, block)


HEAD_256_PARAMS = [pytest.param("cuda", dt, id=f"gpu-{str(dt)[6:]}", marks=pytest.mark.gpu)
                   for dt in (torch.bfloat16, torch.float32)]
HEAD_256_PARAMS += [pytest.param("cpu", torch.bfloat16, id="interp-bfloat16")] if INTERP else []


@pytest.mark.parametrize("device,dtype", HEAD_256_PARAMS)
def test_block_scores_at_head_size_256(device, dtype):
    """Gemma 3's head size (256, 4 query heads a KV head), at the default tiles."""
    test_block_scores_against_reference(device, dtype, 4, 16, 8 if device == "cuda" else 4,
                                        128 if device == "cuda" else 64, None, head_dim=256)


def test_block_scores_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, 5)
