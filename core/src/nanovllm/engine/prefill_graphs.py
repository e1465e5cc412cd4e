"""Prefill steps in piecewise CUDA graphs: the model's forward of a step of ``num_tokens`` tokens
(``max_num_batched_tokens``, the size every chunk of a long prompt and every full batch of prompts has) is
captured once at start-up as one graph per stretch between two attention calls, and each attention call runs
eagerly between the replays, as vLLM's piecewise mode does. A step a little shorter (by at most
``num_tokens // PADDING_SHARE`` tokens: a long prompt's last chunk, a prompt just under the budget) is padded
to that size: its padding rows write no KV, attention runs on its own rows only, and the stretches'
token-wise work on the padding rows is discarded.

Why: a small model's prefill waits on the host, which launches a dozen kernels a layer; a graph launches a
stretch of them at once. Attention stays eager because its work follows the step (context lengths, block
tables, a sparse policy's selection) in ways a graph cannot.

What crosses a cut goes through static buffers. Each layer's QKV projection writes into one
(``Attention.qkv_out``), so its attention call reads ``q``, ``k`` and ``v`` there in place, as RoPE left
them; a model whose attention inputs lie elsewhere has them copied into buffers of their own as its stretch
ends. The next stretch begins by reading the attention's output from one. Every stretch reads the step's
token ids, positions and KV slots (the RoPE kernel writes the keys and values on its way) from static inputs,
copied in before the first replay. The stretches share one memory pool and replay in the order they were
captured, so a stretch may reuse what an earlier one freed."""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import torch

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, forward_context
from nanovllm.config import ResolvedConfig
from nanovllm.distributed import capture_problem, tp_size
from nanovllm.engine.cuda_graphs import collector_paused
from nanovllm.layers.attention import Attention

# a step short of num_tokens by at most num_tokens // PADDING_SHARE tokens replays, padded: at most an eighth
# of the rows wasted
PADDING_SHARE = 8


@attrs.define
class Stretch:
    """One captured stretch of the forward, and the attention call that follows it (None after the last)."""

    graph: torch.cuda.CUDAGraph
    attention: Attention | None = None
    kv_written: bool = False  # the stretch's RoPE kernel wrote the layer's keys and values
    # the attention call's q, k and v over every row of the step: static buffers or views of them
    inputs: tuple[torch.Tensor, ...] = ()


class PrefillGraphs:
    """The piecewise graphs of the steps of ``num_tokens`` tokens; ``stretches`` is empty when those steps run
    eagerly (``enforce_eager``, the CPU, tensor parallelism, KV offload, a backend that is not graph-safe)."""

    def __init__(self, model: torch.nn.Module, attention_layers: list[Attention], config: ResolvedConfig,
                 num_kv_cache_groups: int, backend: Any) -> None:
        self.model, self.attention_layers, self.config = model, attention_layers, config
        self.num_tokens = config.max_num_batched_tokens
        self.num_groups, self.backend = num_kv_cache_groups, backend
        self.device = torch.device(config.device)
        self.stretches: list[Stretch] = []

    def usable(self) -> bool:
        """Whether this runner captures them (warns when only the environment prevents it)."""
        usable = (
            self.device.type == "cuda"
            and self.config.piecewise_cuda_graphs
            and not self.config.enforce_eager
            and tp_size() == 1
            and self.config.kv_offloading_size is None
            and self.backend.supports_cuda_graphs
        )
        problem = capture_problem() if usable else None
        if problem is not None:
            warnings.warn(f"{problem}: prefill steps run eagerly (no piecewise CUDA graphs); pass "
                          "piecewise_cuda_graphs=False to say so and silence this", RuntimeWarning,
                          stacklevel=2)
        return usable and problem is None

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens replays them (padded, when it has fewer)."""
        full = self.num_tokens
        return bool(self.stretches) and full - full // PADDING_SHARE <= num_tokens <= full

    @torch.inference_mode()
    def capture_if_usable(self) -> None:
        """The static buffers, an uncaptured pass (the stretches' kernels compile there), then the capture."""
        if self.usable() and self._allocate():
            self._capture()

    def _allocate(self) -> bool:
        """The static inputs and the buffers across the cuts; False where the layers' shapes differ."""
        first = self.attention_layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim)
        if any((a.num_heads, a.num_kv_heads, a.head_dim) != shape for a in self.attention_layers):
            return False  # layers of different shapes would need a set of buffers each: stay eager
        n, dev = self.num_tokens, self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((self.num_groups, n), -1, dtype=torch.long, device=dev)  # -1: writes nothing
        dtype = getattr(torch, self.config.dtype)
        width = (first.num_heads + 2 * first.num_kv_heads) * first.head_dim
        self.qkv = torch.zeros(n, width, dtype=dtype, device=dev)
        self.attention_out = torch.zeros(n, first.num_heads, first.head_dim, dtype=dtype, device=dev)
        self.copies: dict[int, torch.Tensor] = {}  # attention inputs outside qkv: see attention_inputs
        return True

    def attention_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a replay's attention call reads for a stretch that ends in an attention call on ``q``, ``k``
        and ``v``: each one itself where it is a view of ``qkv`` (the QKV projection wrote it there, RoPE
        in place), else a copy in a buffer kept for that input (one for every layer, made on the uncaptured
        pass)."""
        inputs = []
        for i, t in enumerate((q, k, v)):
            if t.untyped_storage().data_ptr() == self.qkv.untyped_storage().data_ptr():
                inputs.append(t)
                continue
            if i not in self.copies:
                self.copies[i] = torch.empty_like(t, memory_format=torch.contiguous_format)
            inputs.append(self.copies[i].copy_(t))
        return tuple(inputs)

    def _capture(self) -> None:
        """Capture, where the GPU has room: the graphs' pool keeps about one step's activations, and a step
        that runs eagerly later needs its own again, so twice what the uncaptured pass took must be free."""
        stream, dev = torch.cuda.Stream(self.device), self.device
        with forward_context(self._metadata()):
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
            self._run(stream, capture=False)  # every kernel of the stretches compiles here, outside a capture
            torch.cuda.synchronize()
            step_bytes = torch.cuda.max_memory_allocated(dev) - before
            torch.cuda.empty_cache()  # what that pass cached goes back, for the graphs' pool to take
            free = torch.cuda.mem_get_info(dev)[0]
            if free < 2 * step_bytes:
                need, have = 2 * step_bytes / 2**30, free / 2**30
                warnings.warn(f"prefill steps run eagerly (no piecewise CUDA graphs): their pool and an "
                              f"eager step need about {need:.1f} GiB and {have:.1f} GiB is free; lower "
                              "gpu_memory_utilization or max_num_batched_tokens to have them",
                              RuntimeWarning, stacklevel=3)
                return
            with collector_paused():
                self._run(stream, capture=True)
        torch.cuda.synchronize()

    def _metadata(self) -> StepMetadata:
        """What the stretches read of a step (its slots and positions); attention, which reads the rest,
        is not captured."""
        n, dev = self.num_tokens, self.device
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        prefill = PhaseMetadata(cu, cu[1:], tables, n, n)
        first, *later = (StepMetadata(slots, self.positions, 0, None, prefill) for slots in self.slots)
        return attrs.evolve(first, other_groups=tuple(later))

    def _run(self, stream: torch.cuda.Stream, capture: bool) -> None:
        """One pass of the forward on ``stream``, cut at each attention call; with ``capture`` each stretch is
        captured."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        stretches: list[Stretch] = []
        pool = None

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            stretches.append(Stretch(graph))
            if capture:
                graph.capture_begin(pool=pool)

        def end() -> None:
            nonlocal pool
            if capture:
                graph = stretches[-1].graph
                graph.capture_end()
                pool = graph.pool() if pool is None else pool

        def cut(attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_written: bool) -> torch.Tensor:
            inputs = self.attention_inputs(q, k, v)
            end()
            stretches[-1].attention, stretches[-1].kv_written = attention, kv_written
            stretches[-1].inputs = inputs
            begin()
            return self.attention_out

        for layer in self.attention_layers:
            layer.graph_cut, layer.qkv_out = cut, self.qkv
        try:
            with torch.cuda.stream(stream):
                begin()
                self.output = self.model(self.input_ids, self.positions)
                end()
        finally:
            for layer in self.attention_layers:
                layer.graph_cut = layer.qkv_out = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        cuts = [s.attention for s in stretches if s.attention is not None]
        if capture and sorted(map(id, cuts)) == sorted(map(id, self.attention_layers)):
            self.stretches = stretches
        elif capture:  # a model that attends other than once through each Attention layer: stay eager
            warnings.warn(f"the model called its {len(self.attention_layers)} attention layers {len(cuts)} "
                          "times in one forward pass: prefill steps run eagerly (no piecewise CUDA graphs)",
                          RuntimeWarning, stacklevel=3)
            for stretch in stretches:
                stretch.graph.reset()

    def replay(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """The hidden states of a step that :meth:`fits`, whose metadata is ``meta`` (the forward context the
        caller set): its inputs copied into the first rows (the padding rows after them keep earlier steps'
        ids and positions, and write no KV), each stretch replayed, each attention call run eagerly on the
        step's rows of the stretch's ``q``, ``k``, ``v`` (:attr:`Stretch.inputs`)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        for group in range(self.num_groups):
            self.slots[group, :n].copy_(meta.of_group(group).slot_mapping)
        if n < self.num_tokens:
            self.slots[:, n:].fill_(-1)
        out = self.attention_out[:n]
        for stretch in self.stretches:
            stretch.graph.replay()
            if stretch.attention is not None:
                q, k, v = (t[:n] for t in stretch.inputs)
                out.copy_(stretch.attention(q, k, v, stretch.kv_written))
        return self.output[:n]
