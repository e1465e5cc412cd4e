"""The host copies of a phase's lengths (``PhaseMetadata.query_lens_host`` / ``context_lens_host``): the
engine gives them with every prefill phase, equal to the device tensors, and never in the metadata a decode
graph captures, whose replays bring new lengths."""

from __future__ import annotations

import torch
from nanovllm import LLM, SamplingParams
from nanovllm.attention.metadata import PhaseMetadata, StepMetadata
from nanovllm.engine.model_runner import ModelRunner


def test_prefill_metadata_carries_the_lengths_on_the_host(model, monkeypatch, one_thread):
    steps: list[StepMetadata] = []
    step_metadata = ModelRunner._step_metadata

    def recorded(self, plan, on_device):
        steps.append(step_metadata(self, plan, on_device))
        return steps[-1]

    monkeypatch.setattr(ModelRunner, "_step_metadata", recorded)
    # chunks of 16 tokens: prompts prefill over several steps, beside the decodes of the shorter ones
    llm = LLM(model, device="cpu", kv_cache_memory=1 << 24, max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=4)
    prompts = [[5 + i] * n for i, n in enumerate((40, 9, 23))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prefills = [s.prefill for s in steps if s.prefill is not None]
    assert len(prefills) > 3 and any(s.decode is not None and s.prefill is not None for s in steps)
    assert any(p.num_seqs > 1 for p in prefills)
    assert any(p.context_lens_host != p.query_lens_host for p in prefills)  # chunks after a history
    for p in prefills:
        assert p.query_lens_host == tuple(p.query_lens.tolist())
        assert p.context_lens_host == tuple(p.context_lens.tolist())
        assert all(type(n) is int for n in p.query_lens_host + p.context_lens_host)
        assert p.host_lens == (p.query_lens_host, p.context_lens_host)
    decodes = [s.decode for s in steps if s.decode is not None]
    assert decodes and all(d.query_lens_host is None and d.context_lens_host is None for d in decodes)


def test_decode_graph_metadata_has_no_host_copies(model, one_thread):
    llm = LLM(model, device="cpu", kv_cache_memory=1 << 24, max_model_len=64, max_num_seqs=4)
    graphs = llm.runner.cuda_graphs
    with torch.inference_mode():
        graphs._prepare()  # the static buffers and each bucket's metadata, as a capture makes them
    for bs in graphs.sizes:
        step = graphs._metadata(bs)
        for group in range(len(llm.runner.kv_cache_groups)):
            decode = step.of_group(group).decode
            assert decode.query_lens_host is None and decode.context_lens_host is None


def test_host_lens_are_none_without_both_copies():
    cu, lens = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([10, 5], dtype=torch.int32)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    assert PhaseMetadata(cu, lens, tables, 5, 10).host_lens is None
    assert PhaseMetadata(cu, lens, tables, 5, 10, (3, 5)).host_lens is None
    assert PhaseMetadata(cu, lens, tables, 5, 10, (3, 5), (10, 5)).host_lens == ((3, 5), (10, 5))
