from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.fused import kernels, use_fused


class RMSNorm(nn.Module):
    """RMSNorm in float32; with ``residual`` it adds first and returns ``(normed, new_residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """On CUDA one fused kernel, which updates ``residual`` in place."""
        if use_fused(x):
            return kernels().rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
