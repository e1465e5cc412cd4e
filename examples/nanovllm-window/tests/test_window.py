"""Tests of the window policy, at the level of block selection and of attention outputs.

Run them against an installed copy: ``pip install -e . && pytest tests``.
"""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.plugins import get_plugins
from nanovllm.policy import PolicyContext
from nanovllm.selection import SelectionError, resolve_sparse_policy
from nanovllm_window.config import WindowConfig
from nanovllm_window.policy import WindowPolicy

BLOCK = 4


def decode_context(lens: list[int], max_blocks: int, seed: int = 0) -> tuple[torch.Tensor, PolicyContext]:
    """A decode batch over a random paged cache; sequence s owns physical blocks in reverse order."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    num_blocks = len(lens) * max_blocks
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    for s, n in enumerate(lens):
        used = (n + BLOCK - 1) // BLOCK
        tables[s, :used] = torch.arange(used, dtype=torch.int32).flip(0) + s * max_blocks
    meta = PhaseMetadata(
        cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_context_len=max(lens),
    )
    q = torch.randn(len(lens), heads, dim, generator=g)
    ctx = PolicyContext(0, False, q, meta, k_cache, v_cache, dim**-0.5, TorchBackend())
    return q, ctx


def expected_blocks(n: int, sink: int, recent: int) -> list[int]:
    return sorted({j for j in range(n) if j < sink or j >= n - recent})


@pytest.mark.parametrize(("sink", "recent"), [(0, 1), (1, 2), (2, 3), (3, 1)])
def test_selects_sinks_and_recent_blocks(sink, recent):
    lens = [1, 4, 5, 9, 17, 30, 40]
    _, ctx = decode_context(lens, max_blocks=10)
    blocks = WindowPolicy(WindowConfig(sink, recent)).select_blocks(ctx)
    assert blocks.dtype == torch.int32
    for s, n in enumerate(lens):
        row = blocks[s].tolist()
        picked = [b for b in row if b >= 0]
        assert row == picked + [-1] * (len(row) - len(picked)), "-1 padding comes last"
        assert picked == expected_blocks((n + BLOCK - 1) // BLOCK, sink, recent)


def test_budget_covering_every_block_is_dense_attention():
    q, ctx = decode_context([3, 9, 16, 21], max_blocks=6)
    dense = TorchBackend().decode(q, ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
    windowed = WindowPolicy(WindowConfig(2, 4)).compute_chunked_decode(q, ctx)
    torch.testing.assert_close(windowed, dense)


def test_small_budget_attends_to_the_window_only():
    q, ctx = decode_context([40], max_blocks=10)
    windowed = WindowPolicy(WindowConfig(1, 2)).compute_chunked_decode(q, ctx)
    dense = TorchBackend().decode(q, ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
    assert (windowed - dense).abs().max() > 1e-3
    # The same as dense attention over the cache with every block outside the window wiped out.
    keep = [0, 8, 9]
    mask = torch.zeros(10 * BLOCK, dtype=torch.bool)
    for b in keep:
        mask[b * BLOCK : (b + 1) * BLOCK] = True
    k = ctx.k_cache[ctx.meta.block_tables[0].long()].reshape(-1, 2, 8)[mask]
    v = ctx.v_cache[ctx.meta.block_tables[0].long()].reshape(-1, 2, 8)[mask]
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    probs = torch.softmax(torch.einsum("hd,khd->hk", q[0], k) * ctx.scale, dim=-1)
    torch.testing.assert_close(windowed[0], torch.einsum("hk,khd->hd", probs, v))


def test_selection_string_and_validation():
    if "window" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    resolved = resolve_sparse_policy("Window:sink_blocks=2,recent_blocks=8")
    assert resolved.cls is WindowPolicy and resolved.config == WindowConfig(2, 8)
    with pytest.raises(SelectionError, match="recent_blocks must be an int >= 1"):
        resolve_sparse_policy("window:recent_blocks=0")
    with pytest.raises(SelectionError, match="Accepted: sink_blocks, recent_blocks"):
        resolve_sparse_policy("window:size=3")
