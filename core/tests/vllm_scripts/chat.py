"""A vLLM chat script: a system prompt, OpenAI-style content lists, Qwen3's enable_thinking switch, a batch
of conversations and a hand-rendered prompt; only the import changed."""

import os

from nanovllm import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams

MODEL = os.environ.get("MODEL", "Qwen/Qwen3-0.6B")


def main() -> None:
    llm = LLM(model=MODEL)
    sampling_params = SamplingParams(temperature=0, max_tokens=24)
    conversation = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Name three rivers in Europe."}]},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    print(f"Prompt: {outputs[0].prompt!r}\nGenerated text: {outputs[0].outputs[0].text!r}")

    # the same conversation rendered by hand and passed to generate: the same prompt, the same greedy answer
    tokenizer = llm.get_tokenizer()
    as_strings = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                   else m["content"][0]["text"]} for m in conversation]
    text = tokenizer.apply_chat_template(as_strings, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    by_hand = llm.generate({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, sampling_params)
    assert outputs[0].prompt == text, (outputs[0].prompt, text)
    assert by_hand[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids

    batch = llm.chat([conversation] * 3, sampling_params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) == 1
    print(f"{len(batch)} conversations answered")


if __name__ == "__main__":
    main()
