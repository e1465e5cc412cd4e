"""``nanovllm bench``: the project's benchmarks (definitions in ANCHORS.md), on shape presets.

- ``throughput`` (B1): nano-vLLM's bench.py workload (seed 0, 256 sequences, prompts of 100-1024 random
  token ids below 10000, 100-1024 output tokens, temperature 0.6, ignore_eos, max_model_len 4096);
  output tok/s over the whole run, prefill included; optionally the same prompts through transformers.
- ``latency`` (B2): batch 1, prompt 128, 512 greedy output tokens; ms/token with and without CUDA graphs.
Results are written as JSON and a markdown table under ``benchmarks/results/``.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import random
import subprocess
import time
from pathlib import Path
from typing import Any


def throughput_workload(seed: int = 0, num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths drawn exactly as nano-vLLM's bench.py draws them."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _StepTimer:
    """Wraps ``LLMEngine.step`` to time decode-only steps (mean decode step time)."""

    def __init__(self, llm) -> None:
        self.llm, self.decode_times = llm, []
        self._step = llm.step
        llm.step = self

    def __call__(self):
        running = self.llm.scheduler.running
        decode_only = bool(running) and not self.llm.scheduler.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in running
        )
        start = time.perf_counter()
        out = self._step()
        if decode_only:
            self.decode_times.append(time.perf_counter() - start)
        return out


def bench_throughput(preset: str, hf_num_seqs: int = 0, **engine_options: Any) -> dict[str, Any]:
    from nanovllm import LLM, SamplingParams

    prompts, max_tokens = throughput_workload()
    llm = LLM(preset, max_model_len=4096, **engine_options)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    timer = _StepTimer(llm)
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    _sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    result = {
        "benchmark": "throughput",
        "preset": preset,
        "num_seqs": len(prompts),
        "output_tokens": produced,
        "seconds": elapsed,
        "output_tok_per_s": produced / elapsed,
        "mean_decode_step_ms": 1000 * sum(timer.decode_times) / max(1, len(timer.decode_times)),
        "decode_steps": len(timer.decode_times),
        "preemptions": llm.scheduler.num_preemptions,
        "attention_backend": type(llm.runner.backend).__name__,
        "cuda_graphs": bool(llm.runner.graphs),
    }
    del llm
    if hf_num_seqs:
        result["transformers"] = bench_transformers(preset, prompts[:hf_num_seqs], max_tokens[:hf_num_seqs])
    return result


def bench_transformers(preset: str, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    """The same prompts through transformers' generate (one left-padded batch, sampling at 0.6)."""
    import torch
    import transformers

    from nanovllm.presets import preset_dir

    config = transformers.AutoConfig.from_pretrained(preset_dir(preset))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=0.6,
                       max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens), pad_token_id=0)
    _sync()
    elapsed = time.perf_counter() - start
    useful = sum(max_tokens)  # each sequence's own budget counts, as in the nanovllm run
    return {"num_seqs": len(prompts), "output_tokens": useful, "seconds": elapsed, "output_tok_per_s": useful / elapsed}


def bench_latency(preset: str, **engine_options: Any) -> dict[str, Any]:
    from nanovllm import LLM, SamplingParams

    prompt = [random.Random(1).randint(0, 10000) for _ in range(128)]
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    result: dict[str, Any] = {"benchmark": "latency", "preset": preset, "prompt_len": 128, "output_len": 512}
    for label, eager in (("eager", True), ("graphs", False)):
        llm = LLM(preset, max_model_len=1024, max_num_seqs=8, enforce_eager=eager, **engine_options)
        llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)
        timer = _StepTimer(llm)
        llm.generate([prompt], params, use_tqdm=False)
        times = sorted(timer.decode_times)
        result[f"{label}_ms_per_token"] = 1000 * times[len(times) // 2]
        result[f"{label}_cuda_graphs"] = bool(llm.runner.graphs)
        del llm
    return result


def environment() -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
        "torch": torch.__version__,
    }


def write_results(results: list[dict[str, Any]], out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "results": results}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    env = payload["environment"]
    lines = [f"# {name}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}", ""]
    lines += ["| benchmark | preset | metric | value |", "|---|---|---|---|"]
    for r in results:
        for key, value in r.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines.append(f"| {r['benchmark']} | {r['preset']} | {key} | {value:,.2f} |")
            elif isinstance(value, dict):
                for k, v in value.items():
                    lines.append(f"| {r['benchmark']} | {r['preset']} | transformers {k} | {v:,.2f} |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    return path


def main(args) -> int:
    options = {}
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    results = []
    for preset in args.presets:
        if args.benchmark in ("throughput", "all"):
            results.append(bench_throughput(preset, hf_num_seqs=args.hf_num_seqs, **options))
        if args.benchmark in ("latency", "all"):
            results.append(bench_latency(preset, **options))
    path = write_results(results, Path(args.out), args.name)
    print(Path(path).with_suffix(".md").read_text())
    return 0
