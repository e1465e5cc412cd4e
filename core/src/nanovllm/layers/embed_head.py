"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size
from nanovllm.layers import gemv
from nanovllm.layers.linear import default_weight_loader, shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.start = self.per_rank * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of the vocabulary (read only there if ``loaded`` is lazy); the padding rows of
        the last rank stay zero."""
        start = min(self.start, self.num_embeddings)
        size = min(self.start + self.per_rank, self.num_embeddings) - start
        part = shard(loaded, 0, self.num_embeddings, start, size)
        param.data.zero_()
        default_weight_loader(param.data[:size], part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """float32 logits for the vocabulary; with ``tie_word_embeddings`` the model shares the embedding weight.

    The logits are summed in float32 and never rounded to a 16-bit model's dtype on CUDA (see
    :func:`~nanovllm.layers.gemv.matmul`): bfloat16 keeps 8 bits of mantissa, so logits near 20 would
    move in steps of 0.125 and two close candidates would tie. Only rank 0 samples, so each rank sends its
    slice of the logits to rank 0 alone: the other ranks get None and never hold the whole vocabulary's
    logits."""

    use_triton_gemv = False  # as the linear layers'

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        multiply = gemv.linear if self.use_triton_gemv else gemv.matmul
        logits = multiply(hidden, self.weight, out_dtype=torch.float32)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, parts, dst=0)
            if parts is None:
                return None
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]
