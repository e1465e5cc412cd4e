"""Attention-level quality of a block selection, next to the oracle and a random selection.

The queries are decode queries: query ``i`` sits at position ``positions[i]`` and sees keys
``[0, positions[i]]``, its own included. A selection names logical blocks (block ``j`` holds keys
``[j * block_size, (j + 1) * block_size)``) per query, in either form of the policy contract:
``[num_queries, k]`` shared by every head, or ``[num_queries, num_kv_heads, k]`` per KV head; int,
-1 padded. Everything is computed in float64 on the CPU.

Metrics, per query and query head unless said otherwise:

- ``mass_recall``: the share of the dense softmax mass on the selected keys.
- ``topk_recall``: the share of the ``top_k`` highest-weight keys (fewer when fewer are visible) that
  are selected.
- ``output_error``: ``||o_sel - o_dense|| / ||o_dense||``, where ``o_sel`` is attention renormalised
  over the selected keys (0 when nothing is selected, so the error is 1).
- ``policy_output_error``: the same for the output the policy itself computed, when given.
- ``density`` (per query and KV head): selected visible keys over visible keys.

Sparse prefill patterns read keys per query head rather than blocks per KV head: ``compare_key_masks``
measures a key mask ``[Q, H, T]`` the same way, its oracle the keys with the most mass per query head.

The oracle selection takes, per query and KV head, the blocks holding the most true mass summed over
the group's query heads, as many as the policy chose there; the random one takes as many visible
blocks uniformly (seeded).
"""

from __future__ import annotations

import attrs
import torch

CPU64 = {"device": "cpu", "dtype": torch.float64}


@attrs.define(frozen=True)
class DenseAttention:
    """Dense causal attention of decode queries, the reference every selection is measured against."""

    probs: torch.Tensor  # [Q, H, T] softmax weights, 0 on keys a query cannot see
    output: torch.Tensor  # [Q, H, D]
    values: torch.Tensor  # [T, Hkv, D]
    positions: torch.Tensor  # [Q] int64

    @property
    def num_kv_heads(self) -> int:
        return self.values.shape[1]

    @property
    def group(self) -> int:
        return self.probs.shape[1] // self.num_kv_heads

    @property
    def num_keys(self) -> int:
        return self.values.shape[0]

    def visible(self) -> torch.Tensor:
        """``[Q, T]`` bool: the keys each query sees."""
        return torch.arange(self.num_keys)[None, :] <= self.positions[:, None]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | list[int], scale: float
) -> DenseAttention:
    """Queries ``[Q, H, D]`` at ``positions`` over keys/values ``[T, Hkv, D]`` (positions below ``T``)."""
    q, k, v = q.to(**CPU64), k.to(**CPU64), v.to(**CPU64)
    positions = torch.as_tensor(positions, dtype=torch.int64).cpu()
    nq, h, d = q.shape
    t, hkv = k.shape[:2]
    if h % hkv or positions.shape != (nq,) or int(positions.max()) >= t or int(positions.min()) < 0:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}: need q [Q, H, D], "
            f"k/v [T, Hkv, D] with H a multiple of Hkv, and one position in [0, T) per query"
        )
    scores = torch.einsum("qgjd,tgd->qgjt", q.view(nq, hkv, h // hkv, d), k).reshape(nq, h, t) * scale
    visible = torch.arange(t)[None, :] <= positions[:, None]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    output = _attend(probs, v)
    return DenseAttention(probs, output, v, positions)


def _attend(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[Q, H, T]`` weights over ``[T, Hkv, D]`` values -> ``[Q, H, D]``."""
    nq, h, t = probs.shape
    hkv = values.shape[1]
    out = torch.einsum("qgjt,tgd->qgjd", probs.view(nq, hkv, h // hkv, t), values)
    return out.reshape(nq, h, -1)


def selection_mask(selection: torch.Tensor, dense: DenseAttention, block_size: int) -> torch.Tensor:
    """``[Q, Hkv, T]`` bool: the visible keys inside the selected blocks of each query and KV head."""
    nq, hkv, t = dense.probs.shape[0], dense.num_kv_heads, dense.num_keys
    if selection.dtype.is_floating_point or selection.dtype == torch.bool:
        raise TypeError(f"a selection holds integer block indices, got dtype {selection.dtype}")
    if selection.dim() == 2:
        selection = selection[:, None, :].expand(-1, hkv, -1)
    if selection.dim() != 3 or selection.shape[:2] != (nq, hkv):
        raise ValueError(
            f"selection of shape {tuple(selection.shape)}: expected [{nq}, k] (all heads) or "
            f"[{nq}, {hkv}, k] (per KV head), one row per query"
        )
    selection = selection.cpu().long()
    if selection.numel() and int(selection.min()) < -1:
        raise ValueError("selection entries are logical block indices or -1 (padding), got a value below -1")
    num_blocks = -(-t // block_size)
    chosen = torch.zeros(nq, hkv, num_blocks + 1, dtype=torch.bool)  # the last column collects -1 and beyond
    index = torch.where((selection >= 0) & (selection < num_blocks), selection, num_blocks)
    chosen.scatter_(2, index, True)
    keys = chosen[:, :, :num_blocks].repeat_interleave(block_size, dim=2)[:, :, :t]
    return keys & dense.visible()[:, None, :]


@attrs.define(frozen=True)
class SelectionQuality:
    """Quality of one selection for every query (and head); :meth:`summary` averages it."""

    mass_recall: torch.Tensor  # [Q, H]
    topk_recall: torch.Tensor  # [Q, H]
    output_error: torch.Tensor  # [Q, H]
    density: torch.Tensor  # [Q, Hkv] (key masks: [Q, H])
    num_blocks: torch.Tensor  # [Q, Hkv] int64: visible blocks selected (key masks: [Q, H] keys)
    policy_output_error: torch.Tensor | None = None  # [Q, H]
    unit: str = "blocks"  # what num_blocks counts

    def summary(self) -> dict[str, float]:
        out = {
            "mass_recall": self.mass_recall.mean().item(),
            "topk_recall": self.topk_recall.mean().item(),
            "output_error": self.output_error.mean().item(),
            "density": self.density.mean().item(),
            self.unit: self.num_blocks.double().mean().item(),
        }
        if self.policy_output_error is not None:
            out["policy_output_error"] = self.policy_output_error.mean().item()
        return out


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)


def selection_quality(
    dense: DenseAttention,
    selection: torch.Tensor,
    block_size: int,
    top_k: int = 10,
    policy_output: torch.Tensor | None = None,
) -> SelectionQuality:
    """Every metric of ``selection`` against ``dense`` (see the module docstring)."""
    mask = selection_mask(selection, dense, block_size)  # [Q, Hkv, T]
    mass, topk_recall, output_error, policy_error = _mask_metrics(
        dense, mask.repeat_interleave(dense.group, dim=1), top_k, policy_output
    )
    density = mask.sum(-1).double() / dense.visible().sum(-1, keepdim=True)
    num_key_blocks = -(-dense.num_keys // block_size)
    pad = num_key_blocks * block_size - dense.num_keys
    blocks = torch.nn.functional.pad(mask, (0, pad)).view(*mask.shape[:2], num_key_blocks, block_size).any(-1)
    return SelectionQuality(mass, topk_recall, output_error, density, blocks.sum(-1), policy_error)


def _mask_metrics(dense: DenseAttention, head_mask: torch.Tensor, top_k: int, policy_output: torch.Tensor | None):
    """Mass recall, top-k recall, output error and the policy's output error of keys ``[Q, H, T]``."""
    selected = dense.probs * head_mask
    mass = selected.sum(-1)
    renormalised = selected / mass.clamp(min=1e-300)[..., None]
    output_error = _relative_error(_attend(renormalised, dense.values), dense.output)
    visible = dense.visible()
    k = min(top_k, dense.num_keys)
    top = dense.probs.topk(k, dim=-1).indices  # [Q, H, k]
    counted = torch.arange(k)[None, :] < visible.sum(-1, keepdim=True).clamp(max=top_k)  # [Q, k]
    hits = head_mask.gather(2, top) & counted[:, None, :]
    topk_recall = hits.sum(-1).double() / counted.sum(-1, keepdim=True)
    policy_error = None
    if policy_output is not None:
        policy_error = _relative_error(policy_output.to(**CPU64), dense.output)
    return mass, topk_recall, output_error, policy_error


def key_mask_quality(
    dense: DenseAttention, mask: torch.Tensor, top_k: int = 10, policy_output: torch.Tensor | None = None
) -> SelectionQuality:
    """Every metric of a key-level pattern ``[Q, H, T]`` bool, one per query head (sparse prefill reads
    keys, not blocks); density and the key count are per query head."""
    if mask.shape != dense.probs.shape or mask.dtype != torch.bool:
        raise ValueError(f"a key mask is bool {tuple(dense.probs.shape)} [Q, H, T], got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    mask = mask.cpu() & dense.visible()[:, None, :]
    mass, topk_recall, output_error, policy_error = _mask_metrics(dense, mask, top_k, policy_output)
    keys = mask.sum(-1)
    density = keys.double() / dense.visible().sum(-1, keepdim=True)
    return SelectionQuality(mass, topk_recall, output_error, density, keys, policy_error, unit="keys")


def _top_keys(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[Q, H, T]`` bool: the ``counts[q, h]`` best-scoring keys of each row."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order))
    return rank < counts[..., None]


def compare_key_masks(
    dense: DenseAttention, mask: torch.Tensor, top_k: int = 10, policy_output: torch.Tensor | None = None,
    seed: int = 0,
) -> dict[str, SelectionQuality]:
    """``{"policy", "oracle", "random"}`` for a key-level pattern: the oracle reads, per query and query
    head, the keys with the most dense mass, the random one visible keys drawn uniformly, as many as the
    pattern reads there."""
    policy = key_mask_quality(dense, mask, top_k, policy_output)
    visible = dense.visible()[:, None, :].expand_as(dense.probs)
    draw = torch.rand(dense.probs.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return {
        "policy": policy,
        "oracle": key_mask_quality(dense, _top_keys(dense.probs.masked_fill(~visible, -1.0), policy.num_blocks), top_k),
        "random": key_mask_quality(dense, _top_keys(draw.masked_fill(~visible, -1.0), policy.num_blocks), top_k),
    }


def _rank_to_selection(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The ``counts[q, g]`` best-scoring blocks of ``scores [Q, Hkv, NB]`` as an ascending, -1 padded
    selection ``[Q, Hkv, max(counts)]``."""
    width = max(int(counts.max()), 1) if counts.numel() else 1
    best = scores.topk(min(width, scores.shape[-1]), dim=-1).indices
    keep = torch.arange(best.shape[-1])[None, None, :] < counts[..., None]
    big = scores.shape[-1]
    ordered = torch.where(keep, best, big).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered).to(torch.int32)


def _visible_blocks(dense: DenseAttention, block_size: int) -> torch.Tensor:
    """``[Q, NB]`` bool: the blocks holding at least one key each query sees."""
    num_blocks = -(-dense.num_keys // block_size)
    return (torch.arange(num_blocks) * block_size)[None, :] <= dense.positions[:, None]


def oracle_selection(dense: DenseAttention, counts: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per query and KV head, the ``counts[q, g]`` blocks with the most dense mass summed over the
    group's query heads: ``[Q, Hkv, max(counts)]``."""
    nq, hkv, t = dense.probs.shape[0], dense.num_kv_heads, dense.num_keys
    num_blocks = -(-t // block_size)
    mass = dense.probs.view(nq, hkv, dense.group, t).sum(2)
    mass = torch.nn.functional.pad(mass, (0, num_blocks * block_size - t))
    mass = mass.view(nq, hkv, num_blocks, block_size).sum(-1)
    mass = mass.masked_fill(~_visible_blocks(dense, block_size)[:, None, :], -1.0)
    return _rank_to_selection(mass, counts)


def random_selection(
    dense: DenseAttention, counts: torch.Tensor, block_size: int, seed: int = 0
) -> torch.Tensor:
    """Per query and KV head, ``counts[q, g]`` visible blocks drawn uniformly: ``[Q, Hkv, max(counts)]``."""
    nq, hkv = dense.probs.shape[0], dense.num_kv_heads
    num_blocks = -(-dense.num_keys // block_size)
    draw = torch.rand(nq, hkv, num_blocks, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    draw = draw.masked_fill(~_visible_blocks(dense, block_size)[:, None, :], -1.0)
    return _rank_to_selection(draw, counts)


def compare_selection(
    dense: DenseAttention,
    selection: torch.Tensor,
    block_size: int,
    top_k: int = 10,
    policy_output: torch.Tensor | None = None,
    seed: int = 0,
) -> dict[str, SelectionQuality]:
    """``{"policy", "oracle", "random"}``: the selection and the two references at its block counts."""
    policy = selection_quality(dense, selection, block_size, top_k, policy_output)
    oracle = oracle_selection(dense, policy.num_blocks, block_size)
    rand = random_selection(dense, policy.num_blocks, block_size, seed)
    return {
        "policy": policy,
        "oracle": selection_quality(dense, oracle, block_size, top_k),
        "random": selection_quality(dense, rand, block_size, top_k),
    }
