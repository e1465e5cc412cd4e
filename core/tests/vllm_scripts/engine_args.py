"""A vLLM script that sets the engine options vLLM users commonly pass; only the import changed."""

import os

from nanovllm import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams

MODEL = os.environ.get("MODEL", "Qwen/Qwen3-0.6B")
DOWNLOAD_DIR = os.environ.get("DOWNLOAD_DIR")  # a shared model cache, as on a cluster


def main() -> None:
    llm = LLM(
        model=MODEL,
        tokenizer=MODEL,
        revision="main",
        download_dir=DOWNLOAD_DIR,
        dtype="float",
        trust_remote_code=True,
        seed=0,
        max_model_len=256,
        max_num_seqs=8,
        gpu_memory_utilization=0.9,
        enforce_eager=True,
    )
    outputs = llm.generate(["Write one sentence about tea."], SamplingParams(temperature=0, max_tokens=8))
    print(f"Generated text: {outputs[0].outputs[0].text!r}")
    assert outputs[0].outputs[0].finish_reason in ("stop", "length")


if __name__ == "__main__":
    main()
