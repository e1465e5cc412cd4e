"""The sparse index (torch, CPU): lines become slash tiles and columns that cover them, budgets that cover
everything read every visible key, forced lines stay, block-sparse tiles are causal and keep their own
tile, and the offload path's touched blocks hold every key the index reads. The Triton index builder and
ranking give the torch references' tensors exactly: on CUDA (``gpu``), and under Triton's interpreter in a
subprocess (``test_index_kernels_under_interpreter``)."""

import json
import os

import pytest
import torch
from nanovllm.testing import assert_interpreter_cases_pass
from nanovllm_minference.head_config import load_head_patterns, layer_heads
from nanovllm_minference.index import (
    PAD,
    SORTED_IN_KERNEL,
    TILE,
    block_sparse_index,
    computed_density,
    index_mask,
    lines_to_index,
    lines_to_index_reference,
    ranked_lines,
    ranked_lines_reference,
    select_index,
    select_index_reference,
    top_lines,
)
from nanovllm_minference.policy import touched_blocks

# (query_len, context_len) per sequence: a fresh prompt, chunks of a longer one at unaligned starts
SHAPES = [(130, 130), (77, 300), (200, 457), (1, 65)]
CUDA = torch.cuda.is_available()
# the interpreter cases exist only inside the subprocess that test_index_kernel_under_interpreter starts
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"


def batch(shapes=SHAPES):
    q_lens = torch.tensor([q for q, _ in shapes])
    lens = torch.tensor([c for _, c in shapes])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    return q_lens, lens, cu


def positions_of(cu, lens):
    return torch.cat([torch.arange(int(c) - int(cu[s + 1] - cu[s]), int(c)) for s, c in enumerate(lens)])


def random_lines(lens, num_heads, width, seed):
    g = torch.Generator().manual_seed(seed)
    s = lens.shape[0]
    columns = (torch.rand(s, num_heads, width, generator=g) * lens[:, None, None]).long()
    offsets = (torch.rand(s, num_heads, width, generator=g) * lens[:, None, None]).long()
    counts = torch.randint(0, width + 1, (2, s, num_heads), generator=g)
    return columns, counts[0], offsets, counts[1]


def valid(lines, counts):
    """The first ``counts`` entries of each list."""
    return torch.arange(lines.shape[-1]) < counts[..., None]


@pytest.mark.parametrize("seed", range(3))
def test_every_line_is_read_and_nothing_beyond_its_tiles(seed):
    q_lens, lens, cu = batch()
    columns, cc, offsets, oc = random_lines(lens, 3, 6, seed)
    index = lines_to_index_reference(columns, valid(columns, cc), offsets, valid(offsets, oc), lens - q_lens,
                                     int(lens.max()))
    mask = index_mask(index, cu, lens)
    pos = positions_of(cu, lens)
    seq = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
    for row in range(seed, mask.shape[0], 5):  # a fifth of the rows, a different fifth per seed
        s, p = int(seq[row]), int(pos[row])
        for h in range(3):
            read = set(mask[row, h].nonzero().flatten().tolist())
            lines = {int(c) for c in columns[s, h, : cc[s, h]] if c <= p}
            lines |= {p - int(o) for o in offsets[s, h, : oc[s, h]] if p - o >= 0}
            assert lines <= read
            # what is read beyond the lines lies in the tiles a diagonal crosses in this query tile
            base = (p - (row - int(cu[s])) % TILE) // TILE
            for c in read - lines:
                assert any(abs(p - o - c) < 2 * TILE for o in offsets[s, h, : oc[s, h]].tolist())
                assert c // TILE - base in index.slash_tiles[s, h, : index.slash_counts[s, h]].tolist()


@pytest.mark.parametrize("seed", range(3))
def test_computed_density_counts_the_kernels_work(seed):
    """Per query tile and head: every slash tile inside 0..the tile's last key tile in full, every column
    up to the tile's last row once per row; over dense causal work. Counted here one tile at a time."""
    q_lens, lens, cu = batch()
    columns, cc, offsets, oc = random_lines(lens, 3, 40, seed)
    index = lines_to_index_reference(columns, valid(columns, cc), offsets, valid(offsets, oc), lens - q_lens,
                                     int(lens.max()))
    work = dense = 0
    for s, (q_len, ctx) in enumerate(zip(q_lens.tolist(), lens.tolist(), strict=True)):
        q_start = ctx - q_len
        dense += sum(p + 1 for p in range(q_start, ctx))
        for first in range(q_start, ctx, TILE):
            rows = min(first + TILE, ctx) - first
            base, last = first // TILE, (first + rows - 1) // TILE
            for h in range(3):
                slash = index.slash_tiles[s, h, : index.slash_counts[s, h]].tolist()
                cols = index.columns[s, h, : index.column_counts[s, h]].tolist()
                work += sum(TILE * rows for d in slash if 0 <= base + d <= last)
                work += sum(rows for c in cols if c <= first + rows - 1)
    assert computed_density(index, cu, lens) == pytest.approx(work / (dense * 3), rel=1e-12)


def test_budgets_covering_everything_read_every_visible_key():
    q_lens, lens, cu = batch()
    n = int(lens.max())
    every = torch.arange(n).expand(len(lens), 2, n)
    for columns, offsets in (((lens * 0)[:, None].expand(-1, 2), lens[:, None].expand(-1, 2)),
                             (lens[:, None].expand(-1, 2), (lens * 0)[:, None].expand(-1, 2))):
        lines = every, valid(every, columns), every, valid(every, offsets)
        index = lines_to_index_reference(*lines, lens - q_lens, n)
        mask = index_mask(index, cu, lens)
        pos = positions_of(cu, lens)
        seq = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
        visible = (torch.arange(n)[None, :] <= pos[:, None]) & (torch.arange(n)[None, :] < lens[seq][:, None])
        assert torch.equal(mask, visible[:, None, :].expand_as(mask))


# (column list width, offset list width): narrow lists, offsets past one kernel step, columns too wide to
# sort in the kernel
KERNEL_WIDTHS = [(6, 9), (40, 1500), (SORTED_IN_KERNEL + 1, 30)]
KERNEL_PARAMS = [
    pytest.param("cuda", w, id=f"gpu-{w[0]}x{w[1]}", marks=pytest.mark.gpu) for w in KERNEL_WIDTHS
] + [pytest.param("cpu", w, id=f"interp-{w[0]}x{w[1]}") for w in (KERNEL_WIDTHS if INTERP else [])]


@pytest.mark.parametrize("device, widths", KERNEL_PARAMS)
def test_index_kernel_gives_the_reference_index(device, widths):
    """Random lines with garbage past every count (values the reference never reads, some out of range),
    empty lists, several chunks at unaligned starts, a context long enough for offsets past 1024 tiles."""
    shapes = [*SHAPES, (300, 70_000)]
    q_lens, lens, _ = batch(shapes)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        columns, cc, offsets, oc = (t.clone() for t in random_lines(lens, 5, max(widths), seed))
        columns, offsets = columns[..., : widths[0]], offsets[..., : widths[1]]
        cc, oc = cc.clamp(max=widths[0]), oc.clamp(max=widths[1])
        cc[0, 1] = oc[1, 2] = 0
        cv, ov = valid(columns, cc), valid(offsets, oc)
        columns[~cv] = torch.randint(-(10**9), 10**9, (int((~cv).sum()),), generator=g)
        offsets[~ov] = torch.randint(-(10**9), 10**9, (int((~ov).sum()),), generator=g)
        args = columns, cv, offsets, ov, lens - q_lens
        ref = lines_to_index_reference(*args, int(lens.max()))
        out = lines_to_index(*(t.to(device) for t in args), int(lens.max()))
        for name in ("columns", "column_counts", "slash_tiles", "slash_counts", "slash_cover"):
            got, want = getattr(out, name).cpu(), getattr(ref, name)
            assert got.dtype == want.dtype and torch.equal(got, want), f"seed {seed}: {name} differs"


# (forced columns, forced diagonals): none, some, more than the shorter contexts hold
RANK_FORCED = [(0, 0), (4, 100), (30, 2000)]
RANK_PARAMS = [
    pytest.param("cuda", f, id=f"gpu-rank-{f[0]}-{f[1]}", marks=pytest.mark.gpu) for f in RANK_FORCED
] + [pytest.param("cpu", f, id=f"interp-rank-{f[0]}-{f[1]}") for f in (RANK_FORCED if INTERP else [])]


@pytest.mark.parametrize("device, forced", RANK_PARAMS)
def test_ranking_kernel_gives_the_reference_scores(device, forced):
    """Sequences of different lengths (lines past a context at -inf), forced lines, widths off the tile."""
    lens = torch.tensor([1500, 3001, 37])
    g = torch.Generator().manual_seed(sum(forced))
    vertical, slash = torch.rand(2, 3, 4, 3001, generator=g)
    want = ranked_lines_reference(vertical, slash, lens, *forced)
    got = ranked_lines(vertical.to(device), slash.to(device), lens.to(device), *forced)
    for name, a, b in zip(("vertical", "slash"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), f"{name} differs"


# (vertical sizes, slash sizes, adaptive budget, forced columns, forced diagonals): budgets per head some
# above the shorter contexts, the adaptive rule, forced lines past the budgets
SELECT_CASES = [((5, 40, 500), (7, 100, 3), None, 4, 30), ((1, 1, 1), (1, 1, 1), 0.3, 30, 200),
                ((3000, 1, 2), (2, 3000, 1), None, 0, 1)]
SELECT_PARAMS = [
    pytest.param("cuda", c, id=f"gpu-select-{i}", marks=pytest.mark.gpu) for i, c in enumerate(SELECT_CASES)
] + [pytest.param("cpu", c, id=f"interp-select-{i}") for i, c in enumerate(SELECT_CASES if INTERP else [])]


@pytest.mark.parametrize("device, case", SELECT_PARAMS)
def test_select_kernel_gives_the_reference_index(device, case):
    """Random scores (no ties) of sequences of several lengths, chunks at unaligned starts: the one-launch
    selection gives the index of ranking, top lines and the index builder, tensor for tensor."""
    vertical_sizes, slash_sizes, adaptive, sinks, recent = case
    q_lens, lens, cu = batch([*SHAPES, (300, 2100)])
    longest = int(lens.max())
    g = torch.Generator().manual_seed(sum(vertical_sizes))
    vertical, slash = torch.rand(2, len(lens), 3, longest + 5, generator=g)
    sizes = torch.tensor(vertical_sizes), torch.tensor(slash_sizes)
    bounds = (max(vertical_sizes), max(slash_sizes))
    if adaptive is not None:
        bounds = max(1, int(longest * adaptive * 0.2)), max(1, int(longest * adaptive * 0.8))
    args = vertical, slash, cu.int(), lens.int(), *sizes
    want = select_index_reference(*args, sinks, recent, bounds, longest, adaptive)
    got = select_index(*(t.to(device) for t in args), sinks, recent, bounds, longest, adaptive)
    for name in ("columns", "column_counts", "slash_tiles", "slash_counts", "slash_cover"):
        a, b = getattr(got, name).cpu(), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs"


def test_index_kernels_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    assert_interpreter_cases_pass(__file__, len(KERNEL_WIDTHS) + len(RANK_FORCED) + len(SELECT_CASES))


def test_top_lines_keep_forced_lines_best_first_within_budget():
    lens = torch.tensor([500, 40])
    g = torch.Generator().manual_seed(0)
    vertical, slash = torch.rand(2, 2, 3, 500, generator=g)
    sizes_v = torch.tensor([[50, 8, 1]] * 2)
    sizes_s = torch.tensor([[60, 12, 2]] * 2)
    columns, cv, offsets, ov = top_lines(vertical, slash, lens, sizes_v, sizes_s, num_sink_tokens=4,
                                         num_recent_diags=10)
    cc, oc = cv.sum(-1), ov.sum(-1)
    assert cc.tolist() == [[50, 8, 1], [40, 8, 1]] and oc.tolist() == [[60, 12, 2], [40, 12, 2]]
    assert torch.equal(cv, valid(columns, cc)) and torch.equal(ov, valid(offsets, oc))  # best first
    for s in range(2):
        for h in range(3):
            chosen_c = columns[s, h, : cc[s, h]].tolist()
            chosen_o = offsets[s, h, : oc[s, h]].tolist()
            assert max(chosen_c) < lens[s] and max(chosen_o) < lens[s]
            assert set(range(min(4, cc[s, h]))) <= set(chosen_c)
            assert set(range(min(10, oc[s, h]))) <= set(chosen_o)
            # beyond the forced ones, the best scores
            rest = [c for c in chosen_c if c >= 4]
            others = vertical[s, h, 4 : lens[s]]
            if rest:
                assert min(vertical[s, h, rest]) >= others.sort(descending=True).values[len(rest) - 1]
    # host bounds on the sizes (the policy's, to skip a sync) choose the same lines
    bounded = top_lines(vertical, slash, lens, sizes_v, sizes_s, num_sink_tokens=4, num_recent_diags=10,
                        max_sizes=(70, 60))
    for got, want, counts in zip(bounded[::2], (columns, offsets), (cc, oc), strict=True):
        for s in range(2):
            for h in range(3):
                assert got[s, h, : counts[s, h]].tolist() == want[s, h, : counts[s, h]].tolist()


def test_top_lines_with_equal_sizes_choose_the_same_lines_unordered():
    """Heads sharing their budgets take their best lines without topk's sort: the same sets, and a sequence
    shorter than the budget keeps only its real lines."""
    lens = torch.tensor([500, 40])
    g = torch.Generator().manual_seed(1)
    vertical, slash = torch.rand(2, 2, 3, 500, generator=g)
    sizes_v, sizes_s = torch.full((2, 3), 50), torch.full((2, 3), 60)
    ordered = top_lines(vertical, slash, lens, sizes_v, sizes_s, 4, 10, max_sizes=(50, 60))
    unordered = top_lines(vertical, slash, lens, sizes_v, sizes_s, 4, 10, max_sizes=(50, 60),
                          sizes_equal=True)
    for lines, chosen in ((0, 1), (2, 3)):
        assert torch.equal(unordered[chosen].sum(-1), ordered[chosen].sum(-1))
        for s in range(2):
            for h in range(3):
                want = set(ordered[lines][s, h][ordered[chosen][s, h]].tolist())
                assert set(unordered[lines][s, h][unordered[chosen][s, h]].tolist()) == want
    assert unordered[1][1].sum(-1).tolist() == [40, 40, 40]
    with pytest.raises(ValueError, match="max_sizes"):
        top_lines(vertical, slash, lens, sizes_v, sizes_s, 4, 10, sizes_equal=True)


def test_slash_tiles_are_ascending_distinct_and_padded():
    """The slash tiles listed are exactly the offsets the cover marks, ascending, then padding."""
    q_lens, lens, cu = batch()
    columns, cc, offsets, oc = random_lines(lens, 3, 40, seed=5)
    index = lines_to_index_reference(columns, valid(columns, cc), offsets, valid(offsets, oc), lens - q_lens,
                                     int(lens.max()))
    reach = index.cover_offset
    for s in range(len(lens)):
        for h in range(3):
            listed = index.slash_tiles[s, h].tolist()
            count = int(index.slash_counts[s, h])
            marked = (index.slash_cover[s, h].nonzero().flatten() - reach).tolist()
            assert listed[:count] == marked and all(t == PAD for t in listed[count:])


def test_block_sparse_is_causal_keeps_its_own_tile_and_finds_a_planted_cluster():
    q_lens, lens, cu = batch([(256, 256), (100, 400)])
    num_heads, num_kv, d = 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(int(cu[-1]), num_heads, d, generator=g) * 0.1
    keys = torch.randn(2, 400, num_kv, d, generator=g) * 0.1
    keys[:, 64:128, 0] += 3.0  # key tile 1 of KV head 0 aligned with every query of its heads
    q[:, :2] += 3.0
    top_k = torch.tensor([2, 2, 3, 1])
    blocks, counts = block_sparse_index(q, keys, cu, lens, top_k, int(q_lens.max()))
    tiles_q = blocks.shape[2]
    for s in range(2):
        start = int(lens[s] - q_lens[s])
        for m in range(-(-int(q_lens[s]) // TILE)):
            first = start + m * TILE
            last = min(first + TILE, int(lens[s])) - 1
            for h in range(num_heads):
                listed = blocks[s, h, m, : counts[s, h, m]].tolist()
                assert listed == sorted(listed) and max(listed) <= last // TILE
                assert {first // TILE, last // TILE} <= set(listed)
                assert len(listed) <= max(int(top_k[h]), 2)
                if h < 2 and last // TILE > 1 and int(top_k[h]) > len({first // TILE, last // TILE}):
                    assert 1 in listed
    assert tiles_q == 4


@pytest.mark.parametrize("block_size", [16, 128])
def test_touched_blocks_hold_every_key_the_index_reads(block_size):
    q_lens, lens, cu = batch()
    columns, cc, offsets, oc = random_lines(lens, 3, 5, seed=7)
    index = lines_to_index_reference(columns, valid(columns, cc), offsets, valid(offsets, oc), lens - q_lens,
                                     int(lens.max()))
    num_blocks = -(-int(lens.max()) // block_size) + 1
    touched = touched_blocks(index, cu, lens, block_size, num_blocks)
    mask = index_mask(index, cu, lens)
    seq = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
    read = torch.zeros(len(lens), int(lens.max()), dtype=torch.bool).index_put_((seq,), mask.any(1), accumulate=True)
    for s in range(len(lens)):
        keys = read[s].nonzero().flatten()
        assert touched[s, keys // block_size].all()
        assert not touched[s, -(-int(lens[s]) // block_size):].any()  # nothing past the context
    assert touched.float().mean() < 1  # and it is not everything


def test_head_patterns_load_minferences_format(tmp_path):
    path = tmp_path / "heads.json"
    layers = [{"0": ["vertical_and_slash", 1000, 6096, 0.9], "2": ["stream_llm", 100, 800, 0.8]},
              {"1": ["block_sparse", 8, 1, 0.5]}]
    path.write_text(json.dumps(layers))
    loaded = load_head_patterns(path)
    heads = layer_heads(loaded, 0, 4)
    assert [h.pattern for h in heads] == ["vertical_slash", "vertical_slash", "a_shape", "vertical_slash"]
    assert (heads[2].vertical_size, heads[2].slash_size) == (100, 800)
    assert layer_heads(loaded, 1, 2)[1].pattern == "block_sparse"
    with pytest.raises(ValueError, match="another model"):
        layer_heads(loaded, 0, 2)


@pytest.mark.parametrize("content, match", [
    ("[{\"0\": [\"dilated\", 1, 2, 0]}]", "unknown pattern 'dilated'"),
    ("[{\"0\": [\"vertical_and_slash\", 0, 2, 0]}]", "vertical_size must be a positive int"),
    ("{\"0\": 1}", "one .* per layer"),
    ("[{\"x\": [\"stream_llm\", 1, 2, 0]}]", "head indices"),
    ("not json", "not valid JSON"),
])
def test_head_pattern_errors_name_the_problem(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_head_patterns(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_head_patterns(tmp_path / "missing.json")
