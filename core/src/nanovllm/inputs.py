"""Prompt types with vLLM's names: ``generate`` takes a string, a list of token ids, or one of these dicts."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt already tokenized; the ids go to the model as they are."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt

# keys vLLM's prompt dicts may hold that nanovllm has no use for: a clear error, never silently dropped
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": "nanovllm runs text-only models",
    "mm_processor_kwargs": "nanovllm runs text-only models",
    "multi_modal_uuids": "nanovllm runs text-only models",
    "token_type_ids": "token type ids are for embedding and scoring models, which nanovllm does not run",
    "prompt_embeds": "nanovllm takes text or token ids, not embeddings",
    "cache_salt": "the prefix cache is shared by every request; there is no per-request salt",
}
