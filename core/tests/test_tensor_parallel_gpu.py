"""Tensor parallelism on TP GPUs (``NANOVLLM_TEST_TP``, default 2; NCCL, and symmetric memory for small
all-reduces): TP ranks give one rank's greedy tokens, with CUDA graphs and eagerly, on checkpoints and on
random weights, and bfloat16 logprobs close to one rank's; Quest keeps per-rank metadata and selects from the
KV heads each rank owns; a worker that hangs in its graph capture (rank 0 captures for real) leaves an eager
engine with one rank's tokens; at TP 4, two torchrun nodes of two GPUs on this host give the engine's TP 4
tokens. Skipped with fewer than TP CUDA devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nanovllm import LLM, SamplingParams

TP = int(os.environ.get("NANOVLLM_TEST_TP", "2"))  # scripts/tp_check.sh sets it to the machine's GPUs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < TP, reason=f"needs {TP} GPUs"),
]

PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 61)), list(range(100, 170))]
INIT = 0.3  # transformers' default 0.02 makes a tied tiny model repeat its input token forever
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
# TP must divide the heads and KV heads: 2 * TP heads, TP KV heads (grouped queries), head size 32 (a
# Llama's is hidden / heads), which the Triton backend takes: at head size 16 the torch backend runs, which
# captures no CUDA graphs, so a graphs test would decode eagerly on every rank
HEADS = dict(num_attention_heads=2 * TP, num_key_value_heads=TP)
GRAPHED = {"LlamaForCausalLM": dict(HEADS, hidden_size=64 * TP, intermediate_size=256),
           "Qwen3ForCausalLM": HEADS}
EAGER_LLAMA = dict(HEADS, hidden_size=32 * TP)  # head size 16: the torch backend


def generate(path: str, tp: int, params: SamplingParams | None = None, **engine) -> list:
    with LLM(path, tensor_parallel_size=tp, kv_cache_memory=1 << 26, **engine) as llm:
        return llm.generate(PROMPTS, params or SamplingParams(**GREEDY), use_tqdm=False)


def assert_same_tokens(want: list, got: list, logprob_tol: float) -> None:
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lp_w, lp_g in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            for token, entry in lp_w.items():
                assert token in lp_g
                assert lp_g[token].logprob == pytest.approx(entry.logprob, abs=logprob_tol)
    assert len({t for w in want for t in w.outputs[0].token_ids}) > 4  # not one repeated token


def test_symmetric_all_reduce_in_the_engine(tiny_model):
    """With peer access, the first tensor-parallel engine of a process all-reduces through symmetric memory
    (CUDA graphs); a second one keeps NCCL, and says why (pytorch#196082). Both give one rank's tokens."""
    from nanovllm import distributed

    path = tiny_model("Qwen3ForCausalLM", initializer_range=INIT, **HEADS)
    want = generate(path, 1, dtype="float32")
    first_in_process = distributed._rendezvous_count == 0
    for engine_number in range(2):
        with LLM(path, tensor_parallel_size=TP, kv_cache_memory=1 << 26, dtype="float32") as llm:
            off = llm.runner.symmetric_all_reduce_off
            got = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
        assert_same_tokens(want, got, 1e-3)
        if peers() and first_in_process:
            assert (off is None) if engine_number == 0 else ("196082" in off)


def peers() -> bool:
    """Every pair of the TP GPUs has peer access."""
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(TP) for b in range(TP) if a != b)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("eager", [True, False])
def test_tp_gpus_give_the_tokens_of_one(arch, eager, tiny_model):
    path = tiny_model(arch, initializer_range=INIT, **GRAPHED[arch])
    engine = dict(dtype="float32", enforce_eager=eager)
    assert_same_tokens(generate(path, 1, **engine), generate(path, TP, **engine), 1e-3)


def test_random_weights_give_the_tokens_of_one_gpu(tiny_model):
    """Each rank makes its shard of the random weights on its GPU: the shards are one GPU's model. Random
    weights are small, so the logits are near-uniform and greedy decoding repeats a few tokens: the prompt
    logprobs must agree to 1e-5 (float32), far below how much they differ from one position to the next."""
    path = tiny_model("Qwen3ForCausalLM", initializer_range=INIT, **GRAPHED["Qwen3ForCausalLM"])
    engine = dict(dtype="float32", load_format="dummy")
    params = SamplingParams(**GREEDY, prompt_logprobs=0)
    want, got = generate(path, 1, params, **engine), generate(path, TP, params, **engine)
    spread = 0.0
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        prompt_w = [entry.logprob for position in w.prompt_logprobs[1:] for entry in position.values()]
        prompt_g = [entry.logprob for position in g.prompt_logprobs[1:] for entry in position.values()]
        assert prompt_g == pytest.approx(prompt_w, abs=1e-5)
        spread = max(spread, max(prompt_w) - min(prompt_w))
    assert spread > 1e-3  # the check above can tell two models apart


def test_a_worker_that_hangs_in_capture_leaves_an_eager_engine(tiny_model, monkeypatch):
    from test_tensor_parallel import HangsInCaptureOnWorkers

    monkeypatch.setenv("NANOVLLM_CAPTURE_TIMEOUT", "20")
    # rank 0 must capture for real: on a model it runs eagerly it never joins the workers' warm-up
    # collectives, and the two ranks wait for each other forever (seen on the two H200s)
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT, **GRAPHED["LlamaForCausalLM"])
    want = generate(path, 1, dtype="float32")
    with pytest.warns(RuntimeWarning, match=f"started its {TP} ranks again without CUDA graphs"):
        got = generate(path, TP, dtype="float32", observers=[HangsInCaptureOnWorkers()])
    assert_same_tokens(want, got, 1e-3)


def test_bfloat16_logprobs_stay_close(tiny_model):
    """bfloat16 all-reduces add in another order than one GPU's matmuls: the prompt logprobs stay close, within
    0.1 or 2% (bfloat16 steps logits near 10 by 0.0625: on the H200s TP2 put a -11.01 logprob at -10.90)."""
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT, **EAGER_LLAMA)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    runs = []
    for tp in (1, TP):
        with LLM(path, tensor_parallel_size=tp, dtype="bfloat16", kv_cache_memory=1 << 26) as llm:
            runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
    for want, got in zip(*runs, strict=True):
        for w, g in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
            for token, entry in w.items():
                if token in g:
                    assert g[token].logprob == pytest.approx(entry.logprob, abs=0.1, rel=0.02)


def test_quest_under_tp_gpus(tiny_model):
    pytest.importorskip("nanovllm_quest")
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT, **EAGER_LLAMA)
    engine = dict(dtype="float32", block_size=16, sparse_policy="quest:token_budget=32,skip_layers=0")
    assert_same_tokens(generate(path, 1, **engine), generate(path, TP, **engine), 1e-3)


def test_symmetric_all_reduce_sums_as_nccl_does(tmp_path):
    """The engine's all-reduce (one-shot, two-shot, and NCCL past its buffer) equals NCCL's sum, and its
    all-reduce fused with the RMSNorm equals NCCL's sum then the norm (the benchmark checks both); both run
    eagerly and replayed from a graph, and where the GPUs have peer access they must be in use. In
    a process of its own: PyTorch's rendezvous numbering is per process (see
    test_symmetric_all_reduce_in_the_engine)."""
    # qwen3-0.6b rows are 2 KB: one-shot, two-shot (over 512 KiB) and NCCL (over the 4 MiB buffer)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce.py"
    command = [str(script), "--presets", "qwen3-0.6b", "--tensor-parallel-size", str(TP),
               "--batches", "1", "300", "1500", "4096", "--steps", "3", "--out", str(tmp_path), "--name", "ar"]
    subprocess.run([sys.executable, *command], check=True, timeout=300)
    results = json.loads((tmp_path / "ar.json").read_text())["results"]
    rows = [r for r in results if r["benchmark"] == "allreduce"]
    if peers():
        assert all(r["symmetric_off"] is None for r in rows)
        paths_and_modes = {(r["path"], r["mode"]) for r in rows}
        paths = ("nccl", "symmetric", "symmetric+norm", "fused norm")
        assert paths_and_modes == {(p, m) for p in paths for m in ("eager", "graph")}
        fused_batches = {r["batch"] for r in rows if r["path"] == "fused norm"}
        assert fused_batches == {1, 300, 1500}  # 4096 rows are past its slots
    assert len(rows) >= 8 and all(r["us_per_allreduce"] > 0 for r in rows)


@pytest.mark.skipif(TP != 4, reason="two nodes of two GPUs: at TP 4")
def test_two_torchrun_nodes_on_this_host_give_the_engines_tokens(tiny_model, tmp_path):
    """scripts/torchrun_nodes.sh 2 2: two torchrun agents, each a node of two GPUs of its own (as two hosts),
    run examples/torchrun_generate.py; the steps go on the gloo group and the all-reduces through NCCL
    (no symmetric memory: the nodes do not see each other's GPUs). Every rank returns the tokens of the
    engine's own four ranks."""
    root = Path(__file__).resolve().parents[2]
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT, **GRAPHED["LlamaForCausalLM"])
    engine = dict(dtype="float32", kv_cache_memory=1 << 26)
    want = generate(path, TP, dtype="float32")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHON": sys.executable}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        ["bash", str(root / "scripts" / "torchrun_nodes.sh"), "2", "2", str(root / "examples" / "torchrun_generate.py"),
         path, "--prompts", json.dumps(PROMPTS), "--max-tokens", str(GREEDY["max_tokens"]), "--engine",
         json.dumps(engine), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["world_size"] == 4
        assert got["tokens"] == [w.outputs[0].token_ids for w in want], rank
