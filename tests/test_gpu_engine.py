"""On a CUDA machine: the engine with device="cuda" gives the CPU's greedy tokens on the tiny models."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPT_LENS = (5, 37, 80, 130)


def _greedy(path: str, device: str, backend: str, **engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    llm = LLM(path, device=device, dtype="float32", attention_backend=backend, kv_cache_memory=1 << 26,
              max_num_batched_tokens=64, block_size=16, **engine)
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


def test_weight_prefetch_is_captured_in_the_decode_graphs_and_changes_no_token(tiny_model, monkeypatch):
    """Small decode steps read each next matmul's weights into L2 on a side stream, in the captured graphs
    only (eagerly the host's launches bound the step); the tokens are those of an engine without."""
    from nanovllm.layers import fused_kernels, weight_prefetch

    calls = []
    real = fused_kernels.l2_prefetch

    def counted(*args):
        calls.append(torch.cuda.is_current_stream_capturing())
        real(*args)

    monkeypatch.setattr(fused_kernels, "l2_prefetch", counted)
    path = tiny_model("Qwen3ForCausalLM")  # head dim 32
    with_prefetch = _greedy(path, "cuda", "triton")
    assert calls.count(True) > 0 and calls.count(False) <= 1  # captured; at most one compile, outside
    calls.clear()
    assert _greedy(path, "cuda", "triton", enforce_eager=True) == with_prefetch
    assert not calls
    monkeypatch.setattr(weight_prefetch, "enabled", lambda: False)
    assert _greedy(path, "cuda", "triton") == with_prefetch
    assert not calls


def test_cuda_logprobs_match_cpu(tiny_model):
    """Logprobs computed on the GPU and read back with the step's tokens (async scheduling, decodes in
    CUDA graphs, prompt logprobs across chunks, a request without logprobs in the batch) match the CPU's."""
    path = tiny_model("Qwen3ForCausalLM", initializer_range=0.3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    asked = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    params = [asked, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), asked, asked]

    def run(device: str):
        llm = LLM(path, device=device, dtype="float32", kv_cache_memory=1 << 26, max_num_batched_tokens=64,
                  block_size=16)
        return llm.generate(prompts, params, use_tqdm=False)

    def close(a: dict, b: dict, own: int) -> bool:  # the own token's logprob and the top values agree
        top = sorted(lp.logprob for lp in a.values()), sorted(lp.logprob for lp in b.values())
        return abs(a[own].logprob - b[own].logprob) < 1e-4 and all(
            abs(x - y) < 1e-4 for x, y in zip(*top, strict=True)
        )

    for gpu, cpu, prompt in zip(run("cuda"), run("cpu"), prompts, strict=True):
        assert gpu.token_ids == cpu.token_ids
        if cpu.prompt_logprobs is None:
            assert gpu.prompt_logprobs is None and gpu.outputs[0].logprobs is None
            continue
        for token, a, b in zip(gpu.token_ids, gpu.outputs[0].logprobs, cpu.outputs[0].logprobs, strict=True):
            assert close(a, b, token)
        for token, a, b in zip(prompt[1:], gpu.prompt_logprobs[1:], cpu.prompt_logprobs[1:], strict=True):
            assert close(a, b, token)
        assert abs(gpu.outputs[0].cumulative_logprob - cpu.outputs[0].cumulative_logprob) < 1e-3
