"""Piecewise prefill graphs: when a runner captures them, and on a GPU that steps of
``max_num_batched_tokens`` tokens replayed from them give the eager engine's tokens and log-probabilities
(chunked prompts crossing sliding windows, batches of prompts, decodes in the same step, prefix-cache
hits, a sparse policy)."""

from __future__ import annotations

import pytest

from nanovllm import SamplingParams
from nanovllm.conformance import Case, _engine, _generate, _prompts, compare_outputs, hybrid_model, tiny_model
from nanovllm.engine.prefill_graphs import PrefillGraphs
from nanovllm.plugins import get_plugins


def test_the_cpu_prefills_eagerly():
    llm = _engine(Case("prefill_graphs", "cpu", "torch"), tiny_model(), "full", enforce_eager=False)
    graphs = llm.runner.prefill_graphs
    assert not graphs.usable() and graphs.stretches == [] and not graphs.fits(512)


def graphed_and_eager(model_dir: str, policy: str, monkeypatch) -> tuple[list, list, list[int]]:
    """The same requests on an engine with piecewise prefill graphs (steps of 64 tokens) and on one without;
    returns both outputs and the token count of each step the first replayed."""
    case = Case("prefill_graphs", "cuda", "triton")
    options = dict(enforce_eager=False, max_num_batched_tokens=64, max_num_seqs=4)
    replayed: list[int] = []
    replay = PrefillGraphs.replay

    def counted(self, input_ids, meta):
        replayed.append(input_ids.shape[0])
        return replay(self, input_ids, meta)

    monkeypatch.setattr(PrefillGraphs, "replay", counted)
    graphed = _engine(case, model_dir, policy, **options)
    graphs = graphed.runner.prefill_graphs
    layers = len(graphed.runner.attention_layers)
    assert len(graphs.stretches) == layers + 1
    assert sum(s.attention is not None for s in graphs.stretches) == layers
    # a 300-token prompt in chunks of 64 crossing the windows; three prompts whose chunks share steps with
    # decodes; the first prompt again (its cached blocks hit, so its chunks start mid-prompt)
    prompts = _prompts([300, 90, 41, 130], 5)
    prompts.append(prompts[0][:200] + prompts[1][:50])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    got = _generate(graphed, prompts, params)
    eager = _engine(case, model_dir, policy, **options, piecewise_cuda_graphs=False)
    assert eager.runner.prefill_graphs.stretches == []
    return got, _generate(eager, prompts, params), replayed


@pytest.mark.gpu
@pytest.mark.parametrize("hybrid", [True, False], ids=["gemma3-sliding", "llama"])
def test_replayed_prefill_steps_give_the_eager_outputs(hybrid, monkeypatch):
    model_dir = hybrid_model() if hybrid else tiny_model()
    got, want, replayed = graphed_and_eager(model_dir, "full", monkeypatch)
    assert len(replayed) >= 5 and set(replayed) == {64}
    compare_outputs("piecewise prefill graphs against eager", got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [
    "quest:token_budget=64,skip_layers=0,page_size=16",  # its KV-write hook keeps per-page key bounds
    "xattn:threshold=0.5,block_size=64,stride=4,dense_below=0",  # a sparse prefill
], ids=["quest", "xattn"])
def test_a_sparse_policy_runs_between_the_replays(policy, monkeypatch):
    name = policy.split(":")[0]
    if name not in get_plugins().registry.sparse_policies:
        pytest.skip(f"needs the nanovllm-{name} plugin")
    got, want, replayed = graphed_and_eager(tiny_model(), policy, monkeypatch)
    assert replayed
    compare_outputs(f"piecewise prefill graphs against eager, {name}", got, want)
