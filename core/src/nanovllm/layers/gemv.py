"""The small-batch matmul path of the linear layers (engine option ``enable_triton_gemv``).

A decode step multiplies a few rows of activations by every weight of the model, so its matmuls are bound
by reading the weights from HBM. cuBLAS picks split-K GEMMs there that reach about three quarters of the
bandwidth; :mod:`nanovllm.layers.gemv_kernels` streams the weights instead. :func:`linear` is
``F.linear`` with that kernel for CUDA inputs of at most :data:`MAX_ROWS` rows, each shape run with its
entry of :data:`TUNED` (measured by ``benchmarks/gemv_sweep.py``; an entry may keep cuBLAS for a shape) or
else :func:`default_config`; :func:`gated_linear` applies a gated MLP's activation in the same
launch. It allocates only its output (and, with split-K, a float32 workspace) from the current stream's
pool and never synchronises, so the decode CUDA graphs capture it. Imports no Triton until a CUDA input
comes.
"""

from __future__ import annotations

import functools
from types import ModuleType

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.fused import use_fused

MAX_ROWS = 16  # rows of x up to which linear() runs the kernel; larger batches read weights fast in cuBLAS


def _power_of_two(_inst, attr, value) -> None:
    if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
        raise ValueError(f"GemvConfig.{attr.name} must be a power of two, got {value!r}")


def _positive(_inst, attr, value) -> None:
    if not (isinstance(value, int) and value > 0):
        raise ValueError(f"GemvConfig.{attr.name} must be a positive int, got {value!r}")


@attrs.frozen
class GemvConfig:
    """One launch's knobs: output features per program (``block_n``), elements of K per load
    (``block_k``), programs per output slab that share K (``split_k``, >1 adds a reduce kernel), tensor
    cores (``dot``: x's rows padded to 16) or registers, and Triton's ``num_warps`` and ``num_stages``."""

    block_n: int = attrs.field(validator=_power_of_two)
    block_k: int = attrs.field(validator=_power_of_two)
    split_k: int = attrs.field(default=1, validator=_positive)
    dot: bool = False
    num_warps: int = attrs.field(default=4, validator=_power_of_two)
    num_stages: int = attrs.field(default=3, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"{self}: dot=True needs block_n and block_k of at least 16 (tl.dot's smallest "
                             "tile); use dot=False for narrower blocks")

    def knobs(self) -> dict[str, int | bool]:
        return attrs.asdict(self)


def row_bucket(rows: int) -> int:
    """The power of two at or above ``rows``: configurations are per bucket of rows (1, 2, 4, 8, 16)."""
    return 1 << max(rows - 1, 0).bit_length()


# (N, K, row bucket) -> the fastest configuration measured on the H200 by benchmarks/gemv_sweep.py (the
# tuned_table.py it writes), or None where cuBLAS measured faster (linear() runs F.linear there); shapes not
# listed get default_config
_cfg = GemvConfig  # short, for the table's lines
TUNED: dict[tuple[int, int, int], GemvConfig | None] = {
    # qwen3-8b TP 1 qkv
    (6144, 4096, 1): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (6144, 4096, 2): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (6144, 4096, 4): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (6144, 4096, 8): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    # qwen3-8b TP 1 o
    (4096, 4096, 1): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (4096, 4096, 2): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (4096, 4096, 4): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (4096, 4096, 8): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    # qwen3-8b TP 1 gate_up
    (24576, 4096, 1): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (24576, 4096, 2): None,
    (24576, 4096, 4): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
    (24576, 4096, 8): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
    # qwen3-8b TP 1 down
    (4096, 12288, 1): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (4096, 12288, 2): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (4096, 12288, 4): _cfg(block_n=64, block_k=128, split_k=4, dot=True, num_warps=4, num_stages=4),
    (4096, 12288, 8): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    # qwen3-8b TP 1 lm_head
    (151936, 4096, 1): _cfg(block_n=32, block_k=256, split_k=1, dot=True, num_warps=4, num_stages=4),
    (151936, 4096, 2): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (151936, 4096, 4): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (151936, 4096, 8): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
    # qwen3-8b TP 2 qkv
    (3072, 4096, 1): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (3072, 4096, 2): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (3072, 4096, 4): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (3072, 4096, 8): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    # qwen3-8b TP 2 o
    (4096, 2048, 1): _cfg(block_n=4, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=1),
    (4096, 2048, 2): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (4096, 2048, 4): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (4096, 2048, 8): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    # qwen3-8b TP 2 gate_up
    (12288, 4096, 1): _cfg(block_n=32, block_k=256, split_k=1, dot=True, num_warps=4, num_stages=4),
    (12288, 4096, 2): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (12288, 4096, 4): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
    (12288, 4096, 8): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
    # qwen3-8b TP 2 down
    (4096, 6144, 1): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (4096, 6144, 2): _cfg(block_n=8, block_k=512, split_k=1, dot=False, num_warps=4, num_stages=3),
    (4096, 6144, 4): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (4096, 6144, 8): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    # qwen3-8b TP 2 lm_head
    (75968, 4096, 1): _cfg(block_n=32, block_k=256, split_k=1, dot=True, num_warps=4, num_stages=4),
    (75968, 4096, 2): _cfg(block_n=32, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=6),
    (75968, 4096, 4): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
    (75968, 4096, 8): _cfg(block_n=64, block_k=128, split_k=1, dot=True, num_warps=4, num_stages=4),
}
del _cfg


@functools.cache
def default_config(n: int, k: int, rows: int, sms: int) -> GemvConfig:
    """A configuration for ``[rows, k] @ [n, k].T`` on a device of ``sms`` multiprocessors, untuned: one row
    in registers, more on the tensor cores; slabs narrow enough for about two programs a multiprocessor,
    and split-K (its extra launch costs about as much as a small matmul's tail) only where even the
    narrowest slabs leave multiprocessors idle."""
    if rows <= 2:
        block_n, block_k, dot = 8, 512 // rows, False
    else:
        block_n, block_k, dot = 16, 256, True
    k_tile = min(block_k, max(16, 1 << (k - 1).bit_length()))
    split_k = 1
    while -(-n // block_n) * split_k < sms and k // (2 * split_k) >= 4 * k_tile:
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=k_tile, split_k=split_k, dot=dot, num_warps=4, num_stages=3)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_for(n: int, k: int, rows: int, device: torch.device) -> GemvConfig:
    sms = _multiprocessors(device) if device.type == "cuda" else 132
    return default_config(n, k, row_bucket(rows), sms)


def config_for(n: int, k: int, rows: int, device: torch.device) -> GemvConfig | None:
    """The :data:`TUNED` entry of the shape (None: cuBLAS is faster there), else :func:`default_config` for
    ``device``."""
    key = (n, k, row_bucket(rows))
    return TUNED[key] if key in TUNED else _default_for(n, k, rows, device)


@functools.cache
def _kernels() -> ModuleType:
    """:mod:`nanovllm.layers.gemv_kernels`, imported on first use (it imports Triton)."""
    from nanovllm.layers import gemv_kernels

    return gemv_kernels


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` summed in float32 and rounded once to ``out_dtype`` (default ``x``'s
    dtype): the kernel's oracle."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype or x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, activation: str | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through the Triton kernel, for ``x [M, K]`` (``1 <= M <= MAX_ROWS``, unit
    stride along K) and contiguous ``weight [N, K]`` and ``bias [N]`` of ``x``'s dtype, on CUDA (or on the
    CPU under ``TRITON_INTERPRET=1``); ``config`` defaults to :func:`config_for` the shape (its default
    where the table keeps cuBLAS). The float32 sums are rounded once to ``out_dtype`` (default ``x``'s
    dtype). ``activation`` (``"silu"`` or ``"gelu_tanh"``): ``weight`` stacks a gated MLP's gate rows over its
    up rows, and the result is ``act(gate) * up`` ``[M, N / 2]``, rounded as the activation's own kernel
    rounds the plain result, ``config.block_n`` of its features a program."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv multiplies x [M, K] by weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows of x, got {x.shape[0]}: use F.linear for more")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gemv needs x with unit stride along K and a contiguous weight")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"gemv needs x, weight and bias of one dtype; got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if activation is not None and activation not in _kernels().GATED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: the kernel applies "
                         f"{', '.join(_kernels().GATED_ACTIVATIONS)}")
    if activation is not None and weight.shape[0] % 2:
        raise ValueError(f"activation {activation!r} needs a weight of gate rows over as many up rows; got "
                         f"{weight.shape[0]} rows")
    if config is None:
        config = config_for(weight.shape[0], x.shape[1], x.shape[0], x.device)
    if config is None:
        config = _default_for(weight.shape[0], x.shape[1], x.shape[0], x.device)
    return _kernels().gemv(x, weight, None if bias is None else bias.contiguous(), activation=activation,
                           out_dtype=out_dtype, **config.knobs())


def _routed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """The configuration :func:`linear` runs the kernel with, or None where it keeps ``F.linear``."""
    if (
        use_fused(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1
        and weight.dtype == x.dtype and weight.is_contiguous() and (bias is None or bias.dtype == x.dtype)
    ):
        return config_for(weight.shape[0], x.shape[1], x.shape[0], x.device)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`matmul`, through :func:`gemv` where it applies: a CUDA matrix ``x`` of 1 to :data:`MAX_ROWS`
    rows, unit stride along K, a contiguous weight, one dtype throughout, and a shape that :data:`TUNED`
    does not keep on cuBLAS."""
    config = _routed(x, weight, bias)
    return matmul(x, weight, bias, out_dtype) if config is None else gemv(x, weight, bias, config,
                                                                           out_dtype=out_dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in ``out_dtype`` (default ``x``'s dtype). On CUDA, 16-bit inputs with a
    float32 ``out_dtype`` and no bias are summed into float32 without rounding to 16 bits first (cuBLAS
    through ``torch.mm(..., out_dtype=)``); elsewhere the result is rounded to ``x``'s dtype, then cast."""
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.is_cuda and bias is None and out_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
        y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias).to(out_dtype)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
                 ) -> torch.Tensor | None:
    """``act(gate) * up`` of ``linear(x, weight, bias)`` (``activation``: ``"silu"`` or ``"gelu_tanh"``) for a
    weight that stacks gate rows over as many up rows, in one launch where :func:`linear` would run the
    kernel (with the whole matrix's configuration, each program reading as many rows of it: half of them
    gate rows); None where it would not (the caller applies the activation to ``linear``'s output)."""
    config = _routed(x, weight, bias)
    if config is None or weight.shape[0] % 2:
        return None
    config = attrs.evolve(config, block_n=max(config.block_n // 2, 16 if config.dot else 1))
    return gemv(x, weight, bias, config, activation=activation)


def route_small_batches(model: nn.Module) -> int:
    """Send the small-batch matmuls of every layer of ``model`` that has the path (``use_triton_gemv``:
    the linear layers and the LM head) through :func:`linear`; returns how many layers switched."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "use_triton_gemv"):
            module.use_triton_gemv = True
            switched += 1
    return switched


__all__ = ["MAX_ROWS", "TUNED", "GemvConfig", "config_for", "default_config", "gemv", "gemv_reference",
           "linear", "matmul", "route_small_batches", "row_bucket", "gated_linear"]
