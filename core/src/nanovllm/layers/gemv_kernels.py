"""The small-batch matmul's Triton kernels: ``y = x @ w.T (+ bias)`` for ``x [M, K]`` with few rows (a
decode step's tokens) and ``w [N, K]`` row-major (``nn.Linear``'s layout), accumulated in float32.

At a few rows the matmul reads ``w`` once and does almost no arithmetic, so it is bound by HBM: each
program streams a ``BLOCK_N x K`` slab of ``w`` (or its ``1 / SPLIT_K`` slice of K) in ``BLOCK_K``-wide
loads along K, which are contiguous in memory, marked evict-first (each byte is read once; what stays in
L2 is ``x``, read by every program, and the next matmul's prefetched weights). Consecutive programs read
consecutive bytes of ``w``, so the first ones find the part the weight prefetch put in L2.

``DOT``: the rows of ``x`` padded to 16 and multiplied on the tensor cores (``tl.dot``), where the loads go
through shared memory and ``num_stages`` keeps that many tiles in flight; else a broadcast multiply and
sum in registers, better at one row (no padding to 16).

``SPLIT_K > 1`` adds a second, deterministic pass rather than float32 atomics: each program writes its
partial sums to a float32 workspace ``[SPLIT_K, M, N]`` and a small kernel adds the splits in a fixed
order and rounds once. Atomics would need a zeroed float32 buffer and a rounding pass anyway (two extra
launches, not one), and their order of addition changes between runs, so the same prompt could decode
differently.

``GATED``: the gate and up projections of a gated MLP in one matrix (gate rows, then as many up rows),
each program reading its gate rows and the matching up rows and writing ``act(gate) * up`` (1: SiLU, 2:
GELU with the tanh approximation): the activation costs no launch of its own, and half the output is
written. With split-K the summing kernel applies it. On CPU tensors the kernels run under Triton's
interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.dependent_launch import launch_options, wait_for_previous
from nanovllm.kernel_sizes import cdiv, next_power_of_2
from nanovllm.layers.fused_kernels import gelu_tanh_mul, silu_mul


@triton.jit
def _gated(gate, up, Y, GATED: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``act(gate) * up`` of float32 sums: gate and up rounded as the plain output would be, then rounded as
    the activation's own kernel rounds (1: SiLU; 2: GELU-tanh, through libdevice's tanh with ``LIBDEVICE``)."""
    dt = Y.dtype.element_ty
    gate, up = gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32)
    if GATED == 1:
        out = silu_mul(gate, up, Y)
    else:
        out = gelu_tanh_mul(gate, up, Y, LIBDEVICE)
    return out


@triton.jit
def _load(ptrs, mask, POLICY: tl.constexpr):
    """``ptrs``' elements, 0 where ``mask`` is false; no mask where it is None."""
    if mask is None:
        values = tl.load(ptrs, eviction_policy=POLICY)
    else:
        values = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    return values


@triton.jit
def _gemv_kernel(
    X, W, B, Y, P, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr, LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K  # a slab's splits are neighbours: programs in launch order read w in memory order
    pid_n = pid // SPLIT_K
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features: rows of w (gate rows with GATED)
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    m_ok = ms < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # one row of x in registers: x a plain vector and the products a [BLOCK_N, BLOCK_K] tile (with a row
    # dimension of one and every load masked, measured together, the batch-1 step ran slower)
    ONE_ROW: tl.constexpr = BLOCK_M == 1 and not DOT
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + (k_start + ks)[None, :]
    if ONE_ROW:
        x_ptrs = X + k_start + ks
    else:
        x_ptrs = X + ms[:, None] * stride_xm + (k_start + ks)[None, :]
    if GATED:  # the matching up rows, N further down
        u_ptrs = W + (rows[:, None].to(tl.int64) + N) * stride_wn + (k_start + ks)[None, :]
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATED:
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif ONE_ROW:  # products summed along K once, after the loop: no shuffles inside it
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if GATED:
            acc2_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        if GATED:
            acc3_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # STAGES > 1: the loop's loads go through shared memory, that many tiles in flight (the launch's
    # num_stages alone pipelines only loads that feed a dot)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        # masks only where a tile can pass the end of w or x
        if EVEN_K:
            w_mask = None if EVEN_N else row_ok[:, None]
            x_mask = None if ONE_ROW else m_ok[:, None]
        else:
            k_ok = (k0 + ks) < k_end
            w_mask = row_ok[:, None] & k_ok[None, :]
            x_mask = k_ok if ONE_ROW else m_ok[:, None] & k_ok[None, :]
        w = _load(w_ptrs, w_mask, "evict_first")
        x = _load(x_ptrs, x_mask, "evict_last")
        if GATED:
            u = _load(u_ptrs, w_mask, "evict_first")
        if ONE_ROW:
            acc2 += x[None, :].to(tl.float32) * w.to(tl.float32)
            if GATED:
                acc2_u += x[None, :].to(tl.float32) * u.to(tl.float32)
        elif DOT and FP32_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            if GATED:
                acc_u = tl.dot(x.to(tl.float32), tl.trans(u.to(tl.float32)), acc_u, input_precision="ieee")
        elif DOT:
            acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                acc_u = tl.dot(x, tl.trans(u), acc_u)
        else:
            acc3 += x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32)
            if GATED:
                acc3_u += x[:, None, :].to(tl.float32) * u[None, :, :].to(tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if GATED:
            u_ptrs += BLOCK_K
    if ONE_ROW:
        acc = tl.sum(acc2, axis=1)[None, :]
        if GATED:
            acc_u = tl.sum(acc2_u, axis=1)[None, :]
    elif not DOT:
        acc = tl.sum(acc3, axis=2)
        if GATED:
            acc_u = tl.sum(acc3_u, axis=2)
    ok = m_ok[:, None] & row_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(B + N + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            y = _gated(acc, acc_u, Y, GATED, LIBDEVICE)
        else:
            y = acc.to(Y.dtype.element_ty)
        tl.store(Y + ms[:, None] * stride_ym + rows[None, :], y, mask=ok)
    else:  # partials [SPLIT_K, M, N], or with GATED [SPLIT_K, M, 2N]: gate then up
        width = 2 * N if GATED else N
        partial = P + (pid_k * M + ms[:, None]).to(tl.int64) * width + rows[None, :]
        tl.store(partial, acc, mask=ok)
        if GATED:
            tl.store(partial + N, acc_u, mask=ok)


@triton.jit
def _split_k_sum_kernel(P, B, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr, GATED: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = tl.program_id(1)
    ok = cols < N
    width = 2 * N if GATED else N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if GATED:
        acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same sums every run
        partial = P + (s * M + m).to(tl.int64) * width + cols
        acc += tl.load(partial, mask=ok, other=0.0)
        if GATED:
            acc_u += tl.load(partial + N, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            acc_u += tl.load(B + N + cols, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        y = _gated(acc, acc_u, Y, GATED, LIBDEVICE)
    else:
        y = acc.to(Y.dtype.element_ty)
    tl.store(Y + m * stride_ym + cols, y, mask=ok)


_SUM_BLOCK = 1024
DOT_ROWS = 16  # tl.dot's smallest M: the rows of x the DOT path pads to
GATED_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}  # a gated MLP's activation -> the kernels' GATED


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *, block_n: int, block_k: int,
         split_k: int, dot: bool, num_warps: int, num_stages: int, activation: str | None = None,
         out_dtype: torch.dtype | None = None, compile_only: bool = False) -> torch.Tensor:
    """``x @ w.T (+ bias)`` accumulated in float32 and rounded once to ``out_dtype`` (default ``x``'s dtype),
    for ``x [M, K]`` (unit stride along K, ``M <= 16``) and ``w [N, K]`` contiguous of the same dtype.
    ``activation`` (a key of :data:`GATED_ACTIVATIONS`): ``w`` stacks gate rows over as many up rows, and the
    output is ``act(gate) * up`` ``[M, N / 2]``, ``block_n`` of its features a program. The caller checks the shapes and knobs
    (:func:`nanovllm.layers.gemv.gemv`); one launch, two with ``split_k > 1``. ``compile_only``: compile the
    kernels for these arguments and launch nothing (the output is then uninitialised)."""
    m, k = x.shape
    gated = GATED_ACTIVATIONS[activation] if activation is not None else 0
    n = w.shape[0] // 2 if gated else w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    # a split covers whole BLOCK_K tiles, so only the last one may end inside a tile
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k
    width = 2 * n if gated else n
    partials = y if split_k == 1 else torch.empty(split_k, m, width, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y
    launches = [(_gemv_kernel, (cdiv(n, block_n) * split_k,), (
        x, w, b, y, partials, m, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(0),
    ), dict(
        BLOCK_M=DOT_ROWS if dot else next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, DOT=dot, EVEN_K=k == k_per_split * split_k,  # every split whole tiles: no K mask
        EVEN_N=n % block_n == 0,
        HAS_BIAS=bias is not None,
        # float32 products for float32 inputs (not TF32), and in the interpreter, whose 16-bit dot is wrong
        FP32_DOT=x.dtype == torch.float32 or not x.is_cuda, STAGES=num_stages, GATED=gated,
        LIBDEVICE=x.is_cuda, num_warps=num_warps, num_stages=num_stages, **launch_options(x),
    ))]
    if split_k > 1:
        launches.append((_split_k_sum_kernel, (cdiv(n, _SUM_BLOCK), m), (
            partials, b, y, m, n, y.stride(0),
        ), dict(SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=_SUM_BLOCK, GATED=gated,
                LIBDEVICE=x.is_cuda, num_warps=4, **launch_options(x))))
    for kernel, grid, args, kwargs in launches:
        if compile_only:
            kernel.warmup(*args, grid=grid, **kwargs)
        else:
            kernel[grid](*args, **kwargs)
    return y


__all__ = ["DOT_ROWS", "GATED_ACTIVATIONS", "gemv"]
