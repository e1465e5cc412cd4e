"""What FlashAttention-4 runs and how a call maps onto ``flash_attn.cute.flash_attn_varlen_func``.

Decided from a call's shapes alone, never from device values: a decode step keeps one path between CUDA-graph
capture and replay. Imports nothing heavy, so the rules are unit-tested without FA4 or a GPU.

FA4's semantics relied on (flash_attn/cute in flash-attn-4 4.0.0b36):

- varlen queries ``[total_q, H, D]`` with ``cu_seqlens_q``; paged keys/values
  ``[num_pages, page_size, Hkv, D]`` with ``page_table`` ``[batch, max_pages]`` int32 and ``seqused_k`` (the keys each sequence has);
- causal masks align bottom-right: query ``i`` of a sequence with ``q`` queries and ``k`` keys sees keys up
  to ``k - q + i``, which is our convention (the chunk's queries are the last ``q`` of its ``k`` positions);
- ``window_size=(left, right)``: a query sees keys ``left`` before it to ``right`` after it;
- ``softcap``: scores become ``softcap * tanh(scale * q.k / softcap)`` before the softmax (0: off);
- ``return_lse``: log-sum-exp in natural-log units, ``[H, total_q]`` float32;
- ``num_splits`` must stay 1 on SM 9.x (it asserts "SplitKV not supported on SM 9.0");
- pages load by TMA when a page is one key tile (128 keys at head dim 128), else by cp.async per key, which
  needs a head dim that is a multiple of 16. Rows of a page past ``seqused_k`` are read by TMA, so they must
  hold finite values (a masked score still multiplies a NaN value into NaN).
"""

from __future__ import annotations

from typing import Any

# FA4's forward dtypes on SM 9.x; float8 needs SM 10.x.
FA4_DTYPES = ("float16", "bfloat16")


def fa4_refusal(arch: tuple[int, int], dtype: str, head_dim: int) -> str | None:
    """Why FA4's paged forward does not take a call on a GPU of compute capability ``arch``, else None."""
    major, minor = arch
    if major not in (9, 10, 11):
        return f"SM {major}.{minor}: FA4 has a paged-KV forward on SM 9.x and 10.x/11.x only"
    if dtype not in FA4_DTYPES:
        return f"dtype {dtype}: FA4's forward takes float16 and bfloat16"
    if major == 9 and (head_dim % 16 or not 16 <= head_dim <= 256):
        return f"head dim {head_dim}: FA4 on SM 9.x pages KV with head dims 16..256 in multiples of 16"
    if major != 9 and not (head_dim % 16 == 0 and 16 <= head_dim <= 128 or head_dim == 256):
        return f"head dim {head_dim}: FA4 on SM {major}.x takes head dims 16..128 in multiples of 16, and 256"
    return None


def window_size(window: int | None) -> tuple[int | None, int | None]:
    """Our sliding ``window`` (the query at ``p`` sees keys ``p - window + 1 .. p``) as FA4's causal
    ``(left, right)``; no window: ``(None, None)``, plain causal."""
    if window is None:
        return (None, None)
    if window < 1:
        raise ValueError(f"window {window}: a sliding window holds at least the query's own key")
    return (window - 1, 0)


def paged_args(meta: Any, scale: float, window: int | None = None, softcap: float | None = None) -> dict:
    """Keyword arguments of ``flash_attn_varlen_func(q, k_cache, v_cache, **...)`` for causal attention of
    each sequence's new queries over its whole paged context (prefill chunks with history, and decode).

    ``meta`` is a :class:`nanovllm.attention.PhaseMetadata`. With a ``window`` the block tables' -1 entries
    (the padding past a sequence's blocks) become block 0: FA4's cp.async page loads read the table for
    every key of a tile, before the window's mask applies."""
    tables = meta.block_tables if window is None else meta.block_tables.clamp(min=0)
    return dict(
        cu_seqlens_q=meta.cu_seqlens_q,
        seqused_k=meta.context_lens,
        page_table=tables,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_context_len,
        softmax_scale=scale,
        causal=True,
        window_size=window_size(window),
        softcap=softcap or 0.0,
        num_splits=1,
    )


def dense_args(meta: Any, scale: float, window: int | None = None, softcap: float | None = None,
               return_lse: bool = False) -> dict:
    """Keyword arguments of ``flash_attn_varlen_func(q, k, v, **...)`` for causal attention of each
    sequence's new tokens over those new tokens only (``k``/``v`` packed like ``q``)."""
    return dict(
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_q,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_query_len,
        softmax_scale=scale,
        causal=True,
        window_size=window_size(window),
        softcap=softcap or 0.0,
        num_splits=1,
        return_lse=return_lse,
    )
