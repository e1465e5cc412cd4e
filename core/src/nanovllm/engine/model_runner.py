"""ModelRunner: one rank's model, KV store and decode graphs, and the steps it runs: the host plans a step
(:meth:`ModelRunner.prepare`), the device runs it (``launch``), and the tokens are read back later
(:meth:`LaunchedStep.result`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, aligned_rows, forward_context
from nanovllm.config import ResolvedConfig
from nanovllm.distributed import (
    barrier,
    broadcast_control,
    enable_symmetric_all_reduce,
    tp_rank,
    tp_size,
)
from nanovllm.engine.cuda_graphs import CudaGraphRunner
from nanovllm.engine.kv_allocation import allocate_kv_store
from nanovllm.engine.model_loading import EngineParts, bind_attention, build_model
from nanovllm.engine.pinned_staging import PinnedStaging
from nanovllm.engine.prefill_graphs import PrefillGraphs
from nanovllm.engine.sampling_inputs import SamplingInputs
from nanovllm.engine.sequence import PLACEHOLDER, RawLogprobs, Sequence
from nanovllm.engine.step_plan import (
    BatchTables,
    PhaseArrays,
    PromptTargets,
    StepPlan,
    group_slots,
    group_tables,
    phase_arrays,
    prompt_logprob_targets,
)
from nanovllm.engine.warm_up import warm_up
from nanovllm.kv.cache_dtype import kv_cache_torch_dtype
from nanovllm.kv.groups import kv_bytes_per_token
from nanovllm.layers.attention import Attention
from nanovllm.layers.gemv import route_small_batches
from nanovllm.layers.sampler import Sampler, TopLogprobs

# Prompt rows whose logits are computed at once for prompt logprobs: a whole 8K-token chunk of a
# 49K-token vocabulary would take 1.6 GB of float32 logits.
PROMPT_LOGPROB_ROWS = 1024


def aligned_groups(stacked: np.ndarray) -> np.ndarray:
    """``stacked`` (``[groups, n, ...]``, a part per KV cache group) with rows of padding after each part, as
    ``aligned_rows`` asks, so that every part starts 16-byte aligned when the whole is sent at once."""
    groups, n = stacked.shape[:2]
    rows = aligned_rows(n, stacked[0, :1].nbytes) if groups > 1 else n
    if rows == n:
        return stacked
    padded = np.zeros((groups, rows, *stacked.shape[2:]), dtype=stacked.dtype)
    padded[:, :n] = stacked
    return padded


def decode_rows(seqs: list[Sequence]) -> list[Sequence]:
    """A step's decoding sequences, longest context first (ties in the scheduler's order): the decode
    kernel's grid then starts the longest programs first, and the short ones fill its last wave instead of
    a long one running alone at the end."""
    return sorted((s for s in seqs if s.is_decode), key=attrgetter("num_computed_tokens"), reverse=True)


def placeholders(decodes: list[Sequence], ids: list[int], with_prefills: bool
                 ) -> tuple[np.ndarray | None, np.ndarray | None, bool]:
    """The decode rows whose token was sampled last step and not read back (``PLACEHOLDER`` in ``ids``), and
    each one's row among last step's sampled tokens (``None``, ``None`` where there are none); and whether
    the step reads last step's tokens as they lie instead (the steady state of decoding: every row is one,
    in the row that sampled it, and no prefill follows)."""
    rows = [i for i, s in enumerate(decodes) if ids[i] == PLACEHOLDER]
    if not with_prefills and decodes and len(rows) == len(decodes) and all(
            s.sample_row == i for i, s in enumerate(decodes)):
        return None, None, True
    if not rows:
        return None, None, False
    sources = [decodes[i].sample_row for i in rows]
    return np.asarray(rows, dtype=np.int64), np.asarray(sources, dtype=np.int64), False


def prompt_logits(hidden: torch.Tensor, rows: torch.Tensor, compute_logits) -> Iterator[torch.Tensor]:
    """The logits of ``hidden[rows]``, ``PROMPT_LOGPROB_ROWS`` rows at a time (on every tensor-parallel
    rank: computing them is a collective)."""
    for part in rows.split(PROMPT_LOGPROB_ROWS):
        yield compute_logits(hidden[part])


@attrs.define
class PromptLogprobRows:
    """The hidden-state rows of a step followed by a prompt token, of the requests with prompt_logprobs."""

    rows: torch.Tensor  # [n] int64, on the device
    targets: torch.Tensor  # [n] int64, the prompt token that follows each row
    spans: list[tuple[Sequence, int, int]]  # (sequence, position of its first target, count), in row order
    k: int  # the most top tokens any of them asks for

    def logprobs(self, hidden: torch.Tensor, compute_logits) -> TopLogprobs:
        """Their logprobs, ``PROMPT_LOGPROB_ROWS`` rows of logits at a time."""
        chunks = zip(prompt_logits(hidden, self.rows, compute_logits), self.targets.split(PROMPT_LOGPROB_ROWS),
                     strict=True)
        return TopLogprobs.cat([TopLogprobs.of(logits, targets, self.k) for logits, targets in chunks])


@attrs.define
class StepResult:
    """A finished step read back to the host."""

    tokens: list[int]  # one per sampling sequence
    logprobs: list[RawLogprobs | None]  # one per sampling sequence: its token's, if it asked
    prompt_logprobs: list[tuple[Sequence, int, list[RawLogprobs]]]  # (sequence, first position, entries)


@attrs.define
class LaunchedStep:
    """A step in flight: the sequences that sample in it, in row order, and their tokens; the logprobs of
    those that asked, and the prompt logprobs computed in it. On the host (pinned on CUDA) once ``ready``
    has completed."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logprobs: TopLogprobs | None = None  # a row for each of ``seqs`` with logprobs, in order
    prompt_logprobs: TopLogprobs | None = None  # the rows of ``prompt_spans``, in order
    prompt_spans: list[tuple[Sequence, int, int]] = attrs.Factory(list)

    def result(self) -> StepResult:
        """Wait for the step and read it back (the only host sync of a step)."""
        if self.ready is not None:
            self.ready.synchronize()
        logprobs: list[RawLogprobs | None] = [None] * len(self.seqs)
        if self.logprobs is not None:
            asked = [i for i, s in enumerate(self.seqs) if s.sampling_params.logprobs is not None]
            rows = self.logprobs.rows([1 + self.seqs[i].sampling_params.logprobs for i in asked])
            for i, row in zip(asked, rows, strict=True):
                logprobs[i] = row
        prompt_logprobs = []
        if self.prompt_logprobs is not None:
            widths = [1 + s.sampling_params.prompt_logprobs for s, _, n in self.prompt_spans
                      for _ in range(n)]
            rows = self.prompt_logprobs.rows(widths)
            first_row = 0
            for seq, position, n in self.prompt_spans:
                prompt_logprobs.append((seq, position, rows[first_row : first_row + n]))
                first_row += n
        return StepResult(self.tokens.tolist(), logprobs, prompt_logprobs)


class ModelRunner:
    """One rank's model and its steps: builds the model (:func:`~nanovllm.engine.model_loading.build_model`),
    binds the attention backend and the sparse policies to its layers, allocates the KV store
    (:func:`~nanovllm.engine.kv_allocation.allocate_kv_store`), captures the decode graphs
    (:class:`~nanovllm.engine.cuda_graphs.CudaGraphRunner`) and the piecewise prefill graphs
    (:class:`~nanovllm.engine.prefill_graphs.PrefillGraphs`), then launches the scheduler's steps. With tensor
    parallelism rank 0 plans each step and broadcasts it; the other ranks :meth:`follow`."""

    def __init__(self, config: ResolvedConfig, parts: EngineParts) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.device, self.dtype = torch.device(config.device), getattr(torch, config.dtype)
        self.sends_steps = tp_size() > 1 and tp_rank() == 0
        torch.manual_seed(config.seed)
        self.model = build_model(config, parts.plugins)
        if config.enable_triton_gemv:
            route_small_batches(self.model)
        barrier()  # a rank that failed to build or load its shard is reported here, not in a collective
        # why small all-reduces stay on NCCL (None: they go peer to peer through symmetric memory)
        self.symmetric_all_reduce_off = enable_symmetric_all_reduce(self.dtype, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        self.sampler = Sampler()
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.sampling_inputs = SamplingInputs(self.device, self._to_device)
        self.backend, self.hooks = bind_attention(self.attention_layers, parts, self.device, self.dtype,
                                                  config.kv_cache_dtype)
        # before the KV store's memory profile, which then counts it
        cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.backend.reserve_workspace(self.num_kv_heads, self.head_dim, config.block_size, cache_dtype,
                                       self.device, self.max_model_len)
        # the KV store sizing and allocation step: the paged GPU cache, or the host pool with GPU slots
        self.kv = allocate_kv_store(config, self.model, self.attention_layers, self.hooks, self.max_model_len,
                                    self.dtype, self.device, PROMPT_LOGPROB_ROWS)
        self.num_blocks = self.kv.num_blocks
        self.num_window_blocks = self.kv.num_window_blocks  # the window groups' own pool under KV offload
        self.kv_cache_groups = self.kv.groups  # the layers that share a block table (hybrid KV)
        self.batch_tables = BatchTables(len(self.kv_cache_groups))  # the running sequences' block tables
        layer_bytes = 2 * self.num_kv_heads * self.head_dim * cache_dtype.itemsize  # K and V, a token a layer
        self.kv_cache_group_bytes_per_token = kv_bytes_per_token(self.kv_cache_groups, layer_bytes)
        self._last_sampled = torch.empty(0, dtype=torch.long, device=self.device)
        self.cuda_graphs = CudaGraphRunner(self.model, config, self.kv, self.backend, self.hooks)
        if self.device.type == "cuda":
            warm_up(self)
        self.cuda_graphs.capture_if_usable()
        self.prefill_graphs = PrefillGraphs(self.model, self.attention_layers, config,
                                            len(self.kv_cache_groups), self.backend)
        self.prefill_graphs.capture_if_usable()
        barrier()  # every rank built its runner: a failure is reported at start, not at the first step

    # -- one step ---------------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through pinned memory and without waiting for the GPU."""
        if self.staging is None:
            return torch.from_numpy(array)
        return self.staging.upload(array)

    def _step_uploads(self) -> AbstractContextManager:
        """The scope of one step's uploads (:meth:`PinnedStaging.step`)."""
        return nullcontext() if self.staging is None else self.staging.step()

    def _upload(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Every host array of ``plan`` that the forward pass reads, by name, on the device from one transfer.
        Slots and tables are stacked ``[groups, n, ...]``, each KV cache group's part ``[g]`` contiguous and
        16-byte aligned (see ``aligned_rows``)."""
        arrays = {"input_ids": plan.input_ids, "positions": plan.positions, "slots": plan.group_slots}
        for name, phase in (("decode", plan.decode), ("prefill", plan.prefill)):
            if phase is not None:
                arrays |= {f"{name}_cu_seqlens_q": phase.cu_seqlens_q,
                           f"{name}_context_lens": phase.context_lens, f"{name}_tables": phase.group_tables}
        for name in ("placeholder_rows", "placeholder_sources", "sample_rows", "allocated_blocks"):
            if (array := getattr(plan, name)) is not None:
                arrays[name] = array
        stacked = ("slots", "decode_tables", "prefill_tables")
        sent = [aligned_groups(a) if name in stacked else a for name, a in arrays.items()]
        tensors = (self.staging.upload_many(sent) if self.staging is not None
                   else [torch.from_numpy(a) for a in sent])
        return {name: t[:, :arrays[name].shape[1]] if name in stacked else t
                for name, t in zip(arrays, tensors, strict=True)}

    def _phase_metadata(self, phase: PhaseArrays | None, on_device: dict[str, torch.Tensor], name: str,
                        host_lens: bool = False) -> list[PhaseMetadata | None]:
        """Each KV cache group's view of ``phase`` (uploaded by :meth:`_upload` as ``name``; ``None`` for each
        group where there is no such phase); with ``host_lens`` (prefill) it carries the lengths as host ints
        too, so that the prefill policies read none back."""
        if phase is None:
            return [None] * len(self.kv_cache_groups)
        cu, lens = on_device[f"{name}_cu_seqlens_q"], on_device[f"{name}_context_lens"]
        host = ((tuple(np.diff(phase.cu_seqlens_q).tolist()), tuple(phase.context_lens.tolist())) if host_lens
                else (None, None))
        return [PhaseMetadata(cu, lens, tables, phase.max_query_len, phase.max_context_len, *host)
                for tables in on_device[f"{name}_tables"]]

    def _step_metadata(self, plan: StepPlan, on_device: dict[str, torch.Tensor]) -> StepMetadata:
        """The step on the device as its layers read it: group 0's view, holding each later KV cache group's
        (its own slots and block tables). Every view is made once here, so a layer only looks its own up."""
        positions = on_device["positions"]
        n = plan.num_decode_tokens
        (slots, decode, prefill), *rest = zip(on_device["slots"],
                                              self._phase_metadata(plan.decode, on_device, "decode"),
                                              self._phase_metadata(plan.prefill, on_device, "prefill", True),
                                              strict=True)
        later = tuple(StepMetadata(s, positions, n, d, p) for s, d, p in rest)
        return StepMetadata(slots, positions, n, decode, prefill, later)

    def prepare(
        self, seqs: list[Sequence], allocated: list[int] | None = None
    ) -> tuple[StepPlan, list[Sequence], PromptTargets | None]:
        """The host side of one step (:func:`decode_rows`, one token each, then prefill chunks): its plan,
        the sequences that sample in it in row order, and the targets of its prompt logprobs (``None``: none).
        ``allocated``: the blocks handed out since the last step (those of pool 1, which keeps no per-block
        metadata, are left out)."""
        bs = self.block_size
        if allocated and self.num_window_blocks:
            allocated = [b for b in allocated if b < self.num_blocks]
        decodes = decode_rows(seqs)
        prefills = [s for s in seqs if not s.is_decode]
        # decodes: one token each, plain integers; one that is a prompt token samples only if it is the last
        positions = [s.num_computed_tokens for s in decodes]
        ids = [s.token_ids[p] for s, p in zip(decodes, positions, strict=True)]
        id_parts, pos_parts = [np.asarray(ids, dtype=np.int64)], [np.asarray(positions, dtype=np.int64)]
        sample_rows = [i for i, s in enumerate(decodes) if s.samples_this_step]
        sampling = [decodes[i] for i in sample_rows]
        scored = [(s, i) for i, s in enumerate(decodes) if s.prompt_logprobs is not None]  # (seq, first row)
        row = len(decodes)
        for s in prefills:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            # an array straight from the slice: no list of the whole step's ids to grow and convert again
            id_parts.append(np.fromiter(s.token_ids[start:end], dtype=np.int64, count=end - start))
            pos_parts.append(np.arange(start, end))
            if s.prompt_logprobs is not None:
                scored.append((s, row))
            row += end - start
            if s.samples_this_step:
                sample_rows.append(row - 1)
                sampling.append(s)
        placeholder_rows, placeholder_sources, in_order = placeholders(decodes, ids, bool(prefills))
        prompt_rows = prompt_targets = None
        if scored:  # rows followed by a prompt token: each predicts that token
            prompt_rows, prompt_targets = prompt_logprob_targets(scored)
        # every KV cache group's block tables and slots at once (hybrid KV: several)
        offsets = [self.kv.block_offset(g) for g in range(len(self.kv_cache_groups))]
        decode_tables = group_tables(decodes, offsets, self.batch_tables)
        plan = StepPlan(
            input_ids=np.concatenate(id_parts),
            positions=np.concatenate(pos_parts),
            group_slots=group_slots(decodes, decode_tables, prefills, bs, offsets, self.batch_tables),
            num_decode_tokens=len(decodes),
            decode=phase_arrays([1] * len(decodes), [p + 1 for p in positions], decode_tables),
            prefill=phase_arrays(
                [s.num_scheduled_tokens for s in prefills],
                [s.num_computed_tokens + s.num_scheduled_tokens for s in prefills],
                group_tables(prefills, offsets, self.batch_tables),
            ),
            placeholder_rows=placeholder_rows,
            placeholder_sources=placeholder_sources,
            sample_rows=None if len(sample_rows) == row else np.asarray(sample_rows, dtype=np.int64),
            num_sampling=len(sampling),
            prompt_logprob_rows=prompt_rows,
            allocated_blocks=(np.asarray(allocated, dtype=np.int64) if allocated and self.kv.wants_allocations
                              else None),
            inputs_last_sampled=in_order,
        )
        return plan, sampling, prompt_targets

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's inputs on the device and its forward pass (every rank): hidden states, input ids and
        the rows that sample (``None``: every row). A decode-only step that fits the decode graphs is replayed
        in one, its inputs copied into the graph's buffers."""
        on_device = self._upload(plan)
        if plan.allocated_blocks is not None:  # the policies reset their metadata before the step writes them
            self.kv.blocks_allocated(on_device["allocated_blocks"])
        input_ids = on_device["input_ids"]
        if plan.inputs_last_sampled:
            input_ids = self._last_sampled[:input_ids.shape[0]]
        elif plan.placeholder_rows is not None:
            input_ids[on_device["placeholder_rows"]] = self._last_sampled[on_device["placeholder_sources"]]
        graphs = self.cuda_graphs
        if graphs.graphs and plan.prefill is None and input_ids.shape[0] <= graphs.max_batch:
            self.kv.begin_step(plan.decode, None)
            hidden = graphs.replay(input_ids, on_device["positions"], on_device["decode_context_lens"],
                                   on_device["slots"], on_device["decode_tables"])
        else:
            meta = self._step_metadata(plan, on_device)
            self.kv.begin_step(plan.decode, plan.prefill)
            with forward_context(meta):
                if self.prefill_graphs.fits(input_ids.shape[0]):
                    hidden = self.prefill_graphs.replay(input_ids, meta)
                else:
                    hidden = self.model(input_ids, meta.positions)
        return hidden, input_ids, on_device.get("sample_rows")

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], allocated: list[int] | None = None) -> LaunchedStep | None:
        """Launch one step without waiting for it; None when it has nothing to read back (no sequence
        samples in it and none asked for prompt logprobs). ``allocated``: the blocks handed out since the
        last step, whose metadata the policies reset first. With tensor parallelism, rank 0 broadcasts the
        step's plan first; every rank runs the forward pass and the logits, rank 0 samples."""
        plan, sampling, prompt_targets = self.prepare(seqs, allocated)
        if self.sends_steps:
            broadcast_control(("step", plan))
        with self._step_uploads():
            return self._launch(plan, sampling, prompt_targets)

    def _launch(self, plan: StepPlan, sampling: list[Sequence], prompt_targets: PromptTargets | None
                ) -> LaunchedStep | None:
        hidden, input_ids, sample_rows = self._forward(plan)
        if not sampling and prompt_targets is None:
            return None
        prompt_logprobs = None
        if prompt_targets is not None:
            prompt_rows = PromptLogprobRows(
                self._to_device(plan.prompt_logprob_rows), self._to_device(prompt_targets.targets),
                prompt_targets.spans, prompt_targets.k,
            )
            prompt_logprobs = prompt_rows.logprobs(hidden, self.model.compute_logits)
        sampled = torch.empty(0, dtype=torch.long, device=self.device)
        logprobs = None
        if sampling:
            logits = self.model.compute_logits(hidden if sample_rows is None else hidden[sample_rows])
            inputs = self.sampling_inputs.build(sampling, logits.shape[-1], input_ids, sample_rows)
            sampled = self.sampler(logits, *inputs)
            self._keep_sampled(sampled)
            for row, s in enumerate(sampling):
                s.sample_row = row
            asked = [i for i, s in enumerate(sampling) if s.sampling_params.logprobs is not None]
            if asked:
                k = max(sampling[i].sampling_params.logprobs for i in asked)
                if len(asked) < len(sampling):
                    rows = self._to_device(np.asarray(asked, dtype=np.int64))
                    logprobs = TopLogprobs.of(logits[rows], sampled[rows], k)
                else:
                    logprobs = TopLogprobs.of(logits, sampled, k)
        spans = [] if prompt_targets is None else prompt_targets.spans
        if self.device.type != "cuda":
            return LaunchedStep(sampling, sampled, None, logprobs, prompt_logprobs, spans)

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        tokens = to_host(sampled)
        logprobs = None if logprobs is None else logprobs.map(to_host)
        prompt_logprobs = None if prompt_logprobs is None else prompt_logprobs.map(to_host)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(sampling, tokens, ready, logprobs, prompt_logprobs, spans)

    # -- the other tensor-parallel ranks ----------------------------------------------------------------

    @torch.inference_mode()
    def _follow_step(self, plan: StepPlan) -> None:
        """A rank other than 0 runs rank 0's step: the same forward pass and logits collectives, then
        takes the sampled tokens from rank 0."""
        with self._step_uploads():
            hidden, _, sample_rows = self._forward(plan)
            if plan.prompt_logprob_rows is not None:
                prompt_rows = self._to_device(plan.prompt_logprob_rows)
                for _ in prompt_logits(hidden, prompt_rows, self.model.compute_logits):
                    pass
        if plan.num_sampling:
            self.model.compute_logits(hidden if sample_rows is None else hidden[sample_rows])
            self._keep_sampled(torch.empty(plan.num_sampling, dtype=torch.long, device=self.device))

    def _keep_sampled(self, sampled: torch.Tensor) -> None:
        """Keep the step's sampled tokens (rank 0's, into ``sampled`` on the other ranks): the next step
        reads those not yet read back from here, on every rank."""
        if tp_size() > 1:
            dist.broadcast(sampled, src=0)
        self._last_sampled = sampled

    def follow(self) -> Any:
        """The loop of a rank other than 0: run what rank 0 broadcasts until it says stop; returns what
        rank 0 sent with the stop (``("stop", result)``; None for a plain stop)."""
        while True:
            message = broadcast_control()
            if message[0] == "stop":
                return message[1] if len(message) > 1 else None
            self._follow_step(message[1])
