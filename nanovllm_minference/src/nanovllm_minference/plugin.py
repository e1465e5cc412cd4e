"""Entry point of ``nanovllm-minference`` (group ``nanovllm``): registration only, by lazy names."""

from nanovllm.sparse import hookimpl


@hookimpl
def register_sparse_policies(registry) -> None:
    registry.add_sparse_policy(
        "minference", "nanovllm_minference.policy:MInferencePolicy",
        config="nanovllm_minference.config:MInferenceConfig", api_version="1.5",
    )
