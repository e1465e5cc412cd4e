"""Parity of the model plugins with Hugging Face transformers, on tiny random float32 models.

For each model (Qwen3 with tied and untied embeddings; Llama with llama3 RoPE scaling, spelled the
transformers-5 way and the legacy way, and with attention biases) and each engine setting (one-step
prefill; chunked prefill mixed with decodes at block sizes 8 and 32; preemption under a tiny KV cache,
with block size 12, and with block size 16 and no prefix cache), the engine generates greedily for a
batch of prompts of different lengths, then again for prompts that share prefixes with the first round
(prefix-cache hits). We check:

- every generated token's next-token distribution, asked for through the public API
  (``SamplingParams(logprobs=vocab)``: the logprob of every token), is within 1e-4 of the log_softmax
  of one full HF forward over prompt + completion at the same position (relative to the logprob where
  it is below -1: a logprob of -10 is within 1e-3);
- the greedy tokens equal HF ``generate(do_sample=False)``;
- the setting really did what it is for (prefix hits, split prompts sharing steps with decodes,
  preemptions).

Then the logprobs API itself, on one model: prompt and generated logprobs, top-k ids and ranks and the
cumulative logprob against HF, in a batch mixing requests with and without logprobs, under chunked
prefill, preemption, one token per step, and with async scheduling on and off.

Engines and HF references are built once per module.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

MAX_NEW = 10
PROMPT_LENS = (5, 37, 75, 130)
TOL = 1e-4  # on logprobs: absolute down to -1, relative below (float32 rounding grows with the magnitude)
INIT = 0.3  # transformers' default 0.02 makes a tied tiny model repeat its input token forever

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}
LEGACY_ROPE_SCALING = {
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

MODELS = {
    "qwen3-tied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "llama-rope-llama3": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    # written with the pre-transformers-5 keys rope_theta + rope_scaling, and random q/k/v/o biases
    "llama-bias-legacy-rope": ("LlamaForCausalLM", dict(attention_bias=True)),
}

# kv_blocks sizes the cache (the CPU default, 2 GiB per engine, is far more than these tests need).
SETTINGS = {
    # every prompt prefilled in one step, then decodes
    "onestep-bs16": dict(block_size=16, kv_blocks=64),
    # prompts split into chunks of at most 32 tokens that share steps with decodes
    "chunked-bs8": dict(block_size=8, max_num_batched_tokens=32, kv_blocks=128),
    "chunked-bs32": dict(block_size=32, max_num_batched_tokens=48, kv_blocks=32),
    # 16 blocks of 12 tokens (a block size that is no power of two; just MAX_MODEL_LEN) for ~270 tokens
    # of work: the scheduler must preempt, and a recomputed sequence finds its own blocks in the cache
    "preempt-bs12": dict(block_size=12, max_num_batched_tokens=32, kv_blocks=16),
    # the same without the prefix cache, so a preempted sequence recomputes prompt and completion
    "preempt-nocache-bs16": dict(block_size=16, max_num_batched_tokens=32, kv_blocks=12,
                                 enable_prefix_caching=False),
}
MAX_MODEL_LEN = 192


def _make_model(root: Path, name: str) -> str:
    from safetensors.torch import load_file, save_file

    from nanovllm.testing import tiny_model_dir

    arch, overrides = MODELS[name]
    path = tiny_model_dir(root / name, arch, initializer_range=INIT, **overrides)
    if name == "llama-bias-legacy-rope":
        config = json.loads((path / "config.json").read_text())
        config.pop("rope_parameters", None)
        config.update(rope_theta=500000.0, rope_scaling=LEGACY_ROPE_SCALING)
        (path / "config.json").write_text(json.dumps(config, indent=2))
        weights = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(1)
        for key, tensor in weights.items():  # transformers initialises biases to zero
            if key.endswith(".bias"):
                weights[key] = tensor + torch.randn(tensor.shape, generator=gen) * 0.5
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _prompts(vocab: int, lens, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


class HFReference:
    """Greedy tokens from HF ``generate`` and log_softmax of the logits of one full HF forward over
    prompt + completion, cached per prompt."""

    def __init__(self, path: str) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """``(completion tokens, logprobs [len(prompt) + MAX_NEW - 1, vocab])``; row i predicts token i + 1
        of prompt + completion."""
        key = tuple(prompt)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW, pad_token_id=0,
            )
            completion = out[0, len(prompt):].tolist()
            logprobs = self.model(out).logits[0, :-1].float().log_softmax(dim=-1)
            self.cache[key] = (completion, logprobs)
        return self.cache[key]

    def completion_logprobs(self, prompt: list[int]) -> torch.Tensor:
        """``[MAX_NEW, vocab]``: row i predicts completion token i."""
        return self(prompt)[1][len(prompt) - 1 :]


def dense(entries: list[dict], vocab: int) -> torch.Tensor:
    """Logprob dicts (one per position) as rows of a ``[positions, vocab]`` tensor, NaN where absent."""
    rows = torch.full((len(entries), vocab), float("nan"))
    for row, entry in zip(rows, entries, strict=True):
        for token, logprob in entry.items():
            row[token] = logprob.logprob
    return rows


def logprob_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).abs() / want.abs().clamp(min=1)


class CapturingEngine:
    """An ``LLM`` that returns the whole next-token distribution of every generated token (through
    ``SamplingParams(logprobs=vocab)``), and records per step what was scheduled."""

    def __init__(self, path: str, **opts) -> None:
        import nanovllm

        self.llm = llm = nanovllm.LLM(path, device="cpu", max_logprobs=-1, **opts)
        runner = llm.runner
        runner.kv.kv_cache.fill_(float("nan"))  # reading a slot no step has written must show in the logprobs
        self.steps: list[dict] = []
        launch = runner.launch

        def recording_launch(seqs, *rest):
            self.steps.append(dict(
                decodes=sum(s.is_decode for s in seqs),
                prefills=sum(not s.is_decode for s in seqs),
                split=any(
                    not s.is_decode and not s.samples_this_step for s in seqs
                ),  # a prompt chunk that does not reach the end of its sequence
                tokens=sum(s.num_scheduled_tokens for s in seqs),
                # a preempted sequence prefilling its prompt and completion again
                recompute=any(not s.is_decode and s.num_completion_tokens > 0 for s in seqs),
            ))
            return launch(seqs, *rest)

        runner.launch = recording_launch

    def generate(self, prompts: list[list[int]]):
        """Per prompt: (cached tokens, greedy tokens, logprobs ``[MAX_NEW, vocab]``)."""
        from nanovllm import SamplingParams

        vocab = self.llm.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for o in outs:
            completion = o.outputs[0]
            for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
                assert entry[token].rank == 1, "the greedy sampler did not take the most likely token"
            results.append((o.num_cached_tokens, completion.token_ids, dense(completion.logprobs, vocab)))
        return results


def _second_round(first: list[list[int]], completions: list[list[int]], vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes with the first round: a repeat, a continuation of prompt + completion
    (its last blocks were filled by decodes), and truncated prompts with new tails."""
    fresh = _prompts(vocab, (7, 20, 9, 33), seed=99)
    return [
        list(first[3]),
        first[2] + completions[2] + fresh[0],
        first[3][:70] + fresh[1],
        first[1][:33] + fresh[2],
        first[0] + fresh[3],
    ]


def engine_options(ref: HFReference, setting: dict) -> dict:
    """A setting's engine options, with ``kv_blocks`` turned into ``kv_cache_memory`` (float32)."""
    opts = dict(setting)
    cfg = ref.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_hidden_layers * opts["block_size"] * cfg.num_key_value_heads * head_dim * 4
    opts["kv_cache_memory"] = opts.pop("kv_blocks") * per_block
    return opts


# -- fixtures -----------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = _make_model(root, name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def hf_reference(model_paths):
    refs: dict[str, HFReference] = {}

    def get(name: str) -> HFReference:
        if name not in refs:
            refs[name] = HFReference(model_paths(name))
        return refs[name]

    return get


@pytest.fixture(scope="module")
def runs(model_paths, hf_reference):
    """``runs(model, setting)`` -> the engine and both rounds' results (cached)."""
    done: dict[tuple[str, str], dict] = {}

    def get(model: str, setting: str) -> dict:
        if (model, setting) in done:
            return done[(model, setting)]
        path = model_paths(model)
        ref = hf_reference(model)
        vocab = ref.model.config.vocab_size
        opts = engine_options(ref, SETTINGS[setting])
        engine = CapturingEngine(path, max_model_len=MAX_MODEL_LEN, **opts)
        assert engine.llm.scheduler.block_manager.num_usable_blocks == SETTINGS[setting]["kv_blocks"]
        first = _prompts(vocab, PROMPT_LENS, seed=7)
        out1 = engine.generate(first)
        second = _second_round(first, [ref(p)[0] for p in first], vocab)
        out2 = engine.generate(second)
        done[(model, setting)] = result = dict(
            engine=engine, prompts=first + second, outputs=out1 + out2, num_first=len(first)
        )
        return result

    return get


CASES = [pytest.param(m, s, id=f"{m}-{s}") for m in MODELS for s in SETTINGS]


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "setting"), CASES)
def test_next_token_logprobs_match_hf(runs, hf_reference, model, setting):
    run = runs(model, setting)
    ref = hf_reference(model)
    for i, (prompt, (_, tokens, logprobs)) in enumerate(zip(run["prompts"], run["outputs"], strict=True)):
        want_tokens = ref(prompt)[0]
        want = ref.completion_logprobs(prompt)
        if tokens != want_tokens:  # past the first difference the rows describe other sequences
            n = next(j for j, (a, b) in enumerate(zip(tokens, want_tokens, strict=True)) if a != b)
            logprobs, want = logprobs[: n + 1], want[: n + 1]
        err = logprob_error(logprobs, want).amax(dim=-1)  # NaN (a token missing from a dict) fails too
        assert (err < TOL).all(), f"prompt {i} ({len(prompt)} tokens): logprob error {err}"


@pytest.mark.parametrize(("model", "setting"), CASES)
def test_greedy_tokens_match_hf_generate(runs, hf_reference, model, setting):
    run = runs(model, setting)
    ref = hf_reference(model)
    got = [tokens for _, tokens, _ in run["outputs"]]
    want = [ref(p)[0] for p in run["prompts"]]
    assert got == want


@pytest.mark.parametrize(("model", "setting"), CASES)
def test_setting_exercised_what_it_is_for(runs, model, setting):
    run = runs(model, setting)
    engine, steps = run["engine"], run["engine"].steps
    cached = [c for c, _, _ in run["outputs"]]
    if not engine.llm.scheduler.num_preemptions:
        assert not any(cached[: run["num_first"]]), "a fresh engine cannot have prefix hits in round one"
    if engine.llm.config.enable_prefix_caching:
        assert sum(cached[run["num_first"]:]) > 0, "the second round should reuse cached prefix blocks"
    else:
        assert not any(cached)
    block_size = engine.llm.config.block_size
    assert all(c % block_size == 0 for c in cached)
    if not setting.startswith("preempt"):  # (under preemption, blocks may be evicted before the hit)
        # prompt 2 + its completion + more reuses every full block of round one, which for block sizes
        # 8 and 16 includes a block that decodes completed
        computed = PROMPT_LENS[2] + MAX_NEW - 1
        assert cached[run["num_first"] + 1] == computed // block_size * block_size
    if setting == "onestep-bs16":
        assert steps[0]["prefills"] == len(PROMPT_LENS) and steps[0]["decodes"] == 0
        assert not any(s["split"] for s in steps)
    if setting.startswith("chunked"):
        budget = engine.llm.config.max_num_batched_tokens
        assert max(s["tokens"] for s in steps) <= budget
        assert any(s["split"] for s in steps), "no prompt was split into chunks"
        assert any(s["decodes"] and s["prefills"] for s in steps), "no step mixed prefill chunks with decodes"
    if setting.startswith("preempt"):
        assert engine.llm.scheduler.num_preemptions > 0, "the tiny KV cache should force preemption"
        assert any(s["recompute"] for s in steps), "no sequence was preempted after it had generated"
    else:
        assert not any(s["recompute"] for s in steps)


def test_references_are_sensitive(hf_reference):
    """The models are not degenerate: RoPE scaling and attention biases change HF's own logits by far more
    than the tolerance, and greedy completions are not one repeated token."""
    import transformers

    for name in ("llama-rope-llama3", "llama-bias-legacy-rope"):
        ref = hf_reference(name)
        config = ref.model.config
        plain = copy.deepcopy(config)
        plain.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
        unscaled = transformers.LlamaForCausalLM(plain).eval()
        unscaled.load_state_dict(ref.model.state_dict())
        ids = torch.tensor([_prompts(config.vocab_size, (130,), seed=7)[0]])
        with torch.no_grad():
            a, b = ref.model(ids).logits[0, -1], unscaled(ids).logits[0, -1]
        diff = (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item()
        assert diff > 100 * TOL, f"{name}: rope scaling has no effect"
    bias = hf_reference("llama-bias-legacy-rope").model.model.layers[0].self_attn
    assert all(p.bias.abs().max() > 0.1 for p in (bias.q_proj, bias.k_proj, bias.v_proj, bias.o_proj))
    for name in MODELS:
        ref = hf_reference(name)
        completions = [ref(p)[0] for p in _prompts(ref.model.config.vocab_size, PROMPT_LENS, seed=7)]
        assert sum(len(set(c)) for c in completions) > 3 * len(completions), f"{name}: {completions}"


# -- the logprobs API ---------------------------------------------------------------------------------

LOGPROB_MODEL = "qwen3-untied"
LOGPROB_SETTINGS = {
    "onestep": dict(block_size=16, kv_blocks=64),
    "chunked": dict(block_size=8, max_num_batched_tokens=32, kv_blocks=128),
    # 16 blocks of 12 tokens for ~290 tokens of work: requests with prompt logprobs are preempted and
    # recompute their prompts
    "preempt": dict(block_size=12, max_num_batched_tokens=32, kv_blocks=16),
    # every step computes one token, so every prompt token runs as a decode (most of them sample nothing)
    "one-token-steps": dict(block_size=16, max_num_batched_tokens=1, kv_blocks=64),
}
VOCAB = 256  # of the tiny models


def logprob_params():
    """A batch mixing top-k logprobs, none, only the chosen tokens (k=0), and the whole vocabulary."""
    from nanovllm import SamplingParams

    base = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [
        SamplingParams(**base, logprobs=3, prompt_logprobs=2),
        SamplingParams(**base),
        SamplingParams(**base, logprobs=0, prompt_logprobs=0),
        SamplingParams(**base, logprobs=VOCAB, prompt_logprobs=VOCAB),
    ]


@pytest.fixture(scope="module")
def logprob_runs(model_paths, hf_reference):
    """``logprob_runs(setting, async_scheduling)`` -> (engine, outputs, preempted request ids) (cached)."""
    done: dict[tuple[str, bool], tuple] = {}

    def get(setting: str, async_scheduling: bool = True) -> tuple:
        if (setting, async_scheduling) not in done:
            import nanovllm

            opts = engine_options(hf_reference(LOGPROB_MODEL), LOGPROB_SETTINGS[setting])
            llm = nanovllm.LLM(model_paths(LOGPROB_MODEL), device="cpu", max_model_len=MAX_MODEL_LEN,
                               max_logprobs=-1, async_scheduling=async_scheduling, **opts)
            llm.runner.kv.kv_cache.fill_(float("nan"))
            preempted: list[str] = []
            preempt = llm.scheduler._preempt

            def recording_preempt(seq):
                preempted.append(seq.request_id)
                preempt(seq)

            llm.scheduler._preempt = recording_preempt
            outs = llm.generate(_prompts(VOCAB, PROMPT_LENS, seed=7), logprob_params(), use_tqdm=False)
            done[(setting, async_scheduling)] = (llm, outs, preempted)
        return done[(setting, async_scheduling)]

    return get


def check_entry(entry: dict, own: int, k: int, want: torch.Tensor) -> None:
    """One position's dict: its own token plus exactly the ``k`` most likely, with HF's logprobs and
    ranks (ranks allowing for near-ties within the tolerance), and each token's text."""
    assert own in entry
    assert len(entry) == k + (entry[own].rank > k)
    tokens = torch.tensor(list(entry))
    got = torch.tensor([logprob.logprob for logprob in entry.values()])
    ranks = torch.tensor([logprob.rank for logprob in entry.values()])
    assert (logprob_error(got, want[tokens]) < TOL).all()
    slack = (2 * TOL * got.abs().clamp(min=1)).unsqueeze(-1)
    assert (1 + (want > got.unsqueeze(-1) + slack).sum(-1) <= ranks).all()
    assert (ranks <= 1 + (want > got.unsqueeze(-1) - slack).sum(-1)).all()
    assert [logprob.decoded_token for logprob in entry.values()] == [f"tok{t}" for t in entry]
    in_top = (tokens != own) | (ranks <= k)
    assert in_top.sum() == k
    top, top_ranks = got[in_top], ranks[in_top]  # their ranks among themselves: ties share a rank
    assert torch.equal(top_ranks, 1 + (top.unsqueeze(0) > top.unsqueeze(-1)).sum(-1))


@pytest.mark.parametrize("setting", LOGPROB_SETTINGS)
def test_logprobs_match_hf(logprob_runs, hf_reference, setting):
    llm, outs, preempted = logprob_runs(setting)
    ref = hf_reference(LOGPROB_MODEL)
    for prompt, params, out in zip(_prompts(VOCAB, PROMPT_LENS, seed=7), logprob_params(), outs, strict=True):
        completion = out.outputs[0]
        want_tokens, want = ref(prompt)
        assert completion.token_ids == want_tokens
        if params.logprobs is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
            assert out.prompt_logprobs is None
            continue
        assert len(completion.logprobs) == MAX_NEW
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            assert entry[token].rank == 1  # greedy: the sampled token is the most likely
            check_entry(entry, token, params.logprobs, want[len(prompt) - 1 + i])
        sampled = zip(completion.token_ids, completion.logprobs, strict=True)
        assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in sampled), abs=1e-9)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[i], prompt[i], params.prompt_logprobs, want[i - 1])
        assert out.num_cached_tokens == 0
    assert not llm.scheduler.has_unfinished()
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    if setting == "preempt":
        asked = {o.request_id for o, p in zip(outs, logprob_params(), strict=True) if p.prompt_logprobs}
        assert asked & set(preempted), "no request with prompt logprobs was preempted"


def test_whole_vocabulary_ranks_follow_the_definition(logprob_runs):
    """With every token returned, each rank is exactly 1 + the number of strictly larger logprobs."""
    _, outs, _ = logprob_runs("chunked")
    out = outs[3]
    for entry in [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]:
        assert len(entry) == VOCAB
        values = torch.tensor([lp.logprob for lp in entry.values()])
        ranks = torch.tensor([lp.rank for lp in entry.values()])
        assert torch.equal(ranks, 1 + (values.unsqueeze(0) > values.unsqueeze(-1)).sum(-1))
        assert torch.logsumexp(values, 0).abs() < 1e-5  # a whole distribution


def same_logprobs(a: list[dict | None], b: list[dict | None]) -> bool:
    """Equal dicts but for float rounding: the same tokens, logprobs within the tolerance."""
    return len(a) == len(b) and all(
        x == y or (x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < TOL for t in x))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("setting", ["onestep", "chunked", "preempt"])
def test_async_scheduling_gives_the_sync_logprobs(logprob_runs, setting):
    """Identical where both run the same steps. Under preemption they do not: a request that reached
    max_tokens frees its blocks one step later with async scheduling (when its last token is read), so
    other requests are preempted at other points and their prompts chunked differently."""
    _, on, _ = logprob_runs(setting, True)
    _, off, _ = logprob_runs(setting, False)
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if setting != "preempt":
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
            assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
            assert a.prompt_logprobs == b.prompt_logprobs
        elif b.prompt_logprobs is not None:
            assert same_logprobs(a.outputs[0].logprobs, b.outputs[0].logprobs)
            assert same_logprobs(a.prompt_logprobs, b.prompt_logprobs)


def test_one_token_steps_give_the_tokens_and_prompt_logprobs_of_a_normal_run(logprob_runs):
    """max_num_batched_tokens=1: every prompt token is a one-token step run as a decode."""
    _, single, _ = logprob_runs("one-token-steps")
    _, normal, _ = logprob_runs("onestep")
    for a, b in zip(single, normal, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if b.prompt_logprobs is None:
            assert a.prompt_logprobs is None
            continue
        assert same_logprobs(a.prompt_logprobs, b.prompt_logprobs)


def test_prompt_logprobs_take_no_prefix_hits_but_publish_their_blocks(model_paths, hf_reference):
    import nanovllm
    from nanovllm import SamplingParams

    ref = hf_reference(LOGPROB_MODEL)
    llm = nanovllm.LLM(model_paths(LOGPROB_MODEL), device="cpu", max_model_len=MAX_MODEL_LEN,
                       **engine_options(ref, dict(block_size=16, kv_blocks=64)))
    prompt = _prompts(VOCAB, (75,), seed=7)[0]
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    first = llm.generate([prompt], scored, use_tqdm=False)[0]
    again = llm.generate([prompt, prompt], [scored, plain], use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert again[0].num_cached_tokens == 0 and again[0].prompt_logprobs == first.prompt_logprobs
    assert again[1].num_cached_tokens == 64  # the blocks the scored requests computed
    want = ref(prompt)[1]
    for i in range(1, len(prompt)):
        check_entry(again[0].prompt_logprobs[i], prompt[i], 1, want[i - 1])
