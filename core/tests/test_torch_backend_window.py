"""The ``torch`` backend's sliding-window path, which reads only the blocks some query's window reaches,
against the full gather it replaced: every block of the table, masked outside the window (``_over_cache``
over ``_all_blocks``, kept here as the reference).

A window ``W`` lets the query at position ``p`` see keys ``p - W + 1 .. p``.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.attention import torch_backend
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend

# the window path sums the same nonzero terms as the reference over fewer keys: another reduction order
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (query length, context length) per sequence: a fresh prompt, chunks behind histories many windows long,
# a one-token chunk, a chunk shorter than the window
PREFILL = [(45, 45), (7, 60), (1, 41), (17, 50), (40, 90)]
DECODE = [1, 5, 17, 70, 33]
# (block size, query heads per KV head)
layouts = pytest.mark.parametrize("block_size,group", [(8, 1), (4, 4), (16, 2)],
                                  ids=["bs8-mha", "bs4-gqa4", "bs16-gqa2"])


def _batch(q_lens, ctx_lens, block_size, group, dtype=torch.float32, kv_heads=2, head_dim=16, seed=0):
    """Queries and a shuffled pool of random cache blocks, tables padded with -1, and the phase's metadata."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block_size) for c in ctx_lens]
    pool = torch.randperm(sum(nblk) + 2, generator=gen)
    tables = torch.full((len(q_lens), max(nblk) + 1), -1, dtype=torch.int32)
    for j, n in enumerate(nblk):
        tables[j, :n] = pool[sum(nblk[:j]) : sum(nblk[: j + 1])].int()
    k_cache, v_cache = (torch.randn(len(pool), block_size, kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    q = (torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen) * 2).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = PhaseMetadata(cu, torch.tensor(ctx_lens, dtype=torch.int32), tables, max(q_lens), max(ctx_lens))
    return q, k_cache, v_cache, meta, head_dim**-0.5


def _full_gather(q, k_cache, v_cache, meta, scale, window):
    """The reference: every block of each table, masked causally and by the window."""
    backend = TorchBackend()
    blocks = backend._all_blocks(meta)
    return backend._over_cache(q, k_cache, v_cache, meta, blocks, meta.context_lens, scale, True, window)[0]


def _drop_blocks_before_windows(meta: PhaseMetadata, block_size: int, window: int) -> PhaseMetadata:
    """``meta`` with -1 for the blocks wholly before every query's window, as a sliding-window KV group's
    table has once those blocks are freed."""
    first_key = (meta.context_lens - meta.query_lens - window + 1).clamp(min=0)
    idx = torch.arange(meta.block_tables.shape[1])
    tables = meta.block_tables.masked_fill(idx[None, :] < (first_key // block_size)[:, None], -1)
    return PhaseMetadata(meta.cu_seqlens_q, meta.context_lens, tables, meta.max_query_len,
                         meta.max_context_len)


def _assert_matches(out, ref, dtype, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    assert torch.isfinite(out).all(), what
    assert torch.allclose(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype]), (
        f"{what}: max error {(out.float() - ref.float()).abs().max().item():.2e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@layouts
@pytest.mark.parametrize("window", [1, 5, 8, 13, 33, 1000])
def test_window_prefill_matches_the_full_gather(window, block_size, group, dtype):
    """Chunks fresh and behind histories, several query tiles long or one row, windows smaller and larger
    than a block and than the contexts; the blocks wholly before the windows may be gone from the tables."""
    q, k_cache, v_cache, meta, scale = _batch(*zip(*PREFILL, strict=True), block_size, group, dtype)
    args = (q, None, None, k_cache, v_cache)
    out = TorchBackend().prefill(*args, meta, scale, window=window)
    ref = _full_gather(q, k_cache, v_cache, meta, scale, window)
    _assert_matches(out, ref, dtype, f"prefill, window {window}")
    if window >= max(c for _, c in PREFILL):  # the same blocks, the same keys in the same order
        assert torch.equal(out, ref)
    dropped = _drop_blocks_before_windows(meta, block_size, window)
    assert torch.equal(TorchBackend().prefill(*args, dropped, scale, window=window), out)


@layouts
@pytest.mark.parametrize("window", [1, 5, 8, 13, 33, 1000])
def test_window_decode_matches_the_full_gather(window, block_size, group):
    q, k_cache, v_cache, meta, scale = _batch([1] * len(DECODE), DECODE, block_size, group)
    out = TorchBackend().decode(q, k_cache, v_cache, meta, scale, window=window)
    _assert_matches(out, _full_gather(q, k_cache, v_cache, meta, scale, window), torch.float32,
                    f"decode, window {window}")
    if window >= max(DECODE):
        assert torch.equal(out, _full_gather(q, k_cache, v_cache, meta, scale, window))
    dropped = _drop_blocks_before_windows(meta, block_size, window)
    assert torch.equal(TorchBackend().decode(q, k_cache, v_cache, dropped, scale, window=window), out)


def test_window_work_is_bounded_by_the_window(monkeypatch):
    """Behind contexts hundreds of windows long, each query row is scored against a number of keys set by
    the window and block size alone, and the padded rows stay within a tile per sequence of the queries."""
    window, block_size = 32, 16
    scored = []  # (padded query rows, keys per row) of each softmax

    def counting_softmax(q, k, v, mask, scale):
        scored.append((q.shape[0] * q.shape[1], k.shape[1]))
        return softmax(q, k, v, mask, scale)

    softmax = torch_backend._softmax_attend
    monkeypatch.setattr(torch_backend, "_softmax_attend", counting_softmax)
    for q_lens, ctx_lens in [([1, 1], [4096, 1000]), ([1024], [1024]), ([64, 5], [4000, 2048])]:
        q, k_cache, v_cache, meta, scale = _batch(q_lens, ctx_lens, block_size, group=2, head_dim=8)
        scored.clear()
        out = TorchBackend().prefill(q, None, None, k_cache, v_cache, meta, scale, window=window)
        assert len(scored) == 1
        rows, keys = scored[0]
        assert keys <= 2 * window + 3 * block_size, f"{q_lens} of {ctx_lens}: {keys} keys per query row"
        assert rows <= len(q_lens) * (max(q_lens) + max(window, block_size)), f"{q_lens}: {rows} rows"
        _assert_matches(out, _full_gather(q, k_cache, v_cache, meta, scale, window), torch.float32,
                        f"prefill {q_lens} of {ctx_lens}")
