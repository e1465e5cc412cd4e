"""Triton kernels for the small per-token ops of a decoder layer, one launch each instead of the
five to ten elementwise kernels of the torch code they replace (decode steps are launch bound).

- ``rms_norm``: RMSNorm of each row, optionally adding the residual first (written back in place);
  ``unit_offset`` scales by ``1 + weight`` in float32 (Gemma's norm).
- ``silu_and_mul``: ``silu(gate) * up`` over the two halves of each row.
- ``rope_``: neox-style rotary embedding of q and k in place, optionally RMS-normalising each head
  first (Qwen3's and Gemma 3's q/k norms), and optionally writing the rotated keys and the values to their
  paged-cache slots (the attention backend's KV store, in the same launch).
- ``all_reduce_rms_norm``: under tensor parallelism, the sum over the ranks of each rank's share (a
  row-parallel layer's output), then ``rms_norm``, in one kernel: the ranks exchange their shares through
  symmetric memory (:class:`nanovllm.distributed.SymmetricAllReduce`).
- ``l2_prefetch``: reads the first bytes of a tensor into L2 and changes no value (no torch counterpart:
  see :mod:`nanovllm.layers.weight_prefetch`).

Each rounds where the torch reference in the layers rounds (to the activation dtype after the norm,
after the weight, after SiLU), so the two agree to the last bit in most elements and greedy decoding
gives the same tokens. On CPU tensors they run under Triton's interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.attention.triton_kernels import cache_value
from nanovllm.dependent_launch import launch_options, wait_for_previous
from nanovllm.kernel_sizes import CHAINED_LAUNCH_MAX_ROWS, cdiv, next_power_of_2


@triton.jit
def _add_rms_norm_row(x, R, W, Out, row, cols, ok, n_cols, eps, stride_r, stride_o,
                      HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """``_rms_norm_kernel``'s body for one row ``x`` (already loaded, in the activation dtype)."""
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: one rounding, after the scale
        y = xf * rstd
        w = 1.0 + w
    else:  # rounded after the norm, as RMSNorm's torch code does
        y = (xf * rstd).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (y * w).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, n_cols, eps,
    stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    _add_rms_norm_row(x, R, W, Out, row, cols, ok, n_cols, eps, stride_r, stride_o, HAS_RESIDUAL, UNIT_OFFSET)


ROPE_WIDE_MAX_TOKENS = 256  # RoPE launches of up to this many tokens run 8 warps a token, larger ones 4


def _norm_warps(rows: int, block: int) -> int:
    """Warps of a row's RMSNorm program: one per 256 elements of the row, at most 16, or at most 4 in steps of
    up to ``CHAINED_LAUNCH_MAX_ROWS`` rows (decode), where the chained batch-1 step ran faster with fewer."""
    return min(4 if rows <= CHAINED_LAUNCH_MAX_ROWS else 16, max(1, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             unit_offset: bool = False):
    """RMSNorm over the last dim of ``x``; with ``residual`` (a contiguous tensor shaped like ``x``)
    it first sets ``residual = x + residual`` in place and returns ``(normed, residual)``.
    ``unit_offset``: scale by ``1 + weight`` in float32 and round once (Gemma's norm), where the default
    rounds the normalised row before scaling by ``weight``."""
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = residual.view(-1, n_cols) if residual is not None else rows
    if rows.shape[0]:
        block = next_power_of_2(n_cols)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, n_cols, eps, rows.stride(0), res.stride(0), n_cols,
            HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
            num_warps=_norm_warps(rows.shape[0], block), **launch_options(x),
        )
    return out if residual is None else (out, residual)


@triton.jit
def _signal(addresses, epoch):
    """Store ``epoch`` at every address (a flag in a peer GPU's memory), releasing this block's earlier
    writes to the whole system (impure: kept although its result is unused)."""
    return tl.inline_asm_elementwise(
        "st.release.sys.global.u32 [$1], $2; mov.u32 $0, 0;",
        "=r,l,r", [addresses, epoch + tl.zeros(addresses.shape, tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1,
    )


@triton.jit
def _wait(addresses, epoch, timeout_ns):
    """Wait until every flag holds ``epoch`` or a later one (compared modulo 2**32). A peer
    that has not arrived after ``timeout_ns`` traps, so the rank fails instead of hanging."""
    return tl.inline_asm_elementwise(
        """{
        .reg .u32 %seen, %ahead;
        .reg .u64 %start, %now;
        .reg .pred %behind, %gave_up;
        mov.u64 %start, %globaltimer;
        spin:
        ld.acquire.sys.global.u32 %seen, [$1];
        sub.u32 %ahead, %seen, $2;
        setp.lt.s32 %behind, %ahead, 0;
        @!%behind bra done;
        mov.u64 %now, %globaltimer;
        sub.u64 %now, %now, %start;
        setp.gt.u64 %gave_up, %now, $3;
        @%gave_up trap;
        bra spin;
        done:
        mov.u32 $0, 0;
        }""",
        "=r,l,r,l", [addresses, epoch + tl.zeros(addresses.shape, tl.int32),
                     timeout_ns + tl.zeros(addresses.shape, tl.int64)],
        dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit(do_not_specialize=["rank", "timeout_ns"])  # one compiled kernel for every rank
def _all_reduce_rms_norm_kernel(
    X, R, W, Out, Buffers, Epochs, n_rows, n_cols, eps,
    stride_x, stride_r, stride_o, data_offset, slot_size, flags_offset, rank, programs, timeout_ns,
    WORLD: tl.constexpr, WORLD_POW2: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, SYNC: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program ``p`` takes rows ``p, p + programs, ...`` (the same program always takes the same rows; the
    grid is ``min(rows, programs)``) and writes this rank's share of them into every rank's symmetric
    buffer, at slot ``epoch % 2``, region ``rank``, where ``epoch`` counts the calls program ``p`` has run.
    It tells program ``p`` of every rank that it has (a flag per program and rank, holding that count),
    waits for theirs, then sums the regions of its own buffer in rank order (so every rank gets the same
    bits) and norms. Writing to the peers and reading at home crosses the link once: the writes are posted,
    where a read waits for its answer. Two slots let a rank write a row's next share while a slower rank
    still reads this one: past the wait, no program is two calls ahead of its peers. ``SYNC`` off (tests
    on the interpreter): the other ranks' shares are already in this rank's buffer."""
    pid = tl.program_id(0)
    epoch = tl.load(Epochs + pid) + 1
    slot = (epoch & 1).to(tl.int64)
    dtype = Out.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    home = tl.load(Buffers + rank).to(tl.pointer_type(dtype)) + data_offset + slot * WORLD * slot_size
    mine = data_offset + (slot * WORLD + rank) * slot_size  # this rank's region of the slot
    for row in range(pid, n_rows, programs):
        x = tl.load(X + row * stride_x + cols, mask=ok)
        for r in tl.static_range(WORLD):
            there = tl.load(Buffers + r).to(tl.pointer_type(dtype)) + mine
            tl.store(there + row * n_cols + cols, x, mask=ok)
    if SYNC:
        tl.debug_barrier()  # every thread's writes are issued before the flags say so
        ranks = tl.arange(0, WORLD_POW2) % WORLD
        _signal(tl.load(Buffers + ranks) + flags_offset + (pid * WORLD + rank) * 4, epoch)
        _wait(tl.load(Buffers + rank) + flags_offset + (pid * WORLD + ranks) * 4, epoch, timeout_ns)
        tl.debug_barrier()
    for row in range(pid, n_rows, programs):
        total = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):
            share = home + r * slot_size + row * n_cols + cols
            total += tl.load(share, mask=ok, other=0.0, volatile=True).to(tl.float32)
        _add_rms_norm_row(total.to(dtype), R, W, Out, row, cols, ok, n_cols, eps, stride_r, stride_o,
                          HAS_RESIDUAL, False)
    tl.store(Epochs + pid, epoch)


def all_reduce_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    buffers: torch.Tensor, epochs: torch.Tensor, rank: int, data_offset: int, slot_size: int,
    flags_offset: int, *, timeout_s: float, sync: bool = True,
):
    """``rms_norm`` of the sum over the ranks of ``x [rows, hidden]`` (contiguous), as
    ``rms_norm(all_reduce(x), weight, eps, residual)`` computes it.

    ``buffers``: every rank's symmetric buffer address (int64, on the device). The shares live
    ``data_offset`` elements in, in two slots of one region of ``slot_size`` elements per rank; the flags
    ``flags_offset`` bytes in (``[len(epochs), world]`` int32, zero at the start). ``epochs``: this rank's
    calls per program, one program per row up to its length. ``sync=False``: for tests, the other ranks'
    shares are already in this rank's buffer. ``timeout_s``: how long a rank waits for the others before
    its kernel traps (the engine passes its collectives' timeout)."""
    n_rows, n_cols = x.shape
    world = buffers.numel()
    out = torch.empty_like(x)
    res = x if residual is None else residual
    block = next_power_of_2(n_cols)
    programs = epochs.numel()
    if n_rows == 0:
        return out if residual is None else (out, residual)
    _all_reduce_rms_norm_kernel[(min(n_rows, programs),)](
        x, res, weight, out, buffers, epochs, n_rows, n_cols, eps, x.stride(0), res.stride(0), n_cols,
        data_offset, slot_size, flags_offset, rank, programs, int(timeout_s * 1e9),
        WORLD=world, WORLD_POW2=next_power_of_2(world),
        HAS_RESIDUAL=residual is not None, SYNC=sync, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out if residual is None else (out, residual)


@triton.jit
def silu_mul(gate, up, Out):
    """``silu(gate) * up`` for float32 ``gate`` and ``up`` already rounded to ``Out``'s dtype, rounded as
    :class:`~nanovllm.layers.SiluAndMul`'s torch code rounds: after SiLU and after the product (the GEMV
    kernel applies it to its output too)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    return (act * up).to(Out.dtype.element_ty)


@triton.jit
def gelu_tanh_mul(gate, up, Out, LIBDEVICE: tl.constexpr):
    """``gelu(gate, approximate="tanh") * up`` for float32 ``gate`` and ``up`` already rounded to ``Out``'s
    dtype, rounded as :class:`~nanovllm.layers.GeluTanhAndMul`'s torch code rounds: after GELU and after the
    product. The formula is torch's, 0.5 * x * (1 + tanh(y)), so the bits match it where 1 + tanh(y)
    cancels (x below about -4). ``LIBDEVICE``: the GPU's tanhf, as torch's; else (the interpreter, which has
    no libdevice) the same value as x * sigmoid(2y), which cancels nothing."""
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) * (x + 0.044715 x^3)
    if LIBDEVICE:
        act = 0.5 * gate * (1.0 + libdevice.tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    act = act.to(Out.dtype.element_ty).to(tl.float32)
    return (act * up).to(Out.dtype.element_ty)


@triton.jit
def _gated_and_mul_kernel(X, Out, n_cols, stride_x, stride_o, GELU_TANH: tl.constexpr, LIBDEVICE: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:
        out = gelu_tanh_mul(gate, up, Out, LIBDEVICE)
    else:
        out = silu_mul(gate, up, Out)
    tl.store(Out + row * stride_o + cols, out, mask=ok)


def _gated_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = x.new_empty(*x.shape[:-1], n_cols)
    if rows.shape[0]:
        block = min(1024, next_power_of_2(n_cols))
        _gated_and_mul_kernel[(rows.shape[0], cdiv(n_cols, block))](
            rows, out, n_cols, rows.stride(0), n_cols, GELU_TANH=gelu_tanh, LIBDEVICE=x.is_cuda, BLOCK=block,
            num_warps=4, **launch_options(x),
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I]`` -> ``silu(x[..., :I]) * x[..., I:]``."""
    return _gated_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I]`` -> ``gelu(x[..., :I], approximate="tanh") * x[..., I:]``."""
    return _gated_and_mul(x, gelu_tanh=True)


@triton.jit
def _rounded(x, dt: tl.constexpr, BITWISE_RNE: tl.constexpr):
    """Float32 ``x`` rounded to ``dt`` (to nearest, ties to even) and back to float32. ``BITWISE_RNE``:
    to bfloat16 by integer arithmetic, for the interpreter, whose cast to bfloat16 truncates."""
    if BITWISE_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _rotate_heads(
    X, stride_h, W, cos, sin, eps, Cache, slot, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_SIZE: tl.constexpr, STORE: tl.constexpr,
    BITWISE_RNE: tl.constexpr,
):
    """Rotate one token's heads of ``X`` in place (RMS-normalised first with ``NORM``, scaled by ``1 + W``
    with ``UNIT_OFFSET``); with ``STORE`` also write them to cache slot ``slot`` (none when it is
    negative)."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    d_ok = dims < HALF
    ok = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    ptr = X + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        if UNIT_OFFSET:  # Gemma: one rounding, after the scale
            x1 = _rounded(x1 * rstd * (1.0 + w1), dt, BITWISE_RNE)
            x2 = _rounded(x2 * rstd * (1.0 + w2), dt, BITWISE_RNE)
        else:
            x1 = _rounded(_rounded(x1 * rstd, dt, BITWISE_RNE) * w1, dt, BITWISE_RNE)
            x2 = _rounded(_rounded(x2 * rstd, dt, BITWISE_RNE) * w2, dt, BITWISE_RNE)
    # rounded as the torch code rounds: each product, then the sum, to X's dtype (cos, sin already are)
    y1 = _rounded(_rounded(x1 * cos, dt, BITWISE_RNE) - _rounded(x2 * sin, dt, BITWISE_RNE), dt, BITWISE_RNE)
    y2 = _rounded(_rounded(x2 * cos, dt, BITWISE_RNE) + _rounded(x1 * sin, dt, BITWISE_RNE), dt, BITWISE_RNE)
    y1, y2 = y1.to(dt), y2.to(dt)
    tl.store(ptr, y1, mask=ok)
    tl.store(ptr + HALF, y2, mask=ok)
    if STORE:
        _store_heads(y1, y2, Cache, slot, stride_cb, stride_cs, stride_ch, heads, dims, ok, HALF, BLOCK_SIZE)


@triton.jit
def _store_heads(x1, x2, Cache, slot, stride_cb, stride_cs, stride_ch, heads, dims, ok, HALF: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """One token's heads (their two halves) into paged-cache slot ``slot``, unless it is negative."""
    if slot >= 0:
        dst = Cache + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst += heads[:, None] * stride_ch + dims[None, :]
        tl.store(dst, cache_value(x1, Cache), mask=ok)
        tl.store(dst + HALF, cache_value(x2, Cache), mask=ok)


@triton.jit
def _rope_kernel(
    Q, K, V, QW, KW, CosSin, Pos, Slots, KC, VC, eps_q, eps_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_cslot, stride_ch,
    HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, STORE: tl.constexpr, BITWISE_RNE: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    d_ok = dims < HALF
    # cos and sin rounded to the activations' dtype, as the torch code rounds them
    cos = tl.load(CosSin + pos * stride_cs + dims, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cs + HALF + dims, mask=d_ok, other=0.0).to(tl.float32)
    cos = _rounded(cos, Q.dtype.element_ty, BITWISE_RNE)[None, :]
    sin = _rounded(sin, Q.dtype.element_ty, BITWISE_RNE)[None, :]
    slot = tl.load(Slots + t).to(tl.int64) if STORE else -1
    _rotate_heads(Q + t * stride_qt, stride_qh, QW, cos, sin, eps_q, KC, -1, 0, 0, 0,
                  HQ, HQ_PAD, HALF, HALF_PAD, NORM, UNIT_OFFSET, BLOCK_SIZE, False, BITWISE_RNE)
    _rotate_heads(K + t * stride_kt, stride_kh, KW, cos, sin, eps_k, KC, slot, stride_cb, stride_cslot,
                  stride_ch, HK, HK_PAD, HALF, HALF_PAD, NORM, UNIT_OFFSET, BLOCK_SIZE, STORE, BITWISE_RNE)
    if STORE:  # the values as they are
        heads = tl.arange(0, HK_PAD)
        ok = (heads < HK)[:, None] & d_ok[None, :]
        ptr = V + t * stride_vt + heads[:, None] * stride_vh + dims[None, :]
        v1 = tl.load(ptr, mask=ok, other=0.0)
        v2 = tl.load(ptr + HALF, mask=ok, other=0.0)
        _store_heads(v1, v2, VC, slot, stride_cb, stride_cslot, stride_ch, heads, dims, ok, HALF, BLOCK_SIZE)


def rope_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None = None, k_norm: tuple[torch.Tensor, float] | None = None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` in place (rows may be strided views of one qkv
    tensor; the head dim must be contiguous). ``cos_sin [max_pos, D]`` float32 holds cos then sin of
    each frequency; they, each product and each sum are rounded to q's dtype, as transformers rounds.
    ``q_norm``/``k_norm``: ``(weight, eps)`` of a per-head RMSNorm applied first; ``unit_offset``: it scales
    by ``1 + weight`` in float32 and rounds once (Gemma's norm), as ``rms_norm`` does.
    ``store``: ``(v [T, Hkv, D], k_cache, v_cache, slot_mapping [T])`` to also write each token's rotated
    keys and its values to its slot of the paged caches ``[num_blocks, block_size, Hkv, D]`` (as the
    attention backend's ``store_kv`` does; slot -1: not written)."""
    n_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, "rope_ needs a contiguous head dim"
    norm = q_norm is not None
    (qw, eps_q), (kw, eps_k) = (q_norm, k_norm) if norm else ((q, 0.0), (k, 0.0))
    if store is not None:
        v, k_cache, v_cache, slots = store
        assert v.shape == k.shape and v.stride(2) == 1, "rope_ stores v [T, Hkv, D], its head dim contiguous"
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, \
            "k and v caches must share one layout, the head dim contiguous"
    else:
        v, k_cache, v_cache, slots = k, k, k, positions
    if n_tokens:
        half = head_dim // 2
        cache_strides = k_cache.stride()[:3] if store is not None else (0, 0, 0)
        _rope_kernel[(n_tokens,)](
            q, k, v, qw, kw, cos_sin, positions, slots, k_cache, v_cache, eps_q, eps_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
            *cache_strides,
            HQ=num_heads, HQ_PAD=next_power_of_2(num_heads),
            HK=num_kv_heads, HK_PAD=next_power_of_2(num_kv_heads),
            HALF=half, HALF_PAD=next_power_of_2(half), NORM=norm, UNIT_OFFSET=unit_offset,
            BLOCK_SIZE=k_cache.shape[1] if store is not None else 1, STORE=store is not None,
            num_warps=8 if n_tokens <= ROPE_WIDE_MAX_TOKENS else 4,
            BITWISE_RNE=q.dtype == torch.bfloat16 and not q.is_cuda,  # on the CPU: the interpreter
            enable_fp_fusion=False,  # an FMA would skip the rounding of a product that the torch code rounds
            **launch_options(q),
        )
    return q, k


@triton.jit
def _l2_prefetch_kernel(Words, Sink, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(Words + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    tl.store(Sink + pid, tl.sum(words, 0))  # a use of the loads, or the compiler drops them


_PREFETCH_BLOCK = 4096  # 32-bit words a program reads: 16 KiB


def l2_prefetch(x: torch.Tensor, n_bytes: int, sink: torch.Tensor) -> None:
    """Read the first ``n_bytes`` of contiguous ``x`` into L2, marked to be evicted last. ``sink`` (int32,
    at least ``n_bytes / 16 KiB`` elements) takes one meaningless sum per program."""
    words = x.reshape(-1).view(torch.uint8)[: n_bytes - n_bytes % 4].view(torch.int32)
    grid = cdiv(words.numel(), _PREFETCH_BLOCK)
    if grid > sink.numel():
        raise ValueError(f"a sink of {sink.numel()} elements for {grid} programs: prefetch fewer bytes")
    if grid:
        _l2_prefetch_kernel[(grid,)](words, sink, words.numel(), BLOCK=_PREFETCH_BLOCK)


__all__ = ["all_reduce_rms_norm", "l2_prefetch", "rms_norm", "rope_", "silu_and_mul", "silu_mul"]
