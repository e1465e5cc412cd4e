"""Long-context quality of a model under sparse policies, next to dense and transformers: the pass-key test,
the perplexity of a fixed final window given more and more context, and attention metrics on the
full-attention layers (:mod:`nanovllm.quality.long_context`).

    python benchmarks/long_context_quality.py --model gemma-3-270m \\
        --lengths 2048,4096,8192,16384,32768 --trials-per-depth 2 \\
        --policies "full;quest:token_budget=2048;xattn:threshold=0.9;minference" \\
        --out benchmarks/results --name gemma3_long_context --device cuda --dtype bfloat16

Writes OUT/NAME.json (device, date, commit, settings, every number and trial, the time of each phase),
OUT/NAME.md and, with matplotlib, OUT/NAME.png. Progress goes to stderr. A selection that fails is
recorded in the JSON and the run goes on; the exit status is 1 when any phase failed. The JSON is
written after every phase too (with ``"partial": true`` until the end), so a run stopped early keeps
what it measured.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from nanovllm.quality import long_context as lc
from nanovllm.quality.passkey import DEFAULT_DEPTHS
from nanovllm.utils import FlexibleArgumentParser

ROOT = Path(__file__).resolve().parents[1]
# the shared data folder: beside the checkout, or copied into it (as on a machine that gets only the checkout)
TEXTS = [ROOT / "shared" / "data" / "long_text.txt", ROOT.parent / "shared" / "data" / "long_text.txt"]
DEFAULT_TEXT = next((p for p in TEXTS if p.is_file()), TEXTS[-1])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parser() -> FlexibleArgumentParser:
    p = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, 
                   help="model directory, hub ID or packaged name (default: the built-in model)")
    p.add_argument("--lengths", type=_ints, default=[2048, 4096, 8192, 16384, 32768],
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", type=_floats, default=list(DEFAULT_DEPTHS), help="key depths in [0, 1]")
    p.add_argument("--trials-per-depth", type=int, default=2)
    p.add_argument("--policies", type=lc.parse_policies, default=[lc.DENSE],
                   help="';'-separated selections; a prefill+decode pair is written 'xattn+quest'")
    p.add_argument("--tasks", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   default=list(lc.TASKS), help=f"comma-separated, of {','.join(lc.TASKS)}")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="engine and transformers dtype (default: the engine's)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--text-file", default=str(DEFAULT_TEXT),
                   help="natural text for the natural filler, perplexity and attention (skipped when absent)")
    p.add_argument("--tail-tokens", type=int, default=512, help="scored final window of the perplexity task")
    p.add_argument("--answer-tokens", type=int, default=10, help="greedy tokens of each pass-key answer")
    p.add_argument("--attention-queries", type=int, default=64, help="last query rows of the attention task")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="max_num_batched_tokens of the engines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto", help="the engines' kv_cache_dtype (e.g. fp8)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="long_context_quality")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = lc.LongContextSettings(
            model=args.model, lengths=args.lengths, policies=args.policies, tasks=args.tasks,
            depths=args.depths,
            trials_per_depth=args.trials_per_depth, device=args.device, dtype=args.dtype, hf=args.hf,
            text_file=args.text_file, tail_tokens=args.tail_tokens, answer_tokens=args.answer_tokens,
            attention_queries=args.attention_queries, prefill_chunk=args.prefill_chunk, seed=args.seed,
            kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"{args.name}.json"

    def checkpoint(result: dict) -> None:  # what a run stopped early measured, rewritten after each phase
        partial.write_text(json.dumps({**result, "partial": True}, indent=1, default=str) + "\n")

    result = lc.run(settings, say=lambda line: print(line, file=sys.stderr, flush=True),
                    checkpoint=checkpoint)
    result["seconds"] = round(time.perf_counter() - start, 1)
    paths = lc.write_results(result, args.out, args.name)
    print(paths[1].read_text())
    print(f"wrote {', '.join(map(str, paths))} in {result['seconds']} s", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
