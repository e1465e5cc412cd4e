"""Long-context speed of a model under sparse policies, next to dense and transformers in the same run: the
time to the first token (TTFT) of one long prompt, and decode speed at several batch sizes.

    python benchmarks/long_context_speed.py --model gemma-3-270m --lengths 32768 --batch-sizes 1,8 \\
        --policies "full;quest:token_budget=2048;minference:dense_below=0;xattn:threshold=0.9" \\
        --device cuda --dtype bfloat16 --out benchmarks/results --name gemma3_long_context_speed

What is measured, per runner (each ``--policies`` item in its own engine, built once and closed before the
next, then transformers) and per prompt length:

- TTFT: the wall time of ``generate`` of one prompt with ``max_tokens=1`` (prefill and the first token);
  the median of ``--repeats``.
- decode tokens/s at batch ``b``: ``b`` different prompts, greedy with ``ignore_eos``; ``b * N / (t(1 + N) -
  t(1))``, where ``t(k)`` is the wall time of ``generate`` of the ``b`` prompts with ``max_tokens=k`` and
  ``N`` is ``--decode-tokens``: the time the ``N`` decode steps add to the prefill (at batch > 1 the
  engine decodes the first prompts while it prefills the later ones, in chunks: the difference counts what
  those decode tokens add to the mixed steps). The median over ``--repeats`` pairs of runs (each pair
  run back to back).
- the engine's decode steps alone (``engine_decode_tok_s``, every batch size): the tokens of the steps after
  every prompt is prefilled over the time from the last prompt's first token to the last token (the
  engine's request metrics, ``RequestOutput.metrics``); at batch 1 that is ``N`` tokens. At batch 1 also
  the engine's own TTFT (``engine_ttft_ms``).
- per run, the engine's steps: how many prefill only, mixed (decode rows and a prefill chunk) and decode
  only, the mean prefill tokens of a step, the decode row counts of the mixed steps, the preemptions, and
  the Triton kernels compiled while it was timed (where Triton has a compile hook): a timed run should
  compile none, and the table names the runs that did or that preempted.
- transformers: the same token ids through ``AutoModelForCausalLM.generate`` (greedy, ``min_new_tokens``
  = ``max_new_tokens``, the model's dtype as the engine's, bfloat16 on CUDA by default); a batch size that
  runs out of memory is recorded as such.

Prompts are natural text (``--text-file``): prompt ``i`` of a batch is the text rotated by ``i`` times
``1/max batch`` of its length, cut to the prompt length after the tokenizer's BOS, so the prompts differ
while drawing on one text. Before an engine times a batch size, it runs that batch's two runs
(``max_tokens`` 1 and ``1 + N``) once untimed: it schedules the same steps every time, so every kernel
variant the timed runs need (a mixed step's decode kernels depend on its number of decode rows) is compiled
by then. Transformers is warmed up with one ``generate`` of two tokens. The engines run without prefix
caching, so every repeat prefills in full.

Writes OUT/NAME.json (device, date, commit, settings, every number and every repeat), OUT/NAME.md (the
table, next to the targets) and, with matplotlib, OUT/NAME.png; prints the table. The JSON is written after
every runner too (``"partial": true`` until the end), so a run stopped early keeps what it measured. A
runner that fails is recorded and the run goes on; the exit status is then 1. Progress goes to stderr.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from nanovllm.quality import long_context as lc
from nanovllm.utils import FlexibleArgumentParser

ROOT = Path(__file__).resolve().parents[1]
# the shared data folder: beside the checkout, or copied into it (as on a machine that gets only the checkout)
TEXTS = [ROOT / "shared" / "data" / "long_text.txt", ROOT.parent / "shared" / "data" / "long_text.txt"]
DEFAULT_TEXT = next((p for p in TEXTS if p.is_file()), TEXTS[-1])
DEFAULT_POLICIES = ("full;quest:token_budget=2048;minference:dense_below=0;xattn:threshold=0.9;"
                    "xattn+quest;minference+quest")
HF = lc.HF
DENSE = lc.DENSE
# Targets at 32K tokens (Gemma 3 270M): a sparse prefill policy's TTFT at most dense's, and the engine's
# dense batch-1 decode at least this many times transformers'.
SPARSE_PREFILL = ("minference", "xattn")
DENSE_DECODE_VS_HF = 10.0
TARGET_LENGTH = 32768


@attrs.define
class SpeedSettings:
    """What to run. Lengths are prompt lengths in tokens; ``decode_tokens`` is ``N`` of the decode
    measurement; ``max_num_batched_tokens`` is the engine's prefill chunk."""

    model: str | None = "gemma-3-270m"
    lengths: list[int] = attrs.field(factory=lambda: [TARGET_LENGTH])
    policies: list[str] = attrs.field(factory=lambda: lc.parse_policies(DEFAULT_POLICIES))
    batch_sizes: list[int] = attrs.field(factory=lambda: [1, 8])
    decode_tokens: int = 128
    repeats: int = 3
    device: str = "auto"
    dtype: str | None = None  # the engine's default when None; transformers then takes bfloat16 on CUDA
    max_num_batched_tokens: int = 8192
    hf: bool = True
    text_file: str | None = None
    kv_cache_dtype: str = "auto"  # the engines' KV cache element type (EngineConfig.kv_cache_dtype)

    def __attrs_post_init__(self) -> None:
        for name in ("lengths", "batch_sizes"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive numbers, got {values}")
        if min(self.lengths) < 16:
            raise ValueError(f"lengths must be at least 16 tokens each, got {self.lengths}")
        for name in ("decode_tokens", "repeats", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def timed_batch_sizes(self) -> list[int]:
        """Batch 1 always runs: its one-token runs are the TTFT."""
        return sorted({1, *self.batch_sizes})


def check_policies(policies: list[str]) -> dict[str, dict[str, str]]:
    """Resolve every selection before any model loads; per selection, its prefill and decode policy names.
    Raises ``ValueError`` naming the selection and the installed policies."""
    from nanovllm.selection import resolve_policies

    out = {}
    for policy in policies:
        try:
            plan = resolve_policies(lc.selection_of(policy))
        except Exception as exc:
            raise ValueError(f"--policies item {policy!r}: {exc}") from exc
        out[policy] = {"prefill": plan.prefill.selection.name, "decode": plan.decode.selection.name}
    return out


def batch_prompts(bos: list[int], text: list[int], length: int, batch: int) -> list[list[int]]:
    """``batch`` different prompts of ``length`` tokens: BOS, then the text rotated by ``i / batch`` of its
    length for prompt ``i`` (see the module docstring)."""
    body = length - len(bos)
    stride = len(text) // batch
    return [bos + (text[i * stride:] + text[: i * stride])[:body] for i in range(batch)]


def summarize(runs: list[dict[str, Any]], batch: int, decode_tokens: int) -> dict[str, Any]:
    """Per repeat, the decode tokens/s of one pair of runs; their median; at batch 1 the median TTFT; the
    engine's decode steps alone (and at batch 1 its TTFT) where the runs have its request metrics."""
    for run in runs:
        run["decode_tok_s"] = batch * decode_tokens / (run["t_n_s"] - run["t_1_s"])
    out = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs), "repeats": runs}
    if batch == 1:
        out["ttft_ms"] = 1000 * statistics.median(r["t_1_s"] for r in runs)
    timed = [r for r in runs if r.get("engine_metrics_1") and r.get("engine_metrics_n")]
    if timed:  # the engine's own clock: its first token, and the decode steps after every prompt is prefilled
        rates = []
        for r in timed:
            metrics = r["engine_metrics_n"]
            rates.append(r["engine_steps_n"]["decode_tokens_after_prefill"]
                         / (metrics["last_token_s"] - metrics["first_token_s"]))
        out["engine_decode_tok_s"] = statistics.median(rates)
        if batch == 1:
            firsts = [r["engine_metrics_1"]["first_token_s"] for r in timed]
            out["engine_ttft_ms"] = 1000 * statistics.median(firsts)
    return out


def step_stats(steps: list[tuple[int, int]]) -> dict[str, Any]:
    """What the engine scheduled in the steps of one ``generate``, each ``(decode rows, prefill tokens)``
    (:class:`StepLog`): the counts of steps by kind, the mean prefill tokens of a step with any, the decode
    row counts of the mixed steps, and the decode tokens of the steps after the last prefill chunk."""
    steps = [s for s in steps if s != (0, 0)]  # a step that only reads the last tokens back
    chunks = [p for _, p in steps if p]
    last_prefill = max((i for i, (_, p) in enumerate(steps) if p), default=-1)
    return {
        "steps": len(steps),
        "prefill_only_steps": sum(1 for d, p in steps if p and not d),
        "mixed_steps": sum(1 for d, p in steps if p and d),
        "decode_only_steps": sum(1 for d, p in steps if d and not p),
        "mean_prefill_tokens": statistics.mean(chunks) if chunks else 0.0,
        "decode_rows_with_prefill": sorted({d for d, p in steps if p and d}),
        "decode_tokens_after_prefill": sum(d for d, _ in steps[last_prefill + 1:]),
    }


class StepLog:
    """Records, per step of ``llm``'s engine, the decode rows (sequences past their prompt, one token each)
    and the prefill tokens (prompt chunks, recomputes after preemption) its scheduler hands out, by wrapping
    the scheduler's ``schedule``."""

    def __init__(self, llm: Any) -> None:
        self.scheduler = llm.llm_engine.scheduler
        self.steps: list[tuple[int, int]] = []
        schedule = self.scheduler.schedule

        def logged() -> list[Any]:
            seqs = schedule()
            decodes = sum(1 for s in seqs if s.num_computed_tokens >= s.num_prompt_tokens)
            self.steps.append((decodes, sum(s.num_scheduled_tokens for s in seqs) - decodes))
            return seqs

        self.scheduler.schedule = logged

    @contextmanager
    def run(self) -> Iterator[dict[str, Any]]:
        """The steps of the block: after it, the dict holds :func:`step_stats`, ``preemptions`` and
        ``triton_compiles`` (see :func:`triton_compiles`)."""
        first, preempted = len(self.steps), self.scheduler.num_preemptions
        stats: dict[str, Any] = {}
        with triton_compiles() as compiled:
            yield stats
        stats.update(step_stats(self.steps[first:]), preemptions=self.scheduler.num_preemptions - preempted,
                     triton_compiles=compiled)


@contextmanager
def triton_compiles() -> Iterator[list[str] | None]:
    """The names of the Triton kernels compiled in the block (loaded from Triton's disk cache included), one
    entry per compiled variant; ``None`` when Triton is absent or has no compile hook (``triton.knobs``)."""
    try:
        from triton import knobs

        previous = knobs.runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield None
        return
    names: list[str] = []

    def hook(*args: Any, **kwargs: Any) -> Any:  # Triton passes keywords, ``fn`` a JitFunctionInfo
        names.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - start, out


# -------------------------------------------------------------------------------------------- the engine
def engine_speed(settings: SpeedSettings, policy: str, prompts: dict[int, list[list[int]]],
                 config: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """``{length: {batch: summary}}`` of one engine under ``policy`` (see :func:`summarize`)."""
    import torch

    from nanovllm import LLM, SamplingParams

    n = settings.decode_tokens
    longest, batch = max(prompts), max(settings.timed_batch_sizes)
    dtype_bytes = torch.finfo(getattr(torch, settings.dtype)).bits // 8 if settings.dtype else 4
    cache = int(lc.kv_bytes_per_token(config, dtype_bytes) * batch * (longest + n + 16) * 1.1)
    llm = LLM(settings.model, sparse_policy=lc.selection_of(policy), max_num_seqs=batch,
              max_num_batched_tokens=settings.max_num_batched_tokens, kv_cache_memory=cache,
              **lc.engine_options(settings, config, longest + n + 1))
    log = StepLog(llm)
    try:
        def generate(ids: list[list[int]], max_tokens: int) -> tuple[float, dict[str, float], dict[str, Any]]:
            """One ``generate`` of ``ids``: its wall time, the engine's request metrics and its steps."""
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            with log.run() as steps:
                seconds, outs = _timed(lambda: llm.generate([{"prompt_token_ids": p} for p in ids], params,
                                                            use_tqdm=False))
            got = {len(o.outputs[0].token_ids) for o in outs}
            if got != {max_tokens}:
                raise RuntimeError(f"asked for {max_tokens} tokens per request, got {sorted(got)}")
            return seconds, request_metrics(outs), steps

        def pair(ids: list[list[int]]) -> dict[str, Any]:
            """The runs with 1 and ``1 + n`` tokens, back to back."""
            (t_1, metrics_1, steps_1), (t_n, metrics_n, steps_n) = generate(ids, 1), generate(ids, 1 + n)
            return {"t_1_s": t_1, "t_n_s": t_n, "engine_metrics_1": metrics_1, "engine_metrics_n": metrics_n,
                    "engine_steps_1": steps_1, "engine_steps_n": steps_n}

        out: dict[int, dict[int, Any]] = {}
        for length, texts in sorted(prompts.items()):
            out[length] = {}
            for b in settings.timed_batch_sizes:
                warmup = pair(texts[:b])  # compiles the timed runs' kernels: the same steps, the same shapes
                out[length][b] = summarize([pair(texts[:b]) for _ in range(settings.repeats)], b, n)
                out[length][b]["warmup_steps"] = {k: warmup[f"engine_steps_{k}"] for k in ("1", "n")}
                say(f"  {policy} {length} tokens batch {b}: {_line(out[length][b])}")
        return out
    finally:
        llm.close()
        del llm


def request_metrics(outs: list[Any]) -> dict[str, float]:
    """The engine's timing of one ``generate`` call (``RequestOutput.metrics``), seconds from the first
    request's arrival: the last request's first token and the last token of all."""
    metrics = [o.metrics for o in outs if o.metrics is not None and o.metrics.first_token_time is not None]
    if len(metrics) != len(outs):
        return {}
    start = min(m.arrival_time for m in metrics)
    return {"first_token_s": max(m.first_token_time for m in metrics) - start,
            "last_token_s": max(m.last_token_time for m in metrics) - start}


def _line(summary: dict[str, Any]) -> str:
    ttft = f"TTFT {summary['ttft_ms']:.1f} ms, " if "ttft_ms" in summary else ""
    alone = (f" (decode steps alone {summary['engine_decode_tok_s']:.1f})" if "engine_decode_tok_s" in summary
             else "")
    return f"{ttft}decode {summary['decode_tok_s']:.1f} tok/s{alone}"


def timing_notes(runner: str, by_batch: dict[str, Any]) -> list[str]:
    """Markdown lines for the timed runs of ``runner`` that compiled Triton kernels or preempted."""
    lines = []
    for b, summary in by_batch.items():
        steps = [r[key] for r in summary.get("repeats", []) for key in ("engine_steps_1", "engine_steps_n")
                 if key in r]
        compiled = [name for st in steps for name in st.get("triton_compiles") or []]
        preempted = sum(st["preemptions"] for st in steps)
        if compiled:
            lines.append(f"- {runner}, batch {b}: {len(compiled)} Triton kernel variants compiled while "
                         f"timed ({', '.join(sorted(set(compiled)))}): its times include compiling")
        if preempted:
            lines.append(f"- {runner}, batch {b}: {preempted} preemptions while timed: its times include "
                         "recomputing")
    return lines


# ------------------------------------------------------------------------------------------ transformers
def hf_speed(settings: SpeedSettings, model_dir: Path, prompts: dict[int, list[list[int]]],
             say: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same measurements through transformers' ``generate``, and how it ran; a batch size that runs
    out of GPU memory is recorded as ``{"error": ...}``."""
    import torch
    import transformers

    n = settings.decode_tokens
    model, device = lc.hf_model(settings, model_dir)
    if device == "cuda" and model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    info = {"transformers": transformers.__version__, "dtype": str(model.dtype).removeprefix("torch."),
            "attn_implementation": model.config._attn_implementation, "device": device}
    try:
        def generate(ids: torch.Tensor, new: int) -> float:
            with torch.inference_mode():
                seconds, full = _timed(lambda: model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                    min_new_tokens=new, pad_token_id=0))
            if full.shape[1] != ids.shape[1] + new:
                raise RuntimeError(f"transformers made {full.shape[1] - ids.shape[1]} tokens, not {new}")
            return seconds

        out: dict[int, dict[int, Any]] = {}
        for length, texts in sorted(prompts.items()):
            out[length] = {}
            for b in settings.timed_batch_sizes:
                ids = torch.tensor(texts[:b], device=device)
                try:
                    generate(ids, 2)  # warm-up
                    runs = [{"t_1_s": generate(ids, 1), "t_n_s": generate(ids, 1 + n)}
                            for _ in range(settings.repeats)]
                except torch.OutOfMemoryError as exc:
                    out[length][b] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
                    say(f"  {HF} {length} tokens batch {b}: out of memory")
                    lc.free_memory()
                    continue
                out[length][b] = summarize(runs, b, n)
                say(f"  {HF} {length} tokens batch {b}: {_line(out[length][b])}")
        return out, info
    finally:
        del model


# --------------------------------------------------------------------------------------------------- run
def run(settings: SpeedSettings, say: Callable[[str], None] = lambda line: None,
        checkpoint: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every runner of ``settings``; the results as one JSON-ready dict. Raises ``ValueError`` on an
    unknown selection before any model loads. ``checkpoint`` gets the results after every runner."""
    from nanovllm.bench import environment
    from nanovllm.engine.model_loading import load_tokenizer, resolve_model_path
    from nanovllm.quality.passkey import bos_ids

    phases = check_policies(settings.policies)
    model_dir = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(model_dir)
    config = lc.model_config(model_dir)
    bos = bos_ids(tokenizer)
    notes: list[str] = []
    text_file = settings.text_file
    if text_file is not None and not Path(text_file).is_file():
        notes.append(f"natural text {text_file} is absent: the prompts are the text this machine has")
        text_file = None
    text, source = lc.natural_text_ids(tokenizer, max(settings.lengths) - len(bos), text_file)
    batch = max(settings.timed_batch_sizes)
    prompts = {length: batch_prompts(bos, text, length, batch) for length in settings.lengths}
    say(f"model {model_dir}; prompts from {source}")
    runners = list(settings.policies) + ([HF] if settings.hf else [])
    result: dict[str, Any] = {
        "environment": environment(),
        "settings": {**attrs.asdict(settings), "model_dir": str(model_dir), "natural_text": source,
                     "bos_tokens": len(bos)},
        "runners": runners, "policy_phases": phases, "speed": {}, "phases": [], "notes": notes,
        "errors": {},
    }
    for runner in runners:
        say(f"[{runner}] start ({len(result['phases']) + 1}/{len(runners)})")
        start = time.perf_counter()
        try:
            if runner == HF:
                got, result["transformers"] = hf_speed(settings, model_dir, prompts, say)
            else:
                got = engine_speed(settings, runner, prompts, config, say)
            result["speed"][runner] = {str(k): {str(b): v for b, v in by.items()} for k, by in got.items()}
        except Exception as exc:  # a runner that fails must not end the run
            result["errors"][runner] = f"{type(exc).__name__}: {exc}"
            say(f"[{runner}] failed: {result['errors'][runner]}\n{traceback.format_exc(limit=6)}")
        seconds = time.perf_counter() - start
        ok = runner not in result["errors"]
        result["phases"].append({"name": runner, "seconds": round(seconds, 2), "ok": ok})
        lc.free_memory()
        say(f"[{runner}] done in {seconds:.1f} s")
        checkpoint(result)
    return result


# ------------------------------------------------------------------------------------------------ output
def target_of(result: dict[str, Any], runner: str, length: str) -> str:
    """The target that applies to ``runner`` and whether this run meets it (``""`` when none applies)."""
    speed = result["speed"]
    mine = speed.get(runner, {}).get(length, {})
    if runner == DENSE:
        hf = speed.get(HF, {}).get(length, {}).get("1", {})
        if "decode_tok_s" not in mine.get("1", {}) or "decode_tok_s" not in hf:
            return f"B1 >= {DENSE_DECODE_VS_HF:g}x {HF}: not measured"
        ratio = mine["1"]["decode_tok_s"] / hf["decode_tok_s"]
        return f"B1 >= {DENSE_DECODE_VS_HF:g}x {HF}: {'met' if ratio >= DENSE_DECODE_VS_HF else 'MISSED'}"
    if result["policy_phases"].get(runner, {}).get("prefill") in SPARSE_PREFILL:
        dense = speed.get(DENSE, {}).get(length, {}).get("1", {})
        if "ttft_ms" not in mine.get("1", {}) or "ttft_ms" not in dense:
            return f"TTFT <= {DENSE}: not measured"
        return f"TTFT <= {DENSE}: {'met' if mine['1']['ttft_ms'] <= dense['ttft_ms'] else 'MISSED'}"
    return ""


def markdown(result: dict[str, Any], title: str) -> str:
    from nanovllm.bench import markdown_row

    env, s = result["environment"], result["settings"]
    batches = [str(b) for b in s["batch_sizes"]]
    metrics = [("TTFT", "1", "ttft_ms")] + [(f"B{b}", b, "decode_tok_s") for b in batches]
    lines = [f"# {title}", "",
             f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Model {s['model']}, dtype {s['dtype'] or 'default'}, "
             f"prefill chunk {s['max_num_batched_tokens']}, "
             f"{s['decode_tokens']} decode tokens, median of {s['repeats']} repeats; natural text: "
             f"{s['natural_text']}.",
             "TTFT in ms (lower is better); Bn tok/s: decode tokens/s at batch n from the wall time the "
             "decode tokens add; Bn steps tok/s: the engine's decode steps alone, after every prompt is "
             "prefilled (higher is better); x / y: the ratio of the two. "
             f"Targets are set at {TARGET_LENGTH} tokens: "
             f"{' and '.join(SPARSE_PREFILL)} TTFT no slower than {DENSE}; {DENSE} B1 at least "
             f"{DENSE_DECODE_VS_HF:g}x {HF}'.", ""]
    if "transformers" in result:
        t = result["transformers"]
        lines += [f"{HF} {t['transformers']}, {t['dtype']}, attention {t['attn_implementation']}.", ""]
    refs = [r for r in (DENSE, HF) if r in result["runners"]]
    header = ["runner", "TTFT ms", *(f"B{b} tok/s" for b in batches), *(f"B{b} steps tok/s" for b in batches)]
    header += [f"{m} / {ref}" for ref in refs for m, _, _ in metrics] + ["target"]
    for length in map(str, s["lengths"]):
        lines += [f"## {length} tokens", "", markdown_row(header), markdown_row(["---"] * len(header))]
        below = []  # batch sizes a runner could not run (transformers out of memory), timed runs that
        # compiled kernels or preempted
        for runner in result["runners"]:
            by = result["speed"].get(runner, {}).get(length)
            if by is None:
                lines.append(markdown_row([runner, f"failed: {result['errors'].get(runner, 'not run')}",
                                           *[""] * (len(header) - 2)]))
                continue
            values = [by.get(b, {}).get(key) for _, b, key in metrics]
            alone = [by.get(b, {}).get("engine_decode_tok_s") for b in batches]
            cells = [runner, *map(_cell, values), *map(_cell, alone)]
            for ref in refs:
                ref_by = result["speed"].get(ref, {}).get(length, {})
                for (_, b, key), v in zip(metrics, values, strict=True):
                    r = ref_by.get(b, {}).get(key)
                    cells.append(_cell(v / r if v is not None and r else None, ratio=True))
            lines.append(markdown_row([*cells, target_of(result, runner, length)]))
            below += [f"- {runner}, batch {b}: {v['error']}" for b, v in by.items() if "error" in v]
            below += timing_notes(runner, by)
        lines += ["", *below, ""] if below else [""]
    return "\n".join(lines + lc.run_log(result, "runner")) + "\n"


def _cell(v: float | None, ratio: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if ratio else f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def plot(result: dict[str, Any], path: Path) -> bool:
    """A panel per measure (TTFT, decode tokens/s per batch size), a bar per runner and length; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = result["settings"]
    lengths = [str(n) for n in s["lengths"]]
    runners = [r for r in result["runners"] if r in result["speed"]]
    panels = [("TTFT (ms)", "1", "ttft_ms")] + [(f"decode tok/s, batch {b}", str(b), "decode_tok_s")
                                                for b in s["batch_sizes"]]
    if not runners:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.5 * len(runners) * len(lengths) + 2),
                             squeeze=False)
    height = 0.8 / len(lengths)
    for ax, (title, b, key) in zip(axes[0], panels, strict=True):
        for j, length in enumerate(lengths):
            values = [result["speed"][r].get(length, {}).get(b, {}).get(key, 0) for r in runners]
            ax.barh([i + j * height for i in range(len(runners))], values, height=height,
                    label=f"{length} tokens")
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(runners))], runners, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        if len(lengths) > 1:
            ax.legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(f"{s['model']} - {env['device']} - {env['date']} - {env['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> FlexibleArgumentParser:
    p = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m", help="model directory, hub ID or packaged name")
    p.add_argument("--lengths", type=_ints, default=[TARGET_LENGTH],
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8], help="decode batch sizes, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=128, help="N: decode tokens timed per request")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats of each measurement (the median counts)")
    p.add_argument("--policies", type=lc.parse_policies, default=lc.parse_policies(DEFAULT_POLICIES),
                   help="';'-separated selections; a prefill+decode pair is written 'xattn+quest'")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="engine and transformers dtype (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's prefill chunk")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--text-file", default=str(DEFAULT_TEXT), help="natural text the prompts are cut from")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engines' kv_cache_dtype (e.g. fp8)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="long_context_speed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = SpeedSettings(
            model=args.model, lengths=args.lengths, policies=args.policies, batch_sizes=args.batch_sizes,
            decode_tokens=args.decode_tokens, repeats=args.repeats, device=args.device, dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens, hf=args.hf, text_file=args.text_file,
            kv_cache_dtype=args.kv_cache_dtype)
        check_policies(settings.policies)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"{args.name}.json"

    def say(line: str) -> None:
        print(f"{dt.datetime.now(dt.UTC):%H:%M:%S} {line}", file=sys.stderr, flush=True)

    def checkpoint(result: dict) -> None:  # what a run stopped early measured, rewritten after each runner
        partial.write_text(json.dumps({**result, "partial": True}, indent=1, default=str) + "\n")

    result = run(settings, say=say, checkpoint=checkpoint)
    result["seconds"] = round(time.perf_counter() - start, 1)
    paths = lc.write_results(result, args.out, args.name, markdown_of=markdown, plot_to=plot,
                             title="Long-context speed")
    print(paths[1].read_text())
    say(f"wrote {', '.join(map(str, paths))} in {result['seconds']} s")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
