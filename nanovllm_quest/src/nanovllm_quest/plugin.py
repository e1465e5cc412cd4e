"""Entry point of ``nanovllm-quest`` (group ``nanovllm``): registration only, by lazy names."""

from nanovllm.sparse import hookimpl


@hookimpl
def register_sparse_policies(registry) -> None:
    registry.add_sparse_policy(
        "quest", "nanovllm_quest.policy:QuestPolicy", config="nanovllm_quest.config:QuestConfig",
        api_version="1.0",
    )
