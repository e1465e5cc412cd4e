"""Every sparse policy on a Gemma-3-shaped model (head size 256, 4 query heads on 1 KV head, sliding and
full layers), on the CPU with the torch backend: the selections the long-context runs use start and
generate, and really sparse budgets run through each policy's paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("nanovllm_gemma3")

CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, sliding_window=64, query_pre_attn_scalar=256,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=1024,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
)
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([300, 97])]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    import transformers

    config = transformers.Gemma3TextConfig(**CONFIG)
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float()
    path = tmp_path_factory.mktemp("gemma3-policies")
    model.save_pretrained(path, safe_serialization=True)
    return path


def generate(path: Path, policy: str) -> list[list[int]]:
    from nanovllm import LLM, SamplingParams

    llm = LLM(str(path), sparse_policy=policy, device="cpu", dtype="float32", attention_backend="torch",
              enforce_eager=True, max_model_len=512, max_num_seqs=2, block_size=16, kv_cache_memory=2**23,
              skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_long_context_selections_start_and_generate(checkpoint_dir):
    """Quest with a budget past the context and MInference below its dense threshold attend densely: the
    dense engine's tokens; XAttention generates."""
    dense = generate(checkpoint_dir, "full")
    assert generate(checkpoint_dir, "quest:token_budget=2048") == dense
    assert generate(checkpoint_dir, "minference") == dense
    assert [len(t) for t in generate(checkpoint_dir, "xattn:threshold=0.9")] == [4, 4]


@pytest.mark.parametrize("policy", [
    "quest:token_budget=32,page_size=16",
    "minference:vertical_size=8,slash_size=24,num_sink_tokens=4,num_recent_diags=8,dense_below=0,dense_above=null",
    "xattn:threshold=0.5,block_size=64,stride=4,dense_below=0",
])
def test_sparse_budgets_generate(checkpoint_dir, policy):
    assert [len(t) for t in generate(checkpoint_dir, policy)] == [4, 4]
