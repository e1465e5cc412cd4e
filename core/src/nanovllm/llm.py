"""``LLM``: the offline entry point, with vLLM's name and arguments."""

from __future__ import annotations

import json

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

# generation_config.json fields that are sampling defaults, and their SamplingParams names (vLLM's set)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class LLM(LLMEngine):
    """``LLM(model=None, **config)``; ``model`` is a Hugging Face-format directory, a hub ID or a preset, or
    unset for the built-in SmolLM2-135M-Instruct. See :class:`nanovllm.config.EngineConfig` for the options.

    An ``LLM`` is its own engine: ``generate`` and ``chat`` run on the step API (``add_request``, ``step``,
    ``has_unfinished_requests``, ``abort_request``) that ``llm.llm_engine`` offers as in vLLM."""

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine behind ``generate`` (this object: vLLM scripts reach ``get_tokenizer()`` and the
        step API through it)."""
        return self

    def get_default_sampling_params(self) -> SamplingParams:
        """A new ``SamplingParams`` with the sampling defaults of the model's ``generation_config.json``
        (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as
        ``max_tokens``), as vLLM's; ``SamplingParams()`` when the model has none of them."""
        path = self.model_path / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        defaults = {name: config[key] for key, name in GENERATION_DEFAULTS.items() if config.get(key) is not None}
        try:
            return SamplingParams(**defaults)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the sampling defaults of {str(path)!r}, {defaults}, are not valid SamplingParams: "
                             f"{exc}; fix that file, or build SamplingParams(...) yourself") from exc
