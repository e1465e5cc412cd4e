"""Sampling from logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

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
