"""Engine benchmarks on shape presets.

- ``throughput``: nano-vLLM's bench.py workload (seed 0, 256 sequences, prompts of 100-1024 random
  token ids below 10000, 100-1024 output tokens, temperature 0.6, ignore_eos, max_model_len 4096);
  output tok/s over the whole run, prefill included, and the mean decode-only step time. The same
  prompts through Hugging Face transformers' ``generate`` is the peer measured beside it.
- ``latency``: batch 1, prompt 128, 512 greedy output tokens; median ms per decode step, eager or
  with CUDA graphs.

Each function builds one engine; :mod:`nanovllm.bench` runs each in its own process, so one run's GPU
memory never shapes the next one's KV cache. A result's settings record the engine's KV cache groups: each
one's layers, window and KV bytes per token.
"""

from __future__ import annotations

import random
import time
from typing import Any

from nanovllm.bench.kv import engine_groups


def throughput_workload(seed: int = 0, num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths drawn exactly as nano-vLLM's bench.py draws them."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def sync() -> None:
    """Wait for the GPU's queued work (nothing on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class DecodeStepTimer:
    """Wraps the ``step`` of ``llm``'s engine (what ``LLM.generate`` calls) to time the steps in which every
    scheduled sequence decodes."""

    def __init__(self, llm) -> None:
        self.engine, self.times, self.other_times = llm.llm_engine, [], []
        self._step = self.engine.step
        self.engine.step = self

    def __call__(self):
        sched = self.engine.scheduler
        decode_only = bool(sched.running) and not sched.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in sched.running
        )
        start = time.perf_counter()
        out = self._step()
        (self.times if decode_only else self.other_times).append(time.perf_counter() - start)
        return out

    def mean_ms(self) -> float:
        return 1000 * sum(self.times) / max(1, len(self.times))

    def median_ms(self) -> float:
        times = sorted(self.times)
        return 1000 * times[len(times) // 2] if times else float("nan")


def bench_throughput(preset: str, **engine_options: Any) -> dict[str, Any]:
    from nanovllm import LLM, SamplingParams

    prompts, max_tokens = throughput_workload()
    options = {"max_model_len": 4096, **engine_options}
    llm = LLM(preset, **options)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    timer = DecodeStepTimer(llm)
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    return {
        "benchmark": "throughput",
        "preset": preset,
        "settings": {**options, "num_seqs": len(prompts), "temperature": 0.6, "ignore_eos": True,
                     "kv_cache_tokens": llm.runner.num_blocks * llm.runner.block_size,
                     "attention_backend": llm.runner.backend.name,
                     "cuda_graphs": bool(llm.runner.cuda_graphs.graphs), "kv_cache_groups": engine_groups(llm)},
        "output_tokens": produced,
        "seconds": elapsed,
        "output_tok_per_s": produced / elapsed,
        "mean_decode_step_ms": timer.mean_ms(),
        "decode_steps": len(timer.times),
        "other_steps": len(timer.other_times),  # with a prefill chunk in them
        "other_steps_seconds": sum(timer.other_times),
        "preemptions": llm.scheduler.num_preemptions,
    }


def bench_transformers(preset: str, num_seqs: int) -> dict[str, Any]:
    """The first ``num_seqs`` throughput prompts through transformers' ``generate``: one left-padded batch,
    sampling at 0.6, every row running to the longest budget; a row's own budget counts as output."""
    import torch
    import transformers

    from nanovllm.presets import preset_dir

    prompts, max_tokens = throughput_workload()
    prompts, max_tokens = prompts[:num_seqs], max_tokens[:num_seqs]
    config = transformers.AutoConfig.from_pretrained(preset_dir(preset))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=0.6,
                       max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens), pad_token_id=0)
    sync()
    elapsed = time.perf_counter() - start
    useful = sum(max_tokens)
    return {
        "benchmark": "throughput-transformers",
        "preset": preset,
        "settings": {"num_seqs": num_seqs, "transformers": transformers.__version__, "dtype": "bfloat16",
                     "attn_implementation": getattr(config, "_attn_implementation", None)},
        "output_tokens": useful,
        "seconds": elapsed,
        "output_tok_per_s": useful / elapsed,
    }


def bench_latency(preset: str, eager: bool, **engine_options: Any) -> dict[str, Any]:
    from nanovllm import LLM, SamplingParams

    options = {"max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": eager, **engine_options}
    llm = LLM(preset, **options)
    rng = random.Random(1)
    prompt = [rng.randint(0, min(10_000, llm.vocab_size - 1)) for _ in range(128)]
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)
    timer = DecodeStepTimer(llm)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=512, ignore_eos=True), use_tqdm=False)
    return {
        "benchmark": "latency-eager" if eager else "latency",
        "preset": preset,
        "settings": {**options, "prompt_len": 128, "output_len": 512,
                     "cuda_graphs": bool(llm.runner.cuda_graphs.graphs), "kv_cache_groups": engine_groups(llm)},
        "ms_per_token": timer.median_ms(),
        "mean_ms_per_token": timer.mean_ms(),
    }
