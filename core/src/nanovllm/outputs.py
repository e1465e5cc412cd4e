"""What ``LLM.generate`` returns, with vLLM's names."""

from __future__ import annotations

import attrs


@attrs.define
class Logprob:
    """The log-probability of one token under the model's raw distribution (before temperature, top-k and
    top-p); ``rank`` is 1-based over the whole vocabulary (1 + the number of tokens more likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None  # the tokenizer's text of this one token; None without a tokenizer


@attrs.define
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request: arrival, first and last generated token read back,
    and finish (None until then)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, stop string or stop token), "length", "abort", "error" (a step failed for this completion;
    # see ``error``), or None while it runs
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # with SamplingParams(logprobs=k): sum of the generated tokens' logprobs, and per generated token
    # the sampled token and the k most likely ones; None when logprobs were not asked for
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None  # with finish_reason "error": the exception that ended it, "TypeName: message"

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # with SamplingParams(prompt_logprobs=k): None for the first prompt token (nothing predicts it), then
    # per prompt token that token and the k most likely ones; None when not asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False  # every completion has finished
    metrics: RequestMetrics | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
