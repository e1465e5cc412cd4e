from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed import all_reduce, all_reduce_rms_norm, tp_size
from nanovllm.layers.fused import kernels, use_fused


class RMSNorm(nn.Module):
    """RMSNorm in float32; with ``residual`` it adds first and returns ``(normed, new_residual)``."""

    unit_offset = False  # how the fused kernels apply the weight: see GemmaRMSNorm

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, partial: bool = False):
        """On CUDA one fused kernel, which updates ``residual`` in place. ``partial``: ``x`` is this
        rank's share of a sum over the tensor-parallel ranks (a row-parallel layer's output without its
        all-reduce), which is all-reduced first: in the same kernel where symmetric memory takes it."""
        if partial and tp_size() > 1:
            fused = all_reduce_rms_norm(x, self.weight, self.eps, residual)
            if fused is not None:
                return fused
            x = all_reduce(x)
        if use_fused(x):
            return kernels().rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weights are offsets from one (it scales by ``1 + weight``), and the scaling
    happens in float32 before the cast back. Same call as :class:`RMSNorm`; on CUDA one fused kernel."""

    unit_offset = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, partial: bool = False):
        if partial and tp_size() > 1:
            x = all_reduce(x)
        if use_fused(x):
            return kernels().rms_norm(x, self.weight, self.eps, residual, unit_offset=self.unit_offset)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
