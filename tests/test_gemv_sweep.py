"""``benchmarks/gemv_sweep.py``: the shapes it sweeps, and its dry run (tiny shapes under Triton's
interpreter, on the CPU) writing results whose best configurations are correct and whose tuned table
loads as :data:`nanovllm.layers.gemv.TUNED` entries."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gemv_sweep.py"


def sweep():
    spec = importlib.util.spec_from_file_location("gemv_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_shapes_shard_the_split_dimension():
    from nanovllm.presets import PRESETS

    one, two = (sweep().layer_shapes(PRESETS["qwen3-8b"], tp) for tp in (1, 2))
    assert one == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                   "lm_head": (151936, 4096)}
    assert two == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (12288, 4096), "down": (4096, 6144),
                   "lm_head": (75968, 4096)}


def test_splits_only_where_slabs_leave_multiprocessors_idle():
    from nanovllm.layers.gemv import GemvConfig

    narrow, wide = GemvConfig(block_n=4, block_k=512), GemvConfig(block_n=32, block_k=256, dot=True)
    configs = sweep().with_splits([narrow, wide], 4096, 4096, 132)
    assert [c.split_k for c in configs if c.block_n == 4] == [1]  # 1024 programs: enough
    assert sorted(c.split_k for c in configs if c.block_n == 32) == [1, 2, 4]  # 128 programs


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="runs the interpreter in its own process")
def test_dry_run_writes_correct_bests_and_a_loadable_table(tmp_path):
    from nanovllm.layers.gemv import GemvConfig, row_bucket

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--tp", "1", "2",
         "--rows", "1", "3", "--layers", "o", "lm_head"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "gemv_sweep.json").read_text())
    rows = payload["results"]
    assert [(r["tp"], r["layer"], r["rows"]) for r in rows] == [
        (tp, layer, m) for tp in (1, 2) for layer in ("o", "lm_head") for m in (1, 3)]
    for r in rows:
        assert r["ours"] and all(o["correct"] for o in r["ours"]), r  # every configuration computes x @ w.T
        assert r["best"]["us"] == min(o["us"] for o in r["ours"]) and r["floor_us"] > 0
        assert "cublas" in r["torch"] and ("torch.mv" in r["torch"]) == (r["rows"] == 1)
    # the vocabulary split at TP2
    assert [r["n"] for r in rows if r["layer"] == "lm_head"] == [200, 200, 100, 100]
    namespace = {"GemvConfig": GemvConfig}
    exec((tmp_path / "tuned_table.py").read_text(), namespace)
    winners = {(r["n"], r["k"], row_bucket(r["rows"])):
               GemvConfig(**r["best"]["config"]) if r["speedup_vs_cublas"] > 1 else None for r in rows}
    assert namespace["TUNED"] == winners
    assert "| TP | layer |" in (tmp_path / "gemv_sweep.md").read_text()


def test_dry_run_needs_the_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "set TRITON_INTERPRET=1" in done.stderr
