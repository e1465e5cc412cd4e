"""Triton kernels of the ``triton`` attention backend, and the wrappers that launch them.

Five kernels:

- ``_store_kv_kernel``: one program per new token writes its keys and values to their cache slot.
- ``_stage_context_kernel``: one program per (page, KV head, sequence) copies a context's keys and values
  out of the paged cache into contiguous pages of ``STAGED_PAGE`` tokens, whose key tiles the prefill kernel
  loads through TMA, and writes their block table.
- ``_prefill_kernel``: FlashAttention-style varlen attention, one program per (query tile, head,
  sequence), online softmax in base 2. Keys come either from the paged cache through the block table
  (optionally through lists of selected logical blocks, one per sequence or one per KV head of each
  sequence: a KV-head stride of 0 shares a list) or from dense per-step ``k``/``v`` tensors.
  Causal tiles are visited in two loops: the tiles wholly below the diagonal without masks, then the
  rest with masks.
- ``_decode_kernel``: one query token per sequence. A program owns one KV head of one sequence and
  all the query heads of its GQA group (so each K/V tile is read once for the group), and one of
  ``num_splits`` slices of the keys (split-KV, "flash decoding"); ``_reduce_kernel`` merges the slices
  by log-sum-exp. With one split the decode kernel writes the output directly.

Knobs that change speed, never results (:class:`PrefillConfig`, :class:`DecodeConfig`): tiles, warps,
pipeline stages, the split count's target, and structural options (TMA loads of the unmasked key tiles, a
heads-first prefill grid, decode tiles read unmasked with their pages a tile ahead). A small rule
(``_prefill_config``, ``_decode_config``) picks them from the module's defaults, which
``benchmarks/kernel_sweep.py`` measures against the alternatives on a GPU.

Every wrapper takes its grid sizes from host integers (``max_query_len``, the batch, head counts,
``max_context_len``) and never reads device values back, so decode can be captured in a CUDA graph.
On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported), with small tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.attention.backend import selection_per_kv_head
from nanovllm.dependent_launch import launch_options, wait_for_previous
from nanovllm.kernel_sizes import cdiv, next_power_of_2
from nanovllm.kv.cache_dtype import EIGHT_BIT_FLOATS

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, slots,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    tl.store(KC + dst, cache_value(k, KC), mask=mask)
    tl.store(VC + dst, cache_value(v, VC), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share one layout"
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


# tokens a page of staged contexts: whole key tiles of the prefill kernel's TMA loads
STAGED_PAGE = 128


@triton.jit
def _stage_context_kernel(
    KC, VC, K, V, block_tables, context_lens, staged_tables,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_bt, stride_st, stride_kt, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    j = tl.program_id(0)  # the sequence's j-th cache page
    h = tl.program_id(1)
    s = tl.program_id(2)
    first = 0  # the sequence's first staged page: after the pages of the sequences before it
    for s0 in range(0, s, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lens = tl.load(context_lens + offs_s, mask=offs_s < s, other=0)
        first += tl.sum((lens + PAGE - 1) // PAGE)
    ctx = tl.load(context_lens + s)
    if (h == 0) & (j % (PAGE // BLOCK_SIZE) == 0):  # one program a staged page writes its table entry
        p = j // (PAGE // BLOCK_SIZE)
        tl.store(staged_tables + s * stride_st + p, tl.where(p * PAGE < ctx, first + p, -1))
    n = ctx - j * BLOCK_SIZE  # the page's tokens still in the context
    if n <= 0:
        return
    blk = tl.load(block_tables + s * stride_bt + j).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t[:, None] < n) & (offs_d[None, :] < HEAD_DIM)
    src = blk * stride_cb + offs_t[:, None] * stride_cs + h * stride_ch + offs_d[None, :] * stride_cd
    rows = (first * PAGE + j * BLOCK_SIZE + offs_t).to(tl.int64)
    dst = rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
    tl.store(K + dst, tl.load(KC + src, mask=mask), mask=mask)
    tl.store(V + dst, tl.load(VC + src, mask=mask), mask=mask)


def stage_context(k_cache, v_cache, block_tables, context_lens, max_context_len: int,
                  k_pages: torch.Tensor, v_pages: torch.Tensor, staged_tables: torch.Tensor) -> None:
    """Copy each sequence's keys and values, positions ``[0, context_lens[s])``, from the paged caches
    ``[num_blocks, block_size, Hkv, D]`` into the contiguous pages ``k_pages`` / ``v_pages`` ``[pages, page,
    Hkv, D]`` (``page`` a multiple of ``block_size``): each sequence from the first page after those of the
    sequences before it, and its pages' indices into ``staged_tables`` ``[num_seqs, cdiv(max_context_len,
    page)]`` int32 (-1 past its context), a block table of the staged pages. ``max_context_len`` (a host int)
    sizes the grid. Torch reference: :func:`stage_context_reference`."""
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    page = k_pages.shape[1]
    if num_seqs == 0 or max_context_len == 0:
        return
    assert page % block_size == 0, "a staged page holds whole cache pages"
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share one layout"
    assert k_pages.is_contiguous() and v_pages.is_contiguous(), "the staged pages are written contiguous"
    assert staged_tables.shape == (num_seqs, cdiv(max_context_len, page)) and staged_tables.stride(1) == 1
    _stage_context_kernel[(cdiv(max_context_len, block_size), num_kv_heads, num_seqs)](
        k_cache, v_cache, k_pages, v_pages, block_tables, context_lens, staged_tables,
        *k_cache.stride(), block_tables.stride(0), staged_tables.stride(0), k_pages.stride(1),
        k_pages.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_SIZE=block_size, PAGE=page, BLOCK_S=64,
        num_warps=4 if block_size * head_dim >= 2048 else 1,
    )


def stage_context_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: Sequence[int],
    page: int = STAGED_PAGE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`stage_context` writes, in torch ops: ``(k_pages, v_pages, staged_tables)``, the pages
    holding every sequence's context (zeros past each one's end)."""
    block_size = k_cache.shape[1]
    counts = [cdiv(n, page) for n in context_lens]
    k_pages, v_pages = (c.new_zeros(sum(counts), page, *c.shape[2:]) for c in (k_cache, v_cache))
    tables = torch.full((len(counts), cdiv(max(context_lens, default=0), page)), -1, dtype=torch.int32)
    first = 0
    for s, (n, count) in enumerate(zip(context_lens, counts, strict=True)):
        slots = (block_tables[s, : cdiv(n, block_size)].long()[:, None] * block_size
                 + torch.arange(block_size, device=k_cache.device)).flatten()[:n]
        for staged, cache in ((k_pages, k_cache), (v_pages, v_cache)):
            staged[first : first + count].flatten(0, 1)[:n] = cache.flatten(0, 1)[slots]
        tables[s, :count] = torch.arange(first, first + count)
        first += count
    return k_pages, v_pages, tables.to(k_cache.device)


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------


@triton.jit
def tile_blocks(bt_row, start_n, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The physical cache block of each key of tile ``start_n`` (a scalar when the tile lies in one
    block); 0 for a key at or past ``end``, which is then never read. ``bt_row`` points at the sequence's
    block-table row.

    Public: plugin kernels read their paged keys through it. A loop that calls it for the next tile,
    one iteration ahead of that tile's key loads, gets three pipeline stages from Triton; called for the
    tile it loads, two."""
    if BLOCK_N <= BLOCK_SIZE:
        blocks = tl.load(bt_row + start_n // BLOCK_SIZE, mask=start_n < end, other=0)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        blocks = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0)
    return blocks


@triton.jit
def _selected_blocks(sel, bt_row, start_n, num_sel, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The logical block (-1: none) and physical block of each key of selected-key tile ``start_n``."""
    j = (start_n + tl.arange(0, BLOCK_N)) // BLOCK_SIZE
    logical = tl.load(sel + j, mask=j < num_sel, other=-1)
    phys = tl.load(bt_row + logical, mask=logical >= 0, other=0)
    return logical, phys


@triton.jit
def _key_offsets(
    start_n, s, kvh, q_start, n_keys, kv_len,
    block_tables, sel, stride_bt, num_sel,
    stride_kb, stride_ks, stride_kh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, HAS_INDICES: tl.constexpr,
):
    """Offsets (into the K/V base) of the key rows of tile ``start_n``, their positions, and validity.

    Keys are numbered ``0 .. n_keys``: positions in the sequence, or with ``HAS_INDICES`` slots of
    the selected blocks (``n = j * BLOCK_SIZE + i`` is slot ``i`` of the ``j``-th selected block);
    ``sel`` points at the selection row of this sequence and KV head."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if PAGED:
        if HAS_INDICES:
            logical, phys = _selected_blocks(sel, block_tables + s * stride_bt, start_n, num_sel, BLOCK_N,
                                             BLOCK_SIZE)
            pos = logical * BLOCK_SIZE + offs_n % BLOCK_SIZE
            valid = (logical >= 0) & (pos < kv_len)
        else:
            pos = offs_n
            valid = offs_n < n_keys
            phys = tile_blocks(block_tables + s * stride_bt, start_n, n_keys, BLOCK_N, BLOCK_SIZE)
        row = phys.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks
    else:
        pos = offs_n
        valid = offs_n < n_keys
        row = (q_start + offs_n).to(tl.int64) * stride_ks
    return row + kvh * stride_kh, pos, valid


@triton.jit
def attention_scores(q, k, FP32: tl.constexpr):
    """``q @ k^T`` in float32: with ``FP32``, of float32 products (float32 inputs, or the interpreter, whose
    bfloat16 dot is wrong). Keys from an 8-bit cache are widened to the queries' dtype first (fast where the
    kernel made them float16: :func:`queries_for`)."""
    if FP32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))
    return qk


@triton.jit
def queries_for(q, K):
    """The queries as the keys of cache ``K`` meet them: bfloat16 queries become float16 (saturated at its
    range) over an 8-bit cache, whose values widen to float16 at less cost than to bfloat16; else
    unchanged. A kernel converts its queries once, before its key loop."""
    if K.dtype.element_ty.is_fp8() and q.dtype.is_bf16():
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def cache_value(x, Cache):
    """``x`` as paged cache ``Cache`` stores it: in its element type, an 8-bit float saturated at its largest
    finite value (``nanovllm.kv.cache_dtype.to_cache`` is the torch form)."""
    if Cache.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    elif Cache.dtype.element_ty == tl.float8e5:
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    return x.to(Cache.dtype.element_ty)


@triton.jit
def online_softmax_accumulate(acc, l_i, p, alpha, v, FP32: tl.constexpr):
    """The end of an online softmax step, once a tile's probabilities ``p`` and the factor ``alpha`` that
    rescales the running sums are known: returns the updated (acc, l_i). Values from an 8-bit cache are
    widened to float16 first (exactly: every 8-bit value is one)."""
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        if v.dtype.is_fp8():
            v = v.to(tl.float16)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i


@triton.jit
def online_softmax_step(
    acc, l_i, m_i, q, k, v, score_mask,
    scale_log2, MASKED: tl.constexpr, FP32: tl.constexpr,
):
    """One key tile of the online softmax (base 2): returns the updated (acc, l_i, m_i).

    Public: plugin kernels build on it. ``scale_log2`` is the softmax scale times log2(e); ``m_i`` is
    kept in that base-2 unit. ``score_mask`` [rows, keys] is read only when ``MASKED``; a row with
    nothing unmasked so far keeps ``m_i = -inf`` and adds nothing. ``FP32``: float32 products (float32
    inputs, or the interpreter, whose bfloat16 dot is wrong)."""
    qk = attention_scores(q, k, FP32) * scale_log2
    if MASKED:
        qk = tl.where(score_mask, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    acc, l_i = online_softmax_accumulate(acc, l_i, tl.math.exp2(qk - m_use[:, None]), alpha, v, FP32)
    return acc, l_i, m_new


@triton.jit
def online_softmax_step_fused_scale(acc, l_i, m_i, q, k, v, scale_log2, FP32: tl.constexpr):
    """``online_softmax_step`` of a tile without masks, the scale applied inside the exponent's
    multiply-add (one float operation a score fewer): the row maximum is taken before scaling, which is
    the same for a positive scale."""
    qk = attention_scores(q, k, FP32)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    alpha = tl.math.exp2(m_i - m_new)
    acc, l_i = online_softmax_accumulate(acc, l_i, tl.math.exp2(qk * scale_log2 - m_new[:, None]), alpha, v, FP32)
    return acc, l_i, m_new


@triton.jit
def unmasked_kv(K, V, rows, offs_d, d_ok, stride_kd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The keys and values of a tile every row of which is in range, through pointers: ``rows`` holds each
    key's element offset from ``K`` and ``V`` (its KV head's included); only a head dim padded to ``BLOCK_D``
    is masked.

    Public: plugin kernels load their unmasked tiles through it."""
    kv_ptrs = rows[:, None] + offs_d[None, :] * stride_kd
    if BLOCK_D == HEAD_DIM:
        k = tl.load(K + kv_ptrs)
        v = tl.load(V + kv_ptrs)
    else:
        k = tl.load(K + kv_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(V + kv_ptrs, mask=d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _masked_tile(
    acc, l_i, m_i, q, K, V, start_n, s, kvh, q_start, n_keys, kv_len, block_tables, sel,
    stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd, offs_d, d_ok, q_pos, window,
    scale_log2, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    HAS_INDICES: tl.constexpr, CAUSAL: tl.constexpr, FP32: tl.constexpr, SLIDING: tl.constexpr,
):
    """A key tile with masks: validity (length, selection), if CAUSAL position, and if SLIDING the window
    (a key ``window`` or more positions before its query is not seen)."""
    koff, pos, valid = _key_offsets(
        start_n, s, kvh, q_start, n_keys, kv_len, block_tables, sel, stride_bt, num_sel,
        stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_SIZE, PAGED, HAS_INDICES,
    )
    kv_ptrs = koff[:, None] + offs_d[None, :] * stride_kd
    ld_mask = valid[:, None] & d_ok[None, :]
    k = tl.load(K + kv_ptrs, mask=ld_mask, other=0.0)
    v = tl.load(V + kv_ptrs, mask=ld_mask, other=0.0)
    score_mask = valid[None, :]
    if CAUSAL:
        score_mask = score_mask & (pos[None, :] <= q_pos[:, None])
    if SLIDING:
        score_mask = score_mask & (pos[None, :] > q_pos[:, None] - window)
    return online_softmax_step(acc, l_i, m_i, q, k, v, score_mask, scale_log2, True, FP32)


# ---------------------------------------------------------------------------------------------
# prefill / chunk / selected blocks, many query rows per sequence
# ---------------------------------------------------------------------------------------------


# the block-table and selection widths change from step to step, and the selection's KV-head stride is
# 0 for a selection shared by the heads: one compiled kernel for all of them
@triton.jit(do_not_specialize=["stride_bt", "stride_bi", "stride_bh", "num_sel"])
def _prefill_kernel(
    Q, K, V, Out, Lse, desc_k, desc_v,
    cu_q, lens, block_tables, block_idx,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_bt, stride_bi, stride_bh, num_sel, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, HAS_INDICES: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    FP32: tl.constexpr, SKIP_DEAD: tl.constexpr, SLIDING: tl.constexpr,
    TMA: tl.constexpr, HEADS_FIRST: tl.constexpr, FUSED_SCALE: tl.constexpr,
):
    # heaviest (last) query tiles first: under a causal mask they have the most keys. HEADS_FIRST: the
    # grid is (heads, query tiles), so the heaviest tiles of every head start before any lighter one
    if HEADS_FIRST:
        h = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(cu_q + s)
    q_len = tl.load(cu_q + s + 1) - q_start
    m_start = pid_m * BLOCK_M
    if m_start >= q_len:
        return
    kvh = h // GROUP
    sel = block_idx + s * stride_bi + kvh * stride_bh  # this KV head's selected blocks (HAS_INDICES)
    if PAGED:
        kv_len = tl.load(lens + s)  # context length, or the kv_lens of the selection
        if HAS_INDICES:
            n_keys = num_sel * BLOCK_SIZE
        else:
            n_keys = kv_len
        q_off = kv_len - q_len
    else:
        kv_len = q_len
        n_keys = q_len
        q_off = 0

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q = queries_for(q, K)
    q_pos = q_off + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if CAUSAL:
        last_pos = q_off + tl.minimum(m_start + BLOCK_M, q_len) - 1
        hi = tl.minimum(n_keys, last_pos + 1)
        lo = (tl.minimum(q_off + m_start + 1, hi) // BLOCK_N) * BLOCK_N
    else:
        hi = n_keys
        lo = 0
    if HAS_INDICES:
        lo = 0  # every tile needs the selection's masks
    # SLIDING (causal, no selection): tiles before ``win_lo`` lie wholly outside every row's window and
    # are never read; [win_lo, full_lo) need the window's mask; [full_lo, lo) every row sees in full
    win_lo = 0
    full_lo = 0
    if SLIDING:
        win_lo = (tl.maximum(q_off + m_start - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(tl.minimum(full_lo, lo), win_lo)
        for start_n in range(win_lo, full_lo, BLOCK_N):
            acc, l_i, m_i = _masked_tile(
                acc, l_i, m_i, q, K, V, start_n, s, kvh, q_start, n_keys, kv_len, block_tables,
                sel, stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd,
                offs_d, d_ok, q_pos, window, scale_log2, BLOCK_N, BLOCK_SIZE, PAGED, False, True, FP32, True,
            )

    # tiles every row sees in full: no masks (never with HAS_INDICES, whose lo is 0). Paged, a tile's
    # block-table entries are read one tile ahead: Triton pipelines a key load whose address waits on a
    # load of the same iteration only 2 deep, not 3, which left paged prefill well behind contiguous keys.
    col = kvh * HEAD_DIM
    offs_t = tl.arange(0, BLOCK_N)
    bt_row = block_tables + s * stride_bt
    if PAGED:
        next_blocks = tile_blocks(bt_row, full_lo, lo, BLOCK_N, BLOCK_SIZE)
    for start_n in range(full_lo, lo, BLOCK_N):
        if PAGED:
            blocks = next_blocks
            next_blocks = tile_blocks(bt_row, start_n + BLOCK_N, lo, BLOCK_N, BLOCK_SIZE)
        if TMA:  # tensor-memory loads of rows [row0, row0 + BLOCK_N) of [rows, Hkv * D]
            if PAGED:  # a tile lies in one page (BLOCK_N divides BLOCK_SIZE): ``blocks`` is a scalar
                row0 = blocks * BLOCK_SIZE + start_n % BLOCK_SIZE
            else:
                row0 = q_start + start_n
            k = desc_k.load([row0, col])
            v = desc_v.load([row0, col])
        else:
            if PAGED:
                rows = blocks.to(tl.int64) * stride_kb + ((start_n + offs_t) % BLOCK_SIZE) * stride_ks
            else:
                rows = (q_start + start_n + offs_t).to(tl.int64) * stride_ks
            k, v = unmasked_kv(K, V, rows + kvh * stride_kh, offs_d, d_ok, stride_kd, HEAD_DIM, BLOCK_D)
        if FUSED_SCALE:
            acc, l_i, m_i = online_softmax_step_fused_scale(acc, l_i, m_i, q, k, v, scale_log2, FP32)
        else:
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, None, scale_log2, False, FP32)

    # the diagonal band, the ragged end and selected blocks: masked
    for start_n in range(lo, hi, BLOCK_N):
        if SKIP_DEAD:  # the tile lies in one selected block: skip it when nothing in it counts
            logical = tl.load(sel + start_n // BLOCK_SIZE)
            if (logical >= 0) & (logical * BLOCK_SIZE + start_n % BLOCK_SIZE < kv_len):
                acc, l_i, m_i = _masked_tile(
                    acc, l_i, m_i, q, K, V, start_n, s, kvh, q_start, n_keys, kv_len, block_tables,
                    sel, stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd,
                    offs_d, d_ok, q_pos, window, scale_log2, BLOCK_N, BLOCK_SIZE, PAGED, HAS_INDICES, CAUSAL,
                    FP32, False,
                )
        else:
            acc, l_i, m_i = _masked_tile(
                acc, l_i, m_i, q, K, V, start_n, s, kvh, q_start, n_keys, kv_len, block_tables,
                sel, stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd,
                offs_d, d_ok, q_pos, window, scale_log2, BLOCK_N, BLOCK_SIZE, PAGED, HAS_INDICES, CAUSAL,
                FP32, SLIDING,
            )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :],
    )
    if WRITE_LSE:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(Lse + q_rows * stride_lt + h * stride_lh, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# decode: split-KV over the paged cache, a GQA group per program
# ---------------------------------------------------------------------------------------------


# the number of splits follows the batch and the longest context, so it is a runtime argument: as a
# constexpr, the decode rows of mixed steps (eager) compiled a variant for each new count mid-run
@triton.jit(do_not_specialize=["stride_bt", "stride_bi", "stride_bh", "num_sel", "num_splits"])
def _decode_kernel(
    Q, K, V, DescK, DescV, PartO, PartL, Out, Lse,
    lens, block_tables, block_idx,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_bt, stride_bi, stride_bh, num_sel, window, num_splits,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HAS_INDICES: tl.constexpr, WRITE_LSE: tl.constexpr, FP32: tl.constexpr, SKIP_DEAD: tl.constexpr,
    READ_AHEAD: tl.constexpr, SLIDING: tl.constexpr, PAGE_AHEAD: tl.constexpr, HEADS_INNER: tl.constexpr,
    TMA: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    if HEADS_INNER:  # grid (KV heads, sequences, splits)
        kvh = tl.program_id(0)
        s = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:  # grid (sequences, KV heads, splits)
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    sel = block_idx + s * stride_bi + kvh * stride_bh  # this KV head's selected blocks (HAS_INDICES)
    kv_len = tl.load(lens + s)
    if HAS_INDICES:
        n_keys = num_sel * BLOCK_SIZE
    else:
        n_keys = kv_len
    # SLIDING: the splits share out the window's tiles only; the pages before it are never read
    base = 0
    if SLIDING:
        base = (tl.maximum(kv_len - window, 0) // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(n_keys - base, num_splits), BLOCK_N) * BLOCK_N
    start = base + split * per_split
    end = tl.minimum(start + per_split, n_keys)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    s64 = s.to(tl.int64)
    q = tl.load(
        Q + s64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q = queries_for(q, K)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    q_pos = tl.zeros([G_PAD], tl.int32) + kv_len - 1  # read only by the window's mask
    if READ_AHEAD:
        # selected keys: a tile's selection and block-table entries are read one tile ahead, so its key
        # loads wait on no load of their own iteration (see ``_read_ahead`` for when it pays)
        offs_t = tl.arange(0, BLOCK_N)
        bt_row = block_tables + s * stride_bt
        next_logical, next_phys = _selected_blocks(sel, bt_row, start, num_sel, BLOCK_N, BLOCK_SIZE)
        for start_n in range(start, end, BLOCK_N):
            logical, phys = next_logical, next_phys
            next_logical, next_phys = _selected_blocks(sel, bt_row, start_n + BLOCK_N, num_sel, BLOCK_N,
                                                       BLOCK_SIZE)
            within = (start_n + offs_t) % BLOCK_SIZE
            valid = (logical >= 0) & (logical * BLOCK_SIZE + within < kv_len)
            rows = phys.to(tl.int64) * stride_kb + within * stride_ks + kvh * stride_kh
            kv_ptrs = rows[:, None] + offs_d[None, :] * stride_kd
            ld_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(K + kv_ptrs, mask=ld_mask, other=0.0)
            v = tl.load(V + kv_ptrs, mask=ld_mask, other=0.0)
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, valid[None, :], scale_log2, True,
                                                FP32)
    elif PAGE_AHEAD:
        # whole contexts: the tiles that end within the context unmasked, their block-table entries read
        # a tile ahead (so their key loads wait on no load of their own iteration); then the context's
        # last, partial tile with masks, in the split that holds it
        full_end = tl.minimum(end, (n_keys // BLOCK_N) * BLOCK_N)
        offs_t = tl.arange(0, BLOCK_N)
        bt_row = block_tables + s * stride_bt
        next_blocks = tile_blocks(bt_row, start, full_end, BLOCK_N, BLOCK_SIZE)
        for start_n in range(start, full_end, BLOCK_N):
            blocks = next_blocks
            next_blocks = tile_blocks(bt_row, start_n + BLOCK_N, full_end, BLOCK_N, BLOCK_SIZE)
            if TMA:  # a tile lies in one page (``blocks`` is a scalar): rows of [rows, Hkv * D]
                row0 = blocks * BLOCK_SIZE + start_n % BLOCK_SIZE
                k = DescK.load([row0, kvh * HEAD_DIM])
                v = DescV.load([row0, kvh * HEAD_DIM])
            else:
                rows = blocks.to(tl.int64) * stride_kb + ((start_n + offs_t) % BLOCK_SIZE) * stride_ks
                k, v = unmasked_kv(K, V, rows + kvh * stride_kh, offs_d, d_ok, stride_kd, HEAD_DIM, BLOCK_D)
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, q, k, v, None, scale_log2, False, FP32)
        for start_n in range(tl.maximum(full_end, start), end, BLOCK_N):
            acc, l_i, m_i = _masked_tile(
                acc, l_i, m_i, q, K, V, start_n, s, kvh, 0, end, kv_len, block_tables,
                sel, stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd,
                offs_d, d_ok, q_pos, window, scale_log2, BLOCK_N, BLOCK_SIZE, True, False, False, FP32, False,
            )
    else:
        for start_n in range(start, end, BLOCK_N):
            if SKIP_DEAD:
                logical = tl.load(sel + start_n // BLOCK_SIZE)
                if (logical >= 0) & (logical * BLOCK_SIZE + start_n % BLOCK_SIZE < kv_len):
                    acc, l_i, m_i = _masked_tile(
                        acc, l_i, m_i, q, K, V, start_n, s, kvh, 0, end, kv_len, block_tables,
                        sel, stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd,
                        offs_d, d_ok, q_pos, window, scale_log2, BLOCK_N, BLOCK_SIZE, True, HAS_INDICES,
                        False, FP32, False,
                    )
            else:
                acc, l_i, m_i = _masked_tile(
                    acc, l_i, m_i, q, K, V, start_n, s, kvh, 0, end, kv_len, block_tables,
                    sel, stride_bt, num_sel, stride_kb, stride_ks, stride_kh, stride_kd,
                    offs_d, d_ok, q_pos, window, scale_log2, BLOCK_N, BLOCK_SIZE, True, HAS_INDICES, False,
                    FP32, SLIDING,
                )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = m_i + tl.math.log2(l_i)  # base 2; -inf for an empty slice
    if not SPLIT:
        _store_rows(Out, Lse, out, lse2, s64, heads, g_ok, offs_d, d_ok,
                    stride_ot, stride_oh, stride_od, stride_lt, stride_lh, WRITE_LSE)
    else:
        # partials: PartO [S, num_splits, H, BLOCK_D] and PartL [S, num_splits, H], contiguous
        num_heads = num_kv_heads * GROUP
        row = (s64 * num_splits + split) * num_heads + heads
        tl.store(PartO + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_ok[:, None])
        tl.store(PartL + row, lse2, mask=g_ok)


@triton.jit
def _merge_splits(PartO, PartL, s64, heads, h_ok, num_heads, num_splits, ROWS: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split-KV partials of sequence ``s64``'s ``heads`` merged by log-sum-exp: (output
    ``[ROWS, BLOCK_D]`` float32, base-2 log-sum-exp ``[ROWS]``, -inf where no split saw a key). ``CHUNK``
    splits at a time, rescaled online, so that any number of splits fits in registers; a split's heads lie
    side by side (``PartO [S, num_splits, H, BLOCK_D]``), so the sum over splits stays within a thread."""
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    first = s64 * num_splits * num_heads
    m = tl.full([ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for c in range(0, num_splits, CHUNK):
        ok = (c + offs_c < num_splits)[:, None] & h_ok[None, :]
        part = first + (c + offs_c)[:, None] * num_heads + heads[None, :]  # [CHUNK, ROWS]
        lse = tl.load(PartL + part, mask=ok, other=float("-inf"))
        o = tl.load(PartO + part[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=ok[:, :, None],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse - m_use[None, :])
        denom = denom * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 0)
        m = m_new
    return acc / tl.where(denom == 0.0, 1.0, denom)[:, None], m + tl.math.log2(denom)


@triton.jit
def _store_rows(Out, Lse, out, lse2, s64, heads, h_ok, offs_d, d_ok,
                stride_ot, stride_oh, stride_od, stride_lt, stride_lh, WRITE_LSE: tl.constexpr):
    """Merged rows of sequence ``s64``: the output, and with ``WRITE_LSE`` the natural-log log-sum-exp."""
    tl.store(Out + s64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(Lse + s64 * stride_lt + heads * stride_lh, lse2 * 0.6931471805599453, mask=h_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    PartO, PartL, Out, Lse,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The split reduce: one program per (sequence, head) merges its partials."""
    wait_for_previous(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) + tl.arange(0, 1)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = h < tl.num_programs(1)
    out, lse2 = _merge_splits(PartO, PartL, s, h, h_ok, tl.num_programs(1), num_splits, 1, CHUNK, BLOCK_D)
    _store_rows(Out, Lse, out, lse2, s, h, h_ok, offs_d, offs_d < HEAD_DIM,
                stride_ot, stride_oh, stride_od, stride_lt, stride_lh, WRITE_LSE)


# ---------------------------------------------------------------------------------------------
# launch wrappers
# ---------------------------------------------------------------------------------------------


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _max_shared_memory(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device. Triton's driver query behind it costs
    host time on every call, so it runs once per device."""
    return _max_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device, queried once per device (4 elsewhere: the interpreter, where a few
    programs are enough)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


class PrefillConfig(NamedTuple):
    """The prefill kernel's tuning knobs; none changes a result beyond float rounding.

    ``block_m`` query rows and ``block_n`` keys a tile, ``num_warps``, ``num_stages`` (Triton's software
    pipeline depth). ``tma``: the unmasked key tiles through tensor-memory-accelerator loads (Hopper and
    later, head dim a power of two, packed keys or pages of at least ``block_n`` keys; elsewhere it is
    ignored). ``heads_first``: the grid runs the heaviest query tile of every head before any lighter
    one, instead of every tile of one head before the next head. ``fused_scale``: the unmasked tiles
    apply the softmax scale inside the exponent's multiply-add (rounding differs in the last bits)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    heads_first: bool = False
    fused_scale: bool = False


class DecodeConfig(NamedTuple):
    """The split-KV decode kernel's tuning knobs; none changes a result beyond float rounding.

    ``block_n`` keys a step (several pages when pages are smaller), ``num_warps``, ``num_stages``.
    ``programs_per_sm``: the split count aims at this many programs per multiprocessor, at most
    ``max_splits`` splits per sequence and KV head; with ``wave_fit`` it is taken as the programs a
    multiprocessor holds at once, and the split count is the one that ends soonest in whole waves of
    them. ``page_ahead``: over whole contexts, the key tiles that end within the context run unmasked
    with their block-table entries read a tile ahead. ``one_split_waves`` (0: off): once the (sequence, KV
    head) groups alone fill this many waves of ``programs_per_sm`` programs per multiprocessor, one split
    each (the kernel writes the output itself: no partials, no reduce); below that, the rule's own count.
    ``full_wave_programs`` (0: off): one split also when the groups alone end in a wave of this many programs
    per multiprocessor that is at least :data:`ONE_SPLIT_FILL` full (the waves that the one-split times were
    measured to follow; ``programs_per_sm`` sizes the splits).
    ``heads_inner``: the grid's fastest axis is the KV head, so the programs of one sequence's KV heads,
    which read the same rows of its pages, run side by side. ``tma``: with ``page_ahead``, the unmasked
    key tiles through tensor-memory-accelerator loads where a page holds whole tiles (as
    :class:`PrefillConfig`'s ``tma``; elsewhere it is ignored)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 2
    max_splits: int = 64
    page_ahead: bool = False
    wave_fit: bool = False
    one_split_waves: int = 0
    full_wave_programs: int = 0
    heads_inner: bool = False
    tma: bool = False


# The defaults for 16-bit inputs on CUDA, head dim <= 128 (GQA 32q/8kv, d=128 measured): the values that
# benchmarks/kernel_sweep.py reports as best are pasted here.
# chunks of more than 64 queries, packed keys
PREFILL_LONG = PrefillConfig(128, 128, 8, 3, tma=True, fused_scale=True)
# the same through the paged cache (TMA only where a page holds a whole key tile)
PREFILL_LONG_PAGED = PrefillConfig(128, 128, 8, 3, tma=True, fused_scale=True)
PREFILL_SHORT = PrefillConfig(64, 64, 4, 3)  # chunks of at most 64 queries: no large query tile to waste
# head dim above 128 (Gemma 3's 256), chunks of more than 64 queries, where the multiprocessor's shared memory
# holds the 128-row query tile and two stages of 64-key K/V tiles (about 192 KiB at head dim 256: Hopper)
PREFILL_WIDE_HEADS = PrefillConfig(128, 64, 8, 2)
WIDE_TILES_SHARED_MEMORY = 200 * 1024
# pages of fewer than 64 tokens: a key step spans several pages
# (one split once the groups fill 4 waves, or end in a nearly full wave of 4 programs a multiprocessor:
# batches of short contexts then need no partials and no reduce; a sequence's KV heads side by side, which
# share each small page's rows)
DECODE = DecodeConfig(64, 4, 3, programs_per_sm=3, max_splits=128, wave_fit=True, one_split_waves=4,
                      full_wave_programs=4, heads_inner=True)
# small pages of an 8-bit cache: tiles of 128 keys (the bytes of the 16-bit cache's 64), one stage and one
# program a multiprocessor more
DECODE_8BIT = DECODE._replace(block_n=128, num_stages=4, programs_per_sm=4)
# pages of 64 tokens or more (one split from 4 waves as well; whole-page key tiles through TMA, whose two
# stages leave room for three programs a multiprocessor)
DECODE_LARGE_PAGES = DecodeConfig(64, 4, 2, programs_per_sm=3, max_splits=64, page_ahead=True, wave_fit=True,
                                  one_split_waves=4, heads_inner=True, tma=True)
REDUCE_CHUNK = 64  # the split reduce merges more splits than this a chunk at a time
# up to FEW_SPLITS splits it merges FEW_SPLITS_CHUNK at a time: a 64-split chunk mostly masked cost more
# than the loop
FEW_SPLITS, FEW_SPLITS_CHUNK = 8, 2
ONE_SPLIT_FILL = 0.7  # see DecodeConfig.full_wave_programs


def _prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device, max_query_len: int,
                    paged: bool = False) -> PrefillConfig:
    """The prefill kernel's knobs for a launch: by device, dtype, head dim, chunk length and key source."""
    if device.type != "cuda":
        return PrefillConfig(16, 16, 1, 1)
    if dtype == torch.float32:
        return PrefillConfig(32, 32, 4, 2)
    if head_dim > 128:
        if max_query_len > 64 and max_shared_memory(device) >= WIDE_TILES_SHARED_MEMORY:
            return PREFILL_WIDE_HEADS
        return PrefillConfig(64, 32, 4, 2)
    if max_query_len <= 64:
        return PREFILL_SHORT
    if head_dim <= 64:
        return PrefillConfig(128, 64, 8, 3)
    return PREFILL_LONG_PAGED if paged else PREFILL_LONG


# A phase stages its contexts (below) where its longest chunk has at least STAGED_MIN_QUERY_LEN queries
# (shorter chunks take the short configuration, without TMA) and its attention is large enough,
# max_query_len * max_context_len at least STAGED_MIN_PAIRS, to repay the copy and its launch.
STAGED_MIN_QUERY_LEN = 128
STAGED_MIN_PAIRS = 1 << 23


def stages_paged_contexts(head_dim: int, dtype: torch.dtype, device: torch.device, block_size: int) -> bool:
    """Whether long chunks over the paged cache run faster from their contexts staged into pages of
    ``STAGED_PAGE`` tokens (:func:`stage_context`) than over the cache's own: where the long chunks'
    configuration loads its key tiles through TMA and a cache page holds less than a tile (on Hopper a TMA
    load cannot gather pages). Which phases stage: :func:`stages_phase`."""
    if device.type != "cuda" or head_dim & (head_dim - 1):
        return False
    if not _tma_capable(device.index if device.index is not None else torch.cuda.current_device()):
        return False
    cfg = _prefill_config(head_dim, dtype, device, STAGED_MIN_QUERY_LEN, paged=True)
    return cfg.tma and block_size % cfg.block_n != 0 and STAGED_PAGE % block_size == 0


def stages_phase(max_query_len: int, max_context_len: int) -> bool:
    """Whether a prefill phase is large enough for its staged contexts to pay."""
    return max_query_len >= STAGED_MIN_QUERY_LEN and max_query_len * max_context_len >= STAGED_MIN_PAIRS


def _dot_fp32(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 or q.device.type != "cuda"


def _skip_dead(has_idx: bool, block_n: int, block_size: int) -> bool:
    """Selected blocks are visited tile by tile and a tile inside one block can be skipped whole."""
    return has_idx and block_n <= block_size and block_size % block_n == 0


def _read_ahead(multi_block_tiles: bool, num_groups: int, device: torch.device) -> bool:
    """Read a selected-key tile's entries a tile ahead when few (sequence, KV head) groups share the
    GPU: their programs are short and exposed to the load chain (selection, block table, keys). With
    more groups, occupancy hides the chain and reading ahead costs more than it saves. Results are
    bit-identical either way."""
    return multi_block_tiles and num_groups <= num_sms(device) // 2


def _check_window(window: int | None, allowed: bool) -> None:
    if window is None:
        return
    if not allowed:
        raise ValueError("a sliding window applies to causal attention over whole contexts, not to "
                         "selected blocks or non-causal rows")
    if window < 1:
        raise ValueError(f"window={window}: a sliding window holds at least one token")


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether one set of strides reads both ``a`` and ``b``: equal shapes, and equal strides but in dimensions
    of one element, whose stride no index reaches (a one-token prompt's rows may differ there)."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _dummy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A one-element stand-in for an argument a launch does not read: an allocation, never a kernel."""
    return t.new_empty(1, dtype=dtype)


def _selection_args(block_indices: torch.Tensor | None, num_kv_heads: int, like: torch.Tensor):
    """(tensor, sequence stride, KV-head stride, width) of a selection in either form of
    ``attend_blocks``; the shared form gets KV-head stride 0, no copy."""
    if block_indices is None:
        return _dummy(like), 0, 0, 0
    sel = selection_per_kv_head(block_indices, num_kv_heads)
    if sel.shape[2] > 1 and sel.stride(2) != 1:
        raise ValueError(
            f"block_indices with strides {tuple(block_indices.stride())}: the kernels read each list "
            "as contiguous int32s; pass block_indices.contiguous()"
        )
    return sel, sel.stride(0), sel.stride(1), sel.shape[2]


@functools.cache
def _tma_capable(device_index: int) -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, paged: bool, block_n: int):
    """Tensor-memory descriptors of ``k`` and ``v`` as 2-D ``[rows, Hkv * D]`` views (a key tile is
    ``block_n`` rows at column ``kvh * D``), or None where they cannot serve: a GPU before Hopper, a head
    dim that is not a power of two, pages smaller than (or not a multiple of) the tile, or a layout whose
    rows are not evenly strided, 16-byte aligned runs shared by ``k`` and ``v``. Public as
    :func:`nanovllm.sparse.paged_kv_descriptors`."""
    if k.device.type == "cuda":
        if not _tma_capable(k.device.index if k.device.index is not None else torch.cuda.current_device()):
            return None
    elif not is_interpreted():
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    head_dim, num_kv_heads = k.shape[-1], k.shape[-2]
    if head_dim & (head_dim - 1) or k.stride(-1) != 1 or k.stride(-2) != head_dim or k.stride() != v.stride():
        return None
    if paged:
        num_blocks, block_size = k.shape[:2]
        if block_size % block_n or k.stride(0) != block_size * k.stride(1):
            return None
        rows, row_stride = num_blocks * block_size, k.stride(1)
    else:
        rows, row_stride = k.shape[0], k.stride(0)
    if rows == 0 or (row_stride * k.element_size()) % 16 or any(t.data_ptr() % 16 for t in (k, v)):
        return None
    return tuple(TensorDescriptor(t, [rows, num_kv_heads * head_dim], [row_stride, 1], [block_n, head_dim])
                 for t in (k, v))


def attention_rows(
    q, k, v, out, lse, cu_seqlens_q, lens, block_tables, block_indices, max_query_len, scale,
    *, paged: bool, causal: bool, config: PrefillConfig | tuple | None = None, window: int | None = None,
) -> None:
    """Launch ``_prefill_kernel``: many query rows per sequence.

    paged: ``k``/``v`` are the caches ``[num_blocks, block_size, Hkv, D]`` and ``lens`` the KV lengths
    (context lengths, or the selection's ``kv_lens`` when ``block_indices`` is given); otherwise they
    are dense ``[num_tokens, Hkv, D]`` rows laid out like ``q`` (``lens`` unused). ``block_indices``:
    None, or a selection ``[num_seqs, k]`` or ``[num_seqs, Hkv, k]`` (see ``attend_blocks``). ``window``
    (causal, no selection): each query sees the last ``window`` positions up to its own, and tiles before
    them are not read. ``config`` (a :class:`PrefillConfig` or its leading fields) overrides the rule's
    knobs (benchmarks, tests)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return
    num_kv_heads = k.shape[-2]
    if config:
        cfg = PrefillConfig(*config)
    else:
        cfg = _prefill_config(head_dim, q.dtype, q.device, max_query_len, paged)
    bm, bn = cfg.block_m, cfg.block_n
    if paged:
        block_size = k.shape[1]
        kstrides = k.stride()
        bt, stride_bt = block_tables, block_tables.stride(0)
    else:
        block_size = 1
        kstrides = (0, *k.stride())
        bt, stride_bt = _dummy(cu_seqlens_q), 0
    assert same_layout(k, v), "k and v must share one layout"
    has_idx = block_indices is not None
    _check_window(window, causal and not has_idx)
    bi, stride_bi, stride_bh, num_sel = _selection_args(block_indices, num_kv_heads, cu_seqlens_q)
    write_lse = lse is not None
    lse_t = lse if write_lse else _dummy(out, torch.float32)
    lse_strides = lse.stride() if write_lse else (0, 0)
    descs = _kv_descriptors(k, v, paged, bn) if cfg.tma and not has_idx else None
    m_tiles = cdiv(max_query_len, bm)
    grid = (num_heads, m_tiles, num_seqs) if cfg.heads_first else (m_tiles, num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k, v, out, lse_t, *(descs or (k, v)),
        cu_seqlens_q, lens if lens is not None else cu_seqlens_q, bt, bi,
        scale * LOG2E,
        *q.stride(), *kstrides, *out.stride(), *lse_strides,
        stride_bt, stride_bi, stride_bh, num_sel, window or 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn,
        PAGED=paged, HAS_INDICES=has_idx, CAUSAL=causal, WRITE_LSE=write_lse,
        FP32=_dot_fp32(q), SKIP_DEAD=_skip_dead(has_idx, bn, block_size), SLIDING=window is not None,
        TMA=descs is not None, HEADS_FIRST=cfg.heads_first, FUSED_SCALE=cfg.fused_scale,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _decode_config(head_dim: int, dtype: torch.dtype, device: torch.device, block_size: int,
                   cache_dtype: torch.dtype | None = None) -> DecodeConfig:
    """The decode kernel's knobs: by device, query dtype, head dim, page size and the cache's element type
    (default: the queries'). Its compiled parts must not follow the batch or the context length (an eager
    decode step would compile a variant mid-run); the split count, which does, is a runtime argument."""
    if device.type != "cuda":
        return DecodeConfig(16, 1, 1)
    if dtype == torch.float32:
        return DecodeConfig(32, 4, 2)
    eight_bit = cache_dtype in EIGHT_BIT_FLOATS
    cfg = DECODE_LARGE_PAGES if block_size >= 64 else DECODE_8BIT if eight_bit else DECODE
    return cfg._replace(block_n=32) if head_dim > 128 else cfg


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_keys: int, block_n: int, device,
                      programs_per_sm: int = DECODE.programs_per_sm, max_splits: int = DECODE.max_splits,
                      wave_fit: bool = DECODE.wave_fit, one_split_waves: int = DECODE.one_split_waves,
                      full_wave_programs: int = DECODE.full_wave_programs) -> int:
    """Split the keys so that about ``programs_per_sm`` programs run per multiprocessor; at least 2 tiles
    a split, at most ``max_splits`` splits. ``wave_fit``, ``one_split_waves``, ``full_wave_programs``: see
    :class:`DecodeConfig`. (The one-split kernel compiles in the warm-up whatever the rule: its decode rows,
    of one key each, take one split.)"""
    groups = max(1, num_seqs * num_kv_heads)
    slots = programs_per_sm * num_sms(device)
    if one_split_waves and groups >= one_split_waves * slots:
        return 1
    if full_wave_programs:
        wave = full_wave_programs * num_sms(device)
        if (groups - 1) % wave + 1 >= ONE_SPLIT_FILL * wave:  # the programs of the last wave
            return 1
    # at least 2 tiles a split, not more: a short selection (a sequence's few thousand selected keys per
    # KV head) runs faster in more, shorter splits; long contexts are bounded by ``want`` anyway
    cap = max(1, min(cdiv(max_keys, 2 * block_n), max_splits))
    if wave_fit:
        # k waves of ``slots`` programs hold at most k * slots // groups splits each; a program's share of
        # the keys shrinks with the splits: the time is about k / splits. A few waves are enough to compare.
        best, best_time = 1, float("inf")
        for waves in range(1, 9):
            splits = min(max(waves * slots // groups, 1), cap)
            t = cdiv(groups * splits, slots) / splits
            if t < best_time * 0.95:  # more waves only for a clear gain: each split costs a reduce
                best, best_time = splits, t
        return max(1, min(max(2, best), cap))
    # at least two splits: with contexts of mixed lengths the finer slices balance the multiprocessors
    want = max(2, cdiv(slots, groups))
    return max(1, min(want, cap))


def attention_decode(
    q, k_cache, v_cache, out, lse, lens, block_tables, block_indices, max_keys, scale,
    num_splits: int | None = None, config: DecodeConfig | tuple | None = None, window: int | None = None,
) -> None:
    """Launch ``_decode_kernel`` (+ ``_reduce_kernel`` when the keys are split): one query row per sequence,
    paged KV.

    ``block_indices``: None (whole contexts), or a selection ``[num_seqs, k]`` or ``[num_seqs, Hkv, k]``
    (see ``attend_blocks``); each program reads only its KV head's list. ``max_keys`` (a host int)
    bounds the keys of any sequence; it sets the number of splits only, never the result. ``window``
    (no selection): each sequence attends to its last ``window`` keys, and the splits read only the tiles
    that hold them. ``config`` (a :class:`DecodeConfig` or its leading fields) overrides the rule's knobs
    (benchmarks, tests); ``num_splits`` overrides the split count."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share one layout"
    group = num_heads // num_kv_heads
    cfg = DecodeConfig(*config) if config else _decode_config(head_dim, q.dtype, q.device, block_size,
                                                              k_cache.dtype)
    bn = cfg.block_n
    _check_window(window, block_indices is None)
    if window is not None:  # the keys any split may read: the window and one partial tile before it
        max_keys = min(max_keys, window + bn)
    if num_splits is None:
        num_splits = num_decode_splits(num_seqs, num_kv_heads, max_keys, bn, q.device, cfg.programs_per_sm,
                                       cfg.max_splits, cfg.wave_fit, cfg.one_split_waves,
                                       cfg.full_wave_programs)
    block_d = next_power_of_2(head_dim)
    has_idx = block_indices is not None
    skip_dead = _skip_dead(has_idx, bn, block_size)
    bi, stride_bi, stride_bh, num_sel = _selection_args(block_indices, num_kv_heads, lens)
    write_lse = lse is not None
    lse_t = lse if write_lse else _dummy(out, torch.float32)
    lse_strides = lse.stride() if write_lse else (0, 0)
    if num_splits > 1:
        part_o = torch.empty(num_seqs, num_splits, num_heads, block_d, dtype=torch.float32, device=q.device)
        part_l = torch.empty(num_seqs, num_splits, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_o = part_l = _dummy(out, torch.float32)
    page_ahead = cfg.page_ahead and not has_idx and window is None
    descs = _kv_descriptors(k_cache, v_cache, True, bn) if cfg.tma and page_ahead else None
    grid = (num_kv_heads, num_seqs, num_splits) if cfg.heads_inner else (num_seqs, num_kv_heads, num_splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, *(descs or (k_cache, v_cache)), part_o, part_l, out, lse_t,
        lens, block_tables, bi,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *out.stride(), *lse_strides,
        block_tables.stride(0), stride_bi, stride_bh, num_sel, window or 0, num_splits,
        GROUP=group, G_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=bn, SPLIT=num_splits > 1,
        HAS_INDICES=has_idx, WRITE_LSE=write_lse, FP32=_dot_fp32(q),
        SKIP_DEAD=skip_dead,
        READ_AHEAD=_read_ahead(has_idx and not skip_dead, num_seqs * num_kv_heads, q.device),
        SLIDING=window is not None, PAGE_AHEAD=page_ahead, HEADS_INNER=cfg.heads_inner, TMA=descs is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q),
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            part_o, part_l, out, lse_t, *out.stride(), *lse_strides, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, WRITE_LSE=write_lse,
            CHUNK=FEW_SPLITS_CHUNK if num_splits <= FEW_SPLITS else REDUCE_CHUNK,
            num_warps=4 if head_dim >= 128 else 2, **launch_options(q),
        )


def is_interpreted() -> bool:
    """True when this module's kernels were built for Triton's interpreter (CPU tensors)."""
    return type(_prefill_kernel).__name__ == "InterpretedFunction"


__all__ = [
    "store_kv", "stage_context", "stage_context_reference", "STAGED_PAGE", "attention_rows",
    "attention_decode", "num_decode_splits", "is_interpreted", "max_shared_memory",
    "num_sms", "same_layout", "PrefillConfig", "DecodeConfig",
]
