"""``nanovllm bench quality``: attention quality of sparse policies on a real model and a real text.

The built-in SmolLM2-135M-Instruct (or ``model``) prefills a long English text found on the machine
(:mod:`nanovllm.quality.corpus`), or the ``text_file`` given, densely, once; the queries, keys and values
of the chosen layers are captured, and every policy is evaluated on them for decode queries at block ends
over the last three quarters of the text (:mod:`nanovllm.quality.evaluate`): mass recall, top-k recall,
output error and density, next to the oracle and a random selection with the same number of blocks.

One result row per policy, with the run's text, tokens, positions and layers, per-layer metrics and
their mean. ``sequence`` holds whole-sequence metrics of the policy running in the engine
(:mod:`nanovllm.quality.perplexity`): the perplexity of the text's last ``ppl_tail`` tokens, its ratio to
dense, and the density the policy's selections achieved; each key is one more column of the markdown table.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from nanovllm.bench import markdown_row
from nanovllm.utils import progress_bar

DEFAULT_TOKENS = 4096
DEFAULT_QUERIES = 32
DEFAULT_TOP_K = 10
DEFAULT_PPL_TAIL = 512  # tokens scored one per step through a decode policy
MAX_NUM_BATCHED_TOKENS = 1024  # prefill chunks: the torch backend's padded scores stay small on the CPU
METRIC_LABELS = {"mass_recall": "mass recall", "topk_recall": "top-k recall", "output_error": "output error"}


def default_layers(num_layers: int, count: int = 5) -> list[int]:
    """``count`` layers spread evenly from the first to the last."""
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


def run(
    policies: list[str],
    layers: list[int] | None = None,
    tokens: int = DEFAULT_TOKENS,
    queries: int = DEFAULT_QUERIES,
    top_k: int = DEFAULT_TOP_K,
    device: str = "auto",
    model: str | None = None,
    seed: int = 0,
    ppl_tail: int = DEFAULT_PPL_TAIL,
    text_file: str | None = None,
    dtype: str = "auto",
) -> list[dict[str, Any]]:
    """Capture once, evaluate each policy; one result row per policy. ``dtype`` is the engine's (``auto``:
    float32 on the CPU, the model's 16-bit type on a GPU)."""
    import torch

    from nanovllm import LLM
    from nanovllm.quality.capture import capture_activations
    from nanovllm.quality.corpus import corpus_tokens
    from nanovllm.quality.evaluate import decode_positions, evaluate_policy, make_policy, mean_over_layers

    if not policies:
        raise ValueError("name at least one sparse policy to evaluate, e.g. policies=['full']")
    for selection in policies:  # a bad name or option fails before the model loads
        make_policy(selection)
    llm = LLM(model, max_model_len=tokens + 1, sparse_policy="full", device=device, dtype=dtype,
              enforce_eager=True, async_scheduling=False, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    token_ids, text = corpus_tokens(llm.tokenizer, tokens, text_file=text_file)
    layer_ids = layers if layers is not None else default_layers(len(llm.runner.attention_layers))
    capture = capture_activations(llm, token_ids, layer_ids)
    model_name = model or "SmolLM2-135M-Instruct"
    del llm  # its KV cache; the capture keeps the backend
    gc.collect()
    if capture.device.type == "cuda":
        torch.cuda.empty_cache()
    positions = decode_positions(tokens, queries, capture.block_size)
    run_info = {
        "model": model_name, "text": text.describe(), "tokens": tokens, "positions": positions,
        "layers": layer_ids, "top_k": top_k, "seed": seed, "device": str(capture.device),
        "dtype": str(capture.dtype).removeprefix("torch."), "block_size": capture.block_size,
        "attention_backend": capture.backend.name,
    }
    rows = []
    with progress_bar(len(policies), "evaluate", "policy") as bar:
        for selection in policies:
            bar.set_postfix_str(selection)
            row = {"benchmark": "quality", "preset": model_name, "policy": selection, **run_info}
            try:
                per_layer = evaluate_policy(selection, capture, positions, top_k, seed)
                rows.append({**row, "per_layer": per_layer, "mean": mean_over_layers(per_layer), "sequence": {}})
            except Exception as exc:  # a failing policy (a contract bug, a backend gap) leaves the others' rows
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
            bar.update()
    if ppl_tail:
        if not 0 < ppl_tail < tokens:
            raise ValueError(f"ppl_tail={ppl_tail} must be below tokens={tokens}; lower it, or 0 to skip")
        add_perplexity(rows, token_ids, ppl_tail, model, device, dtype)
    return rows


def add_perplexity(rows: list[dict[str, Any]], token_ids: list[int], tail: int, model: str | None,
                   device: str, dtype: str = "auto") -> None:
    """Each row's ``sequence``: perplexity of the last ``tail`` tokens with the policy in the engine, next
    to dense (``full``, run once), and the density its selections achieved."""
    from nanovllm.quality.perplexity import tail_perplexity

    def measure(selection: str) -> dict[str, Any]:
        result = tail_perplexity(selection, token_ids, tail, model=model, device=device, dtype=dtype,
                                 prefill_chunk=MAX_NUM_BATCHED_TOKENS)
        gc.collect()
        return {"perplexity": result.perplexity, "ppl_tail_tokens": tail, "ppl_tail_step": result.tail_step,
                "decode_density": result.decode_density, "prefill_density": result.prefill_density}

    dense = None
    # full first: it is the reference; each run's bar counts its tokens, this one the runs
    measured = sorted((r for r in rows if "error" not in r), key=lambda r: r["policy"] != "full")
    runs = len(measured) + (not any(r["policy"] == "full" for r in measured))
    with progress_bar(runs, "perplexity runs", "run") as bar:
        for row in measured:
            row["sequence"] = measure(row["policy"])
            if row["policy"] == "full":
                dense = row["sequence"]["perplexity"]
            bar.update()
        dense = dense if dense is not None else measure("full")["perplexity"]
    for row in rows:
        if row.get("sequence"):
            row["sequence"]["ppl_vs_dense"] = row["sequence"]["perplexity"] / dense


def _f(value: float) -> str:
    return f"{value:.3f}"


def markdown(payload: dict[str, Any], title: str) -> str:
    env = payload["environment"]
    rows = [r for r in payload["results"] if "error" not in r]
    lines = [f"# {title}", "", f"{env['device']}, {env['date']}, commit {env['commit']}, "
             f"torch {env['torch']}."]
    if rows:
        r = rows[0]
        text = r["text"]
        lines += [
            f"Model {r['model']} ({r['dtype']}, {r['attention_backend']} backend, "
            f"block size {r['block_size']}) "
            f"on the first {r['tokens']:,} tokens of {text['name']} ({text['source']}, sha256 "
            f"{text['sha256'][:12]}). {len(r['positions'])} decode queries at positions {r['positions'][0]}.."
            f"{r['positions'][-1]}, layers {', '.join(map(str, r['layers']))}, top-{r['top_k']} recall.",
            "Oracle and random select as many blocks as the policy, per query and KV head. "
            "Output error: renormalised over the selection; policy out: the output the policy computed.",
        ]
    sequence_keys = sorted({key for r in rows for key in r.get("sequence", {})})
    header = ["policy", "layer", "density", "blocks", "mass recall (oracle / random)",
              "top-k recall (oracle / random)", "output error (oracle / random)", "policy out error",
              *sequence_keys]
    lines += ["", markdown_row(header), "|" + "---|" * len(header)]
    for r in rows:
        for label, entry in [*((str(x["layer"]), x) for x in r["per_layer"]), ("mean", r["mean"])]:
            p, o, rnd = entry["policy"], entry["oracle"], entry["random"]
            cells = [r["policy"], label, _f(p["density"]), f"{p['blocks']:.1f}"]
            cells += [f"{_f(p[m])} ({_f(o[m])} / {_f(rnd[m])})" for m in METRIC_LABELS]
            cells.append(_f(p["policy_output_error"]))
            seq = r.get("sequence", {}) if label == "mean" else {}
            cells += [_f(seq[k]) if isinstance(seq.get(k), float) else
                      ("-" if seq.get(k) is None else str(seq[k])) for k in sequence_keys]
            lines.append(markdown_row(cells))
    for r in payload["results"]:
        if "error" in r:
            lines.append(f"\nfailed: {r.get('policy', r['preset'])}: {r['error']}")
    return "\n".join(lines) + "\n"


def chart(payload: dict[str, Any], path: Path) -> bool:
    """Quality against density, one panel per metric: each policy's layers (circles) with the oracle
    (triangles) and random (crosses) at the same density; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in payload["results"] if "error" not in r]
    if not rows:
        return False
    fig, axes = plt.subplots(1, len(METRIC_LABELS), figsize=(5 * len(METRIC_LABELS), 4.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, label) in zip(axes[0], METRIC_LABELS.items(), strict=True):
        for i, r in enumerate(rows):
            colour = colours[i % len(colours)]
            for which, marker, size in (("policy", "o", 36), ("oracle", "^", 30), ("random", "x", 30)):
                xs = [x[which]["density"] for x in r["per_layer"]]
                ys = [x[which][metric] for x in r["per_layer"]]
                ax.scatter(xs, ys, marker=marker, s=size, color=colour,
                           label=f"{r['policy']} ({which})" if which == "policy" else None)
        ax.set_xscale("log")
        ax.set_xlabel("density (selected keys / visible keys)")
        ax.set_title(label, fontsize=10)
        if metric == "output_error":
            top = max(x[which][metric] for r in rows for x in r["per_layer"]
                      for which in ("policy", "oracle", "random"))
            ax.set_ylim(0, min(max(top, 0.05) * 1.1, 2.0))
        else:
            ax.set_ylim(0, 1.05)
    axes[0][0].legend(fontsize=7, title="o policy  ^ oracle  x random", title_fontsize=7)
    env = payload["environment"]
    fig.suptitle(f"attention quality by layer - {rows[0]['model']} - {env['device']} - {env['date']} - "
                 f"{env['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def is_quality(payload: dict[str, Any]) -> bool:
    return payload.get("settings", {}).get("benchmark") == "quality"
