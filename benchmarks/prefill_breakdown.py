"""``python benchmarks/prefill_breakdown.py``: where one layer's prefill attention time goes, chunk by chunk,
for dense attention, MInference and XAttention, piece by piece.

One prompt of ``--context`` tokens prefilled in chunks of ``--chunk`` (the engine's
``max_num_batched_tokens``), one full-attention layer (Gemma 3 270M's shape by default: 4 query heads, 1 KV
head, head size 256, KV blocks of 16, bfloat16; ``--compare`` adds a second shape). For every chunk (history
0, one chunk, two ...) each policy runs exactly as the engine calls it: its ``compute_chunked_prefill`` with a
:class:`~nanovllm.policy.PolicyContext` over the paged cache that already holds the chunk's keys, on the
backend the engine picks (``auto``: Triton on CUDA, whose first chunk of a fresh prompt goes to SDPA; torch on
the CPU). That call is timed whole, then the functions the policy called inside it are timed alone with the
arguments it passed them (recorded on a first call): MInference's estimate, its index building (the rest of
``build_index``) and its sparse attention (with the ``dense_above`` check it makes); XAttention's antidiagonal
estimate, its selection (``select_blocks`` and the block lists) and its block-sparse attention.

Times are CUDA events around one call started on an idle GPU (median of ``--repeats`` after ``--warmup``
calls, so nothing compiles while timed), and around ``--repeats`` calls queued back to back (per call: what
the launches cost when the host runs ahead). One profiled call gives each piece's GPU busy time, its GPU
operations (kernels, copies, fills) and the host synchronisations it waits on. Density is what the policy
selected (MInference: the index's work over dense causal work; XAttention: kept blocks over causal blocks);
the ceiling is the dense call's time times that density, what the work alone would cost.

Random queries and keys attend almost uniformly, and XAttention then keeps nearly every block. The prompt
plants the structure of real attention instead (:func:`planted_qkv`): a few sink keys, a band along the
diagonal, and hot key blocks, a ``--densities`` share of all, that hold most of every query's attention, so
XAttention at ``threshold=0.9`` keeps about that share. The density actually selected is in every row.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _jobs import job_main, run_jobs
from _plot import save, subplots
from _prefill import xattn_kept_and_causal
from nanovllm.bench import markdown_row

GEMMA3_270M = (4, 1, 256)  # query heads, KV heads, head size of its full-attention layers
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize")  # a host wait (torch.cuda.synchronize's not)
POLICIES = ("full", "minference", "xattn")
PIECE_NAMES = ("estimate", "select", "attention")
HOT_SHARE = 0.97  # of each query's attention in the hot blocks (the sinks and band add to it)
# --configs: the kernels' knobs tried on every chunk with history (fields of PrefillConfig and of
# SparseKernelConfig), each against the kernel's own choice for the shape ("default")
DENSE_CONFIGS = {
    "64x32, 4 warps, 3 stages": (64, 32, 4, 3),
    "64x64, 4 warps, 2 stages": (64, 64, 4, 2),
    "128x32, 8 warps, 2 stages": (128, 32, 8, 2),
    "128x64, 8 warps, 2 stages": (128, 64, 8, 2),
    "128x32, 8 warps, 3 stages": (128, 32, 8, 3),
    "64x32, 4 warps, 2 stages, fused scale": (64, 32, 4, 2, False, False, True),
    "128x64, 8 warps, 2 stages, fused scale": (128, 64, 8, 2, False, False, True),
    "64x16, 4 warps, 4 stages": (64, 16, 4, 4),
}
SPARSE_CONFIGS = {  # block_m, keys a step, warps, stages, fused scale
    "64 rows, 32 keys, 4 warps, 3 stages": (64, 32, 4, 3, True),
    "64 rows, 64 keys, 4 warps, 2 stages": (64, 64, 4, 2, True),
    "128 rows, 32 keys, 8 warps, 2 stages": (128, 32, 8, 2, True),
    "128 rows, 64 keys, 8 warps, 2 stages": (128, 64, 8, 2, True),
    "64 rows, 32 keys, 8 warps, 2 stages": (64, 32, 8, 2, True),
    "64 rows, 16 keys, 4 warps, 4 stages": (64, 16, 4, 4, True),
    "64 rows, 32 keys, 4 warps, 2 stages, unfused": (64, 32, 4, 2, False),
}


# -- the prompt ----------------------------------------------------------------------------------------------


def planted_qkv(n: int, heads: int, kv_heads: int, head_dim: int, density: float | None, block: int, gen,
                device: str = "cuda", dtype=None, sinks: int = 4, band: int = 64, band_logit: float = 4.0):
    """``(q [n, H, D], k, v [n, Hkv, D])`` of one prompt whose attention has a known shape: noise (logits
    of about unit spread, as random inputs give), the first ``sinks`` keys attended strongly by every query,
    a band along the diagonal (about ``band`` tokens wide, logits up to ``band_logit`` higher), and per KV
    head a random ``density`` share of the key blocks of ``block`` tokens (block 0 among them) whose keys
    hold :data:`HOT_SHARE` of every query's attention between them. XAttention at a threshold below that
    share then keeps about ``density`` of the causal blocks. ``density`` None: plain random inputs (near
    uniform attention). ``gen`` draws everything, on ``device``."""
    import math

    import torch

    dtype = dtype or torch.bfloat16
    if density is not None and not 0 < density < 1:
        raise ValueError(f"density={density}: give a share of the key blocks in (0, 1), or None for random "
                         "inputs")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = randn(n, heads, head_dim), randn(n, kv_heads, head_dim), randn(n, kv_heads, head_dim)
    if density is None:
        return q.to(dtype), k.to(dtype), v.to(dtype)
    scale, group = head_dim**-0.5, heads // kv_heads
    # the band lives in the first half of the dimensions: random Fourier features of the position, whose dot
    # products fall off with distance like a Gaussian of width `band`
    pairs = head_dim // 4
    freq = randn(pairs) / band
    angle = torch.arange(n, device=device, dtype=torch.float32)[:, None] * freq[None, :]
    position = torch.cat([angle.cos(), angle.sin()], dim=1) / math.sqrt(pairs)  # [n, 2 * pairs], unit norm
    amplitude = math.sqrt(band_logit / scale)
    q[..., : 2 * pairs] += amplitude * position[:, None, :]
    k[..., : 2 * pairs] += amplitude * position[:, None, :]
    # the hot blocks: one direction per KV head, in the other half, that the noise is made orthogonal to
    u = torch.nn.functional.normalize(randn(kv_heads, head_dim - 2 * pairs), dim=-1)
    u = torch.nn.functional.pad(u, (2 * pairs, 0))  # [Hkv, D]
    uq = u.repeat_interleave(group, dim=0)  # [H, D]
    q -= (q * uq).sum(-1, keepdim=True) * uq
    k -= (k * u).sum(-1, keepdim=True) * u
    boost = math.log(HOT_SHARE / (1 - HOT_SHARE) * (1 - density) / density)  # the hot keys' extra logit
    num_blocks = -(-n // block)
    order = torch.rand(kv_heads, num_blocks, generator=gen, device=device).argsort(-1)  # a permutation a head
    hot = order < round(density * num_blocks)
    hot[:, 0] = True
    hot_keys = hot.repeat_interleave(block, dim=1)[:, :n].T  # [n, Hkv]
    amplitude = math.sqrt(boost / scale)
    q += amplitude * uq
    k += amplitude * hot_keys[..., None] * u
    k[:sinks] += amplitude * u * 4 / boost  # the sinks: 4 more
    return q.to(dtype), k.to(dtype), v.to(dtype)


# -- recording and timing a call -----------------------------------------------------------------------------


class Recorder:
    """Wraps ``fn``: each call's arguments and result, in order, to call it again the same way."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out

    def replay(self) -> None:
        for args, kwargs, _ in self.calls:
            self.fn(*args, **kwargs)

    def canned(self) -> Callable:
        """A stand-in for ``fn`` that returns the recorded results in turn, computing nothing."""
        results = itertools.cycle([out for _, _, out in self.calls])
        return lambda *args, **kwargs: next(results)


@contextlib.contextmanager
def replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block."""
    own = name in vars(module)  # else looked up on the class: put nothing back
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        if own:
            setattr(module, name, original)
        else:
            delattr(module, name)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device, repeats: int, warmup: int) -> dict[str, float]:
    """``ms``: median time of one call of ``fn`` started on an idle device; ``host_ms``: the host's time to
    make that call (its launches and waits, to its return); ``queued_ms``: ``repeats`` calls back to back,
    per call. CUDA events on the GPU, the host's clock on the CPU. ``warmup`` calls first."""
    import torch

    for _ in range(warmup):
        fn()
    sync(device)
    if torch.device(device).type != "cuda":
        once = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            once.append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        ms = statistics.median(once)
        return {"ms": ms, "host_ms": ms, "queued_ms": 1e3 * (time.perf_counter() - start) / repeats}
    pairs, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append(1e3 * (time.perf_counter() - began))
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    once = [s.elapsed_time(e) for s, e in pairs]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return {"ms": statistics.median(once), "host_ms": statistics.median(host),
            "queued_ms": start.elapsed_time(end) / repeats}


def gpu_activity(fn: Callable[[], Any], device) -> dict[str, float]:
    """One profiled call of ``fn``: its GPU operations, their busy time and the host's waits on the GPU
    (:func:`tally`); empty off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return tally(prof.key_averages())


def tally(events) -> dict[str, float]:
    """From a profile's averaged events: ``launches``, the GPU operations (kernels, copies and fills);
    ``busy_ms``, their time; ``syncs``, the host's waits on a stream or event (:data:`SYNC_CALLS`)."""
    from torch.autograd import DeviceType

    on_gpu = [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    return {"launches": sum(e.count for e in on_gpu),
            "busy_ms": sum(e.self_device_time_total for e in on_gpu) / 1e3,
            "syncs": sum(e.count for e in events if e.key in SYNC_CALLS)}


# -- the policies, whole and in pieces -----------------------------------------------------------------------


def make_policy(spec: str, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int, dtype, device):
    """The policy a ``sparse_policy`` selection names, made and initialised as the engine does (one layer)."""
    from nanovllm.selection import resolve_sparse_policy

    resolved = resolve_sparse_policy(spec)
    policy = resolved.cls(resolved.config)
    if callable(getattr(policy, "initialize", None)):
        policy.initialize(1, num_kv_heads, head_dim, num_blocks, block_size, dtype, device)
    return policy


def minference_pieces(policy, q, k, v, ctx) -> tuple[dict[str, Callable], dict[str, Any]]:
    """One recorded call of MInference's prefill: its pieces (``estimate``, ``select``: the rest of
    ``build_index``, ``attention``: the sparse kernel with its ``dense_above`` check), each calling what the
    policy called with its arguments, and what it did (``path``, ``density``, ``attend_calls``: the sparse
    kernel's recorded launches). No pieces when it ran dense without an index."""
    import nanovllm_minference.policy as module
    from nanovllm_minference.index import computed_density

    ops = module._ops(q.device)
    estimate, attend = Recorder(ops.estimate), Recorder(ops.attend)
    recorded = ops._replace(estimate=estimate, attend=attend)
    build = Recorder(policy.build_index)
    with replaced(module, "_ops", lambda device: recorded), replaced(policy, "build_index", build):
        policy.compute_chunked_prefill(q, k, v, ctx)
    if not build.calls:
        return {}, {"path": "dense"}
    meta = ctx.meta
    density = computed_density(build.calls[0][2], meta.cu_seqlens_q, meta.context_lens, meta.max_query_len)
    ran_dense = attend.calls[0][2] is None
    canned = ops._replace(estimate=estimate.canned())

    def index_only():
        for (q_, ctx_, k_cache, tables, _), _kwargs, _ in build.calls:
            policy.build_index(q_, ctx_, k_cache, tables, canned)

    pieces = {"estimate": estimate.replay, "select": index_only, "attention": attend.replay}
    if not estimate.calls:  # a pattern that reads no keys
        del pieces["estimate"]
    return pieces, {"path": "dense (dense_above)" if ran_dense else "sparse", "density": density,
                    "attend_calls": attend.calls}


def xattn_pieces(policy, q, k, v, ctx) -> tuple[dict[str, Callable], dict[str, Any]]:
    """One recorded call of XAttention's prefill: its pieces (``estimate``: the antidiagonal scores,
    ``select``: ``select_blocks`` and the block lists, ``attention``: the block-sparse kernel), each calling
    what the policy called with its arguments, and what it did (``path``, ``density``)."""
    import nanovllm_xattn.policy as module

    block_scores, attend = (Recorder(fn) for fn in module._ops(q.device))
    lists, select = Recorder(module.block_lists), Recorder(policy.select)
    with (replaced(module, "_ops", lambda device: (block_scores, attend)),
          replaced(module, "block_lists", lists), replaced(policy, "select", select)):
        policy.compute_chunked_prefill(q, k, v, ctx)
    if not select.calls:
        return {}, {"path": "dense"}
    kept = causal = 0.0
    for (_, _, part, *_), _, mask in select.calls:  # every slice of the chunk
        part_kept, part_causal = xattn_kept_and_causal(part, mask, policy.config.block_size)
        kept, causal = kept + part_kept, causal + part_causal
    canned = block_scores.canned()

    def selection():
        for (q_, ctx_, part, key_cache, key_tables, _), _, _ in select.calls:
            policy.select(q_, ctx_, part, key_cache, key_tables, canned)
        lists.replay()

    pieces = {"estimate": block_scores.replay, "select": selection, "attention": attend.replay}
    if not block_scores.calls:  # an oracle mode
        del pieces["estimate"]
    return pieces, {"path": "sparse", "density": kept / causal if causal else 0.0}


PIECES = {"minference": minference_pieces, "xattn": xattn_pieces}


# -- the job: one shape, one planted density, every chunk ----------------------------------------------------


def bench_breakdown(job: dict) -> list[dict[str, Any]]:
    """Rows of one shape and planted density: per chunk, the dense call and each policy (see the module
    docstring)."""
    import torch

    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.engine.model_loading import make_backend
    from nanovllm.plugins import get_plugins
    from nanovllm.policy import PolicyContext
    from nanovllm.selection import resolve_attention_backend

    heads, kv_heads, head_dim = job["shape"]
    n, chunk, bs, device = job["context"], job["chunk"], job["block_size"], job["device"]
    dtype = getattr(torch, job["dtype"])
    if n % chunk or chunk % bs:
        raise ValueError(f"--context {n} in chunks of {chunk} with KV blocks of {bs}: give a context that is "
                         "a multiple of the chunk, and a chunk that is a multiple of the block size")
    gen = torch.Generator(device=device).manual_seed(job["seed"])
    q, k, v = planted_qkv(n, heads, kv_heads, head_dim, job["density"], job["planted_block"], gen, device,
                          dtype)
    width = n // bs
    table = torch.randperm(width, generator=gen, device=device).int()
    k_cache = torch.empty(width, bs, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[table.long()] = k.view(width, bs, kv_heads, head_dim)
    v_cache[table.long()] = v.view(width, bs, kv_heads, head_dim)
    backend = make_backend(resolve_attention_backend(job["backend"]), get_plugins(), torch.device(device),
                           dtype, head_dim, windowed=True)
    policies = {name: make_policy(job["policies"][name], kv_heads, head_dim, width, bs, dtype, device)
                for name in POLICIES}
    scale, rows = head_dim**-0.5, []
    base = {"shape": f"{heads}x{kv_heads}x{head_dim}", "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "context": n, "chunk": chunk, "planted_density": job["density"],
            "backend": backend.name}

    def timed(fn: Callable[[], Any]) -> dict[str, float]:
        return time_ms(fn, device, job["repeats"], job["warmup"])

    def measure(fn: Callable[[], Any]) -> dict[str, float]:
        return {**timed(fn), **gpu_activity(fn, device)}

    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = start + chunk
            cu, lens = (torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, chunk], [end]))
            meta = PhaseMetadata(cu, lens, table[None, : -(-end // bs)], chunk, end)
            rows_q, new_k, new_v = q[start:end], k[start:end], v[start:end]
            ctx = PolicyContext(0, True, rows_q, meta, k_cache, v_cache, scale, backend, None, new_k, new_v,
                                torch.arange(start, end, device=device))
            dense = None
            for name in POLICIES:
                policy = policies[name]

                def whole(policy=policy):
                    return policy.compute_chunked_prefill(rows_q, new_k, new_v, ctx)

                pieces, did = PIECES[name](policy, rows_q, new_k, new_v, ctx) if name in PIECES else ({}, {})
                row = {**base, "benchmark": "chunk", "history": start, "policy": name,
                       "selection": job["policies"][name], "path": did.get("path", "dense"),
                       "density": did.get("density", 1.0), **measure(whole)}
                if pieces:
                    row["pieces"] = {piece: measure(fn) for piece, fn in pieces.items()}
                dense = dense or row
                row["dense_ms"] = dense["ms"]
                row["vs_dense"] = row["ms"] / dense["ms"]
                row["ceiling_ms"] = dense["ms"] * (row["density"] if row["path"] == "sparse" else 1.0)
                rows.append(row)
                print(f"{base['shape']} history {start}: {name} {row['path']} {row['ms']:.3f} ms",
                      file=sys.stderr, flush=True)
                if job.get("configs") and start > 0 and name == "minference" and row["path"] == "sparse":
                    rows += config_rows(base, start, "sparse", sparse_calls(did["attend_calls"]),
                                        SPARSE_CONFIGS, timed)
            if job.get("configs") and start > 0:
                rows += config_rows(base, start, "dense", dense_calls(rows_q, k_cache, v_cache, meta, scale),
                                    DENSE_CONFIGS, timed)
    return rows


def dense_calls(q, k_cache, v_cache, meta, scale) -> Callable[[Any], Any]:
    """A call of the dense Triton prefill kernel on one chunk over the paged cache, as the Triton backend
    makes it, with knobs ``config`` (None: the kernel's own): its output."""
    import torch

    from nanovllm.attention import triton_kernels as tk

    def call(config):
        out = torch.empty_like(q)
        tk.attention_rows(q, k_cache, v_cache, out, None, meta.cu_seqlens_q, meta.context_lens,
                          meta.block_tables, None, meta.max_query_len, scale, paged=True, causal=True,
                          config=config)
        return out
    return call


def sparse_calls(recorded: list) -> Callable[[Any], Any]:
    """MInference's recorded sparse-kernel launches made again, with knobs ``config`` (None: the kernel's
    own): the last one's output."""
    from nanovllm_minference.attention import sparse_attention

    def call(config):
        return [sparse_attention(*args, **kwargs, config=config)[0] for args, kwargs, _ in recorded][-1]
    return call


def config_rows(base: dict, history: int, kernel: str, call: Callable[[Any], Any], configs: dict,
                measure: Callable) -> list[dict[str, Any]]:
    """One row per setting of ``configs`` and the default: its time, and its output's largest difference from
    the default's (a setting that Triton cannot compile, e.g. out of shared memory, gets ``error``)."""
    reference = call(None)
    rows = []
    for name, config in {"default": None, **configs}.items():
        row = {**base, "benchmark": "config", "history": history, "kernel": kernel, "config": name}
        try:
            out = call(config)
            row["max_diff"] = float((out.float() - reference.float()).abs().max())
            row.update(measure(lambda config=config: call(config)))
        except Exception as exc:  # noqa: BLE001 (Triton's compile errors have no common base)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
        print(f"{base['shape']} history {history}: {kernel} {name} {row.get('ms', row.get('error'))}",
              file=sys.stderr, flush=True)
    default_ms = rows[0].get("ms")
    for row in rows:
        if default_ms and "ms" in row:
            row["vs_default"] = row["ms"] / default_ms
    return rows


def jobs(args: argparse.Namespace) -> list[dict]:
    """One job per shape and planted density."""
    shapes = [(args.heads, args.kv_heads, args.head_dim), *args.compare]
    policies = {"full": "full", "minference": args.minference, "xattn": args.xattn}
    common = {"context": args.context, "chunk": args.chunk, "block_size": args.block_size,
              "dtype": args.dtype, "device": args.device, "backend": args.backend, "policies": policies,
              "repeats": args.repeats,
              "warmup": args.warmup, "planted_block": args.planted_block, "seed": 0, "configs": args.configs}
    return [{"kind": "breakdown", "shape": list(shape), "density": density, **common}
            for shape in shapes for density in args.densities]


def run_job(job: dict) -> list[dict[str, Any]]:
    return bench_breakdown(job)


# -- results -------------------------------------------------------------------------------------------------


def with_totals(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, then per shape, planted density and policy a ``prompt`` row: its chunks' times and ceilings
    summed (one layer's share of the prompt's TTFT)."""
    out, groups = list(results), {}
    for r in (r for r in results if r.get("benchmark") == "chunk" and "error" not in r):
        groups.setdefault((r["shape"], r["planted_density"], r["policy"]), []).append(r)
    for (shape, planted, policy), rows in groups.items():
        total = {key: sum(r[key] for r in rows) for key in ("ms", "queued_ms", "dense_ms", "ceiling_ms")}
        out.append({"benchmark": "prompt", "shape": shape, "planted_density": planted, "policy": policy,
                    "chunks": len(rows), "sparse_chunks": sum(r["path"] == "sparse" for r in rows), **total,
                    "extra_ms": total["ms"] - total["dense_ms"]})
    return out


def cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def piece_cell(row: dict, name: str, key: str = "ms") -> str:
    return cell(row.get("pieces", {}).get(name, {}).get(key))


def markdown(payload: dict[str, Any], title: str) -> str:
    env, settings = payload["environment"], payload["settings"]
    layers = settings.get("full_layers", 3)
    intro = (f"One prompt of {settings['context']} tokens in chunks of {settings['chunk']}, one "
             f"full-attention layer, KV blocks of {settings['block_size']}, {settings['dtype']}; shape: "
             "query heads x KV heads x head size. Planted: the share of key blocks that hold most of the "
             "attention (see the script's docstring).")
    legend = ("ms: one call from an idle GPU (CUDA events, median); queued: per call of several back to "
              "back; density: what the policy selected; ceiling: dense ms x density (x 1 where the policy "
              "ran dense); estimate, select (MInference: the index), attention: the policy's own calls timed "
              "alone; busy: GPU time of one profiled call; host: the host's time to make a call (launches "
              "and waits; above busy, the GPU waits on the host); launches and syncs: the GPU operations and "
              "host waits of one call (whole call, then estimate / select / attention).")
    lines = [f"# {title}", "",
             f"{env['device']}, {env['date']}, commit {env['commit']}, torch {env['torch']}.",
             intro, "", "## Per chunk (ms)", "", legend, "",
             "| shape | planted | history | policy | path | density | ms | vs dense | queued | ceiling | "
             "over ceiling | estimate | select | attention | busy | host | launches | syncs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r.get("benchmark") == "config":
            continue
        if "error" in r:
            lines.append(markdown_row([r.get("shape", "-"), r.get("density", "-"), "-", "-", r["error"]]))
            continue
        if r["benchmark"] != "chunk":
            continue

        def with_pieces(key: str, r=r) -> str:
            whole = cell(r.get(key))
            if not r.get("pieces") or key not in r:
                return whole
            return f"{whole} ({' / '.join(piece_cell(r, p, key) for p in PIECE_NAMES)})"

        lines.append(markdown_row([
            r["shape"], cell(r["planted_density"], 2), r["history"], r["policy"], r["path"],
            cell(r["density"]), cell(r["ms"]), cell(r["vs_dense"], 2), cell(r["queued_ms"]),
            cell(r["ceiling_ms"]),
            cell(r["ms"] - r["ceiling_ms"]), *(piece_cell(r, p) for p in PIECE_NAMES), cell(r.get("busy_ms")),
            cell(r["host_ms"]), with_pieces("launches"), with_pieces("syncs")]))
    lines += ["", "## Per prompt: the chunks summed (ms, one layer)", "",
              f"Extra: the policy's time over dense's; x {layers} layers: what the policy adds to the TTFT "
              f"of a model with {layers} such layers (Gemma 3 270M: 3 full-attention layers).", "",
              "| shape | planted | policy | sparse chunks | ms | queued | dense | ceiling | extra | "
              f"extra x {layers} layers |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        if r.get("benchmark") == "prompt":
            lines.append(markdown_row([
                r["shape"], cell(r["planted_density"], 2), r["policy"], f"{r['sparse_chunks']}/{r['chunks']}",
                cell(r["ms"]), cell(r["queued_ms"]), cell(r["dense_ms"]), cell(r["ceiling_ms"]),
                cell(r["extra_ms"]), cell(r["extra_ms"] * layers)]))
    return "\n".join(lines + config_table(payload["results"])) + "\n"


def config_table(results: list[dict[str, Any]]) -> list[str]:
    """``--configs``: per shape and kernel, each setting's ms per chunk with history, their sum and its
    ratio to the default's, and its output's largest difference from the default's."""
    rows = [r for r in results if r.get("benchmark") == "config"]
    if not rows:
        return []
    histories = sorted({r["history"] for r in rows})
    lines = ["", "## Kernel settings (ms per chunk, one layer)", "",
             "The dense Triton prefill kernel (paged, causal) and MInference's sparse kernel on its recorded "
             "index, on the chunks with history; default: the kernel's own choice for the shape.", "",
             "| shape | kernel | setting | " + " | ".join(f"history {h}" for h in histories)
             + " | sum | vs default | max diff |", "|---|---|---|" + "---|" * (len(histories) + 3)]
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        settings = groups.setdefault((r["shape"], r["planted_density"], r["kernel"]), {})
        settings.setdefault(r["config"], []).append(r)
    for (shape, _, kernel), settings in groups.items():
        default_sum = None
        for name, rs in settings.items():
            by_history = {r["history"]: r for r in rs}
            cells = [cell(by_history[h].get("ms")) if h in by_history else "-" for h in histories]
            errors = [r["error"] for r in rs if "error" in r]
            total = None if errors else sum(r["ms"] for r in rs)
            default_sum = total if name == "default" else default_sum
            ratio = cell(total / default_sum, 3) if total and default_sum else (errors[0] if errors else "-")
            diff = cell(max(r["max_diff"] for r in rs), 4) if not errors else "-"
            lines.append(markdown_row([shape, kernel, name, *cells, cell(total), ratio, diff]))
    return lines


def chart(payload: dict[str, Any], path: Path) -> None:
    """Per shape and planted density, per chunk: stacked bars of each sparse policy's pieces (and the rest of
    its call), next to the dense call, with each policy's ceiling marked."""
    rows = [r for r in payload["results"] if r.get("benchmark") == "chunk" and "error" not in r]
    groups = list(dict.fromkeys((r["shape"], r["planted_density"]) for r in rows))
    fig, axes = subplots(1, max(len(groups), 1), figsize=(6.5 * max(len(groups), 1), 4.5), squeeze=False)
    colors = {"dense": "tab:purple", "estimate": "tab:orange", "select": "tab:green", "attention": "tab:blue",
              "rest": "tab:gray"}
    for ax, (shape, planted) in zip(axes[0], groups, strict=False):
        mine = [r for r in rows if (r["shape"], r["planted_density"]) == (shape, planted)]
        histories = sorted({r["history"] for r in mine})
        width = 0.8 / len(POLICIES)
        labelled = set()
        for p, policy in enumerate(POLICIES):
            for h, history in enumerate(histories):
                r = next((r for r in mine if r["policy"] == policy and r["history"] == history), None)
                if r is None:
                    continue
                x, bottom = h + (p - 1) * width, 0.0
                parts = {name: piece["ms"] for name, piece in r.get("pieces", {}).items()}
                parts["dense" if policy == "full" else "rest"] = max(r["ms"] - sum(parts.values()), 0.0)
                for name, ms in parts.items():
                    label = name if name not in labelled else None
                    labelled.add(name)
                    ax.bar(x, ms, width, bottom=bottom, color=colors[name], label=label,
                           edgecolor="black", linewidth=0.3)
                    bottom += ms
                if policy != "full":
                    ax.hlines(r["ceiling_ms"], x - width / 2, x + width / 2, colors="red")
                ax.text(x, bottom, policy[0].upper(), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(histories)), [f"{h / 1024:g}K" for h in histories])
        ax.set_xlabel("history before the chunk (F: full, M: MInference, X: XAttention; red: ceiling)")
        ax.set_ylabel("ms per chunk, one layer")
        ax.set_title(f"{shape}, planted {planted}", fontsize=9)
        ax.legend(fontsize=7)
    save(fig, path, "prefill_breakdown", payload["environment"])


def shape_arg(text: str) -> tuple[int, int, int]:
    """``H,HKV,D``, e.g. ``32,8,128``."""
    try:
        heads, kv_heads, head_dim = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give query heads, KV heads and head size, e.g. 32,8,128") from None
    if heads % kv_heads:
        raise argparse.ArgumentTypeError(f"{text!r}: the query heads must be a multiple of the KV heads")
    return heads, kv_heads, head_dim


def parser() -> argparse.ArgumentParser:
    import torch

    p = argparse.ArgumentParser(prog="python benchmarks/prefill_breakdown.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, default=GEMMA3_270M[0])
    p.add_argument("--kv-heads", type=int, default=GEMMA3_270M[1])
    p.add_argument("--head-dim", type=int, default=GEMMA3_270M[2])
    p.add_argument("--compare", nargs="*", type=shape_arg, default=[(32, 8, 128)],
                   help="more shapes as H,HKV,D (default: llama-3.1-8b's 32,8,128; --compare alone: none)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192,
                   help="tokens per prefill chunk (max_num_batched_tokens)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--densities", nargs="+", type=float, default=[0.36],
                   help="planted: the share of key blocks holding most of the attention (about what "
                   "XAttention at threshold 0.9 keeps)")
    p.add_argument("--random", dest="densities", action="store_const", const=[None],
                   help="plain random q/k/v instead of planted structure (near-uniform attention)")
    p.add_argument("--planted-block", type=int, default=128, help="tokens per planted block (XAttention's)")
    p.add_argument("--minference", default="minference:dense_below=0",
                   help="MInference's sparse_policy selection")
    p.add_argument("--xattn", default="xattn:threshold=0.9", help="XAttention's sparse_policy selection")
    p.add_argument("--backend", default="auto", help="attention_backend, as the engine takes it")
    p.add_argument("--full-layers", type=int, default=3,
                   help="layers the policies run on, for the per-prompt sum")
    p.add_argument("--configs", action="store_true",
                   help="also time the dense and MInference kernels' knob settings (DENSE_CONFIGS, "
                   "SPARSE_CONFIGS) on every chunk with history")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="prefill_breakdown")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.job:
        return job_main(run_job, args.job)
    settings = vars(args) | {"job": None, "compare": [list(s) for s in args.compare]}
    return run_jobs(jobs(args), __file__, Path(args.out), args.name, settings, with_totals, markdown, chart)


if __name__ == "__main__":
    sys.exit(main())
