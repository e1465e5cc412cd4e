"""BlockManager with KV cache groups: window groups keep only their window, prefix hits need every group."""

from __future__ import annotations

import pytest
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.kv.groups import (
    KVCacheGroup,
    blocks_per_sequence,
    kv_bytes_per_token,
    kv_cache_groups,
    layer_places,
    needs_null_block,
    num_slots,
    offload_groups,
)
from nanovllm.sampling_params import SamplingParams

BS = 4
WINDOW = 6  # the token at position p reads p-5 .. p: at most 3 blocks of 4 in decode
HYBRID = (KVCacheGroup((0,), None), KVCacheGroup((1,), WINDOW))


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> list[list[int]]:
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    hits = bm.find_cached_prefix(seq)
    assert bm.can_allocate(seq, hits, num_tokens)
    bm.allocate(seq, hits, num_tokens)
    return hits


def compute(bm: BlockManager, seq: Sequence, upto: int) -> None:
    """The model wrote the KV up to ``upto`` tokens (slots first, as the scheduler gives them)."""
    assert bm.append_slots(seq, upto)
    seq.num_computed_tokens = upto
    bm.commit_full_blocks(seq)


def held(bm: BlockManager, table: list[int]) -> list[int]:
    return [b for b in table if b != bm.null_block]


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not bm.ref_counts.any()
    assert bm.null_block not in bm.free_blocks


# -- the groups -------------------------------------------------------------------------------------


def test_groups_of_gemma3_270m_and_of_models_without_windows():
    windows = [None if i % 6 == 5 else 512 for i in range(18)]  # layers 5, 11, 17 attend globally
    groups = kv_cache_groups(windows)
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    assert groups[0].layer_ids == (5, 11, 17) and all(len(g.layer_ids) == 3 for g in groups)
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(18))
    places = layer_places(groups)
    assert places[5] == (0, 0) and places[17] == (0, 2) and num_slots(groups) == 3
    # no windows, or disabled: one group of every layer, each its own slot, as the uniform cache
    for uniform in (kv_cache_groups([None] * 4), kv_cache_groups(windows, hybrid=False)):
        assert len(uniform) == 1 and uniform[0].sliding_window is None and not needs_null_block(uniform)
    assert kv_cache_groups([4096] * 3) == (KVCacheGroup((0, 1, 2), 4096),)  # Mistral: one window group
    # counts that do not divide: groups of the fewer layers, the last one smaller (its slots padded)
    sizes = [len(g.layer_ids) for g in kv_cache_groups([None if i % 6 == 5 else 512 for i in range(26)])]
    assert sizes == [4, 4, 4, 4, 4, 4, 2]


def test_a_long_sequence_needs_about_the_full_layers_blocks():
    groups = kv_cache_groups([None if i % 6 == 5 else 512 for i in range(18)])
    full = 32768 // 16
    decode = blocks_per_sequence(groups, 32768, 16, max_chunk=1)
    assert full < decode <= 1.1 * full  # each window group holds its window and one block
    assert blocks_per_sequence(groups, 100, 16, 8192) == 6 * 7  # shorter than the window: every block


# -- window groups free what their window left -----------------------------------------------------


def test_window_group_keeps_only_its_window_and_frees_the_rest():
    bm = BlockManager(40, BS, groups=HYBRID)
    assert bm.null_block == 39 and bm.num_usable_blocks == 39
    s = seq_of(range(100, 103))
    admit(bm, s)
    compute(bm, s, 3)
    for n in range(4, 40):  # decode one token at a time
        s.token_ids.append(n)
        compute(bm, s, n)
        full, window = s.block_tables
        assert len(full) == len(window) == -(-n // BS) and bm.null_block not in full
        first = max(0, n - WINDOW) // BS  # the block of the first key the next token reads
        assert all(b == bm.null_block for b in window[:first])
        assert bm.null_block not in window[first:]
        assert len(held(bm, window)) <= -(-WINDOW // BS) + 1
    assert bm.num_free_blocks == bm.num_usable_blocks - len(s.block_tables[0]) - len(held(bm, s.block_tables[1]))
    bm.free(s)
    assert_all_free(bm)


def test_groups_of_two_windows_each_free_what_their_own_window_left():
    """Window groups of two windows: each frees exactly the blocks its own window has left, decode step by
    decode step (the manager skips a sequence until the nearer window next passes a block), and chunk by
    chunk after the sequence was preempted and admitted again."""
    windows = {1: WINDOW, 2: 11, 3: WINDOW}
    groups = (KVCacheGroup((0,), None), *(KVCacheGroup((g,), w) for g, w in windows.items()))
    bm = BlockManager(80, BS, enable_prefix_caching=False, groups=groups)
    s = seq_of(range(100, 103))

    def check(computed: int) -> None:
        """The window tables as the last append_slots left them, ``computed`` tokens computed then."""
        for g, window in windows.items():
            first = max(0, computed - window + 1) // BS  # the block of the first key the next token reads
            table = s.block_tables[g]
            assert all(b == bm.null_block for b in table[:first]), (computed, g)
            assert bm.null_block not in table[first:], (computed, g)

    admit(bm, s)
    compute(bm, s, 3)
    for n in range(4, 50):
        s.token_ids.append(n)
        compute(bm, s, n)
        check(n - 1)
    bm.free(s)
    s.reset_for_recompute()
    admit(bm, s, 8)
    for done, upto in ((0, 8), (8, 20), (20, 32), (32, 44), (44, s.num_tokens)):
        compute(bm, s, upto)
        check(done)
    bm.free(s)
    assert_all_free(bm)


def test_chunked_prefill_holds_the_window_and_the_chunk():
    bm = BlockManager(40, BS, groups=HYBRID)
    s = seq_of(range(40))
    admit(bm, s, 8)
    for end in (16, 24, 32, 40):
        compute(bm, s, end - 8)
        assert bm.append_slots(s, end)
        window = s.block_tables[1]
        first = (end - 8 - WINDOW + 1) // BS  # the window of the chunk's first token
        assert window[:first] == [bm.null_block] * first and bm.null_block not in window[first:]
    bm.free(s)
    assert_all_free(bm)


def test_out_of_blocks_fails_without_change_and_admission_counts_each_group():
    bm = BlockManager(8, BS, groups=HYBRID)  # 7 blocks and the null
    s = seq_of(range(12))
    assert bm.blocks_needed(s, 12) == 6  # 3 full + 3 window
    admit(bm, s)
    assert bm.num_free_blocks == 1
    compute(bm, s, 12)
    s.token_ids.append(1)
    assert bm.append_slots(s, 13)  # a block more in each group: the window left block 0, which one takes
    assert len(held(bm, s.block_tables[1])) == 3 and len(s.block_tables[0]) == 4
    assert bm.num_free_blocks == 0
    before = [list(t) for t in s.block_tables]
    assert not bm.append_slots(s, 17)  # a full block more and a window block more: none is free
    assert s.block_tables == before
    bm.free(s)
    assert_all_free(bm)


# -- prefix hits ------------------------------------------------------------------------------------


def test_hit_takes_the_window_blocks_and_not_those_before_it():
    bm = BlockManager(40, BS, groups=HYBRID)
    a = seq_of(range(100, 120))  # 5 full blocks
    admit(bm, a)
    compute(bm, a, 20)
    b = seq_of(list(range(100, 117)) + [7])  # 4 cached blocks, then its own tokens
    hits = admit(bm, b)
    full, window = hits
    assert full == a.block_tables[0][:4]
    first = (16 - WINDOW + 1) // BS  # the window of the token at 16 reaches back to block 2
    assert window[:first] == [bm.null_block] * first and window[first:] == a.block_tables[1][first:4]
    assert b.num_cached_tokens == 16
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_no_hit_where_the_window_blocks_are_gone():
    """A prefix whose full-attention blocks are cached but whose window blocks were freed and overwritten
    is a hit only up to where the window has what it needs, else nothing (it is computed again)."""
    bm = BlockManager(40, BS, groups=HYBRID)
    a = seq_of(range(100, 130))
    admit(bm, a, 4)
    for end in range(8, 32, 4):  # chunks of 4: the window group frees its old blocks as it goes
        compute(bm, a, end - 4)
        assert bm.append_slots(a, min(end, 30))
    compute(bm, a, 28)
    assert bm.null_block in a.block_tables[1]
    freed = [b for b in range(bm.num_usable_blocks) if b in bm.free_blocks and bm.cache_groups[b] >= 0]
    assert freed  # the window's old blocks: cached while free
    filler = seq_of(range(500, 500 + 4 * (bm.num_free_blocks // 2)))  # every free block, cached ones too
    admit(bm, filler)
    # the full group still has blocks 0..6 of a; the window group only its last blocks of a
    b = seq_of(list(range(100, 116)) + [1])  # wants 4 blocks: block 2 and 3 of the window are gone
    hits = bm.find_cached_prefix(b)
    assert hits == [[], []]
    c = seq_of(list(range(100, 129)))  # 7 blocks: the window of the token at 28 reads blocks 5, 6
    full, window = bm.find_cached_prefix(c)
    assert full == a.block_tables[0][:7] and window[5:] == a.block_tables[1][5:7]
    for s in (a, filler):
        bm.free(s)
    assert_all_free(bm)


@pytest.mark.parametrize("groups", [HYBRID, (KVCacheGroup((0,), WINDOW),)], ids=["hybrid", "windows"])
def test_collisions_never_give_a_window_hit(groups, monkeypatch):
    """Under a hash that collides, a window block with the right tokens after another prefix is no hit."""
    from nanovllm.engine import block_manager

    # a hash that ignores the chain
    monkeypatch.setattr(block_manager, "chain_hashes", lambda prev, rows: [int(sum(r)) for r in rows])
    bm = BlockManager(40, BS, groups=groups)
    a = seq_of([1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5, 5, 9])
    admit(bm, a)
    compute(bm, a, 13)
    b = seq_of([3, 3, 3, 3, 2, 2, 2, 2, 5, 5, 5, 5, 9])  # the same last blocks after another first block
    assert [len(h) for h in bm.find_cached_prefix(b)] == [0] * len(groups)
    assert [len(h) for h in bm.find_cached_prefix(seq_of(a.token_ids))] == [3] * len(groups)
    bm.free(a)
    assert_all_free(bm)


# -- two pools (KV offload: the full-attention group in the host pool, the windows on the GPU) -----------


OFFLOAD = (KVCacheGroup((0,), None), KVCacheGroup((1,), WINDOW, pool=1))


def test_offload_groups_put_every_global_layer_in_one_group_and_the_windows_in_pool_1():
    windows = [None if i % 6 == 5 else 512 for i in range(18)]  # Gemma 3 270M
    groups = offload_groups(windows)
    assert groups[0] == KVCacheGroup((5, 11, 17), None, pool=0)
    assert groups[1:] == (KVCacheGroup(tuple(i for i in range(18) if i % 6 != 5), 512, pool=1),)
    assert num_slots(groups, pool=0) == 3 and num_slots(groups, pool=1) == 15
    assert kv_bytes_per_token(groups, 1024) == (3 * 1024, 15 * 1024)  # each pool's own block
    # more windows: grouped among themselves as kv_cache_groups groups them; no window: one group
    mixed = offload_groups([None, 4, 4, 8, 8, None])
    assert mixed == (KVCacheGroup((0, 5)), KVCacheGroup((1, 2), 4, 1), KVCacheGroup((3, 4), 8, 1))
    assert offload_groups([None] * 3) == kv_cache_groups([None] * 3)


def test_two_pools_are_counted_apart_and_the_window_pool_holds_the_null_block():
    bm = BlockManager(6, BS, groups=OFFLOAD, num_window_blocks=4)  # window pool: ids 6..8, null 9
    assert bm.null_block == 9 and bm.num_usable_blocks == 9
    assert list(bm.free_queues[0]) == list(range(6)) and list(bm.free_queues[1]) == [6, 7, 8]
    s = seq_of(range(12))
    admit(bm, s)
    assert all(b < 6 for b in s.block_tables[0]) and all(6 <= b < 9 for b in s.block_tables[1])
    compute(bm, s, 12)
    s.token_ids.extend([1, 1, 1, 1, 1])
    assert bm.append_slots(s, 13)  # the window left block 0: its pool has the block again
    assert len(bm.free_queues[0]) == 2 and len(bm.free_queues[1]) == 0
    other = seq_of(range(100, 104))  # one block in each pool: the host pool has two, the window pool none
    assert bm.num_free_blocks == 2 and not bm.can_allocate(other, bm.find_cached_prefix(other), 4)
    compute(bm, s, 13)
    assert bm.append_slots(s, 17)  # the window moved on: a window block is free for the new one
    bm.free(s)
    assert_all_free(bm)
    assert len(bm.free_queues[0]) == 6 and len(bm.free_queues[1]) == 3


def test_the_window_pool_needs_window_groups_and_they_need_it():
    with pytest.raises(ValueError, match="num_window_blocks"):
        BlockManager(6, BS, groups=HYBRID, num_window_blocks=4)
    with pytest.raises(ValueError, match="num_window_blocks"):
        BlockManager(6, BS, groups=OFFLOAD)


# -- what the step plan's table copies take again ------------------------------------------------------


class ChangeLog:
    """Stands for a sequence's ``step_plan.TableCopy``: the ranges ``Sequence.changed_blocks`` reports."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int | None]] = []

    def changed(self, group: int, start: int, stop: int | None = None) -> None:
        self.ranges.append((group, start, stop))

    def release(self) -> None:
        pass


def test_reported_changes_are_exactly_the_changed_entries():
    """Each step the block manager reports which table entries changed, so the step plan copies only those:
    exactly the entries appended or rewritten (a window's freed run ends where the freed blocks end; only an
    append reaches the table's end), through chunks, decode steps and a shared duplicate prefix."""
    bm = BlockManager(80, BS, groups=HYBRID)
    # admitted together, sharing 5 blocks: b's copies of them become a's
    a, b = seq_of(range(100, 140)), seq_of([*range(100, 120), *range(300, 320)])
    for s in (a, b):
        admit(bm, s, 8)
        s.table_copy = ChangeLog()
    reported_bounded = 0
    for end in [*range(8, 40, 8), 40, *range(41, 60)]:  # chunks of 8, then decode steps
        for s in (a, b):
            before = [list(t) for t in s.block_tables]
            s.table_copy.ranges.clear()
            while s.num_tokens < end:
                s.token_ids.append(7)
            compute(bm, s, end)
            covered = {(g, j) for g, start, stop in s.table_copy.ranges
                       for j in range(start, len(s.block_tables[g]) if stop is None else stop)}
            changed = {(g, j) for g, (old, new) in enumerate(zip(before, s.block_tables))
                       for j in range(len(new)) if j >= len(old) or old[j] != new[j]}
            assert covered == changed, (end, s.table_copy.ranges)
            reported_bounded += sum(stop is not None for _, _, stop in s.table_copy.ranges)
    assert b.block_tables[0][:5] == a.block_tables[0][:5] != b.block_tables[0][:6]
    assert reported_bounded  # window frees and shared copies were reported with their ends
    for s in (a, b):
        bm.free(s)
    assert_all_free(bm)
