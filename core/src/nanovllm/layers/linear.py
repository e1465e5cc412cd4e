"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that takes a checkpoint
tensor (or one shard of a packed projection) and copies this rank's slice into place. The tensor may be a
lazy one (:class:`nanovllm.engine.loader.LazyTensor`): a loader indexes only its rank's rows or columns, so
each rank reads only its shard from the file. Both a tensor and a lazy tensor have ``shape`` and ``[index]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size
from nanovllm.layers import gemv


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by tensor_parallel_size {b}")
    return a // b


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded[...])


def shard(loaded: torch.Tensor, dim: int, full_size: int, start: int, size: int) -> torch.Tensor:
    """Elements ``start:start + size`` of ``loaded`` along ``dim`` (read only there if it is lazy), after
    checking that the checkpoint's ``dim`` has the model's ``full_size``."""
    if loaded.shape[dim] != full_size:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} has size {loaded.shape[dim]} along dim {dim} "
            f"where the model expects {full_size}: the checkpoint does not match its config.json"
        )
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


class LinearBase(nn.Module):
    # small batches through the Triton GEMV (engine option enable_triton_gemv: gemv.route_small_batches)
    use_triton_gemv = False

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and param.dim() > self.tp_dim:
            size = param.shape[self.tp_dim]
            loaded = shard(loaded, self.tp_dim, size * self.tp_size, self.tp_rank * size, size)
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return (gemv.linear if self.use_triton_gemv else F.linear)(x, self.weight, bias)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``; ``out``: a tensor of the result's shape to write it into (cuBLAS's own
        kernel, the same bits)."""
        if out is None:
            return self.matmul(x, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, tp_size()), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matrix (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        part = shard(loaded, 0, self.output_sizes[shard_id], self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matrix; KV heads split across ranks like query heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = _divide(num_kv_heads, tp)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        part = shard(loaded, 0, size * self.tp_size, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed with an all-reduce.
    ``reduce_results=False``: each rank returns its share, for a layer that sums it itself (the RMSNorm
    that follows, ``RMSNorm(..., partial=True)``, fuses the all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__(_divide(in_features, tp_size()), out_features, bias, 1)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self.matmul(x, bias)
        return all_reduce(out) if self.reduce_results else out
