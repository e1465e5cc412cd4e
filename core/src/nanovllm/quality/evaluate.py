"""Evaluate a sparse policy on captured activations: its block selection and its own output for decode
queries, against dense attention, the oracle selection and a random one (:mod:`nanovllm.quality.metrics`).

The captured keys and values of a layer go into a paged cache of one sequence whose block table is
``arange``. Each decode query at position ``t`` is one sequence of the batch whose history is keys
``[0, t]``, its own key included, as in the engine's decode. The policy is called as the engine calls
it: ``initialize`` and ``on_blocks_allocated`` (every block) once, then per layer one ``on_kv_write``
with every key (a prefill of the whole text), ``select_blocks`` (its result goes to
``ctx.selected_blocks`` when the policy ``requires_block_selection``) and ``compute_chunked_decode``.
Query positions sit at block ends, so per-block metadata never includes a key after a query.
"""

from __future__ import annotations

from typing import Any

import torch

from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.kv import KVWrite
from nanovllm.policy import PolicyContext
from nanovllm.quality.capture import Capture, LayerActivations
from nanovllm.quality.metrics import compare_selection, dense_attention
from nanovllm.selection import resolve_policies
from nanovllm.sparse import SparsePolicy


def decode_positions(num_tokens: int, num_queries: int, block_size: int) -> list[int]:
    """Up to ``num_queries`` positions at block ends (``t + 1`` a multiple of ``block_size``), spread
    evenly over the last three quarters of the text."""
    first_block = max(1, -(-(num_tokens // 4 + 1) // block_size))
    last_block = num_tokens // block_size
    if last_block < first_block:
        raise ValueError(f"{num_tokens} tokens hold no full block of {block_size} past the first quarter")
    blocks = torch.linspace(first_block, last_block, num_queries).round().long().unique()
    return [int(b) * block_size - 1 for b in blocks]


def make_policy(selection: str | dict) -> SparsePolicy:
    """A fresh instance of the policy that runs the decode phase under ``selection`` (one policy, or a
    ``prefill=...;decode=...`` pair, whose perplexity the harness measures with both in the engine)."""
    plan = resolve_policies(selection)
    if plan.decode.selection.name == "full" and plan.prefill.selection.name != "full":
        raise ValueError(
            f"sparse_policy={selection!r} runs only prefill ({plan.prefill.selection.name!r}); the harness's "
            f"attention metrics measure decode queries: pair it with a decode policy, "
            f"'prefill={plan.prefill.selection};decode=NAME'"
        )
    return plan.decode.cls(plan.decode.config)


def _paged_cache(x: torch.Tensor, num_blocks: int, block_size: int, device, dtype) -> torch.Tensor:
    """``[T, Hkv, D]`` -> ``[num_blocks, block_size, Hkv, D]``, zero after the last token."""
    cache = torch.zeros(num_blocks * block_size, *x.shape[1:], device=device, dtype=dtype)
    cache[: x.shape[0]] = x.to(device=device, dtype=dtype)
    return cache.view(num_blocks, block_size, *x.shape[1:])


def _decode_metadata(positions: torch.Tensor, block_size: int) -> PhaseMetadata:
    """One single-token sequence per query, holding blocks ``[0, positions[i] // block_size]``."""
    lens = (positions + 1).to(torch.int32)
    width = int(positions.max()) // block_size + 1
    idx = torch.arange(width, dtype=torch.int32, device=positions.device)
    tables = torch.where(idx[None, :] * block_size < lens[:, None], idx, -1)
    cu = torch.arange(len(positions) + 1, dtype=torch.int32, device=positions.device)
    return PhaseMetadata(cu, lens, tables, 1, int(lens.max()))


def evaluate_layer(
    policy: SparsePolicy, capture: Capture, layer: LayerActivations, positions: list[int], top_k: int,
    seed: int, per_head: bool = False,
) -> dict[str, Any]:
    device, dtype, bs = capture.device, capture.dtype, capture.block_size
    num_blocks = -(-capture.num_tokens // bs)
    k_cache = _paged_cache(layer.k, num_blocks, bs, device, dtype)
    v_cache = _paged_cache(layer.v, num_blocks, bs, device, dtype)
    t = layer.k.shape[0]  # the whole text as one prefill, in blocks 0, 1, ...
    policy.on_kv_write(KVWrite.of_sequence(layer.layer_id, k_cache, v_cache, list(range(-(-t // bs))), t))
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    q = layer.q[positions].to(device=device, dtype=dtype)
    ctx = PolicyContext(layer.layer_id, False, q, _decode_metadata(pos, bs), k_cache, v_cache, layer.scale,
                        capture.backend)
    selection = policy.select_blocks(ctx)
    if policy.requires_block_selection:
        ctx.selected_blocks = selection
    output = policy.compute_chunked_decode(q, ctx)
    dense = dense_attention(layer.q[positions], layer.k, layer.v, positions, layer.scale)
    quality = compare_selection(dense, selection, bs, top_k, policy_output=output, seed=seed)
    out = {"layer": layer.layer_id, **{which: result.summary() for which, result in quality.items()}}
    if per_head:  # means over the queries: mass recall per query head, density per KV head
        out["per_head"] = {
            which: {"mass_recall": r.mass_recall.mean(0).tolist(), "density": r.density.mean(0).tolist()}
            for which, r in quality.items()
        }
    return out


def evaluate_policy(
    selection: str | dict, capture: Capture, positions: list[int], top_k: int = 10, seed: int = 0,
    per_head: bool = False,
) -> list[dict[str, Any]]:
    """Per captured layer: ``{"layer", "policy", "oracle", "random"}``, each a dict of mean metrics
    (the policy's also ``policy_output_error``, the error of the output it computed itself); with
    ``per_head`` also ``"per_head"``: per selection, ``mass_recall`` per query head and ``density`` per
    KV head, averaged over the queries."""
    policy = make_policy(selection)
    num_blocks = -(-capture.num_tokens // capture.block_size)
    first = capture.layers[0]
    policy.initialize(capture.num_layers, first.k.shape[1], first.k.shape[2], num_blocks, capture.block_size,
                      capture.dtype, capture.device)
    policy.on_blocks_allocated(torch.arange(num_blocks, device=capture.device))
    with torch.inference_mode():
        return [evaluate_layer(policy, capture, layer, positions, top_k, seed, per_head)
                for layer in capture.layers]


def mean_over_layers(layers: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{"policy": {...}, "oracle": {...}, "random": {...}}`` averaged over layers."""
    out = {}
    for which in ("policy", "oracle", "random"):
        keys = layers[0][which].keys()
        out[which] = {key: sum(layer[which][key] for layer in layers) / len(layers) for key in keys}
    return out
