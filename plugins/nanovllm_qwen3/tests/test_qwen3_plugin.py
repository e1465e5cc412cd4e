"""The nanovllm-qwen3 plugin: its entry point registers the architecture lazily, and the weight loader
fills every parameter of the model (packed projections, q/k norms, tied and untied embeddings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nanovllm.testing import assert_model_family_registered, assert_registration_imports_no_torch

ARCH = "Qwen3ForCausalLM"


def test_entry_point_registers_the_architecture():
    from nanovllm_qwen3.model import Qwen3ForCausalLM

    assert_model_family_registered("nanovllm-qwen3", ARCH, Qwen3ForCausalLM)


def test_registering_imports_no_torch():
    assert_registration_imports_no_torch(ARCH)


def _expected(checkpoint: dict[str, torch.Tensor], name: str, tied: bool) -> torch.Tensor:
    """The checkpoint tensor(s) that should end up in nanovllm parameter ``name``."""
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for dst, srcs in packed.items():
        if f".{dst}." in name:
            return torch.cat([checkpoint[name.replace(dst, src)] for src in srcs])
    if name == "lm_head.weight" and tied:
        return checkpoint["model.embed_tokens.weight"]
    return checkpoint[name]


def _build(path: str):
    from transformers import AutoConfig

    from nanovllm_qwen3.model import Qwen3ForCausalLM

    return Qwen3ForCausalLM(AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_weights_fills_every_parameter(tiny_model, tied):
    from safetensors.torch import load_file

    from nanovllm.engine.loader import load_weights

    path = tiny_model(ARCH, tie_word_embeddings=tied)
    checkpoint = load_file(Path(path) / "model.safetensors")
    assert ("lm_head.weight" in checkpoint) is not tied
    model = _build(path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    names = dict(model.named_parameters())
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(names)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_weights(model, Path(path))
    for name, param in model.named_parameters():
        assert torch.equal(param, _expected(checkpoint, name, tied)), name


def test_load_weights_names_a_missing_tensor(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from nanovllm.engine.loader import ModelDirectoryError, load_weights

    path = Path(tiny_model(ARCH))
    checkpoint = load_file(path / "model.safetensors")
    del checkpoint["model.layers.1.self_attn.k_norm.weight"]
    save_file(checkpoint, tmp_path / "model.safetensors")
    with pytest.raises(ModelDirectoryError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_weights(_build(str(path)), tmp_path)
