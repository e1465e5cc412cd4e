"""Hybrid KV against the uniform layout, in one run: ``python benchmarks/hybrid_kv.py``.

    python benchmarks/hybrid_kv.py --model gemma-3-270m --out benchmarks/results --name hybrid_kv

Each job runs in a process of its own, once per layout: ``hybrid`` (the default, sliding-window layers keep
their window) and ``uniform`` (``disable_hybrid_kv_cache_manager=True``, every layer keeps every token).

- ``capacity``: a fixed KV budget (``--kv-budget-gib``, the engine's ``kv_cache_memory``) and
  ``--capacity-seqs`` greedy requests of random token ids that reach ``--context`` tokens (the
  ``max_model_len``): each decodes long enough that the first is still decoding when the last could have been
  prefilled (:func:`capacity_lengths`). After every step the engine's scheduler is read: the most sequences
  decoding at once with their whole prompt in the cache (``max_decoding``: how many such sequences the budget
  holds), the most running at all, and the most blocks a sequence holds past its first decode, as bytes per
  sequence; the run stops when the first request finishes. Beside them the layout's bytes per sequence of
  ``--context`` tokens as ``nanovllm bench kv`` counts them, and the full-attention layers' own.
- ``serve``: ``--serve-seqs`` requests of ``--serve-context`` tokens submitted at once, ``--serve-tokens``
  greedy output tokens each, the engine's default memory; output tokens per second of wall time after a
  warm-up, and where the time went (:class:`StepRecorder`): the steps of each kind (prefill-only, mixed,
  decode-only), the wall seconds of the steps with prompt tokens and of the decode-only ones, and the host
  milliseconds per step of scheduling and planning.

The hybrid rows get the ratios to the uniform ones of the same run, next to the targets: at least
``CAPACITY_TARGET`` times as many concurrent sequences, and bytes per sequence at most
``BYTES_TARGET`` times the full-attention layers' own. The model is Gemma 3 270M where its packages are
installed, else a random-weight model of its shape (``GEMMA3_270M_SHAPE``; the row says which). Writes
OUT/NAME.json and OUT/NAME.md after every job and OUT/NAME.png at the end; prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _jobs import job_main, run_jobs
from _plot import save, subplots

CAPACITY_TARGET = 4.0  # concurrent --context sequences on one budget, hybrid over uniform
BYTES_TARGET = 1.25  # KV bytes per sequence over the full-attention layers' own
LAYOUTS = {"hybrid": False, "uniform": True}  # disable_hybrid_kv_cache_manager
# Gemma 3 270M's published shape: 15 of 18 layers slide over 512 tokens, every sixth attends globally
GEMMA3_270M_SHAPE: dict[str, Any] = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=640,
    intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    sliding_window=512, max_position_embeddings=32768, query_pre_attn_scalar=256, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="bfloat16",
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
)


def model_source(model: str) -> tuple[str, dict[str, Any], str]:
    """(what to load, the engine options it needs, which weights): Gemma 3 270M's packaged weights where
    installed, else its shape with random weights; any other model as it is."""
    from nanovllm.default_model import GEMMA3_MODEL, gemma3_is_available

    if model != GEMMA3_MODEL or gemma3_is_available():
        return model, {}, "as given"
    folder = Path(tempfile.mkdtemp(prefix="gemma3-270m-shape-"))
    (folder / "config.json").write_text(json.dumps(GEMMA3_270M_SHAPE, indent=1))
    return str(folder), {"load_format": "dummy", "skip_tokenizer_init": True}, "random (Gemma 3 270M shape)"


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]


def held_blocks(seq, null_block: int | None) -> int:
    """Blocks a sequence holds over its KV cache groups (a window group's freed ones are the null block)."""
    return sum(1 for table in seq.block_tables for b in table if b != null_block)


def capacity_lengths(context: int, num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(prompt tokens, tokens decoded) of a capacity request that reaches ``context`` tokens: it decodes until
    every request's prompt could have been prefilled (a quarter more, and 32), so the first request still
    decodes while the last one's prefill is scheduled."""
    decode = -(-num_seqs * context // max_num_batched_tokens) * 5 // 4 + 32
    if decode >= context:
        raise ValueError(f"--context {context} leaves no prompt: the capacity requests decode {decode} tokens "
                         "each; raise --context or --max-num-batched-tokens, or lower --capacity-seqs")
    return context - decode, decode


def bench_capacity(model: str, layout: str, context: int, num_seqs: int, kv_budget_gib: float,
                   max_num_batched_tokens: int, **engine_options: Any) -> dict[str, Any]:
    from nanovllm import LLM, SamplingParams
    from nanovllm.bench.kv import engine_groups, kv_layout

    path, needs, weights = model_source(model)
    prompt_len, decode = capacity_lengths(context, num_seqs, max_num_batched_tokens)
    options = {**needs, **engine_options, "kv_cache_memory": int(kv_budget_gib * 2**30),
               "max_model_len": context, "max_num_batched_tokens": max_num_batched_tokens,
               "max_num_seqs": max(num_seqs, 1), "disable_hybrid_kv_cache_manager": LAYOUTS[layout]}
    llm = LLM(path, **options)
    sched = llm.scheduler
    bm = sched.block_manager
    null = getattr(bm, "null_block", None)
    params = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
    ids = [f"c{i}" for i in range(num_seqs)]
    for request_id, prompt in zip(ids, random_prompts(num_seqs, prompt_len, llm.vocab_size), strict=True):
        llm.add_request(request_id, prompt, params)
    max_running = max_decoding = max_blocks = steps = 0
    was_decoding: set[int] = set()
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        outputs = llm.step()
        steps += 1
        # all but the token being sampled in the cache (a prefill or a recompute has ended)
        decoding = [s for s in sched.running if s.num_computed_tokens >= s.num_tokens - 1]
        max_running = max(max_running, len(sched.running))
        max_decoding = max(max_decoding, len(decoding))
        # decoding at the step before too: its window groups have given back what its last chunk spanned
        settled = [s for s in decoding if s.seq_id in was_decoding]
        max_blocks = max([max_blocks, *(held_blocks(s, null) for s in settled)])
        was_decoding = {s.seq_id for s in decoding}
        if any(o.finished for o in outputs):
            break
    seconds = time.perf_counter() - start
    llm.abort_request(ids)
    kv = kv_layout(path, context, dtype=llm.config.dtype, device=llm.config.device,
                   block_size=llm.config.block_size)
    # a pool block holds one block of tokens in each of its layer slots, whatever group it serves
    block_bytes = llm.config.block_size * max(llm.llm_engine.kv_cache_group_bytes_per_token)
    return {
        "benchmark": "capacity", "layout": layout, "model": model, "weights": weights, "context": context,
        "kv_budget_bytes": options["kv_cache_memory"], "num_blocks": llm.runner.num_blocks,
        "requests": num_seqs, "max_decoding": max_decoding, "max_running": max_running, "steps": steps,
        "seconds": seconds, "preemptions": sched.num_preemptions,
        "measured_bytes_per_sequence": max_blocks * block_bytes,
        "prompt_tokens": prompt_len,
        "bytes_per_sequence": kv["uniform_bytes_per_sequence" if LAYOUTS[layout] else "bytes_per_sequence"],
        "full_attention_bytes_per_sequence": kv["full_attention_bytes_per_sequence"],
        "kv_cache_groups": engine_groups(llm),
        "settings": {k: v for k, v in options.items() if k != "kv_cache_memory"},
    }


class StepRecorder:
    """Wraps the engine's ``step`` (what ``LLM.generate`` calls), the scheduler's ``schedule`` and
    ``advance`` and the runner's ``prepare`` of ``llm``: per kind of step (``prefill_only``, ``mixed`` or
    ``decode_only``, by what it scheduled), how many ran, their wall seconds, and the host seconds spent
    scheduling and planning them (``schedule``, ``prepare``, ``advance``)."""

    KINDS = ("prefill_only", "mixed", "decode_only")

    def __init__(self, llm) -> None:
        engine = llm.llm_engine
        self.steps = dict.fromkeys(self.KINDS, 0)
        self.seconds = dict.fromkeys(self.KINDS, 0.0)
        self.host_seconds = dict.fromkeys(self.KINDS, 0.0)
        self._kind: str | None = None
        self._host = 0.0
        engine.step = self._timed(engine.step, self._end_step)
        sched, runner = engine.scheduler, engine.runner
        sched.schedule = self._timed(sched.schedule, self._scheduled)
        runner.prepare = self._timed(runner.prepare)
        sched.advance = self._timed(sched.advance)

    def _timed(self, fn, then=None):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds = time.perf_counter() - start
            if then is None:
                self._host += seconds
            else:
                then(out, seconds)
            return out

        return wrapper

    def _scheduled(self, seqs, seconds: float) -> None:
        self._host += seconds
        prefills = sum(1 for s in seqs if not s.is_decode)
        self._kind = None if not seqs else (
            "decode_only" if not prefills else "prefill_only" if prefills == len(seqs) else "mixed")

    def _end_step(self, _, seconds: float) -> None:
        if self._kind is not None:
            self.steps[self._kind] += 1
            self.seconds[self._kind] += seconds
            self.host_seconds[self._kind] += self._host
        self._kind, self._host = None, 0.0

    def summary(self) -> dict[str, Any]:
        decodes, prefills = self.steps["decode_only"], self.steps["prefill_only"] + self.steps["mixed"]
        return {
            **{f"steps_{k}": n for k, n in self.steps.items()},
            # the steps with prompt tokens, then the others
            "prefill_seconds": self.seconds["prefill_only"] + self.seconds["mixed"],
            "decode_seconds": self.seconds["decode_only"],
            "host_ms_per_decode_step": 1000 * self.host_seconds["decode_only"] / max(decodes, 1),
            "host_ms_per_prefill_step":
                1000 * (self.host_seconds["prefill_only"] + self.host_seconds["mixed"]) / max(prefills, 1),
        }


def bench_serve(model: str, layout: str, context: int, num_seqs: int, output_tokens: int,
                **engine_options: Any) -> dict[str, Any]:
    from nanovllm import LLM, SamplingParams
    from nanovllm.bench.engine import sync

    path, needs, weights = model_source(model)
    options = {**needs, **engine_options, "max_model_len": context + output_tokens,
               "disable_hybrid_kv_cache_manager": LAYOUTS[layout]}
    llm = LLM(path, **options)
    prompts = random_prompts(num_seqs, context, llm.vocab_size, seed=1)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    recorder = StepRecorder(llm)
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    return {
        "benchmark": "serve", "layout": layout, "model": model, "weights": weights, "context": context,
        "requests": num_seqs, "output_tokens": produced, "seconds": seconds,
        "output_tok_per_s": produced / seconds, "preemptions": llm.scheduler.num_preemptions,
        **recorder.summary(), "cuda_graphs": bool(llm.runner.cuda_graphs.graphs),
        "kv_cache_tokens": llm.runner.num_blocks * llm.runner.block_size, "settings": options,
    }


def run_job(job: dict) -> list[dict[str, Any]]:
    bench = {"capacity": bench_capacity, "serve": bench_serve}[job["kind"]]
    return [bench(**job["options"])]


def with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hybrid rows' ratios to the uniform rows of the same benchmark, and bytes per sequence over the
    full-attention layers' own."""
    uniform = {r["benchmark"]: r for r in results if r.get("layout") == "uniform" and "error" not in r}
    out = []
    for r in results:
        r = dict(r)
        if r.get("layout") == "hybrid" and "error" not in r and r["benchmark"] in uniform:
            base = uniform[r["benchmark"]]
            if r["benchmark"] == "capacity" and base["max_decoding"]:
                r["vs_uniform"] = r["max_decoding"] / base["max_decoding"]
            if r["benchmark"] == "serve":
                r["vs_uniform"] = r["output_tok_per_s"] / base["output_tok_per_s"]
        if r.get("benchmark") == "capacity" and "error" not in r and r["full_attention_bytes_per_sequence"]:
            r["vs_full_attention"] = r["measured_bytes_per_sequence"] / r["full_attention_bytes_per_sequence"]
        out.append(r)
    return out


def markdown(payload: dict[str, Any], title: str) -> str:
    env, rows = payload["environment"], payload["results"]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}."]
    lines += [f"\nfailed: {r['benchmark']} {r.get('options', {}).get('layout', '')}: {r['error']}"
              for r in rows if "error" in r]
    capacity = [r for r in rows if r["benchmark"] == "capacity" and "error" not in r]
    if capacity:
        first = capacity[0]
        lines += ["", f"Concurrent {first['context']:,}-token sequences on "
                  f"{first['kv_budget_bytes'] / 2**20:,.0f} MiB of KV, {first['model']} (weights: "
                  f"{first['weights']}; prompts of {first['prompt_tokens']:,} tokens). Target: hybrid at least "
                  f"{CAPACITY_TARGET:g}x uniform; bytes per sequence at most {BYTES_TARGET:g}x the full-attention "
                  "layers' own.", "",
                  "| layout | max decoding | max running | vs uniform | MiB per sequence (measured) | "
                  "MiB per sequence (counted) | full-attention MiB | measured / full-attention |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in capacity:
            lines.append(
                f"| {r['layout']} | {r['max_decoding']} | {r['max_running']} | "
                f"{_ratio(r.get('vs_uniform'))} | {r['measured_bytes_per_sequence'] / 2**20:,.1f} | "
                f"{r['bytes_per_sequence'] / 2**20:,.1f} | "
                f"{r['full_attention_bytes_per_sequence'] / 2**20:,.1f} | "
                f"{_ratio(r.get('vs_full_attention'))} |")
    serve = [r for r in rows if r["benchmark"] == "serve" and "error" not in r]
    if serve:
        first = serve[0]
        lines += ["", f"Serving {first['requests']} concurrent {first['context']:,}-token requests, greedy.",
                  "",
                  "| layout | output tok/s | vs uniform | output tokens | seconds | preemptions | steps "
                  "(prefill / mixed / decode) | prefill s | decode s | host ms per prefill / decode step |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['layout']} | {r['output_tok_per_s']:,.0f} | {_ratio(r.get('vs_uniform'))} | "
                  f"{r['output_tokens']:,} | {r['seconds']:.2f} | {r['preemptions']} | "
                  f"{r.get('steps_prefill_only', '-')} / {r.get('steps_mixed', '-')} / "
                  f"{r.get('steps_decode_only', '-')} | {r.get('prefill_seconds', float('nan')):.2f} | "
                  f"{r.get('decode_seconds', float('nan')):.2f} | "
                  f"{r.get('host_ms_per_prefill_step', float('nan')):.2f} / "
                  f"{r.get('host_ms_per_decode_step', float('nan')):.2f} |" for r in serve]
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def chart(payload: dict[str, Any], path: Path) -> None:
    """Concurrent sequences and output tok/s, hybrid beside uniform."""
    rows = [r for r in payload["results"] if "error" not in r]
    panels = [(kind, metric, [r for r in rows if r["benchmark"] == kind])
              for kind, metric in (("capacity", "max_decoding"), ("serve", "output_tok_per_s"))]
    panels = [p for p in panels if p[2]]
    if not panels:
        return
    fig, axes = subplots(1, len(panels), figsize=(5 * len(panels), 3), squeeze=False)
    for ax, (kind, metric, kind_rows) in zip(axes[0], panels, strict=True):
        ax.bar([r["layout"] for r in kind_rows], [r[metric] for r in kind_rows], color="tab:blue")
        ax.set_title(f"{kind}: {metric.replace('_', ' ')}", fontsize=9)
    save(fig, path, path.stem, payload["environment"])


def jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = {"device": args.device} if args.device != "auto" else {}
    if args.attention_backend:
        engine["attention_backend"] = args.attention_backend
    out = []
    for layout in LAYOUTS:
        out.append({"kind": "capacity", "options": {
            "model": args.model, "layout": layout, "context": args.context, "num_seqs": args.capacity_seqs,
            "kv_budget_gib": args.kv_budget_gib, "max_num_batched_tokens": args.max_num_batched_tokens,
            **engine}})
    for layout in LAYOUTS:
        out.append({"kind": "serve", "options": {
            "model": args.model, "layout": layout, "context": args.serve_context, "num_seqs": args.serve_seqs,
            "output_tokens": args.serve_tokens, **engine}})
    return [j for j in out if not args.only or j["kind"] in args.only]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/hybrid_kv.py", description=__doc__.split("\n")[0])
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gemma-3-270m",
                   help="a model with sliding-window layers (default: Gemma 3 270M, random weights of its "
                   "shape where its packages are not installed)")
    p.add_argument("--only", nargs="+", choices=("capacity", "serve"), default=None,
                   help="run only these jobs")
    p.add_argument("--context", type=int, default=32768,
                   help="tokens each capacity request reaches, prompt and decoded tokens")
    p.add_argument("--capacity-seqs", type=int, default=48,
                   help="capacity requests, more than the budget holds in the hybrid layout")
    p.add_argument("--kv-budget-gib", type=float, default=4.0,
                   help="the fixed KV budget of the capacity jobs")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the capacity jobs' token budget")
    p.add_argument("--serve-seqs", type=int, default=32, help="concurrent requests of the serve jobs")
    p.add_argument("--serve-context", type=int, default=8192, help="prompt tokens of each serve request")
    p.add_argument("--serve-tokens", type=int, default=512, help="output tokens of each serve request")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="hybrid_kv")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    for name in ("context", "capacity_seqs", "max_num_batched_tokens", "serve_seqs", "serve_context",
                 "serve_tokens"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.kv_budget_gib <= 0:
        parser().error(f"--kv-budget-gib must be positive, got {args.kv_budget_gib}")
    try:
        capacity_lengths(args.context, args.capacity_seqs, args.max_num_batched_tokens)
    except ValueError as exc:
        parser().error(str(exc))
    return run_jobs(jobs(args), __file__, Path(args.out), args.name, vars(args) | {"job": None}, with_ratios,
                    markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
