"""Quality of sparse *prefill* policies on a real model: the harness MInference and XAttention share.

The built-in SmolLM2-135M-Instruct prefills a long English text found on the machine densely, once, and the
queries, keys and values of the chosen layers are captured. For each setting of the policy and each captured
layer the text is cut into prefill chunks as the engine cuts it; the policy sees each chunk after the first
as the engine shows it (a :class:`~nanovllm.policy.PolicyContext` over a paged cache holding every key so far)
and says which keys a sample of the chunk's query rows read, and those are compared with dense attention
(``measure``, usually through :func:`~nanovllm.quality.metrics.compare_selection` or
:func:`~nanovllm.quality.metrics.compare_key_masks`). Then the perplexity of the text's last part with the
policy prefilling in the engine, against dense. Runs on the CPU (the policies' torch references).
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# measure(policy, q, ctx, positions, dense) -> ({"policy"|"oracle"|"random": SelectionQuality}, density)
Measure = Callable[..., tuple[dict[str, Any], float]]


def prefill_chunks(layer, chunk: int, kv_block_size: int) -> Iterator[tuple[int, int, torch.Tensor, Any]]:
    """``(start, end, q, ctx)`` of each chunk after the first of a captured layer: the chunk's queries and
    the context a prefill policy gets, over a paged cache (float32, blocks in order) holding every key up to
    the chunk's end."""
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.policy import PolicyContext

    num_tokens = layer.k.shape[0]
    width = -(-num_tokens // kv_block_size)
    pad = width * kv_block_size - num_tokens
    k_cache, v_cache = (torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)).view(width, kv_block_size, *x.shape[1:])
                        for x in (layer.k, layer.v))
    table = torch.arange(width, dtype=torch.int32)[None, :]
    for start in range(chunk, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        q = layer.q[start:end].float()
        meta = PhaseMetadata(torch.tensor([0, end - start], dtype=torch.int32), torch.tensor([end], dtype=torch.int32),
                             table, end - start, end)
        yield start, end, q, PolicyContext(layer.layer_id, True, q, meta, k_cache, v_cache, layer.scale, TorchBackend())


def layer_metrics(policy, layer, chunk: int, rows_per_chunk: int, kv_block_size: int, measure: Measure) -> dict:
    """Mean metrics over the sampled rows of every chunk after the first of one captured layer, and the
    mean of the densities ``measure`` reports per chunk (``"policy_density"``)."""
    from nanovllm.quality.metrics import dense_attention

    sums: dict[str, dict[str, float]] = {}
    count, densities = 0, []
    for start, end, q, ctx in prefill_chunks(layer, chunk, kv_block_size):
        rows = torch.linspace(0, end - start - 1, rows_per_chunk).round().long().unique()
        positions = start + rows
        dense = dense_attention(layer.q[positions], layer.k[:end], layer.v[:end], positions, layer.scale)
        result, density = measure(policy, q, ctx, positions, dense)
        densities.append(density)
        for which, quality in result.items():
            for key, value in quality.summary().items():
                sums.setdefault(which, {}).setdefault(key, 0.0)
                sums[which][key] += value * len(rows)
        count += len(rows)
    out: dict[str, Any] = {which: {key: value / count for key, value in metrics.items()} for which, metrics in sums.items()}
    out["policy_density"] = sum(densities) / len(densities)
    return out


def run(name: str, settings: list[str], make_policy: Callable[[dict[str, Any]], Any], measure: Measure,
        tokens: int, chunk: int, layers: list[int] | None, rows_per_chunk: int, ppl_tail: int,
        fixed: dict[str, Any] | None = None, done: Callable[[dict], None] = lambda payload: None) -> dict[str, Any]:
    """Every setting (``key=value,...`` of policy ``name``, then ``fixed``) on the captured layers and in the
    engine; ``done(payload)`` after each one, so that a run cut short keeps what it measured."""
    from nanovllm import LLM
    from nanovllm.bench.quality import default_layers
    from nanovllm.quality.capture import capture_activations
    from nanovllm.quality.corpus import corpus_tokens
    from nanovllm.quality.perplexity import tail_perplexity
    from nanovllm.utils import progress_bar

    llm = LLM(None, max_model_len=tokens + 1, sparse_policy="full", device="cpu", enforce_eager=True,
              max_num_batched_tokens=chunk)
    token_ids, text = corpus_tokens(llm.tokenizer, tokens)
    layer_ids = layers if layers is not None else default_layers(len(llm.runner.attention_layers))
    capture = capture_activations(llm, token_ids, layer_ids)
    del llm
    gc.collect()
    print(f"captured layers {layer_ids}", file=sys.stderr, flush=True)
    dense_ppl = tail_perplexity("full", token_ids, ppl_tail, device="cpu", prefill_chunk=chunk).perplexity
    print(f"dense perplexity {dense_ppl:.4f}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    payload = {"model": "SmolLM2-135M-Instruct", "text": text.describe(), "tokens": tokens, "chunk": chunk,
               "layers": layer_ids, "rows_per_chunk": rows_per_chunk, "ppl_tail": ppl_tail,
               "dense_perplexity": dense_ppl, "results": rows}
    with progress_bar(len(settings), name, "setting") as bar:
        for setting in settings:
            options = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in setting.split(","))}
            options = {**options, **(fixed or {})}
            selection = f"{name}:" + ",".join(f"{k}={json.dumps(v)}" for k, v in options.items())
            policy = make_policy(options)
            per_layer = {layer.layer_id: layer_metrics(policy, layer, chunk, rows_per_chunk, capture.block_size,
                                                       measure) for layer in capture.layers}
            ppl = tail_perplexity(selection, token_ids, ppl_tail, device="cpu", prefill_chunk=chunk).perplexity
            mean = {which: {key: sum(m[which][key] for m in per_layer.values()) / len(per_layer)
                            for key in next(iter(per_layer.values()))[which]}
                    for which in ("policy", "oracle", "random")}
            rows.append({"policy": selection, "per_layer": per_layer, "mean": mean,
                         "policy_density": sum(m["policy_density"] for m in per_layer.values()) / len(per_layer),
                         "perplexity": ppl, "ppl_vs_dense": ppl / dense_ppl})
            # above the bar, which a plain print would tear
            bar.write(json.dumps({k: rows[-1][k] for k in ("policy", "mean", "policy_density", "ppl_vs_dense")}),
                      file=sys.stderr)
            done(payload)
            bar.update()
    return payload


def results_table(results: list[dict[str, Any]], density_column: str) -> list[str]:
    """The markdown table of a quality run, a row per setting: the policy's mean density, its own density
    measure (``policy_density``, headed ``density_column``), mass recall next to the oracle's and random's,
    top-10 recall, output error and perplexity against dense."""
    lines = [f"| policy | density | {density_column} | mass recall | oracle | random | top-10 recall | "
             "output error | perplexity vs dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p, o, rnd = r["mean"]["policy"], r["mean"]["oracle"], r["mean"]["random"]
        lines.append(f"| `{r['policy']}` | {p['density']:.3f} | {r['policy_density']:.3f} | {p['mass_recall']:.3f} | "
                     f"{o['mass_recall']:.3f} | {rnd['mass_recall']:.3f} | {p['topk_recall']:.3f} | "
                     f"{p['output_error']:.3f} | {r['ppl_vs_dense']:.4f} |")
    return lines


def main(argv: list[str] | None, prog: str, description: str, default_settings: list[str], default_name: str,
         run_settings: Callable[..., dict[str, Any]], markdown: Callable[[dict[str, Any]], str],
         extra_args: Callable[[Any], None] = lambda parser: None) -> int:
    """The command line of a prefill policy's quality run: ``run_settings(args, done)`` runs it; the
    results go to ``--out``/``--name``.json and .md after each setting."""
    import argparse
    from pathlib import Path

    from nanovllm.bench import environment

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--settings", nargs="+", default=default_settings, help="option strings of the policy")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--layers", nargs="+", type=int, default=None)
    parser.add_argument("--rows-per-chunk", type=int, default=64)
    parser.add_argument("--ppl-tail", type=int, default=4000)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=default_name)
    extra_args(parser)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    env, out = environment(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(payload: dict[str, Any]) -> None:
        payload = {"environment": env, **payload}
        (out / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
        (out / f"{args.name}.md").write_text(markdown(payload))

    run_settings(args, write)
    print((out / f"{args.name}.md").read_text())
    return 0
