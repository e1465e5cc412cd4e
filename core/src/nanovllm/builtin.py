"""Built-in defaults, registered through the same hooks and entry point group as any plugin."""

from importlib.util import find_spec

from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.hookspecs import hookimpl


@hookimpl
def register_attention_backends(registry) -> None:
    registry.add_attention_backend(
        "torch",
        "nanovllm.attention.torch_backend:TorchBackend",
        devices=("cpu", "cuda"),
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=KV_CACHE_DTYPES,
    )
    # Triton kernels (imported only when selected); the head sizes and dtypes are those its tests cover.
    if find_spec("triton") is None:  # e.g. a CPU-only PyTorch: "auto" then falls back to torch
        return
    registry.add_attention_backend(
        "triton",
        "nanovllm.attention.triton_backend:TritonBackend",
        devices=("cuda",),
        dtypes=("float16", "bfloat16", "float32"),
        head_sizes=(32, 64, 128, 256),
        kv_cache_dtypes=KV_CACHE_DTYPES,
    )


@hookimpl
def register_sparse_policies(registry) -> None:
    registry.add_sparse_policy(
        "full", "nanovllm.policies.full:FullAttentionPolicy", config="nanovllm.policies.full:FullConfig"
    )
