"""ModelRunner: builds the model from its family plugin, loads weights, sizes and owns the paged KV
cache, binds the attention backend and the sparse policy, and runs one step of the scheduler."""

from __future__ import annotations

import inspect
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, forward_context
from nanovllm.config import EngineConfig
from nanovllm.distributed import (
    agree_min,
    barrier,
    barrier_within,
    broadcast_control,
    capture_problem,
    enable_symmetric_all_reduce,
    release_before_destroy,
    tp_rank,
    tp_size,
)
from nanovllm.engine.loader import load_weights
from nanovllm.engine.kv_allocation import allocate_kv_store
from nanovllm.engine.sequence import PLACEHOLDER, RawLogprobs, Sequence
from nanovllm.kv.offload import GraphUnsafe, HostPhase
from nanovllm.layers import weight_prefetch
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import LogitsProcessing, PenaltyCounts, Sampler, TopLogprobs
from nanovllm.plugins import PluginSet
from nanovllm.policy import PolicyHooks
from nanovllm.selection import BackendChoice, PolicyPlan

AUTO_BACKENDS = ("triton", "torch")  # preference order for attention_backend="auto"


# Seconds every tensor-parallel rank has to capture its decode graphs (capture with 4 ranks hung once on an
# H200 x4); past them the engine decodes eagerly. The variable changes it.
CAPTURE_TIMEOUT_VARIABLE = "NANOVLLM_CAPTURE_TIMEOUT"
DEFAULT_CAPTURE_TIMEOUT = 300.0


class CaptureTimeout(RuntimeError):
    """A tensor-parallel rank did not capture its decode graphs in time (rank 0 raises it)."""


def capture_timeout() -> float:
    """The seconds of ``NANOVLLM_CAPTURE_TIMEOUT`` (default ``DEFAULT_CAPTURE_TIMEOUT``)."""
    raw = os.environ.get(CAPTURE_TIMEOUT_VARIABLE, "")
    try:
        seconds = float(raw) if raw else DEFAULT_CAPTURE_TIMEOUT
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{CAPTURE_TIMEOUT_VARIABLE}={raw!r} must be a number of seconds above 0 (the time "
                         "each tensor-parallel rank has to capture its decode CUDA graphs); unset it for "
                         f"{DEFAULT_CAPTURE_TIMEOUT:.0f}")
    return seconds


# Prompt rows whose logits are computed at once for prompt logprobs: a whole 8K-token chunk of a
# 49K-token vocabulary would take 1.6 GB of float32 logits.
PROMPT_LOGPROB_ROWS = 1024


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
class PhaseArrays:
    """A :class:`PhaseMetadata` on the host."""

    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    max_query_len: int
    max_context_len: int


@attrs.define
class StepPlan:
    """One step's inputs on the host: what every tensor-parallel rank needs to run the same forward pass
    and the same logits collectives. Rank 0 makes it from the scheduled sequences and broadcasts it."""

    input_ids: np.ndarray  # [num_tokens] int64; PLACEHOLDER where the token is still on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    num_decode_tokens: int
    decode: PhaseArrays | None
    prefill: PhaseArrays | None
    placeholder_rows: np.ndarray | None  # rows whose token is one sampled last step, not read back...
    placeholder_sources: np.ndarray | None  # ...and its row among last step's sampled tokens
    sample_rows: np.ndarray | None  # hidden-state rows that sample; None: every row, in order
    num_sampling: int
    prompt_logprob_rows: np.ndarray | None  # hidden-state rows followed by a prompt token, if any asked
    allocated_blocks: np.ndarray | None  # blocks handed out since the last step, for the policies to reset


@attrs.define
class PromptTargets:
    """Rank 0's part of the prompt logprobs of a step: the prompt token each row of
    ``StepPlan.prompt_logprob_rows`` predicts, the spans they belong to, the most top tokens asked."""

    targets: np.ndarray
    spans: list[tuple[Sequence, int, int]]
    k: int


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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but PyTorch sees no CUDA device; use device='cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    model_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = getattr(torch, model_dtype, None)
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module) -> None:
    """Random weights for shape presets: small uniform values, norms left at one."""
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.uniform_(-1e-3, 1e-3)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        model_path: Path,
        model_cls: type,
        max_model_len: int,
        plugins: PluginSet,
        policy_plan: PolicyPlan,
        backend_choice: BackendChoice,
        observers: tuple[object, ...] = (),
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device)
        # with tensor parallelism rank 0 schedules and broadcasts each step; the others ``follow()``
        self.sends_steps = tp_size() > 1 and tp_rank() == 0
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        torch.manual_seed(config.seed)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_cls(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            load_weights(self.model, model_path)
        self.model.eval()
        barrier()  # a rank that failed to build or load its shard is reported here, not in a collective
        # why small all-reduces stay on NCCL (None: they go peer to peer through symmetric memory)
        self.symmetric_all_reduce_off = enable_symmetric_all_reduce(self.dtype, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        self.sampler = Sampler()
        self.penalty_counts: PenaltyCounts | None = None  # made when a request first uses penalties

        self.backend = self._make_backend(backend_choice, plugins)
        self.hooks = self._make_policy_hooks(policy_plan, observers)
        for layer in self.attention_layers:
            layer.bind(self.backend, self.hooks)
        # the KV store sizing and allocation step: the paged GPU cache, or the host pool with GPU slots
        self.kv = allocate_kv_store(config, self.model, self.attention_layers, self.hooks, max_model_len,
                                    self.dtype, self.device, PROMPT_LOGPROB_ROWS)
        self.num_blocks = self.kv.num_blocks
        self._last_sampled = torch.empty(0, dtype=torch.long, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda":
            self._warm_up()
        if self._every_rank_captures(self._use_cuda_graphs()):
            self._capture_on_every_rank()
        barrier()  # every rank built its runner: a failure is reported at start, not at the first step

    # -- set-up -----------------------------------------------------------------------------------

    def _make_backend(self, choice: BackendChoice, plugins: PluginSet):
        dtype_name = str(self.dtype).removeprefix("torch.")
        if choice.info is None:  # "auto": the first of AUTO_BACKENDS that supports this model here
            table = plugins.registry.attention_backends
            usable = [
                name for name in AUTO_BACKENDS
                if name in table and table[name].supports(self.device.type, dtype_name, self.head_dim) is None
            ]
            if not usable:
                raise ValueError(
                    f"no installed attention backend among {', '.join(AUTO_BACKENDS)} supports device "
                    f"{self.device.type}, dtype {dtype_name}, head size {self.head_dim}"
                )
            choice = BackendChoice(table[usable[0]])
        reason = choice.info.supports(self.device.type, dtype_name, self.head_dim)
        if reason is not None:
            raise ValueError(f"attention backend {choice.info.name!r} cannot run this model: {reason}")
        backend = choice.load()(choice.config)
        windowed = any(layer.sliding_window is not None for layer in self.attention_layers)
        ops = (backend.prefill, backend.decode)
        if windowed and not all("window" in inspect.signature(op).parameters for op in ops):
            raise ValueError(
                f"attention backend {choice.info.name!r} takes no sliding window (its prefill and decode have "
                "no window argument), and this model has sliding-window layers: choose "
                "attention_backend='torch' or 'triton'"
            )
        return backend

    @staticmethod
    def _make_policy_hooks(plan: PolicyPlan, observers: tuple[object, ...]) -> PolicyHooks:
        prefill = plan.prefill.cls(plan.prefill.config)
        decode = prefill if plan.decode is plan.prefill else plan.decode.cls(plan.decode.config)
        return PolicyHooks(prefill, decode, observers)

    @property
    def prefill_policy(self):
        return self.hooks.prefill.policy

    @property
    def decode_policy(self):
        return self.hooks.decode.policy

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Two mixed steps (one decode, two prefill chunks of long or short queries) that write nothing,
        so the kernels of prefill steps compile now and not inside the first requests. The first step's
        chunks follow a history that reaches ``max_model_len`` (block 0, zeroed, throughout), so the paged
        kernels and the policies' long-context paths (e.g. past a ``dense_below``) compile too; with
        offload that history is read from the pool, as a long prompt's would be."""
        dev = self.device

        def phase(lens: list[int], history: int = 0) -> PhaseMetadata:
            width = -(-(max(lens) + history) // self.block_size)
            tables = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
            cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=dev)
            return PhaseMetadata(cu, cu[1:] - cu[:-1] + history, tables, max(lens), max(lens) + history)

        def host(lens: list[int], history: int = 0) -> HostPhase:
            width = -(-(max(lens) + history) // self.block_size)
            return HostPhase([[0] * width] * len(lens), lens, [n + history for n in lens])

        first = min(self.max_model_len, 96)
        history = self.max_model_len - first
        # block 0 (of the pool, with offload) is no one's yet: zeros, not what the memory held, so no NaN
        # reaches a policy
        for layer in self.attention_layers:
            layer.k_cache[0].zero_()
            layer.v_cache[0].zero_()
        for chunks, before in (([first, 8], history), ([8, 8], 0)):
            num_tokens = 1 + sum(chunks)
            ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
            meta = StepMetadata(torch.full((num_tokens,), -1, dtype=torch.long, device=dev), ids, 1, phase([1]),
                                phase(chunks, before))
            self.kv.begin_step(host([1]), host(chunks, before))
            with forward_context(meta):
                self.model.compute_logits(self.model(ids, ids.clone()))
        torch.cuda.synchronize()

    # -- CUDA graphs for decode steps -------------------------------------------------------------------

    def _use_cuda_graphs(self) -> bool:
        usable = (
            self.device.type == "cuda"
            and self.kv.can_capture_decode(self.hooks.decode.select is not None)
            and not self.config.enforce_eager
            and self.backend.supports_cuda_graphs
            and self.hooks.cuda_graph_safe
        )
        problem = capture_problem() if usable else None
        if problem is not None:
            warnings.warn(f"{problem}: the engine decodes eagerly (no CUDA graphs); pass enforce_eager=True "
                          "to say so and silence this", RuntimeWarning, stacklevel=2)
        return usable and problem is None

    @staticmethod
    def _every_rank_captures(this_rank_can: bool) -> bool:
        """Every tensor-parallel rank captures decode graphs, or none does: a rank that captured alone would
        wait forever in its warm-up collectives (a rank's backend, policy or environment may differ)."""
        every_rank_can = agree_min(int(this_rank_can)) == 1
        if this_rank_can and not every_rank_can:
            warnings.warn(f"tensor-parallel rank {tp_rank()} decodes eagerly (no CUDA graphs): another rank "
                          "cannot capture its decode graphs", RuntimeWarning, stacklevel=3)
        return every_rank_can

    def _capture_on_every_rank(self) -> None:
        """Capture the decode graphs; with tensor parallelism every rank has ``capture_timeout()`` seconds
        from a common start after the warm-ups. Rank 0 then waits for the others only until that time is up
        (at least a second) and raises :class:`CaptureTimeout` if one is late, for the engine to start again
        eagerly. A capture that hangs cannot be interrupted in its own process: past the time, each rank
        still in it warns, so that a hang says where it is."""
        try:
            with self.kv.capturing():
                self._prepare_decode_graphs()
        except GraphUnsafe:  # under offload, a decode step that still reads densely somewhere: stay eager
            return
        if tp_size() == 1:
            self._capture_decode_graphs()
            return
        timeout = capture_timeout()
        barrier()  # every rank ran its warm-up collectives: from here each one captures on its own
        start = time.monotonic()
        still_capturing = threading.Timer(timeout, warnings.warn, args=(
            f"tensor-parallel rank {tp_rank()} has not captured its decode CUDA graphs in {timeout:.0f} s "
            f"({CAPTURE_TIMEOUT_VARIABLE}); if it never does, stop the program and start the engine with "
            "enforce_eager=True", RuntimeWarning))
        still_capturing.daemon = True
        still_capturing.start()
        try:
            self._capture_decode_graphs()
        finally:
            still_capturing.cancel()
        try:
            barrier_within(max(timeout - (time.monotonic() - start), 1.0))
        except RuntimeError as exc:
            raise CaptureTimeout(
                f"not every tensor-parallel rank captured its decode CUDA graphs within {timeout:.0f} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    @torch.inference_mode()
    def _prepare_decode_graphs(self) -> None:
        """The batch-size buckets, their static input and output buffers, and a warm-up of each bucket
        outside any graph: Triton compiles here, and with tensor parallelism the collectives run here, so
        that capturing needs no other rank (a rank that hangs in its capture cannot hold up the others)."""
        max_bs = min(self.config.max_num_seqs, 512)
        self.graph_sizes = sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})
        max_blocks = -(-self.max_model_len // self.block_size)
        dev = self.device
        self.graph_inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.long, device=dev),
            "context_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        for bs in self.graph_sizes:
            self.kv.begin_step(None, None)  # a decode step (with offload, its dense reads raise GraphUnsafe)
            with forward_context(self._graph_metadata(bs)):
                warm = self.model(self.graph_inputs["input_ids"][:bs], self.graph_inputs["positions"][:bs])
        self.graph_output = torch.empty(max_bs, *warm.shape[1:], dtype=warm.dtype, device=dev)

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        """One graph per batch-size bucket, sharing a memory pool and the static buffers."""
        if tp_size() > 1:  # the graphs hold the NCCL communicator: they must go before it does
            release_before_destroy(self.release_graphs)
        pool = None
        with weight_prefetch.capturing(self.device):  # the graphs read each next matmul's weights into L2
            for bs in reversed(self.graph_sizes):
                graph = torch.cuda.CUDAGraph()
                ids, pos = self.graph_inputs["input_ids"][:bs], self.graph_inputs["positions"][:bs]
                with forward_context(self._graph_metadata(bs)), torch.cuda.graph(graph, pool):
                    self.kv.begin_capture()
                    self.graph_output[:bs] = self.model(ids, pos)
                    self.kv.end_capture()
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize()

    def release_graphs(self) -> None:
        """Drop the decode graphs (the engine steps eagerly afterwards)."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def _graph_metadata(self, bs: int) -> StepMetadata:
        g = self.graph_inputs
        decode = PhaseMetadata(
            g["cu_seqlens_q"][: bs + 1], g["context_lens"][:bs], g["block_tables"][:bs], 1, self.max_model_len
        )
        return StepMetadata(g["slot_mapping"][:bs], g["positions"][:bs], bs, decode, None)

    def _replay_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        bs = input_ids.shape[0]
        graph_bs = next(b for b in self.graph_sizes if b >= bs)
        g = self.graph_inputs
        g["input_ids"][:bs] = input_ids
        g["positions"][:bs] = positions
        g["slot_mapping"][:graph_bs].fill_(-1)
        g["slot_mapping"][:bs] = meta.slot_mapping
        g["context_lens"][:graph_bs].fill_(1)  # padded rows attend to one (ignored) token
        g["context_lens"][:bs] = meta.decode.context_lens
        tables = meta.decode.block_tables
        g["block_tables"][:graph_bs].fill_(0)
        g["block_tables"][:bs, : tables.shape[1]] = tables
        self.kv.order_streams()
        self.graphs[graph_bs].replay()
        self.kv.order_streams()
        return self.graph_output[:bs]

    # -- one step ---------------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through pinned memory and without waiting for the GPU."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _phase_arrays(seqs: list[Sequence], q_lens: list[int], ctx_lens: list[int]) -> PhaseArrays | None:
        if not seqs:
            return None
        tables = np.full((len(seqs), max(len(s.block_table) for s in seqs)), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        return PhaseArrays(np.cumsum([0, *q_lens], dtype=np.int32), np.asarray(ctx_lens, dtype=np.int32), tables,
                           max(q_lens), max(ctx_lens))

    def _phase_metadata(self, phase: PhaseArrays | None) -> PhaseMetadata | None:
        if phase is None:
            return None
        return PhaseMetadata(self._to_device(phase.cu_seqlens_q), self._to_device(phase.context_lens),
                             self._to_device(phase.block_tables), phase.max_query_len, phase.max_context_len)

    def prepare(
        self, seqs: list[Sequence], allocated: list[int] | None = None
    ) -> tuple[StepPlan, list[Sequence], PromptTargets | None]:
        """The host side of one step (decodes, one token each, first; then prefill chunks): its plan, the
        sequences that sample in it in row order, and the targets of its prompt logprobs (``None``: none).
        ``allocated``: the blocks handed out since the last step."""
        bs = self.block_size
        decodes = [s for s in seqs if s.is_decode]
        prefills = [s for s in seqs if not s.is_decode]
        # decodes: one token each, plain integers; one that is a prompt token samples only if it is the last
        positions = [s.num_computed_tokens for s in decodes]
        ids = [s.token_ids[p] for s, p in zip(decodes, positions, strict=True)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, positions, strict=True)]
        pos_parts, slot_parts = [np.asarray(positions, dtype=np.int64)], [np.asarray(slots, dtype=np.int64)]
        sample_rows = [i for i, s in enumerate(decodes) if s.samples_this_step]
        sampling = [decodes[i] for i in sample_rows]
        scored = [(s, i) for i, s in enumerate(decodes) if s.prompt_logprobs is not None]  # (seq, first row)
        row = len(decodes)
        for s in prefills:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            pos = np.arange(start, end)
            table = np.asarray(s.block_table, dtype=np.int64)
            ids.extend(s.token_ids[start:end])
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            if s.prompt_logprobs is not None:
                scored.append((s, row))
            row += end - start
            if s.samples_this_step:
                sample_rows.append(row - 1)
                sampling.append(s)
        on_device = [i for i, s in enumerate(decodes) if ids[i] == PLACEHOLDER]  # sampled last step, not read back
        prompt_rows = prompt_targets = None
        if scored:  # rows followed by a prompt token: each predicts that token
            score_rows, targets, spans = [], [], []
            for s, first_row in scored:
                start = s.num_computed_tokens
                n = min(s.num_scheduled_tokens, s.num_prompt_tokens - 1 - start)
                if n > 0:
                    score_rows.extend(range(first_row, first_row + n))
                    targets.extend(s.token_ids[start + 1 : start + 1 + n])
                    spans.append((s, start + 1, n))
            if spans:
                prompt_rows = np.asarray(score_rows, dtype=np.int64)
                k = max(s.sampling_params.prompt_logprobs for s, _, _ in spans)
                prompt_targets = PromptTargets(np.asarray(targets, dtype=np.int64), spans, k)
        plan = StepPlan(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.concatenate(pos_parts),
            slot_mapping=np.concatenate(slot_parts),
            num_decode_tokens=len(decodes),
            decode=self._phase_arrays(decodes, [1] * len(decodes), [p + 1 for p in positions]),
            prefill=self._phase_arrays(
                prefills,
                [s.num_scheduled_tokens for s in prefills],
                [s.num_computed_tokens + s.num_scheduled_tokens for s in prefills],
            ),
            placeholder_rows=np.asarray(on_device, dtype=np.int64) if on_device else None,
            placeholder_sources=(np.asarray([decodes[i].sample_row for i in on_device], dtype=np.int64)
                                 if on_device else None),
            sample_rows=None if len(sample_rows) == row else np.asarray(sample_rows, dtype=np.int64),
            num_sampling=len(sampling),
            prompt_logprob_rows=prompt_rows,
            allocated_blocks=(np.asarray(allocated, dtype=np.int64) if allocated and (
                self.hooks.blocks_allocated or self.kv.tracks_allocations)
                else None),
        )
        return plan, sampling, prompt_targets

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's inputs on the device and its forward pass (every rank): hidden states, input ids and
        the rows that sample (``None``: every row)."""
        if plan.allocated_blocks is not None:  # the policies reset their metadata before the step writes them
            ids = self._to_device(plan.allocated_blocks)
            for on_blocks_allocated in self.hooks.blocks_allocated:
                on_blocks_allocated(ids)
            self.kv.forget_blocks(ids)  # and the store's caches of what blocks held
        input_ids = self._to_device(plan.input_ids)
        if plan.placeholder_rows is not None:
            sources = self._to_device(plan.placeholder_sources)
            input_ids[self._to_device(plan.placeholder_rows)] = self._last_sampled[sources]
        meta = StepMetadata(
            slot_mapping=self._to_device(plan.slot_mapping),
            positions=self._to_device(plan.positions),
            num_decode_tokens=plan.num_decode_tokens,
            decode=self._phase_metadata(plan.decode),
            prefill=self._phase_metadata(plan.prefill),
        )
        self.kv.begin_step(plan.decode, plan.prefill)
        if self.graphs and meta.prefill is None and input_ids.shape[0] <= self.graph_sizes[-1]:
            hidden = self._replay_decode(input_ids, meta.positions, meta)
        else:
            with forward_context(meta):
                hidden = self.model(input_ids, meta.positions)
        sample_rows = None if plan.sample_rows is None else self._to_device(plan.sample_rows)
        return hidden, input_ids, sample_rows

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], allocated: list[int] | None = None) -> LaunchedStep | None:
        """Launch one step without waiting for it; None when it has nothing to read back (no sequence
        samples in it and none asked for prompt logprobs). ``allocated``: the blocks handed out since the
        last step, whose metadata the policies reset first. With tensor parallelism, rank 0 broadcasts the
        step's plan first; every rank runs the forward pass and the logits, rank 0 samples."""
        plan, sampling, prompt_targets = self.prepare(seqs, allocated)
        if self.sends_steps:
            broadcast_control(("step", plan))
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
            step_inputs = (input_ids, sample_rows)
            sampled = self.sampler(logits, *self._sampling_tensors(sampling, logits.shape[-1], step_inputs))
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
        hidden, _, sample_rows = self._forward(plan)
        if plan.prompt_logprob_rows is not None:
            for _ in prompt_logits(hidden, self._to_device(plan.prompt_logprob_rows), self.model.compute_logits):
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

    def _sampling_tensors(self, seqs: list[Sequence], vocab_size: int, step_inputs: tuple):
        """The sampler's per-row inputs; a feature no row uses is ``None`` (no work in the sampler).
        ``step_inputs``: the step's input ids and the rows that sample (for multi-token bad words)."""
        params = [s.sampling_params for s in seqs]
        temperatures = self._to_device(np.array([p.temperature for p in params], dtype=np.float32))
        top_ks = top_ps = min_ps = None
        if any(p.top_k > 0 for p in params):
            top_ks = self._to_device(np.array([p.top_k for p in params], dtype=np.int64))
        if any(p.top_p < 1 for p in params):
            top_ps = self._to_device(np.array([p.top_p for p in params], dtype=np.float32))
        if any(p.min_p > 0 for p in params):
            min_ps = self._to_device(np.array([p.min_p for p in params], dtype=np.float32))
        generators = []
        for s in seqs:
            if s.sampling_params.seed is not None and s.generator is None:
                s.generator = torch.Generator(device=self.device).manual_seed(s.sampling_params.seed)
            generators.append(s.generator)
        processing = None
        if any(s.processes_logits for s in seqs):
            processing = self._logits_processing(seqs, vocab_size, *step_inputs)
        return temperatures, top_ks, top_ps, generators, min_ps, processing

    def _logits_processing(
        self, seqs: list[Sequence], vocab_size: int, input_ids: torch.Tensor, sample_rows: torch.Tensor | None
    ) -> LogitsProcessing:
        """Gather this step's penalties, biases and masks into a few index tensors (built on the host from
        what the host knows; the previous token of a multi-token bad word is compared on the device)."""
        add: tuple[list, list, list] = ([], [], [])  # rows, token ids, values
        banned: tuple[list, list, list] = ([], [], [])  # rows, token ids, required previous token
        restricted, allowed_rows, allowed_ids = [], [], []
        penalty_rows, slots, penalties = [], [], []
        for row, s in enumerate(seqs):
            if not s.processes_logits:
                continue
            p = s.sampling_params
            if p.logit_bias:
                add[0].extend([row] * len(p.logit_bias))
                add[1].extend(p.logit_bias)
                add[2].extend(p.logit_bias.values())
            bans = list(s.min_tokens_banned) if s.num_completion_tokens < p.min_tokens else []
            output = s.completion_token_ids
            for word in s.bad_words_token_ids:
                k = len(word) - 1  # tokens that must precede the banned last one
                if k == 0:
                    bans.append(word[0])
                elif len(output) >= k and output[len(output) - k : -1] == word[:-2]:
                    banned[0].append(row)
                    banned[1].append(word[-1])
                    banned[2].append(word[-2])
            add[0].extend([row] * len(bans))
            add[1].extend(bans)
            add[2].extend([float("-inf")] * len(bans))
            if p.allowed_token_ids:
                restricted.append(row)
                allowed_rows.extend([row] * len(p.allowed_token_ids))
                allowed_ids.extend(p.allowed_token_ids)
            if p.has_penalties:
                if self.penalty_counts is None:
                    self.penalty_counts = PenaltyCounts(vocab_size, self.device)
                prompt = self._to_device(np.asarray(s.token_ids[: s.num_prompt_tokens], dtype=np.int64))
                generated = self._to_device(np.asarray([t for t in output if t != PLACEHOLDER], dtype=np.int64))
                penalty_rows.append(row)
                slots.append(self.penalty_counts.slot(s, prompt, generated))
                penalties.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))

        def ints(values: list[int]) -> torch.Tensor:
            return self._to_device(np.asarray(values, dtype=np.int64))

        def floats(values: list[float]) -> torch.Tensor:
            return self._to_device(np.asarray(values, dtype=np.float32))

        processing = LogitsProcessing(counts=self.penalty_counts)
        if add[0]:
            processing.add = (ints(add[0]), ints(add[1]), floats(add[2]))
        if banned[0]:
            rows = ints(banned[0])
            last_tokens = input_ids if sample_rows is None else input_ids[sample_rows]  # what each row read
            processing.conditional_ban = (rows, ints(banned[1]), ints(banned[2]), last_tokens[rows])
        if restricted:
            processing.allowed = (ints(restricted), ints(allowed_rows), ints(allowed_ids))
        if penalty_rows:
            repetition, frequency, presence = (floats(list(column)) for column in zip(*penalties, strict=True))
            processing.penalties = (ints(penalty_rows), ints(slots), repetition, frequency, presence)
        return processing
