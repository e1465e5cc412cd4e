"""Whether a layer runs its fused Triton kernel (CUDA tensors, Triton installed) or its torch code."""

from __future__ import annotations

import functools
from importlib.util import find_spec
from types import ModuleType

import torch

HAS_TRITON = find_spec("triton") is not None


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


@functools.cache
def kernels() -> ModuleType:
    """:mod:`nanovllm.layers.fused_kernels`, imported on first use (it imports Triton)."""
    from nanovllm.layers import fused_kernels

    return fused_kernels
