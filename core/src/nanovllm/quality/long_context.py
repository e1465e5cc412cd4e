"""Long-context quality of any model under any policy selections, next to dense and transformers.

Three tasks, each run through the public engine once per selection and (unless ``hf=False``) through
transformers' ``AutoModelForCausalLM`` (eager attention) on the same model directory and the same token ids:

- ``passkey``: the pass-key test (:mod:`nanovllm.quality.passkey`), classic and natural fillers, every
  trial of one length in one ``generate`` call; greedy, exact match; trial-by-trial records.
- ``perplexity``: the perplexity of the last ``tail_tokens`` of a natural text given ``length`` tokens
  in all (BOS, then the text's tokens ending where the longest length ends, so the scored window is the
  same at every length); the engine's comes from ``prompt_logprobs``
  (:func:`nanovllm.quality.perplexity.engine_tail_nll`), a decode policy scoring the window token by token.
- ``attention``: on the full-attention layers only (``layer_types`` of config.json; every layer when it
  has none), at the longest length, the last ``attention_queries`` rows of the natural text: each decode
  selection (:func:`nanovllm.quality.evaluate.evaluate_policy`) against the oracle at its own budget,
  GQA-shared (the engine's form) and per query head (every query head given its own copy of its KV head).

A selection that raises is recorded with its error; the others go on. Every phase is timed.
"""

from __future__ import annotations

import gc
import json
import math
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from nanovllm.quality import passkey as pk
from nanovllm.utils import JobClock, progress_bar

TASKS = ("passkey", "perplexity", "attention")
HF = "transformers"
DENSE = "full"


@attrs.define
class LongContextSettings:
    """What to run. Lengths are prompt lengths in tokens; ``text_file`` is the natural text (the
    natural filler and the perplexity/attention text); when absent, the natural filler is left out
    and the other tasks read the text this machine has (:mod:`nanovllm.quality.corpus`)."""

    model: str | None
    lengths: list[int] = attrs.field(factory=lambda: [2048, 4096, 8192, 16384, 32768])
    policies: list[str] = attrs.field(factory=lambda: [DENSE])
    tasks: list[str] = attrs.field(factory=lambda: list(TASKS))
    depths: list[float] = attrs.field(factory=lambda: list(pk.DEFAULT_DEPTHS))
    trials_per_depth: int = 2
    device: str = "auto"
    dtype: str | None = None  # the engine's default when None; transformers then takes float32 on the CPU
    hf: bool = True
    text_file: str | None = None
    tail_tokens: int = 512
    answer_tokens: int = 10
    attention_queries: int = 64
    prefill_chunk: int = 8192
    seed: int = 0
    kv_cache_dtype: str = "auto"  # the engines' KV cache element type (EngineConfig.kv_cache_dtype)

    def __attrs_post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; choose from {', '.join(TASKS)}")
        if not self.lengths or min(self.lengths) < 64:
            raise ValueError(f"lengths must be at least 64 tokens each, got {self.lengths}")
        if self.trials_per_depth < 1:
            raise ValueError(f"trials_per_depth must be positive, got {self.trials_per_depth}")
        if "perplexity" in self.tasks and self.tail_tokens >= min(self.lengths) - 1:
            raise ValueError(f"tail_tokens={self.tail_tokens} must be shorter than the shortest length "
                             f"{min(self.lengths)}; lower tail_tokens")


def parse_policies(text: str) -> list[str]:
    """``"full;quest:token_budget=2048;xattn"`` -> one selection per ``;``-separated item. A pair of a
    prefill and a decode policy is written with ``+``: ``"xattn+quest"``."""
    items = [item.strip() for item in text.split(";") if item.strip()]
    if not items:
        raise ValueError("give at least one selection, for example --policies 'full;quest'")
    return items


def selection_of(policy: str) -> str:
    """The engine's ``sparse_policy`` string of one item of :func:`parse_policies` (``+`` -> ``;``)."""
    return policy.replace("+", ";")


class Run:
    """One run's results, built up phase by phase."""

    def __init__(self, settings: LongContextSettings, say: Callable[[str], None] | None = None) -> None:
        runners = len(settings.policies) + settings.hf
        tasks = settings.tasks
        total = runners * (("passkey" in tasks) + ("perplexity" in tasks))
        total += (1 + len(settings.policies)) * ("attention" in tasks)
        self.clock = JobClock(total)
        self.phases: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.errors: dict[str, str] = {}
        self._say = say or (lambda line: None)
        self.on_phase_end: Callable[[], None] = lambda: None

    def note(self, line: str) -> None:
        self.notes.append(line)
        self._say(line)

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as phase ``name``: timed; an exception is recorded under ``name`` (``None`` back)."""
        start = time.perf_counter()
        self._say(f"[{name}] start {self.clock.status()}")
        try:
            return fn()
        except Exception as exc:  # a selection that fails must not end the run
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            self._say(f"[{name}] failed: {self.errors[name]}\n{traceback.format_exc(limit=6)}")
            return None
        finally:
            seconds = time.perf_counter() - start
            self.phases.append({"name": name, "seconds": round(seconds, 2), "ok": name not in self.errors})
            free_memory()
            self._say(f"[{name}] {seconds:.1f} s")
            self.on_phase_end()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- inputs
def model_config(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def full_attention_layers(config: dict[str, Any]) -> list[int]:
    """Layers whose ``layer_types`` entry is ``full_attention`` (every layer when there is no such list)."""
    types = config.get("layer_types")
    if not types:
        return list(range(config["num_hidden_layers"]))
    return [i for i, kind in enumerate(types) if kind == "full_attention"]


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * heads * head_dim * 2 * dtype_bytes


def natural_text_ids(tokenizer: Any, num_tokens: int, text_file: str | None) -> tuple[list[int], str]:
    """``num_tokens`` tokens of natural text without BOS, and where they came from."""
    from nanovllm.quality.corpus import corpus_tokens, joined_corpus_tokens

    class Plain:  # corpus helpers call encode(text): here without special tokens
        @staticmethod
        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

    if text_file is not None and Path(text_file).is_file():
        ids, text = corpus_tokens(Plain, num_tokens, text_file=text_file)
        return ids, text.source
    ids, texts = joined_corpus_tokens(Plain, num_tokens)
    return ids, "; ".join(t.source for t in texts)


def perplexity_inputs(tokenizer: Any, lengths: Sequence[int], text: list[int]) -> dict[int, list[int]]:
    """Per length: BOS (when the tokenizer adds one), then the text's tokens that end where the longest
    length's end, ``length`` tokens in all."""
    bos = pk.bos_ids(tokenizer)
    end = max(lengths) - len(bos)
    return {length: bos + text[end - (length - len(bos)) : end] for length in lengths}


# -------------------------------------------------------------------------------------------- engines
def engine_options(settings: LongContextSettings, config: dict[str, Any],
                   max_model_len: int) -> dict[str, Any]:
    """Options of every engine of the run. A ``max_model_len`` past the model's
    ``max_position_embeddings`` (a prompt of exactly that many tokens, then its answer) raises that limit
    through ``hf_overrides``, as transformers runs such positions (RoPE has no upper bound)."""
    options: dict[str, Any] = {"device": settings.device, "enable_prefix_caching": False,
                               "max_model_len": max_model_len, "kv_cache_dtype": settings.kv_cache_dtype}
    if settings.dtype:
        options["dtype"] = settings.dtype
    if max_model_len > config.get("max_position_embeddings", max_model_len):
        options["hf_overrides"] = {"max_position_embeddings": max_model_len}
    return options


def engine_passkey(settings: LongContextSettings, policy: str, prompts: list[pk.PassKeyPrompt],
                   config: dict[str, Any], tokenizer: Any) -> list[str]:
    """Greedy answers of the engine under ``policy``, one per prompt; every prompt of a length in one
    ``generate`` call."""
    import torch

    from nanovllm import LLM, SamplingParams

    longest = max(p.length for p in prompts)
    per_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        per_length.setdefault(p.length, []).append(i)
    batch = max(len(v) for v in per_length.values())
    dtype_bytes = torch.finfo(getattr(torch, settings.dtype)).bits // 8 if settings.dtype else 4
    tokens = batch * (longest + max(64, settings.answer_tokens) + 16)
    cache = int(kv_bytes_per_token(config, dtype_bytes) * tokens * 1.1)
    # as transformers is run: greedy, never stopped early by EOS
    params = SamplingParams(temperature=0.0, max_tokens=settings.answer_tokens, ignore_eos=True)
    answers = [""] * len(prompts)
    llm = LLM(settings.model, sparse_policy=selection_of(policy),
              max_num_batched_tokens=settings.prefill_chunk, max_num_seqs=batch, kv_cache_memory=cache,
              **engine_options(settings, config, longest + max(64, settings.answer_tokens)))
    try:
        with progress_bar(len(prompts), f"pass key {policy}", "trial", enabled=True) as bar:
            for _length, indices in sorted(per_length.items()):
                outs = llm.generate([{"prompt_token_ids": prompts[i].token_ids} for i in indices], params,
                                    use_tqdm=False)
                for i, out in zip(indices, outs, strict=True):
                    answers[i] = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
                bar.update(len(indices))
    finally:
        llm.close()
        del llm
    return answers


def engine_perplexity(settings: LongContextSettings, policy: str, inputs: dict[int, list[int]],
                      config: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per length: perplexity of the last ``tail_tokens`` and the selections' densities."""
    from nanovllm import LLM
    from nanovllm.quality.perplexity import DensityMeter, engine_tail_nll

    meter = DensityMeter()
    chunk = settings.prefill_chunk
    llm = LLM(settings.model, sparse_policy=selection_of(policy), max_num_batched_tokens=chunk,
              max_num_seqs=1, observers=[meter], **engine_options(settings, config, max(inputs) + 1))
    try:
        tail_step = 1 if llm.policy_plan.decode.selection.name != "full" else chunk
        out = {}
        for length, ids in sorted(inputs.items()):
            meter.reset()  # densities of this length alone
            nll = engine_tail_nll(llm, ids, settings.tail_tokens, chunk, tail_step)
            out[length] = {"perplexity": math.exp(nll), "mean_nll": nll, "tail_step": tail_step,
                           "decode_density": meter.density("decode"),
                           "prefill_density": meter.density("prefill")}
        return out
    finally:
        llm.close()
        del llm


# ------------------------------------------------------------------------------------------ transformers
HF_ATTENTION = "eager"  # the transformers attention the reference runs


def hf_model(settings: LongContextSettings, model_dir: Path):
    import torch
    import transformers

    cuda = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, settings.dtype) if settings.dtype else (torch.bfloat16 if device == "cuda"
                                                                    else torch.float32)
    # eager attention: transformers' default SDPA path on CUDA gives Gemma 3 another next-token distribution
    # from about 8K tokens on than its eager path, SDPA's math backend and the CPU do (float32 included)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=HF_ATTENTION).to(device).eval()
    model.generation_config.eos_token_id = None  # as many tokens as the engine's answer
    return model, device


def hf_batch(length: int, heads: int) -> int:
    """Prompts of one transformers call: eager attention's scores and their float32 softmax (``batch x heads
    x length^2`` elements, at most about 12 bytes each) stay near 16 GiB."""
    return max(1, (16 << 30) // (12 * heads * length * length))


def hf_passkey(settings: LongContextSettings, model_dir: Path, prompts: list[pk.PassKeyPrompt],
               tokenizer: Any) -> list[str]:
    import torch

    model, device = hf_model(settings, model_dir)
    answers = [""] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].length)
    try:
        bar = progress_bar(len(prompts), "pass key transformers", "trial", enabled=True)
        with bar, torch.no_grad():
            start = 0
            while start < len(order):
                length = prompts[order[start]].length
                batch = hf_batch(length, model.config.num_attention_heads)
                group = [i for i in order[start:] if prompts[i].length == length][:batch]
                ids = torch.tensor([prompts[i].token_ids for i in group], device=device)
                full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=settings.answer_tokens, pad_token_id=0)
                for i, row in zip(group, full[:, ids.shape[1]:].tolist(), strict=True):
                    answers[i] = tokenizer.decode(row, skip_special_tokens=True)
                start += len(group)
                bar.update(len(group))
    finally:
        del model
    return answers


def hf_perplexity(settings: LongContextSettings, model_dir: Path,
                  inputs: dict[int, list[int]]) -> dict[int, dict[str, Any]]:
    import torch

    model, device = hf_model(settings, model_dir)
    tail = settings.tail_tokens
    out = {}
    try:
        with torch.no_grad():
            for length, ids in sorted(inputs.items()):
                x = torch.tensor([ids], device=device)
                logits = model(x, logits_to_keep=tail + 1).logits[0, :-1].float().log_softmax(-1)
                nll = -logits.gather(1, x[0, -tail:, None]).mean().item()
                out[length] = {"perplexity": math.exp(nll), "mean_nll": nll}
    finally:
        del model
    return out


# --------------------------------------------------------------------------------------------- attention
def per_query_head(capture):
    """The capture with every query head given its own copy of its KV head (a group of one), so a
    policy's per-KV-head selection and the oracle become per query head."""
    from nanovllm.quality.capture import Capture, LayerActivations

    layers = []
    for layer in capture.layers:
        group = layer.q.shape[1] // layer.k.shape[1]
        layers.append(LayerActivations(layer.layer_id, layer.q, layer.k.repeat_interleave(group, 1),
                                       layer.v.repeat_interleave(group, 1), layer.scale))
    return Capture(capture.token_ids, layers, capture.num_layers, capture.block_size, capture.dtype,
                   capture.device, capture.backend)


def capture_full_layers(settings: LongContextSettings, ids: list[int], layers: list[int],
                        config: dict[str, Any]):
    from nanovllm import LLM
    from nanovllm.quality.capture import capture_activations

    llm = LLM(settings.model, sparse_policy=DENSE, async_scheduling=False, max_num_seqs=1, enforce_eager=True,
              max_num_batched_tokens=settings.prefill_chunk, **engine_options(settings, config, len(ids) + 1))
    try:
        return capture_activations(llm, ids, layers)
    finally:
        llm.close()
        del llm


def summarize_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over layers and heads, the gap to the oracle, and the worst head's share of the oracle."""
    heads = [pair for layer in layers for pair in zip(
        layer["per_head"]["policy"]["mass_recall"], layer["per_head"]["oracle"]["mass_recall"], strict=True)]
    policy = sum(p for p, _ in heads) / len(heads)
    oracle = sum(o for _, o in heads) / len(heads)
    return {
        "mass_recall": policy, "oracle_mass_recall": oracle, "gap": oracle - policy,
        "worst_head_mass_recall": min(p for p, _ in heads),
        "worst_head_share_of_oracle": min(p / o if o > 0 else 1.0 for p, o in heads),
        "density": sum(layer["policy"]["density"] for layer in layers) / len(layers),
    }


def attention_metrics(settings: LongContextSettings, policy: str, capture) -> dict[str, Any]:
    """GQA-shared and per-query-head metrics of ``policy``'s decode selection on the capture's layers."""
    from nanovllm.quality.evaluate import evaluate_policy
    from nanovllm.selection import resolve_policies

    if resolve_policies(selection_of(policy)).decode.selection.name == DENSE:
        return {"skipped": "no decode selection: the attention metrics measure decode queries (dense is the "
                           "reference)"}
    positions = list(range(capture.num_tokens - settings.attention_queries, capture.num_tokens))
    out = {}
    for form, cap in (("gqa_shared", capture), ("per_head", per_query_head(capture))):
        layers = evaluate_policy(selection_of(policy), cap, positions, seed=settings.seed, per_head=True)
        out[form] = {"summary": summarize_layers(layers), "layers": layers}
    return out


# --------------------------------------------------------------------------------------------------- run
def run(settings: LongContextSettings, say: Callable[[str], None] | None = None,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every task of ``settings``; the results as one JSON-ready dict (see :func:`write_results`).
    ``say`` gets progress lines; ``checkpoint`` gets the results so far after every phase (so a run
    stopped early leaves what it measured)."""
    from nanovllm.bench import environment
    from nanovllm.engine.model_loading import load_tokenizer, resolve_model_path

    run_ = Run(settings, say)
    model_dir = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(model_dir)
    config = model_config(model_dir)
    longest = max(settings.lengths)
    text_file = settings.text_file
    if text_file is not None and not Path(text_file).is_file():
        run_.note(f"natural text {text_file} is absent: no natural filler; perplexity and attention read "
                  "the text this machine has")
        text_file = None
    natural, source = natural_text_ids(tokenizer, longest, text_file)
    runners = list(settings.policies) + ([HF] if settings.hf else [])
    result: dict[str, Any] = {
        "environment": environment(),
        "settings": {**attrs.asdict(settings), "model_dir": str(model_dir), "natural_text": source,
                     "hf_attention": HF_ATTENTION},
        "runners": runners, "phases": run_.phases, "notes": run_.notes, "errors": run_.errors,
    }
    if checkpoint is not None:
        run_.on_phase_end = lambda: checkpoint(result)

    if "passkey" in settings.tasks:
        fillers = {"classic": pk.classic_filler_ids(tokenizer, longest)}
        if text_file is not None:
            fillers["natural"] = natural
        prompts = pk.build_prompts(tokenizer, fillers, settings.lengths, settings.depths,
                                   settings.trials_per_depth, settings.seed)
        trials = [{**p.describe(), "answers": {}, "hits": {}} for p in prompts]
        result["passkey"] = passkey = {"trials": trials, "accuracy": {}, "differences": {}}
        for runner in runners:
            if runner == HF:
                answers = run_.phase(f"passkey {HF}",
                                     lambda: hf_passkey(settings, model_dir, prompts, tokenizer))
            else:
                answers = run_.phase(f"passkey {runner}", lambda r=runner: engine_passkey(
                    settings, r, prompts, config, tokenizer))
            if answers is None:
                continue
            for trial, answer in zip(trials, answers, strict=True):
                trial["answers"][runner] = answer
                trial["hits"][runner] = pk.is_hit(answer, trial["key"])
            passkey["accuracy"] = passkey_accuracy(trials, runners)
            passkey["differences"] = passkey_differences(trials, runners)

    if "perplexity" in settings.tasks or "attention" in settings.tasks:
        inputs = perplexity_inputs(tokenizer, settings.lengths, natural)
    if "perplexity" in settings.tasks:
        result["perplexity"] = ppl = {}
        for runner in runners:
            if runner == HF:
                got = run_.phase(f"perplexity {HF}", lambda: hf_perplexity(settings, model_dir, inputs))
            else:
                got = run_.phase(f"perplexity {runner}",
                                 lambda r=runner: engine_perplexity(settings, r, inputs, config))
            if got is not None:
                ppl[runner] = {str(length): v for length, v in got.items()}

    if "attention" in settings.tasks:
        layers = full_attention_layers(config)
        capture = run_.phase("attention capture",
                             lambda: capture_full_layers(settings, inputs[longest], layers, config))
        result["attention"] = metrics = {"layers": layers, "length": longest,
                                         "queries": settings.attention_queries}
        if capture is not None:
            for policy in settings.policies:
                got = run_.phase(f"attention {policy}",
                                 lambda p=policy: attention_metrics(settings, p, capture))
                metrics[policy] = got if got is not None else {"error": run_.errors[f"attention {policy}"]}
            del capture
    return result


def passkey_accuracy(trials: list[dict[str, Any]], runners: list[str]) -> dict[str, Any]:
    """``{runner: {filler: {length: [hits, trials]}}}`` over the trials the runner answered."""
    out = {}
    for runner in runners:
        answered = [{**t, "hit": t["hits"][runner]} for t in trials if runner in t["hits"]]
        if answered:
            out[runner] = {f: {str(k): v for k, v in by_len.items()}
                           for f, by_len in pk.accuracy_table(answered).items()}
    return out


def passkey_differences(trials: list[dict[str, Any]], runners: list[str]) -> dict[str, Any]:
    """Per runner, the trials whose hit differs from dense's and from transformers' (indices of trials)."""
    out: dict[str, Any] = {}
    for runner in runners:
        for ref in (DENSE, HF):
            if ref == runner or ref not in runners:
                continue
            both = [i for i, t in enumerate(trials) if runner in t["hits"] and ref in t["hits"]]
            if both:
                hits = [(trials[i]["hits"][runner], trials[i]["hits"][ref]) for i in both]
                out[f"{runner} vs {ref}"] = [i for i, (a, b) in zip(both, hits, strict=True) if a != b]
    return out


# ------------------------------------------------------------------------------------------------ output
def _cell(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def run_log(result: dict[str, Any], label: str) -> list[str]:
    """Markdown lines of a run's phases (``label`` heads their column), errors and notes."""
    from nanovllm.bench import markdown_row

    lines = ["## Phases", "", markdown_row([label, "seconds", "ok"]), markdown_row(["---"] * 3)]
    lines += [markdown_row([p["name"], p["seconds"], p["ok"]]) for p in result["phases"]]
    lines += [f"\n- error in {name}: {error}" for name, error in result["errors"].items()]
    return lines + [f"\n- {note}" for note in result["notes"]]


def markdown(result: dict[str, Any], title: str) -> str:
    from nanovllm.bench import markdown_row

    env, s = result["environment"], result["settings"]
    lengths = [str(n) for n in s["lengths"]]
    lines = [f"# {title}", "",
             f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             f"Model {s['model']}, dtype {s['dtype'] or 'default'}, natural text: {s['natural_text']}."
             + (f" transformers with {s['hf_attention']} attention." if s.get("hf") and "hf_attention" in s else ""),
             ""]
    if "passkey" in result:
        n = len(s["depths"]) * s["trials_per_depth"]
        for filler in ("classic", "natural"):
            rows = {r: acc[filler] for r, acc in result["passkey"]["accuracy"].items() if filler in acc}
            if not rows:
                continue
            lines += [f"## Pass key, {filler} filler (hits of {n} per length)", "",
                      markdown_row(["runner", *lengths]), markdown_row(["---"] * (len(lengths) + 1))]
            lines += [markdown_row([r, *(by.get(k, ["-"])[0] for k in lengths)]) for r, by in rows.items()]
            lines.append("")
        diffs = result["passkey"]["differences"]
        if diffs:
            lines += ["Trials that differ (filler, length, depth, trial):", ""]
            for pair, idx in diffs.items():
                trials = result["passkey"]["trials"]
                where = ", ".join(f"{trials[i]['filler']} {trials[i]['length']} {trials[i]['depth']} "
                                  f"#{trials[i]['trial']}" for i in idx)
                lines.append(f"- {pair}: {len(idx)}" + (f" ({where})" if idx else ""))
            lines.append("")
    if result.get("perplexity"):
        lines += [f"## Perplexity of the last {s['tail_tokens']} tokens", "",
                  markdown_row(["runner", *lengths]), markdown_row(["---"] * (len(lengths) + 1))]
        for r, by in result["perplexity"].items():
            cells = (_cell(by[k]["perplexity"]) if k in by else "-" for k in lengths)
            lines.append(markdown_row([r, *cells]))
        lines.append("")
    att = result.get("attention")
    if att:
        lines += [f"## Attention, layers {att['layers']}, {att['length']} tokens, "
                  f"last {att['queries']} queries",
                  "", markdown_row(["policy", "form", "mass recall", "oracle", "gap", "worst head",
                                    "worst / oracle", "density"]), markdown_row(["---"] * 8)]
        for policy, m in att.items():
            if not isinstance(m, dict):
                continue
            if "skipped" in m or "error" in m:
                lines.append(markdown_row([policy, m.get("skipped") or f"error: {m['error']}", *[""] * 6]))
                continue
            for form in ("per_head", "gqa_shared"):
                x = m[form]["summary"]
                lines.append(markdown_row([policy, form, *map(_cell, (
                    x["mass_recall"], x["oracle_mass_recall"], x["gap"], x["worst_head_mass_recall"],
                    x["worst_head_share_of_oracle"], x["density"]))]))
        lines.append("")
    return "\n".join(lines + run_log(result, "phase")) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """Accuracy (per filler) and perplexity against length, a line per runner; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = []
    if "passkey" in result:
        for filler in ("classic", "natural"):
            series = {r: acc[filler] for r, acc in result["passkey"]["accuracy"].items() if filler in acc}
            if series:
                panels.append((f"pass key, {filler} filler", "accuracy",
                               {r: {int(k): h / n for k, (h, n) in by.items()} for r, by in series.items()}))
    if result.get("perplexity"):
        panels.append(("perplexity of the final window", "perplexity",
                       {r: {int(k): v["perplexity"] for k, v in by.items()}
                        for r, by in result["perplexity"].items()}))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, ylabel, series) in zip(axes[0], panels, strict=True):
        for runner, points in series.items():
            xs = sorted(points)
            style = {"linestyle": "--", "color": "black"} if runner == HF else {}
            ax.plot(xs, [points[x] for x in xs], marker="o", label=runner, **style)
        ax.set_xscale("log", base=2)
        lengths = sorted({x for points in series.values() for x in points})
        ax.set_xticks(lengths, [str(x) for x in lengths])
        if ylabel == "accuracy":
            ax.set_ylim(-0.03, 1.03)
        ax.set_title(title)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    env = result["environment"]
    model = result["settings"]["model"]
    fig.suptitle(f"{model} - {env['device']} - {env['date']} - {env['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(result: dict[str, Any], out_dir: Path, name: str,
                  markdown_of: Callable[[dict[str, Any], str], str] = markdown,
                  plot_to: Callable[[dict[str, Any], Path], bool] = plot,
                  title: str = "Long-context quality") -> list[Path]:
    """Writes ``<out_dir>/<name>.json``, ``.md`` and (with matplotlib) ``.png``; returns the paths written.
    ``markdown_of`` and ``plot_to`` render another kind of results (the speed benchmark's) the same way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    if plot_to(result, out_dir / f"{name}.png"):
        paths.append(out_dir / f"{name}.png")
    else:
        result["notes"].append("matplotlib is not installed (or nothing to draw): no plot")
    paths[0].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths[1].write_text(markdown_of(result, f"{title}: {name}"))
    return paths
