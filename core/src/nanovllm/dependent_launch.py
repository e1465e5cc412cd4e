"""Programmatic dependent launch for the small Triton kernels of a decode step.

Between two kernels of a stream the GPU lets the first one finish before it launches the second. A batch-1
decode step runs about three hundred kernels of a few microseconds each, so those launch gaps add up. On
Hopper and later, Triton's ``launch_pdl`` lets a kernel launch as the blocks of the one before it exit,
before that kernel has completed as a whole. Each of ours then waits for it at its first instruction
(``gdc_wait``: its writes are visible after), so the order of memory accesses stays as without it, and only
the launch latency is hidden. None of ours lets the next kernel launch earlier
(``gdc_launch_dependents``): the early blocks of an HBM-bound kernel crowd the multiprocessors that free up
first. After a torch or cuBLAS kernel ours may launch early too, and the wait keeps the order. Only kernels
over at most :data:`~nanovllm.kernel_sizes.CHAINED_LAUNCH_MAX_ROWS` rows (a step's tokens) chain: a larger
step's kernels run long enough that their launch gaps matter little, and there chaining was measured
slower. ``NANOVLLM_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from nanovllm.kernel_sizes import CHAINED_LAUNCH_MAX_ROWS

VARIABLE = "NANOVLLM_PDL"


@functools.cache
def _enabled(device: torch.device) -> bool:
    return os.environ.get(VARIABLE, "1") != "0" and torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(like: torch.Tensor) -> dict[str, bool]:
    """The launch keywords that chain a kernel to the one before it, for a kernel over ``like`` (its first
    dimension: the step's tokens or rows): the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``. Empty
    on the CPU (the interpreter), before Hopper, over more than ``CHAINED_LAUNCH_MAX_ROWS`` rows, and with
    ``NANOVLLM_PDL=0``."""
    if not like.is_cuda or like.shape[0] > CHAINED_LAUNCH_MAX_ROWS:
        return {}
    return {"PDL": True, "launch_pdl": True} if _enabled(like.device) else {}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A chained kernel's first step: wait until the kernel before it has finished and its writes are
    visible. Nothing without ``PDL``."""
    if PDL:
        gdc_wait()


__all__ = ["VARIABLE", "launch_options", "wait_for_previous"]
