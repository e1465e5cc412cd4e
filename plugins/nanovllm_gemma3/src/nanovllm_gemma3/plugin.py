"""Entry point of ``nanovllm-gemma3``: registers the family lazily (importing this imports no torch)."""

from nanovllm.hookspecs import hookimpl


@hookimpl
def register_model_families(registry) -> None:
    registry.add_model_family("Gemma3ForCausalLM", "nanovllm_gemma3.model:Gemma3ForCausalLM")
