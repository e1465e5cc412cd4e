"""MInference inside the engine with budgets that are really sparse: chunked prefill runs through it,
offload gives the tokens of the device cache, and it pairs with Quest (MInference prefills, Quest
decodes)."""

from __future__ import annotations

import pytest
from nanovllm import LLM, SamplingParams
from nanovllm.conformance import policy_engine
from nanovllm.engine.warm_up import warm_up
from nanovllm.testing import prompt_logprobs

PROMPT = [(11 * j) % 240 + 3 for j in range(300)]
SPARSE = ("minference:vertical_size=8,slash_size=24,num_sink_tokens=4,num_recent_diags=8,dense_below=0,"
          "dense_above=null")


def engine(device: str, policy: str = SPARSE, offload: bool = False, chunk: int = 64) -> LLM:
    return policy_engine(policy, device, 4, offload, max_num_batched_tokens=chunk)


def generate(llm: LLM):
    prompts = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate([300, 97, 180])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_sparse_prefill_changes_the_prompt_but_not_its_first_tiles():
    """Sparse budgets change what late rows attend to (so it is not silently dense), while rows whose whole
    history the budgets cover (the first tiles) stay exactly dense."""
    sparse, dense = prompt_logprobs(engine("cpu"), PROMPT), prompt_logprobs(engine("cpu", "full"), PROMPT)
    assert sparse[:7] == pytest.approx(dense[:7], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(sparse[100:], dense[100:], strict=True)) > 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offload_gives_the_tokens_of_the_device_cache(device):
    assert generate(engine(device, offload=True)) == generate(engine(device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_with_quest_for_decode(device):
    llm = engine(device, SPARSE + ";quest:token_budget=16,skip_layers=1")
    assert [type(p).__name__ for p in llm.runner.hooks.policies] == ["MInferencePolicy", "QuestPolicy"]
    outputs = generate(llm)
    assert all(len(tokens) == 8 for tokens in outputs)
    assert generate(engine(device, SPARSE + ";quest:token_budget=16,skip_layers=1", offload=True)) == outputs


@pytest.mark.gpu
def test_triton_kernels_give_the_tokens_of_the_torch_references():
    """The CUDA engine (Triton kernels) and the CPU engine (torch references) on the same float32 model."""
    assert generate(engine("cuda")) == generate(engine("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("decision", [False, True])
@pytest.mark.parametrize("offload", [False, True])
def test_the_kernels_compile_at_start_not_in_the_first_prompt(offload, decision):
    """The engine's warm-up prefills after a history as long as ``max_model_len`` (512 here), past
    ``dense_below``: the estimate and the sparse kernel compile at start, and a first prompt compiles none.
    With offload the history is read from the pool, as a prompt's would be. With the ``dense_above``
    decision its density kernel compiles at start too; on the GPU cache the sparse kernel decides itself,
    so it compiles whatever the decision says."""
    from nanovllm_minference import attention, estimate, index

    kernels = [attention._sparse_prefill_kernel, estimate._row_stats_kernel, estimate._sums_kernel,
               index._select_kernel]
    policy = SPARSE.replace("dense_below=0", "dense_below=256")
    if decision:
        kernels.append(attention._density_kernel)
        policy = policy.replace(",dense_above=null", "")

    def compiled() -> dict[str, int]:  # Triton's in-memory cache of compiled variants, per device
        return {kernel.fn.__name__: sum(len(entry[0]) for entry in kernel.device_caches.values())
                for kernel in kernels}

    for kernel in kernels:
        kernel.device_caches.clear()  # earlier tests of this process compiled them already
    llm = engine("cuda", policy, offload=offload)
    at_start = compiled()
    assert all(at_start.values()), at_start
    generate(llm)  # a 300-token prompt: its chunks past 256 tokens run the sparse path
    assert compiled() == at_start


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_the_warm_up_reads_zeros_not_what_block_0_held(offload, monkeypatch):
    """The warm-up's long history is block 0 throughout, which no sequence owns yet: it is zeroed first, so
    NaN left in fresh memory never reaches the estimate (planted here in every layer's block 0)."""
    import nanovllm_minference.policy as module
    import torch

    llm = engine("cuda", SPARSE.replace("dense_below=0", "dense_below=256"), offload=offload)
    for layer in llm.runner.attention_layers:
        layer.k_cache[0].fill_(float("nan"))
        layer.v_cache[0].fill_(float("nan"))
    ops = module._ops(torch.device("cuda"))
    clean = []

    def watched_estimate(*args, **kwargs):
        scores = ops.estimate(*args, **kwargs)
        clean.append(not any(torch.isnan(s).any().item() for s in scores))
        return scores

    monkeypatch.setattr(module, "_ops", lambda device: ops._replace(estimate=watched_estimate))
    warm_up(llm.runner)
    assert clean and all(clean)
