"""Entry point of ``nanovllm-qwen2``: registers the family lazily (importing this imports no torch)."""

from nanovllm.hookspecs import hookimpl


@hookimpl
def register_model_families(registry) -> None:
    registry.add_model_family("Qwen2ForCausalLM", "nanovllm_qwen2.model:Qwen2ForCausalLM")
