"""Gemma 3 in bfloat16 rounds where transformers rounds: RoPE's cos and sin (float32 angles) and its
products in the activations' dtype, so the engine's bfloat16 run tracks transformers' rather than merely
landing as near float32. On the CPU: the RoPE alone at long positions, and a tiny random Gemma 3 whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("nanovllm_gemma3")
transformers = pytest.importorskip("transformers")

from test_gemma3_plugin import ARCH, CONFIG  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate([200, 97, 150])]


def test_rope_equals_transformers_in_bfloat16_at_long_positions():
    """Both layer types of Gemma 3 270M's RoPE, queries and keys bit for bit, up to 32K positions."""
    from transformers.models.gemma3 import modeling_gemma3 as hf

    from nanovllm.layers.rotary_embedding import rope_from_config

    config = transformers.Gemma3TextConfig(
        head_dim=256, max_position_embeddings=32768,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    gen = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(8), torch.randint(8, 32768, (56,), generator=gen)])
    q = torch.randn(len(positions), 4, 256, generator=gen).to(torch.bfloat16)
    k = torch.randn(len(positions), 1, 256, generator=gen).to(torch.bfloat16)
    reference = hf.Gemma3RotaryEmbedding(config)
    for layer_type in ("sliding_attention", "full_attention"):
        cos, sin = reference(q, positions[None], layer_type)
        want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        got_q, got_k = rope_from_config(config, 256, layer_type)(positions, q.clone(), k.clone())
        assert torch.equal(got_q, want_q[0].transpose(0, 1)), layer_type
        assert torch.equal(got_k, want_k[0].transpose(0, 1)), layer_type


def _float32_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=None, **kwargs):
    """transformers' attention computed as the engine's torch backend computes it: scores, softmax and
    the weighted sum in float32, the output rounded once (causal, the layer's window)."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    scores = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
    i, j = torch.arange(query.shape[2])[:, None], torch.arange(key.shape[2])[None, :]
    visible = (j <= i) & ((j > i - sliding_window) if sliding_window else True)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.matmul(probs, v).to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    config = transformers.Gemma3TextConfig(**{**CONFIG, "max_position_embeddings": 512})
    config.architectures = [ARCH]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float()
    path = tmp_path_factory.mktemp("gemma3-bf16")
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_bfloat16_engine_tracks_transformers(checkpoint_dir):
    """With transformers' attention in float32 as the torch backend's, every other rounding point is the
    same: the first layer's keys are transformers' bit for bit, and the logits of every position agree to
    well within what float32 RoPE arithmetic alone moves them (a mean absolute difference near 0.002)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.layers.attention import Attention

    transformers.AttentionInterface.register("nanovllm_float32", _float32_attention)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.bfloat16).eval()
    hf.set_attn_implementation("nanovllm_float32")
    llm = LLM(str(checkpoint_dir), device="cpu", dtype="bfloat16", attention_backend="torch",
              enforce_eager=True, max_model_len=256, max_num_seqs=1, block_size=16, kv_cache_memory=2**23,
              skip_tokenizer_init=True, enable_prefix_caching=False)
    model = llm.runner.model
    first_keys, final = [], []

    def keep_keys(module, args) -> None:
        if module.layer_id == 0:
            first_keys.append(args[1].clone())

    hooks = [m.register_forward_pre_hook(keep_keys) for m in model.modules() if isinstance(m, Attention)]
    hooks.append(model.model.norm.register_forward_hook(lambda m, args, out: final.append(out[0].clone())))
    try:
        for ids in PROMPTS:
            first_keys.clear()
            final.clear()
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            with torch.inference_mode():
                got = model.compute_logits(final[0]).float()
                want = hf(torch.tensor([ids]), use_cache=True)
            keys = want.past_key_values.layers[0].keys[0].transpose(0, 1)  # the window's last keys
            assert torch.equal(first_keys[0][-keys.shape[0]:], keys)
            assert (got - want.logits[0].float()).abs().mean() < 1e-3
    finally:
        for hook in hooks:
            hook.remove()
        llm.close()
