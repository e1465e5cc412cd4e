"""``python benchmarks/host_overhead.py``: the host (Python) time of a prefill step, on the CPU (no GPU).

A tiny random model of Gemma 3 270M's structure (18 layers, five sliding-window layers of ``--window`` tokens
then one full-attention layer, three times over; 4 query heads on 1 KV head) with tiny widths, so that its
operations cost little, runs on the CPU with the torch backend and ``enforce_eager``. The attention backend's
``prefill`` and ``decode`` are stubbed (they return zeros): the torch backend's dense reference math would
dominate the step and is not what a GPU runs; everything around them (KV writes, the policy dispatch, the
metadata, RoPE, norms, MLPs, sampling, scheduling) runs as the engine runs it.

A new prompt of ``--chunks`` chunks of ``--chunk`` tokens is prefilled step by step (``max_tokens=1``),
``--repeats`` times; each step that runs the model is timed whole and split into the model's forward and
the rest (scheduling, the step plan and metadata, sampling, the block manager's bookkeeping). The same is done
with chunks of ``--small-chunk`` tokens: what grows with the tokens is operation compute or per-token
Python, and host work should not. ``--profile`` adds cProfile's top functions by own time (``tottime``)
outside the forward (per step) and inside it (per layer, with the torch operations a layer runs), from
separate profiles so the two do not mix; cProfile slows every Python call, so read its times as shares.

``--device cuda --full-width`` runs the same steps on a GPU with Gemma 3 270M's widths (random weights, a tiny
vocabulary), bfloat16 and the backend the engine picks, nothing stubbed; each step then ends with a
synchronize, so the step's time is the device's and the forward's is the host's launching of it: a forward
near the step's time means the GPU waits on the host. There the engine prefills as it does by default, steps
of ``--chunk`` tokens replayed from piecewise CUDA graphs (their forward is the replay of the stretches and the
attention calls between them), unless ``--no-piecewise``; ``--sparse-policy`` sets the full-attention layers'
policy.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.testing import counting_torch_ops, tiny_model_dir

SLIDING, FULL = "sliding_attention", "full_attention"
LAYERS = 18


def gemma3_270m_shape(window: int, max_len: int, full_width: bool = False) -> dict:
    """Gemma 3 270M's structure: 18 layers, 15 sliding and 3 full, 4 query heads, 1 KV head; tiny widths, or
    with ``full_width`` its own (hidden 640, head size 256, MLP 2048; the vocabulary stays tiny)."""
    widths = (dict(hidden_size=640, intermediate_size=2048, head_dim=256) if full_width
              else dict(hidden_size=32, intermediate_size=64, head_dim=16))
    return dict(
        num_hidden_layers=LAYERS, layer_types=([SLIDING] * 5 + [FULL]) * 3, sliding_window=window,
        num_attention_heads=4, num_key_value_heads=1, query_pre_attn_scalar=widths["head_dim"],
        max_position_embeddings=max_len, **widths,
    )


def stub_attention(llm: LLM) -> None:
    """Make the backend's attention return zeros of the query's shape (its KV store write still runs)."""
    backend = llm.llm_engine.runner.backend
    backend.prefill = lambda q, *args, **kwargs: torch.zeros_like(q)
    backend.decode = lambda q, *args, **kwargs: torch.zeros_like(q)


class StepTimer:
    """Wall time of each engine step and of the model forward inside it; with profilers, cProfile of the
    step outside the forward and of the forward, apart."""

    def __init__(self, llm: LLM, outside: cProfile.Profile | None = None,
                 inside: cProfile.Profile | None = None) -> None:
        self.engine = llm.llm_engine
        self.outside, self.inside = outside, inside
        # on a GPU a step ends with a synchronize: the step's time is the device's, the forward's the host's
        self.sync = torch.cuda.synchronize if self.engine.runner.device.type == "cuda" else lambda: None
        self.profiling = False
        self.forward_s: list[float] = []
        runner = self.engine.runner
        # the forward runs as the model's (eager) or as the piecewise prefill graphs' replay
        runner.model.forward = self._timed(runner.model.forward)
        runner.prefill_graphs.replay = self._timed(runner.prefill_graphs.replay)

    def _timed(self, inner):
        def timed_forward(*args, **kwargs):
            profiling = self.profiling and self.outside is not None
            if profiling:
                self.outside.disable()
                self.inside.enable()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.forward_s.append(time.perf_counter() - start)
                if profiling:
                    self.inside.disable()
                    self.outside.enable()

        return timed_forward

    def prefill(self, prompt: list[int], profile: bool = False) -> list[tuple[float, float]]:
        """Prefill ``prompt`` step by step: ``(step µs, forward µs)`` of each step that runs the model."""
        self.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        steps = []
        self.profiling = profile
        while self.engine.has_unfinished_requests():
            self.forward_s.clear()
            if profile and self.outside is not None:
                self.outside.enable()
            self.sync()
            start = time.perf_counter()
            self.engine.step()
            self.sync()
            step_s = time.perf_counter() - start
            if profile and self.outside is not None:
                self.outside.disable()
            if self.forward_s:  # the last step, which only reads the token back, runs no forward
                steps.append((step_s * 1e6, sum(self.forward_s) * 1e6))
        self.profiling = False
        return steps


def build(path: Path, chunk: int, context: int, block_size: int, device: str, sparse_policy: str = "full",
          piecewise: bool = True) -> LLM:
    """The engine; on the CPU eager, with the torch backend and its attention stubbed; on a GPU as it runs there
    (decode graphs, and piecewise prefill graphs unless not ``piecewise``)."""
    cpu = device == "cpu"
    llm = LLM(str(path), device=device, dtype="float32" if cpu else "bfloat16", sparse_policy=sparse_policy,
              attention_backend="torch" if cpu else "auto", enforce_eager=cpu,
              piecewise_cuda_graphs=piecewise, max_model_len=context + 16,
              max_num_batched_tokens=chunk, max_num_seqs=1, block_size=block_size,
              kv_cache_memory=2**26 if cpu else 2**30, skip_tokenizer_init=True)
    if cpu:
        stub_attention(llm)
    return llm


def layer_ops(llm: LLM, chunk: int) -> Counter:
    """The torch operations of one forward of ``chunk`` tokens (a first chunk), per layer."""
    model = llm.llm_engine.runner.model
    inner, ops = model.forward, Counter()

    def counted(*args, **kwargs):
        with counting_torch_ops() as names:
            out = inner(*args, **kwargs)
        ops.update(names)
        return out

    model.forward = counted
    try:
        llm.generate([[5] * chunk], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        model.forward = inner
    return Counter({name: n / LAYERS for name, n in ops.items()})


def measure(path: Path, chunk: int, chunks: int, repeats: int, block_size: int, profile: bool,
            device: str = "cpu", sparse_policy: str = "full", piecewise: bool = True) -> dict:
    """The medians over the steps of ``repeats`` new prompts of ``chunks`` chunks (after one warm-up
    prompt); with ``profile`` also the two profiles of ``repeats`` more prompts and a layer's operations."""
    context = chunk * chunks
    llm = build(path, chunk, context, block_size, device, sparse_policy, piecewise)
    outside, inside = (cProfile.Profile(), cProfile.Profile()) if profile else (None, None)
    timer = StepTimer(llm, outside, inside)
    # a new prompt each time (its first token differs), so the prefix cache finds nothing
    prompts = [[3 + r] + [(7 * i) % 250 + 3 for i in range(1, context)] for r in range(2 * repeats + 1)]
    timer.prefill(prompts[0])
    steps = [s for prompt in prompts[1 : repeats + 1] for s in timer.prefill(prompt)]
    row = {
        "chunk": chunk, "steps": len(steps),
        "step_us": statistics.median(s for s, _ in steps),
        "forward_us": statistics.median(f for _, f in steps),
        "outside_us": statistics.median(s - f for s, f in steps),
    }
    if profile:  # other prompts than the timed ones: cProfile slows every call
        profiled = sum(len(timer.prefill(prompt, True)) for prompt in prompts[repeats + 1 :])
        row |= {"outside": outside, "inside": inside, "profiled": profiled, "ops": layer_ops(llm, chunk)}
    return row


def profile_rows(profiler: cProfile.Profile, per: int, top: int) -> list[tuple[str, float, float, float]]:
    """``(function, calls, own µs, cumulative µs)``, each per ``per``, of the ``top`` functions by own
    time."""
    stats = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats[:top]:
        where = f"{Path(file).name}:{line} {name}" if line else name
        rows.append((where, calls / per, own / per * 1e6, cumulative / per * 1e6))
    return rows


def print_profile(title: str, unit: str, rows: list[tuple[str, float, float, float]]) -> None:
    print(f"\n{title}\n")
    print(f"| function | calls/{unit} | own µs/{unit} | cumulative µs/{unit} |")
    print("|---|---:|---:|---:|")
    for where, calls, own, cumulative in rows:
        print(f"| `{where}` | {calls:.2f} | {own:.1f} | {cumulative:.1f} |")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=8192, help="tokens per prefill chunk (default 8192)")
    parser.add_argument("--small-chunk", type=int, default=64, help="the chunk to compare with (default 64)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per prompt (default 4)")
    parser.add_argument("--window", type=int, default=512, help="sliding window in tokens (default 512)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="prompts timed after a warm-up one")
    parser.add_argument("--profile", action="store_true", help="cProfile outside and inside the forward")
    parser.add_argument("--top", type=int, default=25, help="functions in each profile table")
    parser.add_argument("--device", default="cpu", help="cpu (the default), or cuda: the real model on a GPU")
    parser.add_argument("--sparse-policy", default="full",
                        help="the full-attention layers' policy, e.g. xattn:threshold=0.9 (default full)")
    parser.add_argument("--no-piecewise", action="store_true",
                        help="prefill without piecewise CUDA graphs (for --device cuda)")
    parser.add_argument("--full-width", action="store_true",
                        help="Gemma 3 270M's own widths (for --device cuda)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        shape = gemma3_270m_shape(args.window, args.chunk * args.chunks + 16, args.full_width)
        path = tiny_model_dir(Path(tmp) / "gemma3", "Gemma3ForCausalLM", **shape)
        rows = [measure(path, chunk, args.chunks, args.repeats, args.block_size, args.profile, args.device,
                        args.sparse_policy, not args.no_piecewise)
                for chunk in (args.small_chunk, args.chunk)]
    print("| chunk tokens | steps | step µs | forward µs | forward µs/layer | outside forward µs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['chunk']} | {row['steps']} | {row['step_us']:.0f} | {row['forward_us']:.0f} | "
              f"{row['forward_us'] / LAYERS:.0f} | {row['outside_us']:.0f} |")
    for row in rows if args.profile else ():
        n = row["profiled"]
        print_profile(f"Outside the forward, {row['chunk']}-token chunks (cProfile, per step)", "step",
                      profile_rows(row["outside"], n, args.top))
        print_profile(f"Inside the forward, {row['chunk']}-token chunks (cProfile, per layer)", "layer",
                      profile_rows(row["inside"], n * LAYERS, args.top))
        ops = ", ".join(f"{name} {k:g}" for name, k in row["ops"].most_common())
        print(f"\ntorch operations per layer: {sum(row['ops'].values()):g} ({ops})")
    return rows


if __name__ == "__main__":
    main()
