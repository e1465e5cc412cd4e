"""BlockManager: allocation, reference counts, and the prefix cache (chained hashes, verified hits)."""

from __future__ import annotations

import gc
import random
import time
import tracemalloc

import numpy as np
import pytest
from nanovllm.engine import block_manager as bm_module
from nanovllm.engine.block_manager import BlockManager, FreeQueue, chain_hashes
from nanovllm.engine.sequence import Sequence
from nanovllm.kv.groups import KVCacheGroup
from nanovllm.sampling_params import SamplingParams

BS = 4  # block size used throughout


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> list[list[int]]:
    """Admit ``seq`` as the scheduler does (prefix hits first); returns the hits (one list per group)."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    hits = bm.find_cached_prefix(seq)
    assert bm.can_allocate(seq, hits, num_tokens)
    bm.allocate(seq, hits, num_tokens)
    return hits


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend the model wrote the KV of ``seq`` up to ``upto`` tokens, then publish full blocks."""
    upto = seq.num_tokens if upto is None else upto
    assert bm.append_slots(seq, upto)
    seq.num_computed_tokens = upto
    bm.commit_full_blocks(seq)


def refs(bm: BlockManager, seq: Sequence) -> list[int]:
    return bm.ref_counts[seq.block_table].tolist()


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not bm.ref_counts.any()


# -- allocation and reference counts ---------------------------------------------------------------


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    a = seq_of(range(10, 20))  # 10 tokens -> 3 blocks
    assert admit(bm, a)[0] == []
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert refs(bm, a) == [1, 1, 1]
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert a.block_table == []
    assert_all_free(bm)


def test_append_slots_grows_by_whole_blocks_and_fails_without_change():
    bm = BlockManager(3, BS)
    a = seq_of(range(5))
    admit(bm, a, 4)
    assert len(a.block_table) == 1
    assert bm.append_slots(a, 4) and len(a.block_table) == 1  # still fits
    assert bm.append_slots(a, 5) and len(a.block_table) == 2
    assert bm.blocks_needed(a, 13) == 2
    before = list(a.block_table)
    assert not bm.append_slots(a, 13)  # needs 2 more, only 1 free
    assert a.block_table == before and bm.num_free_blocks == 1
    bm.free(a)
    assert_all_free(bm)


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(16, BS)
    a = seq_of(range(100, 110))  # blocks [100..103] [104..107] [108, 109]
    admit(bm, a)
    compute(bm, a)
    b = seq_of(list(range(100, 108)) + [7, 7, 7])
    (hits,) = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert refs(bm, a) == [2, 2, 1]
    assert refs(bm, b) == [2, 2, 1]
    bm.free(a)
    assert refs(bm, b) == [1, 1, 1]
    assert not set(b.block_table) & set(bm.free_blocks)  # shared blocks stay in use
    bm.free(b)
    assert_all_free(bm)


def test_can_allocate_counts_reused_free_blocks():
    bm = BlockManager(3, BS)
    a = seq_of(range(9))  # 3 blocks: the whole cache
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    b = seq_of(list(range(8)) + [50, 51, 52, 53])  # 2 cached blocks (free, ref 0) + 1 new block
    hits = bm.find_cached_prefix(b)
    assert len(hits[0]) == 2
    assert bm.can_allocate(b, hits, 12)
    assert not bm.can_allocate(b, hits, 13)  # would need a 4th block
    bm.allocate(b, hits, 12)
    assert bm.num_free_blocks == 0
    bm.free(b)
    assert_all_free(bm)



def test_blocks_with_nothing_cached_are_handed_out_again_first():
    """A freed block that holds nothing cached is the next one handed out, so the blocks ever written stay
    as many as are in use at once (on the CPU, pages of the cache nobody writes never become resident);
    cached blocks wait at the back of the queue."""
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    written: set[int] = set()
    for i in range(20):
        s = seq_of(range(100 * i, 100 * i + 10))  # 3 blocks
        admit(bm, s)
        compute(bm, s)
        written.update(s.block_table)
        bm.free(s)
    assert len(written) == 3

    bm = BlockManager(64, BS)
    a = seq_of(range(1, 11))  # 2 full blocks, published, and a partial one
    admit(bm, a)
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    b = seq_of(range(50, 53))
    admit(bm, b)
    assert b.block_table == table[2:]  # the partial block, not a fresh one nor a cached one
    assert bm.find_cached_prefix(seq_of(range(1, 11)))[0] == table[:2]


@pytest.mark.serial  # thread CPU time
def test_a_pool_of_millions_of_blocks_is_made_at_once():
    """Per-block state lives in arrays made in a few operations: a manager of an H200's 2.5 million blocks,
    one pool or two (KV offload's window pool), takes well under half a second of CPU time (one Python
    object per block took seconds), and works."""
    offload_groups = (KVCacheGroup((0,)), KVCacheGroup((1,), 512, pool=1))
    for make in (lambda: BlockManager(2_500_000, 16),
                 lambda: BlockManager(2_000_000, 16, groups=offload_groups, num_window_blocks=500_000)):
        start = time.thread_time()
        bm = make()
        seconds = time.thread_time() - start
        assert seconds < 0.5, f"{seconds:.2f} s to make a BlockManager of 2.5 million blocks"
        s = seq_of(range(1000))
        admit(bm, s)
        compute(bm, s)
        assert bm.num_free_blocks == bm.num_usable_blocks - sum(len(bm._held(t)) for t in s.block_tables)
        bm.free(s)
        assert bm.num_free_blocks == bm.num_usable_blocks and not bm.ref_counts.any()


def test_a_published_block_holds_no_python_objects_of_its_own():
    """A published block's hash, token ids and parent are rows of the manager's arrays: with every block
    published, the manager takes under 400 bytes of host memory per block, its hash lookup included (a tuple
    of them per block, with the token ids' int objects it keeps alive, took more than twice that)."""
    rng = random.Random(0)
    num_blocks, bs, per_prompt = 4096, 16, 64
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        bm = BlockManager(num_blocks, bs)
        for _ in range(num_blocks // per_prompt):
            # token ids made while traced, as a server's are: a block that kept them would keep them alive
            s = seq_of([rng.randrange(1000, 150_000) for _ in range(per_prompt * bs + 1)])
            admit(bm, s, per_prompt * bs)
            compute(bm, s, per_prompt * bs)
            bm.free(s)
        last = s.token_ids
        del s
        bm.take_newly_allocated()
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - start) / num_blocks
    finally:
        tracemalloc.stop()
    assert (bm.cache_groups >= 0).all()  # every block is published, and found again
    assert len(bm.find_cached_prefix(seq_of(last))[0]) == per_prompt
    assert per_block < 400, f"{per_block:.0f} bytes of host memory per published block"


@pytest.mark.parametrize("seed", range(3))
def test_free_queue_is_a_stack_of_uncached_blocks_then_the_cached_oldest_first(seed):
    """The array-backed free queue against a plain model of its order (a stack handed out from its end, then
    a queue from its start) through random takes, give-backs and take-backs of cached blocks, enough to
    wrap its log many times."""
    rng = random.Random(seed)
    first, size = 5, 12
    queue = FreeQueue(first, first + size)
    stack, cached, held = list(range(first + size - 1, first - 1, -1)), [], []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and len(queue):
            n = rng.randint(1, len(queue))
            k = min(n, len(stack))
            expected = stack[len(stack) - k :][::-1] + cached[: n - k]
            del stack[len(stack) - k :], cached[: n - k]
            assert queue.take(n).tolist() == expected
            held += expected
        elif op < 0.8 and held:
            rng.shuffle(held)
            n = rng.randint(1, len(held))
            back, held, to_cache = held[:n], held[n:], [rng.random() < 0.5 for _ in range(n)]
            queue.put_back(np.array(back), np.array(to_cache))
            stack += [b for b, c in zip(back, to_cache) if not c]
            cached += [b for b, c in zip(back, to_cache) if c]
        elif cached:  # prefix-cache hits on free blocks
            hits = rng.sample(cached, rng.randint(1, len(cached)))
            queue.remove(np.array(hits))
            cached = [b for b in cached if b not in hits]
            held += hits
        assert list(queue) == stack[::-1] + cached and len(queue) == len(stack) + len(cached)
        assert [b for b in range(first - 1, first + size + 1) if b in queue] == sorted(stack + cached)


# -- the prefix cache -------------------------------------------------------------------------------


def test_hit_on_shared_prefix_and_none_after_a_differing_token():
    bm = BlockManager(32, BS)
    base = list(range(1, 14))  # 3 full blocks + 1 token
    a = seq_of(base)
    admit(bm, a)
    compute(bm, a)

    assert bm.find_cached_prefix(seq_of(base[:12] + [99]))[0] == a.block_table[:3]
    diverge_in_block_1 = base[:5] + [99] + base[6:]
    assert bm.find_cached_prefix(seq_of(diverge_in_block_1))[0] == a.block_table[:1]
    assert bm.find_cached_prefix(seq_of([99] + base[1:]))[0] == []
    # Same block contents at a different position is not a prefix hit (the hash is chained).
    assert bm.find_cached_prefix(seq_of(base[4:8] + base[4:8] + [1]))[0] == []


def test_hash_is_chained():
    first, second = chain_hashes(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert second != chain_hashes(None, [[5, 6, 7, 8]])[0]
    assert second != chain_hashes(None, [[0, 2, 3, 4], [5, 6, 7, 8]])[1]
    assert chain_hashes(first, [[5, 6, 7, 8]]) == [second]  # a chain extended later continues the same


@pytest.mark.parametrize("length, expected_hits", [(8, 1), (9, 2), (12, 2), (13, 3)])
def test_at_least_one_token_is_left_to_compute(length, expected_hits):
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 17))
    admit(bm, a)
    compute(bm, a)
    b = seq_of(range(1, 1 + length))
    hits = bm.find_cached_prefix(b)[0]
    assert len(hits) == expected_hits
    assert len(hits) * BS < b.num_tokens


def test_partial_blocks_are_not_published():
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 11))
    admit(bm, a)
    compute(bm, a, 7)  # one full block, one partial
    assert len(bm.hash_to_block[0]) == 1
    compute(bm, a, 10)
    assert len(bm.hash_to_block[0]) == 2
    assert bm.cache_groups[a.block_table[2]] == -1  # unpublished


def test_freed_blocks_stay_reusable_until_overwritten():
    bm = BlockManager(4, BS)
    a = seq_of(range(1, 10))  # blocks 0, 1, 2
    admit(bm, a)
    compute(bm, a)
    prefix_blocks = a.block_table[:2]
    bm.free(a)
    assert_all_free(bm)

    # Still cached while free: a later request with the same prefix takes the blocks back.
    b = seq_of(list(range(1, 9)) + [40])
    assert admit(bm, b)[0] == prefix_blocks
    bm.free(b)

    # The free queue hands out never-used blocks, then the tail of a freed sequence, before its head.
    c = seq_of(range(60, 68))  # 2 blocks
    admit(bm, c)
    assert not set(c.block_table) & set(prefix_blocks)
    assert bm.find_cached_prefix(seq_of(list(range(1, 9)) + [40]))[0] == prefix_blocks

    d = seq_of(range(70, 74))  # one more block: the prefix's second block goes first (tail first)
    admit(bm, d)
    assert bm.find_cached_prefix(seq_of(list(range(1, 9)) + [40]))[0] == prefix_blocks[:1]
    e = seq_of(range(80, 84))  # and then its first block
    admit(bm, e)
    assert bm.find_cached_prefix(seq_of(list(range(1, 9)) + [40]))[0] == []
    for s in (c, d, e):
        bm.free(s)
    assert_all_free(bm)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq_of(range(1, 14))
    admit(bm, a)
    compute(bm, a)
    assert bm.hash_to_block[0] == {}
    assert bm.find_cached_prefix(seq_of(range(1, 14)))[0] == []


def test_duplicate_prefix_computed_together_is_shared_and_stays_findable():
    """Two requests admitted in the same step compute the same prefix twice; the second copy is given
    back and the blocks after it chain to the published copy, so its own suffix can be hit later."""
    bm = BlockManager(16, BS)
    shared = list(range(1, 9))
    a = seq_of(shared + [20, 21, 22, 23, 24])
    b = seq_of(shared + [30, 31, 32, 33, 34])
    admit(bm, a)
    admit(bm, b)  # nothing published yet: no hits, 4 + 4 blocks
    assert bm.num_free_blocks == 16 - 8
    compute(bm, a)
    compute(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert refs(bm, a)[:2] == [2, 2]
    assert bm.num_free_blocks == 16 - 6  # b's duplicate copies went back
    c = seq_of(shared + [30, 31, 32, 33, 99])
    assert bm.find_cached_prefix(c)[0] == b.block_table[:3]
    for s in (a, b):
        bm.free(s)
    assert_all_free(bm)


# -- hash collisions: hits are verified, never trusted -------------------------------------------------


def test_colliding_hash_with_different_tokens_is_no_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hashes", lambda prev, rows: [42] * len(rows))
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 10))
    admit(bm, a)
    compute(bm, a)
    assert bm.find_cached_prefix(seq_of([9, 9, 9, 9, 9]))[0] == []
    assert bm.find_cached_prefix(seq_of(range(1, 10)))[0] == a.block_table[:1]  # a real hit still works


def test_collision_cannot_hand_out_a_block_computed_after_another_prefix(monkeypatch):
    """Under a constant hash, a block holding tokens [1, 2] after the prefix [5, 6] gets published; a
    request *starting* with [1, 2] must not take it (its keys were computed at other positions)."""
    monkeypatch.setattr(bm_module, "chain_hashes", lambda prev, rows: [42] * len(rows))
    bm = BlockManager(3, 2)
    r = seq_of([1, 2, 3])
    admit(bm, r)
    compute(bm, r)  # publishes [1, 2] under 42
    bm.free(r)

    s = seq_of([5, 6, 1, 2, 9])
    assert admit(bm, s, 2)[0] == []
    compute(bm, s, 2)  # [5, 6] collides with the cached [1, 2]: stays unpublished
    assert bm.append_slots(s, 5)  # takes the last free blocks, overwriting r's cached block
    compute(bm, s, 5)  # now [1, 2] (after [5, 6]) is published under 42
    assert 42 in bm.hash_to_block[0] and bm.hash_to_block[0][42] == s.block_table[1]

    assert bm.find_cached_prefix(seq_of([1, 2, 4]))[0] == []


def test_collision_cannot_chain_a_block_to_a_different_parent(monkeypatch):
    """A hash that ignores the prefix: the block [3, 4] computed after [7, 8] must not follow [1, 2]."""
    monkeypatch.setattr(bm_module, "chain_hashes", lambda prev, rows: [hash(tuple(r)) % 2**64 for r in rows.tolist()])
    bm = BlockManager(16, 2)
    first = seq_of([1, 2, 5, 5, 0])
    admit(bm, first)
    compute(bm, first)
    other = seq_of([7, 8, 3, 4, 0])
    admit(bm, other)
    compute(bm, other)  # publishes [3, 4] with parent [7, 8]
    hits = bm.find_cached_prefix(seq_of([1, 2, 3, 4, 0]))[0]
    assert hits == first.block_table[:1]


def test_collision_cannot_reach_a_block_whose_parent_was_overwritten(monkeypatch):
    """A cached block must not outlive the content of the block before it. The free queue normally
    evicts a child before its parent; reorder it by hand so the parent is refilled first, with the
    same tokens after another history, and check the stale child is no longer a hit."""
    monkeypatch.setattr(bm_module, "chain_hashes", lambda prev, rows: [hash(tuple(r)) % 2**64 for r in rows.tolist()])
    bm = BlockManager(6, 2)
    a = seq_of([7, 8, 1, 2, 3, 4, 0])
    admit(bm, a)
    compute(bm, a)
    first, parent, child, _ = a.block_table
    bm.free(a)
    queue = bm.free_queues[0]
    free = queue.take(len(queue)).tolist()  # the unpublished ones first, the spare among them
    spare = free[0]
    order = [parent, first, child]  # the cached ones, the child evicted last (the others stay out)
    queue.put_back(np.array([spare, *order]), np.array([False, True, True, True]))
    assert list(queue)[:2] == [spare, parent] and list(queue)[-1] == child

    s = seq_of([5, 6, 1, 2, 9])
    assert admit(bm, s)[0] == []
    assert s.block_table[:2] == [spare, parent]  # parent's block now holds [1, 2] after [5, 6]
    compute(bm, s)
    assert bm.cache_groups[child] == 0  # the old child is still cached

    assert bm.find_cached_prefix(seq_of([5, 6, 1, 2, 3, 4, 0]))[0] == [spare, parent]


# -- the allocation notice the policies reset their metadata from ----------------------------------------


def test_every_handed_out_block_is_reported_once_and_hits_are_not():
    """``take_newly_allocated`` lists exactly the blocks handed out since the last call: fresh blocks,
    reused free ones, and the duplicate given back by the dedupe path when it is taken again; never a
    prefix-cache hit, whose content (and metadata) is kept."""
    bm = BlockManager(8, BS)
    shared = list(range(1, 9))
    a, b = seq_of(shared + [20]), seq_of(shared + [30])
    admit(bm, a)
    admit(bm, b)
    assert sorted(bm.take_newly_allocated()) == sorted(a.block_table + b.block_table)
    assert bm.take_newly_allocated() == []
    given_back = b.block_table[:2]  # b's own copies of the shared blocks
    first_generations = bm.generations[given_back].copy()
    compute(bm, a)
    compute(bm, b)  # ... go back to the free queue, b now shares a's
    assert b.block_table[:2] == a.block_table[:2] and not bm.ref_counts[given_back].any()
    assert bm.take_newly_allocated() == []  # the dedupe hands nothing out
    c = seq_of(shared + [40])
    shared_generations = bm.generations[a.block_table[:2]].copy()
    hits = admit(bm, c)
    assert hits == [a.block_table[:2]]
    taken = bm.take_newly_allocated()
    assert taken == c.block_table[2:]  # the hits are not reallocated
    d = seq_of(range(50, 62))  # three blocks: the given-back copies come first in the free queue
    admit(bm, d)
    assert bm.take_newly_allocated() == d.block_table
    taken += d.block_table
    assert set(given_back) <= set(taken)  # reported when handed out again
    assert (bm.generations[given_back] != first_generations).all()  # a new generation at each hand-out
    assert (bm.generations[hits[0]] == shared_generations).all()  # none at a hit
