"""Sampling parameters of one request, with vLLM's names and defaults."""

from __future__ import annotations

import copy
import enum
import math

import attrs


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _as_stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {value!r}")
    return list(value)


def _as_id_list(value: list[int] | None) -> list[int]:
    if value is None:
        return []
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )
    if not ok:
        raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {value!r}")
    return list(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


def _as_token_ids(name: str):
    def convert(value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not value or not all(_is_int(t) and t >= 0 for t in value):
            raise ValueError(f"{name} must be None or a non-empty list of non-negative token ids, got {value!r}")
        return list(value)

    return convert


def _as_logit_bias(value: dict[int, float] | None) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be None or a dict {{token id: bias}}, got {value!r}")
    bias = {}
    for token, b in value.items():
        if isinstance(token, str) and token.isdigit():  # JSON object keys (the OpenAI API) are strings
            token = int(token)
        if not (_is_int(token) and token >= 0 and _is_number(b) and _is_finite(b)):
            raise ValueError(f"logit_bias maps token ids (ints >= 0) to finite numbers, got {{{token!r}: {b!r}}}")
        bias[token] = min(max(float(b), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return bias


def _as_bad_words(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"bad_words must be None or a list of strings, got {value!r}")
    if not all(isinstance(w, str) and w.strip() for w in value):
        raise ValueError(f"bad_words must hold non-blank strings, got {value!r}")
    return list(value)


# what torch.Generator.manual_seed accepts: a signed or an unsigned 64-bit integer
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as in vLLM and the OpenAI API

# the float fields, each checked to be finite before its range
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

# vLLM fields that nanovllm does not implement: naming one is an error that says so, never ignored
UNSUPPORTED = {
    "best_of": "return n completions with n=... (best_of is gone from vLLM's current engine too)",
    "logits_processors": "per-request logits processors are not supported",
    "structured_outputs": "structured (guided) decoding is not supported",
    "guided_decoding": "structured (guided) decoding is not supported",
    "detokenize": "outputs are always detokenized when the engine has a tokenizer",
    "extra_args": "extra_args is not supported",
    "flat_logprobs": "logprobs are returned as a list of dicts",
}


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` returns for a request: everything so far (CUMULATIVE), only what is new
    since the last output (DELTA), or one output when it finishes (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@attrs.define(kw_only=True, init=False)
class SamplingParams:
    """How to sample one request's completions, with vLLM's names and defaults. ``temperature=0`` is
    greedy; ``top_k`` 0 or -1 and ``max_tokens=None`` (up to the context limit) are off. Invalid values
    raise ``ValueError``, unknown or unsupported fields ``TypeError``."""

    n: int = 1  # completions per prompt (they share the prompt's KV blocks)
    temperature: float = 1.0  # divides the logits before sampling; 0 is greedy
    top_p: float = 1.0  # sample from the fewest most likely tokens whose probabilities reach top_p (1: all)
    top_k: int = 0  # sample from the top_k most likely tokens (0 or -1: all)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of each token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    max_tokens: int | None = 16  # the most tokens to generate (None: up to max_model_len)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings not checked, before this many
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    stop: list[str] = attrs.field(default=None, converter=_as_stop_list)  # strings that end the completion
    stop_token_ids: list[int] = attrs.field(default=None, converter=_as_id_list)  # token ids that end it
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    seed: int | None = None  # a per-request seed (completion i uses seed + i); None: the engine's generator
    logprobs: int | None = None  # top tokens to return per generated token, besides the sampled one
    prompt_logprobs: int | None = None  # top tokens to return per prompt token, besides the actual one
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what step() returns: all so far, new, or final
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode
    # added to the logits of the given token ids, clamped to [-100, 100]
    logit_bias: dict[int, float] | None = attrs.field(default=None, converter=_as_logit_bias)
    # sample only among these token ids
    allowed_token_ids: list[int] | None = attrs.field(default=None, converter=_as_token_ids("allowed_token_ids"))
    # words never generated: the last token of each is masked where the tokens before it were just generated
    bad_words: list[str] | None = attrs.field(default=None, converter=_as_bad_words)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens (-1: max_model_len - 1)

    def __init__(self, **kwargs) -> None:
        known = {f.name for f in attrs.fields(SamplingParams)}
        for name in kwargs:
            if name in UNSUPPORTED:
                raise TypeError(f"SamplingParams({name}=...) is not supported by nanovllm: {UNSUPPORTED[name]}")
            if name not in known:
                raise TypeError(
                    f"SamplingParams got an unknown field {name!r}; the fields are: {', '.join(sorted(known))}"
                )
        self.__attrs_init__(**kwargs)

    def __attrs_post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        for name in FLOAT_FIELDS:  # inf or nan would reach the sampler's arithmetic and poison its batch
            value = getattr(self, name)
            _check(not _is_number(value) or _is_finite(value), f"{name} must be a finite number, got {value!r}")
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            f"top_k must be 0 or -1 (disabled) or an int >= 1, got {self.top_k!r}",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be a number > 0 (1 means none), got {self.repetition_penalty!r}",
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an int >= 1, or None (up to the context limit), got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an int >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower min_tokens or raise max_tokens",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)),
            f"seed must be None or an int in [-2**63, 2**64 - n] (the range torch.Generator accepts; "
            f"completion i of n uses seed + i), got {self.seed!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= 0),
                f"{name} must be None or an int >= 0 (0: only the chosen token's logprob), got {value!r}",
            )
        _check(
            isinstance(self.output_kind, RequestOutputKind),
            f"output_kind must be a nanovllm.sampling_params.RequestOutputKind, got {self.output_kind!r}",
        )
        _check(
            self.truncate_prompt_tokens is None
            or (_is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
            f"truncate_prompt_tokens must be None, -1 (max_model_len - 1) or an int >= 1, "
            f"got {self.truncate_prompt_tokens!r}",
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be True or False, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Uses a feature that changes logits before sampling (besides temperature, top-k/p and min-p)."""
        return bool(
            self.has_penalties or self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words
        )

    def clone(self) -> SamplingParams:
        """A deep copy (the lists and dicts are not shared)."""
        return copy.deepcopy(self)
