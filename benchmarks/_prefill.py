"""What the sparse-prefill scripts share: one prompt's paged inputs and the dense prefill kernel's times on
them (the reference of every kernel row), the end-to-end time-to-first-token jobs, their rows against
``full`` at the same context and their table, the work the policies selected, and the kernel chart of time
over density. Not a script."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
from _plot import save, subplots
from nanovllm.bench import markdown_row, offload


@attrs.define(frozen=True)
class PagedPrompt:
    """One fresh prompt of ``n`` tokens: its new ``q``/``k``/``v`` and the paged caches that hold every key
    and value, its blocks in a shuffled order (``tables [1, n // block_size]``), with the phase's lengths
    and metadata."""

    q: Any
    k: Any
    v: Any
    k_cache: Any
    v_cache: Any
    tables: Any
    cu_seqlens_q: Any
    context_lens: Any
    meta: Any


def paged_prompt(n: int, heads: int, kv_heads: int, head_dim: int, block_size: int, gen, device: str = "cuda",
                 dtype=None) -> PagedPrompt:
    """Random bfloat16 (by default) inputs of one prompt; ``n`` a multiple of ``block_size``. ``gen`` draws
    q, k and v, then the block order."""
    import torch

    from nanovllm.attention.metadata import PhaseMetadata

    if n % block_size:
        raise ValueError(f"a prompt of {n} tokens in blocks of {block_size}: give a multiple of block_size")
    dtype = dtype or torch.bfloat16
    q, k, v = (torch.randn(n, h, head_dim, generator=gen, device=device, dtype=dtype)
               for h in (heads, kv_heads, kv_heads))
    width = n // block_size
    tables = torch.randperm(width, generator=gen, device=device).int()[None, :]
    k_cache = torch.empty(width, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables[0].long()] = k.view(width, block_size, kv_heads, head_dim)
    v_cache[tables[0].long()] = v.view(width, block_size, kv_heads, head_dim)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    return PagedPrompt(q, k, v, k_cache, v_cache, tables, cu, lens, PhaseMetadata(cu, lens, tables, n, n))


def staged_cache(p: PagedPrompt) -> Callable[[], tuple[Any, Any, Any]] | None:
    """A function that copies the prompt's context into the ``triton`` backend's staged pages of 128 tokens,
    as the engine's sparse policies read it over smaller cache pages (``PolicyContext.read_staged``), and
    returns ``(k_pages, v_pages, block_tables)``; None where the backend stages nothing (pages of 128 tokens
    or more, a GPU without TMA)."""
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.triton_backend import TritonBackend

    n = p.q.shape[0]
    block_size, kv_heads, head_dim = p.k_cache.shape[1:]
    backend = TritonBackend()
    backend.reserve_workspace(kv_heads, head_dim, block_size, p.k_cache.dtype, p.k_cache.device, n)
    if backend.workspace is None:
        return None
    meta = PhaseMetadata(p.cu_seqlens_q, p.context_lens, p.tables, n, n, (n,), (n,))
    return lambda: backend.staged_cache(p.k_cache, p.v_cache, meta)


def kernel_ms(fn: Callable[[], Any], min_runs: int = 10) -> float:
    """Median ms of ``fn`` on the GPU over at least ``min_runs`` runs (the plugins' kernel rows all time this
    way). ``do_bench`` runs as many as fit its time budget, which is a single run of a 128K prefill."""
    from triton.testing import do_bench

    once = do_bench(fn, warmup=1, rep=1, return_mode="median")
    return do_bench(fn, warmup=3, rep=max(20.0, min_runs * once), return_mode="median")


def dense_prefill_ms(prompt: PagedPrompt, scale: float, history: int = 64,
                     contiguous: bool = True) -> dict[str, float]:
    """The dense Triton prefill kernel on ``prompt``: ``dense_ms`` reads the fresh prompt's contiguous keys
    (left out without ``contiguous``: it does not depend on the cache's block size); ``dense_paged_ms`` is
    the same prompt behind a ``history``-token prefix, the paged kernel that every chunk after the first runs
    (the cache reads of a sparse kernel; ``history`` fewer query rows)."""
    import torch

    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.triton_backend import TritonBackend

    p, n = prompt, prompt.q.shape[0]
    dense = TritonBackend()
    dense.sdpa_prefill = False
    times = {}
    if contiguous:
        times["dense_ms"] = kernel_ms(lambda: dense.prefill(p.q, p.k, p.v, p.k_cache, p.v_cache, p.meta,
                                                            scale))
    chunk_cu = torch.tensor([0, n - history], dtype=torch.int32, device=p.q.device)
    chunk = PhaseMetadata(chunk_cu, p.context_lens, p.tables, n - history, n)
    new = slice(history, None)
    times["dense_paged_ms"] = kernel_ms(lambda: dense.prefill(p.q[new], p.k[new], p.v[new], p.k_cache,
                                                             p.v_cache, chunk, scale))
    return times


def bench_ttft(preset: str, context: int, policy: str, rounds: int = 1) -> list[dict[str, Any]]:
    """The ``ttft`` job: the engine end to end, the time to the first token of one prompt under ``policy``,
    KV on the GPU, after a first prompt as long has compiled every kernel it meets (``ttft_first_s``: a
    policy's kernels run only past some length, and compile on first use). With ``rounds`` > 1, ``ttft_s``
    is the median of as many prompts timed one after another."""
    row = offload.bench_decode(preset, context, 1, 1, False, full_warm_up=True, ttft_rounds=rounds,
                               sparse_policy=policy)
    return [{**row, "benchmark": "ttft", "policy": policy}]


def bench_ttft_paired(preset: str, context: int, policies: list[str], rounds: int) -> list[dict[str, Any]]:
    """The ``ttft-paired`` job: :func:`bench_paired_ttft`, the policies' engines in one process taking turns on
    each round's prompt; ``paired_speedup`` is the median of the rounds' speedups."""
    rows = bench_paired_ttft(preset, context, policies, rounds)
    for row in rows[1:]:
        row["paired_speedup"] = statistics.median(row["speedup_rounds"])
    return [{**row, "benchmark": "ttft", "paired_with": policies[0]} for row in rows]


def bench_paired_ttft(
    model: str, context: int, policies: list[str], rounds: int, prompt_ids: list[int] | None = None,
    profile_top: int = 0, work: bool = False, **engine_options: Any,
) -> list[dict[str, Any]]:
    """TTFT of one prompt of ``context`` tokens under each of ``policies`` (``sparse_policy`` selections), KV
    on the GPU: one engine per policy in this process, each with KV for that prompt alone. After a first
    prompt as long on each (``ttft_first_s``: the compiles), ``rounds`` rounds in which every engine in turn
    times the round's fresh prompt. The engines of a round share the process and the moment, which rows of
    separate processes do not. A row per
    policy: ``ttft_s`` the median of ``ttft_rounds_s``; after the first, ``speedup_rounds``: the first
    policy's TTFT over this one's, round by round. ``prompt_ids``: a prompt (its first ``context`` tokens
    or as many as fit) timed in every round instead of fresh random ones; prefix caching is off.
    ``profile_top`` > 0 (CUDA): after the rounds, one more run per engine under the torch profiler, its row's
    ``profile`` (:func:`profiled_ttft`). ``work``: then one more run per engine whose policy's selections are
    recorded, its row's ``work`` (:func:`work_by_chunk`; empty for a policy that selects nothing)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if len(policies) < 2:
        raise ValueError(f"give at least two policies to pair, got {policies!r}")
    shape = offload.model_shape(model, engine_options)
    prompt_len, options = offload.plan_run(shape, context, 1, 1, False, engine_options)
    if "kv_cache_memory" not in options:  # each engine holds KV for its one prompt, and no more
        options["kv_cache_memory"] = offload.kv_bytes(1, options["max_model_len"], offload.engine_option(options, "block_size"),
                                              shape.kv_bytes_per_token)
    from nanovllm import LLM

    if prompt_ids is None:
        first, *timed = offload.random_prompts(rounds + 1, prompt_len, shape.vocab_size)
    elif len(prompt_ids) < prompt_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens, fewer than the {prompt_len} to time")
    else:
        first, *timed = [prompt_ids[:prompt_len]] * (rounds + 1)
    engines = [LLM(model, **options, sparse_policy=policy) for policy in policies]
    times: list[list[float]] = [[] for _ in policies]
    for prompt in [first, *timed]:
        for llm, seconds in zip(engines, times, strict=True):
            seconds.append(offload.ttft_alone(llm, [prompt]))
    profiles = [profiled_ttft(llm, first, profile_top) for llm in engines] if profile_top > 0 else None
    works = []
    for llm in engines if work else ():
        with recorded_work() as selections:
            offload.ttft_alone(llm, [first])
        works.append(work_by_chunk(selections))
    del engines, llm
    offload.free_memory()
    rows = []
    for policy, (first_s, *rounds_s) in zip(policies, times, strict=True):
        row = {"preset": model, "context": context, "prompt_len": prompt_len, "policy": policy,
               "settings": options, "ttft_first_s": first_s, "ttft_rounds_s": rounds_s,
               "ttft_s": statistics.median(rounds_s)}
        if profiles:
            row["profile"] = profiles[len(rows)]
        if works:
            row["work"] = works[len(rows)]
        if rows:
            row["speedup_rounds"] = [a / b for a, b in zip(times[0][1:], rounds_s, strict=True)]
        rows.append(row)
    return rows


def profiled_ttft(llm: Any, prompt: list[int], top: int) -> dict[str, Any]:
    """One TTFT of ``prompt`` under the torch profiler (CUDA): its wall time, the device's busy time (every
    kernel, copy and fill) and the host's (every op's own CPU time), in ms, and the ``top`` kernels by device
    time. A TTFT well above the device time is time the device waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = offload.ttft_alone(llm, [prompt])
    events = prof.key_averages()
    on_device = sorted((e for e in events if e.self_device_time_total > 0 and not e.key.startswith("aten::")),
                       key=lambda e: -e.self_device_time_total)
    return {"wall_ms": 1000 * wall_s, "device_ms": sum(e.self_device_time_total for e in on_device) / 1000,
            "host_ms": sum(e.self_cpu_time_total for e in events) / 1000,
            "kernels_ms": {e.key[:80]: e.self_device_time_total / 1000 for e in on_device[:top]}}


def xattn_kept_and_causal(part: Any, mask: Any, block: int) -> tuple[float, float]:
    """XAttention's selection ``mask`` of one slice ``part`` of a chunk: the key blocks it keeps and the causal
    blocks it could keep."""
    from nanovllm_xattn.layout import first_query_blocks
    from nanovllm_xattn.selection import causal_blocks

    first = first_query_blocks(part.cu_seqlens_q, part.context_lens, block)
    causal = causal_blocks(mask, first, part.context_lens, block)[0].expand_as(mask)
    return float(mask.sum()), float(causal.sum())


@contextlib.contextmanager
def recorded_work() -> Iterator[list[dict[str, Any]]]:
    """Inside the block, each prefill call of the MInference and XAttention policies (those installed) adds a
    row: ``policy``, ``layer``, ``context`` (the chunk's longest), ``path`` (``dense``: no selection made;
    ``dense (dense_above)``: MInference's index was too dense and its kernel ran dense; ``sparse``) and
    ``density``: MInference's index work over dense causal work, XAttention's kept blocks over causal
    blocks (1 where no selection was made). Measuring reads values back from the GPU: time nothing here."""
    rows: list[dict[str, Any]] = []
    originals: list[tuple[type, str, Callable]] = []

    def patch(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
        originals.append((cls, name, getattr(cls, name)))
        setattr(cls, name, make(getattr(cls, name)))

    def entry(name: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def call(self, q, k, v, ctx):
                rows.append({"policy": name, "layer": ctx.layer_id, "context": ctx.meta.max_context_len,
                             "path": "dense", "density": 1.0, "kept": 0.0, "causal": 0.0})
                return original(self, q, k, v, ctx)
            return call
        return make

    with contextlib.suppress(ImportError):
        from nanovllm_minference.index import computed_density
        from nanovllm_minference.policy import MInferencePolicy

        def index_of(original: Callable) -> Callable:
            def build(self, q, ctx, *args):
                index = original(self, q, ctx, *args)
                meta, limit = ctx.meta, self.config.dense_above
                density = float(computed_density(index, meta.cu_seqlens_q, meta.context_lens,
                                                 meta.max_query_len))
                path = "dense (dense_above)" if limit is not None and density > limit else "sparse"
                rows[-1].update(path=path, density=density)
                return index
            return build

        patch(MInferencePolicy, "compute_chunked_prefill", entry("minference"))
        patch(MInferencePolicy, "build_index", index_of)
    with contextlib.suppress(ImportError):
        from nanovllm_xattn.policy import XAttentionPolicy

        def selection_of(original: Callable) -> Callable:
            def select(self, q, ctx, part, *args):
                mask = original(self, q, ctx, part, *args)
                kept, causal = xattn_kept_and_causal(part, mask, self.config.block_size)
                row = rows[-1]
                row.update(path="sparse", kept=row["kept"] + kept, causal=row["causal"] + causal)
                row["density"] = row["kept"] / row["causal"] if row["causal"] else 0.0
                return mask
            return select

        patch(XAttentionPolicy, "compute_chunked_prefill", entry("xattn"))
        patch(XAttentionPolicy, "select", selection_of)
    try:
        yield rows
    finally:
        for cls, name, original in reversed(originals):
            setattr(cls, name, original)


def work_by_chunk(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`recorded_work`'s rows per chunk (by context): the layers' paths and densities, and their mean
    density."""
    chunks: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        chunks.setdefault(r["context"], []).append(r)
    return [{"context": context, "layers": [r["layer"] for r in rs], "paths": [r["path"] for r in rs],
             "densities": [r["density"] for r in rs], "density": statistics.mean(r["density"] for r in rs)}
            for context, rs in sorted(chunks.items())]


def with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kernel rows, where the run timed the dense paged kernel, with their time over its (``ratio_paged``);
    TTFT rows with their speedup over ``full`` at the same context."""
    out = []
    for r in results:
        r = dict(r)
        if r["benchmark"] == "kernel" and "ratio" in r:
            if "dense_paged_ms" in r:
                r["ratio_paged"] = r["sparse_ms"] / r["dense_paged_ms"]
        elif (speedup := ttft_speedup(r, results)) is not None:
            r["speedup"] = speedup
        out.append(r)
    return out


def ttft_speedup(row: dict[str, Any], results: list[dict[str, Any]]) -> float | None:
    """``full``'s TTFT over this row's, at the same context (a paired row: the median of its rounds' speedups
    over the policy it was paired with); None without both."""
    if row.get("benchmark") != "ttft" or "ttft_s" not in row or row.get("policy") == "full":
        return None
    if "paired_speedup" in row:
        return row["paired_speedup"]
    dense = next((d for d in results if d.get("benchmark") == "ttft" and d.get("policy") == "full"
                  and d.get("context") == row["context"] and d.get("preset") == row.get("preset")
                  and "ttft_s" in d), None)
    return None if dense is None else dense["ttft_s"] / row["ttft_s"]


def ttft_table(results: list[dict[str, Any]], heading: str) -> list[str]:
    """The markdown section of the TTFT rows (an error in place of a time where a job failed)."""
    lines = ["", f"## {heading}", "",
             "TTFT after a first prompt as long (timed in the last column, with the compiles of the kernels "
             "it met first).", "",
             "Rounds: the prompts timed one after another, each of its own; TTFT is their median. Paired "
             "rows (`ttft-paired`): engines in one process taking turns on each round's prompt; their "
             "speedup is the median of the rounds' speedups over the first engine's policy.", "",
             "| context | model, prompt | policy | TTFT s | speedup vs full | rounds s | speedup by round | "
             "first prompt s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["benchmark"] == "ttft":
            result = r.get("error") or f"{r['ttft_s']:.3f}"
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
            rounds = ", ".join(f"{t:.3f}" for t in r.get("ttft_rounds_s", [])) or "-"
            by_round = ", ".join(f"{x:.3f}x" for x in r.get("speedup_rounds", [])) or "-"
            first = f"{r['ttft_first_s']:.3f}" if "ttft_first_s" in r else "-"
            cells = [r["context"], ttft_model(r), r["policy"], result, speed, rounds, by_round, first]
            lines.append(markdown_row(cells))
    return lines


def ttft_model(row: dict[str, Any]) -> str:
    """A TTFT row's model and prompt, as the tables and charts name them."""
    return f"{row.get('preset', '-')}, {row.get('prompt', 'random tokens')}"


def density_chart(payload: dict[str, Any], path: Path, name: str, xlabel: str, ylabel: str) -> None:
    """Kernel rows (``density``, ``ratio``), one line per context (and KV block size and kernel config where
    rows name them), and the line of time proportional to density."""
    kernel = [r for r in payload["results"] if r["benchmark"] == "kernel" and "ratio" in r]
    fig, ax = subplots(figsize=(7, 4.5))

    def line(r):  # one line per context, and per KV block size and kernel config where rows name them
        return r["context"], r.get("kv_block_size", 0), r.get("config", "")

    for key in sorted({line(r) for r in kernel}):
        n, block_size, config = key
        pts = sorted((r["density"], r["ratio"]) for r in kernel if line(r) == key)
        label = " ".join([f"{n // 1024}K", *([f"blocks of {block_size}"] if block_size else []), config])
        ax.plot(*zip(*pts, strict=True), marker="o", label=label.strip())
    xs = [0, max((r["density"] for r in kernel), default=1)]
    ax.plot(xs, xs, "r--", label="time proportional to density")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    save(fig, path, name, payload["environment"])
