"""Sparse prefill attention: the torch reference against independent oracles, and the Triton kernel against
the reference.

The reference (:func:`sparse_attention_reference`) is checked against a plain causal softmax when the
index covers every key (in each of its three forms), and against masks written out by hand for a tiny
case. The kernel is checked against the reference on random paged inputs: on CUDA (``gpu``), and at
small sizes under Triton's interpreter in a subprocess (``test_kernel_under_interpreter``). The random
inputs have several sequences with chunked prefill (context > query, chunk starts off the tile grid),
GQA, per-head list lengths including empty ones, columns inside slash tiles, block-sparse heads, rows
that read nothing, garbage past every list's count and in the block tables, and NaN in every cache slot
no sequence owns: a read of padding or of a foreign slot fails the check.
"""

from __future__ import annotations

import os

import attrs
import pytest
import torch

pytest.importorskip("triton")

from nanovllm.sparse import paged_kv_descriptors  # noqa: E402
from nanovllm.testing import PagedBatch, assert_interpreter_cases_pass, assert_kernel_matches_reference  # noqa: E402
from nanovllm_minference.attention import (  # noqa: E402
    SparseKernelConfig,
    index_density,
    kernel_config,
    sparse_attention,
    sparse_attention_reference,
)
from nanovllm_minference.index import TILE, SparseIndex, computed_density  # noqa: E402

CUDA = torch.cuda.is_available()
# the interpreter cases exist only inside the subprocess that test_kernel_under_interpreter starts
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

GARBAGE = [-(10**6), -1, 0, 10**6]  # what padding past a list's count may hold

# (dtype, head_dim, num_kv_heads, group, block_size, with_blocks)
GPU_CONFIGS = [
    (torch.bfloat16, 128, 2, 4, 16, True),
    (torch.bfloat16, 128, 2, 4, 128, False),
    (torch.float16, 64, 4, 1, 256, True),
    (torch.bfloat16, 64, 1, 8, 32, True),
    (torch.float32, 128, 2, 2, 16, True),
    (torch.float16, 96, 2, 2, 64, True),
    (torch.bfloat16, 256, 1, 4, 16, True),  # Gemma 3
    (torch.float32, 256, 1, 4, 16, True),
]
INTERP_CONFIGS = [
    (torch.bfloat16, 64, 1, 4, 16, True),
    (torch.float16, 32, 2, 1, 128, False),
    (torch.float32, 48, 1, 2, 32, True),
    (torch.bfloat16, 256, 1, 4, 16, True),
]
# (query length, context length) per sequence: a fresh prompt, a chunk starting off the tile grid, one
# row over a long prefix, a chunk on the tile grid
GPU_LENS = [(1000, 1000), (700, 3000), (1, 1300), (640, 2560), (333, 4100)]
INTERP_LENS = [(100, 100), (70, 250), (1, 130), (64, 192)]


def _cfg_id(c) -> str:
    dt, d, hkv, g, bs, blocks = c
    return f"{str(dt).removeprefix('torch.')}-d{d}-kv{hkv}-g{g}-bs{bs}" + ("-blocks" if blocks else "")


PARAMS = [pytest.param("cuda", *c, id="gpu-" + _cfg_id(c), marks=pytest.mark.gpu) for c in GPU_CONFIGS] + [
    pytest.param("cpu", *c, id="interp-" + _cfg_id(c)) for c in (INTERP_CONFIGS if INTERP else [])
]


def _tiles(n: int) -> int:
    return -(-n // TILE)


def make_index(slash, columns, blocks, cover_r: int, gen: torch.Generator) -> SparseIndex:
    """A :class:`SparseIndex` from nested lists ``[s][h] -> list`` (``blocks[s][h][m] -> list``, or None),
    each list padded with garbage to the common width."""

    def pack(lists, *lead):
        width = max([len(x) for x in lists] + [1]) + 2  # at least two padding entries everywhere
        data = torch.tensor(GARBAGE)[torch.randint(len(GARBAGE), (*lead, width), generator=gen)].int()
        counts = torch.zeros(*lead, dtype=torch.int32)
        for flat, entries in enumerate(lists):
            data.view(-1, width)[flat, : len(entries)] = torch.tensor(sorted(entries), dtype=torch.int32)
            counts.view(-1)[flat] = len(entries)
        return data, counts

    num_seqs, num_heads = len(slash), len(slash[0])
    flat_slash = [slash[s][h] for s in range(num_seqs) for h in range(num_heads)]
    flat_cols = [columns[s][h] for s in range(num_seqs) for h in range(num_heads)]
    slash_tiles, slash_counts = pack(flat_slash, num_seqs, num_heads)
    cols, col_counts = pack(flat_cols, num_seqs, num_heads)
    cover = torch.zeros(num_seqs, num_heads, cover_r + 2, dtype=torch.int8)
    for s in range(num_seqs):
        for h in range(num_heads):
            for d in slash[s][h]:
                cover[s, h, d + cover_r] = 1
    if blocks is None:
        return SparseIndex(cols, col_counts, slash_tiles, slash_counts, cover)
    num_qtiles = max(len(blocks[s][h]) for s in range(num_seqs) for h in range(num_heads))
    flat_blocks = [
        blocks[s][h][m] if m < len(blocks[s][h]) else []
        for s in range(num_seqs) for h in range(num_heads) for m in range(num_qtiles)
    ]
    blk, blk_counts = pack(flat_blocks, num_seqs, num_heads, num_qtiles)
    return SparseIndex(cols, col_counts, slash_tiles, slash_counts, cover, blk, blk_counts)


def _subset(items: list[int], fraction: float, gen: torch.Generator) -> list[int]:
    keep = torch.rand(len(items), generator=gen) < fraction
    return [x for x, k in zip(items, keep.tolist(), strict=True) if k]


def random_index(lens, num_heads: int, with_blocks: bool, gen: torch.Generator) -> SparseIndex:
    """Every sequence has each kind of head: vertical-slash (columns overlap the slash tiles), block-sparse
    (or a second vertical-slash head), one whose only slash tile is offset 1 plus a couple of columns
    (rows before them read nothing), and an empty one. The kinds rotate over heads from sequence to
    sequence, so each KV group meets several."""
    cover_r = max(_tiles(c) for _, c in lens)
    num_qtiles = max(_tiles(q) for q, _ in lens)
    slash, columns, blocks = [], [], []
    for s, (_, ctx) in enumerate(lens):
        for lists in (slash, columns, blocks):
            lists.append([])
        key_tiles = _tiles(ctx)
        for h in range(num_heads):
            kind = ("vs", "blocks" if with_blocks else "vs", "late", "empty")[(h + s) % 4]
            head_slash, head_cols, head_blocks = [], [], [[] for _ in range(num_qtiles)]
            if kind == "vs":
                head_slash = _subset(list(range(-cover_r, 2)), 0.4, gen)
                head_cols = _subset(list(range(ctx)), 0.3, gen)
            elif kind == "blocks":  # listed key tiles include ones past the diagonal
                head_blocks = [_subset(list(range(key_tiles)), 0.5, gen) for _ in range(num_qtiles)]
            elif kind == "late":
                head_slash = [1]
                head_cols = sorted({ctx - 1, max(0, ctx - 3)})
            slash[s].append(head_slash)
            columns[s].append(head_cols)
            blocks[s].append(head_blocks)
    return make_index(slash, columns, blocks if with_blocks else None, cover_r, gen)


class Case(PagedBatch):
    """:class:`~nanovllm.testing.PagedBatch` with cache blocks up to each context's last key tile (the tails
    poisoned), and the kernels' arguments."""

    def __init__(self, lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen):
        super().__init__(lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen,
                         num_blocks=[_tiles(c) * TILE // block_size + 1 for _, c in lens])

    def args(self, index: SparseIndex):
        return (self.q, self.k_cache, self.v_cache, self.tables, self.cu, self.ctx, index, self.scale,
                self.max_query_len)


def all_keys(lens, num_heads: int, device) -> SparseIndex:
    """Every slash tile of every head: each row reads every key up to its own."""
    cover_r = max(_tiles(c) for _, c in lens)
    every = [[list(range(-cover_r, 2))] * num_heads for _ in lens]
    return _index_to(make_index(every, [[[]] * num_heads for _ in lens], None, cover_r,
                                torch.Generator().manual_seed(0)), device)


def _index_to(index: SparseIndex, device) -> SparseIndex:
    return SparseIndex(*[None if t is None else t.to(device) for t in (
        index.columns, index.column_counts, index.slash_tiles, index.slash_counts, index.slash_cover,
        index.blocks, index.block_counts)])


def test_reference_equals_dense_when_everything_is_read():
    """All slash tiles, all columns, or all key tiles as blocks: each is plain causal attention."""
    gen = torch.Generator().manual_seed(0)
    lens = [(70, 70), (30, 200), (1, 65)]
    num_heads = 4
    c = Case(lens, 2, 2, 16, 16, torch.float32, "cpu", gen)
    want_out, want_lse = c.dense_causal()
    cover_r = max(_tiles(ctx) for _, ctx in lens)
    num_qtiles = max(_tiles(q) for q, _ in lens)
    every = [[[] for _ in range(num_heads)] for _ in lens]
    forms = {
        "slash": (
            [[list(range(-cover_r, 2)) for _ in range(num_heads)] for _ in lens], every, None),
        "columns": (every, [[list(range(ctx)) for _ in range(num_heads)] for _, ctx in lens], None),
        "blocks": (every, every, [[[list(range(_tiles(ctx)))] * num_qtiles for _ in range(num_heads)]
                                  for _, ctx in lens]),
    }
    for name, (slash, columns, blocks) in forms.items():
        out, lse = sparse_attention_reference(*c.args(make_index(slash, columns, blocks, cover_r, gen)))
        torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5, msg=f"{name}: out")
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5, msg=f"{name}: lse")


def test_reference_hand_written_masks():
    """Three sequences, masks spelled out key by key from the index docstring's rules."""
    gen = torch.Generator().manual_seed(1)
    # sequence 0: rows at positions 130..139 (q_start 130, base tile 2); sequence 1: a fresh 70-row prompt;
    # sequence 2: rows at 100..139, one query tile across key tiles 1 and 2 (base tile 1 for every row)
    lens = [(10, 140), (70, 70), (40, 140)]
    c = Case(lens, 1, 4, 8, 16, torch.float32, "cpu", gen)
    slash = [[[-2], [], [0], [1]], [[-1], [], [], [0]], [[0], [], [1], [-1]]]
    columns = [[[5, 70, 135], [], [], [139]], [[], [], [3, 66], [10]], [[], [], [20, 130], []]]
    blocks = [
        [[[], []], [[1], []], [[], []], [[], []]],
        [[[], []], [[1], [0, 1]], [[], []], [[], []]],
        [[[], []], [[2], []], [[], []], [[], []]],
    ]
    index = make_index(slash, columns, blocks, 3, gen)

    def keys_of(s: int, h: int, row: int) -> set[int]:
        p = [130, 0, 100][s] + row
        if s == 2:
            return [
                set(range(64, min(p, 127) + 1)),  # offset 0 is key tile 1 for all rows, also those past 127
                set(range(128, p + 1)),
                set(range(128, p + 1)) | {20},  # offset 1 (key tile 2) covers column 130
                set(range(64)),
            ][h]
        if s == 0:
            return [
                set(range(64)) | {70} | ({135} if p >= 135 else set()),  # slash tile 0 covers column 5
                set(range(64, 128)),
                set(range(128, p + 1)),
                {139} if p >= 139 else set(),  # tile 3 (offset 1) starts past every row
            ][h]
        tile = row // 64
        return [
            set(range(64)) if tile == 1 else set(),  # offset -1: no tile for query tile 0
            set(range(p + 1)) if tile == 1 else set(),  # tile 1 listed for query tile 0: past every row
            ({3} if p >= 3 else set()) | ({66} if p >= 66 else set()),
            set(range(64 * tile, p + 1)) | ({10} if p >= 10 else set()),
        ][h]

    out, lse = sparse_attention_reference(*c.args(index))
    for s, (q_len, ctx) in enumerate(lens):
        table = c.tables[s].long()
        keys = torch.stack([c.k_cache[table[p // 16], p % 16, 0] for p in range(ctx)]).double()
        vals = torch.stack([c.v_cache[table[p // 16], p % 16, 0] for p in range(ctx)]).double()
        for h in range(4):  # one KV head
            for r in range(q_len):
                t = int(c.cu[s]) + r
                read = sorted(keys_of(s, h, r))
                if not read:
                    assert torch.all(out[t, h] == 0) and lse[t, h] == float("-inf"), (s, h, r)
                    continue
                scores = keys[read] @ c.q[t, h].double() * c.scale
                torch.testing.assert_close(out[t, h].double(), torch.softmax(scores, 0) @ vals[read],
                                           rtol=1e-5, atol=1e-5, msg=f"out {(s, h, r)}")
                assert abs(lse[t, h].item() - torch.logsumexp(scores, 0).item()) < 1e-5, (s, h, r)


@pytest.mark.parametrize("device,dtype,head_dim,num_kv_heads,group,block_size,with_blocks", PARAMS)
def test_kernel_matches_reference(device, dtype, head_dim, num_kv_heads, group, block_size, with_blocks):
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    lens = GPU_LENS if device == "cuda" else INTERP_LENS
    c = Case(lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen)
    index = _index_to(random_index(lens, num_kv_heads * group, with_blocks, gen), device)
    out, lse = sparse_attention(*c.args(index))
    ref_out, ref_lse = sparse_attention_reference(*c.args(index))
    assert_kernel_matches_reference(out, lse, ref_out, ref_lse, f"seed {seed}")
    if device != "cuda" and dtype != torch.float32:  # the interpreter: the variants on one config only
        return
    # 32 keys a step (the kernel's steps over head size 128): the same keys, the same results
    default = kernel_config(head_dim, dtype, c.q.device, with_blocks)
    half = sparse_attention(*c.args(index), config=attrs.evolve(default, keys=TILE // 2))
    assert_kernel_matches_reference(*half, ref_out, ref_lse, f"seed {seed}, 32 keys a step")
    # the density the kernel's dense_above reads, from its own kernel: the reference's to the last bit
    density = computed_density(index, c.cu, c.ctx, c.max_query_len)
    assert 0 < density and index_density(index, c.cu, c.ctx, c.max_query_len).item() == density
    # dense_above: below the index's density both compute dense causal attention (the kernel decides on the
    # device), above it the sparse results unchanged
    dense_out, dense_lse = sparse_attention_reference(*c.args(index), dense_above=density * 0.99)
    everything = sparse_attention_reference(*c.args(all_keys(lens, num_kv_heads * group, device)))
    assert torch.equal(dense_out, everything[0]) and torch.equal(dense_lse, everything[1])
    got_out, got_lse = sparse_attention(*c.args(index), dense_above=density * 0.99)
    err = ((got_out.float() - dense_out.float()).norm() / dense_out.float().norm()).item()
    assert err < {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype], f"seed {seed}: {err}"
    torch.testing.assert_close(got_lse, dense_lse, atol=2e-3, rtol=0, msg=f"seed {seed}: dense lse")
    for attend, want in ((sparse_attention, out), (sparse_attention_reference, ref_out)):
        assert torch.equal(attend(*c.args(index), dense_above=density * 1.01)[0], want)


STAGE_PARAMS = [pytest.param("cuda", marks=pytest.mark.gpu, id="gpu")]
STAGE_PARAMS += [pytest.param("cpu", id="interp")] if INTERP else []


@pytest.mark.parametrize("device", STAGE_PARAMS)
def test_staged_columns_are_the_cache_rows_of_each_listed_key(device):
    """The rows the sparse kernel reads for a head's columns: entry ``j`` holds the keys and values of column
    ``j`` of the head's list, read from the head's KV group, zero past the head size; entries past the count
    are never read (left as they are)."""
    from nanovllm_minference.attention import _staged_columns

    gen = torch.Generator().manual_seed(5)
    lens = [(100, 300), (1, 130)]
    c = Case(lens, 2, 2, 48, 16, torch.float32, device, gen)
    index = _index_to(random_index(lens, 4, False, gen), device)
    staged = _staged_columns(c.k_cache, c.v_cache, c.tables, c.ctx, index.columns, index.column_counts, TILE)
    block_size, group = c.k_cache.shape[1], 2
    checked = 0
    for s in range(len(lens)):
        for h in range(4):
            for j, col in enumerate(index.columns[s, h, : index.column_counts[s, h]].tolist()):
                page = c.tables[s, col // block_size]
                for cache, rows in zip((c.k_cache, c.v_cache), staged):
                    assert torch.equal(rows[s, h, j, :48], cache[page, col % block_size, h // group])
                    assert not rows[s, h, j, 48:].any()
                checked += 1
    assert checked > 10


# the knobs, each config with (dtype, head_dim, num_kv_heads, group, block_size, with_blocks): two
# query tiles a program, TMA loads from pages of 128 and of 16 keys, key steps of a quarter and a half
# tile, head sizes 128 and 256
KNOBS = {"fused_scale": True, "tma": True}
GPU_KNOBS = [
    (torch.bfloat16, 128, 8, 4, 16, True, SparseKernelConfig(TILE, TILE, 4, 3)),  # the former defaults
    (torch.bfloat16, 128, 2, 4, 128, True, SparseKernelConfig(2 * TILE, TILE, 8, 3, **KNOBS)),
    (torch.bfloat16, 128, 2, 4, 16, True, SparseKernelConfig(2 * TILE, TILE, 8, 3, fused_scale=True)),
    (torch.bfloat16, 256, 1, 4, 128, True, SparseKernelConfig(2 * TILE, 32, 8, 2, **KNOBS)),
]
INTERP_KNOBS = [
    (torch.bfloat16, 128, 1, 2, 128, True, SparseKernelConfig(2 * TILE, TILE, 1, 1, **KNOBS)),
    (torch.bfloat16, 256, 1, 2, 16, True, SparseKernelConfig(2 * TILE, 16, 1, 1, **KNOBS)),
    (torch.float16, 128, 2, 1, 16, False, SparseKernelConfig(2 * TILE, 32, 1, 1)),
    (torch.bfloat16, 128, 1, 2, 128, False, SparseKernelConfig(TILE, TILE, 1, 1, **KNOBS)),
]


# a chunk whose programs of two query tiles read key tiles below all their rows, and others as INTERP_LENS
KNOB_INTERP_LENS = [(200, 460), (70, 250), (1, 130)]


def _knob_id(c) -> str:
    cfg = c[-1]
    knobs = "".join(f"-{k}" for k in ("fused_scale", "tma") if getattr(cfg, k))
    return _cfg_id(c[:-1]) + f"-m{cfg.block_m}-keys{cfg.keys}-w{cfg.num_warps}s{cfg.num_stages}" + knobs


KNOB_PARAMS = [pytest.param("cuda", *c, id="gpu-" + _knob_id(c), marks=pytest.mark.gpu) for c in GPU_KNOBS]
KNOB_PARAMS += [pytest.param("cpu", *c, id="interp-" + _knob_id(c)) for c in (INTERP_KNOBS if INTERP else [])]


@pytest.mark.parametrize("device,dtype,head_dim,num_kv_heads,group,block_size,with_blocks,config",
                         KNOB_PARAMS)
def test_kernel_knobs_match_reference(device, dtype, head_dim, num_kv_heads, group, block_size, with_blocks,
                                      config):
    """Each knob of :class:`SparseKernelConfig` over the sparse loops and the dense fallback, on the engine's
    layout (each cache a contiguous tensor, which TMA loads need)."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    lens = GPU_LENS if device == "cuda" else KNOB_INTERP_LENS
    c = Case(lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen)
    hopper = device == "cpu" or torch.cuda.get_device_capability()[0] >= 9  # the interpreter, or TMA
    # K and V blocks interleaved in one tensor: rows not evenly strided, no descriptors (pointer loads)
    assert paged_kv_descriptors(c.k_cache, c.v_cache, config.keys) is None
    c.k_cache, c.v_cache = c.k_cache.contiguous(), c.v_cache.contiguous()
    if config.tma and block_size % config.keys == 0 and hopper:
        assert paged_kv_descriptors(c.k_cache, c.v_cache, config.keys) is not None, "no TMA loads"
    index = _index_to(random_index(lens, num_kv_heads * group, with_blocks, gen), device)
    ref_out, ref_lse = sparse_attention_reference(*c.args(index))
    out, lse = sparse_attention(*c.args(index), config=config)
    assert_kernel_matches_reference(out, lse, ref_out, ref_lse, f"seed {seed}")
    density = computed_density(index, c.cu, c.ctx, c.max_query_len)
    dense_out, dense_lse = sparse_attention_reference(*c.args(index), dense_above=density * 0.99)
    got_out, got_lse = sparse_attention(*c.args(index), dense_above=density * 0.99, config=config)
    err = ((got_out.float() - dense_out.float()).norm() / dense_out.float().norm()).item()
    assert err < {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype], f"seed {seed}: {err}"
    torch.testing.assert_close(got_lse, dense_lse, atol=2e-3, rtol=0, msg=f"seed {seed}: dense lse")


def test_bad_kernel_config_is_refused():
    c = Case([(70, 70)], 1, 2, 16, 16, torch.float32, "cpu", torch.Generator().manual_seed(3))
    index = make_index([[[0], [0]]], [[[], []]], None, 3, torch.Generator().manual_seed(3))
    for config, match in (((96, TILE, 1, 1), "block_m=96"), ((TILE, 48, 1, 1), "keys=48")):
        with pytest.raises(ValueError, match=match):
            sparse_attention(*c.args(index), config=config)


def test_head_size_256_takes_wide_tiles_where_shared_memory_holds_them(monkeypatch):
    import nanovllm_minference.attention as module

    cuda = torch.device("cuda")
    narrow = SparseKernelConfig(TILE, TILE // 2, 4, 2, fused_scale=True)
    for shared, want in ((227 * 1024, SparseKernelConfig(2 * TILE, TILE, 8, 2, fused_scale=True)),
                         (163 * 1024, narrow)):  # Hopper, A100
        monkeypatch.setattr(module, "max_shared_memory", lambda device, shared=shared: shared)
        assert kernel_config(256, torch.bfloat16, cuda) == want
        assert kernel_config(256, torch.bfloat16, cuda, has_blocks=True) == narrow
        assert kernel_config(256, torch.float32, cuda) == narrow


def test_one_query_tile_a_program_where_pages_hold_whole_key_tiles():
    cuda = torch.device("cuda")
    one = SparseKernelConfig(TILE, TILE, 4, 3, fused_scale=True, tma=True)
    for block_size in (64, 128, 256):
        assert kernel_config(128, torch.bfloat16, cuda, block_size=block_size) == one
    for block_size in (16, 32):
        assert kernel_config(128, torch.float16, cuda, block_size=block_size) == attrs.evolve(one, block_m=2 * TILE,
                                                                                               num_warps=8)
        assert kernel_config(128, torch.float16, cuda, has_blocks=True, block_size=block_size) == one
    assert kernel_config(128, torch.bfloat16, torch.device("cpu"), block_size=128).block_m == TILE


def test_kernel_under_interpreter():
    """Every ``interp`` case of this file, the knobs' included, under Triton's interpreter on the CPU, in a
    fresh process."""
    assert_interpreter_cases_pass(__file__, len(INTERP_CONFIGS) + len(INTERP_KNOBS) + 1)


def test_bad_inputs_are_refused_up_front():
    gen = torch.Generator().manual_seed(2)
    lens = [(130, 130)]  # three query tiles
    c = Case(lens, 1, 2, 16, 16, torch.float32, "cpu", gen)
    two_tiles = make_index([[[], []]], [[[], []]], [[[[], []], [[], []]]], 3, gen)
    with pytest.raises(ValueError, match="one list per query tile"):
        sparse_attention(*c.args(two_tiles))
    with pytest.raises(ValueError, match="one list per query tile"):
        sparse_attention_reference(*c.args(two_tiles))
    index = make_index([[[0], [0]]], [[[], []]], None, 3, gen)
    with pytest.raises(ValueError, match=r"expected \[1, 4, width\]"):
        sparse_attention_reference(*Case(lens, 2, 2, 16, 16, torch.float32, "cpu", gen).args(index))
    with pytest.raises(ValueError, match="one dtype"):
        sparse_attention_reference(c.q.half(), *c.args(index)[1:])
    if not INTERP:
        with pytest.raises(ValueError, match="sparse_attention_reference on the CPU"):
            sparse_attention(*c.args(index))
