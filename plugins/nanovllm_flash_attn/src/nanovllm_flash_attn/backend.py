"""The ``flash_attn`` attention backend: FlashAttention-4 where it has the path, the ``triton`` backend's
kernels where it has not, chosen per call from shapes alone (:mod:`nanovllm_flash_attn.dispatch`).

- ``prefill``: FA4, causal over each sequence's paged context (prefix-cache hits, chunks with history,
  grouped KV heads, sliding windows, soft-cap). A single sequence with nothing cached before it attends over
  its new keys and values directly, without a page table.
- ``decode``: the Triton split-KV decode, faster than FA4's at every batch size the peer table measures on
  SM 9.x (FA4 has no split-KV there); FA4 with a soft-cap, or with the ``decode="fa4"`` option of
  :class:`~nanovllm_flash_attn.config.FlashAttnConfig`.
- ``attend_chunk``: FA4, with log-sum-exp.
- ``attend_blocks``: Triton. FA4's KV gather (``gather_kv_indices``) is for MLA on SM 10.x only, and its
  block sparsity masks (query tile, key tile) pairs, not per-sequence lists of cache blocks.
- ``store_kv``: Triton (FA4 writes no cache).
- A GPU, dtype or head dim FA4 refuses (:func:`~nanovllm_flash_attn.dispatch.fa4_refusal`): Triton, except
  with ``softcap``, which only FA4 applies: that raises.

``softcap`` (Gemma 2's tanh cap on the scaled scores) is a keyword of ``prefill`` and ``decode`` beyond the
base interface; the engine's attention layers do not pass it yet. Decode launches no host synchronisation
and no data-dependent shapes on either path, so it can be captured in a CUDA graph; FA4 compiles a kernel
on its first call of each kind (seconds), which the graph runner's warm-up does outside the capture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm_flash_attn.config import FlashAttnConfig
from nanovllm_flash_attn.dispatch import dense_args, fa4_refusal, paged_args


def load_fa4() -> Callable:
    """FA4's ``flash_attn_varlen_func``, or an error that names the fix."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as exc:
        raise ImportError(
            f"attention_backend='flash_attn' needs FlashAttention-4 ({exc}): pip install "
            "'nanovllm-flash-attn[fa4]' (flash-attn-4[cu13] under a CUDA 13 PyTorch; installed with pip "
            "--target, put nvidia_cutlass_dsl/dsl_packages on PYTHONPATH too), or choose "
            "attention_backend='triton'"
        ) from exc
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, number of SMs) of CUDA device ``index``."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self, config: FlashAttnConfig | None = None) -> None:
        from nanovllm.attention.triton_backend import TritonBackend

        super().__init__(config if config is not None else FlashAttnConfig())
        self.fa4 = load_fa4()
        self.fallback = TritonBackend()

    def refusal(self, q: torch.Tensor) -> str | None:
        """Why FA4 does not take a call with queries ``q`` (its device, dtype and head dim), else None."""
        if q.device.type != "cuda":
            return f"device {q.device}: FA4 runs on CUDA devices"
        return fa4_refusal(device_facts(q.device.index)[0], str(q.dtype).removeprefix("torch."), q.shape[-1])

    def reserve_workspace(self, num_kv_heads, head_dim, block_size, dtype, device, max_model_len) -> None:
        """The Triton fallback's workspace, where FA4 refuses this device, dtype or head dim (the fallback
        then runs every prefill)."""
        refused = device.type != "cuda" or fa4_refusal(
            device_facts(device.index if device.index is not None else torch.cuda.current_device())[0],
            str(dtype).removeprefix("torch."), head_dim)
        if refused:
            self.fallback.reserve_workspace(num_kv_heads, head_dim, block_size, dtype, device, max_model_len)

    def staged_cache(self, k_cache, v_cache, meta):
        return self.fallback.staged_cache(k_cache, v_cache, meta)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self.fallback.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def prefill(
        self, q, k, v, k_cache, v_cache, meta: PhaseMetadata, scale: float, window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if self._on_triton(q, softcap):
            return self.fallback.prefill(q, k, v, k_cache, v_cache, meta, scale, window)
        if meta.num_seqs == 1 and meta.max_context_len == meta.max_query_len:  # nothing cached before it
            return self.fa4(q, k, v, **dense_args(meta, scale, window, softcap))[0]
        return self.fa4(q, k_cache, v_cache, **paged_args(meta, scale, window, softcap))[0]

    def decode(
        self, q, k_cache, v_cache, meta: PhaseMetadata, scale: float, window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if not self.decode_runs_fa4(q, softcap):
            return self.fallback.decode(q, k_cache, v_cache, meta, scale, window)
        return self.fa4(q, k_cache, v_cache, **paged_args(meta, scale, window, softcap))[0]

    def decode_runs_fa4(self, q: torch.Tensor, softcap: float | None = None) -> bool:
        """Whether ``decode`` of this call runs FA4 (else the Triton split-KV kernel): with a soft-cap, which
        only FA4 applies, or with ``decode="fa4"``."""
        if self._on_triton(q, softcap):
            return False
        return bool(softcap) or self.config.decode == "fa4"

    def attend_blocks(self, q, k_cache, v_cache, meta, block_indices, kv_lens, scale):
        return self.fallback.attend_blocks(q, k_cache, v_cache, meta, block_indices, kv_lens, scale)

    def attend_chunk(self, q, k, v, meta: PhaseMetadata, scale: float):
        if self._on_triton(q, None):
            return self.fallback.attend_chunk(q, k, v, meta, scale)
        out, lse = self.fa4(q, k, v, **dense_args(meta, scale, return_lse=True))
        return out, lse.t().contiguous()  # FA4's varlen lse is [H, T]

    def _on_triton(self, q: torch.Tensor, softcap: float | None) -> bool:
        """A call FA4 refuses runs the Triton backend, which has no soft-cap."""
        reason = self.refusal(q)
        if reason is not None and softcap:
            raise ValueError(f"softcap={softcap} needs FA4, which cannot run this call: {reason}")
        return reason is not None
