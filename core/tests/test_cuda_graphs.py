"""The decode graphs: their batch-size buckets, and (on a GPU) decode steps replayed from them giving the
tokens of eager decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.cuda_graphs import MAX_GRAPH_BATCH, CudaGraphRunner


def buckets(max_num_seqs: int) -> list[int]:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, device="cpu")
    return CudaGraphRunner(None, config, None, None, None).sizes


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    for max_num_seqs in (1, 3, 16, 40, 256, 1000):
        sizes = buckets(max_num_seqs)
        largest = min(max_num_seqs, MAX_GRAPH_BATCH)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == largest
        # every batch up to the largest has a bucket, and pads by fewer than 16 rows (or doubles below 16)
        for bs in range(1, largest + 1):
            bucket = next(b for b in sizes if b >= bs)
            assert bucket - bs < max(16, bs)


def test_the_cpu_decodes_eagerly(tiny_model):
    from nanovllm import LLM

    llm = LLM(tiny_model(), device="cpu", kv_cache_memory=1 << 24, max_model_len=64)
    assert not llm.runner.cuda_graphs.usable() and llm.runner.cuda_graphs.graphs == {}


@pytest.mark.gpu
def test_decode_steps_replay_the_graphs_and_give_the_eager_tokens(tiny_model, monkeypatch):
    from nanovllm import LLM

    path = tiny_model("Qwen3ForCausalLM")
    prompts = [[5 + i, 17, 3 * i + 1] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 26, max_num_seqs=8)
    replays = []
    replay = CudaGraphRunner.replay

    def counted(self, input_ids, positions, meta):
        replays.append(input_ids.shape[0])
        return replay(self, input_ids, positions, meta)

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    graphs = LLM(path, **options)
    assert sorted(graphs.runner.cuda_graphs.graphs) == graphs.runner.cuda_graphs.sizes == [1, 2, 4, 8]
    with_graphs = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert replays and max(replays) == len(prompts)  # the decode steps of all five ran in the bucket of 8
    eager = LLM(path, enforce_eager=True, **options)
    assert eager.runner.cuda_graphs.graphs == {}
    assert [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == with_graphs
    torch.cuda.synchronize()
