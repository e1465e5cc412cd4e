"""The front-end's cost per engine step (CPU, no model): ``python benchmarks/frontend_cost.py [--streams 256]``.

``AsyncLLM`` with ``--streams`` live DELTA requests, its engine replaced by a stand-in that only records
commands, is fed fake step messages (one new token per stream, as a decode step of the engine in its own
process sends) and timed per step: the message's pickling and unpickling (the pipe between the processes),
applying it (the mirrors; waking the consumers), and the consumers polling their streams (incremental
detokenization, building the RequestOutputs) with one ``json.dumps`` per output as the server's streaming
chunk. With the built-in model's tokenizer (``--tokenizer builtin``, the default) or none (``--tokenizer none``,
as the throughput benchmark's presets). ``--behind K`` applies K steps before the consumers run, as a front-end behind the engine
does (each stream's K steps one output), and reports the cost per step.
The served throughput itself is ``nanovllm bench serve`` against ``nanovllm serve`` on the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import statistics
import time

from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.engine.engine_core import SchedulerStats
from nanovllm.sampling_params import RequestOutputKind, SamplingParams
from nanovllm.testing import RecordingCore, recording_front_end


async def _measure(llm: AsyncLLM, core: RecordingCore, num_streams: int, num_steps: int, prompt_len: int,
                   vocab_size: int, seed: int, behind: int) -> dict[str, float]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.6, max_tokens=num_steps, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    received = asyncio.Event()
    pending = [0]  # outputs of the current steps not yet taken by their consumers

    async def consume(i: int) -> None:
        async for out in llm.generate([rng.randrange(vocab_size) for _ in range(prompt_len)], params, f"r{i}"):
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
                                  "stop_reason": None, "logprobs": None}]}
            json.dumps(chunk)  # what the server does with each output when streaming
            pending[0] -= 1
            if not pending[0]:
                received.set()

    consumers = [asyncio.ensure_future(consume(i)) for i in range(num_streams)]
    await asyncio.sleep(0)  # every request sent
    times: dict[str, list[float]] = {"transport": [], "apply": [], "deliver": []}
    for first in range(0, num_steps, behind):  # ``behind`` steps' messages, then the consumers run
        steps = range(first, min(first + behind, num_steps))
        now = time.time()
        messages = []
        for step in steps:
            finish = ("length", None, now, None, None) if step == num_steps - 1 else None
            updates = [(f"r{i}", 0, [rng.randrange(vocab_size)], None, now, now, 0, finish) for i in range(num_streams)]
            messages.append(("step", updates, SchedulerStats(num_streams, 0, 0.5)))
        start = time.perf_counter()
        messages = [pickle.loads(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) for m in messages]
        applied = time.perf_counter()
        pending[0] = num_streams  # one output each: the steps merged
        received.clear()
        for message in messages:
            llm._outputs.handle(message)
        handled = time.perf_counter()
        await received.wait()
        done = time.perf_counter()
        times["transport"].append((applied - start) / len(steps))
        times["apply"].append((handled - applied) / len(steps))
        times["deliver"].append((done - handled) / len(steps))
    await asyncio.gather(*consumers)
    result = {f"{name}_ms": 1000 * statistics.median(values) for name, values in times.items()}
    result["total_ms"] = sum(result.values())
    result["per_stream_us"] = 1000 * result["total_ms"] / num_streams
    return result


def measure(num_streams: int = 256, num_steps: int = 50, prompt_len: int = 128, tokenizer: str = "builtin",
            seed: int = 0, behind: int = 1) -> dict[str, float]:
    """Median milliseconds per step of each part (and their total), and microseconds per stream; with the
    consumers run after every ``behind`` steps (a front-end behind the engine: their outputs merged)."""
    if tokenizer == "builtin":
        from nanovllm.default_model import default_model_dir

        path = str(default_model_dir())
        vocab_size = json.loads((default_model_dir() / "config.json").read_text())["vocab_size"]
    else:
        path, vocab_size = None, 151936  # Qwen3's, as the throughput benchmark's presets
    llm, core = recording_front_end(path, vocab_size)
    return asyncio.run(_measure(llm, core, num_streams, num_steps, prompt_len, vocab_size, seed, behind))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/frontend_cost.py", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokenizer", choices=("builtin", "none"), default="builtin")
    parser.add_argument("--behind", type=int, default=1,
                        help="steps applied before the consumers run (a front-end behind the engine)")
    args = parser.parse_args(argv)
    if args.behind < 1:
        parser.error("--behind must be at least 1 (1: the consumers run after every step)")
    r = measure(args.streams, args.steps, args.prompt_len, args.tokenizer, behind=args.behind)
    print(f"front-end per step, {args.streams} streams, tokenizer {args.tokenizer}, consumers run every "
          f"{args.behind} step(s) (median of {args.steps} steps):")
    print(f"  transport (pickle + unpickle of the step message) {r['transport_ms']:.2f} ms")
    print(f"  apply (mirrors, waking the consumers)             {r['apply_ms']:.2f} ms")
    print(f"  deliver (consumers poll: text, outputs, json)     {r['deliver_ms']:.2f} ms")
    print(f"  total {r['total_ms']:.2f} ms per step = {r['per_stream_us']:.1f} us per stream")


if __name__ == "__main__":
    main()
