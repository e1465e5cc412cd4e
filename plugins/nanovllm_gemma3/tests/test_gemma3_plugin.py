"""The nanovllm-gemma3 plugin: its entry point registers the architecture lazily, the weight loader fills
every parameter of the model, and the model reads its layer types, windows, RoPE and scale off the config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nanovllm.testing import assert_model_family_registered, assert_registration_imports_no_torch

ARCH = "Gemma3ForCausalLM"
CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=256, sliding_window=16, query_pre_attn_scalar=64,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=128,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
)


def test_entry_point_registers_the_architecture():
    from nanovllm_gemma3.model import Gemma3ForCausalLM

    assert_model_family_registered("nanovllm-gemma3", ARCH, Gemma3ForCausalLM)


def test_registering_imports_no_torch():
    assert_registration_imports_no_torch(ARCH)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    import transformers

    config = transformers.Gemma3TextConfig(**CONFIG)
    config.architectures = [ARCH]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _build(path: Path):
    from transformers import AutoConfig

    from nanovllm_gemma3.model import Gemma3ForCausalLM

    return Gemma3ForCausalLM(AutoConfig.from_pretrained(path))


def test_load_weights_fills_every_parameter(checkpoint_dir):
    from safetensors.torch import load_file

    from nanovllm.engine.loader import load_weights

    checkpoint = load_file(checkpoint_dir / "model.safetensors")
    model = _build(checkpoint_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    names = dict(model.named_parameters())
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        assert f"model.layers.2.{norm}.weight" in names
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_weights(model, checkpoint_dir)
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, param in model.named_parameters():
        dst = next((d for d in packed if f".{d}." in name), None)
        want = (torch.cat([checkpoint[name.replace(dst, src)] for src in packed[dst]]) if dst
                else checkpoint[name])
        assert torch.equal(param, want), name


def test_layers_read_the_config(checkpoint_dir):
    """Windows on the sliding layers only; each layer type its own RoPE (the global one linearly
    scaled); ``query_pre_attn_scalar`` as the scale; head size 256."""
    model = _build(checkpoint_dir)
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.attn.sliding_window for a in attns] == [16, None, 16]
    assert all(a.attn.scale == 64**-0.5 and a.head_dim == 256 for a in attns)
    local, global_ = attns[0].rotary_emb.cos_sin, attns[1].rotary_emb.cos_sin
    assert torch.equal(local, attns[2].rotary_emb.cos_sin)
    # position 8 with the global base scaled by 8 is position 1 unscaled: the first frequency (1 rad/step)
    assert torch.allclose(global_[8, 0], torch.tensor(1.0).cos()) and torch.allclose(local[1, 0], global_[8, 0])
    assert model.model.embed_scale == 64**0.5


def test_bidirectional_config_is_refused(checkpoint_dir):
    from transformers import AutoConfig

    from nanovllm_gemma3.model import Gemma3ForCausalLM

    config = AutoConfig.from_pretrained(checkpoint_dir)
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(config)


def test_attention_logit_softcapping_is_refused_except_where_the_reference_ignores_it():
    """No backend caps attention logits: a config that sets ``attn_logit_softcapping`` is refused when the
    model is built, except Gemma 3's, which transformers' Gemma 3 leaves unused too."""
    import transformers
    from nanovllm.layers.decoder import SelfAttention

    from nanovllm_gemma3.model import Gemma3Attention

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=256)
    llama = transformers.LlamaConfig(**shape, intermediate_size=96, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0 .* is not supported"):
        SelfAttention(llama, 0)
    llama.attn_logit_softcapping = None
    SelfAttention(llama, 0)
    Gemma3Attention(transformers.Gemma3TextConfig(**shape, attn_logit_softcapping=50.0), 0)
