"""nanovllm: a small, fast LLM inference engine built as a plugin framework.

``LLM`` and ``AsyncLLM`` are imported lazily so that ``import nanovllm`` (and listing plugins) does not import torch.
"""

from nanovllm.engine_args import EngineArgs
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from nanovllm.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
