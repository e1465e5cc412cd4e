"""GPU soak: the engine's host and GPU memory over 2,000 requests of 1K-token prompts.

Runs :func:`nanovllm.testing.soak` (prompts of random token ids, ``--every`` at a time) on CUDA with a shape
preset's random weights (default ``qwen3-0.6b``; ``--model default`` is the built-in SmolLM2, whose weights
scripts/gpu_check.sh converts) and prefix caching off, and writes one JSON: the environment (device, date,
commit), the settings, every reading as ``results`` (requests done, seconds, host RSS after ``gc.collect()``
and ``malloc_trim(0)``, ``torch.cuda.memory_allocated`` and ``memory_reserved``, bytes) and, for each
quantity, its growth after the first ``--every`` requests. Exits 1 when any grows by ``--max-growth`` or more.
``--device cpu`` runs the same soak on the CPU (host memory only), as a check of the script itself.

    NANOVLLM_COMMIT=$(git rev-parse --short HEAD) python benchmarks/gpu_soak.py OUT.json
    python benchmarks/gpu_soak.py OUT.json --kv-offloading-size 8    # the pinned host pool instead

Any engine option is a flag (``--enable-prefix-caching``, ``--enforce-eager``, ...), as ``nanovllm generate``
takes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanovllm.engine_args import add_engine_args, engine_kwargs


def growth(readings: list[dict], key: str, prompt_len: int) -> dict[str, float]:
    """``key`` after the first batch, its largest later value, their ratio less one, and the bytes of that
    growth per prefill token of the later requests."""
    first, later = readings[1], readings[2:]
    peak = max(r[key] for r in later)
    tokens = (later[-1]["requests"] - first["requests"]) * prompt_len
    return {"after_first": first[key], "max_later": peak, "growth": peak / first[key] - 1,
            "bytes_per_prefill_token": (peak - first[key]) / tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--model", default="qwen3-0.6b", help="a preset, 'default' or a model directory")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=1024, help="tokens of each prompt (less 0-31)")
    parser.add_argument("--every", type=int, default=250, help="requests per generate call and reading")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request decodes")
    parser.add_argument("--max-growth", type=float, default=0.05, help="of the reading after the first batch")
    add_engine_args(parser)
    args = parser.parse_args()
    if args.requests < 2 * args.every:
        parser.error("--requests must be at least twice --every: growth is read after the first batch")

    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.bench import environment
    from nanovllm.testing import soak

    engine = {"enable_prefix_caching": False, "device": "cuda", **engine_kwargs(args)}
    if engine["device"] != "cpu" and not torch.cuda.is_available():
        parser.error("no CUDA device: this soak measures the GPU path (--device cpu runs it on the CPU)")
    llm = LLM(args.model, **engine)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    readings = []
    for reading in soak(llm, args.requests, args.prompt_len, args.every, params):
        readings.append(reading)
        print(json.dumps(reading), flush=True)
    measured = [key for key in readings[0] if key not in ("requests", "seconds")]  # bytes
    summary = {key: growth(readings, key, args.prompt_len) for key in measured}
    settings = {"model": args.model, "requests": args.requests, "prompt_len": args.prompt_len,
                "every": args.every, "max_tokens": args.max_tokens, "max_growth": args.max_growth,
                "engine": engine, "kv_blocks": llm.runner.num_blocks, "block_size": llm.config.block_size}
    payload = {"environment": environment(), "settings": settings, "growth": summary, "results": readings}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    failed = [key for key, g in summary.items() if g["growth"] >= args.max_growth]
    for key, g in summary.items():
        print(f"{key}: {g['after_first'] / 2**20:.1f} -> {g['max_later'] / 2**20:.1f} MiB, "
              f"{g['growth']:+.2%}, {g['bytes_per_prefill_token']:.1f} bytes a prefill token")
    if failed:
        print(f"grew by {args.max_growth:.0%} or more: {', '.join(failed)}")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
