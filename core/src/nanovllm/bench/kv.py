"""``nanovllm bench kv``: how a model's KV memory is laid out, read off its config; nothing is loaded or run.

Per KV cache group (:mod:`nanovllm.kv.groups`: layers of one attention type and window sharing a block
table), its layers, window, the KV bytes it keeps per token (K and V of one token in each of its pool
block's layer slots, padding included) and the bytes one decoding sequence of ``context`` tokens holds in
it: every block for full attention, the blocks its window reaches for a sliding window. Beside them, the
whole sequence's bytes in the hybrid layout, in the uniform one (``disable_hybrid_kv_cache_manager=True``:
every layer keeps every token) and the full-attention layers' own bytes, which no layout can go below.
"""

from __future__ import annotations

from typing import Any

DEFAULT_CONTEXT = 32768


def kv_layout(model: str, context: int = DEFAULT_CONTEXT, **engine_options: Any) -> dict[str, Any]:
    """The KV layout of ``model`` (a preset, packaged model or directory) as the engine would build it with
    ``engine_options`` (``dtype``, ``device``, ``block_size``, ``hf_overrides``), one sequence of ``context``
    tokens in decode; sizes in bytes."""
    from nanovllm.bench.offload import model_shape
    from nanovllm.engine.model_loading import resolve_dtype
    from nanovllm.kv.groups import kv_bytes_per_token, kv_cache_groups
    from nanovllm.layers.decoder import sliding_window_of

    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    shape = model_shape(model, engine_options)
    hf = shape.hf_config
    dtype = resolve_dtype(engine_options.get("dtype", "auto"), hf, shape.device)
    num_layers = hf.num_hidden_layers
    layer_bytes = shape.kv_bytes_per_token // num_layers  # K and V of one token in one layer
    block_size = engine_options.get("block_size", 16)
    windows = [sliding_window_of(hf, i) for i in range(num_layers)]
    groups = kv_cache_groups(windows)
    rows = []
    for group, per_token in zip(groups, kv_bytes_per_token(groups, layer_bytes), strict=True):
        blocks = group.max_blocks(context, block_size, 1)
        rows.append({"layers": list(group.layer_ids), "sliding_window": group.sliding_window,
                     "kv_bytes_per_token": per_token, "blocks_per_sequence": blocks,
                     "bytes_per_sequence": blocks * block_size * per_token})
    padded = -(-context // block_size) * block_size
    return {
        "benchmark": "kv", "preset": model, "context": context, "block_size": block_size,
        "dtype": str(dtype).removeprefix("torch."), "num_layers": num_layers, "groups": rows,
        "bytes_per_sequence": sum(r["bytes_per_sequence"] for r in rows),
        "uniform_bytes_per_sequence": padded * shape.kv_bytes_per_token,
        "full_attention_bytes_per_sequence": padded * layer_bytes * windows.count(None),
    }


def engine_groups(llm) -> list[dict[str, Any]]:
    """The KV cache groups a running engine (``LLM`` or ``LLMEngine``) built: each one's layers, window and
    KV bytes per token, as the results of the engine benchmarks record them."""
    return [{"layers": list(group.layer_ids), "sliding_window": group.sliding_window, "kv_bytes_per_token": size}
            for group, size in zip(llm.kv_cache_groups, llm.kv_cache_group_bytes_per_token, strict=True)]


def is_kv(row: dict[str, Any]) -> bool:
    return row.get("benchmark") == "kv" and "error" not in row


def _ranges(ids: list[int]) -> str:
    """Layer ids as ranges: ``0-2, 4``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def markdown_lines(results: list[dict[str, Any]]) -> list[str]:
    """Each model's groups, then its per-sequence totals in both layouts."""
    rows = [r for r in results if is_kv(r)]
    if not rows:
        return []
    lines = ["", "| model | group | attention | layers | KV bytes per token | MiB per sequence |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for i, g in enumerate(r["groups"]):
            kind = "full" if g["sliding_window"] is None else f"window {g['sliding_window']}"
            lines.append(f"| {r['preset']} | {i} | {kind} | {_ranges(g['layers'])} | "
                         f"{g['kv_bytes_per_token']:,} | {_mib(g['bytes_per_sequence'])} |")
    lines += ["", "| model | context | block | hybrid MiB | uniform MiB | full-attention layers' MiB | "
                  "hybrid / full-attention |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        full = r["full_attention_bytes_per_sequence"]
        ratio = f"{r['bytes_per_sequence'] / full:.2f}x" if full else "-"
        lines.append(f"| {r['preset']} | {r['context']:,} | {r['block_size']} | "
                     f"{_mib(r['bytes_per_sequence'])} | {_mib(r['uniform_bytes_per_sequence'])} | {_mib(full)} | "
                     f"{ratio} |")
    return lines
