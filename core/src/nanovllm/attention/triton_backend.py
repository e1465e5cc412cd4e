"""The ``triton`` attention backend: Triton kernels over the paged KV cache, same semantics as ``torch``.

- ``store_kv``: one program per new token. Over the paged GPU cache the model's RoPE kernel writes the keys
  and values instead (``kv_write_fusable``), one launch fewer a layer.
- ``prefill``: varlen causal FlashAttention over each sequence's whole context (prefix-cache hits and
  chunked prefill). Sequences with no cached prefix read their new keys and values directly, a single one
  through torch SDPA (cuDNN / flash) when ``sdpa_prefill`` is on. Otherwise the context is read through the
  block table, or, where pages are smaller than the kernel's TMA key tiles, from a copy of it in larger
  pages (``staged_cache``).
- ``staged_cache``: the phase's contexts copied into pages of ``STAGED_PAGE`` tokens in the workspace that
  :meth:`TritonBackend.reserve_workspace` allocates, for phases large enough to repay the copy
  (:func:`~nanovllm.attention.triton_kernels.stages_phase`) whose contexts fit it; sparse policies read
  them through ``PolicyContext.read_staged``.
- ``prefill`` and ``decode`` take a sliding ``window``: the kernels mask it and skip the tiles before it.
- ``decode``: split-KV paged decoding, the KV of a GQA group read once for all its query heads,
  then a log-sum-exp reduce. No host synchronisation and no data-dependent shapes: capturable in a
  CUDA graph (the number of splits depends only on the batch, the heads and ``max_context_len``).
- ``attend_blocks``: the decode kernel (one query per sequence) or the prefill kernel (chunks) over
  lists of selected logical blocks (per sequence, or per KV head), with log-sum-exp.
- ``attend_chunk``: the prefill kernel over the dense new keys/values only, with log-sum-exp.
- ``merge``: the base class's.

On CPU tensors the kernels run under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before :mod:`nanovllm.attention.triton_kernels` is first imported; that is
for tests only. The engine registers this backend for CUDA devices.
"""

from __future__ import annotations

import torch

from nanovllm.attention import triton_kernels as tk
from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import PhaseMetadata


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    kv_write_fusable = True
    # Single-sequence prefill without a cached prefix through torch SDPA's cuDNN kernel instead of the
    # Triton one: cuDNN is faster on a fresh causal prompt at every length (`nanovllm bench kernels`).
    # Several sequences, or a cached prefix: Triton.
    sdpa_prefill = True
    sdpa_mode = "cudnn"  # see _sdpa_causal
    # None: stage contexts where tk.stages_paged_contexts says it pays; True / False: always / never (tests)
    stage_contexts: bool | None = None

    def __init__(self, config: object | None = None) -> None:
        super().__init__(config)
        self.workspace: torch.Tensor | None = None  # [2, tokens, Hkv, D]: staged keys, then values

    def reserve_workspace(self, num_kv_heads, head_dim, block_size, dtype, device, max_model_len) -> None:
        """Room to stage ``max_model_len`` tokens of one layer's keys and values, where staging pays."""
        stages = self.stage_contexts
        if stages is None:
            stages = tk.stages_paged_contexts(head_dim, dtype, device, block_size)
        self.workspace = None  # before the new one: the old one's memory is free for it
        if stages:
            rows = -(-max_model_len // tk.STAGED_PAGE) * tk.STAGED_PAGE
            self.workspace = torch.empty(2, rows, num_kv_heads, head_dim, dtype=dtype, device=device)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        tk.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def prefill(
        self, q, k, v, k_cache, v_cache, meta: PhaseMetadata, scale: float, window: int | None = None
    ) -> torch.Tensor:
        one_fresh = meta.num_seqs == 1 and meta.max_context_len == meta.max_query_len
        # cuDNN takes no prompt of one token
        if one_fresh and self.sdpa_prefill and q.is_cuda and window is None and q.shape[0] > 1:
            return _sdpa_causal(q, k, v, scale, self.sdpa_mode)
        out = _empty_out(q)
        if one_fresh or (meta.host_lens is not None and meta.query_lens_host == meta.context_lens_host):
            # nothing cached before any sequence: the new keys are all there is
            if not tk.same_layout(k, v):  # the kernel reads both with one layout; a model may norm k, not v
                k, v = k.contiguous(), v.contiguous()
            tk.attention_rows(
                q, k, v, out, None, meta.cu_seqlens_q, None, None, None, meta.max_query_len, scale,
                paged=False, causal=True, window=window,
            )
            return out
        staged = self.staged_cache(k_cache, v_cache, meta) if window is None else None
        if staged is not None:  # pages whose key tiles load through TMA
            k_cache, v_cache, tables = staged
            tk.attention_rows(
                q, k_cache, v_cache, out, None, meta.cu_seqlens_q, meta.context_lens, tables, None,
                meta.max_query_len, scale, paged=True, causal=True,
            )
            return out
        tk.attention_rows(
            q, k_cache, v_cache, out, None, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, None,
            meta.max_query_len, scale, paged=True, causal=True, window=window,
        )
        return out

    def staged_cache(self, k_cache, v_cache, meta: PhaseMetadata):
        """The phase's contexts copied into the workspace in pages of ``STAGED_PAGE`` tokens, where that pays
        (:func:`~nanovllm.attention.triton_kernels.stages_phase`) and they fit: ``(k_pages, v_pages,
        block_tables)``; else None (no workspace, or one reserved for another cache shape or dtype, a small
        phase, no host lengths, cache pages that do not divide a staged page, contexts that do not fit)."""
        page, room = tk.STAGED_PAGE, self.workspace
        if room is None or meta.context_lens_host is None or page % k_cache.shape[1]:
            return None
        if room.shape[2:] != k_cache.shape[2:] or room.dtype != k_cache.dtype:  # reserved for another cache
            return None
        pages = sum(-(-n // page) for n in meta.context_lens_host)
        fits = pages * page <= room.shape[1]
        if not fits or not tk.stages_phase(meta.max_query_len, meta.max_context_len):
            return None
        k_pages, v_pages = room[:, : pages * page].unflatten(1, (pages, page))
        tables = torch.empty(meta.num_seqs, -(-meta.max_context_len // page), dtype=torch.int32,
                             device=k_cache.device)
        tk.stage_context(k_cache, v_cache, meta.block_tables, meta.context_lens, meta.max_context_len,
                         k_pages, v_pages, tables)
        return k_pages, v_pages, tables

    def decode(
        self, q, k_cache, v_cache, meta: PhaseMetadata, scale: float, window: int | None = None
    ) -> torch.Tensor:
        out = _empty_out(q)
        tk.attention_decode(
            q, k_cache, v_cache, out, None, meta.context_lens, meta.block_tables, None,
            meta.max_context_len, scale, window=window,
        )
        return out

    def attend_blocks(self, q, k_cache, v_cache, meta, block_indices, kv_lens, scale):
        if block_indices.shape[-1] > 1 and block_indices.stride(-1) != 1:  # the kernels read rows as int32 runs
            block_indices = block_indices.contiguous()
        out = _empty_out(q)
        lse = _empty_lse(q)
        if block_indices.shape[-1] == 0:
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        if meta.max_query_len == 1:  # one query per sequence: split-KV decode kernel
            max_keys = block_indices.shape[-1] * k_cache.shape[1]
            tk.attention_decode(
                q, k_cache, v_cache, out, lse, kv_lens, meta.block_tables, block_indices, max_keys, scale,
            )
        else:
            tk.attention_rows(
                q, k_cache, v_cache, out, lse, meta.cu_seqlens_q, kv_lens, meta.block_tables, block_indices,
                meta.max_query_len, scale, paged=True, causal=False,
            )
        return out, lse

    def attend_chunk(self, q, k, v, meta: PhaseMetadata, scale: float):
        if not tk.same_layout(k, v):  # k comes out of RoPE contiguous, v is still a view of the qkv output
            k, v = k.contiguous(), v.contiguous()
        out = _empty_out(q)
        lse = _empty_lse(q)
        tk.attention_rows(
            q, k, v, out, lse, meta.cu_seqlens_q, None, None, None, meta.max_query_len, scale,
            paged=False, causal=True,
        )
        return out, lse


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    """Every output buffer comes from here (tests replace it with one that is poisoned)."""
    return torch.empty_like(q)


def _empty_lse(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mode: str = "cudnn"):
    """One sequence, causal, through torch SDPA; grouped KV heads as they are (``enable_gqa``).

    mode "cudnn": only cuDNN's fused kernel when it applies (16-bit, head dim <= 128), else SDPA's
    own choice; "priority": cuDNN, flash, efficient, math in that order of priority; "plain": SDPA's
    own choice (flash on Hopper)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D] views
    gqa = kh.shape[1] != qh.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if mode == "cudnn" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif mode == "priority":
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]
        with sdpa_kernel(backends, set_priority=True):
            out = sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)
