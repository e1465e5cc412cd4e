"""Decode steps in CUDA graphs: one graph per batch-size bucket, captured once at start-up, replayed for
every decode-only step that fits the largest bucket.

With tensor parallelism every rank captures or none does (they agree first), and each rank has
``NANOVLLM_CAPTURE_TIMEOUT`` seconds (default 300) from a common start to capture; rank 0 raises
:class:`CaptureTimeout` when one is late, and the engine starts its ranks again without graphs."""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, aligned_rows, forward_context
from nanovllm.config import ResolvedConfig
from nanovllm.distributed import (
    agree_min,
    barrier,
    barrier_within,
    capture_problem,
    release_before_destroy,
    tp_rank,
    tp_size,
)
from nanovllm.kv.offload import GraphUnsafe
from nanovllm.kv.store import KVStore
from nanovllm.layers import weight_prefetch

CAPTURE_TIMEOUT_VARIABLE = "NANOVLLM_CAPTURE_TIMEOUT"
DEFAULT_CAPTURE_TIMEOUT = 300.0
MAX_GRAPH_BATCH = 512  # the largest bucket, when max_num_seqs is larger


class CaptureTimeout(RuntimeError):
    """A tensor-parallel rank did not capture its decode graphs in time (rank 0 raises it)."""


def capture_timeout() -> float:
    """The seconds of ``NANOVLLM_CAPTURE_TIMEOUT`` (default ``DEFAULT_CAPTURE_TIMEOUT``)."""
    raw = os.environ.get(CAPTURE_TIMEOUT_VARIABLE, "")
    try:
        seconds = float(raw) if raw else DEFAULT_CAPTURE_TIMEOUT
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{CAPTURE_TIMEOUT_VARIABLE}={raw!r} must be a number of seconds above 0 (the time "
                         "each tensor-parallel rank has to capture its decode CUDA graphs); unset it for "
                         f"{DEFAULT_CAPTURE_TIMEOUT:.0f}")
    return seconds


def every_rank_captures(this_rank_can: bool) -> bool:
    """Every tensor-parallel rank captures decode graphs, or none does: a rank that captured alone would
    wait forever in its warm-up collectives (a rank's backend, policy or environment may differ)."""
    every_rank_can = agree_min(int(this_rank_can)) == 1
    if this_rank_can and not every_rank_can:
        warnings.warn(f"tensor-parallel rank {tp_rank()} decodes eagerly (no CUDA graphs): another rank "
                      "cannot capture its decode graphs", RuntimeWarning, stacklevel=3)
    return every_rank_can


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector run once, then paused until the block ends."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CudaGraphRunner:
    """The decode graphs of one model runner and their static input and output buffers. ``graphs`` is empty
    when the engine decodes eagerly (``enforce_eager``, the CPU, a backend or policy that is not graph-safe,
    or a KV store that cannot capture)."""

    def __init__(self, model: torch.nn.Module, config: ResolvedConfig, kv_store: KVStore, backend: Any,
                 hooks: Any) -> None:
        self.model, self.config, self.kv_store = model, config, kv_store
        self.backend, self.hooks = backend, hooks
        self.device = torch.device(config.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        max_bs = min(config.max_num_seqs, MAX_GRAPH_BATCH)
        self.sizes = sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})
        self.max_batch = self.sizes[-1]

    def usable(self) -> bool:
        """This rank can capture; warns when only the environment (``capture_problem``) prevents it."""
        usable = (
            self.device.type == "cuda"
            and self.kv_store.can_capture_decode(self.hooks.decode.requires_block_selection)
            and not self.config.enforce_eager
            and self.backend.supports_cuda_graphs
            and self.hooks.cuda_graph_safe_on(self.kv_store)
        )
        problem = capture_problem() if usable else None
        if problem is not None:
            warnings.warn(f"{problem}: the engine decodes eagerly (no CUDA graphs); pass enforce_eager=True "
                          "to say so and silence this", RuntimeWarning, stacklevel=2)
        return usable and problem is None

    def capture_if_usable(self) -> None:
        """Capture on every rank, or on none."""
        if every_rank_captures(self.usable()):
            self.capture_on_every_rank()

    def capture_on_every_rank(self) -> None:
        """Capture the decode graphs; with tensor parallelism every rank has ``capture_timeout()`` seconds
        from a common start after the warm-ups. Rank 0 then waits for the others only until that time is up
        (at least a second) and raises :class:`CaptureTimeout` if one is late. A capture that hangs cannot be
        interrupted in its own process: past the time, each rank still in it warns, so that a hang says
        where it is."""
        try:
            with self.kv_store.capturing():
                self._prepare()
        except GraphUnsafe:  # a decode step that still reads densely from the host somewhere: stay eager
            return
        if tp_size() == 1:
            self._capture()
            return
        timeout = capture_timeout()
        barrier()  # every rank ran its warm-up collectives: from here each one captures on its own
        start = time.monotonic()
        still_capturing = threading.Timer(timeout, warnings.warn, args=(
            f"tensor-parallel rank {tp_rank()} has not captured its decode CUDA graphs in {timeout:.0f} s "
            f"({CAPTURE_TIMEOUT_VARIABLE}); if it never does, stop the program and start the engine with "
            "enforce_eager=True", RuntimeWarning))
        still_capturing.daemon = True
        still_capturing.start()
        try:
            self._capture()
        finally:
            still_capturing.cancel()
        try:
            barrier_within(max(timeout - (time.monotonic() - start), 1.0))
        except RuntimeError as exc:
            raise CaptureTimeout(
                f"not every tensor-parallel rank captured its decode CUDA graphs within {timeout:.0f} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    @torch.inference_mode()
    def _prepare(self) -> None:
        """The static input and output buffers, and a warm-up of each bucket outside any graph: Triton
        compiles here, and with tensor parallelism the collectives run here, so that capturing needs no
        other rank (a rank that hangs in its capture cannot hold up the others)."""
        max_bs, dev = self.max_batch, self.device
        max_blocks = -(-self.config.max_model_len // self.config.block_size)
        self.inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "context_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        # every KV cache group's slots, and every group's block tables, in one buffer each (group g's part
        # [g], aligned as a step's transfer is): a step fills each with one copy
        groups = len(self.kv_store.groups)
        self.group_slots = torch.full((groups, aligned_rows(max_bs, 8)), -1, dtype=torch.long, device=dev)
        self.group_tables = torch.zeros(groups, aligned_rows(max_bs, 4 * max_blocks), max_blocks,
                                        dtype=torch.int32, device=dev)
        self.filled = (0, 0)  # the rows and table width the last step wrote; past them: padding values
        for bs in self.sizes:
            self.kv_store.begin_step(None, None)  # a decode step (its dense reads raise GraphUnsafe here)
            with forward_context(self._metadata(bs)):
                warm = self.model(self.inputs["input_ids"][:bs], self.inputs["positions"][:bs])
        self.output = torch.empty(max_bs, *warm.shape[1:], dtype=warm.dtype, device=dev)

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per batch-size bucket, sharing a memory pool and the static buffers. Python's cycle
        collector runs once first and is paused while capturing: an engine dropped earlier (its runner and
        graphs are reference cycles) finalized inside a capture resets its CUDA graphs there, which a
        capture forbids, and the capture fails."""
        if tp_size() > 1:  # the graphs hold the NCCL communicator: they must go before it does
            release_before_destroy(self.release)
        pool = None
        # the prefetch: the graphs read each next matmul's weights into L2
        with collector_paused(), weight_prefetch.capturing(self.device):
            for bs in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                ids, pos = self.inputs["input_ids"][:bs], self.inputs["positions"][:bs]
                with forward_context(self._metadata(bs)), torch.cuda.graph(graph, pool):
                    self.kv_store.begin_capture()
                    self.output[:bs] = self.model(ids, pos)
                    self.kv_store.end_capture()
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Drop the decode graphs (the engine steps eagerly afterwards)."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def _metadata(self, bs: int) -> StepMetadata:
        g = self.inputs
        decode = [PhaseMetadata(g["cu_seqlens_q"][: bs + 1], g["context_lens"][:bs], tables[:bs], 1,
                                self.config.max_model_len) for tables in self.group_tables]
        first, *later = (StepMetadata(slots[:bs], g["positions"][:bs], bs, phase, None)
                         for slots, phase in zip(self.group_slots, decode, strict=True))
        return attrs.evolve(first, other_groups=tuple(later))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
               slots: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The hidden states of a decode-only step of at most ``max_batch`` sequences (``slots``: every KV
        cache group's ``[groups, bs]``, ``tables`` their block tables ``[groups, bs, width]``), its inputs
        copied into the smallest bucket that holds them. The padding rows write nothing (slot -1) and attend
        to one token (block 0): rows and table entries that the last step wrote and this one does not go back
        to that first, so a step of the last one's batch, its tables no narrower, copies each input once."""
        bs, width = input_ids.shape[0], tables.shape[-1]
        graph_bs = next(b for b in self.sizes if b >= bs)
        g = self.inputs
        rows, filled_width = self.filled
        if bs < rows:
            g["context_lens"][bs:rows].fill_(1)
            self.group_slots[:, bs:rows].fill_(-1)
        if bs < rows or width < filled_width:
            self.group_tables[:, :rows, :filled_width].zero_()
        self.filled = (bs, width)
        g["input_ids"][:bs] = input_ids
        g["positions"][:bs] = positions
        g["context_lens"][:bs] = context_lens
        self.group_slots[:, :bs] = slots
        self.group_tables[:, :bs, :width] = tables
        self.kv_store.order_streams()
        self.graphs[graph_bs].replay()
        self.kv_store.order_streams()
        return self.output[:bs]
