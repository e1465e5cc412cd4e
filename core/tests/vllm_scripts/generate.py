"""A vLLM generate script in the shape of vLLM's offline generate example: the engine flags of EngineArgs in
an argument group, the model through --model, sampling flags over the model's default sampling parameters;
only the imports changed. The tests run it with --model and sampling flags spelled both ways (dashes and
underscores)."""

from nanovllm import LLM, EngineArgs  # vLLM: from vllm import LLM, EngineArgs
from nanovllm.utils import FlexibleArgumentParser  # vLLM: from vllm.utils import FlexibleArgumentParser


def main(args: dict) -> None:
    # what LLM does not take
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    top_p = args.pop("top_p")
    top_k = args.pop("top_k")

    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k

    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    assert [o.prompt for o in outputs] == prompts
    if max_tokens is not None:
        assert all(0 < len(o.outputs[0].token_ids) <= max_tokens for o in outputs)


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model="Qwen/Qwen3-0.6B")
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    main(vars(parser.parse_args()))
