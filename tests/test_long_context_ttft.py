"""The interleaved TTFT script end to end on the CPU with the tiny random model: the engines take turns on one
natural-text prompt, and each policy's row carries every round, its ratio to the first policy's and what it
selected chunk by chunk."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_policy_is_timed_in_turns_against_the_first(tmp_path, tiny_model, one_thread):
    from nanovllm.plugins import get_plugins

    if "xattn" not in get_plugins().registry.sparse_policies:
        pytest.skip("needs the nanovllm-xattn plugin")
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("long_context_ttft", BENCHMARKS / "long_context_ttft.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=256)
    rng = random.Random(0)
    text = tmp_path / "text.txt"  # words of the tiny vocabulary
    text.write_text(" ".join(f"tok{rng.randrange(3, 256)}" for _ in range(500)))
    minference = ("minference:dense_below=0,vertical_size=8,slash_size=32,last_q=8,num_sink_tokens=1,"
                  "num_recent_diags=2")
    policies = ["full", "xattn:threshold=0.9,block_size=64,dense_below=0", minference]
    assert script.main(["--model", model, "--length", "192", "--rounds", "2", "--policies", ";".join(policies),
                        "--max-num-batched-tokens", "64", "--dtype", "float32", "--text-file", str(text),
                        "--out", str(tmp_path), "--name", "tiny"]) == 0
    result = json.loads((tmp_path / "tiny.json").read_text())
    rows = result["rows"]
    assert [r["policy"] for r in rows] == policies and result["prompt_source"] == str(text)
    first, xattn, minf = rows
    assert all(len(r["ttft_rounds_s"]) == 2 and r["ttft_s"] > 0 for r in rows)
    assert first["vs_reference"] == 1.0
    ratios = [b / a for a, b in zip(first["ttft_rounds_s"], xattn["ttft_rounds_s"], strict=True)]
    assert xattn["vs_reference"] == pytest.approx(statistics.median(ratios))
    # the work: one entry per chunk, a density per layer; nothing for dense
    assert first["work"] == []
    layers = len(xattn["work"][0]["layers"])
    for row in (xattn, minf):
        assert [c["context"] for c in row["work"]] == [64, 128, 192]
        assert all(c["layers"] == list(range(layers)) for c in row["work"])
        assert all(0 < d <= 1.5 for c in row["work"] for d in c["densities"])
    # MInference's budget of 40 keys a row covers 0.86 of the first chunk's keys: dense before estimating
    assert minf["work"][0]["paths"] == ["dense"] * layers and minf["work"][0]["density"] == 1.0
    assert set(minf["work"][2]["paths"]) <= {"sparse", "dense (dense_above)"}
    assert all(p == "sparse" for c in xattn["work"] for p in c["paths"])
    assert xattn["work"][2]["density"] <= 1
    table = (tmp_path / "tiny.md").read_text()
    assert f"| `{policies[1]}` |" in table and "no slower than `full`" in table
    assert f"| `{minference}` | 64 | 1.000 | " in table
