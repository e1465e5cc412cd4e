"""Built-in defaults, registered through the same hooks and entry point group as any plugin."""

from nanovllm.hookspecs import hookimpl


@hookimpl
def register_attention_backends(registry) -> None:
    registry.add_attention_backend(
        "torch",
        "nanovllm.attention.torch_backend:TorchBackend",
        devices=("cpu", "cuda"),
        dtypes=("float32", "float16", "bfloat16"),
    )


@hookimpl
def register_sparse_policies(registry) -> None:
    registry.add_sparse_policy(
        "full", "nanovllm.policies.full:FullAttentionPolicy", config="nanovllm.policies.full:FullConfig"
    )
