"""Sampling: the sampler on fixed logits, then SamplingParams through the engine on a tiny model."""

from __future__ import annotations

import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.layers.sampler import Sampler
from nanovllm.plugins import get_plugins

# -- the sampler on fixed logits -------------------------------------------------------------------


def sample(logits, temperature=1.0, top_k=None, top_p=None, generators=None):
    rows = logits.shape[0]
    temps = torch.full((rows,), float(temperature))
    top_ks = None if top_k is None else torch.full((rows,), top_k, dtype=torch.long)
    top_ps = None if top_p is None else torch.full((rows,), float(top_p))
    return Sampler()(logits, temps, top_ks, top_ps, generators)


def frequencies(logits_row, draws=4000, **kw):
    torch.manual_seed(0)
    tokens = sample(logits_row.expand(draws, -1).contiguous(), **kw)
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).float() / draws


def test_greedy_is_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))


def test_greedy_rows_ignore_top_k_top_p_and_noise_of_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    temps = torch.tensor([0.0, 1.0, 0.0, 1.5, 0.0, 0.7])
    out = Sampler()(logits, temps, torch.full((6,), 5), torch.full((6,), 0.9), None)
    greedy = temps == 0
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_top_k_one_and_tiny_top_p_are_greedy(kw):
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    assert torch.equal(sample(logits, temperature=1.5, **kw), logits.argmax(-1))


def test_top_k_keeps_the_k_best():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.0]])
    freq = frequencies(logits[0], top_k=3)
    assert set(torch.nonzero(freq).flatten().tolist()) == {1, 3, 5}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert set(torch.nonzero(frequencies(logits, top_p=0.7)).flatten().tolist()) == {0, 1}
    assert set(torch.nonzero(frequencies(logits, top_p=0.85)).flatten().tolist()) == {0, 1, 2}
    kept = frequencies(logits, top_p=0.7)[:2]
    assert torch.allclose(kept, torch.tensor([0.5, 0.3]) / 0.8, atol=0.04)  # renormalised


def test_temperature_reshapes_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    tops = []
    for t in (0.5, 1.0, 2.0):
        freq = frequencies(logits, temperature=t)
        assert torch.allclose(freq, torch.softmax(logits / t, -1), atol=0.03), t
        tops.append(freq[0].item())
    assert tops[0] > tops[1] > tops[2]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    alone = sample(logits[2:3], generators=[torch.Generator().manual_seed(9)])
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(9), None, None]
    batched = sample(logits, generators=gens)
    assert batched[2] == alone[0]
    draws = [sample(logits[2:3], generators=[torch.Generator().manual_seed(9)]).item() for _ in range(3)]
    assert draws == [alone.item()] * 3


# -- SamplingParams through the engine ------------------------------------------------------------

needs_llama = pytest.mark.skipif(
    "LlamaForCausalLM" not in get_plugins().registry.model_families, reason="needs the nanovllm-llama plugin"
)

PROMPTS = [[5, 9, 13, 200, 17], list(range(30, 61)), [250, 3, 3, 4], [7] * 12]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_model):
    from nanovllm import LLM

    return LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", max_num_batched_tokens=32)


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def after_prompt(llm, prompt: list[int], completion: list[int]) -> str:
    decode = llm.tokenizer.decode
    whole = decode(prompt + completion, skip_special_tokens=True)
    head = decode(prompt, skip_special_tokens=True)
    assert whole.startswith(head)
    return whole[len(head) :]


def greedy_tokens(llm, prompt, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return gen(llm, [prompt], params)[0].token_ids


@needs_llama
def test_greedy_top_k_one_and_tiny_top_p_agree(llm):
    greedy = gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        other = gen(llm, PROMPTS, SamplingParams(temperature=1.3, max_tokens=10, ignore_eos=True, **kw))
        assert [o.token_ids for o in other] == [o.token_ids for o in greedy], kw


@needs_llama
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm, tiny_model):
    from nanovllm import LLM

    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = gen(llm, [PROMPTS[1]], seeded)[0].token_ids
    assert gen(llm, [PROMPTS[1]], seeded)[0].token_ids == alone
    others = [
        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
        seeded,
        SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    batched = gen(llm, PROMPTS, others)
    assert batched[1].token_ids == alone
    fresh = LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", max_num_seqs=1)  # one at a time
    assert gen(fresh, [PROMPTS[1]], seeded)[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert gen(llm, [PROMPTS[1]], other_seed)[0].token_ids != alone


@needs_llama
def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {tuple(gen(llm, [PROMPTS[0]], params)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


@needs_llama
def test_max_tokens_gives_length(llm):
    out = gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert all(len(o.token_ids) == 7 and o.finish_reason == "length" and o.outputs[0].stop_reason is None
               for o in out)


@needs_llama
def test_stop_strings_truncate_the_text(llm):
    tokens = greedy_tokens(llm, PROMPTS[0], 12)

    def text(n: int) -> str:  # the text that follows the prompt after n generated tokens
        return after_prompt(llm, PROMPTS[0], tokens[:n])

    words = text(12).split()
    for stop in (words[3], f"{words[4]} {words[5]}", words[5][:-1]):  # a word, two words, part of one
        k = next(i for i in range(1, 13) if stop in text(i))
        full = text(k)
        out = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     stop=["never-there", stop]))[0]
        assert out.token_ids == tokens[:k], stop
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.text == full[: full.find(stop)]
        assert stop not in out.text


@needs_llama
def test_stop_token_ids(llm):
    tokens = greedy_tokens(llm, PROMPTS[2], 12)
    target = tokens[4]
    k = tokens.index(target) + 1
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[target])
    out = gen(llm, [PROMPTS[2]], params)[0]
    assert out.token_ids == tokens[:k]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == target


@needs_llama
def test_eos_stops_unless_ignore_eos(llm, monkeypatch):
    assert 2 in llm.eos_token_ids  # tok2 from the tokenizer and config.json
    tokens = greedy_tokens(llm, PROMPTS[3], 12)
    k = tokens.index(tokens[3]) + 1
    monkeypatch.setattr(llm.llm_engine, "eos_token_ids", {tokens[3]})  # a token this prompt produces is the EOS
    out = gen(llm, [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == tokens[:k]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None
    out = gen(llm, [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == tokens and out.finish_reason == "length"


@needs_llama
def test_outputs_come_back_in_prompt_order(llm):
    singles = [greedy_tokens(llm, p, n) for p, n in zip(PROMPTS, (9, 2, 14, 5), strict=True)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 14, 5)]
    out = gen(llm, PROMPTS, params)  # they finish in another order than they were given
    assert [o.prompt_token_ids for o in out] == PROMPTS
    assert [o.token_ids for o in out] == singles
    assert len({o.request_id for o in out}) == len(PROMPTS)


@needs_llama
def test_generate_accepts_strings_token_ids_dicts_and_a_mix(llm):
    ids = [5, 9, 13, 200, 17]
    text = "tok5 tok9 tok13 tok200 tok17"
    assert llm.tokenizer.encode(text) == ids
    expected = greedy_tokens(llm, ids, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    single_text = gen(llm, text, params)
    single_ids = gen(llm, ids, params)
    assert len(single_text) == len(single_ids) == 1
    assert single_text[0].token_ids == single_ids[0].token_ids == expected
    assert single_text[0].prompt == text and single_ids[0].prompt is None

    mixed = gen(llm, [text, ids, {"prompt_token_ids": ids}, {"prompt": text}, (5, 9, 13, 200, 17)], params)
    assert [o.token_ids for o in mixed] == [expected] * 5
    assert all(o.prompt_token_ids == ids for o in mixed)
    assert mixed[0].text == after_prompt(llm, ids, expected)
    assert mixed[0].text.startswith(" ")  # the word-level tokenizer's separator is kept
    assert text + mixed[0].text == llm.tokenizer.decode(ids + expected, skip_special_tokens=True)
    seq = llm.add_request(text, params)  # the older step-by-step form takes the same prompts
    while llm.scheduler.has_unfinished():
        assert llm.step() == []  # its outputs are read from the sequence
    assert seq.completion_token_ids == expected
