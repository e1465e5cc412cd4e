"""Entry point of ``nanovllm-llama``: registers the family lazily (importing this imports no torch)."""

from nanovllm.hookspecs import hookimpl


@hookimpl
def register_model_families(registry) -> None:
    registry.add_model_family("LlamaForCausalLM", "nanovllm_llama.model:LlamaForCausalLM")
