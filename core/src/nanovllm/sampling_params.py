"""Sampling parameters of one request, with vLLM's names and defaults."""

from __future__ import annotations

import enum

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


# what torch.Generator.manual_seed accepts: a signed or an unsigned 64-bit integer
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` returns for a request: everything so far (CUMULATIVE), only what is new
    since the last output (DELTA), or one output when it finishes (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@attrs.define(kw_only=True)
class SamplingParams:
    """How to sample one completion. ``temperature=0`` is greedy. Invalid values raise ``ValueError``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: list[str] = attrs.field(default=None, converter=_as_stop_list)
    stop_token_ids: list[int] = attrs.field(default=None, converter=_as_id_list)
    seed: int | None = None
    logprobs: int | None = None  # top tokens to return per generated token, besides the sampled one
    prompt_logprobs: int | None = None  # top tokens to return per prompt token, besides the actual one
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __attrs_post_init__(self) -> None:
        num = (int, float)
        _check(
            isinstance(self.temperature, num) and self.temperature >= 0,
            f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_p, num) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or an int >= 1, got {self.top_k!r}",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an int >= 1, got {self.max_tokens!r}",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
            f"seed must be None or an int in [-2**63, 2**64 - 1] (the range torch.Generator accepts), "
            f"got {self.seed!r}",
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
