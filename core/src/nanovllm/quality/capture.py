"""Capture the queries, keys and values of chosen attention layers while the public engine runs a text.

The engine runs densely (``sparse_policy="full"``) and knows nothing of the capture: forward
pre-hooks on its :class:`nanovllm.layers.attention.Attention` modules copy their inputs (after RoPE,
exactly what a policy sees) to the CPU, and are removed afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils import progress_bar


@attrs.define(frozen=True)
class LayerActivations:
    layer_id: int
    q: torch.Tensor  # [T, H, D] on the CPU, in the engine's dtype
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    scale: float


@attrs.define(frozen=True)
class Capture:
    """Activations of one text, and what a policy evaluated on them needs of the engine that made them."""

    token_ids: list[int]
    layers: list[LayerActivations]
    num_layers: int  # of the model, for ``SparsePolicy.initialize``
    block_size: int
    dtype: torch.dtype
    device: torch.device
    backend: AttentionBackend

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def capture_activations(llm, token_ids: list[int], layer_ids: Sequence[int]) -> Capture:
    """Prefill ``token_ids`` once on ``llm`` (a fresh engine: a prefix-cache hit would skip tokens) and
    return the activations of ``layer_ids``; a progress bar counts the prompt's tokens. Use ``async_scheduling=False`` so that no decode step
    runs after the prompt's only sampled token."""
    runner = llm.runner
    modules = {m.layer_id: m for m in runner.attention_layers}
    unknown = [i for i in layer_ids if i not in modules]
    if unknown:
        raise ValueError(f"layers {unknown} do not exist; the model has layers 0..{len(modules) - 1}")
    chunks: dict[int, list[tuple[torch.Tensor, ...]]] = {i: [] for i in layer_ids}

    def keep(module, args) -> None:
        chunks[module.layer_id].append(tuple(t.detach().to("cpu", copy=True) for t in args))

    handles = [modules[i].register_forward_pre_hook(keep) for i in layer_ids]
    try:
        seq = llm.add_request(list(token_ids), SamplingParams(temperature=0.0, max_tokens=1))
        with progress_bar(len(token_ids), "capture (dense prefill)", "tok") as bar:
            while llm.has_unfinished_requests():
                llm.step()
                bar.update(min(seq.num_computed_tokens, len(token_ids)) - bar.n)
    finally:
        for handle in handles:
            handle.remove()
    layers = []
    for i in layer_ids:
        q, k, v = (torch.cat(parts) for parts in zip(*chunks[i], strict=True))
        if q.shape[0] != len(token_ids):
            raise RuntimeError(
                f"layer {i} saw {q.shape[0]} tokens, not the prompt's {len(token_ids)}: capture on a fresh "
                "engine with async_scheduling=False (no prefix-cache hit, no decode step after the prompt)"
            )
        layers.append(LayerActivations(i, q, k, v, modules[i].scale))
    return Capture(list(token_ids), layers, len(modules), runner.block_size, runner.dtype, runner.device,
                   runner.backend)
