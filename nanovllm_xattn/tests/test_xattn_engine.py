"""XAttention inside the engine with a threshold that is really sparse: chunked prefill runs through it,
offload gives the tokens of the device cache, and it pairs with Quest (XAttention prefills, Quest
decodes)."""

from __future__ import annotations

import pytest
from nanovllm import LLM, SamplingParams
from nanovllm.conformance import policy_engine, tiny_model
from nanovllm.testing import prompt_logprobs

PROMPT = [(11 * j) % 240 + 3 for j in range(400)]
SPARSE = "xattn:threshold=0.5,block_size=64,stride=4,dense_below=0"


def engine(device: str, policy: str = SPARSE, offload: bool = False, chunk: int = 128) -> LLM:
    return policy_engine(policy, device, 16, offload, max_num_batched_tokens=chunk)


def generate(llm: LLM):
    prompts = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate([400, 97, 260])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_sparse_prefill_changes_the_prompt_but_not_its_first_block():
    """A low threshold changes what late rows attend to (so it is not silently dense), while the first
    block's rows, which see only their own (diagonal) block, stay exactly dense."""
    sparse, dense = prompt_logprobs(engine("cpu"), PROMPT), prompt_logprobs(engine("cpu", "full"), PROMPT)
    assert sparse[:63] == pytest.approx(dense[:63], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(sparse[128:], dense[128:], strict=True)) > 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offload_gives_the_tokens_of_the_device_cache(device):
    assert generate(engine(device, offload=True)) == generate(engine(device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_with_quest_for_decode(device):
    policy = SPARSE + ";quest:token_budget=32,skip_layers=1"
    llm = engine(device, policy)
    assert [type(p).__name__ for p in llm.runner.hooks.policies] == ["XAttentionPolicy", "QuestPolicy"]
    outputs = generate(llm)
    assert all(len(tokens) == 8 for tokens in outputs)
    assert generate(engine(device, policy, offload=True)) == outputs


def test_bad_options_name_the_fix():
    for spec, match in (("xattn:stride=3", "stride must be a power of two"),
                        ("xattn:threshold=2", r"threshold must be a fraction in \(0, 1\]"),
                        ("xattn:head_reduce=vote", "head_reduce must be one of")):
        with pytest.raises(ValueError, match=match):
            engine("cpu", spec)
    with pytest.raises(ValueError, match="not a multiple of the KV cache's block_size"):
        LLM(tiny_model(), sparse_policy="xattn:block_size=64", device="cpu", dtype="float32", block_size=128,
            max_model_len=512, kv_cache_memory=2**23, enforce_eager=True)


@pytest.mark.gpu
def test_triton_kernels_give_the_tokens_of_the_torch_references():
    """The CUDA engine (Triton kernels) and the CPU engine (torch references) on the same float32 model."""
    assert generate(engine("cuda")) == generate(engine("cpu"))
