"""Rotary position embedding (neox style, rotating the two halves of each head), with llama3 and linear
scaling, and per-layer-type parameters (Gemma 3's local and global layers)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nanovllm.kv.store import CacheSlots
from nanovllm.layers.fused import kernels, use_fused
from nanovllm.layers.layernorm import GemmaRMSNorm, RMSNorm


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, smoothed, out)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        # float32 frequencies (made on the CPU) and angles, as transformers and vLLM make them: in bfloat16,
        # where cos and sin are rounded, an angle's last bit at a long position can pick another cos or sin
        dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (base ** (dims / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":  # positions divided by the factor
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
            )
        inv_freq = inv_freq.to(torch.get_default_device())
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
        v: torch.Tensor | None = None, cache: CacheSlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k ``[T, Hkv, D]`` rotated at ``positions`` ``[T]``, after the optional
        per-head RMSNorms ``q_norm``/``k_norm`` (Qwen3's, Gemma 3's). With ``cache``, the rotated keys and the
        values ``v [T, Hkv, D]`` are also written to their slots there. On CUDA one fused kernel, in place; a
        norm of another kind runs before it."""
        if q_norm is not None and type(q_norm) not in (RMSNorm, GemmaRMSNorm):  # the kinds the kernel knows
            q, k, q_norm, k_norm = q_norm(q), k_norm(k), None, None
        unit_strides = q.stride(-1) == 1 and k.stride(-1) == 1 and (cache is None or v.stride(-1) == 1)
        if use_fused(q) and unit_strides:
            norms = ((q_norm.weight, q_norm.eps), (k_norm.weight, k_norm.eps)) if q_norm is not None else (None, None)
            store = None if cache is None else (v, cache.k_cache, cache.v_cache, cache.slot_mapping)
            return kernels().rope_(q, k, positions, self.cos_sin, *norms, store,
                                   unit_offset=q_norm is not None and q_norm.unit_offset)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if cache is not None:
            cache.write(k, v)
        return q, k

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rounded as transformers and vLLM round it: cos and sin in ``x``'s dtype, each product and each
        sum rounded to it (the fused kernel rounds at the same points)."""
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_from_config(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """Build RoPE from a Hugging Face config (``rope_parameters`` in transformers 5, else ``rope_theta``
    and ``rope_scaling``) for a layer of ``layer_type`` (an entry of the config's ``layer_types``).
    Where the parameters differ per layer type (Gemma 3: ``rope_parameters`` keyed by layer type in
    transformers 5; ``rope_local_base_freq`` for sliding layers, unscaled, before it), the layer's own."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None) is not None:
        return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, hf_config.rope_local_base_freq)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else getattr(hf_config, "rope_scaling", None)
    return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, base, scaling)
