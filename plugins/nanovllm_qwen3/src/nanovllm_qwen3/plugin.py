"""Entry point of ``nanovllm-qwen3``: registers the family lazily (importing this imports no torch)."""

from nanovllm.hookspecs import hookimpl


@hookimpl
def register_model_families(registry) -> None:
    registry.add_model_family("Qwen3ForCausalLM", "nanovllm_qwen3.model:Qwen3ForCausalLM")
