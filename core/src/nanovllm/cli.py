"""The ``nanovllm`` command: ``generate``, ``plugins`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM, SamplingParams

    # Check the sampling options before the model loads.
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    options = {"device": args.device, "sparse_policy": args.sparse_policy, "attention_backend": args.attention_backend}
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    llm = LLM(args.model, **options)
    chat = args.chat if args.chat is not None else getattr(llm.tokenizer, "chat_template", None) is not None
    if chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(out.text.strip() if chat else prompt + out.text)
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from nanovllm.plugins import get_plugins

    plugins = get_plugins().plugins
    if args.json:
        print(json.dumps([p.as_dict() for p in plugins], indent=2))
        return 0
    for p in plugins:
        print(f"{p.name:<12} {p.dist} {p.version}  ({p.value})")
        if p.error:
            print(f"    FAILED TO LOAD: {p.error}")
        elif p.warning:
            print(f"    WARNING: {p.warning}")
        for entry in p.registered:
            print(f"    {entry}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A small, fast LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default=None, help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: when the tokenizer has one)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--sparse-policy", default="full", help="e.g. 'full', 'quest:token_budget=2048' or 'prefill=xattn;decode=quest' (one policy per phase)")
    gen.add_argument("--attention-backend", default="auto", help="e.g. 'auto', 'torch'")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    gen.set_defaults(func=_generate)

    plug = sub.add_parser("plugins", help="list installed plugins and what they register")
    plug.add_argument("--json", action="store_true", help="machine-readable output")
    plug.set_defaults(func=_plugins)
    bench = sub.add_parser("bench", help="benchmarks on shape presets with random weights (GPU), and the "
                           "attention quality of sparse policies on the built-in model (CPU or GPU)")
    bench.add_argument("benchmark", choices=("throughput", "latency", "kernels", "all", "offload", "quality", "render"),
                       help="B1 throughput (+ decode-step profile), B2 latency, B3 kernels (all: these three); "
                       "B5 offload (KV in pinned host memory); quality of sparse policies; render FILE.json "
                       "redoes a results file's ratios, table and chart")
    bench.add_argument("file", nargs="?", help="results JSON (for render)")
    bench.add_argument("--presets", nargs="+", default=None,
                       help="qwen3-0.6b, qwen3-8b, llama-3.1-8b (default: qwen3-0.6b; llama-3.1-8b for offload)")
    bench.add_argument("--hf-num-seqs", type=int, default=0,
                       help="also run the first N throughput prompts through transformers (0: skip)")
    bench.add_argument("--attention-backend", default=None)
    bench.add_argument("--out", default="benchmarks/results")
    bench.add_argument("--name", default=None, help="results file name (default: bench, offload or quality)")
    from nanovllm.bench.quality import DEFAULT_PPL_TAIL, DEFAULT_QUERIES, DEFAULT_TOKENS, DEFAULT_TOP_K

    quality = bench.add_argument_group("quality")
    quality.add_argument("--policy", action="append", default=None, metavar="SEL",
                         help="sparse policy selection, repeatable, e.g. --policy full "
                         "--policy window:sink_blocks=1,recent_blocks=8 (default: full)")
    quality.add_argument("--layers", nargs="+", type=int, default=None,
                         help="layers to capture (default: 5 spread from the first to the last)")
    quality.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                         help="tokens of the text, below the model's context length")
    quality.add_argument("--queries", type=int, default=DEFAULT_QUERIES, help="decode query positions")
    quality.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="k of the top-k recall")
    quality.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    quality.add_argument("--model", default=None,
                         help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    quality.add_argument("--seed", type=int, default=0, help="seed of the random selection")
    quality.add_argument("--ppl-tail", type=int, default=DEFAULT_PPL_TAIL,
                         help="perplexity of the text's last N tokens with each policy in the engine (0: skip)")
    offload = bench.add_argument_group("offload (B5)")
    offload.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072],
                         help="prompt tokens; shortened where the decoded tokens would pass the model's "
                         "position limit (131072 on llama-3.1-8b)")
    offload.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="sequences decoded together")
    offload.add_argument("--decode-steps", type=int, default=8, help="decode steps timed after the prefill")
    offload.add_argument("--copy-mib", type=int, default=1024,
                         help="size of each pinned copy of the copy rate (256 or more to reach the PCIe rate)")
    offload.add_argument("--small-kv-gib", type=float, default=4.0,
                         help="GiB left for KV after the weights on the GPU made small")
    bench.set_defaults(func=_bench)
    return parser


def _bench(args: argparse.Namespace) -> int:
    from nanovllm.bench import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, FileNotFoundError, ImportError, NotImplementedError) as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"nanovllm: error: {message or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
