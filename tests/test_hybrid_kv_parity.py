"""Hybrid KV gives the tokens of the uniform layout and of Hugging Face transformers.

On the tiny float32 models with a window of ``HYBRID_WINDOW`` tokens (Gemma 3: four sliding layers and two
global ones; Mistral: a window on every layer), prompts of up to ~300 tokens cross the window many times.
Each run does a first round of prompts, then a second round sharing prefixes with it (prefix-cache hits
that reach past the window), greedy over ``MAX_NEW`` tokens, in three settings: prefill chunks of 40 tokens
(chunk boundaries inside the window) in a roomy cache; chunks of 24 in a cache holding about one and a half
sequences (preemption); and, for Gemma 3, KV offload to a host pool. The engine's tokens equal
transformers' ``generate(do_sample=False)`` in either KV layout, so the hybrid layout
(``disable_hybrid_kv_cache_manager=False``, the default) equals the uniform one. On a CUDA machine (``gpu``
marker) the hybrid layout with the Triton backend, chunked prefill, prefix hits and decode in CUDA graphs
gives transformers' tokens too.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.plugins import get_plugins
from nanovllm.testing import HYBRID_BLOCK_SIZE, HYBRID_WINDOW, tiny_kv_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID = "disable_hybrid_kv_cache_manager" in attrs.fields_dict(EngineConfig)
MODELS = ["Gemma3ForCausalLM", "MistralForCausalLM"]
MAX_NEW = 64
MAX_MODEL_LEN = 320
PROMPT_LENS = (45, 130, 230)
# (max_num_batched_tokens, KV budget in sequences of MAX_MODEL_LEN tokens; None: KV offload to a host pool)
SETTINGS = {"chunked": (40, 8.0), "preempt": (24, 1.5), "offload": (40, None)}
OFFLOAD = dict(kv_offloading_size=0.01, kv_offloading_buffer_size=0.01, max_num_seqs=8)
ONE_LAYOUT = pytest.mark.skipif(not HYBRID, reason="the engine has one KV layout")
LAYOUTS = [pytest.param(False, id="hybrid", marks=ONE_LAYOUT), pytest.param(True, id="uniform")]


def layout(uniform: bool) -> dict:
    """The engine option that picks the KV layout; nothing on an engine that has only the uniform one."""
    return {"disable_hybrid_kv_cache_manager": uniform} if HYBRID else {}


def prompts(lens, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lens]


def second_round(first: list[list[int]], completions: list[list[int]]) -> list[list[int]]:
    """Prompts sharing prefixes with the first round: a repeat, prompt + completion + more, a truncation."""
    fresh = prompts((9, 20), seed=99)
    return [list(first[1]), first[1] + completions[1][:40] + fresh[0], first[2][:150] + fresh[1]]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    def get(architecture: str) -> str:
        if architecture not in get_plugins().registry.model_families:
            pytest.skip(f"needs the model-family plugin of {architecture}")
        return tiny_model(architecture)

    return get


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    """Transformers' greedy completion of ``MAX_NEW`` tokens (no EOS stop), per model and prompt."""
    import transformers

    models, done = {}, {}

    def get(architecture: str, prompt: list[int]) -> list[int]:
        if architecture not in models:
            path = model_dir(architecture)
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model.generation_config.eos_token_id = None
            models[architecture] = model.eval()
        key = (architecture, tuple(prompt))
        if key not in done:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = models[architecture].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                    max_new_tokens=MAX_NEW, pad_token_id=0)
            done[key] = out[0, len(prompt):].tolist()
        return done[key]

    return get


@pytest.fixture(scope="module")
def runs(model_dir, hf_greedy):
    done = {}

    def get(architecture: str, setting: str, uniform: bool) -> dict:
        key = (architecture, setting, uniform)
        if key not in done:
            from nanovllm import LLM

            chunk, sequences = SETTINGS[setting]
            memory = OFFLOAD if sequences is None else dict(kv_cache_memory=int(
                sequences * tiny_kv_bytes(architecture, MAX_MODEL_LEN, chunk, hybrid=not uniform)))
            llm = LLM(model_dir(architecture), device="cpu", block_size=HYBRID_BLOCK_SIZE,
                      max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=chunk, **memory,
                      skip_tokenizer_init=True, **layout(uniform))
            params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
            first = prompts(PROMPT_LENS, seed=7)
            again = second_round(first, [hf_greedy(architecture, p) for p in first])
            outputs = [*llm.generate(first, params, use_tqdm=False),
                       *llm.generate(again, params, use_tqdm=False)]
            bm = llm.scheduler.block_manager
            all_free = bm.num_free_blocks == bm.num_usable_blocks
            done[key] = dict(prompts=first + again, outputs=outputs, all_free=all_free,
                             preemptions=llm.scheduler.num_preemptions,
                             windows=[g.sliding_window for g in getattr(llm, "kv_cache_groups", ())])
        return done[key]

    return get


# Mistral has no full-attention layer to offload (its window layers stay on the GPU)
CASES = [pytest.param(a, s, id=f"{a.removesuffix('ForCausalLM').lower()}-{s}")
         for a in MODELS for s in SETTINGS if s != "offload" or a == "Gemma3ForCausalLM"]


@pytest.mark.parametrize("uniform", LAYOUTS)
@pytest.mark.parametrize(("architecture", "setting"), CASES)
def test_tokens_equal_transformers(runs, hf_greedy, architecture, setting, uniform):
    run = runs(architecture, setting, uniform)
    for i, (prompt, out) in enumerate(zip(run["prompts"], run["outputs"], strict=True)):
        assert out.token_ids == hf_greedy(architecture, prompt), f"prompt {i} ({len(prompt)} tokens)"
    assert run["all_free"], "blocks left held after every request finished"


@pytest.mark.parametrize("uniform", LAYOUTS)
@pytest.mark.parametrize(("architecture", "setting"), CASES)
def test_setting_exercised_what_it_is_for(runs, architecture, setting, uniform):
    run = runs(architecture, setting, uniform)
    if HYBRID and setting != "offload":  # the layout asked for: window groups, or one group of every token
        assert (run["windows"] == [None]) if uniform else HYBRID_WINDOW in run["windows"]
    cached = [o.num_cached_tokens for o in run["outputs"][len(PROMPT_LENS):]]
    assert max(cached) > 2 * HYBRID_WINDOW, "the second round should hit the prefix cache past the window"
    if setting == "preempt":
        assert run["preemptions"] > 0, "the tight KV cache should force preemption"


@pytest.mark.skipif(not HYBRID, reason="the engine has one KV layout")
@pytest.mark.parametrize(("architecture", "setting"), CASES)
def test_hybrid_layout_gives_the_uniform_tokens(runs, architecture, setting):
    hybrid, uniform = runs(architecture, setting, False), runs(architecture, setting, True)
    assert [o.token_ids for o in hybrid["outputs"]] == [o.token_ids for o in uniform["outputs"]]


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", MODELS)
def test_triton_hybrid_engine_on_cuda_matches_transformers(model_dir, hf_greedy, architecture):
    """Chunks of 40 tokens, a second round of prefix hits, decode steps in CUDA graphs, both layouts."""
    from nanovllm import LLM

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = prompts(PROMPT_LENS, seed=7)
    all_prompts = first + second_round(first, [hf_greedy(architecture, p) for p in first])
    for uniform in ([False, True] if HYBRID else [True]):
        llm = LLM(model_dir(architecture), device="cuda", dtype="float32", attention_backend="triton",
                  block_size=HYBRID_BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=40,
                  kv_cache_memory=1 << 26, skip_tokenizer_init=True, **layout(uniform))
        assert llm.runner.cuda_graphs.graphs, "decode should run in CUDA graphs"
        outputs = llm.generate(first, params, use_tqdm=False) + llm.generate(all_prompts[len(first):], params,
                                                                             use_tqdm=False)
        assert max(o.num_cached_tokens for o in outputs[len(first):]) > 2 * HYBRID_WINDOW
        assert [o.token_ids for o in outputs] == [hf_greedy(architecture, p) for p in all_prompts], (
            f"uniform={uniform}")
