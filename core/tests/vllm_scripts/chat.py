"""A vLLM chat script in the shape of vLLM's offline chat example: engine flags through EngineArgs, the model's
default sampling parameters with flags over them, a conversation with a system prompt and an OpenAI-style
content list, Qwen3's enable_thinking switch, a batch with the progress bar, a template that reads the
content as parts (chat_template_content_format="openai") and an optional template file; only the imports
changed.

MODEL defaults to a hub ID; the tests point it at a tiny model in a local Hugging Face cache.
"""

import os

from nanovllm import LLM, EngineArgs  # vLLM: from vllm import LLM, EngineArgs
from nanovllm.utils import FlexibleArgumentParser  # vLLM: from vllm.utils import FlexibleArgumentParser

# a template that loops over each message's content parts, as multimodal models' templates do
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}:{% for part in message.content %} {{ part.text }}{% endfor %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def create_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=os.environ.get("MODEL", "Qwen/Qwen3-0.6B"))
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    parser.add_argument("--chat-template-path", type=str)
    return parser


def print_outputs(outputs) -> None:
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
    print("-" * 80)


def main(args: dict) -> None:
    overrides = {name: args.pop(name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
    chat_template_path = args.pop("chat_template_path")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    for name, value in overrides.items():
        if value is not None:
            setattr(sampling_params, name, value)

    conversation = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Name three rivers in Europe."}]},
    ]
    no_thinking = {"enable_thinking": False}
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template_kwargs=no_thinking)
    print_outputs(outputs)

    # the same conversation rendered by hand and passed to generate: the same prompt (and greedy answer)
    tokenizer = llm.llm_engine.get_tokenizer()
    as_strings = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                   else m["content"][0]["text"]} for m in conversation]
    text = tokenizer.apply_chat_template(as_strings, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    by_hand = llm.generate({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, sampling_params,
                           use_tqdm=False)
    assert outputs[0].prompt == text, (outputs[0].prompt, text)
    if sampling_params.temperature == 0:
        assert by_hand[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids

    # a batch, with the progress bar to show it runs as one
    batch = llm.chat([conversation] * 4, sampling_params, use_tqdm=True, chat_template_kwargs=no_thinking)
    print_outputs(batch[:1])
    assert [o.prompt for o in batch] == [text] * 4

    # the content as a list of parts, for a template that loops over them
    parts = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=PARTS_TEMPLATE,
                     chat_template_content_format="openai")
    print_outputs(parts)
    assert parts[0].prompt.startswith("system: You are a terse assistant.\nuser: Hello\n"), parts[0].prompt

    if chat_template_path is not None:
        with open(chat_template_path) as f:
            chat_template = f.read()
        print_outputs(llm.chat([conversation] * 2, sampling_params, use_tqdm=False, chat_template=chat_template))


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
