"""Pattern estimation: the torch reference against a per-row loop over a plain softmax and against the
invariants of attention sums, and the Triton ``estimate`` against the reference, on CUDA (``gpu``) and at
small sizes under Triton's interpreter in a subprocess (``test_estimate_under_interpreter``)."""

from __future__ import annotations

import os

import pytest
import torch
from nanovllm.testing import assert_interpreter_cases_pass, paged_query_keys
from nanovllm_minference.estimate import estimate_reference

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

# (query length, context length) per sequence: a fresh prompt, chunked prefill (context > query), one
# token over a prefix, a chunk shorter than last_q, a chunk crossing tile and block boundaries
LENS = [(20, 20), (7, 40), (1, 18), (33, 70)]
GPU_LENS = [(300, 300), (77, 1000), (1, 513), (129, 4100), (64, 64)]


def make_case(lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen):
    """:func:`~nanovllm.testing.paged_query_keys` with q twice a standard normal (a peaked softmax)."""
    return paged_query_keys(lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen, q_scale=2.0)


def row_loop_oracle(case, last_q):
    """Vertical and slash sums by plain loops over sequences, heads and rows."""
    q, k_cache, tables = case["q"].float(), case["k_cache"].float(), case["block_tables"]
    cu, ctx_lens = case["cu_seqlens_q"].tolist(), case["context_lens"].tolist()
    block_size, heads, kv_heads = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    width = max(ctx_lens)
    vertical = torch.zeros(len(ctx_lens), heads, width)
    slash = torch.zeros_like(vertical)
    for s, ctx in enumerate(ctx_lens):
        keys = torch.stack([k_cache[int(tables[s, c // block_size]), c % block_size] for c in range(ctx)])
        n = min(last_q, cu[s + 1] - cu[s])
        for h in range(heads):
            for j in range(n):
                p = ctx - n + j
                row = q[cu[s + 1] - n + j, h]
                attn = torch.softmax(keys[: p + 1, h // (heads // kv_heads)] @ row * case["scale"], 0)
                vertical[s, h, : p + 1] += attn
                slash[s, h, : p + 1] += attn.flip(0)  # offset o reads key p - o
    return vertical, slash


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("last_q", [8, 64])
def test_reference_against_row_loop(block_size, last_q):
    gen = torch.Generator().manual_seed(block_size + last_q)
    case = make_case(LENS, num_kv_heads=2, group=2, head_dim=16, block_size=block_size,
                     dtype=torch.float32, device="cpu", gen=gen)
    vertical, slash = estimate_reference(**case, last_q=last_q)
    want_vertical, want_slash = row_loop_oracle(case, last_q)
    torch.testing.assert_close(vertical, want_vertical, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(slash, want_slash, rtol=1e-5, atol=1e-5)


def check_sums(vertical, slash, case, last_q, width):
    """Each row's attention sums to 1, so both sums total the number of rows; nothing past a context."""
    q_lens = (case["cu_seqlens_q"][1:] - case["cu_seqlens_q"][:-1]).cpu()
    rows = q_lens.clamp(max=last_q).float()[:, None].expand(-1, vertical.shape[1])
    assert vertical.shape == slash.shape == (len(q_lens), case["q"].shape[1], width)
    assert vertical.dtype == slash.dtype == torch.float32
    torch.testing.assert_close(vertical.sum(2).cpu(), rows, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(slash.sum(2).cpu(), rows, rtol=1e-4, atol=1e-4)
    assert (vertical >= 0).all() and (slash >= 0).all()
    past = torch.arange(width, device=vertical.device) >= case["context_lens"][:, None]
    assert (vertical[past[:, None].expand_as(vertical)] == 0).all()
    assert (slash[past[:, None].expand_as(slash)] == 0).all()


def test_reference_sums():
    gen = torch.Generator().manual_seed(3)
    case = make_case(LENS, num_kv_heads=2, group=4, head_dim=32, block_size=16, dtype=torch.bfloat16,
                     device="cpu", gen=gen)
    vertical, slash = estimate_reference(**case, last_q=16, max_context_len=80)  # padded past the longest
    check_sums(vertical, slash, case, 16, 80)
    # the newest row of a fresh prompt reads its own key at offset 0, the oldest key at offset p
    assert (slash[0, :, 0] > 0).all() and (vertical[0, :, 19] > 0).all()


def test_reference_no_rows():
    gen = torch.Generator().manual_seed(4)
    case = make_case([(1, 5), (2, 9)], num_kv_heads=1, group=1, head_dim=8, block_size=4,
                     dtype=torch.float32, device="cpu", gen=gen)
    case["cu_seqlens_q"] = torch.tensor([0, 0, 0], dtype=torch.int32)  # no query rows at all
    vertical, slash = estimate_reference(**case)
    assert vertical.shape == (2, 1, 9) and not vertical.any() and not slash.any()


def test_bad_arguments():
    gen = torch.Generator().manual_seed(5)
    case = make_case([(4, 8)], num_kv_heads=1, group=1, head_dim=8, block_size=4, dtype=torch.float32,
                     device="cpu", gen=gen)
    with pytest.raises(ValueError, match="last_q"):
        estimate_reference(**case, last_q=0)
    with pytest.raises(ValueError, match="max_context_len"):
        estimate_reference(**case, max_context_len=4)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

GPU_CONFIGS = [  # (dtype, group, block_size, last_q)
    (torch.bfloat16, 4, 16, 64), (torch.float16, 1, 128, 64), (torch.bfloat16, 8, 16, 64),
    (torch.float32, 4, 16, 64), (torch.bfloat16, 7, 256, 100), (torch.bfloat16, 4, 32, 16),
]
GPU_PARAMS = [
    pytest.param("cuda", dt, g, bs, lq, id=f"gpu-{str(dt)[6:]}-g{g}-bs{bs}-q{lq}", marks=pytest.mark.gpu)
    for dt, g, bs, lq in GPU_CONFIGS
]
# the interpreter cases exist only inside the subprocess that test_estimate_under_interpreter starts
INTERP_PARAMS = [
    pytest.param("cpu", dt, g, bs, lq, id=f"interp-{str(dt)[6:]}-g{g}-bs{bs}-q{lq}")
    for dt, g, bs, lq in [(torch.bfloat16, 2, 16, 16), (torch.float32, 3, 4, 64), (torch.float16, 1, 32, 8)]
] if INTERP else []


@pytest.mark.parametrize("device,dtype,group,block_size,last_q", GPU_PARAMS + INTERP_PARAMS)
def test_estimate_against_reference(device, dtype, group, block_size, last_q, head_dim=None):
    pytest.importorskip("triton")
    from nanovllm_minference.estimate import estimate

    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    lens = GPU_LENS if device == "cuda" else LENS
    case = make_case(lens, num_kv_heads=2, group=group, head_dim=head_dim or (128 if device == "cuda" else 32),
                     block_size=block_size, dtype=dtype, device=device, gen=gen)
    width = max(c for _, c in lens) + 5  # padded: the extra columns stay 0
    vertical, slash = estimate(**case, last_q=last_q, max_context_len=width)
    want_vertical, want_slash = estimate_reference(**case, last_q=last_q, max_context_len=width)
    check_sums(vertical, slash, case, last_q, width)
    for got, want, what in [(vertical, want_vertical, "vertical"), (slash, want_slash, "slash")]:
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-3, f"{what}: relative error {err:.2e} (seed {seed})"
        assert (got - want).abs().max().item() < 2e-2, f"{what} (seed {seed})"
    again = estimate(**case, last_q=last_q, max_context_len=width)
    assert torch.equal(again[0], vertical) and torch.equal(again[1], slash), "not deterministic"


HEAD_256_PARAMS = [pytest.param("cuda", dt, id=f"gpu-{str(dt)[6:]}", marks=pytest.mark.gpu)
                   for dt in (torch.bfloat16, torch.float32)]
HEAD_256_PARAMS += [pytest.param("cpu", torch.bfloat16, id="interp-bfloat16")] if INTERP else []


@pytest.mark.parametrize("device,dtype", HEAD_256_PARAMS)
def test_estimate_at_head_size_256(device, dtype):
    """Gemma 3's head size (256, 4 query heads a KV head)."""
    test_estimate_against_reference(device, dtype, 4, 16, 64 if device == "cuda" else 16, head_dim=256)


def test_estimate_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, 4)
