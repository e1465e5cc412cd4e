"""Host-side sizes of kernel launches (grids, padded block widths) in plain Python.

Recent Triton versions make ``triton.cdiv`` and ``triton.next_power_of_2`` constexpr functions: called on the
host, each goes through Triton's wrapper, and every launch wrapper sizes its grid and blocks with them. These
give the same results in plain integer arithmetic. Inside a ``@triton.jit`` function use ``tl.cdiv`` as
before."""

from __future__ import annotations


CHAINED_LAUNCH_MAX_ROWS = 32  # kernels over at most this many rows launch chained (nanovllm.dependent_launch)


def cdiv(x: int, y: int) -> int:
    """``x / y`` rounded up, for ``y > 0``."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n``; 0 for ``n <= 0`` (as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


__all__ = ["CHAINED_LAUNCH_MAX_ROWS", "cdiv", "next_power_of_2"]
