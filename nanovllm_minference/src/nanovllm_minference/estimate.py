"""Online pattern estimation: how much attention the last query rows of a chunk pay to each key column
(``vertical``) and to each diagonal offset (``slash``), from which the policy picks its index.

For each sequence ``s`` and query head ``h`` take the last ``n = min(last_q, query_len)`` rows of the chunk;
row ``j`` sits at position ``p_j = context_len - n + j`` and its attention is ``A[j, c] = softmax over
c <= p_j of scale * q_j . k_c`` (float32). Then::

    vertical[s, h, c] = sum_j A[j, c]          slash[s, h, o] = sum_j A[j, p_j - o]   (p_j - o >= 0)

both ``[S, H, L]`` float32 with ``L`` the longest context; entries at or past a sequence's context are 0.

``estimate`` is two Triton passes over the paged keys, each program owning one KV head's slice of keys
(each pass reads a key once for the stacked rows of several of its GQA group's heads: up to 256 rows in
pass 1, 128 in pass 2):

1. row statistics: the running max and sum of ``exp2`` of every row's scores, one partial per slice. It
   also zeroes the outputs over its slice of positions (the diagonal sums are added to; both are 0 past a
   context), so no fill is launched.
2. sums: each program first folds its rows' partials into their max and ``1 / sum``, then reads the
   scores again, normalised; column sums are stored (each column has one owner). Diagonal
   sums are skewed in registers (``tl.gather`` rotates row ``j`` by ``j``) so a column of the skewed
   tile holds two diagonals, one on each side of the rotation, then added to ``slash`` with atomics. Key
   tiles are square (as many keys as rows), so each diagonal gets one part from each of at most two
   tiles: two additions onto zero give the same float in either order, and the result is deterministic.

``estimate_reference`` is the same in plain torch, batched over sequences and heads (the CPU path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from nanovllm.attention.backend import check_paged_inputs
from nanovllm.sparse import cdiv, host_lengths, max_shared_memory, next_power_of_2, num_sms

LOG2E = 1.4426950408889634
MAX_LAST_Q = 128  # rows per head held in one tile; MInference uses 64


def _check_args(q, k_cache, block_tables, cu_seqlens_q, context_lens, last_q) -> None:
    check_paged_inputs(q, k_cache, None, block_tables, cu_seqlens_q, context_lens)
    if not 1 <= last_q <= MAX_LAST_Q:
        raise ValueError(f"last_q={last_q}: estimate from 1 to {MAX_LAST_Q} query rows (MInference uses 64)")


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------


def estimate_reference(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, scale: float, last_q: int = 64, max_context_len: int | None = None, *,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vertical, slash)``, both ``[S, H, L]`` float32 (see the module docstring). ``host_lens``: the query
    and context lengths as host ints (``PhaseMetadata.host_lens``); without them they are read from the
    tensors."""
    _check_args(q, k_cache, block_tables, cu_seqlens_q, context_lens, last_q)
    device = q.device
    num_seqs, num_heads = context_lens.shape[0], q.shape[1]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    host_lens = host_lengths(cu_seqlens_q, context_lens, host_lens)
    ctx = context_lens.long()
    longest = max(host_lens[1], default=0)
    width = longest if max_context_len is None else max_context_len
    if width < longest:
        raise ValueError(f"max_context_len={max_context_len} is shorter than a context of {longest} keys")
    vertical = torch.zeros(num_seqs, num_heads, width, dtype=torch.float32, device=device)
    slash = torch.zeros_like(vertical)
    cu = cu_seqlens_q.long()
    n = (cu[1:] - cu[:-1]).clamp(max=last_q)  # rows per sequence
    rows = min(max(host_lens[0], default=0), last_q)
    if rows == 0 or width == 0:
        return vertical, slash

    # the last n query rows of each sequence, padded to `rows`: [S, R, H, D]
    j = torch.arange(rows, device=device)
    row_ok = j < n[:, None]  # [S, R]
    q_rows = torch.where(row_ok, cu[1:, None] - n[:, None] + j, 0)
    q_last = torch.where(row_ok[..., None, None], q[q_rows].float(), 0.0)
    pos = ctx[:, None] - n[:, None] + j  # [S, R] positions of the rows

    # every key of every sequence, padded to `width`: [S, L, Hkv, D]
    c = torch.arange(width, device=device)
    key_ok = c < ctx[:, None]  # [S, L]
    logical = (c // block_size).clamp(max=block_tables.shape[1] - 1).expand(num_seqs, width)
    physical = torch.where(key_ok, block_tables.long().gather(1, logical), 0)
    keys = k_cache[physical, c % block_size].float()

    # query head h = kvh * group + g reads KV head kvh
    q_groups = q_last.unflatten(2, (num_kv_heads, num_heads // num_kv_heads))  # [S, R, Hkv, G, D]
    scores = torch.einsum("srkgd,slkd->skgrl", q_groups, keys).flatten(1, 2) * scale  # [S, H, R, L]
    allowed = (row_ok[..., None] & (c <= pos[..., None]))[:, None]  # causal; c <= p_j < context
    probs = torch.where(allowed, scores.masked_fill(~allowed, float("-inf")).softmax(-1), 0.0)

    vertical += probs.sum(2)
    offsets = (pos[..., None] - c).clamp(0, width - 1)  # [S, R, L]; where clamped (padded rows too), probs is 0
    offsets = offsets[:, None].expand(num_seqs, num_heads, rows, width).reshape(num_seqs, num_heads, -1)
    slash.scatter_add_(2, offsets, probs.reshape(num_seqs, num_heads, -1))
    return vertical, slash


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _key_tile(
    K, block_tables, s, kvh, c0, ctx, stride_bt, stride_kb, stride_ks, stride_kh, stride_kd, offs_d, d_ok,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Keys ``c0 .. c0 + BLOCK_N - 1`` of KV head ``kvh`` of sequence ``s`` (0 past the context), and their
    positions."""
    c = c0 + tl.arange(0, BLOCK_N)
    c_ok = c < ctx
    if BLOCK_N <= BLOCK_SIZE:  # powers of two and c0 a multiple of BLOCK_N: one cache block, one table read
        phys = tl.load(block_tables + s * stride_bt + c0 // BLOCK_SIZE).to(tl.int64)
    else:
        phys = tl.load(block_tables + s * stride_bt + c // BLOCK_SIZE, mask=c_ok, other=0).to(tl.int64)
    rows = phys * stride_kb + (c % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    k = tl.load(K + rows[:, None] + offs_d[None, :] * stride_kd, mask=c_ok[:, None] & d_ok[None, :],
                other=0.0)
    return k, c


@triton.jit
def _scores(q, k, scale_log2, FP32: tl.constexpr):
    """``scale * q . k`` in base 2, float32."""
    if FP32:  # float32 inputs, or the interpreter (whose bfloat16 dot is wrong)
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))
    return qk * scale_log2


@triton.jit(do_not_specialize=["stride_bt", "tiles_per_split", "last_q", "width"])
def _row_stats_kernel(
    Q, K, cu_q, context_lens, block_tables, PartM, PartL, Vertical, Slash,
    scale_log2, last_q, tiles_per_split, width,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_bt,
    GROUP: tl.constexpr, NUM_SUB: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP32: tl.constexpr,
):
    """Pass 1: per (key slice, KV head and sub-group of HEADS of its query heads, sequence), every row's
    max and sum of exp2 over the slice's keys (max -inf, sum 0 where the slice has none for it); and zeros
    in both outputs over the slice's positions for those heads."""
    split = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_SUB
    sub = tl.program_id(1) % NUM_SUB
    s = tl.program_id(2)
    start = split * tiles_per_split * BLOCK_N
    heads_here = sub * HEADS + tl.arange(0, HEADS)
    rows_out = (s * (tl.num_programs(1) // NUM_SUB) * GROUP + kvh * GROUP + heads_here).to(tl.int64) * width
    for c0 in range(start, tl.minimum(start + tiles_per_split * BLOCK_N, width), BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        where = rows_out[:, None] + c[None, :]
        zero_ok = (heads_here < GROUP)[:, None] & (c < width)[None, :]
        tl.store(Vertical + where, tl.zeros([HEADS, BLOCK_N], tl.float32), mask=zero_ok)
        tl.store(Slash + where, tl.zeros([HEADS, BLOCK_N], tl.float32), mask=zero_ok)
    ctx = tl.load(context_lens + s)
    q_end = tl.load(cu_q + s + 1)
    n = tl.minimum(q_end - tl.load(cu_q + s), last_q)

    # the rows of HEADS query heads stacked: row r is row j = r % ROWS of head r // ROWS of the sub-group
    offs_r = tl.arange(0, HEADS * ROWS)
    head = sub * HEADS + offs_r // ROWS
    j = offs_r % ROWS
    head_ok = head < GROUP
    h = kvh * GROUP + head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_end - n + j).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=(head_ok & (j < n))[:, None] & d_ok[None, :], other=0.0,
    )
    pos = ctx - n + j

    m_i = tl.full([HEADS * ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS * ROWS], tl.float32)
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)
    end = tl.where(n > 0, end, start)
    for c0 in range(start, end, BLOCK_N):
        k, c = _key_tile(K, block_tables, s, kvh, c0, ctx, stride_bt, stride_kb, stride_ks, stride_kh,
                         stride_kd, offs_d, d_ok, BLOCK_N, BLOCK_SIZE)
        qk = _scores(q, k, scale_log2, FP32)
        qk = tl.where((c[None, :] <= pos[:, None]) & (c[None, :] < ctx), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep exp2 finite
        l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(qk - m_use[:, None]), 1)
        m_i = m_new

    # PartM, PartL: [S, H, num_splits, ROWS] contiguous
    out = ((s * (tl.num_programs(1) // NUM_SUB) * GROUP + h) * tl.num_programs(0) + split) * ROWS + j
    tl.store(PartM + out, m_i, mask=head_ok)
    tl.store(PartL + out, l_i, mask=head_ok)


@triton.jit(do_not_specialize=["stride_bt", "tiles_per_split", "last_q", "width", "num_parts"])
def _sums_kernel(
    Q, K, cu_q, context_lens, block_tables, PartM, PartL, Vertical, Slash,
    scale_log2, last_q, tiles_per_split, width, num_parts,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_bt,
    GROUP: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP32: tl.constexpr,
):
    """Pass 2: per (key slice, block of HEADS query heads of one GQA group, sequence), its rows' partials
    from pass 1 folded into each row's max and 1 / sum, then the normalised probabilities of the block's
    stacked rows on each square key tile (ROWS keys): column sums stored per head, diagonal sums atomically
    added."""
    split = tl.program_id(0)
    first_head = tl.program_id(1) * HEADS  # HEADS divides GROUP: the block reads one KV head
    kvh = first_head // GROUP
    s = tl.program_id(2)
    num_heads = tl.num_programs(1) * HEADS
    ctx = tl.load(context_lens + s)
    q_end = tl.load(cu_q + s + 1)
    n = tl.minimum(q_end - tl.load(cu_q + s), last_q)
    if n <= 0:
        return
    # the rows of the block's heads stacked: row r is row j = r % ROWS of head first_head + r // ROWS
    offs_r = tl.arange(0, HEADS * ROWS)
    j = offs_r % ROWS
    h = first_head + offs_r // ROWS
    row_ok = j < n
    pos = ctx - n + j
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + (q_end - n + j).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # PartM, PartL: [S, H, num_parts, ROWS]
    parts = (s * num_heads + h).to(tl.int64) * num_parts * ROWS + j
    m = tl.full([HEADS * ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([HEADS * ROWS], tl.float32)
    for part in range(0, num_parts):
        m_part = tl.load(PartM + parts + part * ROWS)
        m_new = tl.maximum(m, m_part)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
        l_part = tl.load(PartL + parts + part * ROWS)
        l_sum = l_sum * tl.math.exp2(m - m_use) + l_part * tl.math.exp2(m_part - m_use)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    inv_l = tl.where(l_sum > 0, 1.0 / l_sum, 0.0)
    # skew: column u of row j holds key c0 + (j - u) mod ROWS, on the diagonal of offset
    # p_j - c = (ctx - n - c0) + u where u <= j ("lower"), and that minus ROWS where u > j
    u = tl.arange(0, ROWS)
    skew = (j[:, None] - u[None, :] + ROWS) % ROWS
    lower = u[None, :] <= j[:, None]
    out = (s * num_heads + first_head + tl.arange(0, HEADS)).to(tl.int64)[:, None] * width  # [HEADS, 1]
    limit = tl.minimum(ctx, width)  # writes stay inside the outputs

    start = split * tiles_per_split * ROWS
    end = tl.minimum(start + tiles_per_split * ROWS, ctx)
    for c0 in range(start, end, ROWS):
        k, c = _key_tile(K, block_tables, s, kvh, c0, ctx, stride_bt, stride_kb, stride_ks, stride_kh,
                         stride_kd, offs_d, d_ok, ROWS, BLOCK_SIZE)
        qk = _scores(q, k, scale_log2, FP32)
        keep = row_ok[:, None] & (c[None, :] <= pos[:, None])
        p = tl.where(keep, tl.math.exp2(qk - m[:, None]), 0.0) * inv_l[:, None]
        tl.store(Vertical + out + c[None, :], tl.sum(tl.reshape(p, [HEADS, ROWS, ROWS]), 1),
                 mask=(c < limit)[None, :])
        skewed = tl.gather(p, skew, axis=1)
        diag_lower = tl.sum(tl.reshape(tl.where(lower, skewed, 0.0), [HEADS, ROWS, ROWS]), 1)
        diag_upper = tl.sum(tl.reshape(tl.where(lower, 0.0, skewed), [HEADS, ROWS, ROWS]), 1)
        o = ctx - n - c0 + u
        tl.atomic_add(Slash + out + o[None, :], diag_lower, mask=((o >= 0) & (o < limit))[None, :],
                      sem="relaxed")
        o -= ROWS
        tl.atomic_add(Slash + out + o[None, :], diag_upper, mask=((u > 0) & (o >= 0) & (o < limit))[None, :],
                      sem="relaxed")


# ---------------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------------


def _num_splits(programs: int, tiles: int, device: torch.device) -> int:
    """Key slices per (sequence, head group): enough programs for about four per multiprocessor."""
    if device.type != "cuda":
        return min(tiles, 4)  # the interpreter: a few slices, so that merging them is exercised
    return max(1, min(tiles, cdiv(4 * num_sms(device), programs)))


def _slices(width: int, block_n: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(number of slices, tiles per slice) covering ``width`` keys in tiles of ``block_n``."""
    tiles = cdiv(width, block_n)
    per_slice = cdiv(tiles, _num_splits(programs, tiles, device))
    return cdiv(tiles, per_slice), per_slice


def _sums_heads(group: int, rows: int, block_d: int, itemsize: int, budget: int, stages: int) -> int:
    """Query heads per pass-2 program: the most (a power of two) that divide the group, stack at most 128
    rows, and fit ``budget`` bytes of shared memory: their queries, ``stages`` stages of the key tile and
    ``tl.gather``'s float32 probability tile. Fewer heads a program can be faster: the row sums of a larger
    tile cost more than its shared key reads save."""
    tile_k = rows * block_d * itemsize
    fits = [
        heads for heads in range(1, group + 1)
        if group % heads == 0 and heads & (heads - 1) == 0 and heads * rows <= 128
        and heads * tile_k + stages * tile_k + heads * rows * rows * 4 <= budget
    ]
    if not fits:
        raise ValueError(
            f"a pass-2 program of {rows} rows and keys and head size {block_d} needs more than the "
            f"{budget} bytes of shared memory: pass a smaller last_q"
        )
    return fits[-1]


def estimate(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, scale: float, last_q: int = 64, max_context_len: int | None = None, *,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vertical, slash)`` as :func:`estimate_reference`, by two Triton launches and nothing else. Pass
    ``max_context_len`` (a host int, at least every context length) to avoid reading the lengths back to
    the host (``host_lens``, the reference's, goes unused). The two results are views of one allocation
    (``[2, S, H, L]``)."""
    _check_args(q, k_cache, block_tables, cu_seqlens_q, context_lens, last_q)
    num_seqs = context_lens.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    width = max_context_len
    if num_seqs == 0 or width == 0 or q.shape[0] == 0:
        vertical = torch.zeros(num_seqs, num_heads, width, dtype=torch.float32, device=q.device)
        return vertical, torch.zeros_like(vertical)
    # pass 1 zeroes both: no fill is launched
    vertical, slash = torch.empty(2, num_seqs, num_heads, width, dtype=torch.float32, device=q.device)

    gpu = q.device.type == "cuda"
    # pass 2 tiles keys in squares of the rows; on the GPU at least 64 (masked rows past last_q)
    rows = max(64 if gpu else 16, next_power_of_2(last_q))
    block_d = next_power_of_2(head_dim)
    fp32 = q.dtype == torch.float32 or not gpu
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, FP32=fp32)
    strides = (*q.stride(), *k_cache.stride(), block_tables.stride(0))
    scale_log2 = scale * LOG2E

    # pass 1: up to 256 stacked rows a program (a whole GQA group at last_q 64 and group 4), the key tile
    # as wide as keeps the score tile at 16K floats
    # over head size 128 the tiles shrink to stay within shared memory (Hopper: 227 KB a program): at
    # most 128 stacked rows (64 in float32) and 8K key elements
    stacked = 256 if block_d <= 128 else 128 // (2 if q.element_size() == 4 else 1)
    heads = min(next_power_of_2(group), max(1, stacked // rows))
    num_sub = cdiv(group, heads)
    max_keys = 128 if block_d <= 128 else 8192 // block_d
    block_n1 = max(16, min(max_keys, 16384 // (heads * rows))) if gpu else 16
    slices1, per_slice1 = _slices(width, block_n1, num_seqs * num_kv_heads * num_sub, q.device)
    part_m = torch.empty(num_seqs, num_heads, slices1, rows, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _row_stats_kernel[(slices1, num_kv_heads * num_sub, num_seqs)](
        q, k_cache, cu_seqlens_q, context_lens, block_tables, part_m, part_l, vertical, slash,
        scale_log2, last_q, per_slice1, width, *strides,
        GROUP=group, NUM_SUB=num_sub, HEADS=heads, ROWS=rows, BLOCK_N=block_n1, **common,
        num_warps=4,  # faster than 8 at 256 rows x 64 keys, measured at 32K and 128K keys
    )
    # pass 2: square tiles (each diagonal then gets parts from at most two tiles), as many query heads of
    # a group per program as shared memory holds (the CPU interpreter has no limit)
    budget = max_shared_memory(q.device) if gpu else 1 << 30
    stages2 = 3 if block_d * q.element_size() <= 512 else 2  # a float32 key row of 256: two stages
    heads2 = _sums_heads(group, rows, block_d, q.element_size(), budget, stages2)
    slices2, per_slice2 = _slices(width, rows, num_seqs * num_heads // heads2, q.device)
    _sums_kernel[(slices2, num_heads // heads2, num_seqs)](
        q, k_cache, cu_seqlens_q, context_lens, block_tables, part_m, part_l,
        vertical, slash, scale_log2, last_q, per_slice2, width, slices1, *strides,
        GROUP=group, HEADS=heads2, ROWS=rows, **common, num_warps=4, num_stages=stages2,
    )
    return vertical, slash
