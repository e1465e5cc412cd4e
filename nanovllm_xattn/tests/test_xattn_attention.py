"""Block-sparse prefill attention: the torch reference against independent oracles, and the Triton kernel
against the reference.

The reference is checked against a plain causal softmax when every causal block is listed, and against key
sets written out by hand for a tiny case. The kernel is checked against the reference on random paged
inputs: on CUDA (``gpu``; one case at a realistic shape), and at small sizes under Triton's interpreter in
a subprocess (``test_kernel_under_interpreter``). The random inputs have several sequences with chunked
prefill (chunks starting off the block and tile grids, an empty chunk), GQA, one selection per KV head and
one per query head, rows with no block, rows with and without their diagonal block, garbage past every
list's count, in the rows past each chunk and in the block tables, and NaN in every cache slot no sequence
owns: a read of padding or of a foreign slot fails the check.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.sparse import paged_kv_descriptors  # noqa: E402
from nanovllm.testing import PagedBatch, assert_interpreter_cases_pass, assert_kernel_matches_reference  # noqa: E402
from nanovllm_xattn.attention import (  # noqa: E402
    BlockSparseConfig,
    block_sparse_attention,
    block_sparse_attention_reference,
)
from nanovllm_xattn.layout import num_query_blocks  # noqa: E402

CUDA = torch.cuda.is_available()
# the interpreter cases exist only inside the subprocess that test_kernel_under_interpreter starts
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

GARBAGE = [-(10**6), -1, 0, 10**6]  # what padding past a list's count may hold

# (dtype, head_dim, num_kv_heads, group, kv_block_size, per_query_head, block, config)
GPU_CONFIGS = [
    (torch.bfloat16, 128, 8, 4, 16, False, 128, None),  # the realistic shape (GPU_LONG_LENS)
    (torch.bfloat16, 128, 2, 4, 16, True, 128, None),
    (torch.float16, 64, 2, 4, 256, True, 128, None),
    (torch.bfloat16, 128, 2, 2, 16, False, 64, None),
    (torch.float32, 128, 2, 1, 32, False, 128, None),
    (torch.bfloat16, 96, 2, 2, 64, True, 256, None),
    (torch.bfloat16, 128, 2, 4, 16, False, 128, (64, 128, 4, 3)),  # key tiles larger than query tiles
    (torch.bfloat16, 256, 1, 4, 16, False, 128, None),  # Gemma 3
    (torch.float32, 256, 1, 4, 16, True, 128, None),
    # pages of whole key tiles: the defaults' TMA loads; the same without the knobs; head size 256 with TMA
    (torch.bfloat16, 128, 8, 4, 128, False, 128, None),
    (torch.bfloat16, 128, 2, 4, 128, True, 128, BlockSparseConfig(128, 128, 8, 3)),
    (torch.bfloat16, 256, 1, 4, 128, False, 128, BlockSparseConfig(64, 32, 4, 2, fused_scale=True, tma=True)),
]
INTERP_CONFIGS = [
    (torch.bfloat16, 64, 1, 4, 16, False, 64, None),
    (torch.float16, 32, 2, 2, 256, True, 64, (32, 64, 1, 1)),  # key tiles larger than query tiles
    (torch.float32, 48, 2, 1, 4, False, 128, (16, 32, 1, 1)),  # key tiles span several cache blocks
    (torch.bfloat16, 256, 1, 4, 16, False, 64, None),
    # the knobs: TMA loads from pages of 128 and of 16 keys (head sizes 128, 256), the fused scale alone
    (torch.bfloat16, 128, 1, 2, 128, False, 64, BlockSparseConfig(32, 32, 1, 1, fused_scale=True, tma=True)),
    (torch.bfloat16, 256, 1, 2, 16, True, 64, BlockSparseConfig(16, 16, 1, 1, fused_scale=True, tma=True)),
    (torch.float16, 128, 2, 1, 16, False, 128, BlockSparseConfig(32, 32, 1, 1, fused_scale=True)),
]
# (query length, context length) per sequence: a fresh prompt, a chunk starting off the block grid, one row
# over a long prefix, a chunk on the block grid, a sequence with no query in this phase
GPU_LENS = [(1000, 1000), (700, 3000), (1, 1300), (640, 2560), (333, 4100), (0, 77)]
GPU_LONG_LENS = [(3000, 3000), (1500, 4100)]
INTERP_LENS = [(100, 100), (70, 250), (1, 130), (64, 192), (0, 40)]


def _cfg_id(c) -> str:
    dt, d, hkv, g, kvbs, per_q, block, config = c
    name = f"{str(dt).removeprefix('torch.')}-d{d}-kv{hkv}-g{g}-kvbs{kvbs}-B{block}"
    name += "-perq" if per_q else ""
    if config is None:
        return name
    cfg = config if isinstance(config, BlockSparseConfig) else BlockSparseConfig(*config)
    knobs = "".join(f"-{k}" for k in ("fused_scale", "tma") if getattr(cfg, k))
    return name + f"-tiles{cfg.block_m}x{cfg.block_n}-w{cfg.num_warps}s{cfg.num_stages}" + knobs


PARAMS = [pytest.param("cuda", *c, id="gpu-" + _cfg_id(c), marks=pytest.mark.gpu) for c in GPU_CONFIGS] + [
    pytest.param("cpu", *c, id="interp-" + _cfg_id(c)) for c in (INTERP_CONFIGS if INTERP else [])
]


class Case(PagedBatch):
    """:class:`~nanovllm.testing.PagedBatch` (one cache block more than each context needs, its slots NaN)
    and the kernels' arguments."""

    def args(self, blocks: torch.Tensor, block_counts: torch.Tensor, block: int):
        dev = self.q.device
        return (self.q, self.k_cache, self.v_cache, self.tables, self.cu, self.ctx, blocks.to(dev),
                block_counts.to(dev), block, self.scale, self.max_query_len)


def pack_lists(lists, block: int, max_query_len: int, gen: torch.Generator):
    """``(blocks, block_counts)`` from nested lists ``[s][g][r] -> ascending key blocks``: every list padded
    with garbage to a common width (two padding entries at least), and the rows past each sequence's lists
    filled with garbage entries and garbage counts."""
    num_seqs, num_sel = len(lists), len(lists[0])
    rows = num_query_blocks(max_query_len, block)
    width = max([len(lst) for seq in lists for head in seq for lst in head] + [0]) + 2
    pick = torch.randint(len(GARBAGE), (num_seqs, num_sel, rows, width), generator=gen)
    blocks = torch.tensor(GARBAGE)[pick]
    counts = torch.tensor([10**6, -7])[torch.randint(2, (num_seqs, num_sel, rows), generator=gen)]
    for s in range(num_seqs):
        for g in range(num_sel):
            for r, entries in enumerate(lists[s][g]):
                blocks[s, g, r, : len(entries)] = torch.tensor(entries, dtype=torch.long)
                counts[s, g, r] = len(entries)
    return blocks.int(), counts.int()


def _row_blocks(lens, block: int) -> list[range]:
    """The query blocks of each sequence's chunk (empty for a sequence with no query)."""
    return [range((c - q) // block, (c - 1) // block + 1) if q else range(0) for q, c in lens]


def random_lists(lens, num_sel: int, block: int, gen: torch.Generator):
    """Lists of every kind, rotating over rows and heads: empty, the diagonal alone, random earlier blocks
    with the diagonal, random earlier blocks without it."""
    lists = []
    for query_blocks in _row_blocks(lens, block):
        seq = []
        for g in range(num_sel):
            head = []
            for r, qb in enumerate(query_blocks):
                kind = (g + r) % 4
                earlier = [b for b in range(qb) if torch.rand(1, generator=gen).item() < 0.5]
                head.append([[], [qb], earlier + [qb], earlier][kind])
            seq.append(head)
        lists.append(seq)
    return lists


@pytest.mark.parametrize("per_query_head", [False, True])
def test_reference_equals_dense_when_every_causal_block_is_listed(per_query_head):
    gen = torch.Generator().manual_seed(0)
    lens = [(70, 70), (30, 200), (1, 65), (90, 150)]
    block, num_kv_heads, group = 64, 2, 2
    c = Case(lens, num_kv_heads, group, 16, 16, torch.float32, "cpu", gen)
    num_sel = num_kv_heads * group if per_query_head else num_kv_heads
    every_causal_block = [[list(range(qb + 1)) for qb in rows] for rows in _row_blocks(lens, block)]
    lists = [[seq] * num_sel for seq in every_causal_block]
    blocks, counts = pack_lists(lists, block, c.max_query_len, gen)
    out, lse = block_sparse_attention_reference(*c.args(blocks, counts, block))
    want_out, want_lse = c.dense_causal()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_reference_hand_written_key_sets():
    """Three sequences, two query heads with a list each, one KV head; key sets spelled out by hand."""
    gen = torch.Generator().manual_seed(1)
    block = 64
    # seq 0: positions 130..139, one row (block 2); seq 1: a fresh 70-token prompt, rows of blocks 0 and 1;
    # seq 2: positions 100..139, rows of blocks 1 and 2
    lens = [(10, 140), (70, 70), (40, 140)]
    c = Case(lens, 1, 2, 8, 16, torch.float32, "cpu", gen)
    lists = [
        [[[0, 2]], [[1]]],
        [[[0], [0]], [[], [1]]],
        [[[1], [0, 1]], [[0], []]],
    ]

    def keys_of(s: int, h: int, p: int) -> set[int]:
        """The keys the query at position p reads, from the semantics: listed blocks, c <= p."""
        if s == 0:
            return [set(range(64)) | set(range(128, p + 1)), set(range(64, 128))][h]
        if s == 1:
            if p < 64:
                return [set(range(p + 1)), set()][h]
            return [set(range(64)), set(range(64, p + 1))][h]
        if p < 128:
            return [set(range(64, p + 1)), set(range(64))][h]
        return [set(range(128)), set()][h]

    blocks, counts = pack_lists(lists, block, c.max_query_len, gen)
    out, lse = block_sparse_attention_reference(*c.args(blocks, counts, block))
    empty_rows = 0
    for s, (q_len, ctx) in enumerate(lens):
        table = c.tables[s].long()
        keys = torch.stack([c.k_cache[table[p // 16], p % 16, 0] for p in range(ctx)]).double()
        vals = torch.stack([c.v_cache[table[p // 16], p % 16, 0] for p in range(ctx)]).double()
        for h in range(2):
            for r in range(q_len):
                t, p = int(c.cu[s]) + r, ctx - q_len + r
                read = sorted(keys_of(s, h, p))
                if not read:
                    assert torch.all(out[t, h] == 0) and lse[t, h] == float("-inf"), (s, h, r)
                    empty_rows += 1
                    continue
                scores = keys[read] @ c.q[t, h].double() * c.scale
                torch.testing.assert_close(out[t, h].double(), torch.softmax(scores, 0) @ vals[read],
                                           rtol=1e-5, atol=1e-5, msg=f"out {(s, h, r)}")
                assert abs(lse[t, h].item() - torch.logsumexp(scores, 0).item()) < 1e-5, (s, h, r)
    assert empty_rows == 64 + 12


@pytest.mark.parametrize(
    "device,dtype,head_dim,num_kv_heads,group,kv_block_size,per_query_head,block,config", PARAMS)
def test_kernel_matches_reference(device, dtype, head_dim, num_kv_heads, group, kv_block_size, per_query_head,
                                  block, config, splits=None):
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    if device == "cuda":
        lens = GPU_LONG_LENS if num_kv_heads * group == 32 else GPU_LENS
    else:
        lens = INTERP_LENS
    c = Case(lens, num_kv_heads, group, head_dim, kv_block_size, dtype, device, gen)
    num_sel = num_kv_heads * group if per_query_head else num_kv_heads
    if isinstance(config, BlockSparseConfig) and config.tma:  # the engine's caches: each a contiguous tensor
        c.k_cache, c.v_cache = c.k_cache.contiguous(), c.v_cache.contiguous()
        if kv_block_size % config.block_n == 0:
            assert paged_kv_descriptors(c.k_cache, c.v_cache, config.block_n) is not None, "no TMA loads"
    args = c.args(*pack_lists(random_lists(lens, num_sel, block, gen), block, c.max_query_len, gen), block)
    out, lse = block_sparse_attention(*args, config=config, splits=splits)
    ref_out, ref_lse = block_sparse_attention_reference(*args)
    assert_kernel_matches_reference(out, lse, ref_out, ref_lse, f"seed {seed}")


# (config, splits): each query tile's list read by several programs and merged, splits that divide the lists
# unevenly and more splits than a short list has tiles
SPLIT_PARAMS = [pytest.param("cuda", GPU_CONFIGS[i], n, id=f"gpu-{_cfg_id(GPU_CONFIGS[i])}-splits{n}",
                             marks=pytest.mark.gpu) for i, n in ((7, 4), (7, 3), (0, 4), (8, 2))]
SPLIT_PARAMS += [pytest.param("cpu", INTERP_CONFIGS[1], 3, id=f"interp-{_cfg_id(INTERP_CONFIGS[1])}-splits3")
                 ] if INTERP else []


@pytest.mark.parametrize("device,config,splits", SPLIT_PARAMS)
def test_split_lists_match_reference(device, config, splits):
    test_kernel_matches_reference(device, *config, splits=splits)


def test_kernel_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, len(INTERP_CONFIGS) + 1)


def test_bad_inputs_are_refused_up_front():
    gen = torch.Generator().manual_seed(2)
    lens = [(130, 130)]  # three rows at block 64
    c = Case(lens, 1, 4, 16, 16, torch.float32, "cpu", gen)
    lists = [[[[0], [0, 1], [2]]]]
    blocks, counts = pack_lists(lists, 64, c.max_query_len, gen)
    for fn in (block_sparse_attention, block_sparse_attention_reference):
        for bad_block in (32, 96):
            with pytest.raises(ValueError, match="power of two >= 64"):
                fn(*c.args(blocks, counts, bad_block))
        with pytest.raises(ValueError, match="must divide the query heads"):
            fn(*c.args(blocks.expand(1, 3, -1, -1), counts.expand(1, 3, -1), 64))
        with pytest.raises(ValueError, match="needs 4"):
            fn(*c.args(blocks[:, :, :2], counts[:, :, :2], 64))
        with pytest.raises(ValueError, match=r"expected \[1, Hs, R, width\]"):
            fn(*c.args(blocks[0], counts[0], 64))
        with pytest.raises(ValueError, match="one dtype"):
            fn(c.q.half(), *c.args(blocks, counts, 64)[1:])
    for broken in ([[[[0], [1, 0], [2]]]], [[[[0], [0, 2], [2]]]], [[[[-1], [0], [2]]]]):
        with pytest.raises(ValueError, match="breaks the contract"):
            block_sparse_attention_reference(*c.args(*pack_lists(broken, 64, c.max_query_len, gen), 64))
    if not INTERP:
        with pytest.raises(ValueError, match="block_sparse_attention_reference on the CPU"):
            block_sparse_attention(*c.args(blocks, counts, 64))
