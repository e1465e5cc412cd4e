"""Soak: the engine's memory stays flat over many long prefills.

The engine runs in a fresh process, so the readings are its own and not the test session's. Memory that
grows with every prefill token shows here as steady growth between readings; memory that is allocated
once (weights, the written part of the KV cache, caches keyed by a few shapes) shows only before the
first reading after requests. benchmarks/gpu_soak.py runs the same soak on a real model's shape.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

NUM_REQUESTS = 1000
PROMPT_LEN = 1024
READ_EVERY = 125
MAX_GROWTH = 0.05  # of the reading after the first READ_EVERY requests

# The smallest model that still runs every part of a step (one layer, one head of 8): attention over 1K
# tokens dominates the run time. Its KV is 64 bytes a token, so a KV cache written block after block
# without reuse would grow the resident set by 62 MiB over the run. The cache (160 MiB) holds that much;
# in a much larger one the free queue (a dict over every block) resizes once mid-run, a one-time step this
# test would count as growth.
SOAK_MODEL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, max_position_embeddings=2 * PROMPT_LEN)
ENGINE = dict(enable_prefix_caching=False, kv_cache_memory=160 << 20)
CPU_ENGINE = dict(ENGINE, max_num_batched_tokens=256)  # chunks of 256: the torch backend's fastest on the CPU


def run_soak(model_dir: str, device: str) -> list[dict]:
    """The readings of :func:`nanovllm.testing.soak`; on CUDA each request also decodes a few tokens."""
    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.testing import soak

    torch.set_num_threads(1)  # two OpenMP threads spin badly on a busy 2-core machine
    llm = LLM(model_dir, device=device, **(CPU_ENGINE if device == "cpu" else ENGINE))
    params = SamplingParams(temperature=0, max_tokens=1 if device == "cpu" else 8, ignore_eos=True)
    return list(soak(llm, NUM_REQUESTS, PROMPT_LEN, READ_EVERY, params))


def soak_in_subprocess(tiny_model, device: str) -> list[dict]:
    from nanovllm.plugins import get_plugins

    if not sys.platform.startswith("linux"):
        pytest.skip("reads the resident set from /proc")
    if "LlamaForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-llama plugin")
    model_dir = tiny_model("LlamaForCausalLM", **SOAK_MODEL)
    proc = subprocess.run([sys.executable, __file__, model_dir, device], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    readings = json.loads(proc.stdout.splitlines()[-1])
    assert [r["requests"] for r in readings] == list(range(0, NUM_REQUESTS + 1, READ_EVERY))
    return readings


def assert_flat(readings: list[dict], key: str, max_growth: float = MAX_GROWTH) -> None:
    """``key`` grows less than ``max_growth`` from the reading after the first ``READ_EVERY`` requests."""
    first, later = readings[1][key], [r[key] for r in readings[2:]]
    growth = max(later) / first - 1
    per_token = (max(later) - first) / ((NUM_REQUESTS - READ_EVERY) * PROMPT_LEN)
    mib = ", ".join(f"{r[key] / 2**20:.1f}" for r in readings)
    assert growth < max_growth, (
        f"{key} grew {growth:.1%} after the first {READ_EVERY} requests (about {per_token:.0f} bytes a "
        f"prefill token); MiB before the first request and after each {READ_EVERY}: {mib}"
    )


def test_host_memory_stays_flat_over_1000_long_prefills(tiny_model):
    assert_flat(soak_in_subprocess(tiny_model, "cpu"), "rss")


@pytest.mark.gpu
def test_host_and_gpu_memory_stay_flat_over_1000_long_prefills_on_cuda(tiny_model):
    readings = soak_in_subprocess(tiny_model, "cuda")
    assert_flat(readings, "rss")
    assert_flat(readings, "cuda_reserved")
    assert_flat(readings, "cuda_allocated", max_growth=0.01)  # what lives between steps: weights, KV


if __name__ == "__main__":
    print(json.dumps(run_soak(*sys.argv[1:])))
