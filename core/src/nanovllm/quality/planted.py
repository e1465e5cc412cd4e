"""Planted attention structure with a known ground truth, for unit tests of block selectors.

Each generator returns a :class:`PlantedAttention`: queries ``[T, H, D]``, keys and values
``[T, Hkv, D]`` (grouped-query: query head ``h`` reads KV head ``h // (H // Hkv)``) and the truth,
which key positions matter for which query and KV head. The structure lives in a few reserved
dimensions of the head; the remaining dimensions carry small random noise (logit standard deviation
about ``noise``), orthogonal to the structure so it never disturbs it. Everything is seeded.

Patterns (logits are after the softmax scale):

- ``sink_columns``: the first keys score ``strength`` for every query.
- ``vertical_columns``: a few key positions per KV head score ``strength`` for every later query.
- ``local_band``: each query attends to its ``window`` most recent keys (a narrow Gaussian-shaped kernel
  in the query-key distance, from one rotating pair of dimensions).
- ``slash_diagonals``: query ``t`` attends to keys ``t - offset`` for a few offsets (random unit codes per
  position; the query sums the codes of its targets).
- ``needles``: one needle key per KV head aligned to the queries, plus near-miss distractors (cosine
  ``similarity`` to the needle) in other blocks.
- ``block_clusters``: every key of a few logical blocks per KV head aligned to the queries.
"""

from __future__ import annotations

import math

import attrs
import torch


@attrs.define(frozen=True)
class PlantedAttention:
    """Attention inputs with a planted structure and its ground truth."""

    name: str
    q: torch.Tensor  # [T, H, D] float32
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    scale: float
    block_size: int
    truth: torch.Tensor  # [T, Hkv, T] bool: key s matters for query t at KV head g (only s <= t)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def true_blocks(self) -> torch.Tensor:
        """``[T, Hkv, num_blocks]`` bool: the logical blocks holding a true key of each query and KV head."""
        pad = self.num_blocks * self.block_size - self.num_tokens
        truth = torch.nn.functional.pad(self.truth, (0, pad))
        return truth.view(self.num_tokens, self.num_kv_heads, self.num_blocks, self.block_size).any(-1)


class _Builder:
    """Zero structure plus orthogonal noise; generators write the structure into dims ``[0, reserved)``."""

    def __init__(self, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 seed: int, noise: float, reserved: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim < reserved + 1:
            raise ValueError(f"head_dim={head_dim} is too small: this pattern needs over {reserved} dims")
        self.t, self.h, self.hkv, self.d, self.bs = num_tokens, num_heads, num_kv_heads, head_dim, block_size
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.gen = torch.Generator().manual_seed(seed)
        # Noise logit: scale * sum of q_i k_i over the free dims, std scale * sigma^2 * sqrt(d - reserved).
        sigma = math.sqrt(noise / (self.scale * math.sqrt(head_dim - reserved)))
        self.q = torch.zeros(num_tokens, num_heads, head_dim)
        self.k = torch.zeros(num_tokens, num_kv_heads, head_dim)
        self.q[:, :, reserved:] = sigma * self.randn(num_tokens, num_heads, head_dim - reserved)
        self.k[:, :, reserved:] = sigma * self.randn(num_tokens, num_kv_heads, head_dim - reserved)
        self.v = self.randn(num_tokens, num_kv_heads, head_dim)
        self.truth = torch.zeros(num_tokens, num_kv_heads, num_tokens, dtype=torch.bool)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def heads_of(self, g: int) -> slice:
        return slice(g * self.group, (g + 1) * self.group)

    def distinct_blocks(self, count: int, low_block: int = 0) -> list[int]:
        """``count`` different logical blocks at or after ``low_block`` (random, sorted)."""
        available = -(-self.t // self.bs) - low_block
        if count > available:
            raise ValueError(f"{count} distinct blocks do not fit in {available} blocks; use more tokens")
        return sorted((low_block + torch.randperm(available, generator=self.gen)[:count]).tolist())

    def done(self, name: str) -> PlantedAttention:
        causal = torch.ones(self.t, self.t, dtype=torch.bool).tril()
        truth = self.truth & causal[:, None, :]
        return PlantedAttention(name, self.q, self.k, self.v, self.scale, self.bs, truth)


def sink_columns(num_tokens: int = 512, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                 block_size: int = 16, num_sinks: int = 4, strength: float = 8.0, seed: int = 0,
                 noise: float = 0.5) -> PlantedAttention:
    """The first ``num_sinks`` keys score ``strength`` for every query, at every head."""
    b = _Builder(num_tokens, num_heads, num_kv_heads, head_dim, block_size, seed, noise, reserved=1)
    b.k[:num_sinks, :, 0] = 1.0
    b.q[:, :, 0] = strength / b.scale
    b.truth[:, :, :num_sinks] = True
    return b.done("sink_columns")


def vertical_columns(num_tokens: int = 512, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                     block_size: int = 16, columns_per_head: int = 3, strength: float = 8.0, seed: int = 0,
                     noise: float = 0.5) -> PlantedAttention:
    """``columns_per_head`` key positions per KV head (different for each head, none in the first block)
    score ``strength`` for every query after them."""
    b = _Builder(num_tokens, num_heads, num_kv_heads, head_dim, block_size, seed, noise, reserved=1)
    b.q[:, :, 0] = strength / b.scale
    for g in range(num_kv_heads):
        columns = block_size + torch.randperm(num_tokens - block_size, generator=b.gen)[:columns_per_head]
        b.k[columns, g, 0] = 1.0
        b.truth[:, g, columns] = True
    return b.done("vertical_columns")


def local_band(num_tokens: int = 512, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
               block_size: int = 16, window: int = 32, seed: int = 0, noise: float = 0.5) -> PlantedAttention:
    """Each query attends to its ``window`` most recent keys, itself included.

    Query and key rotate in one pair of dimensions at angle ``theta`` per position, so their logit is
    ``beta * cos(theta * (t - s - c))``: a Gaussian-shaped bump in the distance ``t - s``, centred on the
    window's middle ``c`` with standard deviation ``window / 4`` (about 95% of the mass inside the window).
    ``theta * T <= pi / 2`` keeps the cosine decreasing over every distance that occurs.
    """
    b = _Builder(num_tokens, num_heads, num_kv_heads, head_dim, block_size, seed, noise, reserved=2)
    theta = math.pi / (2 * num_tokens)
    centre, sigma = (window - 1) / 2, window / 4
    beta = 1 / (theta * sigma) ** 2
    pos = torch.arange(num_tokens, dtype=torch.float64)
    b.k[:, :, 0] = torch.cos(theta * pos)[:, None].float()
    b.k[:, :, 1] = torch.sin(theta * pos)[:, None].float()
    b.q[:, :, 0] = (beta / b.scale * torch.cos(theta * (pos - centre)))[:, None].float()
    b.q[:, :, 1] = (beta / b.scale * torch.sin(theta * (pos - centre)))[:, None].float()
    distance = pos[:, None] - pos[None, :]
    b.truth[:] = ((distance >= 0) & (distance < window))[:, None, :]
    return b.done("local_band")


def slash_diagonals(num_tokens: int = 512, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                    block_size: int = 16, offsets: tuple[int, ...] = (0, 48, 160), strength: float = 16.0,
                    seed: int = 0, noise: float = 0.5) -> PlantedAttention:
    """Query ``t`` attends to keys ``t - offset`` for each offset (diagonal lines of the attention map).

    Every position gets a random unit code in all but 8 dimensions of the head; each key carries its own
    code and each query the sum of its targets' codes, so a target scores about ``strength`` and any
    other key ``strength`` times a random overlap of order ``sqrt(len(offsets) / reserved)``.
    """
    reserved = head_dim - 8
    b = _Builder(num_tokens, num_heads, num_kv_heads, head_dim, block_size, seed, noise, reserved=reserved)
    for g in range(num_kv_heads):
        codes = b.randn(num_tokens, reserved)
        codes /= codes.norm(dim=-1, keepdim=True)
        b.k[:, g, :reserved] = codes
        query = torch.zeros(num_tokens, reserved)
        for offset in offsets:
            query[offset:] += codes[: num_tokens - offset]
        b.q[:, b.heads_of(g), :reserved] = (strength / b.scale * query)[:, None, :]
    pos = torch.arange(num_tokens)
    for offset in offsets:
        b.truth[pos[offset:], :, pos[offset:] - offset] = True
    return b.done("slash_diagonals")


def needles(num_tokens: int = 512, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
            block_size: int = 16, num_distractors: int = 8, strength: float = 12.0, similarity: float = 0.7,
            seed: int = 0, noise: float = 0.5) -> PlantedAttention:
    """One needle key per KV head scoring ``strength`` for every later query, plus ``num_distractors``
    near misses scoring ``similarity * strength`` (their direction is at cosine ``similarity`` to the
    needle's). Needle and distractors of a head lie in different logical blocks, after the first."""
    reserved = 8
    b = _Builder(num_tokens, num_heads, num_kv_heads, head_dim, block_size, seed, noise, reserved=reserved)
    off_axis = math.sqrt(1 - similarity**2)
    for g in range(num_kv_heads):
        direction = b.randn(reserved)
        direction /= direction.norm()
        blocks = b.distinct_blocks(1 + num_distractors, low_block=1)
        offsets = torch.randint(block_size, (len(blocks),), generator=b.gen).tolist()
        positions = [blk * block_size + off for blk, off in zip(blocks, offsets, strict=True)]
        positions = [min(p, num_tokens - 1) for p in positions]
        needle_at = positions.pop(int(torch.randint(len(positions), (1,), generator=b.gen)))
        b.k[needle_at, g, :reserved] = direction
        for p in positions:
            other = b.randn(reserved)
            other -= (other @ direction) * direction
            other /= other.norm()
            b.k[p, g, :reserved] = similarity * direction + off_axis * other
        b.q[:, b.heads_of(g), :reserved] = strength / b.scale * direction
        b.truth[:, g, needle_at] = True
    return b.done("needles")


def block_clusters(num_tokens: int = 512, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                   block_size: int = 16, clusters_per_head: int = 3, strength: float = 6.0, seed: int = 0,
                   noise: float = 0.5) -> PlantedAttention:
    """Every key of ``clusters_per_head`` logical blocks per KV head (different per head, never the first)
    scores ``strength`` for every query."""
    b = _Builder(num_tokens, num_heads, num_kv_heads, head_dim, block_size, seed, noise, reserved=1)
    b.q[:, :, 0] = strength / b.scale
    for g in range(num_kv_heads):
        for blk in b.distinct_blocks(clusters_per_head, low_block=1):
            span = slice(blk * block_size, min((blk + 1) * block_size, num_tokens))
            b.k[span, g, 0] = 1.0
            b.truth[:, g, span] = True
    return b.done("block_clusters")


GENERATORS = {
    "sink_columns": sink_columns,
    "vertical_columns": vertical_columns,
    "local_band": local_band,
    "slash_diagonals": slash_diagonals,
    "needles": needles,
    "block_clusters": block_clusters,
}
