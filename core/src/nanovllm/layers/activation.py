from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import gemv
from nanovllm.layers.fused import kernels, use_fused
from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear


class GatedActivation(nn.Module):
    """An activation of the gate half of the last dimension times the up half."""

    gemv_activation: str  # its name for the small-batch matmul kernel (nanovllm.layers.gemv.gated_linear)

    def of_projection(self, proj: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``self(proj(x))`` for the projection ``proj`` whose output halves are gate and up. Where the
        projection's small batches run the Triton GEMV, its kernel applies the activation to what it computes
        (one launch, the same bits as the two)."""
        if proj.use_triton_gemv:
            out = gemv.gated_linear(x, proj.weight, proj.bias, self.gemv_activation)
            if out is not None:
                return out
        return self(proj(x))


class SiluAndMul(GatedActivation):
    """``silu(gate) * up`` for the gate/up halves of the last dimension."""

    gemv_activation = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return kernels().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(GatedActivation):
    """``gelu(gate, approximate="tanh") * up`` for the gate/up halves of the last dimension (Gemma)."""

    gemv_activation = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return kernels().gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# Hugging Face activation names (``hidden_act`` / ``hidden_activation``) -> the gated form
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu_tanh": GeluTanhAndMul}


class GatedMLP(nn.Module):
    """The gated feed-forward block (``gate_proj``/``up_proj`` packed): SwiGLU for Llama-family models,
    ``activation`` any name of :data:`GATED_ACTIVATIONS`. ``reduce_results=False``: each tensor-parallel
    rank returns its share of the output (see :class:`~nanovllm.layers.linear.RowParallelLinear`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce_results: bool = True, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported in a gated MLP (supported: "
                             f"{', '.join(GATED_ACTIVATIONS)})")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           reduce_results=reduce_results)
        self.act_fn = GATED_ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn.of_projection(self.gate_up_proj, x))
