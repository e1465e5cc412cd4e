"""Decode-graph capture beside dropped engines: an engine's runner and graphs are reference cycles, freed
whenever Python's cycle collector runs, which must not be inside another engine's capture."""

from __future__ import annotations

import gc

import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.conformance import policy_engine
from nanovllm.kv.store import KVStore


@pytest.mark.gpu
def test_a_dropped_engines_graphs_are_not_freed_inside_a_capture(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dropped = [policy_engine("full", "cuda", 4, enforce_eager=False)]
    assert dropped[0].runner.cuda_graphs.graphs
    begin_capture = KVStore.begin_capture

    def drop_then_collect(store):  # the last reference goes, and the collector runs as it may on its own
        dropped.clear()
        if gc.isenabled():
            gc.collect()
        begin_capture(store)

    monkeypatch.setattr(KVStore, "begin_capture", drop_then_collect)
    llm = policy_engine("full", "cuda", 4, enforce_eager=False)
    assert llm.runner.cuda_graphs.graphs and gc.isenabled()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
