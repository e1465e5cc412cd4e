"""What the shared decoder reads off a Hugging Face config, in each spelling transformers has written:
which layers slide and over how many tokens, and each layer type's RoPE."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanovllm.layers.decoder import layer_type_of, sliding_window_of
from nanovllm.layers.rotary_embedding import rope_from_config


def config(**fields) -> SimpleNamespace:
    return SimpleNamespace(max_position_embeddings=64, **fields)


def test_layer_types_win_where_the_config_has_them():
    cfg = config(layer_types=["sliding_attention", "full_attention"], sliding_window=512)
    assert [sliding_window_of(cfg, i) for i in range(2)] == [512, None]


def test_qwen2_without_layer_types_slides_from_max_window_layers():
    cfg = config(sliding_window=16, use_sliding_window=True, max_window_layers=2)
    assert [layer_type_of(cfg, i) for i in range(4)] == ["full_attention"] * 2 + ["sliding_attention"] * 2
    off = config(sliding_window=16, use_sliding_window=False, max_window_layers=0)
    assert sliding_window_of(off, 3) is None


def test_mistral_slides_on_every_layer_where_the_window_is_set():
    assert sliding_window_of(config(sliding_window=4096), 7) == 4096
    assert sliding_window_of(config(sliding_window=None), 7) is None
    assert sliding_window_of(config(), 0) is None  # Llama: no window at all


def _first_angle(rope, position: int) -> float:
    """The angle of RoPE's first (fastest) frequency at ``position``."""
    cos, sin = rope.cos_sin[position, 0], rope.cos_sin[position, rope.cos_sin.shape[1] // 2]
    return torch.atan2(sin, cos).item()


@pytest.mark.parametrize("spelling", ["transformers-5", "transformers-4"])
def test_gemma3_rope_per_layer_type(spelling):
    """Sliding layers: the local base, unscaled; global layers: the global base, linearly scaled."""
    if spelling == "transformers-5":
        cfg = config(rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        })
    else:
        cfg = config(rope_theta=1000.0, rope_local_base_freq=10.0,
                     rope_scaling={"rope_type": "linear", "factor": 4.0})
    local, global_ = rope_from_config(cfg, 8, "sliding_attention"), rope_from_config(cfg, 8, "full_attention")
    assert _first_angle(local, 1) == pytest.approx(1.0)
    assert _first_angle(global_, 1) == pytest.approx(0.25)
    # the second frequency shows the base: theta ** (-2 / head_dim)
    assert local.cos_sin[1, 1].item() == pytest.approx(torch.tensor(10.0 ** -0.25).cos().item(), abs=1e-6)
    assert global_.cos_sin[4, 1].item() == pytest.approx(torch.tensor(1000.0 ** -0.25).cos().item(), abs=1e-6)
