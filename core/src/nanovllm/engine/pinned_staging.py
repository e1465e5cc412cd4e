"""Host arrays to the GPU through pinned buffers that are reused from step to step.

A copy from pageable memory cannot run asynchronously, so each host array of a step goes through pinned
memory. Pinning afresh (``tensor.pin_memory()``) is cheap only while PyTorch's caching host allocator has a
free block; while the GPU still reads the blocks of the steps before (the host runs ahead of it), the
allocator pins new memory, which takes milliseconds. Here a step's arrays are packed one after another into
one of a few buffers kept for the engine's life; a buffer is written again only once an event says the
copies out of it have run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache

import numpy as np
import torch

ALIGN = 64  # bytes between one array's start and the next


class PinnedStaging:
    """``upload(array)`` -> the array on ``device``, without waiting for the GPU (``upload_many``: several in
    one transfer). Inside :meth:`step` the arrays go through the step's pinned buffer; outside a step
    (set-up) each is pinned on its own. ``depth`` buffers take turns, one a step; each grows to the largest
    step it has carried (``initial_bytes`` at first)."""

    def __init__(self, device: torch.device, depth: int = 3, initial_bytes: int = 1 << 20) -> None:
        self.device = device
        self.buffers = [torch.empty(initial_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.host_views = [buffer.numpy() for buffer in self.buffers]  # numpy writes cost a fraction of torch's
        self.copied: list[torch.cuda.Event | None] = [None] * depth  # recorded after each buffer's last copy
        self.outgrown: list[list[torch.Tensor]] = [[] for _ in range(depth)]  # kept until their copies ran
        self.current = -1
        self.used = 0
        self.in_step = False

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step's uploads share the next buffer, once the copies of its last use have run."""
        self.current = (self.current + 1) % len(self.buffers)
        event = self.copied[self.current]
        if event is not None:
            event.synchronize()
        self.outgrown[self.current].clear()
        self.used, self.in_step = 0, True
        try:
            yield
        finally:
            self.in_step = False
            event = torch.cuda.Event()
            event.record()
            self.copied[self.current] = event

    def upload(self, array: np.ndarray) -> torch.Tensor:
        return self.upload_many([array])[0]

    def upload_many(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The arrays on ``device`` from one transfer: packed into the step's buffer, each ``ALIGN`` bytes
        aligned, copied as one span, and returned as views of it (a copy costs about a microsecond of the
        GPU's stream and several of the host's, whatever its size)."""
        if not self.in_step:
            return [torch.from_numpy(np.ascontiguousarray(a)).pin_memory().to(self.device, non_blocking=True)
                    for a in arrays]
        offsets, size = [], 0
        for a in arrays:
            offsets.append(-(-size // ALIGN) * ALIGN)
            size = offsets[-1] + a.nbytes
        base = -(-self.used // ALIGN) * ALIGN
        buffer = self.buffers[self.current]
        if base + size > buffer.numel():  # a larger buffer; the old one lives until this step's copies ran
            self.outgrown[self.current].append(buffer)
            buffer = torch.empty(max(2 * buffer.numel(), size), dtype=torch.uint8, pin_memory=True)
            self.buffers[self.current] = buffer
            self.host_views[self.current] = buffer.numpy()
            base = 0
        self.used = base + size
        host = self.host_views[self.current]
        for a, offset in zip(arrays, offsets, strict=True):
            start = base + offset
            host[start:start + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        span = buffer[base:base + size].to(self.device, non_blocking=True)
        out = []
        for a, offset in zip(arrays, offsets, strict=True):
            flat = span[offset:offset + a.nbytes].view(_torch_dtype(a.dtype))
            out.append(flat if a.ndim == 1 else flat.view(a.shape))
        return out


@cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of numpy's ``dtype``."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
