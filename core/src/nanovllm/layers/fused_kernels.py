"""Triton kernels for the small per-token ops of a decoder layer, one launch each instead of the
five to ten elementwise kernels of the torch code they replace (decode steps are launch bound).

- ``rms_norm``: RMSNorm of each row, optionally adding the residual first (written back in place).
- ``silu_and_mul``: ``silu(gate) * up`` over the two halves of each row.
- ``rope_``: neox-style rotary embedding of q and k in place, optionally RMS-normalising each head
  first (Qwen3's q/k norms).

Each rounds where the torch reference in the layers rounds (to the activation dtype after the norm,
after the weight, after SiLU), so the two agree to the last bit in most elements and greedy decoding
gives the same tokens. On CPU tensors they run under Triton's interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, n_cols, eps,
    stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (y * w).to(Out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of ``x``; with ``residual`` (a contiguous tensor shaped like ``x``)
    it first sets ``residual = x + residual`` in place and returns ``(normed, residual)``."""
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = residual.view(-1, n_cols) if residual is not None else rows
    if rows.shape[0]:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, n_cols, eps, rows.stride(0), res.stride(0), n_cols,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, residual)


@triton.jit
def _silu_and_mul_kernel(X, Out, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I]`` -> ``silu(x[..., :I]) * x[..., I:]``."""
    n_cols = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = x.new_empty(*x.shape[:-1], n_cols)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n_cols, block))](
            rows, out, n_cols, rows.stride(0), n_cols, BLOCK=block, num_warps=4,
        )
    return out


@triton.jit
def _rotate_heads(
    X, stride_h, W, cos, sin, eps,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    d_ok = dims < HALF
    ok = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    ptr = X + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        dt = X.dtype.element_ty
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=ok)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    Q, K, QW, KW, CosSin, Pos, eps_q, eps_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    d_ok = dims < HALF
    cos = tl.load(CosSin + pos * stride_cs + dims, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + HALF + dims, mask=d_ok, other=0.0)[None, :]
    _rotate_heads(Q + t * stride_qt, stride_qh, QW, cos, sin, eps_q, HQ, HQ_PAD, HALF, HALF_PAD, NORM)
    _rotate_heads(K + t * stride_kt, stride_kh, KW, cos, sin, eps_k, HK, HK_PAD, HALF, HALF_PAD, NORM)


def rope_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None = None, k_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` in place (rows may be strided views of one qkv
    tensor; the head dim must be contiguous). ``cos_sin [max_pos, D]`` float32 holds cos then sin of
    each frequency. ``q_norm``/``k_norm``: ``(weight, eps)`` of a per-head RMSNorm applied first."""
    n_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, "rope_ needs a contiguous head dim"
    norm = q_norm is not None
    (qw, eps_q), (kw, eps_k) = (q_norm, k_norm) if norm else ((q, 0.0), (k, 0.0))
    if n_tokens:
        half = head_dim // 2
        _rope_kernel[(n_tokens,)](
            q, k, qw, kw, cos_sin, positions, eps_q, eps_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
            HQ=num_heads, HQ_PAD=triton.next_power_of_2(num_heads),
            HK=num_kv_heads, HK_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), NORM=norm, num_warps=4,
        )
    return q, k


__all__ = ["rms_norm", "rope_", "silu_and_mul"]
