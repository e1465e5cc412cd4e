"""Entry point of ``nanovllm-mistral``: registers the family lazily (importing this imports no torch)."""

from nanovllm.hookspecs import hookimpl


@hookimpl
def register_model_families(registry) -> None:
    registry.add_model_family("MistralForCausalLM", "nanovllm_mistral.model:MistralForCausalLM")
