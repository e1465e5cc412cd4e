"""Model shape presets with random weights, so benchmarks need no download.

``LLM("qwen3-0.6b")`` builds the published shape of the model with random weights (vLLM's
``load_format="dummy"``) and no tokenizer: prompts are token ids. Each tensor-parallel rank makes only its
own shard of the weights, on its device, so a preset larger than one GPU (``llama-3.1-70b``) starts in
seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, torch_dtype="bfloat16",
    bos_token_id=151643, eos_token_id=151645, attention_bias=False,
)

_LLAMA_3_1 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        _QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(
        _LLAMA_3_1, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    ),
    # 70.6B parameters, 141 GB in bfloat16: more than one H200 holds; each rank makes only its own shard
    "llama-3.1-70b": dict(
        _LLAMA_3_1, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    ),
}


def is_preset(name: str | None) -> bool:
    return name is not None and name.lower() in PRESETS


def preset_dir(name: str) -> Path:
    """A directory holding only the preset's config.json (written once into the cache)."""
    import json

    from nanovllm.default_model import cache_root

    path = cache_root() / "presets" / name.lower()
    path.mkdir(parents=True, exist_ok=True)
    config_file = path / "config.json"
    text = json.dumps(PRESETS[name.lower()], indent=2)
    if not config_file.is_file() or config_file.read_text() != text:
        config_file.write_text(text)
    return path
