"""Entry point of ``nanovllm-xattn`` (group ``nanovllm``): registration only, by lazy names."""

from nanovllm.sparse import hookimpl


@hookimpl
def register_sparse_policies(registry) -> None:
    registry.add_sparse_policy(
        "xattn", "nanovllm_xattn.policy:XAttentionPolicy", config="nanovllm_xattn.config:XAttentionConfig",
        api_version="1.5",
    )
