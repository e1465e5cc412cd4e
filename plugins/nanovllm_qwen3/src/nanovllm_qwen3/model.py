"""Qwen3: the core's generic decoder with an RMSNorm on each query and key head before RoPE."""

from __future__ import annotations

from nanovllm.layers import RMSNorm
from nanovllm.layers.decoder import DecoderForCausalLM, SelfAttention


class Qwen3Attention(SelfAttention):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class Qwen3ForCausalLM(DecoderForCausalLM):
    attention_cls = Qwen3Attention
