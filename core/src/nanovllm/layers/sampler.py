"""Sampling from logits: greedy, temperature, min-p, top-k, top-p, per-request seeds; penalties, biases and
token masks; and log-probabilities."""

from __future__ import annotations

import functools
from types import ModuleType

import attrs
import torch
from torch import nn

from nanovllm.layers.fused import use_fused


class Sampler(nn.Module):
    """Samples with the exponential race (argmax of p / E with E ~ Exp(1)), which needs no sort or cumsum
    beyond top-p and no host sync. Rows with temperature 0 take the argmax. ``processing`` (penalties,
    biases, masks) and ``min_ps`` are ``None`` when no row uses them, which adds no work. On CUDA, a step
    with temperatures only (no option, no seeded row) reads the logits once, in a Triton kernel and a small
    merge of its splits (:mod:`nanovllm.layers.sampler_kernels`); everything else, and the CPU, runs the
    torch code here."""

    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_ks: torch.Tensor | None = None,
        top_ps: torch.Tensor | None = None,
        generators: list[torch.Generator | None] | None = None,
        min_ps: torch.Tensor | None = None,
        processing: LogitsProcessing | None = None,
    ) -> torch.Tensor:
        plain = processing is None and min_ps is None and top_ks is None and top_ps is None
        if plain and use_fused(logits) and not any(gen is not None for gen in generators or ()):
            return _kernels().sample(logits, temperatures)
        logits = logits.float()
        if processing is not None:  # before the argmax: greedy rows obey penalties and masks too
            logits = processing.apply(logits)
        greedy = logits.argmax(dim=-1)
        scaled = logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(-1)
        if min_ps is not None:
            scaled = _apply_min_p(scaled, min_ps)
        if top_ks is not None:
            scaled = _apply_top_k(scaled, top_ks)
        if top_ps is not None:
            scaled = _apply_top_p(scaled, top_ps)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(generators or ()):
            if gen is not None:  # a seeded request draws from its own stream, whatever its batch
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        sampled = torch.where(temperatures > 0, sampled, greedy)
        if processing is not None:
            processing.record(sampled)
        return sampled


@functools.cache
def _kernels() -> ModuleType:
    """:mod:`nanovllm.layers.sampler_kernels`, imported on first use (it imports Triton)."""
    from nanovllm.layers import sampler_kernels

    return sampler_kernels


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest (``min_p = 0`` keeps all)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class PenaltyCounts:
    """Per-sequence token statistics on the device for presence, frequency and repetition penalties: a
    row (slot) per sequence that uses them, holding how often each token was generated and which tokens
    its prompt has. Each step adds the sampled tokens on the device, so nothing is read back. A slot is
    taken at a sequence's first sampling step and reclaimed once its sequence has finished."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.owners: list[object | None] = []  # the sequence holding each slot

    def slot(self, seq, prompt_ids: torch.Tensor, output_ids: torch.Tensor) -> int:
        """The slot of ``seq`` (anything with ``is_finished`` and a ``penalty_slot`` attribute); a new one
        is filled from its prompt and output token ids (device tensors)."""
        if seq.penalty_slot >= 0:
            return seq.penalty_slot
        free = [i for i, owner in enumerate(self.owners) if owner is None or owner.is_finished]
        if not free:
            self._grow(max(4, 2 * len(self.owners)))
            free = [i for i, owner in enumerate(self.owners) if owner is None]
        slot = free[0]
        if self.owners[slot] is not None:
            self.owners[slot].penalty_slot = -1
        self.owners[slot] = seq
        seq.penalty_slot = slot
        self.counts[slot] = 0  # index_put_, not bincount, whose output size would need a host sync
        self.counts[slot].index_put_((output_ids,), torch.ones_like(output_ids, dtype=torch.int32), accumulate=True)
        self.in_prompt[slot] = False
        self.in_prompt[slot].index_fill_(0, prompt_ids, True)  # a scalar fill: no value tensor to copy over
        return slot

    def _grow(self, capacity: int) -> None:
        extra = capacity - len(self.owners)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.vocab_size)])
        self.owners.extend([None] * extra)


@attrs.define
class LogitsProcessing:
    """This step's logits changes, batched over the rows that ask for them (all tensors on the device).

    - ``add``: (rows, token ids, values) added to the logits: logit_bias, and -inf for tokens banned
      outright (bad words of one token, EOS and stop tokens before min_tokens).
    - ``conditional_ban``: (rows, token ids, required previous token, each row's previous token): a
      token banned only if the row's last token is the required one (the end of a multi-token bad word;
      the last token may still be on the device with async scheduling, so the test runs there).
    - ``allowed``: (rows that restrict, their rows repeated per allowed token, the allowed token ids).
    - ``penalties``: (rows, slots in ``counts``, repetition, frequency, presence penalty per row)."""

    add: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    conditional_ban: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    counts: PenaltyCounts | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed copy of float32 ``logits [rows, vocab]``, in vLLM's order: allowed tokens, bad
        words, bias and min_tokens, then penalties."""
        logits = logits.clone()
        if self.allowed is not None:
            restricted, rows, tokens = self.allowed
            banned = torch.zeros_like(logits, dtype=torch.bool)
            # scalar fills: an indexed assignment of a Python value copies it over from the host, a sync
            banned.index_fill_(0, restricted, True)
            banned.view(-1).index_fill_(0, rows * logits.shape[1] + tokens, False)
            logits.masked_fill_(banned, float("-inf"))
        if self.add is not None:
            rows, tokens, values = self.add
            logits.index_put_((rows, tokens), values, accumulate=True)
        if self.conditional_ban is not None:
            rows, tokens, required, previous = self.conditional_ban
            values = torch.where(previous == required, float("-inf"), 0.0)
            logits.index_put_((rows, tokens), values, accumulate=True)
        if self.penalties is not None:
            rows, slots, repetition, frequency, presence = self.penalties
            counts = self.counts.counts[slots]
            generated = counts > 0
            seen = generated | self.counts.in_prompt[slots]
            part = logits[rows]
            repetition = repetition.unsqueeze(-1)
            penalised = torch.where(part > 0, part / repetition, part * repetition)
            part = torch.where(seen, penalised, part)
            part = part - frequency.unsqueeze(-1) * counts - presence.unsqueeze(-1) * generated
            logits[rows] = part
        return logits

    def record(self, sampled: torch.Tensor) -> None:
        """Count the tokens just sampled for the rows with penalties."""
        if self.penalties is not None:
            rows, slots = self.penalties[:2]
            self.counts.counts.index_put_((slots, sampled[rows]), torch.ones_like(slots, dtype=torch.int32),
                                          accumulate=True)


def _apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (``k <= 0`` keeps all)."""
    vocab = logits.shape[-1]
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab).long()
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches ``p`` (always at least the top one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    drop_sorted = before >= top_ps.unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@attrs.define
class TopLogprobs:
    """Log-probabilities of some logits rows under the raw model distribution (float32 log_softmax, before
    temperature, top-k and top-p). Column 0 is the row's own token (the sampled one, or the prompt token
    that follows), columns 1.. its ``k`` most likely tokens, best first. Ranks are 1-based over the
    whole vocabulary: 1 + the number of strictly more likely tokens."""

    token_ids: torch.Tensor  # [rows, 1 + k] int64
    logprobs: torch.Tensor  # [rows, 1 + k] float32
    ranks: torch.Tensor  # [rows, 1 + k] int64

    @classmethod
    def of(cls, logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> TopLogprobs:
        """``logits [rows, vocab]``, ``token_ids [rows]`` (each row's own token); all on the device."""
        logprobs = logits.float().log_softmax(dim=-1)
        own = logprobs.gather(-1, token_ids.unsqueeze(-1))
        own_rank = (logprobs > own).sum(dim=-1, keepdim=True) + 1
        top, top_ids = logprobs.topk(k, dim=-1)
        # a token more likely than one of the top k is itself among them, so its rank counts within them
        top_ranks = (top.unsqueeze(-2) > top.unsqueeze(-1)).sum(dim=-1) + 1
        return cls(
            torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1),
            torch.cat([own, top], dim=-1),
            torch.cat([own_rank, top_ranks], dim=-1),
        )

    @classmethod
    def cat(cls, parts: list[TopLogprobs]) -> TopLogprobs:
        if len(parts) == 1:
            return parts[0]
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in attrs.fields(cls)))

    def map(self, fn) -> TopLogprobs:
        """The same rows with ``fn`` applied to each tensor (e.g. a copy to the host)."""
        return TopLogprobs(fn(self.token_ids), fn(self.logprobs), fn(self.ranks))

    def rows(self, widths: list[int]) -> list[tuple[list[int], list[float], list[int]]]:
        """On the host: row i as plain lists of its first ``widths[i]`` columns."""
        ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [(ids[i][:w], logprobs[i][:w], ranks[i][:w]) for i, w in enumerate(widths)]
