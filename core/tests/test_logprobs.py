"""Logprobs: the device-side computation on fixed logits, then what the engine adds (and does not add)
to a step. Their values against Hugging Face transformers are checked in tests/test_parity.py."""

from __future__ import annotations

import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.layers.sampler import TopLogprobs
from nanovllm.plugins import get_plugins

# -- on fixed logits ------------------------------------------------------------------------------------


def test_own_token_top_k_and_ranks():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, -1.0], [2.0, 0.0, 0.0, 1.0, 5.0]])
    out = TopLogprobs.of(logits, torch.tensor([4, 1]), k=3)
    logprobs = logits.log_softmax(-1)
    assert out.token_ids[:, 0].tolist() == [4, 1]  # each row's own token first
    assert torch.allclose(out.logprobs[:, 0], logprobs[[0, 1], [4, 1]])
    assert out.ranks[:, 0].tolist() == [5, 4]  # 1 + the number of strictly more likely tokens
    assert set(out.token_ids[0, 1:].tolist()) == {1, 3, 2} and out.token_ids[1, 1:].tolist() == [4, 0, 3]
    assert out.ranks[0, 1:].tolist() == [1, 1, 3]  # a tie shares its rank; the next rank skips
    assert out.ranks[1, 1:].tolist() == [1, 2, 3]
    assert torch.allclose(out.logprobs[:, 1:], logprobs.gather(-1, out.token_ids[:, 1:]))


def test_k_zero_gives_only_the_own_token_and_float32_from_half_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = TopLogprobs.of(logits, torch.tensor([1, 2, 3]), k=0)
    assert out.token_ids.shape == out.logprobs.shape == out.ranks.shape == (3, 1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs[:, 0], logits.float().log_softmax(-1)[[0, 1, 2], [1, 2, 3]])


def test_rows_are_cut_to_each_requests_width_and_slices_concatenate():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 1, 2, 3])
    whole = TopLogprobs.of(logits, ids, k=4)
    parts = TopLogprobs.cat([TopLogprobs.of(logits[:3], ids[:3], 4), TopLogprobs.of(logits[3:], ids[3:], 4)])
    assert parts.rows([5] * 4) == whole.rows([5] * 4)
    rows = whole.rows([1, 5, 3, 2])
    assert [len(r[0]) for r in rows] == [1, 5, 3, 2] and all(len(set(map(len, r))) == 1 for r in rows)


# -- in the engine --------------------------------------------------------------------------------------

needs_llama = pytest.mark.skipif(
    "LlamaForCausalLM" not in get_plugins().registry.model_families, reason="needs the nanovllm-llama plugin"
)
PROMPTS = [[5, 9, 13, 200, 17], list(range(30, 61)), [250, 3, 3, 4]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_model):
    from nanovllm import LLM

    path = tiny_model(initializer_range=0.3)  # a peaked distribution: no near-ties among the top tokens
    return LLM(path, kv_cache_memory=1 << 24, device="cpu", max_num_batched_tokens=16)


@needs_llama
def test_logprobs_are_of_the_raw_distribution(llm):
    """Temperature, top-k and top-p change what is sampled, not the logprobs reported: with top_k=1 a
    hot sampler picks the greedy tokens, and their logprobs are the greedy run's."""
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4),
                          use_tqdm=False)
    hot = SamplingParams(temperature=2.5, top_k=1, top_p=0.5, max_tokens=6, ignore_eos=True, logprobs=4)
    sampled = llm.generate(PROMPTS, hot, use_tqdm=False)
    for a, b in zip(greedy, sampled, strict=True):  # (the second run has prefix-cache hits: not bitwise)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            for t in x:
                assert x[t].rank == y[t].rank and x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


@needs_llama
def test_steps_without_logprobs_do_no_logprob_work(llm, monkeypatch):
    calls, launched = [], []
    of, launch = TopLogprobs.of, llm.runner.launch

    def counting_of(*args, **kwargs):
        calls.append(1)
        return of(*args, **kwargs)

    def recording_launch(seqs, *rest):
        step = launch(seqs, *rest)
        launched.append(step)
        return step

    monkeypatch.setattr(TopLogprobs, "of", counting_of)
    monkeypatch.setattr(llm.runner, "launch", recording_launch)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(PROMPTS, plain, use_tqdm=False)
    assert not calls
    assert all(s is None or (s.logprobs is None and s.prompt_logprobs is None) for s in launched)
    assert all(o.outputs[0].logprobs is None and o.prompt_logprobs is None for o in outs)
    # one request that asks: its steps compute logprobs, for its rows only
    launched.clear()
    asked = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    llm.generate(PROMPTS, [plain, asked, plain], use_tqdm=False)
    assert calls
    with_logprobs = [s for s in launched if s is not None and s.logprobs is not None]
    assert len(with_logprobs) == 4 and all(s.logprobs.token_ids.shape == (1, 3) for s in with_logprobs)


@needs_llama
def test_prompt_only_steps_return_their_prompt_logprobs(llm):
    """A prompt chunk that samples nothing (the 31-token prompt in 16-token steps) still has results to
    read back; every prompt position gets exactly one entry."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[1])
    for token, entry in zip(PROMPTS[1][1:], out.prompt_logprobs[1:], strict=True):
        assert token in entry and len(entry) in (1, 2)


@needs_llama
def test_prompt_logprobs_are_computed_in_slices(llm, monkeypatch):
    """A 16-token chunk in slices of 7 rows of logits gives the logprobs of the unsliced computation."""
    from nanovllm.engine import model_runner

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    whole = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].prompt_logprobs
    calls, of = [], TopLogprobs.of

    def counting_of(logits, *args):
        calls.append(logits.shape[0])
        return of(logits, *args)

    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 7)
    monkeypatch.setattr(TopLogprobs, "of", counting_of)
    sliced = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].prompt_logprobs
    assert max(calls) == 7 and sum(calls) == len(PROMPTS[1]) - 1  # every row once, in slices
    for x, y in zip(whole[1:], sliced[1:], strict=True):
        assert x.keys() == y.keys()
        assert all(x[t].rank == y[t].rank and abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


@needs_llama
def test_without_a_tokenizer_decoded_token_is_none(tiny_model):
    from nanovllm import LLM

    llm = LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert entries and all(lp.decoded_token is None for entry in entries for lp in entry.values())
