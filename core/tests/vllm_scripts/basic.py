"""A vLLM offline-inference script (the quickstart's shape), with only the import changed.

MODEL defaults to a hub ID; the tests point it at a tiny model in a local Hugging Face cache.
"""

import os

from nanovllm import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams

MODEL = os.environ.get("MODEL", "Qwen/Qwen3-0.6B")


def main() -> None:
    prompts = ["The capital of France is", "Three primary colours are", "A haiku about the sea:"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    llm = LLM(model=MODEL)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    assert [o.prompt for o in outputs] == prompts
    assert all(0 < len(o.outputs[0].token_ids) <= 16 for o in outputs)  # vLLM's default max_tokens


if __name__ == "__main__":
    main()
