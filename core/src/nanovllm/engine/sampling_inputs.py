"""The sampler's per-row inputs for one step, built on the host from the sequences' sampling parameters
and copied to the device: temperatures, top-k/top-p/min-p, seeded generators, and the logits processing
(logit bias, banned and allowed tokens, penalties). A feature no row uses is ``None``: no work in the
sampler."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.sampler import LogitsProcessing, PenaltyCounts


class _Edits:
    """One step's logits edits as flat index lists, gathered row by row on the host."""

    def __init__(self) -> None:
        self.add: tuple[list, list, list] = ([], [], [])  # rows, token ids, values
        self.banned: tuple[list, list, list] = ([], [], [])  # rows, token ids, required previous token
        self.restricted: list[int] = []
        self.allowed: tuple[list, list] = ([], [])  # rows, token ids
        self.penalties: tuple[list, list, list] = ([], [], [])  # rows, count slots, (rep, freq, presence)

    def gather(self, row: int, seq: Sequence) -> None:
        """``seq``'s bias, bans and allowed tokens (its penalties are gathered by the caller)."""
        p = seq.sampling_params
        if p.logit_bias:
            self.add[0].extend([row] * len(p.logit_bias))
            self.add[1].extend(p.logit_bias)
            self.add[2].extend(p.logit_bias.values())
        bans = list(seq.min_tokens_banned) if seq.num_completion_tokens < p.min_tokens else []
        output = seq.completion_token_ids
        for word in seq.bad_words_token_ids:
            k = len(word) - 1  # tokens that must precede the banned last one
            if k == 0:
                bans.append(word[0])
            elif len(output) >= k and output[len(output) - k : -1] == word[:-2]:
                self.banned[0].append(row)
                self.banned[1].append(word[-1])
                self.banned[2].append(word[-2])
        self.add[0].extend([row] * len(bans))
        self.add[1].extend(bans)
        self.add[2].extend([float("-inf")] * len(bans))
        if p.allowed_token_ids:
            self.restricted.append(row)
            self.allowed[0].extend([row] * len(p.allowed_token_ids))
            self.allowed[1].extend(p.allowed_token_ids)


class SamplingInputs:
    """Builds the sampler's inputs on ``device``, copying host arrays with ``to_device`` (the runner's);
    keeps the token counts of requests with penalties (made when a request first uses one)."""

    def __init__(self, device: torch.device, to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        self.device, self.to_device = device, to_device
        self.penalty_counts: PenaltyCounts | None = None

    def _ints(self, values: list[int]) -> torch.Tensor:
        return self.to_device(np.asarray(values, dtype=np.int64))

    def _floats(self, values: list[float]) -> torch.Tensor:
        return self.to_device(np.asarray(values, dtype=np.float32))

    def build(self, seqs: list[Sequence], vocab_size: int, input_ids: torch.Tensor,
              sample_rows: torch.Tensor | None) -> tuple:
        """The sampler's arguments after the logits, one row per sequence of ``seqs``: temperatures, top-k,
        top-p, generators, min-p, logits processing. ``input_ids`` and ``sample_rows``: the step's input ids
        and the rows that sample (``None``: every row), for multi-token bad words."""
        params = [s.sampling_params for s in seqs]
        to_device = self.to_device
        temperatures = to_device(np.array([p.temperature for p in params], dtype=np.float32))
        top_ks = top_ps = min_ps = None
        if any(p.top_k > 0 for p in params):
            top_ks = to_device(np.array([p.top_k for p in params], dtype=np.int64))
        if any(p.top_p < 1 for p in params):
            top_ps = to_device(np.array([p.top_p for p in params], dtype=np.float32))
        if any(p.min_p > 0 for p in params):
            min_ps = to_device(np.array([p.min_p for p in params], dtype=np.float32))
        generators = []
        for s in seqs:
            if s.sampling_params.seed is not None and s.generator is None:
                s.generator = torch.Generator(device=self.device).manual_seed(s.sampling_params.seed)
            generators.append(s.generator)
        processing = None
        if any(s.processes_logits for s in seqs):
            processing = self.logits_processing(seqs, vocab_size, input_ids, sample_rows)
        return temperatures, top_ks, top_ps, generators, min_ps, processing

    def logits_processing(self, seqs: list[Sequence], vocab_size: int, input_ids: torch.Tensor,
                          sample_rows: torch.Tensor | None) -> LogitsProcessing:
        """Gather this step's penalties, biases and masks into a few index tensors (built on the host from
        what the host knows; the previous token of a multi-token bad word is compared on the device)."""
        edits = _Edits()
        for row, s in enumerate(seqs):
            if not s.processes_logits:
                continue
            edits.gather(row, s)
            if s.sampling_params.has_penalties:
                self._gather_penalties(edits, row, s, vocab_size)
        ints, floats = self._ints, self._floats
        processing = LogitsProcessing(counts=self.penalty_counts)
        if edits.add[0]:
            processing.add = (ints(edits.add[0]), ints(edits.add[1]), floats(edits.add[2]))
        if edits.banned[0]:
            rows = ints(edits.banned[0])
            last_tokens = input_ids if sample_rows is None else input_ids[sample_rows]  # what each row read
            processing.conditional_ban = (rows, ints(edits.banned[1]), ints(edits.banned[2]), last_tokens[rows])
        if edits.restricted:
            processing.allowed = (ints(edits.restricted), ints(edits.allowed[0]), ints(edits.allowed[1]))
        rows, slots, penalties = edits.penalties
        if rows:
            repetition, frequency, presence = (floats(list(column)) for column in zip(*penalties, strict=True))
            processing.penalties = (ints(rows), ints(slots), repetition, frequency, presence)
        return processing

    def _gather_penalties(self, edits: _Edits, row: int, seq: Sequence, vocab_size: int) -> None:
        """``seq``'s penalties and the slot of its token counts (its prompt's and completion's tokens)."""
        if self.penalty_counts is None:
            self.penalty_counts = PenaltyCounts(vocab_size, self.device)
        p = seq.sampling_params
        prompt = self._ints(seq.token_ids[: seq.num_prompt_tokens])
        generated = self._ints([t for t in seq.completion_token_ids if t != PLACEHOLDER])
        edits.penalties[0].append(row)
        edits.penalties[1].append(self.penalty_counts.slot(seq, prompt, generated))
        edits.penalties[2].append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))


# -- per request, when it is queued -------------------------------------------------------------------------


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids as it would appear at the start of a text and after a space."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in found:
                found.append(ids)
    return found


def prepare_request(seq: Sequence, eos_token_ids: set[int], tokenizer, share_prefix: bool) -> None:
    """The token ids that the sampler masks for ``seq`` (``min_tokens``, ``bad_words``); for ``n > 1`` its
    siblings in ``seq.group`` (seeds ``seed + i``), which wait for its prompt blocks and then, with
    ``share_prefix`` (the prefix cache on), share them."""
    params = seq.sampling_params
    if params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        seq.min_tokens_banned = sorted(banned)
    if params.bad_words:
        seq.bad_words_token_ids = bad_words_token_ids(tokenizer, params.bad_words)
    if params.n == 1:
        return
    children = []
    for i in range(params.n):
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + i
        if i > 0:
            child.prompt_logprobs = None  # the first completion reports them
        children.append(child)
    seq.sampling_params = children[0]
    for i, child in enumerate(children[1:], start=1):
        sibling = Sequence(seq.token_ids, child, seq.request_id, seq.prompt_text)
        sibling.index, sibling.group, sibling.arrival_time = i, seq.group, seq.arrival_time
        sibling.min_tokens_banned, sibling.bad_words_token_ids = seq.min_tokens_banned, seq.bad_words_token_ids
        if share_prefix:
            sibling.prefix_source = seq
        seq.group.append(sibling)
