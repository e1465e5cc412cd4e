"""Llama (and SmolLM2, which is a Llama): the core's generic decoder as it is; llama3 RoPE scaling
comes from the core's rotary embedding, read off the config."""

from __future__ import annotations

from nanovllm.layers.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
