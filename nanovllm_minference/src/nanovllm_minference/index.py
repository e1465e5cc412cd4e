"""The sparse index: which keys each query head of each sequence reads, in tiles of ``TILE`` keys.

A prefill chunk's query rows are cut into query tiles of ``TILE`` rows: tile ``m`` of sequence ``s`` holds
its rows ``TILE*m ..`` at positions ``q_start + TILE*m ..``, where ``q_start = context_len - query_len``.
Its *base key tile* is ``(q_start + TILE*m) // TILE``; key tile ``t`` holds positions ``TILE*t .. TILE*t+TILE-1``.

A row at position ``p`` of query tile ``m`` reads key ``c`` when ``c <= p`` (causal) and one of:

- **slash tiles**: ``c // TILE - base(m)`` is one of the head's tile offsets (diagonal bands of tiles, the
  same for every query tile: that is how a set of diagonals looks in tiles);
- **columns**: ``c`` is one of the head's vertical columns;
- **blocks**: ``c // TILE`` is one of the key tiles listed for query tile ``m`` (block-sparse heads).

A head uses slash tiles and columns, or blocks, never both, so no key is counted twice. Lists are
ascending and padded at the end; counts say how many entries are real.
"""

from __future__ import annotations

import attrs
import torch

TILE = 64  # query rows and keys per tile; MInference's 64 x 64 blocks


@attrs.frozen
class SparseIndex:
    columns: torch.Tensor  # int32 [S, H, NV] ascending key positions
    column_counts: torch.Tensor  # int32 [S, H]
    slash_tiles: torch.Tensor  # int32 [S, H, NS] ascending tile offsets from the query tile's base tile
    slash_counts: torch.Tensor  # int32 [S, H]
    slash_cover: torch.Tensor  # int8 [S, H, R + 2]: 1 at index d + R where offset d is a slash tile (d in -R..1)
    blocks: torch.Tensor | None = None  # int32 [S, H, M, NB] ascending key tiles per query tile
    block_counts: torch.Tensor | None = None  # int32 [S, H, M]

    @property
    def cover_offset(self) -> int:
        """``R``: the slash-cover index of tile offset 0."""
        return self.slash_cover.shape[-1] - 2
