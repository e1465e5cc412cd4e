from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.fused import kernels, use_fused
from nanovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for the gate/up halves of the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return kernels().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    """The SwiGLU feed-forward block of Llama-family models (``gate_proj``/``up_proj`` packed).
    ``reduce_results=False``: each tensor-parallel rank returns its share of the output (see
    :class:`~nanovllm.layers.linear.RowParallelLinear`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
