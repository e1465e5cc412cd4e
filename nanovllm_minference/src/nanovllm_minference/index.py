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

:func:`lines_to_index` builds the index of lines in one Triton launch (on CPU tensors, under Triton's
interpreter); :func:`lines_to_index_reference` is the same in torch, the CPU path and the tests' oracle.
"""

from __future__ import annotations

import functools

import attrs
import torch
import triton
import triton.language as tl

from nanovllm.sparse import cdiv, next_power_of_2

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


PAD = 2**30  # list padding: sorts after every real entry
FORCED = 2.0**24  # the score of always-kept lines, above any sum of softmax rows


def _sorted_padded(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values`` with invalid entries replaced by ``PAD``, sorted ascending along the last dimension (int32:
    half the radix passes of int64)."""
    return torch.where(valid, values.int(), PAD).sort(dim=-1).values


def _compacted(present: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``values`` (int32, broadcast to ``present``) where ``present``, in their order, then ``PAD``; and
    how many. A cumulative count places every entry, where a sort would order them all again."""
    rank = present.cumsum(-1, dtype=torch.int32)  # present entries up to and including this one
    count = rank[..., -1:]
    slot = torch.arange(present.shape[-1], device=present.device, dtype=torch.int32)
    # present entries go to rank - 1; the others follow them, in order
    where = torch.where(present, rank - 1, count + slot - rank)
    out = torch.empty(present.shape, dtype=torch.int32, device=present.device)
    out.scatter_(-1, where.long(), torch.where(present, values, PAD))
    return out, count[..., 0]


def lines_to_index_reference(
    columns: torch.Tensor, column_valid: torch.Tensor, offsets: torch.Tensor, offset_valid: torch.Tensor,
    query_starts: torch.Tensor, max_context_len: int,
) -> SparseIndex:
    """The index of vertical lines and diagonals. ``columns`` ``[S, H, V]`` key positions and ``offsets``
    ``[S, H, K]`` diagonal offsets (query position minus key position, 0 the main diagonal), in any order;
    ``*_valid`` (bool, the same shapes) say which entries are real. A diagonal crosses the rows of a query
    tile in at most two key tiles, at the same offsets from the tile's base for every query tile of the
    sequence; those offsets are the slash tiles."""
    device = columns.device
    cols = _sorted_padded(columns, column_valid)
    reach = -(-max_context_len // TILE) + 1  # R: offsets run from -R to 1
    phase = (query_starts.long() % TILE)[:, None, None]
    o = offsets.long()
    cover = torch.zeros(*o.shape[:2], reach + 3, dtype=torch.int8, device=device)  # the last slot: a dump
    for edge in (0, TILE - 1):
        tile = torch.div(phase + edge - o, TILE, rounding_mode="floor")
        cover.scatter_(-1, torch.where(offset_valid, tile + reach, reach + 2), 1)
    cover = cover[..., : reach + 2].contiguous()
    offsets_from_base = torch.arange(reach + 2, device=device, dtype=torch.int32) - reach
    tiles, tile_counts = _compacted(cover.bool(), offsets_from_base)
    return SparseIndex(cols, column_valid.sum(-1, dtype=torch.int32), tiles, tile_counts, cover)


SORTED_IN_KERNEL = 4096  # wider column lists are sorted by torch: one program would hold them all


@triton.jit
def _mark_crossed_tiles(cover_row, o, keep, phase, reach, width, TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Mark in ``cover_row`` the key tiles that the kept diagonals at offsets ``o`` cross. A diagonal at offset
    o crosses the rows of a query tile in the key tiles of its first and last row: offsets
    floor((phase + edge - o) / TILE) from the base tile, shifted by ``reach`` (>= 0: o < context)."""
    for edge in tl.static_range(2):
        at = (phase + edge * (TILE - 1) - o + reach * TILE) // TILE
        tl.store(cover_row + at, tl.full([CHUNK], 1, tl.int8), mask=keep & (at >= 0) & (at < width))


@triton.jit
def _pad_from(out, count, n, PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Fill entries ``count`` to ``n - 1`` of ``out`` with ``PAD``."""
    for j0 in range(0, n, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        tl.store(out + j, tl.full([CHUNK], PAD, tl.int32), mask=(j >= count) & (j < n))


@triton.jit
def _list_marked_tiles(cover_row, tiles_row, width, reach, PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Write the marked tiles of ``cover_row`` (offsets from the base tile, less ``reach``) to ``tiles_row``
    ascending, then ``PAD`` to ``width``; returns how many. A running count places each."""
    count = tl.full([], 0, tl.int32)
    for j0 in range(0, width, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        present = tl.load(cover_row + j, mask=j < width, other=0).to(tl.int32)
        rank = tl.cumsum(present, 0)
        tl.store(tiles_row + count + rank - 1, (j - reach).to(tl.int32), mask=present != 0)
        count += tl.sum(present, 0)
    _pad_from(tiles_row, count, width, PAD, CHUNK)
    return count


@triton.jit(do_not_specialize=["num_heads", "num_columns", "num_offsets", "reach"])
def _lines_kernel(
    columns, column_valid, offsets, offset_valid, query_starts,
    sorted_columns, column_counts, slash_tiles, slash_counts, cover,
    num_heads, num_columns, num_offsets, reach,
    TILE: tl.constexpr, PAD: tl.constexpr, COLUMNS: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per (sequence, head) row of the index. ``cover`` is zero on entry; ``COLUMNS`` 0: the
    columns are sorted by the caller."""
    row = tl.program_id(0).to(tl.int64)
    if COLUMNS > 0:
        slot = tl.arange(0, COLUMNS)  # names of their own: Triton types a name once per function
        in_list = slot < num_columns
        listed = tl.load(column_valid + row * num_columns + slot, mask=in_list, other=0).to(tl.int1)
        c = tl.load(columns + row * num_columns + slot, mask=in_list, other=0).to(tl.int32)
        tl.store(sorted_columns + row * num_columns + slot, tl.sort(tl.where(listed, c, PAD)), mask=in_list)
        tl.store(column_counts + row, tl.sum(listed.to(tl.int32), 0))
    width = reach + 2
    cover_row = cover + row * width
    phase = tl.load(query_starts + row // num_heads).to(tl.int64) % TILE
    for j0 in range(0, num_offsets, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        live = j < num_offsets
        real = tl.load(offset_valid + row * num_offsets + j, mask=live, other=0).to(tl.int1) & live
        o = tl.load(offsets + row * num_offsets + j, mask=real, other=0).to(tl.int64)
        _mark_crossed_tiles(cover_row, o, real, phase, reach, width, TILE, CHUNK)
    tl.debug_barrier()  # every mark is made before any is read
    count = _list_marked_tiles(cover_row, slash_tiles + row * width, width, reach, PAD, CHUNK)
    tl.store(slash_counts + row, count)


def lines_to_index(
    columns: torch.Tensor, column_valid: torch.Tensor, offsets: torch.Tensor, offset_valid: torch.Tensor,
    query_starts: torch.Tensor, max_context_len: int,
) -> SparseIndex:
    """:func:`lines_to_index_reference` in one launch (Triton) and a fill, where the reference launches some
    thirty small torch kernels for every prefill chunk and layer."""
    num_seqs, num_heads, width = columns.shape
    device = columns.device
    reach = -(-max_context_len // TILE) + 1
    cover = torch.zeros(num_seqs, num_heads, reach + 2, dtype=torch.int8, device=device)
    tiles = torch.empty(num_seqs, num_heads, reach + 2, dtype=torch.int32, device=device)
    tile_counts = torch.empty(num_seqs, num_heads, dtype=torch.int32, device=device)
    sorted_here = width <= SORTED_IN_KERNEL
    if sorted_here:
        cols = torch.empty(num_seqs, num_heads, width, dtype=torch.int32, device=device)
        col_counts = torch.empty(num_seqs, num_heads, dtype=torch.int32, device=device)
    else:
        cols, col_counts = _sorted_padded(columns, column_valid), column_valid.sum(-1, dtype=torch.int32)
    if num_seqs * num_heads > 0:
        _lines_kernel[(num_seqs * num_heads,)](
            columns.contiguous(), column_valid.contiguous(), offsets.contiguous(), offset_valid.contiguous(),
            query_starts.contiguous(), cols, col_counts, tiles, tile_counts, cover,
            num_heads, width, offsets.shape[-1], reach,
            TILE=TILE, PAD=PAD, COLUMNS=next_power_of_2(max(width, 1)) if sorted_here else 0,
            CHUNK=1024,
        )
    return SparseIndex(cols, col_counts, tiles, tile_counts, cover)


def ranked_lines_reference(
    vertical: torch.Tensor, slash: torch.Tensor, context_lens: torch.Tensor, num_sink_tokens: int,
    num_recent_diags: int,
) -> torch.Tensor:
    """The scores :func:`top_lines` ranks by, columns then diagonals (float32, ``[2, S, H, L]``): forced
    lines above any sum, nearest first; lines at or past a sequence's context at -inf."""
    pos = torch.arange(vertical.shape[-1], device=vertical.device)
    lens = context_lens.long()[:, None, None]

    def ranked(scores: torch.Tensor, forced: int) -> torch.Tensor:
        scores = torch.where(pos < forced, FORCED - pos, scores.float())
        return torch.where(pos < lens, scores, float("-inf"))

    return torch.stack((ranked(vertical, num_sink_tokens), ranked(slash, num_recent_diags)))


@triton.jit
def _ranked_kernel(vertical, slash, context_lens, ranked_vertical, ranked_slash, num_heads, length,
                   num_sink_tokens, num_recent_diags, FORCED: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (sequence and head, BLOCK lines): both kinds of line."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < length
    visible = pos < tl.load(context_lens + row // num_heads)
    at = row * length + pos
    v = tl.load(vertical + at, mask=inside, other=0.0).to(tl.float32)
    v = tl.where(pos < num_sink_tokens, FORCED - pos.to(tl.float32), v)
    tl.store(ranked_vertical + at, tl.where(visible, v, float("-inf")), mask=inside)
    d = tl.load(slash + at, mask=inside, other=0.0).to(tl.float32)
    d = tl.where(pos < num_recent_diags, FORCED - pos.to(tl.float32), d)
    tl.store(ranked_slash + at, tl.where(visible, d, float("-inf")), mask=inside)


def ranked_lines(
    vertical: torch.Tensor, slash: torch.Tensor, context_lens: torch.Tensor, num_sink_tokens: int,
    num_recent_diags: int,
) -> torch.Tensor:
    """:func:`ranked_lines_reference` in one launch (Triton) instead of ten elementwise torch kernels."""
    num_seqs, num_heads, length = vertical.shape
    out = torch.empty(2, *vertical.shape, dtype=torch.float32, device=vertical.device)
    vertical, slash = vertical.contiguous(), slash.contiguous()
    if out.numel():
        block = 1024
        _ranked_kernel[(num_seqs * num_heads, cdiv(length, block))](
            vertical, slash, context_lens, out[0], out[1], num_heads, length,
            num_sink_tokens, num_recent_diags, FORCED=FORCED, BLOCK=block,
        )
    return out


def top_lines(
    vertical: torch.Tensor, slash: torch.Tensor, context_lens: torch.Tensor, vertical_sizes: torch.Tensor,
    slash_sizes: torch.Tensor, num_sink_tokens: int, num_recent_diags: int,
    max_sizes: tuple[int, int] | None = None, sizes_equal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MInference's choice from the estimated scores ``[S, H, L]``: the ``vertical_sizes[s, h]`` best
    columns, the first ``num_sink_tokens`` always among them (first when the budget is smaller), and the
    ``slash_sizes[s, h]`` best diagonals, the ``num_recent_diags`` nearest always among them. Returns
    (columns, column_valid, offsets, offset_valid) for :func:`lines_to_index`. ``max_sizes``: host ints at
    least every vertical and slash size, which saves reading the sizes back. ``sizes_equal``: every size
    equals its bound in ``max_sizes``, so the best lines are taken unordered (no sort inside topk)."""
    if sizes_equal and max_sizes is None:
        raise ValueError("sizes_equal needs max_sizes: the sizes every head and sequence shares")
    length = vertical.shape[-1]
    rank = ranked_lines if vertical.device.type == "cuda" else ranked_lines_reference
    ranked = rank(vertical, slash, context_lens, num_sink_tokens, num_recent_diags)
    sizes = (vertical_sizes, slash_sizes)
    ks = [min(int(s.max()) if bound is None else bound, length)
          for s, bound in zip(sizes, max_sizes or (None, None), strict=True)]
    # one topk for both kinds of line: on the GPU each call on long rows is some twenty launches, which set
    # the pace of a small model's prefill; the kind with the smaller budget takes its best from the wider
    # selection
    wide = max(ks)
    top = ranked.topk(wide, dim=-1, sorted=not sizes_equal)
    lines = []
    for values, indices, k, kind_sizes in zip(top.values, top.indices, ks, sizes, strict=True):
        if k < wide and sizes_equal:  # unordered: the best k of the wider selection
            best = values.topk(k, dim=-1, sorted=False)
            values, indices = best.values, indices.gather(-1, best.indices)
        elif k < wide:  # best first: the first k
            values, indices = values[..., :k], indices[..., :k]
        valid = values > float("-inf")  # past the context
        if not sizes_equal:  # best first: a head's first sizes[s, h] are its own
            valid &= torch.arange(k, device=values.device) < kind_sizes[..., None]
        lines += [indices, valid]
    return tuple(lines)


def tile_slash_lines(
    slash: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor, slash_sizes: torch.Tensor,
    num_recent_diags: int, max_slash_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diagonals chosen a slash tile at a time: ``(offsets, valid)`` ``[S, H, K]`` for :func:`lines_to_index`.

    A query tile reads a key tile at offset ``-j`` from its base through the diagonals ``p + 64 j + v``,
    ``|v| < TILE``, a share ``(TILE - |v|) / TILE`` of its rows each (``p``: the chunk's first position modulo
    ``TILE``). Each such band is scored by those shares of the estimate's diagonal scores ``slash``
    ``[S, H, L]``, and the best bands are kept as their middle diagonal ``p + 64 j``, which crosses that key
    tile alone. A head keeps ``ceil(slash_sizes[h] / TILE)`` tiles: the ``num_recent_diags`` nearest diagonals
    (always kept, as themselves) and the bands they touch count within them (``slash_sizes``: ``[H]``, or
    ``[S, H]`` or ``[S, 1]`` per sequence). ``max_slash_size``: a host int at least every size."""
    device = slash.device
    num_seqs, num_heads, width = slash.shape
    phase = (query_starts.long() % TILE)[:, None, None, None]  # [S, 1, 1, 1]
    num_bands = -(-width // TILE) + 1
    j = torch.arange(num_bands, device=device)[:, None]
    v = torch.arange(1 - TILE, TILE, device=device)
    diagonal = phase + TILE * j + v  # [S, 1, bands, 2 TILE - 1]
    inside = (diagonal >= 0) & (diagonal < context_lens.long()[:, None, None, None])
    scores = slash.gather(-1, (diagonal.clamp(0, width - 1) * inside).flatten(2).expand(-1, num_heads, -1))
    weights = (TILE - v.abs()).float() / TILE * inside
    bands = (scores.view(num_seqs, num_heads, num_bands, -1) * weights).sum(-1)  # [S, H, bands]
    middle = phase[..., 0] + TILE * j[:, 0]  # [S, 1, bands]
    recent = middle - (TILE - 1) <= num_recent_diags - 1  # bands the nearest diagonals touch
    reaches = middle - (TILE - 1) < context_lens.long()[:, None, None]
    sizes = torch.broadcast_to(slash_sizes.long(), (num_seqs, num_heads))[..., None]
    kept = -(-sizes // TILE) - recent.sum(-1, keepdim=True)  # [S, H, 1]
    top = torch.where(recent | ~reaches, -1.0, bands).topk(min(-(-max_slash_size // TILE), num_bands), dim=-1)
    rank = torch.arange(top.indices.shape[-1], device=device)
    valid = (rank < kept) & (top.values >= 0)
    offsets = phase[..., 0] + TILE * top.indices
    nearest = torch.arange(num_recent_diags, device=device).expand(num_seqs, num_heads, -1)
    near_ok = nearest < context_lens.long()[:, None, None]
    return torch.cat([nearest, offsets], -1), torch.cat([near_ok, valid], -1)


def select_index_reference(
    vertical: torch.Tensor, slash: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
    vertical_sizes: torch.Tensor, slash_sizes: torch.Tensor, num_sink_tokens: int, num_recent_diags: int,
    max_sizes: tuple[int, int], max_context_len: int, adaptive_budget: float | None = None,
) -> SparseIndex:
    """The index of every head's best lines (:func:`top_lines`, then :func:`lines_to_index_reference`) from
    the estimate ``vertical``, ``slash`` ``[S, H, L]``. ``*_sizes``: ``[H]`` int64, the lines each head
    keeps in every sequence; with ``adaptive_budget`` they are ignored and each sequence keeps that fraction
    of its context, 20% as columns and 80% as diagonals (the seed fork's rule). ``max_sizes``: host ints at
    least every size."""
    lens = context_lens.long()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    num_seqs, num_heads = vertical.shape[:2]
    sizes = [t[None, :].expand(num_seqs, num_heads) for t in (vertical_sizes, slash_sizes)]
    if adaptive_budget is not None:
        budget = (lens.double() * adaptive_budget)[:, None].expand(-1, num_heads)
        sizes = [(budget * share).long().clamp(min=1) for share in (0.2, 0.8)]
    lines = top_lines(vertical, slash, context_lens, *sizes, num_sink_tokens, num_recent_diags, max_sizes)
    return lines_to_index_reference(*lines, lens - q_lens, max_context_len)


@triton.jit
def _line_keys(row, c, ctx, forced, FORCED: tl.constexpr):
    """The ranking of lines ``c`` (:func:`ranked_lines_reference`) as int32 keys that order as the scores
    do (the scores are >= 0), and whether each line lies inside the context (the others are never kept)."""
    inside = c < ctx
    score = tl.load(row + c, mask=inside, other=0.0)
    score = tl.where(c < forced, FORCED - c.to(tl.float32), score)
    return tl.maximum(score.to(tl.int32, bitcast=True), 0), inside  # -0.0 as 0


@triton.jit
def _kth_key(row, ctx, n, forced, FORCED: tl.constexpr, CHUNK: tl.constexpr):
    """``(key, ties)``: the ``n``-th largest key of a row's lines inside the context, and how many lines of
    that key are kept (the first ones) along with every larger one. A radix selection: four passes of
    eight bits, each a histogram of the lines that match the key's bits found so far."""
    prefix = tl.full([], 0, tl.int32)
    remaining = n
    bins = tl.arange(0, 512)
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        counts = tl.zeros([512], tl.int32)
        for c0 in range(0, ctx, CHUNK):
            key, inside = _line_keys(row, c0 + tl.arange(0, CHUNK), ctx, forced, FORCED)
            match = inside
            if level > 0:
                match = match & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            counts += tl.histogram(tl.where(match, (key >> shift) & 255, 256), 512)  # 256: not counted
        counts = tl.where(bins < 256, counts, 0)
        at_least = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts  # lines whose digit is >= the bin's
        digit = tl.max(tl.where((at_least >= remaining) & (bins < 256), bins, 0), 0)
        remaining -= tl.sum(tl.where(bins > digit, counts, 0), 0)
        prefix = prefix | (digit << shift)
    return prefix, remaining


@triton.jit(do_not_specialize=["num_heads", "width", "num_columns", "reach", "num_sink_tokens",
                               "num_recent_diags"])
def _select_kernel(
    vertical, slash, cu_q, context_lens, vertical_sizes, slash_sizes,
    columns, column_counts, slash_tiles, slash_counts, cover,
    num_heads, width, num_columns, reach, num_sink_tokens, num_recent_diags, adaptive,
    ADAPTIVE: tl.constexpr, FORCED: tl.constexpr, TILE: tl.constexpr, PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per (sequence and head, kind of line): program 0 of the second axis keeps the head's
    best columns and lists them ascending; program 1 keeps its best diagonals and marks the slash tiles
    they cross (as ``_lines_kernel``)."""
    row = tl.program_id(0).to(tl.int64)
    s = row // num_heads
    ctx = tl.load(context_lens + s)
    if tl.program_id(1) == 0:
        if ADAPTIVE:  # the seed fork's rule: 20% of the budget as columns, in float64 as the reference
            size = tl.maximum((ctx.to(tl.float64) * tl.load(adaptive) * 0.2).to(tl.int64), 1)
        else:
            size = tl.load(vertical_sizes + row % num_heads)
        n = tl.minimum(size, ctx).to(tl.int32)
        scores = vertical + row * width
        key, ties = _kth_key(scores, ctx, n, num_sink_tokens, FORCED, CHUNK)
        out = columns + row * num_columns
        count = tl.full([], 0, tl.int32)
        tied = tl.full([], 0, tl.int32)
        for c0 in range(0, tl.where(n > 0, ctx, 0), CHUNK):  # none kept: no line read
            c = c0 + tl.arange(0, CHUNK)
            k, inside = _line_keys(scores, c, ctx, num_sink_tokens, FORCED)
            equal = inside & (k == key)
            keep = inside & ((k > key) | (equal & (tied + tl.cumsum(equal.to(tl.int32), 0) <= ties)))
            rank = tl.cumsum(keep.to(tl.int32), 0)
            tl.store(out + count + rank - 1, c, mask=keep)
            count += tl.sum(keep.to(tl.int32), 0)
            tied += tl.sum(equal.to(tl.int32), 0)
        _pad_from(out, count, num_columns, PAD, CHUNK)
        tl.store(column_counts + row, count)
    else:
        if ADAPTIVE:  # and 80% as diagonals
            size = tl.maximum((ctx.to(tl.float64) * tl.load(adaptive) * 0.8).to(tl.int64), 1)
        else:
            size = tl.load(slash_sizes + row % num_heads)
        n = tl.minimum(size, ctx).to(tl.int32)
        scores = slash + row * width
        key, ties = _kth_key(scores, ctx, n, num_recent_diags, FORCED, CHUNK)
        cover_width = reach + 2
        cover_row = cover + row * cover_width
        for j0 in range(0, cover_width, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            tl.store(cover_row + j, tl.zeros([CHUNK], tl.int8), mask=j < cover_width)
        tl.debug_barrier()  # zeroed before any mark
        phase = (ctx - (tl.load(cu_q + s + 1) - tl.load(cu_q + s))).to(tl.int64) % TILE
        tied = tl.full([], 0, tl.int32)
        for o0 in range(0, tl.where(n > 0, ctx, 0), CHUNK):  # none kept: no line read
            o = o0 + tl.arange(0, CHUNK)
            k, inside = _line_keys(scores, o, ctx, num_recent_diags, FORCED)
            equal = inside & (k == key)
            keep = inside & ((k > key) | (equal & (tied + tl.cumsum(equal.to(tl.int32), 0) <= ties)))
            tied += tl.sum(equal.to(tl.int32), 0)
            _mark_crossed_tiles(cover_row, o.to(tl.int64), keep, phase, reach, cover_width, TILE, CHUNK)
        tl.debug_barrier()  # every mark is made before any is read
        count = _list_marked_tiles(cover_row, slash_tiles + row * cover_width, cover_width, reach, PAD, CHUNK)
        tl.store(slash_counts + row, count)


def select_index(
    vertical: torch.Tensor, slash: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
    vertical_sizes: torch.Tensor, slash_sizes: torch.Tensor, num_sink_tokens: int, num_recent_diags: int,
    max_sizes: tuple[int, int], max_context_len: int, adaptive_budget: float | None = None,
) -> SparseIndex:
    """:func:`select_index_reference` in one Triton launch and no torch op, where ranking, ``topk`` and the
    index take some twenty launches. Of lines with equal scores the first are kept (``torch.topk`` leaves
    the choice open)."""
    num_seqs, num_heads, width = vertical.shape
    device = vertical.device
    reach = -(-max_context_len // TILE) + 1
    num_columns = max(1, min(max_sizes[0], width))
    columns = torch.empty(num_seqs, num_heads, num_columns, dtype=torch.int32, device=device)
    tiles = torch.empty(num_seqs, num_heads, reach + 2, dtype=torch.int32, device=device)
    cover = torch.empty(num_seqs, num_heads, reach + 2, dtype=torch.int8, device=device)
    column_counts, tile_counts = torch.empty(2, num_seqs, num_heads, dtype=torch.int32, device=device)
    if num_seqs * num_heads > 0:
        _select_kernel[(num_seqs * num_heads, 2)](
            vertical.contiguous(), slash.contiguous(), cu_seqlens_q, context_lens, vertical_sizes,
            slash_sizes,
            columns, column_counts, tiles, tile_counts, cover,
            num_heads, width, num_columns, reach, num_sink_tokens, num_recent_diags,
            vertical_sizes if adaptive_budget is None else _float64_scalar(adaptive_budget, device),
            ADAPTIVE=adaptive_budget is not None, FORCED=FORCED, TILE=TILE, PAD=PAD, CHUNK=2048,
            num_warps=8,
        )
    return SparseIndex(columns, column_counts, tiles, tile_counts, cover)


@functools.cache
def _float64_scalar(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a float64 device tensor, made once: a Triton float argument is float32."""
    return torch.tensor([value], dtype=torch.float64, device=device)


def block_sparse_index(
    q: torch.Tensor, keys: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
    top_k: torch.Tensor, max_query_len: int, max_top_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference's block-sparse pattern: per query tile, the ``top_k[h]`` key tiles whose mean key scores
    highest against the tile's mean query, block-causal; the key tiles holding the query tile's own
    positions are always kept. ``q`` ``[T, H, D]``, ``keys`` ``[S, L, Hkv, D]`` (position order, L at
    least the longest context). ``max_top_k``: the largest ``top_k`` as a host int, which saves reading it
    back. Returns (blocks ``[S, H, M, K]``, counts ``[S, H, M]``)."""
    device = q.device
    num_seqs, length, num_kv_heads, head_dim = keys.shape
    num_heads = q.shape[1]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lens = context_lens.long()
    tiles_q, tiles_k = -(-max_query_len // TILE), -(-length // TILE)
    # mean query of each query tile: rows scattered into [S * M, H, D] by (sequence, row // TILE)
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=q.shape[0])
    row = torch.arange(q.shape[0], device=device) - cu_seqlens_q.long()[seq_of_row]
    slot = seq_of_row * tiles_q + row // TILE
    q_sum = torch.zeros(num_seqs * tiles_q, num_heads, head_dim, device=device, dtype=torch.float32)
    q_sum.index_add_(0, slot, q.float())
    q_count = torch.zeros(num_seqs * tiles_q, device=device).index_add_(0, slot, torch.ones_like(slot, dtype=torch.float))
    q_mean = (q_sum / q_count.clamp(min=1)[:, None, None]).view(num_seqs, tiles_q, num_heads, head_dim)
    # mean key of each key tile, over the positions below the context length
    pad = tiles_k * TILE - length
    real = (torch.arange(tiles_k * TILE, device=device)[None, :] < lens[:, None]).float()
    k_padded = torch.nn.functional.pad(keys.float(), (0, 0, 0, 0, 0, pad)) * real[..., None, None]
    k_sum = k_padded.view(num_seqs, tiles_k, TILE, num_kv_heads, head_dim).sum(2)
    k_mean = k_sum / real.view(num_seqs, tiles_k, TILE).sum(-1).clamp(min=1)[..., None, None]
    k_mean = k_mean.repeat_interleave(num_heads // num_kv_heads, dim=2)  # [S, NT, H, D]
    scores = torch.einsum("smhd,snhd->shmn", q_mean, k_mean)
    # the query tile's first and last positions: keep their tiles, drop the tiles after the last
    q_start = (lens - q_lens)[:, None]
    first = q_start + torch.arange(tiles_q, device=device)[None, :] * TILE
    last = torch.minimum(first + TILE - 1, lens[:, None] - 1)
    key_tile = torch.arange(tiles_k, device=device)
    own = (key_tile[None, None, :] == (first // TILE)[..., None]) | (key_tile[None, None, :] == (last // TILE)[..., None])
    scores = torch.where(own[:, None], float("inf"), scores)
    scores = torch.where((key_tile[None, None, :] <= (last // TILE)[..., None])[:, None], scores, float("-inf"))
    k = min(int(top_k.max()) if max_top_k is None else max_top_k, tiles_k)
    best = scores.topk(k, dim=-1)
    rank = torch.arange(k, device=device)
    top_k = top_k.to(device)[None, :, None, None]
    valid = (best.values > float("-inf")) & ((rank < top_k) | (best.values == float("inf"))) & (top_k > 0)
    blocks = _sorted_padded(best.indices, valid)
    return blocks, valid.sum(-1, dtype=torch.int32)


def index_mask(index: SparseIndex, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """The keys each query row reads, ``[R, H, L]`` bool (L the longest context), for the packed query
    rows ``rows`` (default: all of them): the definition in this module's docstring, spelled out densely.
    The oracle of the kernels' tests and of the quality measurements."""
    device = context_lens.device
    cu = cu_seqlens_q.long()
    lens = context_lens.long()
    if rows is None:
        rows = torch.arange(int(cu[-1]), device=device)
    length = int(lens.max())
    num_seqs, num_heads = index.columns.shape[:2]
    seq = torch.searchsorted(cu, rows, right=True) - 1
    r = rows - cu[seq]
    position = lens[seq] - (cu[seq + 1] - cu[seq]) + r
    tile_q = r // TILE
    base = (position - r % TILE) // TILE
    key = torch.arange(length, device=device)
    key_tile = key // TILE
    # slash tiles: the cover at the key tile's offset from the row's base tile
    reach = index.cover_offset
    offset = key_tile[None, :] - base[:, None]  # [R, L]
    inside = (offset >= -reach) & (offset <= 1)
    cover = index.slash_cover[seq].bool()  # [R, H, reach + 2]
    mask = torch.gather(cover, 2, (offset.clamp(-reach, 1) + reach)[:, None, :].expand(-1, num_heads, -1))
    mask &= inside[:, None, :]
    # columns
    real = torch.arange(index.columns.shape[-1], device=device) < index.column_counts[..., None]
    cols = torch.zeros(num_seqs, num_heads, length + 1, dtype=torch.bool, device=device)
    cols.scatter_(2, torch.where(real, index.columns.long(), length).clamp(max=length), True)
    mask |= cols[seq, :, :length]
    # block-sparse tiles of the row's query tile
    if index.blocks is not None:
        tiles_k = -(-length // TILE)
        real = torch.arange(index.blocks.shape[-1], device=device) < index.block_counts[..., None]
        listed = torch.zeros(*index.blocks.shape[:3], tiles_k + 1, dtype=torch.bool, device=device)
        listed.scatter_(3, torch.where(real, index.blocks.long(), tiles_k).clamp(max=tiles_k), True)
        mask |= listed[seq, :, tile_q][:, :, key_tile]
    visible = (key[None, :] <= position[:, None]) & (key[None, :] < lens[seq][:, None])
    return mask & visible[:, None, :]


def computed_density(index: SparseIndex, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                     max_query_len: int | None = None) -> float:
    """The attention work the kernel does over the work of dense causal attention: every listed tile a
    query tile reaches counts in full (TILE x TILE, as the kernel computes it), every column up to the
    tile's last row once per row. Duplicated columns count twice (an upper bound); what drives the time.
    ``max_query_len`` (a host int, at least every chunk's length) saves reading the lengths back. The
    reference of :func:`~nanovllm_minference.attention.index_density`, which computes it in one launch."""
    device = context_lens.device
    lens = context_lens.long()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    q_start = (lens - q_lens)[:, None]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    m = torch.arange(-(-max_query_len // TILE), device=device)[None, :]
    first = q_start + m * TILE
    rows = (torch.minimum(first + TILE, lens[:, None]) - first).clamp(min=0)  # [S, M], 0 past the chunk
    base, last = first // TILE, (first + rows - 1) // TILE
    num_heads = index.slash_tiles.shape[1]

    def entries_at_most(lists: torch.Tensor, counts: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        """[S, H, M]: how many of each head's first ``counts`` (ascending) entries are <= ``bound`` [S, M];
        what follows them is never read (the search runs over the real entries, then ``PAD``)."""
        bound = bound[:, None, :].expand(-1, num_heads, -1).contiguous()
        real = torch.arange(lists.shape[-1], device=device) < counts[..., None]
        return torch.searchsorted(torch.where(real, lists.long(), PAD), bound, right=True)

    # slash offsets d with 0 <= base + d <= last; columns up to the tile's last row
    tiles = (entries_at_most(index.slash_tiles, index.slash_counts, last - base)
             - entries_at_most(index.slash_tiles, index.slash_counts, -base - 1))
    columns = entries_at_most(index.columns, index.column_counts, first + rows - 1)
    work = tiles * TILE * rows[:, None, :] + columns * rows[:, None, :]
    if index.blocks is not None:
        work = work + index.block_counts.long() * TILE * rows[:, None, :]
    dense = ((q_start + 1) * q_lens[:, None] + q_lens[:, None] * (q_lens[:, None] - 1) // 2).sum()
    return float(work.sum().double() / (dense * index.columns.shape[1]).double())
