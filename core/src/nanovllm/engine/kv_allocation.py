"""The KV store sizing and allocation step of the model runner's set-up: the one place that picks where KV
lives (:mod:`nanovllm.kv.store`), sizes it from the memory left after a profiled step, allocates it, binds it
to the attention layers and the policies' hooks, and has the policies allocate their per-block metadata."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, forward_context
from nanovllm.config import EngineConfig
from nanovllm.distributed import agree_min
from nanovllm.kv.groups import (
    KVCacheGroup,
    blocks_per_sequence,
    kv_cache_groups,
    needs_null_block,
    num_slots,
    offload_groups,
)
from nanovllm.kv.offload import OffloadEngine
from nanovllm.kv.cache_dtype import kv_cache_torch_dtype
from nanovllm.kv.store import HostKVStore, KVStore, PagedKVStore
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import TopLogprobs
from nanovllm.policy import PolicyHooks

CPU_DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes of KV (and policy metadata) on the CPU device by default


@attrs.frozen
class KVShape:
    """What one KV block of the model costs: its layers, heads, head size, tokens, the model's dtype (the
    policies' metadata), the device, and the cache's element type (``kv_cache_dtype``; default the model's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    cache_dtype: torch.dtype = attrs.field(default=attrs.Factory(lambda shape: shape.dtype, takes_self=True))

    def kv_bytes(self, num_layers: int | None = None) -> int:
        """Bytes of K and V of one block in ``num_layers`` layers (default: all)."""
        num_layers = self.num_layers if num_layers is None else num_layers
        itemsize = self.cache_dtype.itemsize
        return 2 * num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def metadata_bytes(self, hooks: PolicyHooks) -> int:
        """Device bytes of the per-block metadata the policies will keep, per block."""
        shape = (self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype, self.device)
        return sum(p.metadata_bytes_per_block(*shape) for p in hooks.policies)

    def empty_cache(self, num_layers: int, num_blocks: int) -> torch.Tensor:
        """A paged cache ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        return torch.empty(num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                           dtype=self.cache_dtype, device=self.device)


def allocate_kv_store(
    config: EngineConfig, model: torch.nn.Module, layers: Sequence[Attention], hooks: PolicyHooks,
    max_model_len: int, dtype: torch.dtype, device: torch.device, prompt_logprob_rows: int,
) -> KVStore:
    """The model's KV store: the paged GPU cache, or with ``kv_offloading_size`` the host pool with GPU
    slots (the sliding-window layers' windows in a GPU pool of their own). Bound to ``layers`` and to the
    ``hooks`` it tells, with the hooks' members (policies, observers) initialized for its blocks. On CUDA
    the budget is what a profiled largest step (with ``prompt_logprob_rows`` rows of prompt logprobs)
    leaves under ``gpu_memory_utilization``; every tensor-parallel rank holds the blocks the scheduler
    plans."""
    first = layers[0]
    shape = KVShape(len(layers), first.num_kv_heads, first.head_dim, config.block_size, dtype, device,
                    kv_cache_torch_dtype(config.kv_cache_dtype, dtype))

    def free_memory() -> int:
        return profile_free_cuda_memory(model, config, max_model_len, device, prompt_logprob_rows)

    groups = layer_groups(config, layers)
    if config.kv_offloading_size is None:
        num_blocks = agree_min(gpu_cache_blocks(config, shape, hooks, max_model_len, free_memory, groups))
        store: KVStore = PagedKVStore(shape.empty_cache(num_slots(groups), num_blocks), groups)
    else:
        for policy in hooks.policies:  # before the pool: options that need the GPU cache fail now
            policy.check_offload()
        store = host_store(config, shape, layers, hooks, max_model_len, free_memory, groups)
    for layer, kv in zip(layers, store.layers, strict=True):
        layer.bind_kv(kv)
    store.bind(hooks.kv_write, hooks.blocks_allocated, hooks.decode_offload, hooks.prefill_offload)
    for member in hooks.members:  # the policies, and observers that keep per-block state
        if callable(getattr(member, "initialize", None)):
            member.initialize(shape.num_layers, shape.num_kv_heads, shape.head_dim, store.num_blocks,
                              shape.block_size, dtype, device)
    return store


def layer_groups(config: EngineConfig, layers: Sequence[Attention]) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups of the model's attention ``layers``: by their windows (hybrid KV; under KV offload
    the full-attention layers in one group, over the host pool, and the window groups in a GPU pool of their
    own), or one group of every layer with ``disable_hybrid_kv_cache_manager``."""
    windows = [layer.sliding_window for layer in layers]
    if config.disable_hybrid_kv_cache_manager:
        return kv_cache_groups(windows, hybrid=False)
    if config.kv_offloading_size is not None and any(w is None for w in windows):
        return offload_groups(windows)
    return kv_cache_groups(windows)


def gpu_cache_blocks(config: EngineConfig, shape: KVShape, hooks: PolicyHooks, max_model_len: int,
                     free_memory, groups: Sequence[KVCacheGroup] | None = None, pool: int = 0) -> int:
    """Blocks of the paged GPU cache: ``kv_cache_memory`` bytes, else on the CPU
    ``CPU_DEFAULT_KV_CACHE_MEMORY``, else what ``free_memory()`` profiles, each block with its metadata. A
    block holds one layer slot per layer of the largest KV cache group of ``groups`` (default: one group,
    every layer) in ``pool`` (1: the window groups' own pool under KV offload, whose blocks keep no policy
    metadata); one sequence of ``max_model_len`` tokens must fit, each of those groups counting what it
    keeps."""
    groups = [g for g in groups or (KVCacheGroup(tuple(range(shape.num_layers))),) if g.pool == pool]
    per_block = shape.kv_bytes(num_slots(groups, pool))
    if not pool:
        per_block += shape.metadata_bytes(hooks)  # metadata: the same budget
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif shape.device.type == "cpu":
        budget = CPU_DEFAULT_KV_CACHE_MEMORY
    else:
        budget = free_memory()
    num_blocks = int(budget // per_block)
    null = int(needs_null_block(groups))
    chunk = config.max_num_batched_tokens
    needed = blocks_per_sequence(groups, max_model_len, shape.block_size, chunk) + null
    if num_blocks < needed:
        short = (f"{num_blocks * shape.block_size} tokens, fewer than max_model_len={max_model_len}"
                 if len(groups) == 1 and not null else
                 f"{num_blocks} blocks of {shape.block_size} tokens, fewer than the {needed} that one sequence "
                 f"of max_model_len={max_model_len} tokens needs in its {len(groups)} KV cache groups")
        what = "the sliding-window layers' GPU KV budget under offload" if pool else "the KV cache budget"
        raise ValueError(
            f"{what} ({budget / 2**20:.0f} MiB) holds {short}; raise "
            f"{'kv_cache_memory' if shape.device.type == 'cpu' else 'gpu_memory_utilization'} "
            f"{'or lower kv_offloading_buffer_size ' if pool else ''}or lower max_model_len"
        )
    return num_blocks


def resident_layers(layers: Sequence[Attention], hooks: PolicyHooks) -> list[int]:
    """The layers the policies run dense, and the sliding-window layers (always dense over their
    window), whose KV stays on the GPU under offload."""
    num_layers = len(layers)
    resident = sorted(hooks.dense_layers(num_layers))
    if any(not 0 <= i < num_layers for i in resident):
        raise ValueError(
            f"the policies' dense_layers {resident} are not all layers of this {num_layers}-layer model"
        )
    windowed = {i for i, layer in enumerate(layers) if layer.sliding_window is not None}
    resident = sorted(set(resident) | windowed)
    if len(resident) == num_layers:
        raise ValueError(
            f"all {num_layers} layers dense (the policies' dense_layers and the sliding-window layers), so "
            "their KV stays on the GPU and nothing is left to offload: drop kv_offloading_size, or make "
            "fewer layers dense (e.g. a smaller skip_layers)"
        )
    return resident


def host_store(config: EngineConfig, shape: KVShape, layers: Sequence[Attention], hooks: PolicyHooks,
               max_model_len: int, free_memory, groups: Sequence[KVCacheGroup]) -> HostKVStore:
    """KV of the offloaded layers in a host pool of ``kv_offloading_size`` GiB; the GPU keeps the load
    slots (``kv_offloading_buffer_size`` GiB), the policies' per-block metadata and the paged cache of the
    layers resident over the pool's blocks (the dense ones; in the uniform layout the sliding-window ones
    too) for every pool block, which must all fit what the memory profile leaves under the utilisation cap.
    With hybrid ``groups`` the window groups' pool (1) takes what is left of it, or ``kv_cache_memory``, or
    on the CPU ``CPU_DEFAULT_KV_CACHE_MEMORY`` (:func:`gpu_cache_blocks`)."""
    resident = resident_layers(layers, hooks)
    windowed = {i for group in groups if group.pool for i in group.layer_ids}
    over_pool = [i for i in resident if i not in windowed]
    offloaded = [i for i in range(len(layers)) if i not in resident]
    num_blocks = int(config.kv_offloading_size * 2**30 // shape.kv_bytes(len(offloaded)))
    if num_blocks * shape.block_size < max_model_len:
        raise ValueError(
            f"kv_offloading_size={config.kv_offloading_size} GiB holds {num_blocks * shape.block_size} "
            f"tokens of KV, fewer than max_model_len={max_model_len}; raise it or lower max_model_len"
        )
    engine = OffloadEngine(
        offloaded, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device,
        int(config.kv_offloading_buffer_size * 2**30), config.max_num_seqs, config.kv_offloading_reuse_selections,
    )
    metadata = num_blocks * shape.metadata_bytes(hooks)
    resident_bytes = num_blocks * shape.kv_bytes(len(over_pool))
    fixed, left = engine.gpu_bytes + metadata + resident_bytes, None
    if shape.device.type == "cuda":
        budget = free_memory() + engine.gpu_bytes  # the slots exist already
        left = budget - fixed
        if left < 0:
            raise ValueError(
                f"with KV offload the GPU needs {engine.gpu_bytes / 2**20:.0f} MiB of load slots, "
                f"{metadata / 2**20:.0f} MiB of policy metadata and {resident_bytes / 2**20:.0f} MiB for the KV "
                f"of the {len(over_pool)} dense layers it keeps resident, more than the "
                f"{budget / 2**20:.0f} MiB left under gpu_memory_utilization; raise it, lower "
                "kv_offloading_buffer_size, or lower kv_offloading_size (each pool block has its dense "
                "layers' KV on the GPU)"
            )
    window_kv_cache = None
    if windowed:  # what the GPU has left goes to the window groups' blocks
        num_window_blocks = agree_min(
            gpu_cache_blocks(config, shape, hooks, max_model_len, lambda: left, groups, pool=1))
        window_kv_cache = shape.empty_cache(num_slots(groups, pool=1), num_window_blocks)
    # the resident layers' paged caches, allocated after the memory profile, which runs without a cache
    return HostKVStore(len(layers), engine, over_pool, shape.empty_cache(len(over_pool), num_blocks), groups,
                       window_kv_cache)


@torch.inference_mode()
def profile_free_cuda_memory(model: torch.nn.Module, config: EngineConfig, max_model_len: int,
                             device: torch.device, prompt_logprob_rows: int) -> int:
    """Run the largest step once without a cache; what remains under the utilisation cap is for KV."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    meta = StepMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        positions=torch.zeros(num_tokens, dtype=torch.long, device=device),
        num_decode_tokens=0,
        decode=None,
        prefill=PhaseMetadata(cu, lens_t, torch.empty(len(lens), 0, dtype=torch.int32, device=device),
                              max(lens), max(lens)),
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with forward_context(meta):
        hidden = model(ids, ids.clone())
        model.compute_logits(hidden[cu[1:].long() - 1])
        # the largest slice of prompt logprobs: its logits and (rank 0, which gets them) their log_softmax
        rows = hidden[: min(prompt_logprob_rows, num_tokens)]
        logits = model.compute_logits(rows)
        if logits is not None:
            TopLogprobs.of(logits, ids[: rows.shape[0]], 1)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    peak, current = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    return int(total * config.gpu_memory_utilization - used - (peak - current))
