"""The KV offload engine behind :class:`nanovllm.kv.HostKVStore`: the only code that moves KV between the
host pool and the GPU.

**Pool.** The KV of every offloaded layer (all but the policies' dense layers, which the model runner keeps
resident on the GPU) lives in one pinned host tensor ``[layers, blocks + 1, kv_heads, 2, block_size,
head_dim]``: the K and V of one KV head of one block (a "head block") are one contiguous piece, and a
run of consecutive blocks is one contiguous range. The last block is scratch: writes and loads that must
go nowhere go there, which keeps every index computation on the device without a host sync.

**Copies.** A contiguous run of at least ``MIN_COPY_BYTES`` is one DMA copy (the copy engines, no
multiprocessor time). Anything scattered (per-head selections, fragmented blocks) is one gather kernel
that reads the pinned memory directly through a device view of it: far faster than many small copies, but
it occupies multiprocessors while it waits.

**Slots.** A ring of GPU load slots, each holding up to ``capacity`` head blocks of K and of V. A layer's
reads are cut into pieces that fit a slot. Loads run on their own stream and wait only for the slot to be
free ("compute done") and for earlier steps' writes to the pool ("offload done"); attention waits for
"slot ready". The host enqueues layer after layer without waiting, so the loads of piece i+1, and of the
next layer, run while piece i is attended to. New K/V go to the pool on a third stream, so both PCIe
directions run at once. A loaded slot is patched with the step's new K/V of its blocks, so it holds exactly
what the paged GPU cache would.

**Selections** made on the device (``attend_selected``) become pieces on the device, without a host sync:
one ``selected_piece`` kernel per piece (the head blocks to load, the piece's selection and lengths, the
new tokens' slot rows) and one ``patch_slot`` kernel to write the new K/V in; a selection that fits a slot
is one piece. Both are Triton kernels on CUDA (:mod:`nanovllm.kv.offload_kernels`) with their torch
references here, which the CPU runs.

**The selection cache.** Consecutive decode steps select mostly the same blocks. When every offloaded layer's selection of every sequence of
a decode step fits the slots' memory, that memory becomes one cache region per layer instead of the ring.
Each (sequence, KV head) keeps the head blocks it loaded, keyed by pool id, and a step loads only the
selected head blocks its region lacks (``cached_piece``, then ``load_misses``).
- A full block's pool content changes only when the block is handed out again, which invalidates it
  (:meth:`OffloadEngine.forget_blocks`).
- The block being written (a sequence's newest) is loaded every step and never kept.
- Any use of the ring (a prefill, a dense read) overwrites the regions, so it empties the cache for the
  rest of the step.
- What each flat head block holds is one fixed tensor (``_held``, ids over every layer's pool), so a layout
  for another ``k`` and the decode graphs captured with the first one never disagree about it.
Attention reads the same keys in the same order either way, so the results are bit-identical to the ring's.

**Attention over a slot** runs on a virtual batch: each (KV head, sequence) pair is one sequence with a
single KV head and its group of query heads, with its own block table into the slot. Per-KV-head
selections and shared ones take the same path through the backend's ordinary kernels.

**CUDA graphs.** A decode step whose every offloaded read is a selection made on the device has no host
plan, so the model runner captures it like any decode step: inside the capture, the side streams fork from
the capture stream and join it at the end, and no event from outside the graph is waited on; around each
replay the compute stream and the side streams are ordered both ways (:meth:`OffloadEngine.order_streams`).
A dense read met while capturing raises :class:`GraphUnsafe`, and decode stays eager.

On the CPU device the same code runs with host tensors for pool and slots and without streams, so the
tests cover its logic.
"""

from __future__ import annotations

import functools
from importlib.util import find_spec
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from types import ModuleType

import attrs
import numpy as np
import torch

from nanovllm.attention.backend import selection_per_kv_head
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.kv.store import KVTransfer

HAS_TRITON = find_spec("triton") is not None
NUM_SLOTS = 2  # double buffering: one slot loads while the other is attended to
MIN_COPY_BYTES = 2 << 20  # runs at least this long go to the copy engines; shorter ones to the gather kernel


def use_fused(x: torch.Tensor) -> bool:
    """Whether the bookkeeping of a piece runs as a Triton kernel (CUDA tensors, Triton installed); the
    same test as :func:`nanovllm.layers.fused.use_fused`, which this floor may not import."""
    return x.is_cuda and HAS_TRITON


def device_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned host memory: with unified addressing the host pointer is valid on the
    device, so kernels read and write the pool across PCIe without a copy."""
    typestr = {torch.float16: "<f2", torch.bfloat16: "<f2", torch.float32: "<f4"}[host.dtype]

    class _Interface:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": typestr, "data": (host.data_ptr(), False), "version": 3,
            "strides": tuple(s * host.element_size() for s in host.stride()),
        }

    view = torch.as_tensor(_Interface(), device="cuda")
    return view.view(host.dtype) if host.dtype == torch.bfloat16 else view


class GraphUnsafe(RuntimeError):
    """A decode step being captured needs reads planned on the host each step (dense, not selected)."""


@attrs.define
class HostPhase:
    """What the host knows of one phase of a step: block tables and lengths (for the dense plans)."""

    block_tables: Sequence[Sequence[int]]  # a row may run on past its sequence's blocks (padding)
    query_lens: list[int]
    context_lens: list[int]


@attrs.define
class Piece:
    """One slot's worth of a layer's reads, in the virtual batch (row ``h * num_seqs + s``)."""

    ids: torch.Tensor  # [n] head blocks to load into slot rows 0..n-1: block * kv_heads + head (scratch: padding)
    tables: torch.Tensor  # [kv_heads * seqs, w] slot head block of each local block
    selection: torch.Tensor  # [kv_heads * seqs, w] local block indices, -1 padded
    kv_lens: torch.Tensor  # [kv_heads * seqs] tokens of each virtual sequence in the piece
    rows: torch.Tensor | None  # [kv_heads, new tokens] slot row of each new token (scratch row if absent)
    max_keys: int
    on_device: bool  # computed on the compute stream (a selection), not planned on the host
    runs: list[tuple[int, int, int]] | None = None  # (first id, first slot row, length): DMA copies instead
    base: int | None = None  # a cached piece: its layer's region's first flat head block; ids are per position
    # of the region (-1: nothing to load there)


class OffloadEngine:
    def __init__(
        self, layers: Sequence[int], num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device, buffer_bytes: int, max_num_seqs: int,
        reuse_selections: bool = True,
    ) -> None:
        """``layers``: the ids of the layers whose KV lives in the pool, ascending. ``reuse_selections``:
        the selection cache (the slots' memory as per-layer regions when a decode step's selections fit)."""
        self.layers = list(layers)
        self._row = {layer_id: i for i, layer_id in enumerate(self.layers)}  # layer id -> pool row
        # the offloaded layer after each, whose dense plan's first piece an offloaded layer prefetches at its
        # end (resident layers in between are skipped)
        self._following = dict(zip(self.layers, self.layers[1:], strict=False))
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = device
        self.cuda = device.type == "cuda"
        shape = (len(self.layers), num_blocks + 1, num_kv_heads, 2, block_size, head_dim)
        self.pool = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        self._pool = device_view(self.pool) if self.cuda else self.pool  # what kernels address
        self.head_block_bytes = head_block_bytes = 2 * block_size * head_dim * self.pool.element_size()
        # no more head blocks per slot than the pool holds, and enough for one block of every sequence's
        # every head in each piece
        self.capacity = min(int(buffer_bytes // NUM_SLOTS // head_block_bytes), num_blocks * num_kv_heads)
        if self.capacity < num_kv_heads * max_num_seqs:
            need = NUM_SLOTS * num_kv_heads * max_num_seqs * head_block_bytes
            raise ValueError(
                f"kv_offloading_buffer_size is too small: each of the {NUM_SLOTS} load slots must hold one "
                f"block of every KV head of max_num_seqs={max_num_seqs} sequences; raise it to at least "
                f"{need / 2**30:.4f} GiB or lower max_num_seqs"
            )
        self.scratch_id = num_blocks * num_kv_heads  # the pool's scratch block, head 0
        self.scratch_row = self.capacity * block_size  # the slots' scratch head block, first row
        self.slots = torch.empty(NUM_SLOTS, self.capacity + 1, 2, block_size, head_dim, dtype=dtype, device=device)
        self.gpu_bytes = self.slots.numel() * self.slots.element_size()
        self._next_slot = 0
        if self.cuda:
            self.load_stream, self.store_stream = torch.cuda.Stream(), torch.cuda.Stream()
            self._slot_free: list[torch.cuda.Event | None] = [None] * NUM_SLOTS
        # per pool row: earlier steps' writes, this step's
        self._stored: list[torch.cuda.Event | None] = [None] * len(self.layers)
        self._storing: list[torch.cuda.Event | None] = [None] * len(self.layers)
        self._host: dict[bool, HostPhase | None] = {}
        self._plans: dict[bool, list[Piece]] = {}
        # each layer's pool as head blocks [(blocks + 1) * kv_heads, 2, block_size, head_dim], for the gather
        self._pool_head_blocks = [layer.view(-1, 2, block_size, head_dim) for layer in self._pool]
        self._virtual_cu: dict[bool, torch.Tensor] = {}  # per phase: cu_seqlens_q of the virtual batch
        self._virtual_tables: dict[tuple[int, int], torch.Tensor] = {}  # (rows, width) -> the identity tables
        # each slot's K and V as a paged cache with one KV head, [capacity + 1, block_size, 1, head_dim]
        self._slot_caches = [(slot[:, 0, :, None], slot[:, 1, :, None]) for slot in self.slots]
        # (layer, is_prefill) -> (the dense plan's first piece, what _load returned for it)
        self._prefetched: dict[tuple[int, bool], tuple[Piece, tuple]] = {}
        # the selection cache: the slots' memory as one flat run of head blocks (the last one scratch), and
        # the head block of the whole pool each holds, (pool row * (blocks + 1) + block) * kv_heads + head
        self._flat = self.slots.view(-1, 2, block_size, head_dim)
        self._flat_cache = (self._flat[:, 0, :, None], self._flat[:, 1, :, None])
        self._flat_scratch_row = (self._flat.shape[0] - 1) * block_size
        self._held = torch.full((self._flat.shape[0] - 1,), -1, dtype=torch.int32, device=device)
        self._all_head_blocks = self._pool.view(-1, 2, block_size, head_dim)
        self.reuse_selections = reuse_selections
        self._cache_open = False  # this step may use the cache (decode only, the ring untouched so far)
        self._cache_emptied = False  # emptied in this step (a graph replay may have filled it since)
        # selected head blocks the cache has loaded and reused so far, counted by ``cached_piece``
        self.cache_counts = torch.zeros(2, dtype=torch.int64, device=device)
        self._capturing = False  # warming up and capturing decode graphs
        self._in_graph = False  # inside one capture
        self._forked: set = set()  # the side streams a capture has forked (they must join it)
        # the on_decode_offload / on_prefill_offload hooks told of every load (set by the KV store)
        self.load_hooks: tuple[tuple, tuple] = ((), ())

    # -- the pool as a paged cache -------------------------------------------------------------------

    def cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K and V of a layer in the paged cache's layout ``[blocks + 1, block_size, kv_heads,
        head_dim]`` (a strided view, device-addressable): for code that reads the cache itself."""
        pool = self._pool[self._row[layer_id]]
        return pool[:, :, 0].transpose(1, 2), pool[:, :, 1].transpose(1, 2)

    # -- one step ---------------------------------------------------------------------------------------

    def begin_step(self, decode: HostPhase | None, prefill: HostPhase | None) -> None:
        """Called by the model runner before each forward pass."""
        self._host = {False: decode, True: prefill}
        self._plans = {}
        self._virtual_cu = {}
        self._prefetched = {}
        self._stored = self._storing
        self._storing = [None] * len(self._storing)
        self._cache_open, self._cache_emptied = self.reuse_selections and prefill is None, False

    def forget_blocks(self, block_ids: torch.Tensor) -> None:
        """Blocks handed out again (their pool content is about to change): the cache forgets them. Called by
        the model runner before the step that writes them."""
        if not self.reuse_selections:
            return
        # -1 (nothing held) maps to the scratch block, which is never handed out
        blocks = self._held.div(self.num_kv_heads, rounding_mode="floor") % (self.num_blocks + 1)
        self._held.masked_fill_(torch.isin(blocks, block_ids.to(torch.int32)), -1)

    def store(self, layer_id: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Send the step's new K/V ``[tokens, kv_heads, head_dim]`` of one layer to their pool slots
        (-1: to the scratch block), on the store stream."""
        bs, row = self.block_size, self._row[layer_id]
        pool = self._pool[row]
        # everything the store stream reads is made on it, or kept alive for it (no allocator reuse)
        with self._on(self.store_stream if self.cuda else None, key, value, slot_mapping):
            slots = torch.where(slot_mapping >= 0, slot_mapping, self.num_blocks * bs)
            blocks, offsets = slots // bs, slots % bs
            pool[:, :, 0][blocks, :, offsets] = key.to(pool.dtype)
            pool[:, :, 1][blocks, :, offsets] = value.to(pool.dtype)
            if self.cuda:
                self._storing[row] = torch.cuda.Event()
                self._storing[row].record(self.store_stream)

    # -- attention ----------------------------------------------------------------------------------------

    def attend_dense(self, ctx, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out, lse) over every history block (decode: the whole context, the new token included;
        prefill: the tokens before the chunk); None when no sequence of the phase has any."""
        if self._capturing:
            raise GraphUnsafe(f"layer {ctx.layer_id} reads every history block, planned on the host each step")
        if ctx.is_prefill not in self._plans:
            self._plans[ctx.is_prefill] = list(self._dense_plan(self._host[ctx.is_prefill], ctx.is_prefill))
        plan = self._plans[ctx.is_prefill]
        if not plan:
            return None
        # the next layer's first piece loads behind this layer's last, unless the step's other phase comes
        # next and needs the slots
        ahead = ctx.layer_id in self._following and self._host[not ctx.is_prefill] is None
        return self._run(ctx, q, iter(plan), plan[0] if ahead else None)

    def attend_selected(
        self, ctx, q: torch.Tensor, block_indices: torch.Tensor, kv_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend_blocks`` over the pool: only the selected head blocks cross PCIe."""
        return self._run(ctx, q, self._selected_pieces(ctx, block_indices, kv_lens))

    def wait_stored(self, layer_id: int) -> None:
        """Make the compute stream wait until this step's new K/V of a layer are in the pool, for code
        that reads the pool itself (``PolicyContext.read_blocks``)."""
        storing = self._storing[self._row[layer_id]]
        if self.cuda and storing is not None:
            torch.cuda.current_stream().wait_event(storing)

    def _run(self, ctx, q: torch.Tensor, pieces: Iterator[Piece], next_layer: Piece | None = None):
        """Load each piece into the next slot, patch in the new K/V, attend, merge by log-sum-exp. Loads run
        one piece ahead of attention; ``next_layer`` (the next layer's first piece) is loaded after the
        last, so the copy engines never wait for the host to reach the next layer."""
        hkv, t = self.num_kv_heads, q.shape[0]
        group = q.shape[1] // hkv
        qv = q.view(t, hkv, group, -1).transpose(0, 1).reshape(hkv * t, group, q.shape[2])
        cu_v = self._virtual_cu.get(ctx.is_prefill)
        if cu_v is None:  # the same for every layer of the step's phase
            cu = ctx.meta.cu_seqlens_q
            heads = torch.arange(hkv, device=cu.device, dtype=cu.dtype)[:, None]
            cu_v = torch.cat([(cu[:-1][None, :] + heads * t).flatten(), cu.new_full((1,), hkv * t)])
            self._virtual_cu[ctx.is_prefill] = cu_v
        out = lse = None
        piece = next(pieces, None)
        # the prefetched first piece of the dense plan, unless this layer reads something else (a selection)
        held = self._prefetched.pop((ctx.layer_id, ctx.is_prefill), None)
        if piece is not None:
            loaded = (held[1] if held is not None and held[0] is piece
                      else self._load(ctx.layer_id, piece, ctx.is_prefill))
        while piece is not None:
            index, ready = loaded
            following = next(pieces, None)
            if following is not None:
                loaded = self._load(ctx.layer_id, following, ctx.is_prefill)
            elif next_layer is not None:
                following_layer = self._following[ctx.layer_id]
                self._prefetched[(following_layer, ctx.is_prefill)] = (
                    next_layer, self._load(following_layer, next_layer, ctx.is_prefill)
                )
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            slot, (k_slot, v_slot) = ((self._flat, self._flat_cache) if index is None
                                      else (self.slots[index], self._slot_caches[index]))
            if piece.rows is not None:
                patch_slot(slot, piece.rows, ctx.new_keys, ctx.new_values)
            meta = PhaseMetadata(cu_v, piece.kv_lens, piece.tables, ctx.meta.max_query_len, piece.max_keys)
            part_out, part_lse = ctx.backend.attend_blocks(
                qv, k_slot, v_slot, meta, piece.selection, piece.kv_lens, ctx.scale
            )
            if index is not None:
                self._release(index)
            out, lse = (part_out, part_lse) if out is None else ctx.backend.merge(out, lse, part_out, part_lse)
            piece = following
        if out is None:  # nothing to read: the phase's sequences have no history
            out, lse = torch.zeros_like(qv), qv.new_full(qv.shape[:2], float("-inf"), dtype=torch.float32)
        out = out.view(hkv, t, group, -1).transpose(0, 1).reshape(q.shape)
        lse = lse.view(hkv, t, group).transpose(0, 1).reshape(t, hkv * group)
        return out, lse

    # -- CUDA graphs -----------------------------------------------------------------------------------------

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """While the model runner warms up and captures decode graphs: dense reads raise :class:`GraphUnsafe`."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            with torch.inference_mode():  # however the engine was built, as the steps change it
                self._held.fill_(-1)  # the warm-ups loaded from made-up block tables

    def begin_capture(self) -> None:
        """First thing inside a capture: forget the events of earlier work, which the graph cannot wait on
        (its replays are ordered by :meth:`order_streams`), and what earlier steps computed."""
        self._forget_events()
        self._plans, self._virtual_cu, self._prefetched, self._forked = {}, {}, {}, set()
        self._in_graph = True
        self._cache_open, self._cache_emptied = self.reuse_selections, False

    def end_capture(self) -> None:
        """Last thing inside a capture: the side streams it forked join the capture stream. What the capture
        computed holds no values (its kernels have not run), so none of it is kept for later steps."""
        for stream in self._forked:
            torch.cuda.current_stream().wait_stream(stream)
        self._forget_events()
        self._plans, self._virtual_cu, self._prefetched = {}, {}, {}
        self._in_graph = False

    def order_streams(self) -> None:
        """Before and after a graph replay: the compute stream waits for the side streams' work so far,
        and they for its, so the replay's loads see earlier stores and later loads see the replay's."""
        if self.cuda:
            compute = torch.cuda.current_stream()
            for stream in (self.load_stream, self.store_stream):
                compute.wait_stream(stream)
                stream.wait_stream(compute)
        self._forget_events()

    def _forget_events(self) -> None:
        self._stored = [None] * len(self.layers)
        self._storing = [None] * len(self.layers)
        if self.cuda:
            self._slot_free = [None] * NUM_SLOTS

    # -- slots and streams ---------------------------------------------------------------------------------

    def _fork(self, stream) -> None:
        """``stream`` runs after the compute stream's work so far (inside a capture: joins the graph)."""
        stream.wait_stream(torch.cuda.current_stream())
        if self._in_graph:
            self._forked.add(stream)

    def _on(self, stream, *tensors: torch.Tensor):
        """Run on ``stream`` after the current stream's work so far; ``tensors`` stay alive until it is done."""
        if stream is None:
            return nullcontext()
        self._fork(stream)
        for tensor in tensors:
            tensor.record_stream(stream)
        return torch.cuda.stream(stream)

    def _load(self, layer_id: int, piece: Piece, is_prefill: bool) -> tuple[int | None, torch.cuda.Event | None]:
        """Enqueue the piece's head blocks of a layer into the next slot: (slot index, the "slot ready"
        event the compute stream waits for); a cached piece's go to its layer's cache region (index None).
        The phase's offload hooks are told what is loaded."""
        for hook in self.load_hooks[is_prefill]:
            hook(KVTransfer(layer_id, is_prefill, "load", piece.ids, self.head_block_bytes))
        index = None
        if piece.base is None:  # the ring
            self.empty_cache()
            index = self._next_slot
            self._next_slot = (index + 1) % NUM_SLOTS
            # a prefetch that was never used (its layer read something else) is overwritten now: forget it
            self._prefetched = {key: held for key, held in self._prefetched.items() if held[1][0] != index}
        if not self.cuda:
            self._copy(layer_id, piece, index)
            return index, None
        stream = self.load_stream
        if piece.on_device:  # a selection: its indices come from this layer's query
            self._fork(stream)
            piece.ids.record_stream(stream)
        slot_free = None if index is None else self._slot_free[index]
        for event in (slot_free, self._stored[self._row[layer_id]]):
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            self._copy(layer_id, piece, index)
        ready = torch.cuda.Event()
        ready.record(stream)
        return index, ready

    def empty_cache(self) -> None:
        """The ring is about to overwrite the cache regions: forget them (once a step, recorded in a graph
        being captured), and let its loads start only after the attention over them so far. The cache stays
        closed for the rest of the step."""
        self._cache_open = False
        if self._cache_emptied:
            return
        self._held.fill_(-1)
        self._cache_emptied = True
        if self.cuda:
            self._fork(self.load_stream)

    def _copy(self, layer_id: int, piece: Piece, index: int | None) -> None:
        """Into ring slot ``index``: runs through the copy engines from the pinned pool, otherwise one gather
        kernel. A cached piece's missing head blocks (index None): ``load_misses``."""
        if index is None:
            load_misses(self._all_head_blocks, self._flat, piece.ids, piece.base)
            return
        slot = self.slots[index]
        rows = (-1, 2, self.block_size, self.head_dim)
        if piece.runs is not None:
            host = self.pool[self._row[layer_id]].view(rows)
            for first, at, length in piece.runs:
                slot[at : at + length].copy_(host[first : first + length], non_blocking=True)
        else:
            source = self._pool_head_blocks[self._row[layer_id]]
            torch.index_select(source, 0, piece.ids, out=slot[: piece.ids.shape[0]])

    def _release(self, index: int) -> None:
        """The compute stream is done with slot ``index`` once its work so far has run."""
        if self.cuda:
            self._slot_free[index] = torch.cuda.Event()
            self._slot_free[index].record()

    # -- pieces ------------------------------------------------------------------------------------------

    def _dense_plan(self, host: HostPhase, is_prefill: bool) -> Iterator[Piece]:
        """Pieces of every history block of every sequence, built on the host once per step and phase.
        In decode the history includes the new token, which the pieces patch in."""
        bs, hkv = self.block_size, self.num_kv_heads
        num_seqs = len(host.block_tables)
        hist = [c - q if is_prefill else c for c, q in zip(host.context_lens, host.query_lens, strict=True)]
        need = [-(-h // bs) for h in hist]
        per_piece = self.capacity // hkv  # whole blocks, every head
        done = [0] * num_seqs
        while any(d < n for d, n in zip(done, need, strict=True)):
            take, room = [0] * num_seqs, per_piece
            for s in range(num_seqs):
                take[s] = min(need[s] - done[s], room)
                room -= take[s]
            yield self._host_piece(host, hist, done, take, is_prefill)
            done = [d + t for d, t in zip(done, take, strict=True)]

    def _host_piece(self, host: HostPhase, hist, first, take, is_prefill) -> Piece:
        """The piece's blocks go to the slot sorted by pool id, each once (a prefix shared by several
        sequences loads once), so that whatever order the block manager handed them out in, they form
        few long runs for the copy engines. Virtual sequence (head h, sequence s) reads its j-th block at
        slot row ``where[s, j] * kv_heads + h``."""
        bs, hkv = self.block_size, self.num_kv_heads
        num_seqs = len(take)
        blocks = np.concatenate(
            [np.asarray(host.block_tables[s][first[s] : first[s] + take[s]], dtype=np.int64) for s in range(num_seqs)]
        )
        unique, where = np.unique(blocks, return_inverse=True)
        ids = (unique[:, None] * hkv + np.arange(hkv)[None, :]).ravel()
        starts = np.concatenate([[0], np.cumsum(take)[:-1]]).astype(np.int64)
        width = max(take)
        local = np.arange(width)
        inside = local[None, :] < np.asarray(take)[:, None]  # [seqs, width]
        slot_block = where[np.where(inside, starts[:, None] + local[None, :], 0)]  # [seqs, width]
        heads = np.arange(hkv)[:, None, None]
        tables = np.where(inside[None], slot_block[None] * hkv + heads, 0).reshape(hkv * num_seqs, width)
        selection = np.where(inside, local[None, :], -1)[None].repeat(hkv, 0).reshape(hkv * num_seqs, width)
        kv = np.clip(np.asarray(hist) - np.asarray(first) * bs, 0, np.asarray(take) * bs)
        rows = None
        if not is_prefill:  # the new token: position hist - 1, in the piece if its block is
            last = (np.asarray(hist) - 1) // bs - np.asarray(first)
            has_last = (last >= 0) & (last < np.asarray(take))
            head_block = slot_block[np.arange(num_seqs), np.clip(last, 0, width - 1)][None, :] * hkv + heads[:, :, 0]
            offset = (np.asarray(hist) - 1) % bs
            rows = np.where(has_last[None, :], head_block * bs + offset[None, :], self.scratch_row)
        to = self._to_device
        return Piece(
            to(ids), to(tables.astype(np.int32)), to(selection.astype(np.int32)), to(np.tile(kv, hkv).astype(np.int32)),
            None if rows is None else to(rows), width * bs, False, self._runs(ids),
        )

    def _runs(self, ids: np.ndarray) -> list[tuple[int, int, int]] | None:
        """Contiguous runs of ``ids`` as (first id, first slot row, length) if they are long enough for
        the copy engines, else None (the gather kernel)."""
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        starts = np.concatenate([[0], breaks])
        lengths = np.diff(np.concatenate([starts, [ids.shape[0]]]))
        head_block_bytes = self.slots[0, 0].numel() * self.slots.element_size()
        if lengths.mean() * head_block_bytes < MIN_COPY_BYTES:
            return None
        return [(int(ids[a]), int(a), int(n)) for a, n in zip(starts, lengths, strict=True)]

    def _selected_pieces(self, ctx, block_indices: torch.Tensor, kv_lens: torch.Tensor) -> Iterator[Piece]:
        """Pieces of a selection made on the device: computed there, one ``selected_piece`` each, without a
        host sync. Shapes are known on the host: ``capacity // (kv_heads * seqs)`` selected blocks of every
        virtual sequence per piece, so a selection that fits the slot is one piece."""
        hkv, meta = self.num_kv_heads, ctx.meta
        sel = selection_per_kv_head(block_indices, hkv)
        num_seqs, _, k = sel.shape
        if not ctx.is_prefill and self._cache_fits(num_seqs, k):
            row = self._row[ctx.layer_id]
            base = row * self._cache_seqs(k) * hkv * k  # the layer's region
            loads, tables, selection, lens, rows = cached_piece(
                sel, meta.block_tables, kv_lens, meta.cu_seqlens_q, ctx.positions,
                self._held[base : base + num_seqs * hkv * k].view(-1, k), base, row * (self.num_blocks + 1),
                self.block_size, self._flat_scratch_row, self.cache_counts,
            )
            self._cache_emptied = False
            yield Piece(loads, tables, selection, lens, rows, k * self.block_size, True, base=base)
            return
        per_piece = self.capacity // (hkv * num_seqs)
        for first in range(0, k, per_piece):
            width = min(per_piece, k - first)
            ids, selection, lens, rows = selected_piece(
                sel, meta.block_tables, kv_lens, meta.cu_seqlens_q, ctx.positions, first, width, self.block_size,
                self.scratch_id, self.scratch_row,
            )
            tables = self._virtual_tables.get((hkv * num_seqs, width))
            if tables is None:  # virtual sequence r reads its i-th selected block at slot head block r * width + i
                tables = torch.arange(hkv * num_seqs * width, device=sel.device, dtype=torch.int32).view(-1, width)
                if not self._in_graph:  # a graph's own tensor holds values only in its replays
                    self._virtual_tables[(hkv * num_seqs, width)] = tables
            yield Piece(ids, tables, selection, lens, rows, width * self.block_size, True)

    def _cache_fits(self, num_seqs: int, k: int) -> bool:
        """Whether this step's selection of ``k`` blocks per sequence and KV head goes through the cache."""
        return self._cache_open and 0 < num_seqs <= self._cache_seqs(k)

    def _cache_seqs(self, k: int) -> int:
        """How many sequences each layer's region holds, at ``k`` head blocks per sequence and KV head."""
        return self._held.shape[0] // (len(self.layers) * self.num_kv_heads * k)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A planned piece's tensor: copied on the load stream, which reads it first, and kept alive
        for the compute stream, which reads it next."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if not self.cuda:
            return tensor
        with torch.cuda.stream(self.load_stream):
            tensor = tensor.pin_memory().to(self.device, non_blocking=True)
        tensor.record_stream(torch.cuda.current_stream())
        return tensor


# -- the per-piece bookkeeping: a Triton kernel on CUDA, its torch reference elsewhere ---------------------


@functools.cache
def _kernels() -> ModuleType:
    """:mod:`nanovllm.kv.offload_kernels`, imported on first use (it imports Triton)."""
    from nanovllm.kv import offload_kernels

    return offload_kernels


def selected_piece(
    sel: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    first: int, width: int, block_size: int, scratch_id: int, scratch_row: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One piece of a selection: see :func:`selected_piece_reference`."""
    piece = _kernels().selected_piece if use_fused(sel) else selected_piece_reference
    return piece(sel, tables, lens, cu, positions, first, width, block_size, scratch_id, scratch_row)


def cached_piece(
    sel: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    held: torch.Tensor, base: int, first_block: int, block_size: int, scratch_row: int, counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode selection through a layer's cache region: see :func:`cached_piece_reference`."""
    piece = _kernels().cached_piece if use_fused(sel) else cached_piece_reference
    return piece(sel, tables, lens, cu, positions, held, base, first_block, block_size, scratch_row, counts)


def load_misses(pool: torch.Tensor, flat: torch.Tensor, loads: torch.Tensor, base: int) -> None:
    """Copy pool head block ``loads[j]`` to flat head block ``base + j`` wherever ``loads[j] >= 0``."""
    if use_fused(flat):
        _kernels().load_misses(pool, flat, loads, base)
    else:
        where = (loads >= 0).nonzero().flatten()
        flat[base + where] = pool[loads[where].long()].to(flat.device)


def patch_slot(slot: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write the new K/V into a slot: see :func:`patch_slot_reference`."""
    if use_fused(slot):
        _kernels().patch_slot(slot, rows, keys, values)
    else:
        patch_slot_reference(slot, rows, keys, values)


def selected_piece_reference(
    sel: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    first: int, width: int, block_size: int, scratch_id: int, scratch_row: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The piece of selected blocks ``first .. first + width`` of each virtual sequence ``r = h * seqs + s``
    (KV head ``h`` of sequence ``s``), given the selection ``sel`` ``[seqs, kv_heads, k]`` (ascending, -1
    padded), the block tables ``[seqs, W]``, the KV lengths ``[seqs]`` and the phase's new tokens (their
    ``cu_seqlens`` ``[seqs + 1]`` and positions ``[tokens]``). Returns:

    - ids ``[rows * width]`` int64: head block ``physical * kv_heads + h`` to load into slot head block
      ``r * width + i`` (``scratch_id`` for padding);
    - selection ``[rows, width]`` int32: ``0 .. count - 1`` then -1;
    - kv_lens ``[rows]`` int32: tokens of the piece's blocks (the block of the last token counts its fill);
    - rows ``[kv_heads, tokens]`` int64: the slot row of each new token, ``scratch_row`` where its block is
      not in the piece."""
    num_seqs, hkv = sel.shape[:2]
    dev = sel.device
    part = sel[:, :, first : first + width].transpose(0, 1).reshape(hkv * num_seqs, width).long()
    head = torch.arange(hkv, device=dev).repeat_interleave(num_seqs)
    seq = torch.arange(num_seqs, device=dev).repeat(hkv)
    valid = part >= 0
    physical = tables.long()[seq[:, None], part.clamp(min=0)]
    ids = torch.where(valid, physical * hkv + head[:, None], scratch_id).flatten()
    count = valid.sum(1)
    n = lens.long()[seq]
    partial = torch.where(n > 0, (n - 1) // block_size, -2)  # the block of the last token, if any
    has_partial = (valid & (part == partial[:, None])).any(1)
    piece_lens = count * block_size - torch.where(has_partial, block_size - (n - partial * block_size), 0)
    local = torch.arange(width, device=dev)
    selection = torch.where(local < count[:, None], local, -1)
    token_seq = torch.repeat_interleave(
        torch.arange(num_seqs, device=dev), (cu[1:] - cu[:-1]).long(), output_size=positions.shape[0]
    )
    token_part = part.view(hkv, num_seqs, width)[:, token_seq]  # [kv_heads, tokens, width]
    match = (token_part == (positions // block_size)[None, :, None]) & (token_part >= 0)
    j = torch.where(match, local, -1).amax(-1)  # the piece's index of each token's block, -1: not in it
    virtual = torch.arange(hkv, device=dev)[:, None] * num_seqs + token_seq[None, :]
    rows = torch.where(j >= 0, (virtual * width + j) * block_size + positions % block_size, scratch_row)
    return ids, selection.to(torch.int32), piece_lens.to(torch.int32), rows


def cached_piece_reference(
    sel: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, positions: torch.Tensor,
    held: torch.Tensor, base: int, first_block: int, block_size: int, scratch_row: int, counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selection ``sel`` ``[seqs, kv_heads, k]`` (ascending, -1 padded) of a decode step through a
    layer's cache region: ``k`` head blocks per cache row ``c = s * kv_heads + h``, starting at flat head
    block ``base``. ``held`` ``[seqs * kv_heads, k]`` int32 is the head block of the whole pool each
    position holds (-1: none), updated in place; this layer's pool begins at block ``first_block`` of it, so
    block ``b``'s head ``h`` is ``(first_block + b) * kv_heads + h``. A selected head block already held stays
    where it is; the others (and the block holding the newest token, whose pool copy is still being written)
    go to positions whose block is no longer selected, in order. The newest block is not kept: its position
    reads -1 afterwards. ``counts`` ``[2]`` int64 adds the head blocks loaded and those reused. Returns:

    - loads ``[seqs * kv_heads * k]`` int32: the head block of the whole pool to load into flat head block
      ``base + c * k + j``, -1 where nothing is loaded;
    - tables ``[rows, k]`` int32 (virtual row ``r = h * seqs + s``): the flat head block of the i-th selected
      block, 0 past the selection;
    - selection, kv_lens and rows as :func:`selected_piece_reference` gives them, with ``width = k``."""
    num_seqs, hkv, k = sel.shape
    dev, n_rows = sel.device, num_seqs * hkv
    part = sel.reshape(n_rows, k).long()  # cache-row order
    valid = part >= 0
    seq = torch.arange(num_seqs, device=dev).repeat_interleave(hkv)
    head = torch.arange(hkv, device=dev).repeat(num_seqs)
    physical = first_block + tables.long()[seq[:, None], part.clamp(min=0)]
    wanted = torch.where(valid, physical * hkv + head[:, None], -1)
    n = lens.long()[seq]
    partial = torch.where(n > 0, (n - 1) // block_size, -2)  # the block of the last token, if any
    newest = valid & (part == partial[:, None])
    holding = held.long()
    reusable = (valid & ~newest)[:, :, None] & (holding >= 0)[:, None, :]
    match = (wanted[:, :, None] == holding[:, None, :]) & reusable  # [rows, i, j]
    local = torch.arange(k, device=dev)
    hit = torch.where(match, local, -1).amax(-1)  # [rows, i]: the position holding selected block i
    miss = valid & (hit < 0)
    free = ~match.any(1)  # [rows, j]: positions whose block is not selected
    rank_miss, rank_free = miss.cumsum(1) - 1, free.cumsum(1) - 1
    assign = miss[:, :, None] & free[:, None, :] & (rank_miss[:, :, None] == rank_free[:, None, :])
    position = torch.where(miss, torch.where(assign, local, -1).amax(-1), hit)
    loads = torch.where(assign, wanted[:, :, None], -1).amax(1)  # [rows, j]
    kept = torch.where(assign & ~newest[:, :, None], wanted[:, :, None], -1).amax(1)
    held.copy_(torch.where(assign.any(1), kept, holding))
    counts += torch.stack([miss.sum(), (valid & ~miss).sum()])
    count = valid.sum(1)
    flat = base + torch.arange(n_rows, device=dev)[:, None] * k + position
    def virtual(x: torch.Tensor) -> torch.Tensor:  # cache-row order (s, h) to the virtual batch's (h, s)
        return x.view(num_seqs, hkv, *x.shape[1:]).transpose(0, 1).reshape(x.shape)

    tables_v = torch.where(local < count[:, None], flat, 0)
    selection = torch.where(local < count[:, None], local, -1)
    has_partial = newest.any(1)
    piece_lens = count * block_size - torch.where(has_partial, block_size - (n - partial * block_size), 0)
    token_seq = torch.repeat_interleave(
        torch.arange(num_seqs, device=dev), (cu[1:] - cu[:-1]).long(), output_size=positions.shape[0]
    )
    token_part = part.view(num_seqs, hkv, k).transpose(0, 1)[:, token_seq]  # [kv_heads, tokens, k]
    token_flat = flat.view(num_seqs, hkv, k).transpose(0, 1)[:, token_seq]
    match_t = (token_part == (positions // block_size)[None, :, None]) & (token_part >= 0)
    block = torch.where(match_t, token_flat, -1).amax(-1)
    rows = torch.where(block >= 0, block * block_size + positions % block_size, scratch_row)
    int32 = torch.int32
    return (loads.flatten().to(int32), virtual(tables_v).to(int32), virtual(selection).to(int32),
            virtual(piece_lens).to(int32), rows)


def patch_slot_reference(slot: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write the new keys and values ``[tokens, kv_heads, head_dim]`` into ``slot`` ``[capacity + 1, 2,
    block_size, head_dim]`` at the slot rows ``[kv_heads, tokens]`` (head block ``row // block_size``,
    offset ``row % block_size``), so the slot holds what the paged GPU cache would."""
    block_size = slot.shape[2]
    rows = rows.flatten()
    head_block, offset = rows // block_size, rows % block_size
    slot[:, 0][head_block, offset] = keys.transpose(0, 1).reshape(rows.shape[0], -1).to(slot.dtype)
    slot[:, 1][head_block, offset] = values.transpose(0, 1).reshape(rows.shape[0], -1).to(slot.dtype)
