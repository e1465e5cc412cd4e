"""Weights read into L2 while HBM idles. At small decode batches a matmul reads its weights well below HBM's
rate, and the kernels before it (an all-reduce, attention, a norm) read little. So the decoder asks for the
next matmul's weights before those kernels: a Triton kernel on a side stream reads the first part into L2
(evict-last) while they run, and the matmul then finds it there. No value changes.

Only in the decode CUDA graphs the runner captures inside :func:`capturing`: a graph replays the prefetches
at no host cost, where eagerly they would add three Triton launches a layer to steps that are already bound
by the host's launches. The side stream joins the main one at the end of the model's forward, inside the
graph. ``NANOVLLM_WEIGHT_PREFETCH=0`` turns it off."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from nanovllm.layers.fused import HAS_TRITON, kernels

VARIABLE = "NANOVLLM_WEIGHT_PREFETCH"
MAX_TOKENS = 32  # decode steps of up to this many tokens prefetch; larger ones leave HBM little idle time
MAX_BYTES = 8 << 20  # per matmul: smaller and larger prefetches gained less, or lost
_SINK_ELEMENTS = MAX_BYTES // (16 << 10)


@functools.cache
def enabled() -> bool:
    return os.environ.get(VARIABLE, "1") != "0"


class _SideStream:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.empty(_SINK_ELEMENTS, dtype=torch.int32, device=device)
        self.forked = False


_side_streams: dict[torch.device, _SideStream] = {}  # kept: the graphs write their sinks at every replay
_side: _SideStream | None = None  # while capturing


@contextlib.contextmanager
def capturing(device: torch.device) -> Iterator[None]:
    """Prefetch in the forward passes run inside (the runner's decode-graph captures), on ``device``."""
    global _side
    if not (enabled() and HAS_TRITON and device.type == "cuda"):
        yield
        return
    if device not in _side_streams:  # outside any graph: the sink must not come from a graph's memory pool
        _side_streams[device] = _SideStream(device)
        kernels().l2_prefetch(_side_streams[device].sink, 64, _side_streams[device].sink)  # compile it now
    _side = _side_streams[device]
    try:
        yield
    finally:
        _side = None


def prefetch(weight: torch.Tensor, x: torch.Tensor) -> None:
    """Start reading the first half of ``weight`` (at most :data:`MAX_BYTES`) into L2 when capturing and
    ``x`` (the activations about to run through the kernels before its matmul) is a small batch."""
    side = _side
    if side is None or x.shape[0] > MAX_TOKENS:
        return
    side.stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side.stream):
        kernels().l2_prefetch(weight, min(weight.numel() * weight.element_size() // 2, MAX_BYTES), side.sink)
    side.forked = True


def join(x: torch.Tensor) -> None:
    """Make the current stream wait for the prefetches started since the last join (a CUDA graph capture
    must end with every stream it forked joined)."""
    side = _side
    if side is not None and side.forked:
        torch.cuda.current_stream(x.device).wait_stream(side.stream)
        side.forked = False
