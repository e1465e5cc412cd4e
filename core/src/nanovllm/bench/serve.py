"""``nanovllm bench serve``: a load generator against a live OpenAI-compatible server (like ``vllm bench serve``).

Requests are the throughput benchmark's workload (see :func:`nanovllm.bench.engine.throughput_workload`: token-id prompts,
temperature 0.6, ``ignore_eos``) sent to ``/v1/completions`` with streaming, their arrivals a Poisson process
at each request rate (``inf``: all at once). Per rate: output tok/s over the run, request rate, and the mean
and percentiles of the time to first token (TTFT), the time per output token after the first (TPOT) and the
end-to-end latency. Results go to ``NAME.json`` and ``NAME.md`` like the other benchmarks.

What the client does before the clock starts, so that the run times the server and not the client (they share
the host's CPU; a burst at rate ``inf`` is where the client's costs showed):
- one short request (as vLLM's initial test prompt, and the offline benchmark's warm-up), untimed; an error there stops
  the run;
- the request bodies are encoded to JSON (a body holds up to a thousand token ids);
- each request gets a client of its own with its connection already open (a ``GET /health`` on it): httpx
  connects through anyio, which resolves even an IP address on a worker thread, a cost to the client's event
  loop per connection at a burst. The server's accepting the connection is then before the clock too.
The requests themselves, their HTTP parsing, validation and everything after are timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from nanovllm.utils import progress_bar

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def summary(name: str, values: list[float]) -> dict[str, float]:
    out = {f"mean_{name}_ms": 1000 * sum(values) / len(values) if values else float("nan")}
    out.update({f"p{p}_{name}_ms": 1000 * percentile(values, p) for p in PERCENTILES})
    return out


JSON_HEADERS = {"content-type": "application/json"}


def request_body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> bytes:
    """A completion request of the throughput workload, encoded."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return json.dumps(body, separators=(",", ":")).encode()


async def one_request(client, body: bytes, start_at: float, stream: bool = True) -> dict[str, Any]:
    """Send one encoded completion request at ``start_at`` (perf_counter seconds); its timings and token count.
    Not streamed, its first token is timed at the answer's arrival, as its latency."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    sent = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", content=body, headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
        if not stream:
            tokens = json.loads(await response.aread())["usage"]["completion_tokens"]
        else:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None and chunk["choices"]:  # any chunk, as vLLM's benchmark: a model without a
                    first = time.perf_counter()  # tokenizer streams tokens with empty text
    done = time.perf_counter()
    return {"ttft": (first or done) - sent, "latency": done - sent, "tokens": tokens,
            "tpot": (done - (first or done)) / (tokens - 1) if tokens > 1 and first is not None else None}


async def run_rate(base_url: str, model: str, prompts: list[list[int]], max_tokens: list[int], rate: float,
                   seed: int, timeout: float, stream: bool = True) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    now, offsets = 0.0, []
    for _ in prompts:  # Poisson arrivals: exponential gaps at the rate; all at once for inf
        offsets.append(now)
        now += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    bodies = [request_body(model, p, m, stream) for p, m in zip(prompts, max_tokens, strict=True)]
    # a client (one connection) per request: httpx's pool looks at every connection for every request it
    # assigns and every response it closes, which with hundreds of requests at once costs more than they do
    async with contextlib.AsyncExitStack() as clients:
        per_request = [await clients.enter_async_context(httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                                                           verify=False)) for _ in prompts]
        warm_up = await one_request(per_request[0], request_body(model, [1, 2, 3], 4, stream), 0.0, stream)
        if "error" in warm_up:
            raise RuntimeError(f"the initial test request failed, so no run: {warm_up['error']}")
        await asyncio.gather(*(client.get("/health") for client in per_request))  # each one's connection open
        with progress_bar(len(prompts), f"{rate} requests/s", "req") as bar:

            async def counted(request) -> dict[str, Any]:
                result = await request
                bar.update()
                return result

            start = time.perf_counter()
            requests = zip(per_request, bodies, offsets, strict=True)
            results = await asyncio.gather(*(counted(one_request(c, b, start + o, stream)) for c, b, o in requests))
            elapsed = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    produced = sum(r["tokens"] for r in ok)
    out = {"benchmark": "serve", "request_rate": "inf" if math.isinf(rate) else rate, "num_requests": len(prompts),
           "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
           "output_tok_per_s": produced / elapsed, "requests_per_s": len(ok) / elapsed, "output_tokens": produced}
    out.update(summary("ttft", [r["ttft"] for r in ok]))
    out.update(summary("tpot", [r["tpot"] for r in ok if r["tpot"] is not None]))
    out.update(summary("e2e", [r["latency"] for r in ok]))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        out["first_error"] = errors[0]
    return out


def markdown(payload: dict[str, Any], title: str) -> str:
    env, s = payload["environment"], payload["settings"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Server {s['base_url']} ({s['model']}), {s['num_prompts']} prompts of the throughput workload per rate.", "",
             "| rate (req/s) | done | output tok/s | req/s | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms "
             "| e2e p50 / p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        lines.append(
            f"| {r['request_rate']} | {r['completed']}/{r['num_requests']} | {r['output_tok_per_s']:,.0f} | "
            f"{r['requests_per_s']:.2f} | {r['mean_ttft_ms']:.1f} / {r['p50_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | "
            f"{r['mean_tpot_ms']:.2f} / {r['p50_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f} | "
            f"{r['p50_e2e_ms']:.0f} / {r['p99_e2e_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def main_serve(args) -> int:
    import httpx

    from nanovllm.bench import environment
    from nanovllm.bench.engine import throughput_workload

    rates = [float(r) for r in args.request_rates]
    if any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0 requests per second, or inf; got {args.request_rates}")
    base_url = args.base_url.rstrip("/")
    try:
        models = httpx.get(f"{base_url}/v1/models", timeout=args.timeout).json()["data"]
    except httpx.HTTPError as exc:
        raise RuntimeError(f"no server answers at {base_url} ({exc}); start one with: nanovllm serve MODEL") from None
    model = models[0]["id"]
    prompts, max_tokens = throughput_workload(num_seqs=args.num_prompts)
    results = []
    for rate in rates:
        print(f"== serve at {rate} requests/s", flush=True)
        results.append(asyncio.run(run_rate(base_url, model, prompts, max_tokens, rate, args.seed, args.timeout)))
    settings = {"benchmark": "serve", "base_url": base_url, "model": model, "num_prompts": args.num_prompts,
                "request_rates": args.request_rates, "seed": args.seed}
    payload = {"environment": environment(), "settings": settings, "results": results}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or "serve"
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    text = markdown(payload, name)
    (out_dir / f"{name}.md").write_text(text)
    print(text)
    return 1 if any(r["failed"] for r in results) else 0
