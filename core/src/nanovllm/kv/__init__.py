"""Where KV lives: the store interface (:mod:`nanovllm.kv.store`) and the host pool's offload engine
(:mod:`nanovllm.kv.offload`, imported where it is used)."""

from nanovllm.kv.store import (
    HostKVStore,
    KVStore,
    KVTransfer,
    KVWrite,
    LayerKV,
    PagedKVStore,
    PagedLayerKV,
    PooledLayerKV,
)

__all__ = [
    "HostKVStore",
    "KVStore",
    "KVTransfer",
    "KVWrite",
    "LayerKV",
    "PagedKVStore",
    "PagedLayerKV",
    "PooledLayerKV",
]
