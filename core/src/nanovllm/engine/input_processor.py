"""``InputProcessor``: a request's checks and its prompt's token ids, with what they need of the engine (the
tokenizer and the model's limits). The engine has one; ``AsyncLLM``'s front-end has its own when the engine
runs in another process, so that a bad request fails at the API, before it is sent."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from nanovllm.inputs import UNSUPPORTED_PROMPT_KEYS
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int) -> None:
        """``max_logprobs``: the most logprobs a request may ask for (-1: the vocabulary size)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs

    def process(self, prompt: Prompt, params: SamplingParams, index: int = 0) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids, after every check; ``index`` names the
        request in errors."""
        text, token_ids = self.tokenize(prompt, index)
        token_ids = self.truncate(token_ids, params, index)
        self.check_length(token_ids, index)
        self.check_logprobs(params, index)
        self.check_sampling(params, index)
        return text, token_ids

    def tokenize(self, prompt: Prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            prompt = self.unpack_prompt_dict(prompt, index)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text, but this engine has no tokenizer; pass token ids")
            if not prompt:
                raise ValueError(f"prompt {index} is empty; give at least one character or token")
            return prompt, self.tokenizer.encode(prompt)
        # the checks by the set of the ids' types and their min and max, in C: per id in Python they cost a
        # served request of a thousand tokens a millisecond or two
        if isinstance(prompt, SequenceABC) and all(
            issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, prompt))
        ):
            token_ids = list(prompt)
            if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
                bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
                raise ValueError(
                    f"prompt {index} has token id(s) outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
                )
            return None, token_ids
        raise TypeError(f"prompt {index} must be a string, a list of token ids or a dict, not {prompt!r:.80}")

    @staticmethod
    def unpack_prompt_dict(prompt: dict, index: int) -> str | list[int]:
        """A :class:`~nanovllm.inputs.TextPrompt` or :class:`~nanovllm.inputs.TokensPrompt` to its text or ids."""
        for key in prompt:
            if key in UNSUPPORTED_PROMPT_KEYS:
                raise ValueError(f"prompt {index} has {key!r}, which is not supported: {UNSUPPORTED_PROMPT_KEYS[key]}")
            if key not in ("prompt", "prompt_token_ids"):
                raise ValueError(f"prompt {index} has an unknown key {key!r}; a dict prompt needs 'prompt' or "
                                 "'prompt_token_ids' (a TextPrompt or a TokensPrompt)")
        if len(prompt) != 1:
            raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids' (a TextPrompt or "
                             "a TokensPrompt), exactly one of them")
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]

    def truncate(self, token_ids: list[int], params: SamplingParams, index: int) -> list[int]:
        """``truncate_prompt_tokens``: keep the last k tokens (-1: as many as leave room for one more)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len - 1
        if keep >= self.max_model_len:
            raise ValueError(
                f"request {index}: truncate_prompt_tokens={keep} is not below max_model_len={self.max_model_len}; "
                f"use at most {self.max_model_len - 1}, or -1 for that"
            )
        return token_ids[-keep:]

    def check_length(self, token_ids: list[int], index: int) -> None:
        if not token_ids:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, which "
                "must leave room for at least one generated token. Shorten the prompt or raise max_model_len"
            )

    def check_logprobs(self, params: SamplingParams, index: int) -> None:
        limit = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is None:
                continue
            if wanted > self.vocab_size:
                raise ValueError(
                    f"request {index} asks for {name}={wanted}, more than the vocabulary's {self.vocab_size} "
                    f"tokens; ask for at most {self.vocab_size}"
                )
            if wanted > limit:
                raise ValueError(
                    f"request {index} asks for {name}={wanted}, more than max_logprobs={limit}; ask for at "
                    f"most {limit}, or raise the limit: LLM(..., max_logprobs={wanted})"
                )

    def check_sampling(self, params: SamplingParams, index: int) -> None:
        """The options that depend on this model: token ids within the vocabulary (a stop token id beyond it
        would fail the sampler's step for its whole batch), a tokenizer for words."""
        token_id_fields = (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                           ("allowed_token_ids", params.allowed_token_ids or ()))
        for name, ids in token_id_fields:
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"request {index}: token_id(s) {bad[:5]} in {name} contain out-of-vocab token ids. "
                                 f"Vocabulary size: {self.vocab_size}")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(
                f"request {index}: bad_words needs a tokenizer, and this engine has none (skip_tokenizer_init); "
                "ban token ids with logit_bias={id: -100} instead"
            )

    def check_context_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise vLLM's ``ValueError`` when the prompt and ``max_tokens`` together exceed ``max_model_len`` (the
        server's 400). ``process`` does not call it: offline, such a request stops at the limit with finish
        reason "length", as in vLLM. ``max_tokens=None`` (up to the limit) always fits."""
        if max_tokens is None or num_prompt_tokens + max_tokens <= self.max_model_len:
            return
        raise ValueError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )
