"""Host arrays to the GPU through pinned buffers that are reused from step to step.

A copy from pageable memory cannot run asynchronously, so each host array of a step goes through pinned
memory. Pinning afresh (``tensor.pin_memory()``) is cheap only while PyTorch's caching host allocator has a
free block; while the GPU still reads the blocks of the steps before (the host runs ahead of it), the
allocator pins new memory, which takes milliseconds. Here a step's arrays are packed one after another into
one of a few buffers kept for the engine's life; a buffer is written again only once an event says the
copies out of it have run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

ALIGN = 64  # bytes between one array's start and the next


class PinnedStaging:
    """``upload(array)`` -> the array on ``device``, without waiting for the GPU. Inside :meth:`step` the
    array goes through the step's pinned buffer; outside a step (set-up) it is pinned on its own. ``depth``
    buffers take turns, one a step; each grows to the largest step it has carried (``initial_bytes`` at
    first)."""

    def __init__(self, device: torch.device, depth: int = 3, initial_bytes: int = 1 << 20) -> None:
        self.device = device
        self.buffers = [torch.empty(initial_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
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
        source = torch.from_numpy(array)
        if not self.in_step:
            return source.pin_memory().to(self.device, non_blocking=True)
        start = -(-self.used // ALIGN) * ALIGN
        end = start + array.nbytes
        buffer = self.buffers[self.current]
        if end > buffer.numel():  # a larger buffer; the old one lives until this step's copies have run
            self.outgrown[self.current].append(buffer)
            buffer = torch.empty(max(2 * buffer.numel(), end), dtype=torch.uint8, pin_memory=True)
            self.buffers[self.current] = buffer
            start, end = 0, array.nbytes
        self.used = end
        staged = buffer[start:end].view(source.dtype).view(source.shape).copy_(source)
        return staged.to(self.device, non_blocking=True)
