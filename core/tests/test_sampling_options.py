"""vLLM's sampling options beyond temperature and top-k/p: penalties, min_p, min_tokens, logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens, include_stop_str_in_output, n; and the output fields
(finished, metrics, num_cached_tokens). First the sampler on fixed logits against torch references, then
the options through the engine on a tiny model."""

from __future__ import annotations

import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.conformance import host_syncs_fail
from nanovllm.layers.sampler import LogitsProcessing, PenaltyCounts, Sampler
from nanovllm.plugins import get_plugins

# -- the sampler on fixed logits -------------------------------------------------------------------


class Owner:
    """Stands in for a sequence holding a penalty slot."""

    def __init__(self) -> None:
        self.penalty_slot = -1
        self.is_finished = False


def reference_penalties(logits, prompt, output, repetition, frequency, presence):
    """vLLM's formulas, written out per token."""
    logits = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / repetition if value > 0 else value * repetition
    return logits - frequency * counts - presence * (counts > 0).float()


def test_penalties_match_the_formulas_and_count_sampled_tokens():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    histories = [([1, 2, 3, 3], [5, 5, 7]), ([9], []), ([2, 30], [30, 31, 31, 31])]
    settings = [(1.5, 0.4, 0.3), (1.0, 0.0, 0.0), (0.7, -0.5, 1.2)]  # (repetition, frequency, presence)
    counts = PenaltyCounts(vocab, torch.device("cpu"))
    owners = [Owner() for _ in histories]
    slots = [counts.slot(o, torch.tensor(p), torch.tensor(out, dtype=torch.long))
             for o, (p, out) in zip(owners, histories, strict=True)]
    rows = [0, 2]  # row 1 uses no penalty
    processing = LogitsProcessing(
        penalties=(torch.tensor(rows), torch.tensor([slots[r] for r in rows]),
                   *(torch.tensor([settings[r][i] for r in rows]) for i in range(3))),
        counts=counts,
    )
    processed = processing.apply(logits)
    for r in range(3):
        expected = reference_penalties(logits[r], *histories[r], *settings[r]) if r in rows else logits[r]
        torch.testing.assert_close(processed[r], expected)
    # greedy rows take the argmax of the penalised logits, and the sampled tokens are counted
    sampled = Sampler()(logits, torch.zeros(3), processing=processing)
    assert torch.equal(sampled, processed.argmax(-1))
    for r in rows:
        expected = torch.bincount(torch.tensor(histories[r][1] + [sampled[r].item()]), minlength=vocab)
        assert torch.equal(counts.counts[slots[r]].long(), expected)
    assert counts.counts[slots[1]].sum() == 0  # not a penalty row: not counted


def test_penalty_slots_are_reused_after_their_sequence_finishes():
    counts = PenaltyCounts(16, torch.device("cpu"))
    first, second = Owner(), Owner()
    slot = counts.slot(first, torch.tensor([1]), torch.tensor([3, 3], dtype=torch.long))
    assert counts.slot(first, torch.tensor([1]), torch.tensor([], dtype=torch.long)) == slot  # kept
    taken = [counts.slot(Owner(), torch.tensor([0]), torch.tensor([], dtype=torch.long)) for _ in range(3)]
    assert slot not in taken and len(counts.owners) == 4
    first.is_finished = True
    assert counts.slot(second, torch.tensor([2]), torch.tensor([4], dtype=torch.long)) == slot
    assert first.penalty_slot == -1 and len(counts.owners) == 4  # no growth
    assert counts.counts[slot].tolist() == [0, 0, 0, 0, 1] + [0] * 11  # the old counts are gone
    assert counts.in_prompt[slot].nonzero().flatten().tolist() == [2]


def test_bias_bans_allowed_tokens_and_conditional_bans():
    logits = torch.zeros(3, 10)
    inf = float("-inf")
    processing = LogitsProcessing(
        add=(torch.tensor([0, 0, 1]), torch.tensor([4, 6, 4]), torch.tensor([2.5, inf, -1.0])),
        conditional_ban=(torch.tensor([1, 2]), torch.tensor([8, 8]), torch.tensor([3, 3]), torch.tensor([3, 5])),
        allowed=(torch.tensor([2]), torch.tensor([2, 2, 2]), torch.tensor([1, 8, 9])),
    )
    out = processing.apply(logits)
    expected = torch.zeros(3, 10)
    expected[0, 4], expected[0, 6], expected[1, 4] = 2.5, inf, -1.0
    expected[1, 8] = inf  # row 1's previous token is the required 3; row 2's (5) is not
    expected[2] = torch.tensor([inf, 0, inf, inf, inf, inf, inf, inf, 0, 0])
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.zeros(3, 10))  # the input is left alone


def test_min_p_drops_the_unlikely_tokens():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    torch.manual_seed(0)
    draws = 3000
    tokens = Sampler()(probs.log().expand(draws, -1).contiguous(), torch.ones(draws),
                       min_ps=torch.full((draws,), 0.3))
    freq = torch.bincount(tokens, minlength=4).float() / draws
    assert freq[2:].sum() == 0  # below 0.3 * 0.5
    assert torch.allclose(freq[:2], torch.tensor([0.5, 0.3]) / 0.8, atol=0.04)


@pytest.mark.gpu
def test_every_option_runs_on_the_device_without_a_host_sync():
    dev = torch.device("cuda")
    vocab, rows = 1000, 8
    logits = torch.randn(rows, vocab, device=dev)
    counts = PenaltyCounts(vocab, dev)
    ints = lambda values: torch.tensor(values, dtype=torch.long).pin_memory().to(dev, non_blocking=True)  # noqa: E731
    floats = lambda values: torch.tensor(values).pin_memory().to(dev, non_blocking=True)  # noqa: E731
    with host_syncs_fail():
        slots = [counts.slot(Owner(), ints([1, 2, 3]), ints([4, 4])) for _ in range(3)]
        processing = LogitsProcessing(
            add=(ints([0, 1]), ints([5, 6]), floats([3.0, float("-inf")])),
            conditional_ban=(ints([2]), ints([7]), ints([9]), ints([9])),
            allowed=(ints([3]), ints([3, 3]), ints([10, 11])),
            penalties=(ints([4, 5, 6]), ints(slots), floats([1.2] * 3), floats([0.5] * 3), floats([0.1] * 3)),
            counts=counts,
        )
        sampled = Sampler()(logits, floats([0.0, 1.0] * 4), ints([0, 5] * 4), floats([1.0, 0.9] * 4), None,
                            floats([0.0, 0.1] * 4), processing)
    assert sampled[3].item() in (10, 11) and sampled[1].item() != 6


# -- SamplingParams ------------------------------------------------------------------------------


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0, 0, 0, 0, 1)
    assert (p.max_tokens, p.min_tokens, p.skip_special_tokens, p.include_stop_str_in_output) == (16, 0, True, False)
    assert p.logit_bias is p.allowed_token_ids is p.bad_words is p.truncate_prompt_tokens is None
    assert not p.processes_logits
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(max_tokens=None).max_tokens is None


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0}, bad_words=["a"], allowed_token_ids=[3])
    q = p.clone()
    assert q == p
    q.stop.append("y")
    q.logit_bias[5] = 1.0
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0}


def test_logit_bias_takes_json_keys_and_is_clamped():
    assert SamplingParams(logit_bias={"7": 500, 3: -1000}).logit_bias == {7: 100.0, 3: -100.0}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(n=0), "n"),
        (dict(n=2.0), "n"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={1: "a"}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(bad_words="word"), "bad_words"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(skip_special_tokens="no"), "skip_special_tokens"),
        (dict(seed=2**64 - 2, n=3), "seed"),  # the third completion's seed would not fit
    ],
)
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize(("name", "hint"), [("best_of", "not supported"), ("guided_decoding", "not supported"),
                                            ("temprature", "unknown field 'temprature'")])
def test_unknown_and_unsupported_fields_are_errors(name, hint):
    with pytest.raises(TypeError, match=hint):
        SamplingParams(**{name: 1})


# -- through the engine ----------------------------------------------------------------------------

needs_llama = pytest.mark.skipif(
    "LlamaForCausalLM" not in get_plugins().registry.model_families, reason="needs the nanovllm-llama plugin"
)
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 9, 13, 200, 17]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from nanovllm import LLM

    return LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", max_num_batched_tokens=64)


def run(llm, prompt=PROMPT, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.fixture
def captured_logits(llm, monkeypatch):
    """The raw logits of every sampling step (one sequence: one row per step)."""
    rows = []
    compute = llm.runner.model.compute_logits

    def capture(hidden):
        logits = compute(hidden)
        rows.append(logits.float().clone())
        return logits

    monkeypatch.setattr(llm.runner.model, "compute_logits", capture)
    return rows


@needs_llama
@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, presence_penalty=0.7),
                                       dict(repetition_penalty=0.6, presence_penalty=-0.5)])
def test_penalties_in_the_engine_follow_the_formulas(llm, captured_logits, penalties):
    out = run(llm, max_tokens=16, **penalties).token_ids
    assert len(captured_logits) == len(out)
    settings = (penalties.get("repetition_penalty", 1.0), penalties.get("frequency_penalty", 0.0),
                penalties.get("presence_penalty", 0.0))
    for t, logits in enumerate(captured_logits):
        expected = reference_penalties(logits[0], PROMPT, out[:t], *settings)
        assert out[t] == expected.argmax().item(), t


@needs_llama
def test_repetition_penalty_changes_the_greedy_output(llm):
    plain = run(llm, max_tokens=16).token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    assert run(llm, max_tokens=16, repetition_penalty=2.0).token_ids != plain


@needs_llama
def test_penalised_and_plain_requests_share_a_batch(llm):
    prompts = [PROMPT, [7] * 12, list(range(30, 50))]
    alone = [run(llm, p, max_tokens=16, frequency_penalty=1.0 if i == 1 else 0.0).token_ids
             for i, p in enumerate(prompts)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.0 if i == 1 else 0.0)
              for i in range(3)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in batched] == alone


@needs_llama
def test_logit_bias_forces_a_token(llm):
    assert run(llm, temperature=1.0, logit_bias={77: 100}).token_ids == [77] * 12


@needs_llama
def test_allowed_token_ids_restrict_sampling(llm):
    out = run(llm, temperature=1.5, max_tokens=30, allowed_token_ids=[3, 50, 60]).token_ids
    assert set(out) <= {3, 50, 60} and len(set(out)) > 1


@needs_llama
def test_bad_words_never_appear(llm):
    plain = run(llm, max_tokens=16).token_ids
    word = plain[2]
    out = run(llm, max_tokens=16, bad_words=[f"tok{word}"]).token_ids
    assert word not in out and out[:2] == plain[:2]
    # two tokens: the second is banned only right after the first
    first, second = plain[3], plain[4]
    out = run(llm, max_tokens=16, bad_words=[f"tok{first} tok{second}"]).token_ids
    assert out[:4] == plain[:4] and out[4] != second
    assert all(out[i : i + 2] != [first, second] for i in range(len(out) - 1))


@needs_llama
def test_min_tokens_hold_back_eos_and_stop_strings(llm, monkeypatch):
    plain = run(llm, max_tokens=16).token_ids
    eos = plain[1]
    monkeypatch.setattr(llm.llm_engine, "eos_token_ids", {eos})  # a token this prompt produces early is the EOS
    assert run(llm, max_tokens=16, ignore_eos=False).token_ids == plain[:2]
    out = run(llm, max_tokens=16, ignore_eos=False, min_tokens=6)
    assert len(out.token_ids) >= 6 and eos not in out.token_ids[:6]
    assert out.finish_reason == "length" or out.token_ids[-1] == eos
    stop = f"tok{plain[0]}"  # a stop string in the first token is only checked from min_tokens on
    assert run(llm, max_tokens=16, stop=[stop]).token_ids == plain[:1]
    assert len(run(llm, max_tokens=16, stop=[stop], min_tokens=4).token_ids) >= 4


@needs_llama
def test_include_stop_str_in_output(llm):
    plain = run(llm, max_tokens=16)
    stop = f"tok{plain.token_ids[3]}"
    cut = run(llm, max_tokens=16, stop=[stop])
    kept = run(llm, max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    assert kept.token_ids == cut.token_ids
    assert not cut.text.endswith(stop) and kept.text == cut.text + stop


@needs_llama
def test_truncate_prompt_tokens_keeps_the_end(llm):
    out = run(llm, list(range(30, 60)), truncate_prompt_tokens=7)
    assert out.prompt_token_ids == list(range(53, 60))
    assert out.token_ids == run(llm, list(range(53, 60))).token_ids


@needs_llama
def test_max_tokens_none_runs_to_the_context_limit(tiny_model):
    from nanovllm import LLM

    llm = LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", max_model_len=40)
    out = run(llm, max_tokens=None)
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40 and out.finish_reason == "length"


@needs_llama
def test_outputs_carry_finished_and_metrics(llm):
    out = run(llm, max_tokens=5)
    assert out.finished and out.outputs[0].finished()
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    again = run(llm, PROMPT * 8, max_tokens=2)  # 40 tokens: two full blocks of 16
    assert again.num_cached_tokens == 0 or again.num_cached_tokens % 16 == 0
    assert run(llm, PROMPT * 8, max_tokens=2).num_cached_tokens == 32


@needs_llama
def test_n_completions_are_the_seeds_in_turn_and_share_the_prompt_blocks(llm, monkeypatch):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one
    hits = []
    allocate = llm.scheduler.block_manager.allocate

    def record(seq, cached, num_tokens):
        hits.append(len(cached[0]))  # the first KV cache group's blocks
        return allocate(seq, cached, num_tokens)

    monkeypatch.setattr(llm.scheduler.block_manager, "allocate", record)
    out = run(llm, prompt, n=3, seed=11, temperature=1.0, max_tokens=10)
    assert hits == [0, 2, 2]  # the first computes the prompt; the other two take its full blocks
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(c.finished() and len(c.token_ids) == 10 for c in out.outputs)
    singles = [run(llm, prompt, seed=11 + i, temperature=1.0, max_tokens=10).token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(t) for t in singles}) == 3


@needs_llama
def test_bad_requests_leave_the_engine_usable(llm, monkeypatch):
    for kw, hint in ((dict(logit_bias={256: 1.0}), "logit_bias"), (dict(allowed_token_ids=[1, 999]), "allowed"),
                     (dict(truncate_prompt_tokens=600), "truncate_prompt_tokens")):
        with pytest.raises(ValueError, match=hint):
            run(llm, **kw)
    monkeypatch.setattr(llm.input_processor, "tokenizer", None)  # the engine's checks, as without a tokenizer
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        run(llm, bad_words=["tok5"])
    monkeypatch.undo()
    assert not llm.scheduler.has_unfinished()
    assert len(run(llm).token_ids) == 12


@needs_llama
@pytest.mark.gpu
def test_decode_steps_with_every_option_never_wait_for_the_gpu():
    """The engine launches step N+1 before it reads step N's tokens; a sync anywhere in a step (the
    sampler's inputs, penalties, bans, logprobs) would drain that pipeline. On the conformance kit's model,
    whose head size the Triton backend takes."""
    from nanovllm import LLM
    from nanovllm.conformance import tiny_model

    llm = LLM(tiny_model(), kv_cache_memory=1 << 24, device="cuda", attention_backend="triton",
              dtype="float32", block_size=4, enforce_eager=False)
    options = [dict(temperature=0, logprobs=3),
               dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1),
               dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, logprobs=0),
               dict(logit_bias={7: 2.0}, bad_words=["tok9", "tok11 tok12"], min_tokens=30,
                    stop=["tok3 tok3"]),
               dict(allowed_token_ids=[3, 50, 60, 70], temperature=1.5)]
    seqs = [llm.add_request([5 + i, 9, 13, 200, 17] * 4, SamplingParams(max_tokens=40, ignore_eos=True, **o))
            for i, o in enumerate(options)]
    while any(s.num_completion_tokens < 2 for s in seqs):
        llm.step()
    with host_syncs_fail():
        for _ in range(12):  # three blocks of 4 tokens: allocation too
            llm.step()
    assert all(not s.is_finished for s in seqs)
