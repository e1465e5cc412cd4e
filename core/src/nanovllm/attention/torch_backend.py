"""The ``torch`` attention backend: plain PyTorch on any device, the reference for every faster one.

Every operation pads the batch to ``[num_seqs, max_len]``, gathers keys and values through the block
table, and runs one masked softmax in float32. Clear rather than fast, except that a sliding-window layer
reads only its window: its chunks are cut into query tiles, each gathering only the blocks its windows reach,
so its cost grows with the window rather than the context.
"""

from __future__ import annotations

import torch

from nanovllm.attention.backend import AttentionBackend, selection_per_kv_head
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.kv.cache_dtype import EIGHT_BIT_FLOATS, to_cache


def _pad_index(meta: PhaseMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query row: its sequence and its index inside that sequence's chunk."""
    q_lens = meta.query_lens
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=q_lens.device), q_lens)
    row = torch.arange(seq.shape[0], device=q_lens.device) - meta.cu_seqlens_q[:-1].long()[seq]
    return seq, row


def _softmax_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[S, Q, H, D]``, k/v ``[S, K, Hkv, D]``, mask ``[S, Q, Hkv, K]`` (each KV head its own keys)
    -> out ``[S, Q, H, D]``, lse ``[S, Q, H]``."""
    s, nq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(s, nq, hkv, h // hkv, d)
    scores = torch.einsum("sqkgd,stkd->sqkgt", qg, k.float()).mul_(scale)
    scores = scores.masked_fill_(~mask[:, :, :, None, :], float("-inf"))
    # one exp pass, in place (the scores become the unnormalised weights); a row that sees no key keeps
    # all-zero weights and a logsumexp of -inf
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)
    # Cache slots no query may see (unwritten, or past a sequence's end) can hold anything, NaN included,
    # and 0 * NaN is NaN: zero those values rather than trusting the zero weight.
    seen = mask.any(dim=1).transpose(1, 2)  # [S, K, Hkv]
    v = v.float().masked_fill(~seen[..., None], 0.0)
    out = torch.einsum("sqkgt,stkd->sqkgd", weights, v).div_(total.clamp(min=torch.finfo(total.dtype).tiny))
    return out.reshape(s, nq, h, d), lse.reshape(s, nq, h)


def _gather_blocks(cache: torch.Tensor, physical: torch.Tensor) -> torch.Tensor:
    """``[S, Hkv, n]`` physical block ids, one list per KV head -> ``[S, n * block_size, Hkv, D]``:
    key ``t`` of head ``h`` is slot ``t % block_size`` of that head's ``t // block_size``-th block."""
    s, hkv, n = physical.shape
    heads = torch.arange(hkv, device=cache.device)[None, :, None]
    gathered = cache[physical.clamp(min=0).long(), :, heads]  # [S, Hkv, n, block_size, D]
    return gathered.permute(0, 2, 3, 1, 4).reshape(s, n * cache.shape[1], hkv, cache.shape[3])


def _query_tiles(meta: PhaseMetadata, tile: int) -> PhaseMetadata:
    """``meta`` with each sequence's chunk cut into tiles of ``tile`` query rows, each tile a sequence of its
    own: the same block table, its context ending at its last row. Every sequence gets the same number of
    tiles (its last ones shorter or empty), so nothing is read back from the device."""
    per_seq = -(-meta.max_query_len // tile)
    if per_seq == 1:
        return meta
    q_lens = meta.query_lens[:, None]
    bounds = torch.minimum(torch.arange(per_seq + 1, device=q_lens.device) * tile, q_lens)  # [S, per_seq + 1]
    starts = meta.cu_seqlens_q[:-1, None] + bounds[:, :-1]
    cu_seqlens_q = torch.cat([starts.flatten(), meta.cu_seqlens_q[-1:]]).int()
    context_lens = (meta.context_lens - meta.query_lens)[:, None] + bounds[:, 1:]
    tables = meta.block_tables.repeat_interleave(per_seq, dim=0)
    return PhaseMetadata(cu_seqlens_q, context_lens.flatten().int(), tables, tile, meta.max_context_len)


def _window_blocks(meta: PhaseMetadata, window: int, block_size: int) -> torch.Tensor:
    """Logical block indices ``[num_seqs, n]``, -1 padded, of the blocks that can hold a key inside some
    query's ``window``: from the block of the first query's first key to that of the last query. ``n`` is
    the most that a chunk of ``max_query_len`` rows can reach (computed on the host)."""
    width = meta.block_tables.shape[1]
    span = meta.max_query_len + window - 1  # positions from the first query's first key to the last query
    n = min(width, (span + block_size - 2) // block_size + 1)  # blocks a span can touch, at worst alignment
    first_key = (meta.context_lens - meta.query_lens - window + 1).clamp(min=0)
    idx = (first_key // block_size).long()[:, None] + torch.arange(n, device=first_key.device)
    physical = torch.gather(meta.block_tables, 1, idx.clamp(max=width - 1))
    return torch.where((idx < width) & (physical >= 0), idx, -1).int()


class TorchBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        if k_cache.dtype in EIGHT_BIT_FLOATS:
            key, value = to_cache(key, k_cache.dtype), to_cache(value, v_cache.dtype)
        flat_k[slots] = key[valid].to(k_cache.dtype)
        flat_v[slots] = value[valid].to(v_cache.dtype)

    def _over_cache(self, q, k_cache, v_cache, meta, block_indices, kv_lens, scale, causal, window=None):
        """Shared body: queries of each sequence over selected cached blocks, optionally causal, and
        with ``window`` (causal only) over the last ``window`` positions up to each query's own.

        ``block_indices`` in either form of ``attend_blocks``; each KV head gathers only its own
        selected blocks and gets its own key mask."""
        seq, row = _pad_index(meta)
        q_pad = q.new_zeros(meta.num_seqs, meta.max_query_len, *q.shape[1:])
        q_pad[seq, row] = q
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        selected = selection_per_kv_head(block_indices, hkv).long()  # [S, Hkv, n]
        tables = meta.block_tables.long()[:, None, :].expand(-1, hkv, -1)
        physical = torch.gather(tables, 2, selected.clamp(min=0))
        k = _gather_blocks(k_cache, physical).to(q.dtype)  # an 8-bit cache widened to the queries' dtype
        v = _gather_blocks(v_cache, physical).to(q.dtype)
        offsets = torch.arange(bs, device=q.device)
        key_pos = (selected[..., None] * bs + offsets).flatten(2)  # [S, Hkv, n * bs]
        key_ok = (selected[..., None] >= 0).expand(-1, -1, -1, bs).flatten(2)
        key_ok = key_ok & (key_pos < kv_lens.long()[:, None, None])
        mask = key_ok[:, None].expand(-1, meta.max_query_len, -1, -1)  # [S, Q, Hkv, n * bs]
        if causal:
            q_pos = (meta.context_lens - meta.query_lens).long()[:, None] + torch.arange(
                meta.max_query_len, device=q.device
            )
            mask = mask & (key_pos[:, None] <= q_pos[:, :, None, None])
            if window is not None:
                mask = mask & (key_pos[:, None] > q_pos[:, :, None, None] - window)
        out, lse = _softmax_attend(q_pad, k, v, mask, scale)
        return out[seq, row].to(q.dtype), lse[seq, row]

    def _all_blocks(self, meta: PhaseMetadata) -> torch.Tensor:
        n = meta.block_tables.shape[1]
        idx = torch.arange(n, device=meta.block_tables.device, dtype=torch.int32)
        return torch.where(meta.block_tables >= 0, idx, -1)

    def _over_window(self, q, k_cache, v_cache, meta, scale, window):
        """Causal attention of a sliding-window layer reading only its window: query tiles of a quarter
        window (at least a block) each, each over the blocks its queries' windows reach."""
        block_size = k_cache.shape[1]
        # each row scores its tile and a window of keys before it: smaller tiles waste fewer scores, until
        # gathering each tile's window dominates
        tiles = _query_tiles(meta, max(window // 4, block_size))
        blocks = _window_blocks(tiles, window, block_size)
        kv_lens = tiles.context_lens
        return self._over_cache(q, k_cache, v_cache, tiles, blocks, kv_lens, scale, True, window)[0]

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
        if window is not None:
            return self._over_window(q, k_cache, v_cache, meta, scale, window)
        blocks = self._all_blocks(meta)
        return self._over_cache(q, k_cache, v_cache, meta, blocks, meta.context_lens, scale, True)[0]

    def decode(self, q, k_cache, v_cache, meta, scale, window=None):
        if window is not None:
            return self._over_window(q, k_cache, v_cache, meta, scale, window)
        blocks = self._all_blocks(meta)
        return self._over_cache(q, k_cache, v_cache, meta, blocks, meta.context_lens, scale, True)[0]

    def attend_blocks(self, q, k_cache, v_cache, meta, block_indices, kv_lens, scale):
        return self._over_cache(q, k_cache, v_cache, meta, block_indices, kv_lens, scale, causal=False)

    def attend_chunk(self, q, k, v, meta, scale):
        seq, row = _pad_index(meta)
        n = meta.max_query_len
        pads = [t.new_zeros(meta.num_seqs, n, *t.shape[1:]) for t in (q, k, v)]
        for pad, t in zip(pads, (q, k, v), strict=True):
            pad[seq, row] = t
        pos = torch.arange(n, device=q.device)
        valid = pos[None, :] < meta.query_lens.long()[:, None]  # [S, n]
        mask = valid[:, None, :] & (pos[None, None, :] <= pos[None, :, None])  # [S, n, n], every KV head
        out, lse = _softmax_attend(*pads, mask[:, :, None, :].expand(-1, -1, k.shape[1], -1), scale)
        return out[seq, row].to(q.dtype), lse[seq, row]
