"""Gemma 3 (text): the core's generic decoder with Gemma's pieces.

From the core, read off the config: the sliding window of the layers ``layer_types`` marks sliding (the
others attend globally), RoPE per layer type (``rope_local_base_freq`` on sliding layers, ``rope_theta``
and ``rope_scaling`` on global ones), ``query_pre_attn_scalar`` as the attention scale, the GELU-tanh
gated MLP and the final logit soft-cap. Here: Gemma's norms (``1 + weight``, in float32) on queries and
keys and around both the attention and the MLP, and the embeddings scaled by sqrt(hidden_size)."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers import GemmaRMSNorm
from nanovllm.layers.decoder import DecoderForCausalLM, SelfAttention, mlp_from_config


class Gemma3Attention(SelfAttention):
    ignores_attn_logit_softcapping = True  # as transformers' Gemma 3 does (Gemma 2 applies it)

    def __init__(self, config, layer_id: int) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True (an embedding encoder) is not "
                             "supported: nanovllm runs causal decoders")
        super().__init__(config, layer_id)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around both the attention and the MLP; each post-norm sums the tensor-parallel
    shares of its block's output, so the layer returns its output whole."""

    returns_partial = False

    def __init__(self, config, layer_id: int, attention_cls: type[SelfAttention]) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_id)
        self.mlp = mlp_from_config(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden), partial=True)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden), partial=True), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    attention_cls = Gemma3Attention
    layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm
    embed_scaled = True
