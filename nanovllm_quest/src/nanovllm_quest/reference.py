"""Quest's steps in plain torch: the CPU path of the policy and the oracle of the Triton kernels, and the
exact page masses of the ``oracle`` evaluation mode.

Metadata of one layer is ``[num_blocks, num_kv_heads, 2 * bounds, head_dim]`` in the KV dtype: per bound
and KV head, the channel-wise minimum (index ``2 * j``) and maximum (``2 * j + 1``) of bound ``j``'s keys, so
a KV head's bounds of a block are contiguous. A page's bounds are kept at its anchor, the physical block of
its first logical block (with pages of one block, every block is its own anchor). A bound covers the whole
page (the paper's, one bound), or one of the page's runs of ``bound_size`` tokens; a write's rows name their
bounds ``anchor * bounds + j`` (:class:`PageRows`). Minima and maxima of
stored keys are stored keys' values, so they are exact in any dtype. In float8 (``metadata_dtype=fp8``)
minima round down and maxima up (:func:`round_fp8`), and NaN marks a bound whose keys left the format's
range: its page scores ``+inf``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN, MAX = 0, 1
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_NAN = 0x7F  # e4m3's NaN, as the int8 bits of a float8


class PageRows(NamedTuple):
    """A write's rows grouped by the bound they fold into: ``anchor[i]`` is ``block * bounds + j``, bound
    ``j`` kept at physical ``block``, of row ``order[i]`` (-1: a skipped row), and rows of one bound are
    adjacent. ``order`` None: the rows in their own order, already grouped (pages of one block)."""

    anchor: torch.Tensor  # [T] int64
    order: torch.Tensor | None  # [T] int64


def update_metadata(
    metadata: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, rows: PageRows, bound_size: int
) -> None:
    """Fold new keys ``[T, Hkv, D]`` into the min/max of their bounds (``rows.anchor``), in place. A bound
    whose first token (``position % bound_size == 0``) is among the rows starts afresh, so a reallocated
    anchor never keeps its previous owner's bounds; otherwise the new keys widen it."""
    if rows.order is not None:
        key, positions = key[rows.order], positions[rows.order]
    keep = rows.anchor >= 0
    restart = positions[keep] % bound_size == 0
    # the touched bounds, folded in float32: [U, Hkv, 2, D]. Minima and maxima of stored keys are stored
    # keys' values, so 16-bit bounds come back exact; float8 ones are rounded outward
    pairs = metadata.unflatten(2, (-1, 2))  # [blocks, Hkv, bounds, 2, D]
    touched, at = torch.unique(rows.anchor[keep], return_inverse=True)
    block, j = touched // pairs.shape[2], touched % pairs.shape[2]
    bounds, keys = pairs[block, :, j].float(), key[keep].float()
    bounds[at[restart], :, MIN] = float("inf")
    bounds[at[restart], :, MAX] = float("-inf")
    index = at[:, None, None].expand_as(keys)
    bounds.select(2, MIN).scatter_reduce_(0, index, keys, "amin")  # a NaN (unbounded float8) bound stays NaN
    bounds.select(2, MAX).scatter_reduce_(0, index, keys, "amax")
    if metadata.dtype == FP8:
        bounds = torch.stack([round_fp8(bounds[:, :, MIN], up=False), round_fp8(bounds[:, :, MAX], up=True)],
                             dim=2)
    pairs[block, :, j] = bounds.to(metadata.dtype)


def round_fp8(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 ``x`` rounded to float8 e4m3 toward ``+inf`` (``up``) or ``-inf``: the nearest value, then one
    step outward if that fell on the wrong side. Past the range on the rounding side (above 448 up, below
    -448 down), and NaN, give NaN."""
    over = (x > FP8_MAX) if up else (x < -FP8_MAX)
    near = x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    back = near.float()
    bits = near.view(torch.int8).int()
    negative = bits < 0  # sign-magnitude: a step away from zero adds 1 to the bits either side
    if up:
        step = torch.where(back < x, torch.where(negative, -1, 1), 0)
    else:
        step = torch.where(back > x, torch.where(negative, 1, -1), 0)
    bits = torch.where(over | x.isnan(), FP8_NAN, bits + step)
    return bits.to(torch.int8).view(FP8)


def page_scores(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
    page_size: int, group_reduction: str = "max", keep_sink: bool = False, recent_pages: int = 1,
    scale: float = 1.0,
) -> torch.Tensor:
    """``[S, Hkv, P]`` float32 priority of each logical page (``P = ceil(W / (page_size / block_size))``,
    ``W`` the block-table width) for the decode queries ``q [S, H, D]`` over histories of ``kv_lens``
    tokens (``n = ceil(kv_lens / page_size)`` pages each).

    A bound for query head ``h`` is ``sum_i max(q_i * min_i, q_i * max_i)``, at least ``q . k`` for every
    key it covers; a page's is the largest of its bounds, and the query heads of a GQA group combine by
    ``group_reduction`` (``mass``: :func:`combine_shares` of ``scale`` times the bounds, the attention
    scale). The ``recent_pages`` newest pages (from ``n[s] - recent_pages``; at least the newest,
    ``n[s] - 1``), with ``keep_sink`` page 0, and pages without a bound (NaN) get ``+inf``; pages at or
    past ``n[s]`` get ``-inf``."""
    bound = head_bounds(q, metadata, block_tables, kv_lens, block_size, page_size)
    return force_pages(reduce_group(bound, group_reduction, scale), kv_lens, page_size, keep_sink,
                        recent_pages)


def select_pages(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    block_size: int, page_size: int, k: int, group_reduction: str = "max", keep_sink: bool = False,
    recent_pages: int = 1, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, blocks)``: :func:`page_scores` and the blocks of the ``k`` best pages, :func:`top_pages`
    of them. The kernels take it in two launches whatever the ``group_reduction``."""
    scores = page_scores(q, metadata, block_tables, kv_lens, block_size, page_size, group_reduction,
                         keep_sink, recent_pages, scale)
    return scores, top_pages(scores, k, kv_lens, block_size, page_size)


def head_bounds(
    q: torch.Tensor, metadata: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
    page_size: int,
) -> torch.Tensor:
    """``[S, Hkv, G, P]`` float32: each query head's page bound (:func:`page_scores`), ``+inf`` for a page
    without a bound (NaN), ``-inf`` past the history; nothing forced."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = metadata.shape[1]
    anchors = block_tables[:, :: page_size // block_size]  # [S, P]: each page's first block
    meta = metadata[anchors.clamp(min=0).long()].float().unflatten(3, (-1, 2))  # [S, P, Hkv, bounds, 2, D]
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    bound = torch.einsum("shgd,swhbd->shgwb", qg.clamp(min=0), meta[..., MAX, :]) + torch.einsum(
        "shgd,swhbd->shgwb", qg.clamp(max=0), meta[..., MIN, :]
    )
    bound = torch.where(bound.isnan(), float("inf"), bound).amax(-1)  # NaN: an unbounded float8 bound
    n = (kv_lens.long() + page_size - 1) // page_size
    return bound.masked_fill(torch.arange(bound.shape[-1], device=q.device) >= n[:, None, None, None],
                             float("-inf"))


def reduce_group(per_head: torch.Tensor, group_reduction: str, scale: float = 1.0) -> torch.Tensor:
    """``[S, Hkv, G, N]`` scores of each query head -> ``[S, Hkv, N]``: their largest (``max``), their sum
    (``sum``), or :func:`combine_shares` of ``scale`` times them (``mass``)."""
    if group_reduction == "max":
        return per_head.amax(dim=2)
    if group_reduction == "sum":
        return per_head.sum(dim=2)
    return combine_shares(per_head * scale)


def combine_shares(logits: torch.Tensor) -> torch.Tensor:
    """``[S, Hkv, G, N]`` float32 log-weights of ``N`` candidates for each query head of a GQA group ->
    ``[S, Hkv, N]``: the log of the candidates' summed shares, each head's share being its softmax over the
    finite candidates. Every head so counts for one whole attention distribution, whatever the scale of
    its logits. ``+inf`` where any head has ``+inf``, ``-inf`` where every head has ``-inf``."""
    finite = logits.isfinite()
    z = logits.masked_fill(~finite, float("-inf"))
    lse = z.logsumexp(-1, keepdim=True)
    share = torch.where(finite, z - lse.masked_fill(lse.isneginf(), 0.0), float("-inf"))
    combined = share.logsumexp(2)
    return torch.where(logits.isposinf().any(2), float("inf"), combined)


def page_masses(
    q: torch.Tensor, keys: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float,
    group_reduction: str = "max", keep_sink: bool = False, recent_pages: int = 1,
) -> torch.Tensor:
    """The oracle of :func:`page_scores`, same result contract: ``[S, Hkv, P]`` float32, each page's exact
    attention mass for the decode queries ``q [S, H, D]``. ``keys [S, W, block_size, Hkv, D]`` are the
    sequences' logical blocks (``PolicyContext.read_keys``); a query head's mass of a page is the sum over
    its keys of the head's softmax of ``scale * q . k`` over the first ``kv_lens`` keys, and the query
    heads of a GQA group combine by ``group_reduction``. Forced and absent pages as in :func:`page_scores`."""
    num_seqs, width, block_size, num_kv_heads, head_dim = keys.shape
    num_pages = -(-width // (page_size // block_size))
    pad = num_pages * page_size - width * block_size
    k = torch.nn.functional.pad(keys.float().flatten(1, 2), (0, 0, 0, 0, 0, pad))  # [S, P * page, Hkv, D]
    qg = q.float().view(num_seqs, num_kv_heads, -1, head_dim)
    logits = torch.einsum("shgd,snhd->shgn", qg, k) * scale
    past = torch.arange(k.shape[1], device=q.device) >= kv_lens.long()[:, None, None, None]
    probs = logits.masked_fill(past, float("-inf")).softmax(-1)
    mass = probs.view(*probs.shape[:3], num_pages, page_size).sum(-1)  # [S, Hkv, G, P]
    score = mass.amax(dim=2) if group_reduction == "max" else mass.sum(dim=2)
    return force_pages(score, kv_lens, page_size, keep_sink, recent_pages)


def rescore_pages(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    nominees: torch.Tensor, scores: torch.Tensor, group_reduction: str = "max", scale: float = 1.0,
) -> torch.Tensor:
    """``[S, Hkv, C]`` float32 exact scores of the nominated pages ``nominees [S, Hkv, C]`` (pages of one
    block as logical blocks, -1 padded; :func:`top_pages` of ``scores [S, Hkv, P]``): a nominee scores the
    largest ``q . k`` of its keys for each query head (keys at or past ``kv_lens`` left out), the page
    bound taken over one key, its GQA group's combined by ``group_reduction``. With ``mass`` a head's
    score is instead the log of the page's exact attention weight, ``logsumexp`` of ``scale * q . k`` over
    its keys, and the group's combine by :func:`combine_shares` (shares of the nominees). A page ``scores``
    forces (``+inf``) stays ``+inf``, padding is ``-inf``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    valid = nominees >= 0
    pages = nominees.clamp(min=0).long()  # [S, Hkv, C]
    phys = block_tables.long().gather(1, pages.flatten(1)).view_as(pages)
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    keys = k_cache.transpose(1, 2)[phys, heads].float()  # [S, Hkv, C, block, D]
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = torch.einsum("shgd,shcjd->shgcj", qg, keys)
    pos = pages[:, :, None, :, None] * block_size + torch.arange(block_size, device=q.device)
    logits = logits.masked_fill(pos >= kv_lens.long()[:, None, None, None, None], float("-inf"))
    if group_reduction == "mass":
        exact = combine_shares(torch.where(valid[:, :, None, :], (logits * scale).logsumexp(-1), float("-inf")))
    else:
        best = logits.amax(-1)  # [S, Hkv, G, C]
        exact = best.amax(2) if group_reduction == "max" else best.sum(2)
    return rescored(exact, nominees, scores)


def pick_by_keys(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
    nominees: torch.Tensor, scores: torch.Tensor, k: int, group_reduction: str = "max", scale: float = 1.0,
) -> torch.Tensor:
    """``[S, Hkv, k]`` int32 pages: :func:`pick_nominees` by the nominees' :func:`rescore_pages`. The kernels
    take it in two launches whatever the ``group_reduction``."""
    exact = rescore_pages(q, k_cache, block_tables, kv_lens, nominees, scores, group_reduction, scale)
    return pick_nominees(exact, nominees, k)


def rescored(exact: torch.Tensor, nominees: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The nominees' scores ``exact [S, Hkv, C]`` with the pages ``scores`` forces ``+inf`` and padding
    ``-inf``."""
    forced = scores.gather(-1, nominees.clamp(min=0).long()) == float("inf")
    return torch.where(nominees >= 0, torch.where(forced, float("inf"), exact), float("-inf"))


def pick_nominees(exact: torch.Tensor, nominees: torch.Tensor, k: int) -> torch.Tensor:
    """``[S, Hkv, k]`` int32: :func:`top_pages`' selection of ``k`` among the nominees by their scores
    ``exact [S, Hkv, C]``, written as their pages ``nominees [S, Hkv, C]`` (ascending), so ascending too, -1
    padded."""
    every = torch.full(exact.shape[:1], exact.shape[-1], device=exact.device)  # no nominee is past a history
    picked = top_pages(exact, k, every, 1, 1).long()  # indices into the nominees
    return torch.where(picked >= 0, nominees.long().gather(-1, picked.clamp(min=0)), -1).to(torch.int32)


def force_pages(score: torch.Tensor, kv_lens: torch.Tensor, page_size: int, keep_sink: bool,
                 recent_pages: int) -> torch.Tensor:
    """``score [S, Hkv, P]`` with the ``recent_pages`` newest pages (at least one) and page 0 with
    ``keep_sink`` ``+inf``, pages past the history ``-inf``."""
    idx = torch.arange(score.shape[-1], device=score.device)
    n = ((kv_lens.long() + page_size - 1) // page_size)[:, None, None]
    forced = idx >= n - max(1, recent_pages)
    if keep_sink:
        forced = forced | (idx == 0)
    score = torch.where(forced, float("inf"), score)
    return torch.where(idx < n, score, float("-inf"))


def top_pages(
    scores: torch.Tensor, k: int, kv_lens: torch.Tensor, block_size: int, page_size: int
) -> torch.Tensor:
    """``[S, Hkv, k * page_size / block_size]`` int32 logical blocks: per row the ``k`` highest-scoring
    pages (ties: the lower index), ascending, each expanded to its blocks that hold history (below
    ``ceil(kv_lens / block_size)``), -1 padded; ``-inf`` (and NaN) scores are never chosen."""
    width = scores.shape[-1]
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    ordered = torch.sort(scores, dim=-1, descending=True, stable=True)
    take = min(k, width)
    pages = ordered.indices[..., :take]
    pages = torch.where(ordered.values[..., :take] > float("-inf"), pages, width).sort(dim=-1).values
    pages = torch.where(pages < width, pages, -1)
    if take < k:
        pages = torch.cat([pages, pages.new_full((*pages.shape[:-1], k - take), -1)], dim=-1)
    per_page = page_size // block_size
    blocks = pages[..., None] * per_page + torch.arange(per_page, device=scores.device)  # [S, Hkv, k, per_page]
    history = ((kv_lens.long() + block_size - 1) // block_size)[:, None, None, None]
    return torch.where((pages[..., None] >= 0) & (blocks < history), blocks, -1).flatten(-2).to(torch.int32)

