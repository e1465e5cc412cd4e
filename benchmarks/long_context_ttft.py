"""Time to the first token of one long prompt under several policies, the engines alive together and their
runs interleaved, so that a drift of the machine (clocks, other tenants) falls on every policy alike.

    python benchmarks/long_context_ttft.py --model gemma-3-270m --length 32768 --repeats 9 \\
        --policies "full;xattn:threshold=0.9;minference:dense_below=0" --profile --out benchmarks/results

What is measured: per repeat, one ``generate`` of the prompt with ``max_tokens=1`` in each engine in turn (the
wall time, the device synchronised before and after); per policy the median, the minimum and every repeat, and
the median's ratio to the first policy's (the reference, ``full`` by default). Each engine runs the prompt
twice untimed first, so that nothing compiles in a timed run; the garbage collector is off while timing.
With ``--profile`` (CUDA only), one more run per engine under the torch profiler gives its device time and
host time, and the ``--top`` kernels by device time: a TTFT above the device time is time the device waited
for the host.

The prompt is natural text (``--text-file``) after the tokenizer's BOS. Prefix caching is off. Writes
OUT/NAME.json (device, date, commit, settings, every number) and OUT/NAME.md; prints the table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from long_context_speed import DEFAULT_TEXT
from nanovllm.quality import long_context as lc


@attrs.define
class TtftSettings:
    model: str = "gemma-3-270m"
    length: int = 32768
    policies: list[str] = attrs.field(factory=lambda: ["full", "xattn:threshold=0.9", "minference:dense_below=0"])
    repeats: int = 9
    max_num_batched_tokens: int = 8192
    device: str = "auto"
    dtype: str | None = "bfloat16"
    profile: bool = False
    top: int = 12
    text_file: str | None = None


def run(settings: TtftSettings, say=lambda line: None) -> dict[str, Any]:
    """Every policy's TTFT (and with ``profile`` its device/host split); the results as one JSON-ready dict."""
    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.bench import environment
    from nanovllm.engine.model_loading import load_tokenizer, resolve_model_path
    from nanovllm.quality.passkey import bos_ids

    model_dir = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(model_dir)
    bos = bos_ids(tokenizer)
    text, source = lc.natural_text_ids(tokenizer, settings.length - len(bos), settings.text_file)
    prompt = (bos + text)[: settings.length]
    config = lc.model_config(model_dir)
    options = lc.engine_options(settings, config, settings.length + 1)
    cache = max(int(lc.kv_bytes_per_token(config, 4) * (settings.length + 64) * 1.5), 256 << 20)
    engines = {p: LLM(settings.model, sparse_policy=lc.selection_of(p), max_num_seqs=1, kv_cache_memory=cache,
                      max_num_batched_tokens=settings.max_num_batched_tokens, **options)
               for p in settings.policies}
    cuda = torch.cuda.is_available() and settings.device != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft_ms(llm: Any) -> float:
        sync()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        sync()
        return 1000 * (time.perf_counter() - start)

    try:
        for llm in engines.values():
            ttft_ms(llm), ttft_ms(llm)
        times: dict[str, list[float]] = {p: [] for p in engines}
        gc.collect()
        gc.disable()
        try:
            for _ in range(settings.repeats):
                for p, llm in engines.items():
                    times[p].append(ttft_ms(llm))
        finally:
            gc.enable()
        reference = statistics.median(times[settings.policies[0]])
        results = {p: {"ttft_ms": statistics.median(v), "min_ms": min(v), "repeats_ms": v,
                       "vs_reference": statistics.median(v) / reference} for p, v in times.items()}
        for p, r in results.items():
            say(f"{p}: TTFT {r['ttft_ms']:.2f} ms ({r['vs_reference']:.3f}x)")
        if settings.profile and cuda:
            for p, llm in engines.items():
                results[p]["profile"] = _profile(lambda: ttft_ms(llm), settings.top)
    finally:
        for llm in engines.values():
            llm.close()
    return {"environment": environment(), "settings": attrs.asdict(settings), "prompt_source": source,
            "results": results, "notes": []}


def _profile(fn, top: int) -> dict[str, Any]:
    """One run of ``fn`` under the torch profiler: device and host time (ms), and the ``top`` kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = fn()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.self_device_time_total > 0 and not e.key.startswith("aten::")),
                     key=lambda e: -e.self_device_time_total)
    return {"wall_ms": wall,
            "device_ms": sum(e.self_device_time_total for e in kernels) / 1000,
            "host_ms": sum(e.self_cpu_time_total for e in events) / 1000,
            "kernels_ms": {e.key[:80]: e.self_device_time_total / 1000 for e in kernels[:top]}}


def markdown(result: dict[str, Any], title: str) -> str:
    env, s, res = result["environment"], result["settings"], result["results"]
    first = s["policies"][0]
    lines = [f"# {title}", "", f"{env.get('device')}, {env.get('date')}, commit {env.get('commit')}.",
             f"Model {s['model']}, one {s['length']}-token prompt in chunks of {s['max_num_batched_tokens']}, "
             f"{s['dtype']}; median of {s['repeats']} interleaved repeats.", "",
             f"| policy | TTFT ms (median) | min | vs `{first}` | target |", "|---|---|---|---|---|"]
    for p, r in res.items():
        target = "" if p == first else f"no slower than `{first}`: {'met' if r['vs_reference'] <= 1 else 'missed'}"
        lines.append(f"| `{p}` | {r['ttft_ms']:.2f} | {r['min_ms']:.2f} | {r['vs_reference']:.3f}x | {target} |")
    if any("profile" in r for r in res.values()):
        lines += ["", "One profiled run each: device time (kernels) and host time (every op on the CPU).", "",
                  "| policy | wall ms | device ms | host ms | top kernels (ms) |", "|---|---|---|---|---|"]
        for p, r in res.items():
            if "profile" in r:
                f = r["profile"]
                tops = ", ".join(f"{k.split('(')[0][:40]} {v:.2f}" for k, v in list(f["kernels_ms"].items())[:5])
                wall = "-" if f.get("wall_ms") is None else f"{f['wall_ms']:.1f}"
                lines.append(f"| `{p}` | {wall} | {f['device_ms']:.1f} | {f['host_ms']:.1f} | {tops} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in result["notes"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/long_context_ttft.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=32768, help="prompt tokens, BOS included")
    p.add_argument("--policies", type=lc.parse_policies, default=lc.parse_policies(
        "full;xattn:threshold=0.9;minference:dense_below=0"), help="';'-separated; the first is the reference")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's prefill chunk")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true", help="one profiled run per policy (CUDA)")
    p.add_argument("--top", type=int, default=12, help="kernels kept per profile")
    p.add_argument("--text-file", default=str(DEFAULT_TEXT))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="long_context_ttft")
    args = p.parse_args(argv)
    settings = TtftSettings(model=args.model, length=args.length, policies=list(args.policies),
                            repeats=args.repeats, max_num_batched_tokens=args.max_num_batched_tokens,
                            device=args.device, dtype=args.dtype, profile=args.profile, top=args.top,
                            text_file=args.text_file if Path(args.text_file).is_file() else None)
    result = run(settings, say=lambda line: print(line, file=sys.stderr, flush=True))
    paths = lc.write_results(result, args.out, args.name, markdown_of=markdown, plot_to=lambda r, path: False,
                             title="Long-context TTFT")
    print(paths[1].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
