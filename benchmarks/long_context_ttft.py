"""Time to the first token of one long natural-text prompt under several policies, the engines alive together
and taking turns, so that a drift of the machine (clocks, other tenants) falls on every policy alike.

    python benchmarks/long_context_ttft.py --model gemma-3-270m --length 32768 --rounds 9 \\
        --policies "full;xattn:threshold=0.9;minference:dense_below=0" --profile 12

The pairing is :func:`_prefill.bench_paired_ttft` (as ``minference_prefill.py``'s ``text`` job): one engine
per policy, KV on the GPU for the prompt alone, a first untimed run each (the compiles), then ``--rounds``
rounds in which every engine in turn times the prompt. Per policy: the median TTFT, every round, and the
median of the rounds' ratios to the first policy (the reference, ``full`` by default). With ``--profile N``
(CUDA), one more run per engine under the torch profiler gives its device and host time and the N kernels
that took longest (:func:`_prefill.profiled_ttft`): a TTFT above the device time is time the device waited
for the host. A last run per engine records what its policy selected, chunk by chunk and layer by layer
(:func:`_prefill.recorded_work`): MInference's index work and XAttention's kept blocks, each over dense causal
attention's.

The prompt is ``--text-file`` after the tokenizer's BOS. Writes OUT/NAME.json (device, date, commit,
settings, every number) and OUT/NAME.md; prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from _prefill import bench_paired_ttft
from long_context_speed import DEFAULT_TEXT
from nanovllm.quality import long_context as lc


def run(model: str, length: int, policies: list[str], rounds: int, profile_top: int, text_file: str | None,
        **engine_options: Any) -> dict[str, Any]:
    """The paired TTFT rows of every policy, as one JSON-ready dict."""
    from nanovllm.bench import environment
    from nanovllm.engine.model_loading import load_tokenizer, resolve_model_path
    from nanovllm.quality.passkey import bos_ids

    tokenizer = load_tokenizer(resolve_model_path(model))
    bos = bos_ids(tokenizer)
    text, source = lc.natural_text_ids(tokenizer, length - len(bos), text_file)
    rows = bench_paired_ttft(model, length, policies, rounds, prompt_ids=bos + text, profile_top=profile_top,
                             work=True, **engine_options)
    for row in rows[1:]:
        row["vs_reference"] = statistics.median(1 / s for s in row["speedup_rounds"])
    rows[0]["vs_reference"] = 1.0
    settings = {"model": model, "length": length, "policies": policies, "rounds": rounds,
                "profile_top": profile_top, **engine_options}
    return {"environment": environment(), "settings": settings, "prompt_source": source, "rows": rows,
            "notes": []}


def markdown(result: dict[str, Any], title: str) -> str:
    env, s, rows = result["environment"], result["settings"], result["rows"]
    first = rows[0]["policy"]
    chunk = s.get("max_num_batched_tokens", "the engine's default")
    lines = [f"# {title}", "", f"{env.get('device')}, {env.get('date')}, commit {env.get('commit')}.",
             f"Model {s['model']}, one {rows[0]['prompt_len']}-token prompt, prefill chunks of {chunk} tokens; "
             f"the median of {s['rounds']} rounds, the engines taking turns.", "",
             f"| policy | TTFT ms | min | vs `{first}` (median of the rounds) | target |", "|---|---|---|---|---|"]
    for r in rows:
        target = "" if r is rows[0] else (f"no slower than `{first}`: "
                                          f"{'met' if r['vs_reference'] <= 1 else 'missed'}")
        lines.append(f"| `{r['policy']}` | {1000 * r['ttft_s']:.2f} | {1000 * min(r['ttft_rounds_s']):.2f} | "
                     f"{r['vs_reference']:.3f}x | {target} |")
    if any("profile" in r for r in rows):
        lines += ["", "One profiled run each: device time (kernels, copies) and host time (every op's own CPU "
                  "time), ms.", "", "| policy | wall | device | host | kernels that took longest |",
                  "|---|---|---|---|---|"]
        for r in (r for r in rows if "profile" in r):
            f = r["profile"]
            wall = "-" if f.get("wall_ms") is None else f"{f['wall_ms']:.1f}"
            tops = ", ".join(f"{k.split('(')[0][:40]} {v:.2f}" for k, v in list(f["kernels_ms"].items())[:5])
            lines.append(f"| `{r['policy']}` | {wall} | {f['device_ms']:.1f} | {f['host_ms']:.1f} | {tops} |")
    worked = [r for r in rows if r.get("work")]
    if worked:
        lines += ["", "What each policy selected, per prefill chunk (by the context it ends at): the mean over its "
                  "layers of the work it computed over dense causal attention's, and each layer's (`d`: ran "
                  "dense, no selection made; `D`: the index was above `dense_above` and the kernel ran dense).",
                  "", "| policy | chunk ends at | mean | per layer |", "|---|---|---|---|"]
        marks = {"dense": "d", "dense (dense_above)": "D", "sparse": ""}
        for r in worked:
            for c in r["work"]:
                layers = ", ".join(f"{d:.2f}{marks[p]}" for d, p in zip(c["densities"], c["paths"], strict=True))
                lines.append(f"| `{r['policy']}` | {c['context']} | {c['density']:.3f} | {layers} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in result["notes"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/long_context_ttft.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=32768, help="prompt tokens, BOS included (fewer where the "
                   "model's position limit leaves no room)")
    p.add_argument("--policies", type=lc.parse_policies, default=lc.parse_policies(
        "full;xattn:threshold=0.9;minference:dense_below=0"), help="';'-separated; the first is the reference")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's prefill chunk")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="one profiled run per policy, keeping its N longest kernels (CUDA)")
    p.add_argument("--text-file", default=str(DEFAULT_TEXT))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="long_context_ttft")
    args = p.parse_args(argv)
    text_file = args.text_file if Path(args.text_file).is_file() else None
    result = run(args.model, args.length, list(args.policies), args.rounds, args.profile, text_file,
                 max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    if text_file is None:
        result["notes"].append(f"{args.text_file} is absent: the prompt is the text this machine has")
    paths = lc.write_results(result, args.out, args.name, markdown_of=markdown, plot_to=lambda r, path: False,
                             title="Long-context TTFT")
    print(paths[1].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
