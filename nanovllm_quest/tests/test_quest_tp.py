"""Quest under tensor parallelism on the CPU (two gloo ranks): each rank selects for its own KV heads, with
the KV cache on the device or offloaded, and the engine gives exactly the greedy tokens of one rank with the
same policy. The budget is really sparse, and sparse enough to change the tokens against dense attention,
so a rank that ignored its selection would be seen."""

from __future__ import annotations

import pytest
from nanovllm import LLM, SamplingParams
from nanovllm.plugins import get_plugins
from nanovllm.quality.perplexity import DensityMeter

SPARSE = "quest:token_budget=16,skip_layers=1,page_size=4"  # 4 blocks of 4 tokens, from layer 1 on
INIT = 0.3  # transformers' default 0.02 makes a tied tiny model repeat its input token forever
# 2 slots of 24 head blocks (4 tokens x head size 16, K and V, float32): several loads per layer and step
SMALL_BUFFER = 2 * 24 * 2 * 4 * 16 * 4 / 2**30
PROMPTS = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate([90, 33, 140])]


def engine(model: str, policy: str, offload: bool, tensor_parallel_size: int = 1, observers=()) -> LLM:
    if "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, enforce_eager=True,
                   max_num_seqs=4, attention_backend="torch")
    if offload:
        options.update(kv_offloading_size=0.01, kv_offloading_buffer_size=SMALL_BUFFER)
    else:
        options["kv_cache_memory"] = 2**23
    return LLM(model, sparse_policy=policy, observers=list(observers),
               tensor_parallel_size=tensor_parallel_size, **options)


def generate(llm: LLM) -> list[list[int]]:
    with llm:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("offload", [False, True], ids=["device-cache", "offload"])
def test_two_ranks_give_the_quest_tokens_of_one(tiny_model, one_thread, offload):
    model = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    want = generate(engine(model, SPARSE, offload))
    assert want != generate(engine(model, "full", offload))  # the selection changes the tokens
    meter = DensityMeter()  # rank 0's, over its KV head
    assert generate(engine(model, SPARSE, offload, tensor_parallel_size=2, observers=[meter])) == want
    # the mean of layer 0 (dense, density 1) and layer 1 (sparse): under 0.65 when layer 1 reads under 30 %
    assert 0.5 < meter.density("decode") < 0.65
