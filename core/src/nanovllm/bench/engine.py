"""Engine benchmarks on shape presets (definitions in ANCHORS.md).

- B1 ``throughput``: nano-vLLM's bench.py workload (seed 0, 256 sequences, prompts of 100-1024 random
  token ids below 10000, 100-1024 output tokens, temperature 0.6, ignore_eos, max_model_len 4096);
  output tok/s over the whole run, prefill included, and the mean decode-only step time. The same
  prompts through Hugging Face transformers' ``generate`` is the measured peer.
- B2 ``latency``: batch 1, prompt 128, 512 greedy output tokens; median ms per decode step, eager or
  with CUDA graphs.

Each function builds one engine; :mod:`nanovllm.bench` runs each in its own process, so one run's GPU
memory never shapes the next one's KV cache.
"""

from __future__ import annotations

import random
import time
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


class DecodeStepTimer:
    """Wraps ``LLMEngine.step`` to time the steps in which every scheduled sequence decodes."""

    def __init__(self, llm) -> None:
        self.llm, self.times, self.other_times = llm, [], []
        self._step = llm.step
        llm.step = self

    def __call__(self):
        sched = self.llm.scheduler
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
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    _sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    return {
        "benchmark": "throughput",
        "preset": preset,
        "settings": {**options, "num_seqs": len(prompts), "temperature": 0.6, "ignore_eos": True,
                     "kv_cache_tokens": llm.runner.num_blocks * llm.runner.block_size,
                     "attention_backend": llm.runner.backend.name, "cuda_graphs": bool(llm.runner.graphs)},
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
    """The first ``num_seqs`` B1 prompts through transformers' ``generate``: one left-padded batch,
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
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=True, temperature=0.6,
                       max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens), pad_token_id=0)
    _sync()
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
        "settings": {**options, "prompt_len": 128, "output_len": 512, "cuda_graphs": bool(llm.runner.graphs)},
        "ms_per_token": timer.median_ms(),
        "mean_ms_per_token": timer.mean_ms(),
    }


def profile_decode_step(preset: str, steps: int = 30, num_seqs: int = 256, temperature: float = 0.6,
                        top: int = 12, **engine_options: Any) -> dict[str, Any]:
    """Where one full-batch decode step of the B1 workload goes (its first ``num_seqs`` prompts; 1: a
    batch-1 step, as B2 and B6 time them): the prompts are prefilled, then
    decode steps are timed (wall clock per step; the host phases without and with a synchronisation
    after each, which separates host work from waiting; ``wait_and_apply`` is where the host waits
    for the GPU) and five are profiled (GPU kernel time). ``temperature``: every request's (B2 and B6 decode
    greedily: 0); ``top``: how many kernels the result lists, the slowest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import LLM, SamplingParams

    llm = LLM(preset, max_model_len=4096, **engine_options)
    prompts, _ = throughput_workload(num_seqs=num_seqs)
    for p in prompts:  # every sequence outlives the profiled steps
        llm.add_request(p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=1024))
    sched, runner = llm.scheduler, llm.runner
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        llm.step()
    for _ in range(5):
        llm.step()
    _sync()
    phases = {"schedule": (sched, "schedule"), "prepare": (runner, "prepare"), "sampler": (runner, "sampler"),
              "wait_and_apply": (llm, "_apply_pending")}
    result: dict[str, Any] = {"benchmark": "decode-profile", "preset": preset, "batch": len(sched.running),
                              "cuda_graphs": bool(runner.graphs)}
    for synced in (False, True):
        spent = dict.fromkeys(phases, 0.0)
        originals = {name: getattr(obj, attr) for name, (obj, attr) in phases.items()}

        def timed(name, fn, synced=synced, spent=spent):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                if synced:
                    _sync()
                spent[name] += time.perf_counter() - start
                return out
            return wrapper

        for name, (obj, attr) in phases.items():
            setattr(obj, attr, timed(name, originals[name]))
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        _sync()
        step_ms = 1000 * (time.perf_counter() - start) / steps
        for name, (obj, attr) in phases.items():
            setattr(obj, attr, originals[name])
        label = "synced" if synced else "plain"
        result[f"step_ms_{label}"] = step_ms
        result[f"host_ms_{label}"] = {k: round(1000 * v / steps, 3) for k, v in spent.items()}
    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            llm.step()
        _sync()
    kernels = [(e.key, e.self_device_time_total / n / 1000, e.count // n) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[1])
    result["gpu_ms_per_step"] = sum(k[1] for k in kernels)
    result["kernel_launches_per_step"] = sum(k[2] for k in kernels)
    result["gpu_idle_ms_per_step"] = result["step_ms_plain"] - result["gpu_ms_per_step"]
    result["top_kernels"] = [{"name": k[0][:80], "ms": round(k[1], 3), "calls": k[2]} for k in kernels[:top]]
    return result
