"""Triton kernels of the offload engine's per-layer bookkeeping on a selection, one launch each instead of
the twenty-odd small torch ops of their references in :mod:`nanovllm.kv.offload` (offload decode is
host bound, so every op saved per layer counts).

- ``selected_piece``: from a selection made on the device, one slot's piece: the head blocks to load, the
  piece's selection and KV length per virtual sequence, and the slot row of each new token.
- ``patch_slot``: write the step's new K/V into the slot rows a piece gives them.
- ``cached_piece``: a decode selection through a layer's cache region: where each selected head block is,
  what to load where, and the cache's new contents.
- ``load_misses``: copy the head blocks a cache region lacks from the pinned pool.

Same signatures and results as the references (integers: exact). On CPU tensors they run under Triton's
interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernel_sizes import next_power_of_2


@triton.jit
def _new_token_rows(Rows, Cu, Pos, part, valid, head_blocks, s, h, num_tokens, block_size, scratch_row,
                    BLOCK_T: tl.constexpr):
    """The slot row of each of sequence ``s``'s new tokens for KV head ``h``: in the head block
    ``head_blocks[j]`` where its block is the piece's ``part[j]``, else the scratch row."""
    t0 = tl.load(Cu + s)
    t1 = tl.load(Cu + s + 1)
    for start in range(t0, t1, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        ok = t < t1
        pos = tl.load(Pos + t, mask=ok, other=0)
        block = (pos // block_size).to(tl.int32)
        at = tl.max(tl.where((part[None, :] == block[:, None]) & valid[None, :], head_blocks[None, :], -1), 1)
        row = at.to(tl.int64) * block_size + pos % block_size
        tl.store(Rows + h * num_tokens + t, tl.where(at >= 0, row, scratch_row), mask=ok)


@triton.jit
def _selected_piece_kernel(
    Sel, Tables, Lens, Cu, Pos, Ids, Selection, PieceLens, Rows,
    num_seqs, num_tokens, first, width, num_kv_heads, block_size, scratch_id, scratch_row,
    stride_sel_s, stride_sel_h, stride_tab_s,
    BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
):
    r = tl.program_id(0)  # virtual sequence h * num_seqs + s
    h = r // num_seqs
    s = r % num_seqs
    i = tl.arange(0, BLOCK_W)
    inside = i < width
    part = tl.load(Sel + s * stride_sel_s + h * stride_sel_h + first + i, mask=inside, other=-1)
    valid = part >= 0
    physical = tl.load(Tables + s * stride_tab_s + tl.where(valid, part, 0), mask=valid, other=0).to(tl.int64)
    tl.store(Ids + r * width + i, tl.where(valid, physical * num_kv_heads + h, scratch_id), mask=inside)
    count = tl.sum(valid.to(tl.int32), 0)  # valid entries come first: the selection is -1 padded at the end
    tl.store(Selection + r * width + i, tl.where(i < count, i, -1), mask=inside)
    n = tl.load(Lens + s).to(tl.int32)
    partial = tl.where(n > 0, (n - 1) // block_size, -2)  # the block of the last token, if any
    has_partial = tl.sum((valid & (part == partial)).to(tl.int32), 0) > 0
    tl.store(PieceLens + r, count * block_size - tl.where(has_partial, block_size - (n - partial * block_size), 0))
    _new_token_rows(Rows, Cu, Pos, part, valid, r * width + i, s, h, num_tokens, block_size, scratch_row, BLOCK_T)


def selected_piece(
    sel: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    first: int, width: int, block_size: int, scratch_id: int, scratch_row: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`nanovllm.kv.offload.selected_piece_reference`."""
    num_seqs, num_kv_heads = sel.shape[:2]
    rows_v = num_kv_heads * num_seqs
    dev = sel.device
    ids = torch.empty(rows_v * width, dtype=torch.int64, device=dev)
    selection = torch.empty(rows_v, width, dtype=torch.int32, device=dev)
    piece_lens = torch.empty(rows_v, dtype=torch.int32, device=dev)
    rows = torch.empty(num_kv_heads, positions.shape[0], dtype=torch.int64, device=dev)
    if sel.stride(-1) != 1:
        sel = sel.contiguous()
    block_w = next_power_of_2(max(width, 1))
    block_t = max(1, min(64, 4096 // block_w))
    _selected_piece_kernel[(rows_v,)](
        sel, tables, lens, cu, positions, ids, selection, piece_lens, rows,
        num_seqs, positions.shape[0], first, width, num_kv_heads, block_size, scratch_id, scratch_row,
        sel.stride(0), sel.stride(1), tables.stride(0), BLOCK_W=block_w, BLOCK_T=block_t,
    )
    return ids, selection, piece_lens, rows


@triton.jit
def _patch_slot_kernel(
    Slot, Rows, K, V, num_tokens, block_size, head_dim,
    stride_slot_block, stride_slot_kv, stride_slot_row, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # h * num_tokens + t
    h = pid // num_tokens
    t = pid % num_tokens
    row = tl.load(Rows + pid)
    d = tl.arange(0, BLOCK_D)
    ok = d < head_dim
    k = tl.load(K + t * stride_k_t + h * stride_k_h + d, mask=ok)
    v = tl.load(V + t * stride_v_t + h * stride_v_h + d, mask=ok)
    to = Slot + (row // block_size) * stride_slot_block + (row % block_size) * stride_slot_row + d
    tl.store(to, k.to(Slot.dtype.element_ty), mask=ok)
    tl.store(to + stride_slot_kv, v.to(Slot.dtype.element_ty), mask=ok)


def patch_slot(slot: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """See :func:`nanovllm.kv.offload.patch_slot_reference`."""
    num_kv_heads, num_tokens = rows.shape
    if num_kv_heads * num_tokens == 0:
        return
    rows = rows.contiguous()
    head_dim = slot.shape[-1]
    keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (keys, values))
    _patch_slot_kernel[(num_kv_heads * num_tokens,)](
        slot, rows, keys, values, num_tokens, slot.shape[2], head_dim,
        slot.stride(0), slot.stride(1), slot.stride(2), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), BLOCK_D=next_power_of_2(head_dim),
    )


@triton.jit
def _cached_piece_kernel(
    Sel, Tables, Lens, Cu, Pos, Held, Loads, VTables, Selection, PieceLens, Rows, Counts,
    num_seqs, num_tokens, k, num_kv_heads, block_size, base, first_block, scratch_row,
    stride_sel_s, stride_sel_h, stride_tab_s,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    c = tl.program_id(0)  # cache row s * kv_heads + h
    s = c // num_kv_heads
    h = c % num_kv_heads
    r = h * num_seqs + s  # virtual row
    i = tl.arange(0, BLOCK_K)
    inside = i < k
    part = tl.load(Sel + s * stride_sel_s + h * stride_sel_h + i, mask=inside, other=-1)
    valid = part >= 0
    physical = tl.load(Tables + s * stride_tab_s + tl.where(valid, part, 0), mask=valid, other=0)
    wanted = tl.where(valid, (first_block + physical) * num_kv_heads + h, -1)
    n = tl.load(Lens + s).to(tl.int32)
    partial = tl.where(n > 0, (n - 1) // block_size, -2)  # the block of the last token, if any
    newest = valid & (part == partial)
    held = tl.load(Held + c * k + i, mask=inside, other=-1)
    match = (wanted[:, None] == held[None, :]) & (valid & ~newest)[:, None] & (held >= 0)[None, :]
    hit = tl.max(tl.where(match, i[None, :], -1), 1)
    miss = valid & (hit < 0)
    free = inside & (tl.max(match.to(tl.int32), 0) == 0)
    rank_miss = tl.cumsum(miss.to(tl.int32), 0) - 1
    rank_free = tl.cumsum(free.to(tl.int32), 0) - 1
    assign = miss[:, None] & free[None, :] & (rank_miss[:, None] == rank_free[None, :])
    position = tl.where(miss, tl.max(tl.where(assign, i[None, :], -1), 1), hit)
    loads = tl.max(tl.where(assign, wanted[:, None], -1), 0)
    kept = tl.max(tl.where(assign & ~newest[:, None], wanted[:, None], -1), 0)
    tl.store(Loads + c * k + i, loads, mask=inside)
    tl.store(Held + c * k + i, tl.where(tl.max(assign.to(tl.int32), 0) > 0, kept, held), mask=inside)
    count = tl.sum(valid.to(tl.int32), 0)
    loaded = tl.sum(miss.to(tl.int32), 0)
    tl.atomic_add(Counts, loaded.to(tl.int64))
    tl.atomic_add(Counts + 1, (count - loaded).to(tl.int64))
    flat = base + c * k + position
    tl.store(VTables + r * k + i, tl.where(i < count, flat, 0), mask=inside)
    tl.store(Selection + r * k + i, tl.where(i < count, i, -1), mask=inside)
    has_partial = tl.sum(newest.to(tl.int32), 0) > 0
    unfilled = tl.where(has_partial, block_size - (n - partial * block_size), 0)
    tl.store(PieceLens + r, count * block_size - unfilled)
    _new_token_rows(Rows, Cu, Pos, part, valid, flat, s, h, num_tokens, block_size, scratch_row, BLOCK_T)


def cached_piece(
    sel: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    held: torch.Tensor, base: int, first_block: int, block_size: int, scratch_row: int, counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`nanovllm.kv.offload.cached_piece_reference`."""
    num_seqs, num_kv_heads, k = sel.shape
    n_rows = num_kv_heads * num_seqs
    dev = sel.device
    loads = torch.empty(n_rows * k, dtype=torch.int32, device=dev)
    tables_v = torch.empty(n_rows, k, dtype=torch.int32, device=dev)
    selection = torch.empty(n_rows, k, dtype=torch.int32, device=dev)
    piece_lens = torch.empty(n_rows, dtype=torch.int32, device=dev)
    rows = torch.empty(num_kv_heads, positions.shape[0], dtype=torch.int64, device=dev)
    if sel.stride(-1) != 1:
        sel = sel.contiguous()
    block_k = next_power_of_2(max(k, 1))
    _cached_piece_kernel[(n_rows,)](
        sel, tables, lens, cu, positions, held, loads, tables_v, selection, piece_lens, rows, counts,
        num_seqs, positions.shape[0], k, num_kv_heads, block_size, base, first_block, scratch_row,
        sel.stride(0), sel.stride(1), tables.stride(0),
        BLOCK_K=block_k, BLOCK_T=max(1, min(64, 4096 // block_k)), num_warps=8 if block_k >= 128 else 4,
    )
    return loads, tables_v, selection, piece_lens, rows


@triton.jit
def _load_misses_kernel(Pool, Flat, Loads, base, elems, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    source = tl.load(Loads + j)
    if source >= 0:
        o = tl.arange(0, BLOCK)
        ok = o < elems
        x = tl.load(Pool + source.to(tl.int64) * elems + o, mask=ok)
        tl.store(Flat + (base + j).to(tl.int64) * elems + o, x, mask=ok)


def load_misses(pool: torch.Tensor, flat: torch.Tensor, loads: torch.Tensor, base: int) -> None:
    """See :func:`nanovllm.kv.offload.load_misses`: ``pool`` and ``flat`` are contiguous head blocks."""
    elems = flat[0].numel()
    if loads.shape[0]:
        block = next_power_of_2(elems)
        _load_misses_kernel[(loads.shape[0],)](pool, flat, loads, base, elems, BLOCK=block)
