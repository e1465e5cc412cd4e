"""Mistral: the core's generic decoder as it is; the sliding window on every layer (where the config
sets ``sliding_window``) comes from the core, read off the config."""

from __future__ import annotations

from nanovllm.layers.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass
