"""On a CUDA machine: the engine with device="cuda" gives the CPU's greedy tokens on the tiny models."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPT_LENS = (5, 37, 80, 130)


def _greedy(path: str, device: str, backend: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    llm = LLM(path, device=device, dtype="float32", attention_backend=backend, kv_cache_memory=1 << 26,
              max_num_batched_tokens=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # prefix-cache hits
    assert first == again
    return first


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_cuda_torch_backend_matches_cpu(tiny_model, arch):
    path = tiny_model(arch)
    assert _greedy(path, "cuda", "torch") == _greedy(path, "cpu", "torch")


def test_triton_engine_matches_torch_backend(tiny_model):
    """The whole engine on CUDA (chunked prefill, prefix-cache hits, decode in CUDA graphs), float32."""
    path = tiny_model("Qwen3ForCausalLM")  # head dim 32
    assert _greedy(path, "cuda", "triton") == _greedy(path, "cuda", "torch")
