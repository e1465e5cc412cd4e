"""``nanovllm bench kv``: the KV layout of a model, per KV cache group, read off its config."""

from __future__ import annotations

import json

import pytest
from nanovllm.bench.kv import kv_layout
from nanovllm.cli import main as cli_main
from nanovllm.testing import HYBRID_WINDOW, TINY_CONFIGS

BLOCK = 16


def layer_token_bytes(architecture: str) -> int:
    """K and V of one token in one layer, float32."""
    c = TINY_CONFIGS[architecture]
    return 2 * c["num_key_value_heads"] * c["head_dim"] * 4


@pytest.mark.parametrize("context", [300, 20])
def test_gemma3_groups_keep_every_block_or_their_window(tiny_model, context):
    architecture = "Gemma3ForCausalLM"
    layout = kv_layout(tiny_model(architecture), context, dtype="float32", device="cpu", block_size=BLOCK)
    types = TINY_CONFIGS[architecture]["layer_types"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    per_layer, padded = layer_token_bytes(architecture), -(-context // BLOCK) * BLOCK
    groups = layout["groups"]
    assert sorted(i for g in groups for i in g["layers"]) == list(range(len(types)))
    assert [g["layers"] for g in groups if g["sliding_window"] is None] == [full]
    for g in groups:
        assert g["kv_bytes_per_token"] >= len(g["layers"]) * per_layer  # padded slots cost, never help
        if g["sliding_window"] is None:
            assert g["bytes_per_sequence"] == padded * g["kv_bytes_per_token"]
        else:
            assert g["sliding_window"] == HYBRID_WINDOW and set(g["layers"]).isdisjoint(full)
            window_blocks = min(-(-HYBRID_WINDOW // BLOCK) + 1, padded // BLOCK)  # the window, one block more
            assert g["blocks_per_sequence"] == window_blocks
            assert g["bytes_per_sequence"] == window_blocks * BLOCK * g["kv_bytes_per_token"]
    assert layout["bytes_per_sequence"] == sum(g["bytes_per_sequence"] for g in groups)
    assert layout["uniform_bytes_per_sequence"] == padded * len(types) * per_layer
    assert layout["full_attention_bytes_per_sequence"] == padded * len(full) * per_layer
    if context > 8 * HYBRID_WINDOW:  # a long sequence: the windows cost little beside the global layers
        assert layout["bytes_per_sequence"] < layout["uniform_bytes_per_sequence"] / 2


def test_a_model_with_one_window_has_one_group(tiny_model):
    architecture = "MistralForCausalLM"
    layout = kv_layout(tiny_model(architecture), 1000, dtype="float32", device="cpu")
    layers = TINY_CONFIGS[architecture]["num_hidden_layers"]
    [group] = layout["groups"]
    assert group["layers"] == list(range(layers)) and group["sliding_window"] == HYBRID_WINDOW
    assert group["kv_bytes_per_token"] == layers * layer_token_bytes(architecture)
    assert layout["full_attention_bytes_per_sequence"] == 0
    assert layout["bytes_per_sequence"] == (HYBRID_WINDOW // BLOCK + 1) * BLOCK * group["kv_bytes_per_token"]


def test_the_command_writes_the_groups_and_totals(tiny_model, tmp_path, capsys):
    gemma, llama = tiny_model("Gemma3ForCausalLM"), tiny_model("LlamaForCausalLM")
    assert cli_main(["bench", "kv", "--presets", llama, "--model", gemma, "--dtype", "float32",
                     "--context", "300", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "kv.json").read_text())
    assert payload["settings"]["context"] == 300
    rows = payload["results"]
    assert [r["preset"] for r in rows] == [llama, gemma]
    assert rows[0]["bytes_per_sequence"] == rows[0]["uniform_bytes_per_sequence"]  # no window: one layout
    assert len(rows[1]["groups"]) == 3
    md = (tmp_path / "kv.md").read_text()
    assert md in capsys.readouterr().out
    assert f"| {gemma} | 0 | full | 2, 5 | 1,024 | 0.30 |" in md
    assert f"| {gemma} | 300 | 16 | 0.39 | 0.89 | 0.30 | 1.32x |" in md
    with pytest.raises(ValueError, match="context must be at least 1"):
        kv_layout(llama, 0)


@pytest.mark.parametrize("architecture", ["Gemma3ForCausalLM", "MistralForCausalLM", "LlamaForCausalLM"])
def test_the_layout_is_the_one_the_engine_builds(tiny_model, architecture):
    """What ``bench kv`` reads off the config is what an engine makes of the model: the same groups, each
    with the same KV bytes per token (as the engine benchmarks' results record them)."""
    from nanovllm import LLM
    from nanovllm.bench.kv import engine_groups

    model = tiny_model(architecture)
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 22, max_model_len=256,
              skip_tokenizer_init=True)
    layout = kv_layout(model, 256, dtype="float32", device="cpu", block_size=BLOCK)
    assert engine_groups(llm) == [
        {k: g[k] for k in ("layers", "sliding_window", "kv_bytes_per_token")} for g in layout["groups"]]
