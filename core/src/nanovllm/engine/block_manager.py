"""Paged KV blocks: allocation, reference counts, and the prefix cache, for every KV cache group.

A block holds ``block_size`` consecutive tokens of one or more sequences. A full block is named by a
chained hash: ``xxh64(hash of the previous block, its token ids)``, so equal hashes mean equal
prefixes. A hit is verified before it is shared, without trusting the hash: the block must hold the
same token ids and follow the same parent block (block id and generation, renewed whenever a block is
handed out again), so a hash collision can only cost a hit, never give a wrong one. A block whose last
user is gone goes to the back of the free queue but keeps its content and hash, so a later request
with the same prefix can take it back until it is handed out again and overwritten. A block with nothing
to keep (prefix caching off, a partial block) goes to the front and is handed out next: the engine then
writes only as many blocks as it ever holds at once, and on the CPU, where the cache's pages become
resident when first written, the process does not grow towards the whole cache's size.

Per-block state, the published blocks' contents included, lives in flat arrays indexed by block id, so a
pool of millions of blocks is made in a few operations and holds no Python object per block, and a run of
blocks (a prompt chunk's) is handed out, published and given back in a few numpy operations rather than one
Python step per block.

Hybrid models (:mod:`nanovllm.kv.groups`): every group takes blocks from the one pool and keeps a block
table per sequence (``Sequence.block_tables[g]``); the prefix cache is per group, under the same hashes.
A sliding-window group frees the blocks its window has left as the sequence advances, and its table names
them by the null block, which no one writes and every kernel may read harmlessly (it is zeroed). A cached
prefix is a hit only as far as every group has what the next token reads: a full-attention group every
block before it, a window group the blocks its window reaches; otherwise it is computed again, as vLLM does.

Under KV offload the window groups take their blocks from a pool of their own (``KVCacheGroup.pool`` 1, the
GPU's), numbered after the host pool's; each pool has its free queue and counts its own blocks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from typing import NamedTuple

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.kv.groups import KVCacheGroup, needs_null_block

FULL_ATTENTION = (KVCacheGroup((), None),)  # the one group of a model without windows

# A block's parent, what proves the prefix before it (see BlockManager._contents), is a pair of numbers: the
# block before it and that block's generation, or one of these markers and a number
NO_PARENT = -1  # with 0: the block starts a sequence
CHECKED = -2  # with the check hash of the prefix: a window group's block where every layer has a window


class Contents(NamedTuple):
    """What a run of blocks holds, a row per block: their chained hashes (as ints for the prefix caches'
    dicts, and as one uint64 array for the per-block state, made once for every group that publishes the
    run), token ids ``[blocks, block_size]`` (int32) and parents ``[blocks, 2]`` (int64)."""

    hashes: list[int]
    hash_array: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray

    def row(self, i: int) -> Contents:
        """The ``i``-th block's, as a run of one."""
        return Contents(self.hashes[i : i + 1], self.hash_array[i : i + 1], self.tokens[i : i + 1],
                        self.parents[i : i + 1])


def chain_hashes(prev_hash: int | None, blocks: np.ndarray | SequenceABC[SequenceABC[int]]) -> list[int]:
    """The chained hashes of consecutive full blocks, the token ids ``blocks [n, block_size]``, after the block
    hashed ``prev_hash`` (None: the first blocks of a sequence): each is ``xxh64(previous hash, 8 bytes
    little-endian, then its token ids as int64)``, 64 bits, unsigned."""
    return _chained_digests(xxhash.xxh64_intdigest, prev_hash, blocks)


def check_hashes(prev_hash: int | None, blocks: np.ndarray | SequenceABC[SequenceABC[int]]) -> list[int]:
    """A second chain of hashes over the same blocks, independent of :func:`chain_hashes` (another function,
    xxh3 with a seed): what a window group of a model without full attention checks a cached block's prefix
    by, where the blocks before it are gone. They have 63 bits, to be kept in a block's parent beside block
    ids (int64)."""
    return _chained_digests(_check_digest, prev_hash, blocks)


def _check_digest(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=0x9E3779B9) >> 1


def _chained_digests(digest: Callable[[bytes], int], prev_hash: int | None,
                     blocks: np.ndarray | SequenceABC[SequenceABC[int]]) -> list[int]:
    """``digest`` of each block's bytes after the hash before it, as returned (so a chain extended later
    continues from what it stored)."""
    rows = np.asarray(blocks, dtype=np.int64)
    data, width = rows.tobytes(), rows.shape[-1] * 8  # one buffer: a prompt's chunk is hundreds of blocks
    hashes = []
    for start in range(0, len(data), width):
        row = data[start : start + width]
        prev_hash = digest(row if prev_hash is None else prev_hash.to_bytes(8, "little") + row)
        hashes.append(prev_hash)
    return hashes


class FreeQueue:
    """The free blocks of one pool (ids ``start`` to ``stop - 1``, all free at first), in the order they are
    handed out: first the ones with nothing cached (a stack, the last given back first), then the cached
    ones, oldest first. Both live in arrays made once, so a run of blocks comes and goes in a few numpy
    operations."""

    def __init__(self, start: int, stop: int) -> None:
        size = stop - start
        self.start = start
        self.stack = np.arange(stop - 1, start - 1, -1)  # the uncached ones: stack[:num_uncached], top last
        self.num_uncached = size
        # The cached ones, oldest first, are the current entries of log[head:tail]: those whose position (per
        # block, from ``start``; -1 if none) is their index. A block taken back out leaves a stale entry.
        self.log = np.empty(2 * size, np.int64)
        self.position = np.full(size, -1, np.int64)
        self.head = self.tail = self.num_cached = 0

    def __len__(self) -> int:
        return self.num_uncached + self.num_cached

    def __iter__(self) -> Iterator[int]:
        yield from self.stack[: self.num_uncached][::-1].tolist()
        yield from self._current(self.tail).tolist()

    def __contains__(self, block_id: int) -> bool:
        i = block_id - self.start
        return 0 <= i < len(self.position) and (
            self.position[i] >= 0 or block_id in self.stack[: self.num_uncached])

    def _current(self, end: int) -> np.ndarray:
        """The current entries of ``log[head:end]``, in order."""
        entries = self.log[self.head : end]
        return entries[self.position[entries - self.start] == np.arange(self.head, end)]

    def take(self, n: int) -> np.ndarray:
        """Take out the first ``n`` blocks."""
        assert n <= self.num_uncached + self.num_cached, "more blocks taken than the queue holds"
        k = min(n, self.num_uncached)
        self.num_uncached -= k
        taken = self.stack[self.num_uncached : self.num_uncached + k][::-1].copy()
        if k == n:
            return taken
        parts, n = [taken], n - k
        while n:  # n entries hold at most n current ones: read on past the stale ones until there are n
            cached = self._current(self.head + n)
            self.head += n
            self.position[cached - self.start] = -1
            self.num_cached -= len(cached)
            n -= len(cached)
            parts.append(cached)
        if not self.num_cached:  # nothing current is left in the log: start it again
            self.head = self.tail = 0
        return np.concatenate(parts)

    def put_back(self, block_ids: np.ndarray, cached: np.ndarray) -> None:
        """Give back ``block_ids`` in order: where ``cached``, to the back (handed out last); the others to
        the front (handed out next)."""
        if not cached.all():
            uncached = block_ids[~cached]
            self.stack[self.num_uncached : self.num_uncached + len(uncached)] = uncached
            self.num_uncached += len(uncached)
            block_ids = block_ids[cached]
        n = len(block_ids)
        if not n:
            return
        if self.tail + n > len(self.log):  # move the current entries to the start: a pool's worth fits after
            current = self._current(self.tail)
            self.head, self.tail = 0, len(current)
            self.log[: self.tail] = current
            self.position[current - self.start] = np.arange(self.tail)
        self.log[self.tail : self.tail + n] = block_ids
        self.position[block_ids - self.start] = np.arange(self.tail, self.tail + n)
        self.tail += n
        self.num_cached += n

    def remove(self, block_ids: np.ndarray) -> None:
        """Take the cached blocks ``block_ids`` out of the queue (they are in use again)."""
        self.position[block_ids - self.start] = -1
        self.num_cached -= len(block_ids)


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` tokens shared by the KV cache ``groups`` (default: one
    full-attention group); with ``num_window_blocks``, the groups of pool 1 (KV offload's window groups)
    take theirs from that many more, ids ``num_blocks`` on. Where a group has a window, the last block id
    (``null_block``) is kept back as the null block; the others (``num_usable_blocks``) are handed out."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: SequenceABC[KVCacheGroup] = FULL_ATTENTION, num_window_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = tuple(groups)
        if any(g.pool for g in self.groups) != bool(num_window_blocks):
            raise ValueError("num_window_blocks sizes the pool of the KV cache groups of pool 1, and only it")
        # the last id: the usable blocks stay 0..n-1, all free when num_free_blocks == num_usable_blocks
        total = num_blocks + num_window_blocks
        self.null_block = total - 1 if needs_null_block(self.groups) else None
        n = self.num_usable_blocks = total - (self.null_block is not None)
        self.free_queues = [FreeQueue(0, min(num_blocks, n))]  # per pool
        if num_window_blocks:
            self.free_queues.append(FreeQueue(num_blocks, n))
        # Per block: its users; its generation, the number of the hand-out that last gave it out (its id and
        # generation name its content); the group whose prefix cache publishes it, -1 if none (its hash then
        # names it in that group's hash_to_block). A published block's contents (see Contents) are its row of
        # hashes, tokens and parents; the zeroed arrays take host memory only as blocks are published.
        self.ref_counts = np.zeros(n, np.int32)
        self.generations = np.zeros(n, np.int64)
        self.num_handouts = 0
        self.cache_groups = np.full(n, -1, np.int16)
        self.hashes = np.zeros(n, np.uint64)
        self.tokens = np.zeros((n, block_size), np.int32)
        self.parents = np.zeros((n, 2), np.int64)
        self.hash_to_block: list[dict[int, int]] = [{} for _ in self.groups]  # per group
        # the first full-attention group: a window group's block records its parent there (see _cached_blocks)
        self.anchor = next((g for g, group in enumerate(self.groups) if group.sliding_window is None), None)
        self.windowed = [group.sliding_window is not None for group in self.groups]
        self.full_groups = [g for g in range(len(self.groups)) if not self.windowed[g]]
        self.window_groups = [(g, group) for g, group in enumerate(self.groups) if self.windowed[g]]
        # the window groups by window: one of them, and the indices of all
        by_window: dict[int, list[int]] = {}
        for g, group in self.window_groups:
            by_window.setdefault(group.sliding_window, []).append(g)
        self.windows = [(self.groups[gs[0]], gs) for gs in by_window.values()]
        self.pool_groups = [[g for g, group in enumerate(self.groups) if group.pool == pool]
                            for pool in range(len(self.free_queues))]
        if self.anchor not in (None, 0):
            raise ValueError("the full-attention KV cache groups come first (see nanovllm.kv.groups)")
        self.newly_allocated: list[int] = []  # handed out since take_newly_allocated (policies reset them)

    @property
    def free_blocks(self) -> FreeQueue | Mapping[int, None]:
        """The free blocks, oldest first: the one pool's free queue, or a view over every pool's (read it,
        never change it)."""
        return self.free_queues[0] if len(self.free_queues) == 1 else ChainMap(*self.free_queues)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, over every pool."""
        return sum(map(len, self.free_queues))

    def _fits(self, takes: list[int]) -> bool:
        """Whether each pool has the free blocks for each group ``g`` to take ``takes[g]`` of them."""
        if len(self.free_queues) == 1:  # the common case, once per running sequence and step
            return sum(takes) <= len(self.free_queues[0])
        need = [0] * len(self.free_queues)
        for group, n in zip(self.groups, takes, strict=True):
            need[group.pool] += n
        return all(n <= len(queue) for n, queue in zip(need, self.free_queues, strict=True))

    def _held(self, block_ids: list[int]) -> np.ndarray:
        """``block_ids`` but the null block, in order."""
        ids = np.array(block_ids, dtype=np.int64)
        return ids if self.null_block is None else ids[ids != self.null_block]

    def _hold(self, block_ids: np.ndarray, pool: int) -> None:
        """One more user of each of ``block_ids`` (distinct blocks of pool ``pool``); the free ones, cached
        since they have something to share, leave the free queue."""
        self.free_queues[pool].remove(block_ids[self.ref_counts[block_ids] == 0])
        self.ref_counts[block_ids] += 1

    def _release(self, block_ids: np.ndarray, pool: int) -> None:
        """One user fewer of each of ``block_ids`` (distinct blocks of pool ``pool``: a table never names a
        block twice), in order; a block no one holds goes to the back of the free queue when it is published
        (reused last), to the front when not (reused first)."""
        counts = self.ref_counts[block_ids] - 1
        self.ref_counts[block_ids] = counts
        freed = block_ids[counts == 0]
        self.free_queues[pool].put_back(freed, self.cache_groups[freed] >= 0)

    def _new_entries(self, seq_tables: list[list[int]], num_computed: int, num_tokens: int) -> list[int]:
        """Per group, the blocks to hand out so that tables of ``seq_tables``' lengths cover ``num_tokens``
        tokens, when the next token to compute is at ``num_computed`` (a window group skips the blocks its
        window no longer reaches)."""
        bs, total = self.block_size, -(-num_tokens // self.block_size)
        return [
            max(0, total - max(len(table), group.first_needed_block(num_computed, bs)))
            for group, table in zip(self.groups, seq_tables, strict=True)
        ]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        tables = seq.block_tables or [[] for _ in self.groups]
        return sum(self._new_entries(tables, seq.num_computed_tokens, num_tokens))

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """Chained hash of the ``index``-th full block of ``seq`` (cached on the sequence)."""
        return self._chained(seq, seq.block_hashes, chain_hashes, index)

    def _chained(self, seq: Sequence, chain: list[int],
                 hashes_fn: Callable[[int | None, np.ndarray], list[int]], index: int) -> int:
        """``hashes_fn`` chained over ``seq``'s full blocks up to the ``index``-th, extending ``chain`` (the
        sequence's cache of that chain) as far as needed."""
        start, bs = len(chain), self.block_size
        if start <= index:
            rows = np.asarray(seq.token_ids[start * bs : (index + 1) * bs], dtype=np.int64).reshape(-1, bs)
            chain += hashes_fn(chain[-1] if chain else None, rows)
        return chain[index]

    def find_cached_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per group, the block ids holding a prefix of ``seq`` (a window group's table names the blocks
        before its window by the null block); at least one token is always left to compute. The prefix is
        the longest whose every group has what the next token reads."""
        if not self.enable_prefix_caching:
            return self.no_prefix()
        bs = self.block_size
        num_hits = (seq.num_tokens - 1) // bs
        found: list[list[int | None]] = [[] for _ in self.groups]
        # full attention first: its verified chain bounds how far a window group need look, and anchors it
        for g in sorted(range(len(self.groups)), key=lambda g: self.windowed[g]):
            anchor = found[self.anchor] if self.anchor is not None else []
            found[g] = self._cached_blocks(seq, g, num_hits, anchor)
            num_hits = min(num_hits, len(found[g]))
        while num_hits and not all(
            None not in blocks[group.first_needed_block(num_hits * bs, bs) : num_hits]
            for group, blocks in zip(self.groups, found, strict=True)
        ):
            num_hits -= 1
        return [
            [b if i >= group.first_needed_block(num_hits * bs, bs) else self.null_block
             for i, b in enumerate(blocks[:num_hits])]
            for group, blocks in zip(self.groups, found, strict=True)
        ]

    def no_prefix(self) -> list[list[int]]:
        """No cached prefix, in ``find_cached_prefix``'s form (a request that computes every token)."""
        return [[] for _ in self.groups]

    def _cached_blocks(
        self, seq: Sequence, g: int, max_blocks: int, anchor: list[int | None]
    ) -> list[int | None]:
        """Group ``g``'s cached copies of the first ``max_blocks`` blocks of ``seq``, each holding the same
        tokens after the same prefix (``_contents``; ``anchor``: the anchor group's blocks found so far). For
        full attention the chain from the first block up to the first miss; for a window every block, None
        where missing, since it need not keep the blocks before its window."""
        cache, chain = self.hash_to_block[g], not self.windowed[g]
        candidates: list[int] = []  # -1: none under the hash
        for i in range(max_blocks):
            block_id = cache.get(self._block_hash(seq, i), -1)
            if block_id < 0 and chain:
                break
            candidates.append(block_id)
        if not candidates:  # a new prompt's common case
            return []
        # a full-attention block must follow the candidate before it (a hit, up to the first that is not)
        before = candidates if chain else anchor if self.anchor is not None else None
        ids = np.array(candidates, dtype=np.int64)
        hit = ((ids >= 0) & self._same_content(ids, self._contents(seq, 0, len(ids), before))).tolist()
        if chain:
            return candidates[: hit.index(False) if False in hit else len(hit)]
        return [block_id if h else None for block_id, h in zip(candidates, hit, strict=True)]

    def _contents(self, seq: Sequence, first: int, stop: int, before: SequenceABC[int] | None) -> Contents:
        """What blocks ``first`` to ``stop - 1`` of ``seq`` hold. A block's parent, which a hit must have too,
        proves the prefix before it: with ``before`` (a full-attention table's blocks), the block before it
        and its generation; without (a window group where every layer has a window, which may have freed that
        block), the check hash of the prefix, a second chained hash independent of the first."""
        bs = self.block_size
        if stop:
            self._block_hash(seq, stop - 1)  # hashed up to the last
        hashes = seq.block_hashes[first:stop]
        tokens = np.array(seq.token_ids[first * bs : stop * bs], dtype=np.int32).reshape(-1, bs)
        parents = np.zeros((stop - first, 2), np.int64)
        if not first and stop:  # the first block of the sequence
            parents[0, 0] = NO_PARENT
        after = max(first, 1)  # the first block with a block before it
        if before is not None:
            ids = np.asarray(before[after - 1 : stop - 1], dtype=np.int64)
            parents[after - first :] = np.stack([ids, self.generations[ids]], axis=1)
        else:
            parents[after - first :, 0] = CHECKED
            if stop > after:
                self._chained(seq, seq.block_checks, check_hashes, stop - 2)  # hashed up to the last at once
            parents[after - first :, 1] = seq.block_checks[after - 1 : stop - 1]
        return Contents(hashes, np.array(hashes, dtype=np.uint64), tokens, parents)

    def _same_content(self, block_ids: np.ndarray, contents: Contents) -> np.ndarray:
        """Per block of ``block_ids`` (found under ``contents``' hashes), whether it holds the same tokens
        after the same parent as ``contents``' row."""
        return ((self.tokens[block_ids] == contents.tokens).all(axis=1)
                & (self.parents[block_ids] == contents.parents).all(axis=1))

    def can_allocate(self, seq: Sequence, hits: list[list[int]], num_tokens: int) -> bool:
        new = self._new_entries(hits, len(hits[0]) * self.block_size, num_tokens)
        reused_free = [np.count_nonzero(self.ref_counts[self._held(blocks)] == 0) for blocks in hits]
        return self._fits([a + b for a, b in zip(new, reused_free)])

    def allocate(self, seq: Sequence, hits: list[list[int]], num_tokens: int) -> None:
        """Admit ``seq``: share the cached prefix ``hits`` (one list per group, as ``find_cached_prefix``
        gives it) and give it slots up to ``num_tokens``."""
        assert not seq.block_tables
        for group, blocks in zip(self.groups, hits, strict=True):
            self._hold(self._held(blocks), group.pool)
        seq.block_tables = [list(blocks) for blocks in hits]
        seq.window_moves_at = 0  # new tables (a preempted sequence's too): check the windows afresh
        seq.num_committed_blocks = len(hits[0])
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits[0]) * self.block_size
        assert self.append_slots(seq, num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Free the blocks that ``seq``'s windows have left, then grow it to ``num_tokens`` slots; ``False``
        (and no other change) if blocks run out."""
        # most decode steps: every group has the slots, and no window has left a block behind since the last
        # call (the computed tokens, fewer than num_tokens, are then below window_moves_at too)
        if num_tokens <= seq.slots_ready_until:
            return True
        total = -(-num_tokens // self.block_size)
        # one full-attention group: its hand-outs without the general path's per-group work, which costs more
        if self.null_block is None and len(self.groups) == 1:
            table = seq.block_tables[0]
            needed = total - len(table)
            if needed > len(self.free_queues[0]):
                return False
            if needed > 0:
                seq.changed_blocks(0, len(table))
                table += self._take(0, needed)
            seq.slots_ready_until = len(table) * self.block_size
            return True
        if self.null_block is not None:
            self._free_left_behind(seq)
        if min(map(len, seq.block_tables)) < total:
            entries = self._new_entries(seq.block_tables, seq.num_computed_tokens, num_tokens)
            if not self._fits(entries):
                return False
            taken = self._take_free_blocks(entries)
            for g, (table, new) in enumerate(zip(seq.block_tables, taken, strict=True)):
                seq.changed_blocks(g, len(table))
                table.extend([self.null_block] * (total - len(new) - len(table)))  # before a window: none held
                table += new
        ready = min(map(len, seq.block_tables)) * self.block_size
        seq.slots_ready_until = ready if self.null_block is None else min(ready, seq.window_moves_at)
        return True

    def _free_left_behind(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq``'s window groups that no token still to compute reads; their
        entries become the null block (the tail first, as ``free`` does)."""
        n = seq.num_computed_tokens
        if n < seq.window_moves_at:  # most decode steps: no window has passed a block since the last call
            return
        seq.window_moves_at = min(group.next_block_behind(n, self.block_size) for group, _ in self.windows)
        null, left = self.null_block, []
        for group, same_window in self.windows:
            first = group.first_needed_block(n, self.block_size)
            for g in same_window:
                table = seq.block_tables[g]
                i = min(first, len(table)) - 1
                if i < 0 or table[i] == null:
                    continue  # nothing new behind the window (the blocks before a null block went earlier)
                start = i  # the table is null blocks, then held ones: free the held ones up to i
                if i and table[i - 1] != null:  # more than block i (a decode step frees that one alone)
                    start = bisect_left(range(i), True, key=lambda j: table[j] != null)
                left += table[i : start - 1 if start else None : -1]
                table[start : i + 1] = [null] * (i + 1 - start)
                seq.changed_blocks(g, start, i + 1)
        if left:  # the window groups share a pool
            self._release(np.array(left, dtype=np.int64), self.window_groups[0][1].pool)

    def _take_free_blocks(self, counts: list[int]) -> list[list[int]]:
        """For each group ``g``, ``counts[g]`` blocks from the front of its pool's free queue, handed to it
        (to be overwritten)."""
        taken: list[list[int]] = [[] for _ in counts]
        for pool, groups in enumerate(self.pool_groups):
            handed_out = self._take(pool, sum([counts[g] for g in groups]))
            end = 0
            for g in groups:
                taken[g] = handed_out[end : end + counts[g]]
                end += counts[g]
        return taken

    def _take(self, pool: int, n: int) -> list[int]:
        """``n`` blocks from the front of pool ``pool``'s free queue, handed out (to be overwritten)."""
        if n <= 0:
            return []
        queue = self.free_queues[pool]
        num_cached = n - min(n, queue.num_uncached)  # they come last, and every cached block is published
        block_ids = queue.take(n)
        if num_cached:
            self._unpublish(block_ids[n - num_cached :])
        self.ref_counts[block_ids] = 1
        self.num_handouts += 1
        self.generations[block_ids] = self.num_handouts
        taken = block_ids.tolist()
        self.newly_allocated += taken
        return taken

    def _unpublish(self, block_ids: np.ndarray) -> None:
        """Take the published ``block_ids`` out of the prefix cache (they are about to be overwritten)."""
        for g, h in zip(self.cache_groups[block_ids].tolist(), self.hashes[block_ids].tolist(), strict=True):
            del self.hash_to_block[g][h]
        self.cache_groups[block_ids] = -1

    def take_newly_allocated(self) -> list[int]:
        """Blocks handed out (to be overwritten) since the last call."""
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that the last step filled, so later requests can share them."""
        full, first = seq.num_computed_tokens // self.block_size, seq.num_committed_blocks
        if not self.enable_prefix_caching or full <= first:
            return
        self._block_hash(seq, full - 1)  # hashed up to the last
        hashes = seq.block_hashes[first:full]
        distinct = len(set(hashes)) == len(hashes)
        # a window group's block records what the anchor's does, the anchor's block before it, as its parent
        # (or without an anchor, the check hash of the prefix): the contents are the same in every group
        anchored: Contents | None = None
        for g in self.full_groups:  # which come first, the anchor first of all
            run = self._contents(seq, first, full, seq.block_tables[g])
            run = self._publish_run(seq, g, first, run, distinct)
            if g == self.anchor:
                anchored = run
        if self.window_groups:
            run = anchored if anchored is not None else self._contents(seq, first, full, None)
            for g, _ in self.window_groups:
                self._publish_run(seq, g, first, run, distinct)
        seq.num_committed_blocks = full

    def _publish_run(self, seq: Sequence, g: int, first: int, run: Contents, distinct: bool) -> Contents:
        """Publish the blocks of ``seq``'s group ``g`` from the ``first`` on, holding ``run`` (``distinct``:
        no two of its hashes equal; for full attention, its parents as the table stands before the first is
        published). Returns the contents as published: a shared copy may replace a full-attention block,
        which changes the parent of the block after it."""
        table, cache = seq.block_tables[g], self.hash_to_block[g]
        block_ids = table[first : first + len(run.hashes)]
        # the common case: a run of new blocks none of which is cached yet (a table is null blocks, then held
        # ones), published at once
        if distinct and block_ids[0] != self.null_block and cache.keys().isdisjoint(run.hashes):
            self._record(block_ids, g, run)
            return run
        run = run._replace(parents=run.parents.copy())
        for row, i in enumerate(range(first, first + len(block_ids))):
            if i and not self.windowed[g]:  # the block before may have become a shared copy
                run.parents[row] = table[i - 1], self.generations[table[i - 1]]
            if table[i] != self.null_block:  # else left behind by its window: nothing to publish
                self._publish(seq, g, i, run.row(row))
        return run

    def _publish(self, seq: Sequence, g: int, i: int, content: Contents) -> None:
        """Publish block ``i`` of ``seq``'s group ``g`` holding ``content`` (a run of one), or share the copy
        already there."""
        table = seq.block_tables[g]
        block_id = table[i]
        cached_id = self.hash_to_block[g].get(content.hashes[0])
        if cached_id is None:
            self._record([block_id], g, content)
        elif cached_id != block_id and self._same_content(np.array([cached_id]), content)[0]:
            # Requests admitted together computed the same prefix twice: share the published copy, so the
            # blocks after it chain to it and stay findable, and return this one.
            pool = self.groups[g].pool
            self._hold(np.array([cached_id]), pool)
            table[i] = cached_id
            seq.changed_blocks(g, i, i + 1)
            self._release(np.array([block_id]), pool)
        # else: a different block under the same hash (a collision); this one stays unpublished

    def _record(self, block_ids: list[int], g: int, run: Contents) -> None:
        """Publish ``block_ids`` (none of whose hashes is in the cache) in group ``g``'s prefix cache,
        holding ``run``."""
        self.hash_to_block[g].update(zip(run.hashes, block_ids))
        if len(block_ids) == 1:  # a decode step's block: scalar stores cost a fraction of index arrays
            b = block_ids[0]
            self.hashes[b], self.tokens[b], self.parents[b] = run.hash_array[0], run.tokens[0], run.parents[0]
            self.cache_groups[b] = g
            return
        block_ids = np.array(block_ids, dtype=np.int64)
        self.hashes[block_ids] = run.hash_array
        self.tokens[block_ids] = run.tokens
        self.parents[block_ids] = run.parents
        self.cache_groups[block_ids] = g

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``. Cached blocks go to the back of the free queue, the tail first so
        the prefix lasts longer; blocks with nothing cached go to the front, to be reused first."""
        for group, table in zip(self.groups, seq.block_tables):
            self._release(self._held(table[::-1]), group.pool)
        seq.drop_tables()
