"""XAttention's block-importance estimate: strided antidiagonal scores, summed per (query block, key block).

For sequence ``s`` (context ``ctx``, chunk queries at positions ``q0 = ctx - query_len .. ctx - 1``), query
head ``h`` (KV head ``h // G``) and stride ``S'``, positions are grouped by ``S'``: reshaped row ``i`` holds
the queries at positions ``i*S' + S'-1 .. i*S'`` (reversed; a position outside the chunk gives zeros) and
reshaped key ``j`` the keys at ``j*S' .. j*S' + S'-1`` (past the context: zeros), so ``Q~_i . K~_j`` is the
sum of the ``S'`` antidiagonal entries of tile ``(i, j)`` of ``q.k^T``. Row ``i`` takes part iff one of its
positions is a query of the chunk. With ``x[i, j] = scale / S' * Q~_i . K~_j`` and ``P[i, :]`` its softmax
over ``j <= i`` (float32)::

    scores[s, h, r, kb] = sum of P[i, j] over taking-part rows i of query block first_query_block + r
                          and keys j of key block kb (j*S' // block == kb)

``[S, H, num_query_blocks, num_key_blocks]`` float32 (the grid of ``layout``), 0 elsewhere. A query block
row sums to its number of taking-part rows (``block / S'`` for a full block).

``block_scores_reference`` is this in plain torch (the CPU path; also runs on CUDA tensors).

``block_scores`` is two Triton passes; the first reads the keys, once:

1. per (head, tile of reshaped rows, sequence): the logits of each key tile (row tiles start at the
   first query block and hold whole blocks, key tiles start at key 0 and hold whole blocks), reduced on
   their own to each row's log2-sum-exp2 over each key block, ``lse[i, kb]``, stored: float32
   ``[S, H, rows, key blocks]``, ``block / S'`` times the size of the scores (2 GiB for one 128K-token
   chunk at H=32, S'=8, block 128; chunked prefill keeps it small).
2. per (head, query block row, sequence): each row's total ``log2 sum_kb exp2(lse[i, kb])``, then
   ``scores = sum over the block's taking-part rows of exp2(lse[i, kb] - total[i])``.

Every stored element has one writer: deterministic, no atomics. Against the usual two GEMM passes (row
statistics, then the logits again, normalised) this does the GEMM once; pass 2 only streams ``lse``.

The logits of a tile are a GEMM of depth ``S' * D``, computed as ``S'`` dots ``[rows, D] x [D, keys]``:
step ``t`` pairs the queries at positions ``i*S' + S'-1-t`` with the keys at ``j*S' + t``, both loaded
with a row stride of ``S'`` positions straight from ``q`` and the paged cache, so no reshaped tensor is
materialised. The step loop is a plain loop that Triton pipelines (one step's operands in shared memory
per stage). When ``S'`` divides the KV block size, the ``S'`` keys of a reshaped key share a cache block,
so the block table is read once per key tile rather than once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import triton
import triton.language as tl
from nanovllm.attention.backend import check_paged_inputs
from nanovllm.sparse import cdiv, host_lengths, is_interpreted, max_shared_memory, next_power_of_2

from nanovllm_xattn.layout import num_key_blocks, num_query_blocks

LOG2E = 1.4426950408889634
MAX_ROWS_PER_BLOCK = 128  # block // stride: a row tile of the Triton passes holds at least one whole block
REFERENCE_LOGITS = 1 << 26  # logits the reference materialises at once (256 MiB of float32)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_args(
    q, k_cache, block_tables, cu_seqlens_q, context_lens, stride: int, block: int, max_query_len: int,
    max_context_len: int,
) -> None:
    check_paged_inputs(q, k_cache, None, block_tables, cu_seqlens_q, context_lens)
    if not (_is_power_of_two(block) and block >= 64):
        raise ValueError(f"block={block}: use a power of two of at least 64 (XAttention uses 128)")
    if not (_is_power_of_two(stride) and 2 <= stride <= 64 and block % stride == 0):
        raise ValueError(
            f"stride={stride}: use a power of two from 2 to 64 that divides block={block} (XAttention uses 8)"
        )
    if max_query_len < 0 or max_context_len < 0:
        raise ValueError(f"max_query_len={max_query_len}, max_context_len={max_context_len}: must be >= 0")
    devices = {t.device for t in (q, k_cache, block_tables, cu_seqlens_q, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"q, k_cache, block_tables, cu_seqlens_q and context_lens are on {devices}: use one")


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------


def block_scores_reference(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, scale: float, stride: int, block: int, max_query_len: int,
    max_context_len: int, *, host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """``[S, H, num_query_blocks, num_key_blocks]`` float32 block scores (see the module docstring), one
    sequence at a time, batched over heads. ``host_lens``: the query and context lengths as host ints
    (``PhaseMetadata.host_lens``); without them they are read from the tensors."""
    _check_args(q, k_cache, block_tables, cu_seqlens_q, context_lens, stride, block, max_query_len,
                max_context_len)
    device = q.device
    num_seqs, num_heads, head_dim = context_lens.shape[0], q.shape[1], q.shape[2]
    num_kv_heads, kv_block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    per_block = block // stride  # reshaped rows (and keys) per block
    scores = torch.zeros(num_seqs, num_heads, num_query_blocks(max_query_len, block),
                         num_key_blocks(max_context_len, block), dtype=torch.float32, device=device)
    host_lens = host_lengths(cu_seqlens_q, context_lens, host_lens)
    first_rows = accumulate(host_lens[0], initial=0)
    for s, (first_row, q_len, ctx) in enumerate(zip(first_rows, *host_lens)):
        if not 0 <= q_len <= min(ctx, max_query_len) or ctx > max_context_len:
            raise ValueError(
                f"sequence {s}: {q_len} queries over a context of {ctx}, against max_query_len="
                f"{max_query_len} and max_context_len={max_context_len}: a chunk's queries are the last "
                "of its context and the maxima bound every sequence"
            )
        if q_len == 0:
            continue
        q0 = ctx - q_len
        num_blocks = -(-ctx // block)
        n = num_blocks * per_block  # reshaped positions, padded to whole blocks
        # queries and keys by position, zero outside the chunk / past the context
        q_by_pos = torch.zeros(n * stride, num_heads, head_dim, dtype=torch.float32, device=device)
        q_by_pos[q0:ctx] = q[first_row: first_row + q_len].float()
        c = torch.arange(ctx, device=device)
        physical = block_tables[s, c // kv_block_size].long()
        keys = torch.zeros(n * stride, num_kv_heads, head_dim, dtype=torch.float32, device=device)
        keys[:ctx] = k_cache[physical, c % kv_block_size].float()
        # Q~ reverses the positions inside each group of `stride`, K~ does not: [heads, n, stride * D]
        q_re = q_by_pos.view(n, stride, num_heads, head_dim).flip(1).permute(2, 0, 1, 3).flatten(2)
        k_re = keys.view(n, stride, num_kv_heads, head_dim).permute(2, 0, 1, 3).flatten(2)
        q_re = q_re.unflatten(0, (num_kv_heads, group))

        first_block = q0 // block
        chunk_blocks = max(1, REFERENCE_LOGITS // (num_heads * n * per_block))  # bounds the logits' memory
        j = torch.arange(n, device=device)
        for b0 in range(first_block, num_blocks, chunk_blocks):
            b1 = min(b0 + chunk_blocks, num_blocks)
            i = torch.arange(b0 * per_block, b1 * per_block, device=device)
            logits = torch.einsum("kgid,kjd->kgij", q_re[:, :, i], k_re).flatten(0, 1) * (scale / stride)
            probs = logits.masked_fill(j > i[:, None], float("-inf")).softmax(-1)
            taking_part = (i * stride + stride > q0) & (i * stride < ctx)
            probs = torch.where(taking_part[:, None], probs, 0.0)
            sums = probs.view(num_heads, b1 - b0, per_block, num_blocks, per_block).sum((2, 4))
            scores[s, :, b0 - first_block: b1 - first_block, :num_blocks] = sums
    return scores


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_logits(
    Q, K, block_tables, s, h, kvh, q_start, q0, ctx, i, j,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd, stride_bt,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP32: tl.constexpr,
):
    """``Q~_i . K~_j`` for the reshaped rows ``i`` [ROWS] and keys ``j`` [BLOCK_N], float32."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = (offs_d < HEAD_DIM)[None, :]
    # step t reads the query at position first_query - t and the key at first_key + t
    first_query = i * STRIDE + STRIDE - 1
    q_ptrs = Q + ((q_start - q0 + first_query).to(tl.int64) * stride_qt + h * stride_qh)[:, None] \
        + offs_d[None, :] * stride_qd
    first_key = j * STRIDE
    if BLOCK_SIZE >= STRIDE:  # the STRIDE keys of a reshaped key lie in one cache block: one table read
        phys = tl.load(block_tables + s * stride_bt + first_key // BLOCK_SIZE, mask=first_key < ctx, other=0)
        k_ptrs = K + (phys.to(tl.int64) * stride_kb + (first_key % BLOCK_SIZE) * stride_ks
                      + kvh * stride_kh)[:, None] + offs_d[None, :] * stride_kd
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for t in range(STRIDE):
        q_ok = ((first_query - t >= q0) & (first_query - t < ctx))[:, None]
        k_pos = first_key + t
        k_ok = (k_pos < ctx)[:, None]
        if BLOCK_D != HEAD_DIM:
            q_ok = q_ok & d_ok
            k_ok = k_ok & d_ok
        qt = tl.load(q_ptrs - t * stride_qt, mask=q_ok, other=0.0)
        if BLOCK_SIZE >= STRIDE:
            kt = tl.load(k_ptrs + t * stride_ks, mask=k_ok, other=0.0)
        else:
            phys_t = tl.load(block_tables + s * stride_bt + k_pos // BLOCK_SIZE, mask=k_pos < ctx, other=0)
            k_rows = phys_t.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
            kt = tl.load(K + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=k_ok, other=0.0)
        if FP32:  # float32 inputs, or the interpreter (whose bfloat16 dot is wrong)
            acc = tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(qt, tl.trans(kt.to(qt.dtype)), acc)
    return acc


@triton.jit(do_not_specialize=["stride_bt", "lse_rows", "num_k_blocks"])
def _block_lse_kernel(
    Q, K, cu_q, context_lens, block_tables, Lse,
    scale_log2, lse_rows, num_k_blocks,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd, stride_bt,
    GROUP: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP32: tl.constexpr,
):
    """Pass 1: per (head, row tile, sequence), each row's log2-sum-exp2 of its base-2 logits over each key
    block up to the tile's diagonal (-inf where a block has no visible key). Each key tile is reduced on
    its own, against its own row max: no running max, no rescaling."""
    KB: tl.constexpr = BLOCK_N // PER_BLOCK  # key blocks of a key tile
    h = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest row tiles start first
    s = tl.program_id(2)
    ctx = tl.load(context_lens + s)
    q_start = tl.load(cu_q + s)
    q0 = ctx - (tl.load(cu_q + s + 1) - q_start)
    last_row = (ctx - 1) // STRIDE
    i0 = q0 // (STRIDE * PER_BLOCK) * PER_BLOCK + tile * ROWS  # row tiles start at the first query block
    i = i0 + tl.arange(0, ROWS)
    num_keys = tl.minimum(i0 + ROWS, last_row + 1)  # causal: keys j <= i
    if (q0 < ctx) & (i0 <= last_row):  # rows that do not take part are written too; pass 2 skips them
        out_rows = ((s * tl.num_programs(0) + h).to(tl.int64) * lse_rows + tile * ROWS
                    + tl.arange(0, ROWS)) * num_k_blocks
        for j0 in range(0, num_keys, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            x = _tile_logits(Q, K, block_tables, s, h, h // GROUP, q_start, q0, ctx, i, j,
                             stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
                             stride_bt, ROWS, BLOCK_N, STRIDE, HEAD_DIM, BLOCK_D, BLOCK_SIZE, FP32)
            x = tl.where(j[None, :] <= i[:, None], x * scale_log2, float("-inf"))
            m = tl.max(x, 1)
            m = tl.where(m == float("-inf"), 0.0, m)  # a row that sees no key of the tile
            sums = tl.sum(tl.reshape(tl.math.exp2(x - m[:, None]), [ROWS, KB, PER_BLOCK]), 2)
            kb = j0 // PER_BLOCK + tl.arange(0, KB)
            tl.store(Lse + out_rows[:, None] + kb[None, :], m[:, None] + tl.math.log2(sums),
                     mask=(kb < num_k_blocks)[None, :])


@triton.jit(do_not_specialize=["lse_rows", "num_q_blocks", "num_k_blocks"])
def _block_sums_kernel(
    Lse, cu_q, context_lens, Scores,
    lse_rows, num_q_blocks, num_k_blocks,
    STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    """Pass 2: per (head, query block row, sequence), each row's total log2-sum-exp2 over its key blocks,
    then ``P`` summed per key block over the row's taking-part reshaped rows: ``exp2(lse - total)``. Every
    element of ``Scores`` is written (0 past the diagonal and in padding rows): no fill before it."""
    h = tl.program_id(0)
    r = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(context_lens + s)
    q0 = ctx - (tl.load(cu_q + s + 1) - tl.load(cu_q + s))
    b = q0 // (STRIDE * PER_BLOCK) + r  # the row's query block, its diagonal key block
    out = ((s * tl.num_programs(0) + h).to(tl.int64) * num_q_blocks + r) * num_k_blocks
    if (q0 < ctx) & (b * STRIDE * PER_BLOCK < ctx):
        i = b * PER_BLOCK + tl.arange(0, PER_BLOCK)
        row_ok = (i >= q0 // STRIDE) & (i <= (ctx - 1) // STRIDE)
        rows = ((s * tl.num_programs(0) + h).to(tl.int64) * lse_rows + r * PER_BLOCK
                + tl.arange(0, PER_BLOCK)) * num_k_blocks
        m_i = tl.full([PER_BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([PER_BLOCK], tl.float32)
        for kb0 in range(0, b + 1, BLOCK_KB):
            kb = kb0 + tl.arange(0, BLOCK_KB)
            lse = tl.load(Lse + rows[:, None] + kb[None, :], mask=(kb <= b)[None, :], other=float("-inf"))
            m_new = tl.maximum(m_i, tl.max(lse, 1))  # finite from the first chunk: key block 0 is visible
            l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(lse - m_new[:, None]), 1)
            m_i = m_new
        total = m_i + tl.math.log2(l_i)
        for kb0 in range(0, num_k_blocks, BLOCK_KB):  # past the diagonal: exp2(-inf) = 0
            kb = kb0 + tl.arange(0, BLOCK_KB)
            lse = tl.load(Lse + rows[:, None] + kb[None, :], mask=(kb <= b)[None, :], other=float("-inf"))
            p = tl.where(row_ok[:, None], tl.math.exp2(lse - total[:, None]), 0.0)
            tl.store(Scores + out + kb, tl.sum(p, 0), mask=kb < num_k_blocks)
    else:  # a padding row
        for kb0 in range(0, num_k_blocks, BLOCK_KB):
            kb = kb0 + tl.arange(0, BLOCK_KB)
            tl.store(Scores + out + kb, tl.zeros([BLOCK_KB], tl.float32), mask=kb < num_k_blocks)


# ---------------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------------


def _config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(rows per tile, keys per tile, num_warps, num_stages) before fitting to the block and the chunk.
    On the GPU a tile is a GEMM of depth stride x head_dim."""
    if device.type != "cuda":  # the interpreter: its time goes by the number of tiles, not their size
        return 32, 32, 1, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    # 16-bit: wide key tiles, so that a long context is few tiles and each GEMM is large (``config``
    # overrides it, for tuning)
    return 64, 128, 4, 3


def _fit_stages(stages: int, rows: int, block_n: int, block_d: int, q: torch.Tensor) -> int:
    """Pipeline stages that fit in shared memory: each holds one step's query and key tiles; pass 1's
    reduction by key block may stage the float32 logit tile besides (wide blocks make wide tiles)."""
    if q.device.type != "cuda":
        return stages
    budget = max_shared_memory(q.device)
    while stages > 1 and stages * (rows + block_n) * block_d * q.element_size() + rows * block_n * 4 > budget:
        stages -= 1
    return stages


def block_scores(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, scale: float, stride: int, block: int, max_query_len: int,
    max_context_len: int, *, config: tuple[int, int, int, int] | None = None,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """:func:`block_scores_reference` by two Triton passes over the paged keys (CUDA tensors, or CPU
    tensors under Triton's interpreter). ``max_query_len`` and ``max_context_len`` are host ints that
    bound every sequence; nothing is read back from the device (``host_lens``, the reference's, goes
    unused). ``config`` overrides :func:`_config` (benchmarks): powers of two, the tiles widened to whole
    blocks."""
    _check_args(q, k_cache, block_tables, cu_seqlens_q, context_lens, stride, block, max_query_len,
                max_context_len)
    per_block = block // stride
    if per_block > MAX_ROWS_PER_BLOCK:
        raise ValueError(
            f"block={block} with stride={stride} makes {per_block} reshaped rows a block; the Triton "
            f"estimate holds a block's rows in one tile, at most {MAX_ROWS_PER_BLOCK}: use a larger stride"
        )
    if q.device.type != "cuda" and not is_interpreted():
        raise ValueError("block_scores runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1); "
                         "use block_scores_reference on the CPU")
    num_seqs, num_heads, head_dim = context_lens.shape[0], q.shape[1], q.shape[2]
    num_q_blocks = num_query_blocks(max_query_len, block)
    num_k_blocks = num_key_blocks(max_context_len, block)
    shape = (num_seqs, num_heads, num_q_blocks, num_k_blocks)
    if num_seqs == 0 or max_query_len == 0 or q.shape[0] == 0:
        return torch.zeros(shape, dtype=torch.float32, device=q.device)
    scores = torch.empty(shape, dtype=torch.float32, device=q.device)

    rows, block_n, warps, stages = config or _config(q.dtype, q.device)
    if not all(_is_power_of_two(v) for v in (rows, block_n)):
        raise ValueError(f"config={config}: rows and keys per tile must be powers of two")
    # whole blocks per tile, at least 16 (tl.dot), no more rows than the chunk's blocks hold
    rows = max(per_block, 16, min(rows, next_power_of_2(num_q_blocks * per_block)))
    block_n = max(per_block, 16, block_n)
    stages = _fit_stages(stages, rows, block_n, next_power_of_2(head_dim), q)
    num_tiles = cdiv(num_q_blocks * per_block, rows)
    lse_rows = num_tiles * rows
    lse = torch.empty(num_seqs, num_heads, lse_rows, num_k_blocks, dtype=torch.float32, device=q.device)

    strides = (*q.stride(), *k_cache.stride(), block_tables.stride(0))
    _block_lse_kernel[(num_heads, num_tiles, num_seqs)](
        q, k_cache, cu_seqlens_q, context_lens, block_tables, lse,
        scale / stride * LOG2E, lse_rows, num_k_blocks, *strides,
        GROUP=num_heads // k_cache.shape[2], STRIDE=stride, PER_BLOCK=per_block, ROWS=rows, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        FP32=q.dtype == torch.float32 or q.device.type != "cuda", num_warps=warps, num_stages=stages,
    )
    gpu = q.device.type == "cuda"
    _block_sums_kernel[(num_heads, num_q_blocks, num_seqs)](
        lse, cu_seqlens_q, context_lens, scores, lse_rows, num_q_blocks, num_k_blocks,
        STRIDE=stride, PER_BLOCK=per_block, BLOCK_KB=max(16, 2048 // per_block) if gpu else 16,
        num_warps=4 if gpu else 1,
    )
    return scores
