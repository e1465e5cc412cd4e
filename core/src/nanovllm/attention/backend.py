"""The attention-backend interface that policies and the attention layer call."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanovllm.attention.metadata import PhaseMetadata


class AttentionBackend:
    """Kernels over the paged KV cache of one layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Queries are ``[num_tokens, num_heads, head_dim]``; grouped-query attention maps query head
    ``h`` to KV head ``h // (num_heads // num_kv_heads)``. Log-sum-exp values are float32
    ``[num_tokens, num_heads]`` in natural-log units of the scaled scores.
    """

    name = "base"
    # Decode launches no host synchronisation and no data-dependent shapes, so it can be captured.
    supports_cuda_graphs = False
    # True where ``store_kv`` only writes the new rows to their slots: the kernel that makes the keys (RoPE's)
    # may then write them in its own launch. The torch backend, the reference, writes them itself.
    kv_write_fusable = False

    def __init__(self, config: object | None = None) -> None:
        self.config = config

    def reserve_workspace(self, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          device: torch.device, max_model_len: int) -> None:
        """Allocate the memory the kernels use beyond their outputs, for a cache of this shape and element
        type (``dtype``: the cache's, an 8-bit float under ``kv_cache_dtype``). The engine calls it once,
        before its memory profile, so that the KV cache is sized around it. Default: none."""

    def staged_cache(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PhaseMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The prefill phase's contexts copied out of the caches into larger pages, where the backend's
        kernels read those faster: ``(k_pages, v_pages, block_tables)``, a paged cache of its own, read with
        the phase's ``cu_seqlens_q`` and ``context_lens``; or None where the backend copies nothing. Valid
        until the backend's next call. Default: None."""
        return None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write new keys/values ``[num_tokens, num_kv_heads, head_dim]`` to their slots (-1: skip)."""
        raise NotImplementedError

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PhaseMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of each chunk over its whole cached context (prefix hits and earlier chunks).

        ``k``/``v`` are the chunk's new keys/values, already in the cache; a backend may read them
        directly when no sequence has a cached prefix. ``window`` (a sliding-window layer): the query at
        position ``p`` sees only keys at positions ``p - window + 1 .. p``."""
        raise NotImplementedError

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PhaseMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """One query token per sequence over its whole cached context, or with ``window`` over its last
        ``window`` tokens (its own included)."""
        raise NotImplementedError

    def attend_blocks(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PhaseMetadata,
        block_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention, without causal mask, over a subset of each sequence's blocks; returns (out, lse).

        ``block_indices`` are logical block indices (int32, ascending, padded with -1 at the end,
        each below ``ceil(kv_lens[s] / block_size)``) in one of two forms:

        - ``[num_seqs, k]``: one list per sequence, shared by all its heads;
        - ``[num_seqs, num_kv_heads, k]``: one list per KV head of each sequence; query head ``h``
          reads the list of its KV head ``h // (num_heads // num_kv_heads)``.

        Only positions below ``kv_lens[s]`` count. A head with nothing selected gets out 0 and lse -inf.
        """
        raise NotImplementedError

    def attend_chunk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PhaseMetadata, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each sequence's new tokens over those new tokens only; (out, lse)."""
        raise NotImplementedError

    @staticmethod
    def merge(
        out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine two partial attentions over disjoint key sets into one, by log-sum-exp."""
        lse = torch.logaddexp(lse_a, lse_b)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        w_a = torch.exp(lse_a - safe).unsqueeze(-1)
        w_b = torch.exp(lse_b - safe).unsqueeze(-1)
        out = out_a.float() * w_a + out_b.float() * w_b
        return out.to(out_a.dtype), lse


def selection_per_kv_head(block_indices: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``attend_blocks``' selection in its per-KV-head form ``[num_seqs, num_kv_heads, k]``: the
    shared form ``[num_seqs, k]`` becomes a view with KV-head stride 0 (no copy)."""
    if block_indices.dim() == 2:
        return block_indices[:, None, :].expand(-1, num_kv_heads, -1)
    if block_indices.dim() == 3 and block_indices.shape[1] == num_kv_heads:
        return block_indices
    raise ValueError(
        f"block_indices of shape {tuple(block_indices.shape)}: expected [num_seqs, k] (shared by the "
        f"heads) or [num_seqs, num_kv_heads={num_kv_heads}, k] (one list per KV head)"
    )


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
) -> None:
    """The checks every kernel over a prefill phase of the paged cache makes at its boundary (plugins'
    kernels too): shapes, one dtype, head sizes, grouped heads, a power-of-two block size, one entry per
    sequence. ``v_cache`` None: a kernel that reads keys only."""
    caches = (k_cache,) if v_cache is None else (k_cache, v_cache)
    if q.dim() != 3 or k_cache.dim() != 4 or any(c.shape != k_cache.shape for c in caches):
        shapes = ", ".join(f"{name} {tuple(c.shape)}" for name, c in zip(("k_cache", "v_cache"), caches, strict=False))
        raise ValueError(f"q {tuple(q.shape)}, {shapes}: expected q [T, H, D] and caches "
                         "[num_blocks, block_size, Hkv, D]")
    if any(c.dtype != q.dtype for c in caches):
        raise ValueError(f"q {q.dtype}, caches {', '.join(str(c.dtype) for c in caches)}: the kernels' dots need "
                         "one dtype; cast q to the cache dtype")
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads of dim {head_dim} over {num_kv_heads} KV heads of dim "
            f"{k_cache.shape[3]}: the head dims must match and the KV heads must divide the query heads"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size}: the kernels need a power of two")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if context_lens.shape != (num_seqs,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} sequences in cu_seqlens_q but context_lens {tuple(context_lens.shape)} and "
            f"block_tables {tuple(block_tables.shape)}: one entry / row per sequence"
        )


def prefill_kernel_outputs(
    kernel: object, name: str, q: torch.Tensor, cu_seqlens_q: torch.Tensor, inputs: Sequence[torch.Tensor],
    inputs_name: str,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The Python side of a Triton kernel over a prefill phase (plugins' kernels too), after the checks of
    :func:`check_paged_inputs` and its own: ``(out [T, H, D] in q's dtype, lse [T, H] float32, launch)``, both
    outputs unwritten for the kernel to fill; ``launch`` False when there is nothing to compute (no query row
    or no sequence). Refuses ``inputs`` (``inputs_name`` in the error) off q's device and, when there is work,
    CPU tensors unless ``kernel`` was built for Triton's interpreter (``name`` is the kernel's Python function;
    its torch path is ``{name}_reference``)."""
    if any(t.device != q.device for t in inputs):
        raise ValueError(f"{inputs_name} must be on q's device ({q.device}): move them there")
    num_tokens, num_heads = q.shape[:2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    launch = num_tokens > 0 and cu_seqlens_q.shape[0] > 1
    if launch and q.device.type != "cuda" and type(kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            f"{name} got CPU tensors but Triton's interpreter is off: use {name}_reference on the CPU, or set "
            "TRITON_INTERPRET=1 before importing triton"
        )
    return out, lse, launch
