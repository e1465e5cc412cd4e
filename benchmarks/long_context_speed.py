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
  run back to back). The engine's own request metrics
  (``RequestOutput.metrics``) of every run are recorded beside the wall times, and at batch 1 the TTFT
  and decode tokens/s they give (``engine_ttft_ms``, ``engine_decode_tok_s``: the decode steps alone).
- transformers: the same token ids through ``AutoModelForCausalLM.generate`` (greedy, ``min_new_tokens``
  = ``max_new_tokens``, the model's dtype as the engine's, bfloat16 on CUDA by default); a batch size that
  runs out of memory is recorded as such.

Prompts are natural text (``--text-file``): prompt ``i`` of a batch is the text rotated by ``i`` times
``1/max batch`` of its length, cut to the prompt length after the tokenizer's BOS, so the prompts differ
while drawing on one text. Every runner is warmed up (one ``generate`` per batch size, two output
tokens) before it is timed. The engines run without prefix caching, so every repeat prefills in full.

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
from collections.abc import Callable
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
    """Per repeat, the decode tokens/s of one pair of runs; their median; at batch 1 the median TTFT, and
    the same two from the engine's request metrics where the runs have them."""
    for run in runs:
        run["decode_tok_s"] = batch * decode_tokens / (run["t_n_s"] - run["t_1_s"])
    out = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs), "repeats": runs}
    if batch == 1:
        out["ttft_ms"] = 1000 * statistics.median(r["t_1_s"] for r in runs)
        timed = [r for r in runs if r.get("engine_metrics_1") and r.get("engine_metrics_n")]
        if timed:  # the engine's own clock: its first token, and the decode steps alone
            firsts = [r["engine_metrics_1"]["first_token_s"] for r in timed]
            spans = [m["last_token_s"] - m["first_token_s"] for m in (r["engine_metrics_n"] for r in timed)]
            out["engine_ttft_ms"] = 1000 * statistics.median(firsts)
            out["engine_decode_tok_s"] = statistics.median(decode_tokens / span for span in spans)
    return out


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
    try:
        def generate(ids: list[list[int]], max_tokens: int) -> tuple[float, dict[str, float]]:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            seconds, outs = _timed(lambda: llm.generate([{"prompt_token_ids": p} for p in ids], params,
                                                        use_tqdm=False))
            got = {len(o.outputs[0].token_ids) for o in outs}
            if got != {max_tokens}:
                raise RuntimeError(f"asked for {max_tokens} tokens per request, got {sorted(got)}")
            return seconds, request_metrics(outs)

        out: dict[int, dict[int, Any]] = {}
        for length, texts in sorted(prompts.items()):
            out[length] = {}
            for b in settings.timed_batch_sizes:
                generate(texts[:b], 2)  # warm-up: kernels compiled and tuned for these shapes
                runs = []
                for _ in range(settings.repeats):
                    (t_1, metrics_1), (t_n, metrics_n) = generate(texts[:b], 1), generate(texts[:b], 1 + n)
                    runs.append({"t_1_s": t_1, "t_n_s": t_n, "engine_metrics_1": metrics_1,
                                 "engine_metrics_n": metrics_n})
                out[length][b] = summarize(runs, b, n)
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
    return f"{ttft}decode {summary['decode_tok_s']:.1f} tok/s"


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
             "TTFT in ms (lower is better); Bn: decode tokens/s at batch n (higher is better); x / y: the "
             f"ratio of the two. Targets are set at {TARGET_LENGTH} tokens: "
             f"{' and '.join(SPARSE_PREFILL)} TTFT no slower than {DENSE}; {DENSE} B1 at least "
             f"{DENSE_DECODE_VS_HF:g}x {HF}'.", ""]
    if "transformers" in result:
        t = result["transformers"]
        lines += [f"{HF} {t['transformers']}, {t['dtype']}, attention {t['attn_implementation']}.", ""]
    refs = [r for r in (DENSE, HF) if r in result["runners"]]
    header = ["runner", "TTFT ms", *(f"B{b} tok/s" for b in batches)]
    header += [f"{m} / {ref}" for ref in refs for m, _, _ in metrics] + ["target"]
    for length in map(str, s["lengths"]):
        lines += [f"## {length} tokens", "", markdown_row(header), markdown_row(["---"] * len(header))]
        failed = []  # batch sizes a runner could not run (transformers out of memory), below the table
        for runner in result["runners"]:
            by = result["speed"].get(runner, {}).get(length)
            if by is None:
                lines.append(markdown_row([runner, f"failed: {result['errors'].get(runner, 'not run')}",
                                           *[""] * (len(header) - 2)]))
                continue
            values = [by.get(b, {}).get(key) for _, b, key in metrics]
            cells = [runner, *map(_cell, values)]
            for ref in refs:
                ref_by = result["speed"].get(ref, {}).get(length, {})
                for (_, b, key), v in zip(metrics, values, strict=True):
                    r = ref_by.get(b, {}).get(key)
                    cells.append(_cell(v / r if v is not None and r else None, ratio=True))
            lines.append(markdown_row([*cells, target_of(result, runner, length)]))
            failed += [f"- {runner}, batch {b}: {v['error']}" for b, v in by.items() if "error" in v]
        lines += ["", *failed, ""] if failed else [""]
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
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="long_context_speed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = SpeedSettings(
            model=args.model, lengths=args.lengths, policies=args.policies, batch_sizes=args.batch_sizes,
            decode_tokens=args.decode_tokens, repeats=args.repeats, device=args.device, dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens, hf=args.hf, text_file=args.text_file)
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
