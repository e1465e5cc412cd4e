"""The nanovllm-llama plugin: its entry point registers the architecture lazily, the weight loader fills
every parameter (packed projections, attention biases), and llama3 RoPE scaling gives HF's frequencies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nanovllm.testing import assert_model_family_registered, assert_registration_imports_no_torch

ARCH = "LlamaForCausalLM"
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


def test_entry_point_registers_the_architecture():
    from nanovllm_llama.model import LlamaForCausalLM

    assert_model_family_registered("nanovllm-llama", ARCH, LlamaForCausalLM)


def test_registering_imports_no_torch():
    assert_registration_imports_no_torch(ARCH)


def _expected(checkpoint: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The checkpoint tensor(s) that should end up in nanovllm parameter ``name``."""
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for dst, srcs in packed.items():
        if f".{dst}." in name:
            return torch.cat([checkpoint[name.replace(dst, src)] for src in srcs])
    return checkpoint[name]


def _build(path: str):
    from transformers import AutoConfig

    from nanovllm_llama.model import LlamaForCausalLM

    return LlamaForCausalLM(AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "attention-bias"])
def test_load_weights_fills_every_parameter(tiny_model, bias):
    from safetensors.torch import load_file

    from nanovllm.engine.loader import load_weights

    path = tiny_model(ARCH, attention_bias=bias)
    checkpoint = load_file(Path(path) / "model.safetensors")
    model = _build(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    names = set(dict(model.named_parameters()))
    bias_names = {f"model.layers.0.self_attn.{p}.bias" for p in ("qkv_proj", "o_proj")}
    assert (bias_names <= names) is bias
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_weights(model, Path(path))
    for name, param in model.named_parameters():
        assert torch.equal(param, _expected(checkpoint, name)), name


def _inv_freq(rotary) -> torch.Tensor:
    """Frequencies back from the cos/sin table: position 1 holds cos(f), sin(f) with f < pi."""
    cos, sin = rotary.cos_sin[1].double().chunk(2)
    return torch.atan2(sin, cos)


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rope_frequencies_match_hf(tiny_model, rope):
    import transformers

    overrides = {} if rope is None else {"rope_parameters": rope}
    path = tiny_model(ARCH, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = hf.model.rotary_emb.inv_freq.double()
    assert hf.model.rotary_emb.attention_scaling == 1.0
    model = _build(path)
    got = _inv_freq(model.model.layers[0].self_attn.rotary_emb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    if rope is not None:  # with a short original length the scaling really changes the low frequencies
        head_dim = got.numel() * 2
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        assert (got < base * 0.5).sum() >= 2 and torch.isclose(got[0], base[0])
