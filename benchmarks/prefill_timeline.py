"""Where a long prompt's prefill waits: one traced TTFT per policy (CUDA), the GPU's busy and idle time, and
the idle time by what the host was doing meanwhile.

    python benchmarks/prefill_timeline.py --model gemma-3-270m --length 32768 \\
        --policies "full;xattn:threshold=0.9;minference:dense_below=0"

Each engine (one per policy, alive one at a time) prefills the prompt untimed twice, then ``--rounds`` times
plainly (their TTFTs as ``nanovllm.bench.offload.ttft_alone`` times them, for scale: the trace slows the
host), then once under the torch profiler with host labels: the engine's phases (``schedule``, ``prepare``,
``step_metadata``, ``kv_begin_step``, ``apply_pending``, ``logits``), each decoder layer (``layer05F``: layer
5, full attention; ``s``: sliding window) and each layer's attention call (``attnF``, ``attns``). From the
trace: the span from the first kernel to the last, the time some kernel, copy or fill ran (busy), the rest
(idle), and each idle gap charged to the innermost label open on the host at its midpoint. An idle time near
the span's half says the GPU waits on the host; the labels say on what.

The prompt is ``--text-file`` after the tokenizer's BOS (random token ids with ``--random-prompt``). Writes
OUT/NAME.json (device, date, commit, settings, every number) and OUT/NAME.md; prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from long_context_speed import DEFAULT_TEXT
from nanovllm.quality import long_context as lc

# (owner, method, label) of the engine's phases
PHASES = [("scheduler", "schedule", "schedule"), ("runner", "prepare", "prepare"),
          ("runner", "_step_metadata", "step_metadata"), ("kv", "begin_step", "kv_begin_step"),
          ("engine", "_apply_pending", "apply_pending"), ("model", "compute_logits", "logits")]


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """``(busy, gaps)`` of device intervals ``(start, end)`` (any order, overlaps allowed): the length of
    their union and the holes in it, in the intervals' unit."""
    busy, gaps = 0.0, []
    ordered = sorted(intervals)
    if not ordered:
        return 0.0, []
    start, end = ordered[0]
    for s, e in ordered[1:]:
        if s > end:
            busy += end - start
            gaps.append((end, s))
            start, end = s, e
        else:
            end = max(end, e)
    return busy + end - start, gaps


def idle_by_label(gaps: list[tuple[float, float]], labels: list[tuple[float, float, str]]) -> Counter:
    """Each gap's length charged to the shortest label ``(start, end, name)`` open at its midpoint
    (``(none)`` where none is)."""
    charged: Counter = Counter()
    for start, end in gaps:
        mid = (start + end) / 2
        open_ = [label for label in labels if label[0] <= mid <= label[1]]
        charged[min(open_, key=lambda label: label[1] - label[0])[2] if open_ else "(none)"] += end - start
    return charged


def timeline(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The busy and idle time (ms) of a Chrome trace's device events, the idle time by host label (``#`` names),
    and the host time under each label with its count."""
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    labels = [(e["ts"], e["ts"] + e["dur"], e["name"][1:]) for e in events
              if e.get("cat") == "user_annotation" and e["name"].startswith("#")]
    busy, gaps = busy_and_gaps(device)
    span = max(e for _, e in device) - min(s for s, _ in device) if device else 0.0
    host: Counter = Counter()
    count: Counter = Counter()
    for start, end, name in labels:
        host[name] += end - start
        count[name] += 1
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "gaps": len(gaps),
            "idle_by_label_ms": {k: v / 1e3 for k, v in idle_by_label(gaps, labels).most_common()},
            "host_by_label_ms": {k: [v / 1e3, count[k]] for k, v in host.most_common()}}


def label_engine(llm: Any) -> None:
    """Wrap the engine's phases, its decoder layers and their attention calls in profiler labels."""
    from torch.profiler import record_function

    def labelled(obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def wrapped(*args, **kwargs):
            with record_function("#" + label):
                return inner(*args, **kwargs)

        setattr(obj, name, wrapped)

    engine = llm.llm_engine
    owners = {"scheduler": engine.scheduler, "runner": engine.runner, "kv": engine.runner.kv, "engine": engine,
              "model": engine.runner.model}
    for owner, method, label in PHASES:
        labelled(owners[owner], method, label)
    for i, layer in enumerate(engine.runner.model.model.layers):
        attention = layer.self_attn.attn
        kind = "s" if attention.sliding_window is not None else "F"
        labelled(layer, "forward", f"layer{i:02d}{kind}")
        labelled(attention, "forward", f"attn{kind}")


def run(model: str, length: int, policies: list[str], rounds: int, chunk: int, text_file: str | None,
        random_prompt: bool) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import LLM
    from nanovllm.bench import environment, offload
    from nanovllm.engine.model_loading import load_tokenizer, resolve_model_path
    from nanovllm.quality.passkey import bos_ids

    # the prompt shortened where it and its first token would pass the model's position limit
    length, options = offload.plan_run(offload.model_shape(model, {}), length, 1, 1, False,
                                       {"max_num_batched_tokens": chunk})
    if random_prompt:
        ids = torch.randint(3, 200, (length,), generator=torch.Generator().manual_seed(0)).tolist()
        source = "random token ids"
    else:
        tokenizer = load_tokenizer(resolve_model_path(model))
        bos = bos_ids(tokenizer)
        text, source = lc.natural_text_ids(tokenizer, length - len(bos), text_file)
        ids = bos + text

    def ttft_ms(llm: Any) -> float:
        return 1000 * offload.ttft_alone(llm, [ids])

    rows = []
    for policy in policies:
        llm = LLM(model, sparse_policy=lc.selection_of(policy), dtype="bfloat16", kv_cache_memory=2 << 30,
                  **options)
        try:
            label_engine(llm)
            for _ in range(2):  # the kernels' compiles
                ttft_ms(llm)
            plain = [ttft_ms(llm) for _ in range(rounds)]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                traced = ttft_ms(llm)
            with tempfile.NamedTemporaryFile(suffix=".json") as trace:
                prof.export_chrome_trace(trace.name)
                events = json.loads(Path(trace.name).read_text())["traceEvents"]
        finally:
            llm.close()
        rows.append({"policy": policy, "ttft_ms": statistics.median(plain), "ttft_rounds_ms": plain,
                     "traced_ttft_ms": traced, **timeline(events)})
    settings = {"model": model, "length": len(ids), "policies": policies, "rounds": rounds, "chunk": chunk}
    return {"environment": environment(), "settings": settings, "prompt_source": source, "rows": rows}


def markdown(result: dict[str, Any], title: str, top: int = 8) -> str:
    env, s = result["environment"], result["settings"]
    lines = [f"# {title}", "", f"{env.get('device')}, {env.get('date')}, commit {env.get('commit')}.",
             f"Model {s['model']}, one {s['length']}-token prompt ({result['prompt_source']}), prefill chunks "
             f"of "
             f"{s['chunk']} tokens; TTFT the median of {s['rounds']} plain runs; the rest from one traced run.",
             "", "| policy | TTFT ms | traced TTFT | device span | busy | idle | idle, by host label (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        idle = ", ".join(f"{k} {v:.1f}" for k, v in list(r["idle_by_label_ms"].items())[:top])
        lines.append(f"| `{r['policy']}` | {r['ttft_ms']:.2f} | {r['traced_ttft_ms']:.1f} | "
                     f"{r['span_ms']:.1f} | {r['busy_ms']:.1f} | {r['idle_ms']:.1f} | {idle} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/prefill_timeline.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=32768, help="prompt tokens, BOS included")
    p.add_argument("--policies", type=lc.parse_policies, default=lc.parse_policies("full;xattn:threshold=0.9"))
    p.add_argument("--rounds", type=int, default=5, help="plain TTFT runs per policy")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's prefill chunk")
    p.add_argument("--text-file", default=str(DEFAULT_TEXT))
    p.add_argument("--random-prompt", action="store_true", help="random token ids instead of the text")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="prefill_timeline")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("prefill_timeline.py traces the GPU: it needs CUDA", file=sys.stderr)
        return 2
    result = run(args.model, args.length, args.policies, args.rounds, args.max_num_batched_tokens,
                 args.text_file, args.random_prompt)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result, args.name)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
