"""``LLM``: the offline entry point, with vLLM's name and arguments."""

from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """``LLM(model=None, **config)``; ``model`` is a Hugging Face-format directory, or unset for the
    built-in SmolLM2-135M-Instruct. See :class:`nanovllm.config.EngineConfig` for the options."""
