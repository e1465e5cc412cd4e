"""Per-request outputs of the step-by-step API (``LLMEngine.add_request`` / ``step``), as vLLM's
``output_kind`` asks: cumulative, delta, or final only.

Text is detokenized incrementally: each step decodes only the new tokens together with the few decoded
just before them (so a tokenizer that drops the leading space of a piece decoded alone keeps it), and
waits while the text ends in an incomplete UTF-8 character. A request with stop strings holds back its
last ``len(longest stop) - 1`` characters until it finishes, so a stop string is never streamed.
"""

from __future__ import annotations

from nanovllm.engine.sequence import PLACEHOLDER, RawLogprobs, Sequence, SequenceStatus
from nanovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

# prompt tokens decoded ahead of the first generated token, for the separator between them
_PROMPT_CONTEXT = 4
# looked up once: an enum member read from its class costs as much as the rest of a poll's checks
_FINISHED, _DELTA, _FINAL_ONLY = SequenceStatus.FINISHED, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class OutputBuilder:
    """Sequences to vLLM's outputs, with the tokenizer (None: outputs without text). The engine has one;
    ``AsyncLLM``'s front-end has its own when the engine runs in another process."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # a fast tokenizer that cleans up no spaces decodes as its Rust tokenizer does, which ignores
        # spaces_between_special_tokens: called directly, a decode of a few tokens costs a quarter
        backend = getattr(tokenizer, "backend_tokenizer", None)
        clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend_decode = backend.decode if backend is not None and clean_up is False else None

    def detokenize(self, token_ids: list[int], params: SamplingParams | None = None) -> str:
        if self.tokenizer is None:
            return ""
        if self._backend_decode is not None:
            skip = params is None or params.skip_special_tokens
            return self._backend_decode(token_ids, skip_special_tokens=skip)
        if params is None or params.spaces_between_special_tokens:  # the tokenizers' default
            return self.tokenizer.decode(token_ids, skip_special_tokens=params is None or params.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=params.skip_special_tokens, spaces_between_special_tokens=False
        )

    def completion_text(self, seq: Sequence) -> str:
        """The text that follows the prompt. Decoded after the last few prompt tokens, because
        SentencePiece and word-level tokenizers drop the leading space of a piece decoded alone."""
        params = seq.sampling_params
        context = seq.token_ids[max(0, seq.num_prompt_tokens - _PROMPT_CONTEXT) : seq.num_prompt_tokens]
        prefix = self.detokenize(context, params)
        text = self.detokenize(context + seq.completion_token_ids, params)
        return text[len(prefix) :] if text.startswith(prefix) else self.detokenize(seq.completion_token_ids, params)

    def output(self, seq: Sequence) -> RequestOutput:
        """The output of the request of ``seq``: one completion per sequence of its group."""
        return self.request_output(seq, [self.completion(s) for s in seq.group])

    def request_output(self, seq: Sequence, completions: list[CompletionOutput]) -> RequestOutput:
        """The output of the request of ``seq``, with the ``completions`` given (a stream's, built already)."""
        first = seq.group[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None, *self.logprob_dicts(first.prompt_logprobs[1:])]
        finished = all(s.is_finished for s in seq.group)
        first_tokens = [s.first_token_time for s in seq.group if s.first_token_time is not None]
        metrics = RequestMetrics(
            first.arrival_time,
            min(first_tokens, default=None),
            max((s.last_token_time for s in seq.group if s.last_token_time is not None), default=None),
            max(s.finished_time for s in seq.group) if finished else None,
        )
        return RequestOutput(first.request_id, first.prompt_text, first.token_ids[: first.num_prompt_tokens],
                             completions, first.num_cached_tokens, prompt_logprobs, finished, metrics)

    def completion(self, seq: Sequence) -> CompletionOutput:
        text = self.completion_text(seq)
        params = seq.sampling_params
        if isinstance(seq.stop_reason, str):
            end = text.find(seq.stop_reason)
            text = text[: end + len(seq.stop_reason) if params.include_stop_str_in_output else end]
        completion = CompletionOutput(seq.index, text, seq.completion_token_ids, seq.finish_reason, seq.stop_reason,
                                      error=seq.error)
        if params.logprobs is not None:
            completion.logprobs = self.logprob_dicts(seq.logprobs)
            completion.cumulative_logprob = sum(logprobs[0] for _, logprobs, _ in seq.logprobs)
        return completion

    def logprob_dicts(self, entries: list[RawLogprobs | None]) -> list[dict[int, Logprob] | None]:
        """Per position: the position's own token first, then the top tokens, each with its text. A position
        never computed (the prompt of a request that ended with an error) is None."""
        texts: dict[int, str | None] = {}
        ids = sorted({t for entry in entries if entry is not None for t in entry[0]})
        if self.tokenizer is not None and ids:  # batch_decode([]) is not [] for every tokenizer
            texts = dict(zip(ids, self.tokenizer.batch_decode([[t] for t in ids]), strict=True))
        return [
            None if entry is None else {t: Logprob(lp, rank, texts.get(t)) for t, lp, rank in zip(*entry, strict=True)}
            for entry in entries
        ]


class OutputStream:
    """What one request (its ``n`` completions) has produced and what of it was already returned."""

    def __init__(self, seq: Sequence) -> None:
        self.first = seq.group[0]
        self.kind = seq.sampling_params.output_kind
        self.delta = self.kind is _DELTA
        self.completions = [CompletionStream(s) for s in seq.group]
        # one list for every output before the last: copying the prompt per token would cost O(prompt) each
        self.prompt_token_ids = self.first.token_ids[: self.first.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        for s in self.first.group:
            if s.status is not _FINISHED:
                return False
        return True

    def poll(self, builder: OutputBuilder) -> RequestOutput | None:
        """The output this step owes the caller, or None (nothing new, or FINAL_ONLY still running). DELTA
        outputs hold the completions with something new; the others every completion so far."""
        if self.kind is _FINAL_ONLY:
            return builder.output(self.first) if self.finished else None
        changed = []
        for stream in self.completions:
            if (completion := stream.poll(builder)) is not None:
                changed.append(completion)
        if not changed:
            return None
        completions = changed if self.delta else [s.last for s in self.completions if s.last]
        if self.finished:  # with the prompt logprobs and metrics; the completions are the streams'
            return builder.request_output(self.first, completions)
        first = self.first
        return RequestOutput(first.request_id, first.prompt_text, self.prompt_token_ids, completions,
                             first.num_cached_tokens)


class CompletionStream:
    """One completion of a request: its text decoded so far and what of it was already returned."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.delta = seq.sampling_params.output_kind is _DELTA
        self.with_logprobs = seq.sampling_params.logprobs is not None
        self.prefix_offset = max(0, seq.num_prompt_tokens - _PROMPT_CONTEXT)  # window decoded for context
        self.read_offset = seq.num_prompt_tokens  # tokens before this are in ``text``
        self.text = ""  # the completion text decoded so far
        self.logprobs: list[dict[int, Logprob]] = []  # converted once per token, with logprobs=k
        self.cumulative_logprob = 0.0  # their sum, added in order as sum() would
        self.num_tokens_seen = 0
        self.num_tokens_sent = 0  # what DELTA outputs already returned
        self.num_chars_sent = 0
        self.done = False  # its final completion was returned
        self.last: CompletionOutput | None = None  # the latest, whole (for CUMULATIVE outputs)
        stops = seq.sampling_params.stop
        self.holdback = max(map(len, stops)) - 1 if stops else 0

    def poll(self, builder: OutputBuilder) -> CompletionOutput | None:
        """This completion's news since the last poll (cut to the new part for DELTA), or None. Before the
        last, only what is returned is copied: a DELTA output costs what is new, not all so far."""
        seq = self.seq
        if seq.status is _FINISHED:
            if self.done:
                return None
            self.done = True
            return self._send(builder.completion(seq))
        ids = seq.token_ids
        end = len(ids) - (ids[-1] == PLACEHOLDER)  # a token in flight is not known yet
        num_tokens = end - seq.num_prompt_tokens
        if num_tokens == self.num_tokens_seen:
            return None
        self.num_tokens_seen = num_tokens
        self._decode(builder, ids, end)
        with_logprobs = self.with_logprobs
        if with_logprobs:
            new = seq.logprobs[len(self.logprobs) :]
            self.logprobs += builder.logprob_dicts(new)
            for _, lps, _ in new:
                self.cumulative_logprob += lps[0]
        shown = max(0, len(self.text) - self.holdback)  # a stop string may still begin in the rest
        tokens, chars = (self.num_tokens_sent, self.num_chars_sent) if self.delta else (0, 0)
        completion = CompletionOutput(seq.index, self.text[chars:shown], ids[seq.num_prompt_tokens + tokens : end], None,
                                      None, self.cumulative_logprob if with_logprobs else None,
                                      self.logprobs[tokens:] if with_logprobs else None)
        if self.delta:
            self.num_tokens_sent, self.num_chars_sent = num_tokens, shown
        else:
            self.last = completion
        return completion

    def _decode(self, builder: OutputBuilder, ids: list[int], end: int) -> None:
        """Add the text of ``ids[:end]``."""
        if builder.tokenizer is None:
            return
        if not self._decode_to(builder, ids, end):
            # several new tokens (steps merged), the last character incomplete: the text before it is shown
            # now, as one token a poll would have shown it
            for partial_end in range(self.read_offset + 1, end):
                self._decode_to(builder, ids, partial_end)

    def _decode_to(self, builder: OutputBuilder, ids: list[int], end: int) -> bool:
        """Add the text of the tokens up to ``end``; False (nothing added) while it ends in a character split
        across tokens: it waits for the rest of it."""
        prefix = builder.detokenize(ids[self.prefix_offset : self.read_offset])
        full = builder.detokenize(ids[self.prefix_offset : end])
        if full.endswith("\ufffd"):
            return False
        self.text += full[len(prefix) :] if full.startswith(prefix) else full
        self.prefix_offset, self.read_offset = self.read_offset, end
        return True

    def _send(self, completion: CompletionOutput) -> CompletionOutput:
        """CUMULATIVE: as it is. DELTA: cut to what was not returned before, and remember what was."""
        self.last = completion
        if not self.delta:
            return completion
        tokens, chars = len(completion.token_ids), len(completion.text)
        delta = CompletionOutput(completion.index, completion.text[self.num_chars_sent :],
                                 completion.token_ids[self.num_tokens_sent :], completion.finish_reason,
                                 completion.stop_reason, completion.cumulative_logprob,
                                 None if completion.logprobs is None else completion.logprobs[self.num_tokens_sent :],
                                 completion.error)
        self.num_tokens_sent, self.num_chars_sent = tokens, chars
        return delta
