"""KV cache groups: layers that share one block table (vLLM's hybrid KV cache manager).

Layers with the same attention type and window form groups. A full-attention group keeps every block of a
sequence; a sliding-window group keeps only the blocks that the window of some token still to be computed
reaches, and the blocks before it are freed (their entries in the table become the null block).

All groups take their blocks from one pool. A pool block has one slot per layer of the largest group: the
``i``-th layer of every group reads and writes slot ``i``, so a block handed to a group holds one block of
tokens for each of its layers. Groups are therefore made of equal size (see :func:`kv_cache_groups`).

Under KV offload there are two pools (:func:`offload_groups`): the host pool, whose block holds every
full-attention layer (one group), and a GPU pool of the sliding-window groups' own (``pool=1``), whose
block has one slot per layer of its largest group. The block manager numbers pool 1's blocks after pool 0's.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class KVCacheGroup:
    """Layers (ids in model order) that share a block table; ``sliding_window`` (tokens, the query's own
    included) for sliding-window layers, None for full attention; ``pool``: the block pool its blocks come
    from (0, or 1 for the sliding-window groups' own pool under KV offload)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None
    pool: int = 0

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block that the window of the token at position ``num_computed_tokens`` (the next one to
        compute) reaches: every block before it is no longer read (0 for full attention)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // block_size

    def next_block_behind(self, num_computed_tokens: int, block_size: int) -> int:
        """The least number of computed tokens at which :meth:`first_needed_block` passes its value at
        ``num_computed_tokens``: where the window next leaves a block behind (a window group only)."""
        first = self.first_needed_block(num_computed_tokens, block_size)
        return (first + 1) * block_size + self.sliding_window - 1

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds in this group at once, computed in
        chunks of at most ``max_chunk`` tokens: every block for full attention; for a window, the window
        before the chunk and the chunk itself (one block more where they straddle block boundaries)."""
        every = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return every
        span = self.sliding_window - 1 + min(max_chunk, num_tokens)
        return min(every, -(-span // block_size) + 1)


def kv_cache_groups(windows: Sequence[int | None], hybrid: bool = True) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer ``i`` has window ``windows[i]`` (None: full attention).

    With ``hybrid`` False, or when every layer has the same window, one group of every layer (with no window
    unless ``hybrid`` keeps the one all layers share). Otherwise the layers of each window (full attention
    first, then windows in ascending order) are cut, in model order, into groups of ``size`` layers: the
    fewest layers any window has, or the most when that is under 1.25 times the fewest (vLLM's rule: a few
    padded slots cost less than many groups). A window whose count ``size`` does not divide ends with a
    smaller group; its blocks leave the slots it lacks unused (padding), which the KV sizing counts.
    """
    if not windows:
        raise ValueError("a model with KV cache groups has at least one attention layer")
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if not hybrid or len(kinds) == 1:
        return (KVCacheGroup(tuple(range(len(windows))), kinds[0] if hybrid and len(kinds) == 1 else None),)
    layers = {w: [i for i, lw in enumerate(windows) if lw == w] for w in kinds}
    fewest, most = min(map(len, layers.values())), max(map(len, layers.values()))
    size = most if most < 1.25 * fewest else fewest
    return tuple(
        KVCacheGroup(tuple(ids[i : i + size]), w) for w in kinds for ids in [layers[w]]
        for i in range(0, len(ids), size)
    )


def offload_groups(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose full-attention layers live in the host pool (KV offload; ``windows`` as
    :func:`kv_cache_groups` takes them): every full-attention layer in one group, since a host pool block
    holds each of them, then the sliding-window layers grouped among themselves as :func:`kv_cache_groups`
    groups them, in a GPU pool of their own (``pool=1``)."""
    full = tuple(i for i, w in enumerate(windows) if w is None)
    windowed = [i for i, w in enumerate(windows) if w is not None]
    groups = (KVCacheGroup(full),) if full else ()
    if windowed:
        groups += tuple(KVCacheGroup(tuple(windowed[i] for i in g.layer_ids), g.sliding_window, pool=1)
                        for g in kv_cache_groups([windows[i] for i in windowed]))
    return groups


def num_slots(groups: Sequence[KVCacheGroup], pool: int = 0) -> int:
    """Layer slots of one block of ``pool``: the size of its largest group (0 without groups there)."""
    return max((len(g.layer_ids) for g in groups if g.pool == pool), default=0)


def layer_places(groups: Sequence[KVCacheGroup]) -> list[tuple[int, int]]:
    """``(group, slot)`` of each layer, in layer order."""
    places = {layer: (g, slot) for g, group in enumerate(groups)
              for slot, layer in enumerate(group.layer_ids)}
    return [places[layer] for layer in range(len(places))]


def needs_null_block(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether some group frees blocks that leave its window, which its table then names by the null block
    (the last block of the window groups' pool)."""
    return any(g.sliding_window is not None for g in groups)


def blocks_per_sequence(
    groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, max_chunk: int
) -> int:
    """Pool blocks one sequence of ``num_tokens`` tokens needs at most, over every group of ``groups``."""
    return sum(g.max_blocks(num_tokens, block_size, max_chunk) for g in groups)


def kv_bytes_per_token(groups: Sequence[KVCacheGroup], layer_bytes_per_token: int) -> tuple[int, ...]:
    """Bytes of KV each group holds per token it keeps: the slots of its pool's blocks (padding included)
    times ``layer_bytes_per_token`` (K and V of one token in one layer)."""
    return tuple(num_slots(groups, g.pool) * layer_bytes_per_token for g in groups)


__all__ = ["KVCacheGroup", "blocks_per_sequence", "kv_bytes_per_token", "kv_cache_groups", "layer_places",
           "needs_null_block", "num_slots", "offload_groups"]
