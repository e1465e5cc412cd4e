"""The KV store: one interface over where a model's keys and values live.

The engine picks one store at start-up (:func:`nanovllm.engine.kv_allocation.allocate_kv_store`):

- :class:`PagedKVStore`, the paged GPU cache of every layer;
- :class:`HostKVStore`, the pinned host pool of the full-attention layers read through GPU load slots
  (:class:`nanovllm.kv.offload.OffloadEngine`), with the layers the policies run dense kept in a paged GPU
  cache over the pool's blocks, and the sliding-window layers in a paged GPU cache of their own, which
  holds only their windows (hybrid KV).

A store is a list of per-layer handles (:class:`LayerKV`), each owning one layer's KV: its writes (which
also keep the policies' per-block metadata, through ``on_kv_write``, on either store), and every read a
policy makes through :class:`nanovllm.policy.PolicyContext` (attend to selected blocks, attend to the whole
history, read blocks or keys, read a compact paged copy). A handle is one of two kinds, :class:`PagedLayerKV`
and :class:`PooledLayerKV`, so a store can mix them layer by layer. Layers sharing one block table form a
KV cache group (:mod:`nanovllm.kv.groups`: sliding-window layers keeping only their window); a handle knows
its group, whose slots and block tables the step gives it (``StepMetadata.of_group``).
The store itself adds the step's life cycle around the forward pass (``begin_step``, the CUDA-graph
calls), which the paged cache leaves empty, so nothing above it asks where KV lives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Literal, Protocol

import attrs
import numpy as np
import torch

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata
from nanovllm.kv.cache_dtype import to_cache
from nanovllm.kv.groups import KVCacheGroup, layer_places, needs_null_block

if TYPE_CHECKING:
    from nanovllm.attention.backend import AttentionBackend
    from nanovllm.kv.offload import HostPhase, OffloadEngine
    from nanovllm.policy import PolicyContext

Hook = Callable[..., None]


# -- what the store tells policies and observers ---------------------------------------------------------


@attrs.define(frozen=True, slots=True)
class KVWrite:
    """The new keys and values of one layer in one step, already in the layer's store.

    Rows are the step's new tokens: decodes first (one per sequence), then the prefill chunks. A row
    whose slot is -1 was not written (padding, warm-up) and must be ignored. ``key`` and ``value`` are on
    the GPU on either store; ``k_cache`` / ``v_cache`` are the layer's paged view (the GPU cache, or the
    host pool in the same layout).
    """

    layer_id: int
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    step: StepMetadata
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], this layer, after the write
    v_cache: torch.Tensor

    @property
    def slot_mapping(self) -> torch.Tensor:
        """``[num_tokens]`` int64 cache slot of each row (``block * block_size + offset``), -1: skipped."""
        return self.step.slot_mapping

    @property
    def positions(self) -> torch.Tensor:
        """``[num_tokens]`` position of each row's token in its sequence."""
        return self.step.positions

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def block_ids(self) -> torch.Tensor:
        """``[num_tokens]`` physical block of each row, -1 where skipped."""
        slots = self.slot_mapping
        return torch.where(slots >= 0, slots // self.block_size, -1)

    @classmethod
    def of_blocks(
        cls, layer_id: int, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: list[int],
        counts: list[int], starts: list[int],
    ) -> KVWrite:
        """A write of what the cache already holds: the first ``counts[i]`` tokens of physical block
        ``blocks[i]``, whose first token sits at position ``starts[i]`` (a multiple of the block size),
        each block as one sequence's prefill chunk. Recomputes per-block metadata from the cache in one
        call (the conformance kit, the quality harness)."""
        dev, bs = k_cache.device, k_cache.shape[1]
        slots = torch.tensor([b * bs + i for b, n in zip(blocks, counts, strict=True) for i in range(n)],
                             dtype=torch.long, device=dev)
        positions = torch.tensor([s + i for s, n in zip(starts, counts, strict=True) for i in range(n)],
                                 dtype=torch.long, device=dev)
        lens = torch.tensor(counts, dtype=torch.int32, device=dev)
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        tables = torch.full((len(blocks), max(starts) // bs + 1), -1, dtype=torch.int32)
        tables[range(len(blocks)), [s // bs for s in starts]] = torch.tensor(blocks, dtype=torch.int32)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
        ends_t = torch.tensor(ends, dtype=torch.int32, device=dev)
        prefill = PhaseMetadata(cu, ends_t, tables.to(dev), max(counts), max(ends), tuple(counts),
                                tuple(ends))
        return cls._of_cache(layer_id, k_cache, v_cache, StepMetadata(slots, positions, 0, None, prefill))

    @classmethod
    def of_sequence(
        cls, layer_id: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int], num_tokens: int
    ) -> KVWrite:
        """A write of what the cache already holds: the first ``num_tokens`` tokens of one sequence through
        its ``block_table`` (physical blocks), as one prefill chunk. Unlike :meth:`of_blocks`, the write
        says which blocks form the sequence, which metadata spanning blocks (Quest's pages) needs."""
        dev, bs = k_cache.device, k_cache.shape[1]
        positions = torch.arange(num_tokens, dtype=torch.long, device=dev)
        table = torch.tensor([block_table], dtype=torch.int32, device=dev)
        slots = table[0, positions // bs].long() * bs + positions % bs
        cu = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
        prefill = PhaseMetadata(cu, cu[1:], table, num_tokens, num_tokens, (num_tokens,), (num_tokens,))
        return cls._of_cache(layer_id, k_cache, v_cache, StepMetadata(slots, positions, 0, None, prefill))

    @classmethod
    def _of_cache(
        cls, layer_id: int, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepMetadata
    ) -> KVWrite:
        """The write of ``step``, its keys and values read back from the cache at its slots."""
        slots = step.slot_mapping
        flat_k, flat_v = (c.reshape(-1, *c.shape[2:]) for c in (k_cache, v_cache))
        return cls(layer_id, flat_k[slots], flat_v[slots], step, k_cache, v_cache)

    def block_fill(self) -> torch.Tensor:
        """``[num_tokens]`` how many tokens the block of each row holds after this step."""
        positions = self.positions
        ends = positions + 1  # a decode row is its sequence's last token
        prefill = self.step.prefill
        if prefill is not None:
            nd = self.step.num_decode_tokens
            ends = ends.clone()
            ends[nd:] = torch.repeat_interleave(
                prefill.context_lens.long(), prefill.query_lens.long(), output_size=ends.shape[0] - nd
            )
        return (ends - (positions - positions % self.block_size)).clamp(max=self.block_size)


@attrs.define(frozen=True, slots=True)
class KVTransfer:
    """KV the host store moved across PCIe for one layer and one phase: what ``on_prefill_offload`` and
    ``on_decode_offload`` report. A notification only: no policy needs it to stay correct.

    - ``kind="store"``: the phase's new keys and values went to the host pool, one entry of ``blocks`` per
      token row (its pool block; padding rows go to the pool's scratch block, and cross PCIe too).
    - ``kind="load"``: pool head blocks (``block * num_kv_heads + head``) were copied into a GPU slot, one
      entry per slot head block; -1 where nothing was copied (a selection-cache hit).

    ``blocks`` is on the device; ``unit_bytes`` is the bytes one entry moves.
    """

    layer_id: int
    is_prefill: bool
    kind: Literal["store", "load"]
    blocks: torch.Tensor
    unit_bytes: int

    @property
    def num_bytes(self) -> int:
        """Bytes that crossed PCIe (reads ``blocks`` back: a host sync on the GPU)."""
        return int((self.blocks >= 0).sum()) * self.unit_bytes


# -- one layer's KV ----------------------------------------------------------------------------------------


@attrs.define(frozen=True, slots=True)
class CacheSlots:
    """Where one layer's new keys and values of a step go in its paged GPU cache: for a kernel that makes the
    keys (RoPE's) to write them and the values itself, as the attention backend's ``store_kv`` would."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1: not written

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The write in torch (the fused kernels' reference): ``key``/``value`` ``[num_tokens, Hkv, D]``."""
        written = self.slot_mapping >= 0
        slots = self.slot_mapping[written]
        self.k_cache.view(-1, *self.k_cache.shape[2:])[slots] = to_cache(key[written], self.k_cache.dtype)
        self.v_cache.view(-1, *self.v_cache.shape[2:])[slots] = to_cache(value[written], self.v_cache.dtype)


class LayerKV:
    """One layer's keys and values, and every operation on them. ``k_cache`` / ``v_cache`` are the
    layer's paged view ``[num_blocks, block_size, num_kv_heads, head_dim]`` (on the host store, the pool
    in that layout: device-addressable, read across PCIe). ``kv_write`` holds the ``on_kv_write`` hooks
    that :meth:`write` calls, set by :meth:`KVStore.bind`."""

    def __init__(self, layer_id: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.layer_id = layer_id
        self.k_cache, self.v_cache = k_cache, v_cache
        self.kv_write: tuple[Hook, ...] = ()
        self.group = 0  # its KV cache group (set by the store): whose slots and block tables it reads

    def write(self, key: torch.Tensor, value: torch.Tensor, step: StepMetadata, backend: AttentionBackend,
              stored: bool = False) -> None:
        """Store the step's new keys and values ``[num_tokens, num_kv_heads, head_dim]`` at
        ``step.slot_mapping`` (-1: skipped), then tell the ``on_kv_write`` hooks. ``stored``: a kernel has
        already written them through :meth:`cache_slots`; only tell the hooks."""
        raise NotImplementedError

    def cache_slots(self, step: StepMetadata) -> CacheSlots | None:
        """Where a kernel that makes the step's keys may write them and the values itself (then
        ``write(..., stored=True)``); None where only :meth:`write` can (the host pool)."""
        return None

    def attend_blocks(
        self, ctx: PolicyContext, q: torch.Tensor, block_indices: torch.Tensor, kv_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of ``q`` over the selected logical history blocks (see ``PolicyContext.attend_blocks``)."""
        raise NotImplementedError

    def attend_all(
        self, ctx: PolicyContext, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """Dense causal attention over the whole context (prefill: the history and the chunk ``k``/``v``)."""
        raise NotImplementedError

    def wait_writes(self) -> None:
        """Make the current stream wait until this step's writes can be read through ``k_cache`` /
        ``v_cache`` (for code that reads the paged view itself)."""

    def read_blocks(
        self, ctx: PolicyContext, block_indices: torch.Tensor, values: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys and (with ``values``) values ``[num_seqs, k, block_size, num_kv_heads, head_dim]`` of the
        logical blocks ``[num_seqs, k]`` (-1: zeros), this step's tokens included, on the query's device."""
        self.wait_writes()
        physical = torch.gather(ctx.meta.block_tables, 1, block_indices.clamp(min=0).to(torch.int64)).long()
        invalid = (block_indices < 0)[..., None, None, None]

        def gather(cache: torch.Tensor) -> torch.Tensor:
            return cache[physical].masked_fill(invalid, 0)

        return gather(self.k_cache), gather(self.v_cache) if values else None

    def read_paged(
        self, ctx: PolicyContext, blocks: torch.Tensor | Callable[[], torch.Tensor], values: bool = True,
        width: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(k_cache, v_cache, block_tables)`` through which the logical blocks marked in ``blocks`` can be
        read (see ``PolicyContext.read_paged``)."""
        raise NotImplementedError

    def read_staged(self, ctx: PolicyContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The phase's contexts in the attention backend's staged pages (see ``PolicyContext.read_staged``),
        or None."""
        return None

    def compact_copy(
        self, ctx: PolicyContext, present: torch.Tensor, values: bool, width: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The logical blocks marked in ``present`` ``[num_seqs, n]`` read into a paged cache of their own,
        ``width`` blocks a sequence (default: the most any sequence marks, read back with a host sync), and
        block tables ``[num_seqs, n]`` addressing it by logical block (unmarked blocks map to block 0)."""
        counts = present.sum(-1)
        if width is None:
            width = max(int(counts.max()), 1) if present.numel() else 1
        width = max(min(width, present.shape[1]), 1)
        logical = torch.arange(present.shape[1], device=present.device, dtype=torch.int32)
        order = torch.where(present, logical, torch.iinfo(torch.int32).max).sort(-1).values[:, :width]
        chosen = torch.where(torch.arange(width, device=present.device)[None, :] < counts[:, None], order, -1)
        rank = present.long().cumsum(-1) - 1
        seq = torch.arange(present.shape[0], device=present.device)[:, None]
        tables = torch.where(present, seq * width + rank, 0).to(torch.int32)
        keys, vals = self.read_blocks(ctx, chosen, values)
        return keys.flatten(0, 1), None if vals is None else vals.flatten(0, 1), tables

    def _tell_kv_write(self, key: torch.Tensor, value: torch.Tensor, step: StepMetadata) -> None:
        write = KVWrite(self.layer_id, key, value, step, self.k_cache, self.v_cache)
        for on_kv_write in self.kv_write:
            on_kv_write(write)


class PagedLayerKV(LayerKV):
    """A layer's KV in a paged GPU cache, read in place by the attention backend's kernels."""

    def write(self, key, value, step, backend, stored=False) -> None:
        if not stored:
            backend.store_kv(key, value, self.k_cache, self.v_cache, step.slot_mapping)
        if self.kv_write:
            self._tell_kv_write(key, value, step)

    def cache_slots(self, step):
        return CacheSlots(self.k_cache, self.v_cache, step.slot_mapping)

    def attend_blocks(self, ctx, q, block_indices, kv_lens):
        return ctx.backend.attend_blocks(q, self.k_cache, self.v_cache, ctx.meta, block_indices, kv_lens, ctx.scale)

    def attend_all(self, ctx, q, k, v):
        if ctx.is_prefill:
            return ctx.backend.prefill(q, k, v, self.k_cache, self.v_cache, ctx.meta, ctx.scale)
        return ctx.backend.decode(q, self.k_cache, self.v_cache, ctx.meta, ctx.scale)

    def read_paged(self, ctx, blocks, values=True, width=None):
        """The cache itself and the phase's block tables: every block is readable, nothing is copied
        (``blocks`` is not evaluated)."""
        return self.k_cache, self.v_cache if values else None, ctx.meta.block_tables

    def read_staged(self, ctx):
        return ctx.backend.staged_cache(self.k_cache, self.v_cache, ctx.meta)


class PooledLayerKV(LayerKV):
    """A layer's KV in the host pool of an :class:`~nanovllm.kv.offload.OffloadEngine`: writes go to the
    pool on the store stream, reads stream what they need into GPU slots (only the selected blocks for
    ``attend_blocks``). ``offload_hooks`` holds the ``on_decode_offload`` and ``on_prefill_offload`` hooks
    (index 0 and 1), told of each store to the pool; the offload engine tells them of each load."""

    def __init__(self, layer_id: int, engine: OffloadEngine) -> None:
        super().__init__(layer_id, *engine.cache(layer_id))
        self.engine = engine
        self.offload_hooks: tuple[tuple[Hook, ...], tuple[Hook, ...]] = ((), ())

    def write(self, key, value, step, backend, stored=False) -> None:
        self.engine.store(self.layer_id, key, value, step.slot_mapping)  # never stored: no cache_slots
        if self.kv_write:  # the new keys are on the GPU: the metadata stays there
            self._tell_kv_write(key, value, step)
        if self.offload_hooks[0] or self.offload_hooks[1]:
            self._tell_stored(step)

    def _tell_stored(self, step: StepMetadata) -> None:
        engine, nd = self.engine, step.num_decode_tokens
        slots = step.slot_mapping
        blocks = torch.where(slots >= 0, slots // engine.block_size, engine.num_blocks)
        unit = 2 * engine.num_kv_heads * engine.head_dim * engine.pool.element_size()
        for is_prefill, rows, phase in ((False, slice(0, nd), step.decode), (True, slice(nd, None), step.prefill)):
            if phase is not None:
                transfer = KVTransfer(self.layer_id, is_prefill, "store", blocks[rows], unit)
                for hook in self.offload_hooks[is_prefill]:
                    hook(transfer)

    def attend_blocks(self, ctx, q, block_indices, kv_lens):
        return self.engine.attend_selected(ctx, q, block_indices, kv_lens)

    def attend_all(self, ctx, q, k, v):
        history = self.engine.attend_dense(ctx, q)
        if not ctx.is_prefill:
            return history[0]
        chunk = ctx.backend.attend_chunk(q, k, v, ctx.meta, ctx.scale)
        return chunk[0] if history is None else ctx.backend.merge(*history, *chunk)[0]

    def wait_writes(self) -> None:
        """The pool's writes run on the store stream: wait for this layer's."""
        self.engine.wait_stored(self.layer_id)

    def read_paged(self, ctx, blocks, values=True, width=None):
        """Only the marked blocks cross PCIe, into a compact paged cache of their own."""
        present = blocks() if callable(blocks) else blocks
        return self.compact_copy(ctx, present, values, width)


# -- the store: every layer, and the step's life cycle --------------------------------------------------


class KVStore:
    """Every attention layer's KV (``layers[i]`` is layer ``i``'s handle) in ``num_blocks`` blocks of
    ``block_size`` tokens, and the calls the model runner makes around each forward pass. The base class
    is the paged GPU cache's: every call around the step does nothing."""

    # Whether the store calls the offload notifications (``on_decode_offload`` / ``on_prefill_offload``):
    # only a store that moves KV across PCIe has anything to tell.
    notifies_offload: bool = False

    def __init__(self, layers: Sequence[LayerKV], num_blocks: int, block_size: int,
                 groups: Sequence[KVCacheGroup] | None = None, num_window_blocks: int = 0) -> None:
        self.layers = list(layers)
        self.num_blocks, self.block_size = num_blocks, block_size
        # the KV cache groups whose block tables the scheduler keeps (default: one, every layer)
        self.groups = tuple(groups or (KVCacheGroup(tuple(range(len(self.layers)))),))
        # blocks of the pool of the groups of pool 1 (the window groups' own under offload), which the block
        # manager numbers from num_blocks on and their layers' caches from 0 (block_offset)
        self.num_window_blocks = num_window_blocks
        self._blocks_allocated: tuple[Hook, ...] = ()

    def block_offset(self, group: int) -> int:
        """What the block manager's block ids of KV cache group ``group`` exceed the ids its layers' caches
        are indexed by: ``num_blocks`` for a group of pool 1, else 0."""
        return self.num_blocks if self.groups[group].pool else 0

    def bind(self, kv_write: Sequence[Hook], blocks_allocated: Sequence[Hook] = (),
             decode_offload: Sequence[Hook] = (), prefill_offload: Sequence[Hook] = ()) -> None:
        """The hooks the store tells: ``on_kv_write`` after every write and ``on_blocks_allocated`` when
        blocks are handed out again, on every store (they keep the policies' per-block metadata); the
        offload notifications where the store moves KV across PCIe."""
        for layer in self.layers:
            layer.kv_write = tuple(kv_write)
        self._blocks_allocated = tuple(blocks_allocated)

    @property
    def wants_allocations(self) -> bool:
        """Whether :meth:`blocks_allocated` has work to do (a hook resets metadata, or the store caches
        what blocks held); when not, the runner need not send the blocks."""
        return bool(self._blocks_allocated)

    def blocks_allocated(self, block_ids: torch.Tensor) -> None:
        """Physical blocks handed out again since the last step (int64 on the device, ids below
        ``num_blocks``: pool 1 keeps no per-block metadata), before the step writes them: the
        ``on_blocks_allocated`` hooks reset their metadata, and the store forgets what they held."""
        for on_blocks_allocated in self._blocks_allocated:
            on_blocks_allocated(block_ids)

    def begin_step(self, decode: HostPhaseLike | None, prefill: HostPhaseLike | None) -> None:
        """Before each forward pass: what the host knows of the step's phases (block tables and lengths)."""

    def can_capture_decode(self, selects_on_device: bool) -> bool:
        """Whether decode steps can be captured in CUDA graphs, given whether the decode policy selects
        its blocks on the device (``requires_block_selection``) or reads every block."""
        return True

    def capturing(self) -> AbstractContextManager[None]:
        """Around the decode graphs' warm-up and capture."""
        return nullcontext()

    def begin_capture(self) -> None:
        """First thing inside each decode graph's capture."""

    def end_capture(self) -> None:
        """Last thing inside each decode graph's capture."""

    def order_streams(self) -> None:
        """Right before and right after each decode graph's replay."""


class PagedKVStore(KVStore):
    """Every layer in one paged GPU cache ``kv_cache`` ``[slots, 2, num_blocks, block_size, num_kv_heads,
    head_dim]``. With one KV cache group (default) slot ``i`` is layer ``i`` (``kv_cache[i, 0]`` its keys,
    ``kv_cache[i, 1]`` its values); with ``groups`` the ``i``-th layer of every group has slot ``i``, in the
    blocks its group holds (:mod:`nanovllm.kv.groups`), and where a group has a window the last block is
    the null block, zeroed: kernels read it (masked) where a window group's table names it, never write it."""

    def __init__(self, kv_cache: torch.Tensor, groups: Sequence[KVCacheGroup] | None = None) -> None:
        groups = groups or (KVCacheGroup(tuple(range(kv_cache.shape[0]))),)
        layers = []
        for layer_id, (group, slot) in enumerate(layer_places(groups)):
            layers.append(PagedLayerKV(layer_id, kv_cache[slot, 0], kv_cache[slot, 1]))
            layers[-1].group = group
        super().__init__(layers, kv_cache.shape[2], kv_cache.shape[3], groups)
        self.kv_cache = kv_cache
        if needs_null_block(groups):
            kv_cache[:, :, -1].zero_()


class HostKVStore(KVStore):
    """The offloaded layers' KV in the host pool of ``engine``, and on the GPU the rest:

    - the ``pool_resident_layers`` in a paged cache ``resident_kv_cache`` ``[those layers, 2, num_blocks,
      block_size, num_kv_heads, head_dim]`` over the pool's block ids: the policies' dense layers, and in the
      uniform layout (one KV cache group) the sliding-window layers;
    - with hybrid ``groups`` (:func:`nanovllm.kv.groups.offload_groups`: the full-attention layers in group
      0, the window groups in pool 1), the sliding-window layers in a paged cache ``window_kv_cache``
      ``[slots, 2, window blocks, ...]`` of their own, the ``i``-th layer of each window group in slot
      ``i``, the last block the null block (zeroed); its block ids are the block manager's less
      ``num_blocks``.

    ``resident_layers`` lists every layer whose KV is on the GPU. The KV-write and allocation hooks see the
    pool's blocks only: the window layers (which no policy runs on) tell no one, since their block ids name
    other blocks; the offload hooks see the pool's transfers."""

    notifies_offload = True

    def __init__(self, num_layers: int, engine: OffloadEngine, pool_resident_layers: Sequence[int],
                 resident_kv_cache: torch.Tensor, groups: Sequence[KVCacheGroup] | None = None,
                 window_kv_cache: torch.Tensor | None = None) -> None:
        self.engine = engine
        self.resident_kv_cache, self.window_kv_cache = resident_kv_cache, window_kv_cache
        groups = tuple(groups or (KVCacheGroup(tuple(range(num_layers))),))
        if any(g.pool for g in groups) != (window_kv_cache is not None):
            raise ValueError("window_kv_cache holds the KV cache groups of pool 1, and only those")
        row = {layer_id: i for i, layer_id in enumerate(pool_resident_layers)}
        layers: list[LayerKV] = []
        for i, (g, slot) in enumerate(layer_places(groups)):
            if groups[g].pool:
                layers.append(PagedLayerKV(i, window_kv_cache[slot, 0], window_kv_cache[slot, 1]))
            elif g:  # the offload engine plans its dense reads from group 0's block tables
                raise ValueError("under KV offload the host pool's layers form KV cache group 0")
            elif i in row:
                layers.append(PagedLayerKV(i, resident_kv_cache[row[i], 0], resident_kv_cache[row[i], 1]))
            else:
                layers.append(PooledLayerKV(i, engine))
            layers[-1].group = g
        num_window_blocks = 0 if window_kv_cache is None else window_kv_cache.shape[2]
        super().__init__(layers, engine.num_blocks, engine.block_size, groups, num_window_blocks)
        self.resident_layers = [i for i, layer in enumerate(layers) if isinstance(layer, PagedLayerKV)]
        if window_kv_cache is not None:
            window_kv_cache[:, :, -1].zero_()

    def bind(self, kv_write, blocks_allocated=(), decode_offload=(), prefill_offload=()) -> None:
        super().bind(kv_write, blocks_allocated)
        for layer in self.layers:
            if self.groups[layer.group].pool:
                layer.kv_write = ()
            if isinstance(layer, PooledLayerKV):
                layer.offload_hooks = (tuple(decode_offload), tuple(prefill_offload))
        self.engine.load_hooks = (tuple(decode_offload), tuple(prefill_offload))

    @property
    def wants_allocations(self) -> bool:
        return super().wants_allocations or self.engine.reuse_selections

    def blocks_allocated(self, block_ids):
        super().blocks_allocated(block_ids)
        self.engine.forget_blocks(block_ids)  # the selection cache

    def begin_step(self, decode, prefill):
        self.engine.begin_step(*(None if p is None else host_phase(p) for p in (decode, prefill)))

    def can_capture_decode(self, selects_on_device):
        # dense reads are planned on the host each step: only selections made on the device are captured
        return selects_on_device

    def capturing(self):
        return self.engine.capturing()

    def begin_capture(self):
        self.engine.begin_capture()

    def end_capture(self):
        self.engine.end_capture()

    def order_streams(self):
        self.engine.order_streams()


class HostPhaseLike(Protocol):
    """A phase as :meth:`KVStore.begin_step` takes it besides a :class:`~nanovllm.kv.offload.HostPhase`:
    the model runner's host arrays ``block_tables`` ``[num_seqs, width]``, ``cu_seqlens_q``
    ``[num_seqs + 1]`` and ``context_lens`` ``[num_seqs]``."""

    block_tables: np.ndarray
    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray


def host_phase(phase: HostPhase | HostPhaseLike) -> HostPhase:
    """``phase`` as a :class:`~nanovllm.kv.offload.HostPhase` (the offload engine's plan input)."""
    from nanovllm.kv.offload import HostPhase

    if isinstance(phase, HostPhase):
        return phase
    return HostPhase(phase.block_tables, np.diff(phase.cu_seqlens_q).tolist(), phase.context_lens.tolist())

