"""Paged KV blocks: allocation, reference counts, and the prefix cache.

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
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: tuple[int, int] | None = None  # (block id, generation) of the block before it
        self.generation = 0  # bumped each time the block is handed out (its content is overwritten)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.hash_to_block: dict[int, int] = {}
        self.newly_allocated: list[int] = []  # handed out since take_newly_allocated (policies reset them)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """Chained hash of the ``index``-th full block of ``seq`` (cached on the sequence)."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            prev = seq.block_hashes[i - 1] if i else None
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            seq.block_hashes.append(chain_hash(prev, tokens))
        return seq.block_hashes[index]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding a prefix of ``seq``; at least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            block_id = self.hash_to_block.get(self._block_hash(seq, i))
            if block_id is None:
                break
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = self._parent_key(hits[-1] if hits else None)
            if not self._same_content(self.blocks[block_id], tokens, parent):
                break  # a hash collision, not a hit
            hits.append(block_id)
        return hits

    def _parent_key(self, parent_id: int | None) -> tuple[int, int] | None:
        """What a block after block ``parent_id`` records as its parent (``None``: it starts a sequence)."""
        if parent_id is None:
            return None
        return parent_id, self.blocks[parent_id].generation

    @staticmethod
    def _same_content(block: Block, tokens: tuple[int, ...], parent: tuple[int, int] | None) -> bool:
        return block.token_ids == tokens and block.parent == parent

    def can_allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        reused_free = sum(1 for b in hits if b in self.free_blocks)
        new = max(0, -(-num_tokens // self.block_size) - len(hits))
        return new + reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Admit ``seq``: share the cached prefix ``hits`` and give it slots up to ``num_tokens``."""
        assert not seq.block_table
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        assert self.append_slots(seq, num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq`` to ``num_tokens`` slots; ``False`` (and no change) if blocks run out."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its content is about to be overwritten
        block.hash, block.token_ids, block.parent, block.ref_count = None, None, None, 1
        block.generation += 1
        self.newly_allocated.append(block_id)
        return block_id

    def take_newly_allocated(self) -> list[int]:
        """Blocks handed out (to be overwritten) since the last call."""
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that the last step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_committed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = self._block_hash(seq, i)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = self._parent_key(seq.block_table[i - 1] if i else None)
            cached_id = self.hash_to_block.get(h)
            if cached_id is None:
                block.hash, block.token_ids, block.parent = h, tokens, parent
                self.hash_to_block[h] = block.block_id
            elif cached_id != block.block_id and self._same_content(self.blocks[cached_id], tokens, parent):
                # Requests admitted together computed the same prefix twice: share the published copy, so
                # the blocks after it chain to it and stay findable, and return this one.
                cached = self.blocks[cached_id]
                if cached.ref_count == 0:
                    del self.free_blocks[cached_id]
                cached.ref_count += 1
                seq.block_table[i] = cached_id
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.free_blocks[block.block_id] = None
                    self.free_blocks.move_to_end(block.block_id, last=False)  # nothing worth keeping
            # else: a different block under the same hash (a collision); this one stays unpublished
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``. Cached blocks go to the back of the free queue, the tail first so
        the prefix lasts longer; blocks with nothing cached go to the front, to be reused first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table = []
