"""Paged KV blocks: allocation, reference counts, and the prefix cache, for every KV cache group.

A block holds ``block_size`` consecutive tokens of one or more sequences. A full block is named by a
chained hash: ``xxh64(hash of the previous block, its token ids)``, so equal hashes mean equal
prefixes. A hit is verified before it is shared, without trusting the hash: the block must hold the
same token ids and follow the same parent block (block id and generation, bumped whenever a block is
handed out again), so a hash collision can only cost a hit, never give a wrong one. A block whose last
user is gone goes to the back of the free queue but keeps its content and hash, so a later request
with the same prefix can take it back until it is handed out again and overwritten. A block with nothing
to keep (prefix caching off, a partial block) goes to the front and is handed out next: the engine then
writes only as many blocks as it ever holds at once, and on the CPU, where the cache's pages become
resident when first written, the process does not grow towards the whole cache's size.

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

from collections import ChainMap, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.kv.groups import KVCacheGroup, needs_null_block

FULL_ATTENTION = (KVCacheGroup((), None),)  # the one group of a model without windows


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def check_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    """A second chained hash, independent of ``chain_hash`` (another function): what a window group of a
    model without full attention checks a cached block's prefix by, where the blocks before it are gone."""
    h = xxhash.xxh3_64(seed=0x9E3779B9)
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "pool", "ref_count", "hash", "token_ids", "parent", "generation", "group")

    def __init__(self, block_id: int, pool: int = 0) -> None:
        self.block_id = block_id
        self.pool = pool  # the pool it belongs to (KVCacheGroup.pool of the groups it is handed to)
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: tuple[int, int] | None = None  # (block id, generation) of the block before it
        self.generation = 0  # bumped each time the block is handed out (its content is overwritten)
        self.group = 0  # the KV cache group whose prefix cache names it, while it has a hash


class FreeQueue:
    """One pool's free blocks, in the order they are handed out: first the ones with nothing cached (a stack,
    the last given back first), then the cached ones, oldest first. Lists and slices let a run of blocks
    come and go at once."""

    __slots__ = ("uncached", "cached")

    def __init__(self, block_ids: Iterable[int]) -> None:
        self.uncached: list[int] = list(block_ids)[::-1]  # handed out from the end
        self.cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.uncached) + len(self.cached)

    def __iter__(self) -> Iterator[int]:
        yield from reversed(self.uncached)
        yield from self.cached

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.cached or block_id in self.uncached

    def take(self, n: int) -> list[int]:
        """The first ``n`` blocks (there must be as many)."""
        taken = self.uncached[: -n - 1 : -1]
        del self.uncached[len(self.uncached) - len(taken) :]
        cached = self.cached
        taken += [cached.popitem(last=False)[0] for _ in range(n - len(taken))]
        return taken


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` tokens shared by the KV cache ``groups`` (default: one
    full-attention group); with ``num_window_blocks``, the groups of pool 1 (KV offload's window groups)
    take theirs from that many more, ids ``num_blocks`` on. Where a group has a window, the last block id
    (``null_block``) is kept back as the null block and ``blocks`` holds the others."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: SequenceABC[KVCacheGroup] = FULL_ATTENTION, num_window_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = tuple(groups)
        if any(g.pool for g in self.groups) != bool(num_window_blocks):
            raise ValueError("num_window_blocks sizes the pool of the KV cache groups of pool 1, and only it")
        # the last id: the managed blocks stay 0..n-1, all free when num_free_blocks == len(blocks)
        total = num_blocks + num_window_blocks
        self.null_block = total - 1 if needs_null_block(self.groups) else None
        num_managed = total - (self.null_block is not None)
        self.blocks = [Block(i, int(i >= num_blocks)) for i in range(num_managed)]
        # per pool, oldest first
        self.free_queues = [FreeQueue(range(min(num_blocks, num_managed)))]
        if num_window_blocks:
            self.free_queues.append(FreeQueue(range(num_blocks, num_managed)))
        self.hash_to_block: list[dict[int, int]] = [{} for _ in self.groups]  # per group
        # the first full-attention group: a window group's block records its parent there (see _cached_blocks)
        self.anchor = next((g for g, group in enumerate(self.groups) if group.sliding_window is None), None)
        self.windowed = [group.sliding_window is not None for group in self.groups]
        self.window_groups = [(g, group) for g, group in enumerate(self.groups) if self.windowed[g]]
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

    def _fits(self, entries: list[int], reused: SequenceABC[int] = ()) -> bool:
        """Whether each pool has the blocks to hand out ``entries[g]`` new ones to each group ``g`` and to
        take back the free cached blocks ``reused``."""
        if len(self.free_queues) == 1:  # the common case, once per running sequence and step
            return sum(entries) + len(reused) <= len(self.free_queues[0])
        need = [0] * len(self.free_queues)
        for group, n in zip(self.groups, entries, strict=True):
            need[group.pool] += n
        for block_id in reused:
            need[self.blocks[block_id].pool] += 1
        return all(n <= len(queue) for n, queue in zip(need, self.free_queues, strict=True))

    def _take_back(self, block_id: int) -> None:
        """One more user of ``block_id``, which leaves its free queue if it was there."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queues[block.pool].cached[block_id]  # a block with something to share is cached
        block.ref_count += 1

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
        return self._chained(seq, seq.block_hashes, chain_hash, index)

    def _chained(self, seq: Sequence, chain: list[int], hash_fn: Callable[[int | None, list[int]], int],
                 index: int) -> int:
        """``hash_fn`` chained over ``seq``'s full blocks up to the ``index``-th, extending ``chain`` (the
        sequence's cache of that chain) as far as needed."""
        while len(chain) <= index:
            i = len(chain)
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            chain.append(hash_fn(chain[i - 1] if i else None, tokens))
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
        for g in sorted(range(len(self.groups)), key=lambda g: self.groups[g].sliding_window is not None):
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
        tokens after the same prefix (``_parent_of``; ``anchor``: the anchor group's blocks found so far). For
        full attention the chain from the first block up to the first miss; for a window every block, None
        where missing, since it need not keep the blocks before its window."""
        cache, chain = self.hash_to_block[g], self.groups[g].sliding_window is None
        found: list[int | None] = []
        for i in range(max_blocks):
            block_id = cache.get(self._block_hash(seq, i))
            if block_id is not None:
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                parent = self._parent_of(seq, g, i, found, anchor)
                if not self._same_content(self.blocks[block_id], tokens, parent):
                    block_id = None  # a hash collision, not a hit
            if block_id is None and chain:
                break
            found.append(block_id)
        return found

    def _parent_of(self, seq: Sequence, g: int, i: int, table: SequenceABC[int | None],
                   anchor: SequenceABC[int | None]) -> tuple[int, int] | None:
        """What proves the prefix before block ``i`` of ``seq`` in group ``g`` (``table``: its blocks,
        ``anchor``: the anchor group's): the block before it (id and generation) in a full-attention group;
        in a window group, which may have freed that block, the anchor group's block before it, or without
        an anchor (every layer has a window) ``(-1, check_hash of the prefix)``, a second chained hash
        independent of the first."""
        if not i:
            return None
        if self.groups[g].sliding_window is None:
            return self._parent_key(table[i - 1])
        if self.anchor is not None:
            return self._parent_key(anchor[i - 1])
        return -1, self._check_hash(seq, i - 1)

    def _check_hash(self, seq: Sequence, index: int) -> int:
        """``check_hash`` chained over the first ``index + 1`` blocks of ``seq`` (cached on the sequence)."""
        return self._chained(seq, seq.block_checks, check_hash, index)

    def _parent_key(self, parent_id: int | None) -> tuple[int, int] | None:
        """What a block after block ``parent_id`` records as its parent (``None``: it starts a sequence, or
        follows the null block, which proves nothing)."""
        if parent_id is None or parent_id == self.null_block:
            return None
        return parent_id, self.blocks[parent_id].generation

    def can_allocate(self, seq: Sequence, hits: list[list[int]], num_tokens: int) -> bool:
        held = {b for blocks in hits for b in blocks if b != self.null_block}
        reused_free = [b for b in held if self.blocks[b].ref_count == 0]
        return self._fits(self._new_entries(hits, len(hits[0]) * self.block_size, num_tokens), reused_free)

    def allocate(self, seq: Sequence, hits: list[list[int]], num_tokens: int) -> None:
        """Admit ``seq``: share the cached prefix ``hits`` (one list per group, as ``find_cached_prefix``
        gives it) and give it slots up to ``num_tokens``."""
        assert not seq.block_tables
        for blocks in hits:
            for block_id in blocks:
                if block_id != self.null_block:
                    self._take_back(block_id)
        seq.block_tables = [list(blocks) for blocks in hits]
        seq.num_committed_blocks = len(hits[0])
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits[0]) * self.block_size
        assert self.append_slots(seq, num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Free the blocks that ``seq``'s windows have left, then grow it to ``num_tokens`` slots; ``False``
        (and no other change) if blocks run out."""
        total = -(-num_tokens // self.block_size)
        if self.null_block is None and len(self.groups) == 1:  # one full-attention group: every step's case
            table = seq.block_tables[0]
            needed = total - len(table)
            if needed > len(self.free_queues[0]):
                return False
            if needed > 0:
                seq.changed_blocks(0, len(table))
                table += self._take_free_blocks(0, needed)
            return True
        if self.null_block is not None:
            self._free_left_behind(seq)
        if min(map(len, seq.block_tables)) >= total:  # most decode steps: every group has its slots
            return True
        entries = self._new_entries(seq.block_tables, seq.num_computed_tokens, num_tokens)
        if not self._fits(entries):
            return False
        for g, (table, new) in enumerate(zip(seq.block_tables, entries, strict=True)):
            seq.changed_blocks(g, len(table))
            table.extend([self.null_block] * (total - new - len(table)))  # before a window: nothing to hold
            table += self._take_free_blocks(g, new)
        return True

    def _free_left_behind(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq``'s window groups that no token still to compute reads; their
        entries become the null block (the tail first, as ``free`` does)."""
        null = self.null_block
        for g, group in self.window_groups:
            table = seq.block_tables[g]
            i = min(group.first_needed_block(seq.num_computed_tokens, self.block_size), len(table)) - 1
            if i < 0 or table[i] == null:
                continue  # nothing new behind the window (the blocks before a null block went earlier)
            start = i  # the table is null blocks, then held ones: free the held ones up to i
            while start and table[start - 1] != null:
                start -= 1
            self._release_all(table[i : start - 1 if start else None : -1])
            table[start : i + 1] = [null] * (i + 1 - start)
            seq.changed_blocks(g, start)

    def _take_free_blocks(self, group: int, n: int) -> list[int]:
        """``n`` blocks from the front of group ``group``'s free queue, handed to it (to be overwritten)."""
        if n <= 0:
            return []
        caches, blocks = self.hash_to_block, self.blocks
        taken = self.free_queues[self.groups[group].pool].take(n)
        for block_id in taken:
            block = blocks[block_id]
            if block.hash is not None:
                if caches[block.group].get(block.hash) == block_id:
                    del caches[block.group][block.hash]  # its content is about to be overwritten
                block.hash = block.token_ids = block.parent = None
            block.ref_count = 1
            block.generation += 1
        self.newly_allocated += taken
        return taken

    def take_newly_allocated(self) -> list[int]:
        """Blocks handed out (to be overwritten) since the last call."""
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that the last step filled, so later requests can share them."""
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_committed_blocks:
            return
        bs, tables, first = self.block_size, seq.block_tables, seq.num_committed_blocks
        anchor = tables[self.anchor] if self.anchor is not None else []
        hashes = [self._block_hash(seq, i) for i in range(first, full)]
        tokens = [tuple(seq.token_ids[i * bs : (i + 1) * bs]) for i in range(first, full)]
        # group by group, the full-attention ones first (the anchor, group 0, first of all): a window group's
        # block records the anchor's block before it as its parent, as the anchor's own does (or without an
        # anchor, the check hash), the same in every window group
        parents: list[tuple[int, int] | None] = []
        for g, table in enumerate(tables):
            if not self.windowed[g]:
                for i in range(first, full):
                    parent = self._parent_of(seq, g, i, table, anchor)
                    if g == self.anchor:
                        parents.append(parent)
                    self._publish(seq, g, i, hashes[i - first], tokens[i - first], parent)
        if not self.window_groups:
            seq.num_committed_blocks = full
            return
        null, blocks = self.null_block, self.blocks
        if self.anchor is None:
            parents = [self._parent_of(seq, self.window_groups[0][0], i, (), anchor) for i in range(first, full)]
        distinct = len(set(hashes)) == len(hashes)
        for g, _ in self.window_groups:
            table, cache = tables[g], self.hash_to_block[g]
            ids = table[first:full]
            if distinct and null not in ids and cache.keys().isdisjoint(hashes):
                # the common case, a run of new blocks none of which is cached yet: publish them at once
                for block_id, h, t, parent in zip(ids, hashes, tokens, parents):
                    block = blocks[block_id]
                    block.hash, block.token_ids, block.parent, block.group = h, t, parent, g
                cache.update(zip(hashes, ids))
                continue
            for i in range(first, full):
                if table[i] != null:  # else left behind by its window: nothing to publish
                    self._publish(seq, g, i, hashes[i - first], tokens[i - first], parents[i - first])
        seq.num_committed_blocks = full

    def _publish(self, seq: Sequence, g: int, i: int, h: int, tokens: tuple[int, ...],
                 parent: tuple[int, int] | None) -> None:
        """Publish block ``i`` of ``seq``'s group ``g`` under hash ``h``, or share the copy already there."""
        table, cache = seq.block_tables[g], self.hash_to_block[g]
        block = self.blocks[table[i]]
        cached_id = cache.get(h)
        if cached_id is None:
            block.hash, block.token_ids, block.parent, block.group = h, tokens, parent, g
            cache[h] = block.block_id
        elif cached_id != block.block_id and self._same_content(self.blocks[cached_id], tokens, parent):
            # Requests admitted together computed the same prefix twice: share the published copy, so the
            # blocks after it chain to it and stay findable, and return this one.
            self._take_back(cached_id)
            table[i] = cached_id
            seq.changed_blocks(g, i)
            self._release(block.block_id)
        # else: a different block under the same hash (a collision); this one stays unpublished

    @staticmethod
    def _same_content(block: Block, tokens: tuple[int, ...], parent: tuple[int, int] | None) -> bool:
        return block.token_ids == tokens and block.parent == parent

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block no one holds goes to the back of the free queue when it is cached
        (reused last), to the front when not (reused first)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            queue = self.free_queues[block.pool]
            if block.hash is None:
                queue.uncached.append(block_id)
            else:
                queue.cached[block_id] = None

    def _release_all(self, block_ids: list[int]) -> None:
        """``_release`` each of ``block_ids`` (blocks of one pool), in order."""
        if not block_ids:
            return
        blocks = self.blocks
        queue = self.free_queues[blocks[block_ids[0]].pool]
        uncached, cached = queue.uncached, queue.cached
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_count -= 1
            if not block.ref_count:
                if block.hash is None:
                    uncached.append(block_id)
                else:
                    cached[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``. Cached blocks go to the back of the free queue, the tail first so
        the prefix lasts longer; blocks with nothing cached go to the front, to be reused first."""
        null = self.null_block
        for table in seq.block_tables:
            self._release_all([b for b in reversed(table) if b != null])
        seq.block_tables = []
