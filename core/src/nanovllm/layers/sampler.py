"""Sampling from logits: greedy, temperature, top-k, top-p, per-request seeds; and log-probabilities."""

from __future__ import annotations

import attrs
import torch
from torch import nn


class Sampler(nn.Module):
    """Samples with the exponential race (argmax of p / E with E ~ Exp(1)), which needs no sort or cumsum
    beyond top-p and no host sync. Rows with temperature 0 take the argmax."""

    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_ks: torch.Tensor | None = None,
        top_ps: torch.Tensor | None = None,
        generators: list[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(-1)
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
        return torch.where(temperatures > 0, sampled, greedy)


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
