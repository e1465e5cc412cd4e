"""Qwen2: the core's generic decoder with biases on the q/k/v projections (none on the output
projection). Its sliding-window layers (``use_sliding_window``, from ``max_window_layers`` on, or
``layer_types``) come from the core, read off the config."""

from __future__ import annotations

from nanovllm.layers.decoder import DecoderForCausalLM, SelfAttention


class Qwen2Attention(SelfAttention):
    qkv_bias = True


class Qwen2ForCausalLM(DecoderForCausalLM):
    attention_cls = Qwen2Attention
