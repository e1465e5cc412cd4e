"""The ``nanovllm`` command: ``generate``, ``chat``, ``serve``, ``plugins`` and ``bench``."""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from nanovllm import __version__
from nanovllm.engine_args import add_engine_args, engine_kwargs
from nanovllm.entrypoints import DEFAULT_MAX_JSON_BODY_SIZE, DEFAULT_SHUTDOWN_TIMEOUT


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=temperature)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1, help="-1: off")


def _sampling_params(args: argparse.Namespace, **extra):
    from nanovllm import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, **extra)


def _generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM

    params = _sampling_params(args)  # checked before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
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


def _chat(args: argparse.Namespace) -> int:
    """An interactive conversation on the terminal; the reply streams as it is generated."""
    from nanovllm import LLM
    from nanovllm.sampling_params import RequestOutputKind

    params = _sampling_params(args, output_kind=RequestOutputKind.DELTA)
    llm = LLM(args.model, **engine_kwargs(args))
    tokenizer = llm.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer of {str(llm.model_path)!r} has no chat template; use nanovllm generate")
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting; an empty line or end of input (Ctrl-D) quits.", file=sys.stderr)
    for turn in itertools.count():
        print("> ", end="", flush=True)
        line = sys.stdin.readline().strip()
        if not line:
            return 0
        history.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        llm.add_request(f"chat-{turn}", {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, params)
        reply = ""
        while llm.has_unfinished_requests():
            for out in llm.step():
                print(out.outputs[0].text, end="", flush=True)
                reply += out.outputs[0].text
        print()
        history.append({"role": "assistant", "content": reply})


def _serve(args: argparse.Namespace) -> int:
    try:
        from nanovllm.entrypoints.openai_server import serve
    except ImportError as exc:
        raise ImportError(f"nanovllm serve needs the serve extra: pip install 'nanovllm[serve]' ({exc})") from None
    from nanovllm import AsyncLLM
    from nanovllm.default_model import DEFAULT_MODEL

    llm = AsyncLLM(args.model, engine_process=args.engine_process, **engine_kwargs(args))
    name = args.served_model_name or args.model or DEFAULT_MODEL
    serve(llm, name, args.host, args.port, args.api_key, args.uvicorn_log_level,
          shutdown_timeout=args.shutdown_timeout, max_json_body_size=args.max_json_body_size)
    return 0


def _plugins(args: argparse.Namespace) -> int:
    """The plugins and what they register; with ``--check``, every registered target loaded as selecting it
    would (exit status 1 when a plugin or a target fails)."""
    from nanovllm.plugins import get_plugins

    plugin_set = get_plugins()
    ok = plugin_set.check() if args.check else True
    plugins = plugin_set.plugins
    if args.json:
        print(json.dumps([p.as_dict() for p in plugins], indent=2))
        return 0 if ok else 1
    for p in plugins:
        print(f"{p.name:<12} {p.dist} {p.version}  ({p.value})")
        if p.error:
            print(f"    FAILED TO LOAD: {p.error}")
        elif p.warning:
            print(f"    WARNING: {p.warning}")
        for entry in p.registered:
            print(f"    {entry}")
            kind, _, key = entry.partition(":")
            backend = plugin_set.registry.attention_backends.get(key) if kind == "attention_backend" else None
            if backend is not None and backend.unavailable is not None:
                print(f"        unavailable: {backend.unavailable}")
            if p.problems and entry in p.problems:
                print(f"        FAILED: {p.problems[entry]}")
    if not args.check:
        print("(registered targets load when selected; --check loads them all now)")
    elif ok:
        print("every registered target loads")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A small, fast LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"nanovllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default=None, help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: when the tokenizer has one)")
    _add_sampling_args(gen, max_tokens=64, temperature=0.0)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="an interactive chat on the terminal, streaming the replies")
    chat.add_argument("model", nargs="?", default=None, help="HF-format model directory (default: the built-in model)")
    chat.add_argument("--system", default=None, help="a system message to start the conversation")
    _add_sampling_args(chat, max_tokens=512, temperature=0.7)
    add_engine_args(chat)
    chat.set_defaults(func=_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    serve.add_argument("model", nargs="?", default=None, help="HF-format model directory (default: the built-in model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: MODEL)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug", "trace"))
    serve.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, new requests get 503 and those in flight may finish for this "
                       "long; the rest are then aborted, each client told so (a second signal stops at once; "
                       "default: %(default)g)")
    serve.add_argument("--max-json-body-size", type=int, default=DEFAULT_MAX_JSON_BODY_SIZE, metavar="BYTES",
                       help="a larger request body gets a 413 (default: %(default)d, 32 MiB)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine in a process of its own, apart from HTTP and detokenization "
                       "(default: yes, unless the environment has NANOVLLM_ENGINE_PROCESS=0)")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    plug = sub.add_parser("plugins", help="list installed plugins and what they register")
    plug.add_argument("--json", action="store_true", help="machine-readable output")
    plug.add_argument("--check", action="store_true",
                      help="also load every registered target and config as selecting it would (imports the "
                      "plugins' code and torch), check policies' hook argument names, flag each failure; exit "
                      "status 1 if anything fails")
    plug.set_defaults(func=_plugins)
    bench = sub.add_parser("bench", help="benchmarks on shape presets with random weights (GPU), and the "
                           "attention quality of sparse policies on the built-in model (CPU or GPU)")
    bench.add_argument("benchmark", choices=("throughput", "latency", "kernels", "all", "offload", "kv", "quality",
                                             "render", "serve"),
                       help="throughput (nano-vLLM's bench.py workload), latency (batch 1), kernels (attention "
                       "kernels; all: these three); offload (KV in pinned host memory); kv: KV bytes per token "
                       "per KV cache group, from the config, nothing run; quality of sparse policies; serve: the "
                       "throughput prompts against a live server; render FILE.json redoes a results file's table "
                       "and chart")
    bench.add_argument("file", nargs="?", help="results JSON (for render)")
    bench.add_argument("--presets", nargs="+", default=None,
                       help="qwen3-0.6b, qwen3-8b, llama-3.1-8b (default: qwen3-0.6b; llama-3.1-8b for offload)")
    bench.add_argument("--hf-num-seqs", type=int, default=0,
                       help="also run the first N throughput prompts through transformers (0: skip)")
    bench.add_argument("--attention-backend", default=None)
    bench.add_argument("--kv-cache-dtype", default="auto",
                       help="the engines' KV cache element type for throughput and latency, e.g. fp8")
    bench.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs per engine for throughput and latency")
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
    quality.add_argument("--text", default=None, metavar="FILE",
                         help="a UTF-8 text file to read instead of the long text found on this machine")
    quality.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                         help="the engine's dtype (auto: float32 on the CPU, the model's 16-bit type on a GPU)")
    offload = bench.add_argument_group("offload")
    offload.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072],
                         help="prompt tokens; shortened where the decoded tokens would pass the model's "
                         "position limit (131072 on llama-3.1-8b)")
    offload.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="sequences decoded together")
    offload.add_argument("--decode-steps", type=int, default=8, help="decode steps timed after the prefill")
    offload.add_argument("--copy-mib", type=int, default=1024,
                         help="size of each pinned copy of the copy rate (256 or more to reach the PCIe rate)")
    offload.add_argument("--small-kv-gib", type=float, default=4.0,
                         help="GiB left for KV after the weights on the GPU made small")
    kv = bench.add_argument_group("kv (models: --presets and --model, any preset, packaged model or directory; "
                                  "--dtype and --device as the engine takes them)")
    kv.add_argument("--context", type=int, default=32768,
                    help="tokens of the one sequence whose KV bytes are counted")
    load = bench.add_argument_group("serve (a live server: nanovllm serve MODEL)")
    load.add_argument("--base-url", default="http://127.0.0.1:8000")
    load.add_argument("--request-rates", nargs="+", default=["inf"],
                      help="requests per second, Poisson arrivals; inf sends them all at once")
    load.add_argument("--num-prompts", type=int, default=256, help="throughput prompts sent at each rate")
    load.add_argument("--timeout", type=float, default=3600, help="seconds a request may take")
    bench.set_defaults(func=_bench)
    return parser


def _bench(args: argparse.Namespace) -> int:
    if args.benchmark == "serve":
        from nanovllm.bench.serve import main_serve

        return main_serve(args)
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
