"""A vLLM script that passes pre-tokenized and text prompts as vLLM's prompt types; only the imports changed."""

import os

from nanovllm import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams
from nanovllm.inputs import TextPrompt, TokensPrompt  # vLLM: from vllm.inputs import TextPrompt, TokensPrompt

MODEL = os.environ.get("MODEL", "Qwen/Qwen3-0.6B")


def main() -> None:
    llm = LLM(model=MODEL)
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog"
    prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(text)), TextPrompt(prompt=text)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for output in outputs:
        print(f"Prompt ids: {output.prompt_token_ids}, Generated text: {output.outputs[0].text!r}")
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


if __name__ == "__main__":
    main()
