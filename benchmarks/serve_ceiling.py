"""The serving stack's own ceiling, with no model (CPU): ``python benchmarks/serve_ceiling.py``.

The server of ``nanovllm serve`` (FastAPI and uvicorn over ``AsyncLLM``, its engine in a process of its own with
the real scheduler) runs over a stand-in model: a step samples one token per sequence instantly and takes
``--step-ms`` plus ``--prefill-us`` per prompt token (a sleep: the host waiting on the GPU). The client of
``nanovllm bench serve`` sends it the throughput benchmark's requests at an infinite rate, streaming and not. Reported: output tok/s
served against the same stand-in offline (``LLM.generate``, no HTTP), the CPU seconds of the server, engine and
client processes over the run (a process near one CPU second per second is the limit), and the batch (sequences,
tokens) of the first steps, served and offline: requests that trickle in start the run with small batches.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from nanovllm.engine.model_runner import StepResult
from nanovllm.engine.sequence import Sequence

STAND_IN_MODEL = dict(vocab_size=10_240, max_position_embeddings=4096)  # the throughput workload's ids and lengths fit
LOGGED_STEPS = 64


class StandInStep:
    """A launched step of the stand-in: done at ``done_at`` (perf_counter seconds), token 7 for every sequence."""

    def __init__(self, seqs: list[Sequence], done_at: float) -> None:
        self.seqs, self.done_at = seqs, done_at

    def result(self) -> StepResult:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return StepResult([7] * len(self.seqs), [None] * len(self.seqs), [])


class StandInRunner:
    """In place of the engine's ModelRunner: steps run one after another on a pretend GPU, each taking
    ``step_s`` plus ``prefill_s`` per prompt token; the first steps' batches are logged (to ``log_path``)."""

    def __init__(self, step_s: float, prefill_s: float, log_path: str | None) -> None:
        self.step_s, self.prefill_s, self.log_path = step_s, prefill_s, log_path
        self.busy_until = 0.0
        self.steps: list[tuple[int, int]] = []  # (sequences, tokens) per step

    def launch(self, seqs: list[Sequence], allocated: list[int] | None = None) -> StandInStep | None:
        tokens = sum(s.num_scheduled_tokens for s in seqs)
        if len(self.steps) < LOGGED_STEPS:
            self.steps.append((len(seqs), tokens))
            if len(self.steps) == LOGGED_STEPS and self.log_path is not None:
                Path(self.log_path).write_text(json.dumps(self.steps))
        prefill = tokens - sum(1 for s in seqs if s.is_decode)
        self.busy_until = max(self.busy_until, time.perf_counter()) + self.step_s + prefill * self.prefill_s
        sampling = [s for s in seqs if s.samples_this_step]
        return StandInStep(sampling, self.busy_until) if sampling else None


def stand_in_engine(model: str, step_ms: float, prefill_us: float, log_path: str | None = None, **kwargs: Any):
    """An LLMEngine over the tiny model in ``model`` whose model runner is a :class:`StandInRunner`."""
    from nanovllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, **kwargs)
    engine.runner = StandInRunner(step_ms / 1000, prefill_us / 1e6, log_path)
    return engine


ENGINE_OPTIONS = dict(device="cpu", skip_tokenizer_init=True, max_model_len=4096, kv_cache_memory=1 << 28,
                      enforce_eager=True)


def _server_main(model: str, port: int, build: functools.partial) -> None:
    """The server process: ``nanovllm serve``'s app over the stand-in engine, until SIGTERM."""
    from nanovllm.engine.async_llm import AsyncLLM
    from nanovllm.engine.engine_core import EngineProcess
    from nanovllm.entrypoints.openai_server import serve

    llm = AsyncLLM.__new__(AsyncLLM)
    llm._setup(EngineProcess(model, ENGINE_OPTIONS, build))
    serve(llm, "stand-in", port=port, log_level="warning")


def cpu_seconds(processes) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in processes]


def served(model: str, build: functools.partial, prompts, max_tokens, stream: bool, timeout: float) -> dict:
    import httpx
    import psutil

    from nanovllm.bench.serve import run_rate

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=_server_main, args=(model, port, build))
    server.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if not server.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the stand-in server did not start; its error is above")
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children(), psutil.Process()]
        before, start = cpu_seconds(processes), time.perf_counter()
        result = asyncio.run(run_rate(base_url, "stand-in", prompts, max_tokens, float("inf"), 0, timeout, stream))
        used, elapsed = cpu_seconds(processes), time.perf_counter() - start
    finally:
        server.terminate()
        server.join(timeout)
    names = ("server", "engine", "client")
    result["cpu_s_per_s"] = {name: (u - b) / elapsed for name, u, b in zip(names, used, before, strict=True)}
    return result


def offline(model: str, build: functools.partial, prompts, max_tokens) -> dict:
    from nanovllm import SamplingParams

    engine = build(model, **ENGINE_OPTIONS)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    return {"output_tok_per_s": produced / elapsed, "duration_s": elapsed, "first_steps": engine.runner.steps}


def measure(num_prompts: int = 256, step_ms: float = 6.6, prefill_us: float = 3.5, max_output: int | None = None,
            timeout: float = 600) -> dict[str, Any]:
    """Offline and served (streaming, then not) over the stand-in; ``max_output`` caps the throughput
    workload's output lengths (a shorter run)."""
    from nanovllm.bench.engine import throughput_workload
    from nanovllm.testing import tiny_model_dir

    prompts, max_tokens = throughput_workload(num_seqs=num_prompts)
    if max_output is not None:
        max_tokens = [min(m, max_output) for m in max_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model_dir(Path(tmp) / "model", **STAND_IN_MODEL))
        results: dict[str, Any] = {"settings": {"num_prompts": num_prompts, "step_ms": step_ms,
                                                "prefill_us": prefill_us, "max_output": max_output}}
        build = functools.partial(stand_in_engine, step_ms=step_ms, prefill_us=prefill_us)
        results["offline"] = offline(model, build, prompts, max_tokens)
        for stream in (True, False):
            log = Path(tmp) / f"steps-{stream}.json"
            logged = functools.partial(stand_in_engine, step_ms=step_ms, prefill_us=prefill_us, log_path=str(log))
            r = served(model, logged, prompts, max_tokens, stream, timeout)
            r["first_steps"] = json.loads(log.read_text()) if log.exists() else None
            r["vs_offline"] = r["output_tok_per_s"] / results["offline"]["output_tok_per_s"]
            results["streaming" if stream else "not_streaming"] = r
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/serve_ceiling.py", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=6.6, help="a step's time in ms")
    parser.add_argument("--prefill-us", type=float, default=3.5, help="and per prompt token in it, in us")
    parser.add_argument("--max-output", type=int, default=None, help="cap the output lengths (a shorter run)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    r = measure(args.num_prompts, args.step_ms, args.prefill_us, args.max_output)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(f"stand-in model: {args.step_ms} ms a step + {args.prefill_us} us a prompt token; {args.num_prompts} "
          f"prompts, rate inf")
    print(f"  offline: {r['offline']['output_tok_per_s']:,.0f} output tok/s in {r['offline']['duration_s']:.2f} s")
    for name in ("streaming", "not_streaming"):
        s = r[name]
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_s_per_s"].items())
        print(f"  served, {name.replace('_', ' ')}: {s['output_tok_per_s']:,.0f} output tok/s ({s['vs_offline']:.2f} of "
              f"offline) in {s['duration_s']:.2f} s, TTFT mean {s['mean_ttft_ms']:.0f} ms; CPU s/s: {cpu}")
    for name in ("offline", "streaming", "not_streaming"):
        steps = r[name]["first_steps"]
        if steps:
            print(f"  first steps, {name.replace('_', ' ')} (sequences/tokens): "
                  + " ".join(f"{n}/{t}" for n, t in steps[:24]))


if __name__ == "__main__":
    main()
