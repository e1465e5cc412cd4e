"""``nanovllm bench offload``: the KV offload engine (every layer's KV in a pinned host pool) on a shape preset.

Jobs, each in its own process:

- ``offload-copy``: this machine's pinned copy rate: host-to-device and device-to-host copies of
  ``copy_mib`` MiB between pinned host memory and the GPU, one direction alone and both at once (two
  streams), GB/s.
- ``offload-decode``: the offload engine at one context and batch. The prompts are prefilled (TTFT: until
  every sequence has its first token), then ``steps`` decode steps are timed. A dense decode step reads
  every sequence's whole history from the pool, ``kv_tokens x kv_bytes_per_token`` host-to-device bytes
  (``kv_bytes_per_token = 2 x layers x kv_heads x head_dim x itemsize``; ``h2d_bytes_per_step`` counts the
  layers in the pool only, not those a policy runs dense nor a hybrid model's sliding-window layers); its
  floor is those bytes at the measured host-to-device copy rate. The new tokens' K/V go the other way,
  ``batch x kv_bytes_per_token``. A row whose pool would take more than ``HOST_MEMORY_FRACTION`` of the
  host's RAM is skipped, with that reason.
- ``offload-resident``: the same measurement with the KV cache on the GPU (batch 1): the TTFT that
  offload's is held against, and the decode step from HBM.
- ``offload-small``: a GPU made small: ``gpu_memory_utilization`` leaves at most ``small_kv_gib`` GiB for KV
  after the weights. The GPU-resident engine refuses the longest context; the offload engine runs it with
  its load slots as the only GPU memory for KV.

:func:`with_ratios` adds what needs two jobs' rows, when the results are written: each decode row's floor
against the copy rate, and offload TTFT against resident TTFT. On the CPU every path runs, with a host
memcpy in place of PCIe and ``kv_cache_memory`` in place of the small GPU; the ratios then mean nothing.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from typing import Any

import attrs
import torch

from nanovllm.bench import fmt, markdown_row
from nanovllm.bench.engine import sync
from nanovllm.config import EngineConfig

HOST_MEMORY_FRACTION = 0.7  # the most of the host's RAM a pool may pin; the OS and page cache need the rest
# what the engine's memory profile counts besides weights and KV (CUDA context, the largest step's
# activations), in GiB: the small GPU's utilisation includes it, so about small_kv_gib is left for KV (the
# refusal message states the budget left)
ACTIVATION_HEADROOM_GIB = 8.5


def jobs(
    presets: list[str], contexts: list[int], batches: list[int], steps: int, copy_mib: int,
    small_kv_gib: float, engine_options: dict[str, Any], host_memory_fraction: float = HOST_MEMORY_FRACTION,
) -> list[dict]:
    """The copy rate first, then per preset: per context the GPU-resident reference and the offload
    engine at each batch, then the small GPU at the longest context, without and with offload."""
    for name, values in (("--contexts", contexts), ("--batches", batches), ("--decode-steps", [steps])):
        if any(v < 1 for v in values):
            raise ValueError(f"{name} takes positive numbers, got {values}")
    sizes = {"steps": steps, **engine_options}
    out: list[dict] = [{"kind": "offload-copy", "options": {"copy_mib": copy_mib}}]
    for preset in presets:
        for context in contexts:
            out.append({"kind": "offload-resident", "preset": preset,
                        "options": {"context": context, "batch": 1, **sizes}})
            out += [{"kind": "offload-decode", "preset": preset, "options": {
                "context": context, "batch": b, "host_memory_fraction": host_memory_fraction, **sizes}}
                for b in batches]
        out += [{"kind": "offload-small", "preset": preset,
                 "options": {"context": max(contexts), "offload": o, "small_kv_gib": small_kv_gib, **sizes}}
                for o in (False, True)]
    return out


# -- the pinned copy rate ---------------------------------------------------------------------------------


def bench_copy(copy_mib: int = 1024, repeats: int = 5) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    n = copy_mib * 2**20

    def host() -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=cuda)

    def device() -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device="cuda" if cuda else "cpu")

    h2d, d2h = (device(), host()), (host(), device())
    [t_h2d], [t_d2h] = _copy_seconds([h2d], repeats), _copy_seconds([d2h], repeats)
    both = _copy_seconds([h2d, d2h], repeats)
    row = {
        "benchmark": "offload-copy", "preset": "-",
        "settings": {"copy_mib": copy_mib, "repeats": repeats, "pinned": cuda},
        "h2d_gbs": n / t_h2d / 1e9, "d2h_gbs": n / t_d2h / 1e9,
        "both_h2d_gbs": n / both[0] / 1e9, "both_d2h_gbs": n / both[1] / 1e9, "both_total_gbs": 2 * n / max(both) / 1e9,
    }
    if not cuda:
        row["note"] = "No CUDA device: a host memcpy between plain tensors, the two directions one after the other"
    del h2d, d2h
    gc.collect()
    return row


def _copy_seconds(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> list[float]:
    """Median seconds of each ``(dst, src)`` copy. On CUDA the copies of a round run at once, each on its
    own stream, timed from one start event; on the CPU one after the other. The first round warms up."""
    cuda = any(t.is_cuda for pair in pairs for t in pair)
    times: list[list[float]] = [[] for _ in pairs]
    streams = [torch.cuda.Stream() for _ in pairs] if cuda else []
    for _ in range(repeats + 1):
        if not cuda:
            for (dst, src), spent in zip(pairs, times, strict=True):
                start = time.perf_counter()
                dst.copy_(src)
                spent.append(time.perf_counter() - start)
            continue
        torch.cuda.synchronize()
        start_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
        ends = []
        for (dst, src), stream in zip(pairs, streams, strict=True):
            stream.wait_event(start_event)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record(stream)
        torch.cuda.synchronize()
        for end, spent in zip(ends, times, strict=True):
            spent.append(start_event.elapsed_time(end) / 1000)
    return [statistics.median(spent[1:]) for spent in times]


# -- engines -------------------------------------------------------------------------------------------------


@attrs.frozen
class ModelShape:
    """What sizes a run before its engine exists."""

    kv_bytes_per_token: int  # K and V of one token in every layer
    max_positions: int
    vocab_size: int
    itemsize: int
    device: torch.device
    hf_config: Any


def model_shape(model: str, engine_options: dict[str, Any]) -> ModelShape:
    from transformers import AutoConfig

    from nanovllm.engine.model_loading import override_config, resolve_device, resolve_dtype, resolve_model_path

    hf = AutoConfig.from_pretrained(resolve_model_path(model))
    override_config(hf, engine_options.get("hf_overrides"))
    device = resolve_device(engine_options.get("device", "auto"))
    itemsize = torch.empty((), dtype=resolve_dtype(engine_options.get("dtype", "auto"), hf, device)).element_size()
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * itemsize
    return ModelShape(per_token, hf.max_position_embeddings, hf.vocab_size, itemsize, device, hf)


def weight_bytes(shape: ModelShape) -> int:
    """The model's parameter bytes, counted on the meta device (nothing is allocated)."""
    from nanovllm.plugins import get_plugins, load_registered

    families = get_plugins().registry.model_families
    arch = next(a for a in shape.hf_config.architectures if a in families)
    cls = load_registered(families[arch].target, families[arch].dist, f"model family {arch!r}")
    with torch.device("meta"):
        model = cls(shape.hf_config)
    return sum(p.numel() for p in model.parameters()) * shape.itemsize


def lengths(context: int, batch: int, steps: int, max_positions: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(prompt tokens, max_model_len). Room is left for the timed steps and for the tokens that sequences
    decode while later ones still prefill, so none stops inside the timed window; the prompt is shortened
    where ``context`` plus that room would pass the model's position limit (128K on llama-3.1-8b)."""
    room = steps + batch + -(-batch * context // max_num_batched_tokens) + 8
    prompt = min(context, max_positions - room)
    return prompt, prompt + room


def kv_bytes(batch: int, max_model_len: int, block_size: int, kv_bytes_per_token: int) -> int:
    """KV bytes of ``batch`` sequences of ``max_model_len`` tokens in whole blocks, and one spare block (the
    engine rounds a KV budget down to whole blocks)."""
    return (batch * -(-max_model_len // block_size) + 1) * block_size * kv_bytes_per_token


def pool_gib(batch: int, max_model_len: int, block_size: int, kv_bytes_per_token: int) -> float:
    """``kv_offloading_size`` for ``batch`` sequences of ``max_model_len`` tokens."""
    return kv_bytes(batch, max_model_len, block_size, kv_bytes_per_token) / 2**30


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def small_gpu_utilization(weights: int, kv_gib: float, total: int) -> float:
    """The ``gpu_memory_utilization`` that leaves at most ``kv_gib`` GiB for KV after the weights."""
    return min(1.0, (weights + (kv_gib + ACTIVATION_HEADROOM_GIB) * 2**30) / total)


def bench_decode(
    model: str, context: int, batch: int, steps: int, offload: bool,
    host_memory_fraction: float = HOST_MEMORY_FRACTION, full_warm_up: bool = False, ttft_rounds: int = 1,
    **engine_options: Any,
) -> dict[str, Any]:
    """TTFT and decode of ``batch`` prompts of ``context`` tokens. ``full_warm_up``: the warm-up is a batch of
    other prompts as long, timed as ``ttft_first_s``, so that every kernel the timed run meets has compiled
    (a sparse prefill's kernels run only past some length). ``ttft_rounds``: batches of fresh prompts timed
    one after another; ``ttft_s`` is their median, ``ttft_rounds_s`` each one."""
    if ttft_rounds < 1:
        raise ValueError(f"ttft_rounds must be at least 1, got {ttft_rounds}")
    shape = model_shape(model, engine_options)
    prompt_len, options = plan_run(shape, context, batch, steps, offload, engine_options)
    row = {"benchmark": "offload-decode" if offload else "offload-resident", "preset": model, "context": context,
           "batch": batch, "prompt_len": prompt_len, "kv_bytes_per_token": shape.kv_bytes_per_token,
           "settings": options}
    if offload:
        pool, ram = options["kv_offloading_size"], host_memory_bytes()
        if pool * 2**30 > host_memory_fraction * ram:
            return {**row, "skipped": f"the pool would pin {pool:.3g} GiB, more than {host_memory_fraction:g} "
                                      f"of this host's {ram / 2**30:.0f} GiB of RAM"}
    from nanovllm import LLM

    llm = LLM(model, **options)
    measured = _measure(llm, shape, batch, prompt_len, steps, full_warm_up, ttft_rounds)
    del llm
    free_memory()
    return {**row, **measured}


def bench_small_gpu(
    model: str, context: int, steps: int, offload: bool, small_kv_gib: float, **engine_options: Any
) -> dict[str, Any]:
    """One sequence of ``context`` on a GPU that keeps at most ``small_kv_gib`` GiB for KV after the
    weights. Without offload the engine's refusal is the result."""
    shape = model_shape(model, engine_options)
    weights = weight_bytes(shape)
    if shape.device.type == "cuda":
        total = torch.cuda.mem_get_info()[1]
        limit = {"gpu_memory_utilization": small_gpu_utilization(weights, small_kv_gib, total)}
    else:  # the CPU's KV budget stands in for the small GPU's
        limit = {"kv_cache_memory": int(small_kv_gib * 2**30)}
    prompt_len, options = plan_run(shape, context, 1, steps, offload, {**limit, **engine_options})
    row = {"benchmark": "offload-small", "preset": model, "offload": offload, "context": context, "batch": 1,
           "prompt_len": prompt_len, "small_kv_gib": small_kv_gib, "weight_bytes": weights, "settings": options}
    from nanovllm import LLM

    refused = None
    try:
        llm = LLM(model, **options)
    except ValueError as exc:
        if offload:
            raise
        refused = str(exc)
    if refused is not None:
        free_memory()  # the refused engine's weights, once the exception no longer holds them
        return {**row, "refused": refused}
    measured = _measure(llm, shape, 1, prompt_len, steps)
    del llm
    free_memory()
    return {**row, "refused": None, **measured}


def plan_run(
    shape: ModelShape, context: int, batch: int, steps: int, offload: bool, engine_options: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """The prompt length and the engine options of one run; with offload, a pool for the whole batch."""
    budget = engine_option(engine_options, "max_num_batched_tokens")
    prompt_len, max_len = lengths(context, batch, steps, shape.max_positions, budget)
    options = {"max_model_len": max_len, "max_num_seqs": batch, "enable_prefix_caching": False, **engine_options}
    if offload:
        block_size = engine_option(options, "block_size")
        options["kv_offloading_size"] = pool_gib(batch, max_len, block_size, shape.kv_bytes_per_token)
    return prompt_len, options


def _measure(llm, shape: ModelShape, batch: int, prompt_len: int, steps: int,
             full_warm_up: bool = False, ttft_rounds: int = 1) -> dict[str, Any]:
    """TTFT and decode of ``batch`` prompts; with offload, the bytes each decode step moves."""
    warm_ups = batch if full_warm_up else 0
    prompts = random_prompts(ttft_rounds * batch + warm_ups, prompt_len, shape.vocab_size)
    out = {}
    if full_warm_up:
        from nanovllm import SamplingParams

        sync()
        start = time.perf_counter()
        first = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
        llm.generate(prompts[batch:2 * batch], first, use_tqdm=False)
        sync()
        out["ttft_first_s"] = time.perf_counter() - start
    extra = prompts[batch + warm_ups:]  # the rounds before the last, each on prompts of its own
    rounds = [ttft_alone(llm, extra[i:i + batch]) for i in range(0, len(extra), batch)]
    out |= _prefill_then_decode(llm, prompts[:batch], steps)
    if rounds:
        out["ttft_rounds_s"] = [*rounds, out["ttft_s"]]
        out["ttft_s"] = statistics.median(out["ttft_rounds_s"])
    if llm.runner.device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if (store := host_store(llm)) is not None:
        # only the pool's layers cross PCIe: not those kept on the GPU (dense, or a hybrid model's windows)
        pooled = shape.kv_bytes_per_token * len(store.engine.layers) // len(store.layers)
        out["h2d_bytes_per_step"] = out["kv_tokens_per_step"] * pooled
        out["h2d_gbs"] = out["h2d_bytes_per_step"] / out["decode_ms_per_step"] / 1e6
        out["d2h_bytes_per_step"] = batch * pooled  # the new tokens' K/V to the pool
        # its load slots, and the KV of the layers kept on the GPU
        caches = (c for c in (store.resident_kv_cache, store.window_kv_cache) if c is not None)
        out["gpu_bytes"] = store.engine.gpu_bytes + sum(c.numel() * c.element_size() for c in caches)
    return out


def host_store(llm):
    """The engine's :class:`~nanovllm.kv.store.HostKVStore` (KV in the host pool), or None (KV on the GPU)."""
    from nanovllm.kv.store import HostKVStore

    return llm.runner.kv if isinstance(llm.runner.kv, HostKVStore) else None


def engine_option(options: dict[str, Any], name: str) -> Any:
    return options.get(name, attrs.fields_dict(EngineConfig)[name].default)


def random_prompts(batch: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(0, min(10_000, vocab_size - 1)) for _ in range(length)] for _ in range(batch)]


def _time_to_first_tokens(llm, prompts: list[list[int]]) -> tuple[float, list]:
    """Seconds from adding ``prompts`` together until every one has its first token, and their sequences
    (still running)."""
    from nanovllm import SamplingParams

    sched = llm.scheduler
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=llm.max_model_len)
    sync()
    start = time.perf_counter()
    seqs = [llm.add_request(p, params) for p in prompts]
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        llm.step()
    sync()
    return time.perf_counter() - start, seqs


def ttft_alone(llm, prompts: list[list[int]]) -> float:
    """:func:`_time_to_first_tokens`, the sequences aborted after."""
    seconds, seqs = _time_to_first_tokens(llm, prompts)
    llm.abort_request([s.request_id for s in seqs])
    return seconds


def _prefill_then_decode(llm, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """TTFT of the prompts together (until every sequence has its first token), then, after one untimed
    decode step, ``steps`` decode steps of the whole batch; the sequences are aborted after."""
    from nanovllm import SamplingParams

    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, decode included
    sched = llm.scheduler
    ttft, seqs = _time_to_first_tokens(llm, prompts)
    llm.step()  # untimed: kernels specialised on the full context's shape (split counts) compile here
    kv_tokens = 0  # each sequence's history read by the step, its new token included
    store = host_store(llm)
    counts = store.engine.cache_counts.tolist() if store is not None else None
    start = time.perf_counter()
    for _ in range(steps):
        kv_tokens += sum(s.num_tokens for s in sched.running)
        llm.step()
    sync()
    decode = time.perf_counter() - start
    cache = {}
    if counts is not None:  # head blocks of the selections the cache loaded and reused, per step
        loaded, reused = (now - then for now, then in zip(store.engine.cache_counts.tolist(), counts, strict=True))
        cache = {"cache_loaded_head_blocks_per_step": loaded / steps,
                 "cache_reused_head_blocks_per_step": reused / steps}
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a sequence finished inside the timed decode steps; lengths() must leave more room")
    llm.abort_request([s.request_id for s in seqs])
    return {"ttft_s": ttft, "decode_ms_per_step": 1000 * decode / steps,
            "kv_tokens_per_step": kv_tokens / steps, **cache}


def free_memory() -> None:
    """Free a deleted engine's GPU memory and pinned pool before the next measurement."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- results ---------------------------------------------------------------------------------------------------


def with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Offload rows with what needs another job's row of the same run: each decode row's floor (its bytes at
    the measured host-to-device copy rate) and floor / time; offload TTFT over GPU-resident TTFT; the small
    GPU's memory for KV in GiB."""
    copy = next((r for r in results if r["benchmark"] == "offload-copy" and "h2d_gbs" in r), None)
    resident = {(r["preset"], r["context"]): r["ttft_s"] for r in results
                if r["benchmark"] == "offload-resident" and "ttft_s" in r}
    out = []
    for r in results:
        r = dict(r)
        if r["benchmark"] == "offload-decode" and "h2d_bytes_per_step" in r:
            if copy is not None:
                r["floor_ms"] = r["h2d_bytes_per_step"] / copy["h2d_gbs"] / 1e6
                r["vs_floor"] = r["floor_ms"] / r["decode_ms_per_step"]
            if r["batch"] == 1 and (r["preset"], r["context"]) in resident:
                r["ttft_vs_resident"] = r["ttft_s"] / resident[r["preset"], r["context"]]
        if r["benchmark"] == "offload-small" and r.get("gpu_bytes") is not None:
            r["gpu_kv_gib"] = r["gpu_bytes"] / 2**30
        out.append(r)
    return out


ADDED = {"floor_ms", "vs_floor", "ttft_vs_resident", "gpu_kv_gib"}  # by with_ratios


def is_offload(row: dict[str, Any]) -> bool:
    return row["benchmark"].startswith("offload-")


def markdown_lines(results: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in results if is_offload(r) and "error" not in r]
    if not rows:
        return []
    lines = ["", "## Offload", ""]
    for r in rows:
        if r["benchmark"] == "offload-copy":
            lines.append(
                f"Pinned copy of {r['settings']['copy_mib']:,} MiB: host-to-device {r['h2d_gbs']:.1f} GB/s, "
                f"device-to-host {r['d2h_gbs']:.1f} GB/s; both at once {r['both_h2d_gbs']:.1f} + "
                f"{r['both_d2h_gbs']:.1f} = {r['both_total_gbs']:.1f} GB/s. {r.get('note', '')}".rstrip())
    lines += ["", "Decode: the whole history crosses PCIe each step; floor = its bytes at the host-to-device copy "
              "rate above.", "",
              "| engine | preset | context | batch | prompt | TTFT s | TTFT / resident "
              "| decode ms/step | H2D GiB/step | H2D GB/s | floor ms | floor / time | D2H KiB/step | note |",
              "|" + "---|" * 14]
    for r in rows:
        if r["benchmark"] not in ("offload-decode", "offload-resident"):
            continue
        h2d = r.get("h2d_bytes_per_step")
        cells = [r["benchmark"].removeprefix("offload-"), r["preset"], r["context"], r["batch"], r["prompt_len"],
                 r.get("ttft_s", ""), r.get("ttft_vs_resident", ""), r.get("decode_ms_per_step", ""),
                 "" if h2d is None else h2d / 2**30, r.get("h2d_gbs", ""), r.get("floor_ms", ""), r.get("vs_floor", ""),
                 "" if "d2h_bytes_per_step" not in r else r["d2h_bytes_per_step"] / 2**10, r.get("skipped", "")]
        lines.append(markdown_row(map(fmt, cells)))
    small_kv = next((r["small_kv_gib"] for r in rows if r["benchmark"] == "offload-small"), "small_kv_gib")
    lines += ["", f"Small GPU: at most {small_kv} GiB left for KV after the weights; GPU KV: the offload engine's "
              "GPU memory for KV (its load slots).", "",
              "| engine | preset | context | KV limit | outcome | TTFT s | decode ms/step | max allocated GiB "
              "| GPU KV GiB |", "|" + "---|" * 9]
    for r in rows:
        if r["benchmark"] != "offload-small":
            continue
        s = r["settings"]
        limit = (f"gpu_memory_utilization {s['gpu_memory_utilization']:.3f}" if "gpu_memory_utilization" in s
                 else f"kv_cache_memory {s['kv_cache_memory'] / 2**30:.4g} GiB")
        outcome = f"refused: {r['refused']}" if r.get("refused") else "ran"
        peak = r.get("max_memory_allocated")
        cells = ["offload" if r["offload"] else "resident", r["preset"], r["context"], limit, outcome,
                 r.get("ttft_s", ""), r.get("decode_ms_per_step", ""), "" if peak is None else peak / 2**30,
                 r.get("gpu_kv_gib", "")]
        lines.append(markdown_row(map(fmt, cells)))
    return lines


def chart_panels(results: list[dict[str, Any]]) -> list[tuple[str, list]]:
    """Decode ms per step against the PCIe floor, and offload TTFT against resident TTFT (red marks)."""
    decode = [r for r in results if r["benchmark"] == "offload-decode" and "decode_ms_per_step" in r]
    panels = []
    if decode:
        panels.append(("offload decode ms/step  (red: PCIe floor)",
                       [(f"{_k(r['context'])} x {r['batch']}", r["decode_ms_per_step"], r.get("floor_ms"))
                        for r in decode]))
    ttft = [r for r in decode if "ttft_vs_resident" in r]
    if ttft:
        panels.append(("offload TTFT s  (red: GPU-resident)",
                       [(_k(r["context"]), r["ttft_s"], r["ttft_s"] / r["ttft_vs_resident"])
                        for r in ttft]))
    return panels


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)
