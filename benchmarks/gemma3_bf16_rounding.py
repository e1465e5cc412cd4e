"""Gemma 3 270M in bfloat16 against float32: the engine next to transformers, rounding point by point.

On pass-key prompts (the answer's tokens appended, teacher-forced) it runs transformers in float32 (the
truth; ``--truth-weights bfloat16`` gives it the bf16 runs' rounded weights, so only arithmetic differs),
transformers in bfloat16 as it is and with rounding points switched (RoPE in float32 with one rounding;
attention in float32; attention with its probabilities rounded to bfloat16, as flash-style GPU kernels
do), and the engine in bfloat16 (torch backend, eager, on the CPU), all on the same weights and token ids.
Per run against the truth: the residual stream's relative error after each layer (per token, averaged),
the post-RoPE queries' and keys' relative error per layer, and on the answer's positions the logits'
max/mean absolute error, KL(truth || run), the answer token's margin and whether the greedy token holds;
and the engine's distance from transformers' runs.

    python benchmarks/gemma3_bf16_rounding.py --lengths 1024,2048 --depths 0.1,0.3,0.5,0.7,0.9 \\
        --out benchmarks/results --name gemma3_bf16_rounding

Writes OUT/NAME.json and prints a markdown summary; about 30 s a 1K-token prompt on two CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from nanovllm.quality import passkey as pk

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [ROOT / "shared" / "data" / "long_text.txt", ROOT.parent / "shared" / "data" / "long_text.txt"]


# ------------------------------------------------------------------------- transformers, rounding switchable
def _rope_fp32(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE with float32 cos/sin (``_cos_sin_fp64``), rotated in float32 and rounded once."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def _cos_sin_fp64(self, x, position_ids, layer_type):
    """cos/sin of float64 angles, rounded to float32 (not to x's dtype)."""
    base = self.config.rope_parameters[layer_type]["rope_theta"]
    dim = self.config.head_dim
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].double() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def _attention(p_dtype):
    """Attention in float32 (scores, softmax); the probabilities rounded to ``p_dtype`` before P @ V
    (float32: the engine's torch backend; bfloat16: flash-style kernels, the engine's Triton one)."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               **kwargs):
        n_rep = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(n_rep, dim=1).float()
        v = value.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
        t = query.shape[2]
        i = torch.arange(t)[:, None]
        j = torch.arange(key.shape[2])[None, :]
        ok = j <= i
        if sliding_window is not None:
            ok &= j > i - sliding_window
        scores = scores.masked_fill(~ok, float("-inf"))
        probs = scores.softmax(-1)
        out = torch.matmul(probs.to(p_dtype), v.to(p_dtype)).float()
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return attend


class HFRun:
    """transformers' Gemma 3 with switchable rounding points; records per-layer streams and post-RoPE q/k."""

    def __init__(self, model_dir: Path, dtype: torch.dtype,
                 weights_rounded_to: torch.dtype | None = None) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if weights_rounded_to is not None:  # float32 arithmetic on the weights a bfloat16 run sees
            with torch.no_grad():
                for param in self.model.parameters():
                    param.copy_(param.to(weights_rounded_to))
        self.streams: list[torch.Tensor] = []
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.model.model.layers:
            layer.register_forward_hook(lambda m, a, out: self.streams.append(
                (out[0] if isinstance(out, tuple) else out)[0].detach().float()))

    @contextlib.contextmanager
    def switches(self, rope: str = "hf", attention: str = "sdpa"):
        from transformers import AttentionInterface
        from transformers.models.gemma3 import modeling_gemma3 as mg

        orig_apply, orig_rot = mg.apply_rotary_pos_emb, mg.Gemma3RotaryEmbedding.forward
        recorder = self

        def apply(q, k, cos, sin, unsqueeze_dim=1):
            fn = _rope_fp32 if rope == "fp32" else orig_apply
            q, k = fn(q, k, cos, sin, unsqueeze_dim)
            recorder.qk.append((q[0].transpose(0, 1).detach().float(), k[0].transpose(0, 1).detach().float()))
            return q, k

        mg.apply_rotary_pos_emb = apply
        if rope == "fp32":
            mg.Gemma3RotaryEmbedding.forward = _cos_sin_fp64
        impl = self.model.config._attn_implementation
        if attention != "sdpa":
            AttentionInterface.register(f"probe_{attention}",
                                        _attention(torch.float32 if attention == "fp32" else torch.bfloat16))
            self.model.set_attn_implementation(f"probe_{attention}")
        try:
            yield
        finally:
            mg.apply_rotary_pos_emb, mg.Gemma3RotaryEmbedding.forward = orig_apply, orig_rot
            if attention != "sdpa":
                self.model.set_attn_implementation(impl)

    def __call__(self, ids: list[int], rows: int, **switches) -> dict:
        self.streams, self.qk = [], []
        with self.switches(**switches), torch.no_grad():
            logits = self.model(torch.tensor([ids]), logits_to_keep=rows).logits[0].float()
        return {"streams": self.streams, "qk": self.qk, "logits": logits}


# ------------------------------------------------------------------------------------------------- engine
class EngineRun:
    """The engine (torch backend, eager) with hooks: per-layer streams, post-RoPE q/k, final hidden."""

    def __init__(self, model: str, dtype: str, max_len: int) -> None:
        from nanovllm import LLM

        self.llm = LLM(model, device="cpu", dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
                       async_scheduling=False, max_model_len=max_len + 8, max_num_batched_tokens=max_len + 8,
                       max_num_seqs=1, attention_backend="torch")
        self.model = self.llm.runner.model
        self.streams, self.qk, self.final = [], [], []
        for layer in self.model.model.layers:  # the stream after the layer: its output plus its residual
            layer.register_forward_hook(
                lambda m, a, out: self.streams.append((out[0] + out[1]).detach().float()))
        from nanovllm.layers.attention import Attention

        for m in self.model.modules():
            if isinstance(m, Attention):
                m.register_forward_pre_hook(lambda m, a: self.qk.append((a[0].detach().float(),
                                                                           a[1].detach().float())))
        self.model.model.norm.register_forward_hook(lambda m, a, out: self.final.append(out[0].detach()))

    def __call__(self, ids: list[int], rows: int) -> dict:
        from nanovllm import SamplingParams

        self.streams, self.qk, self.final = [], [], []
        self.llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)
        n = len(self.model.model.layers)
        assert len(self.streams) == n, "the prompt ran in more than one chunk"
        with torch.no_grad():
            logits = self.model.compute_logits(self.final[0][-rows:]).float()
        return {"streams": self.streams[:n], "qk": self.qk[:n], "logits": logits}


# ---------------------------------------------------------------------------------------------- metrics
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against ``b``, per token (last dimension), averaged over the tokens."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()


def _margin(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per row: the logit of token ``idx`` minus the largest other logit."""
    rows = torch.arange(len(idx))
    others = logits.clone()
    others[rows, idx] = float("-inf")
    return logits[rows, idx] - others.max(-1).values


def compare(run: dict, truth: dict, answer: list[int]) -> dict:
    t, r = truth["logits"], run["logits"]
    diff = (r - t).abs()
    lp_t, lp_r = t.log_softmax(-1), r.log_softmax(-1)
    kl = (lp_t.exp() * (lp_t - lp_r)).sum(-1)
    idx = torch.tensor(answer)
    margin, margin_truth = _margin(r, idx), _margin(t, idx)
    return {
        "stream_rel": [rel(a, b) for a, b in zip(run["streams"], truth["streams"], strict=True)],
        "stream_last_rel": [rel(a[-1], b[-1]) for a, b in zip(run["streams"], truth["streams"], strict=True)],
        "q_rel": [rel(a[0], b[0]) for a, b in zip(run["qk"], truth["qk"], strict=True)],
        "k_rel": [rel(a[1], b[1]) for a, b in zip(run["qk"], truth["qk"], strict=True)],
        "logit_max_abs": diff.max().item(), "logit_mean_abs": diff.mean().item(),
        "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
        "margin": margin.tolist(), "margin_abs_err": (margin - margin_truth).abs().tolist(),
        "greedy_ok": (r.argmax(-1) == idx).tolist(),
    }


def prompts_of(tokenizer, lengths, depths, fillers, seed=0):
    ids = {}
    if "classic" in fillers:
        ids["classic"] = pk.classic_filler_ids(tokenizer, max(lengths))
    if "natural" in fillers:
        text = next((p for p in TEXTS if p.is_file()), None)
        if text is not None:
            ids["natural"] = list(tokenizer.encode(text.read_text()[: 12 * max(lengths)],
                                                   add_special_tokens=False))
    return pk.build_prompts(tokenizer, ids, lengths, depths, 1, seed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.2,0.5,0.8")
    p.add_argument("--fillers", default="classic,natural")
    p.add_argument("--variants", default="hf_rope_fp32,hf_attn_fp32,hf_rope_fp32_attn_fp32",
                   help="transformers bf16 runs with rounding points switched, besides hf_bf16 (also: "
                        "hf_attn_pbf16, hf_rope_fp32_attn_pbf16)")
    p.add_argument("--truth-weights", choices=["float32", "bfloat16"], default="float32",
                   help="the truth's weights: the checkpoint's, or rounded to bfloat16 as every bf16 run's "
                        "are (then only the arithmetic differs)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="gemma3_bf16_rounding")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from nanovllm import default_model

    model_dir = default_model.gemma3_model_dir()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    prompts = prompts_of(tok, lengths, depths, args.fillers.split(","))
    variants = {
        "hf_bf16": {},
        "hf_rope_fp32": {"rope": "fp32"},
        "hf_attn_fp32": {"attention": "fp32"},  # the engine's rounding on the CPU
        "hf_attn_pbf16": {"attention": "pbf16"},
        "hf_rope_fp32_attn_fp32": {"rope": "fp32", "attention": "fp32"},
        "hf_rope_fp32_attn_pbf16": {"rope": "fp32", "attention": "pbf16"},
    }
    chosen = ["hf_bf16"] + [v for v in args.variants.split(",") if v]
    start = time.perf_counter()
    rounded = torch.bfloat16 if args.truth_weights == "bfloat16" else None
    hf32, hf16 = HFRun(model_dir, torch.float32, rounded), HFRun(model_dir, torch.bfloat16)
    engine = EngineRun(args.model, "bfloat16", max(lengths) + 8)
    results = []
    for prompt in prompts:
        answer = list(tok.encode(" " + prompt.key, add_special_tokens=False))
        ids = prompt.token_ids + answer[:-1]  # rows predicting each answer token
        rows = len(answer)
        truth = hf32(ids, rows)
        runs = {name: hf16(ids, rows, **variants[name]) for name in chosen}
        runs["engine_bf16"] = engine(ids, rows)
        record = {**prompt.describe(), "answer_ids": answer,
                  "truth_greedy_ok": (truth["logits"].argmax(-1) == torch.tensor(answer)).tolist(),
                  "runs": {n: compare(r, truth, answer) for n, r in runs.items()}}
        # the engine against transformers' bf16 and against its emulation, beyond float32
        for ref in ("hf_bf16", "hf_attn_fp32", "hf_rope_fp32_attn_fp32"):
            if ref in runs:
                pairs = zip(runs["engine_bf16"]["streams"], runs[ref]["streams"], strict=True)
                record["runs"]["engine_bf16"][f"stream_rel_vs_{ref}"] = [rel(a, b) for a, b in pairs]
                record["runs"]["engine_bf16"][f"logit_max_abs_vs_{ref}"] = (
                    runs["engine_bf16"]["logits"] - runs[ref]["logits"]).abs().max().item()
        results.append(record)
        print(f"{prompt.filler} {prompt.length} depth {prompt.depth}: " + ", ".join(
            f"{n} KL {r['kl_mean']:.2e} maxabs {r['logit_max_abs']:.3f} min-margin {min(r['margin']):.2f}"
            for n, r in record["runs"].items()), file=sys.stderr, flush=True)
    out = {"model": args.model, "truth_weights": args.truth_weights,
           "seconds": round(time.perf_counter() - start, 1), "trials": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    print(summary(results))
    return 0


def summary(results: list[dict]) -> str:
    """Markdown: per run, the means over trials against the truth; KL paired with hf_bf16's; the engine's
    distance from transformers' runs."""
    mean = statistics.mean
    names = list(results[0]["runs"])
    layers = results[0]["runs"][names[0]]["stream_rel"]
    picks = sorted({0, len(layers) // 3, 2 * len(layers) // 3, len(layers) - 1})
    lines = ["| run | mean KL | median KL | mean max-abs logit err | mean abs logit err | "
             "mean abs margin err | greedy misses | stream rel err " + "/".join(f"L{i}" for i in picks)
             + " | q rel err L0/last |",
             "|" + "---|" * 9]
    for n in names:
        rs = [t["runs"][n] for t in results]
        misses = sum(not ok for r in rs for ok in r["greedy_ok"])
        lines.append(
            f"| {n} | {mean(r['kl_mean'] for r in rs):.2e} "
            f"| {statistics.median(r['kl_mean'] for r in rs):.2e} "
            f"| {mean(r['logit_max_abs'] for r in rs):.3f} | {mean(r['logit_mean_abs'] for r in rs):.4f} "
            f"| {mean(m for r in rs for m in r['margin_abs_err']):.3f} | {misses} | "
            + "/".join(f"{mean(r['stream_rel'][i] for r in rs):.4f}" for i in picks) + " | "
            + "/".join(f"{mean(r['q_rel'][i] for r in rs):.4f}" for i in (0, -1)) + " |")
    lines.append("")
    for n in names[1:]:
        diffs = [t["runs"][n]["kl_mean"] - t["runs"]["hf_bf16"]["kl_mean"] for t in results]
        sem = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        lines.append(f"- KL({n}) - KL(hf_bf16), paired: {mean(diffs):+.2e} +- {sem:.2e} (sem); lower in "
                     f"{sum(d < 0 for d in diffs)}/{len(diffs)} trials")
    engine = [t["runs"]["engine_bf16"] for t in results]
    for key in engine[0]:
        if key.startswith("stream_rel_vs_"):
            ref = key.removeprefix("stream_rel_vs_")
            gap = mean(r["logit_max_abs_vs_" + ref] for r in engine)
            lines.append(f"- engine_bf16 vs {ref}: max-abs logit difference {gap:.3f}; stream difference "
                         "by layer "
                         + " ".join(f"{mean(r[key][i] for r in engine):.4f}" for i in range(len(layers))))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
