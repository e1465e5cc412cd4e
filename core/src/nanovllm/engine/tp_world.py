"""The tensor-parallel world of one engine: this process alone (``tensor_parallel_size=1``), worker
processes the engine starts (``distributed_executor_backend="mp"``), or processes ``torchrun`` started
(``"external_launcher"``). It checks the world can be made, starts it and this rank's model runner, starts
it again without CUDA graphs when a rank's capture times out, and stops it."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch

from nanovllm.config import EngineConfig, ResolvedConfig
from nanovllm.distributed import (
    broadcast_control,
    destroy_tensor_parallel,
    init_tensor_parallel,
    torchrun_ranks,
    tp_rank,
    tp_size,
)
from nanovllm.engine.cuda_graphs import CAPTURE_TIMEOUT_VARIABLE, CaptureTimeout
from nanovllm.engine.model_loading import EngineParts
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.tp_workers import TPWorkers, check_observers_travel

T = TypeVar("T")


class TensorParallelWorld:
    def __init__(self, options: EngineConfig, observers: tuple[object, ...]) -> None:
        """Checks that need no model: no other world is open here, ``torchrun``'s environment is there
        (``external_launcher``), the observers can travel to spawned workers."""
        if tp_size() > 1:  # the layers would shard themselves for that world
            raise RuntimeError(
                f"this process already runs a tensor-parallel world of {tp_size()} ranks (an engine with "
                "tensor_parallel_size > 1 that is still open); close() it before creating another engine"
            )
        self.size = options.tensor_parallel_size
        self.external = options.distributed_executor_backend == "external_launcher"
        # checked before anything is loaded: a script started without torchrun fails at once
        self.torchrun_ranks = torchrun_ranks(self.size) if self.external else None
        if self.size > 1 and not self.external:
            check_observers_travel(observers, self.size)
        self.workers: TPWorkers | None = None
        self._finalizer: weakref.finalize | None = None  # leaves the world
        self.stopped_reason: str | None = None  # set when the world is closed or broken

    @property
    def follows_rank0(self) -> bool:
        """The ranks are torchrun's: they run requests together only inside ``run_on_every_rank``."""
        return self.external and tp_size() > 1

    @property
    def single(self) -> bool:
        """One rank: a failed step can be contained without stopping anyone."""
        return self.workers is None and not self.follows_rank0

    def check(self, config: ResolvedConfig) -> None:
        """Each rank takes an equal share of the heads and MLP features, and a GPU of its own."""
        if self.size == 1:
            return
        hf = config.hf_config
        heads = getattr(hf, "num_attention_heads", None)
        for name, value in (("num_attention_heads", heads),
                            ("num_key_value_heads", getattr(hf, "num_key_value_heads", None) or heads),
                            ("intermediate_size", getattr(hf, "intermediate_size", None))):
            if value is not None and value % self.size:
                raise ValueError(f"tensor_parallel_size={self.size} must divide the model's {name}={value}: each "
                                 "rank takes an equal share; choose a divisor of it")
        if config.device != "cuda":
            return
        if self.external:  # the ranks may be on several hosts: this one needs the GPU of its LOCAL_RANK
            local_rank = self.torchrun_ranks[1]
            if torch.cuda.device_count() <= local_rank:
                raise ValueError(f"torchrun gave this process LOCAL_RANK={local_rank}, but PyTorch sees "
                                 f"{torch.cuda.device_count()} GPU(s) on this host; start at most that many "
                                 "processes per host (--nproc-per-node)")
        elif torch.cuda.device_count() < self.size:
            raise ValueError(f"tensor_parallel_size={self.size} needs one GPU per rank, but PyTorch sees "
                             f"{torch.cuda.device_count()}; lower it, or use device='cpu'")

    def start(self, config: ResolvedConfig, parts: EngineParts) -> tuple[ModelRunner, ResolvedConfig]:
        """Join or start the world and build this rank's runner; returns it and the config it runs with.
        A rank that does not capture its decode graphs in time makes the world start again without them
        (``enforce_eager``), with a warning that says how to avoid that."""
        self.check(config)
        try:
            return self._start(config, parts), config
        except CaptureTimeout as exc:
            if self.external:  # torchrun's ranks cannot be started again from here
                raise CaptureTimeout(f"{exc}; start every rank again with enforce_eager=True") from exc
            late = str(exc)
        warnings.warn(
            f"{late}, so the engine started its {self.size} ranks again without CUDA graphs (slower decoding). "
            f"Pass enforce_eager=True to skip the capture, or set {CAPTURE_TIMEOUT_VARIABLE} to more seconds if "
            "it was only slow", RuntimeWarning, stacklevel=4,  # the caller of LLM(...)
        )
        config = attrs.evolve(config, enforce_eager=True)
        gc.collect()  # the failed runner's model and cache, before the new one sizes its cache
        return self._start(config, parts), config

    def _start(self, config: ResolvedConfig, parts: EngineParts) -> ModelRunner:
        """A failure stops the workers; a worker's error, with its traceback, is the one raised."""
        if self.external:
            rank, local_rank = self.torchrun_ranks
            init_tensor_parallel(rank, self.size, config.device, local_rank=local_rank)
            self._finalizer = weakref.finalize(self, destroy_tensor_parallel)
        elif self.size > 1:
            self.workers = TPWorkers(config, self.size)
            # the workers stop when the world is closed or garbage-collected (the finalizer holds no world)
            self._finalizer = weakref.finalize(self, self.workers.stop)
        try:
            return ModelRunner(config, parts)
        except BaseException as exc:
            if self.workers is None:
                raise
            error = self.workers.worker_failure()
            self._finalizer.detach()
            self.workers.stop(graceful=False)
            if error is None:
                raise
            raise error from exc

    def step_failed(self, exc: BaseException) -> BaseException | None:
        """After a step failed with several ranks (they may be out of step): stop the world; the error to
        raise (None: ``exc`` itself)."""
        if self.follows_rank0:  # torchrun's ranks: none steps again
            self.stopped_reason = (f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); the "
                                   "ranks may be out of step: restart every rank")
        if self.workers is None:
            return None
        error = self.workers.failure(exc)
        self.workers.stop(graceful=False)
        self.stopped_reason = str(error)
        return error

    def run_on_every_rank(self, call: Callable[[], T], runner: ModelRunner) -> T:
        """Under torchrun every rank calls this with the same ``call``: rank 0 runs it, the others follow its
        steps, and every rank returns rank 0's result (or raises when rank 0 did)."""
        if not self.follows_rank0:
            return call()
        if self.stopped_reason is not None:
            raise RuntimeError(self.stopped_reason)
        if tp_rank() != 0:
            kind, value, self.stopped_reason = runner.follow()
            if kind == "error":
                raise RuntimeError(f"rank 0 raised in generate(), so this rank does too: {value}")
            return value
        try:
            result: Any = call()
        except BaseException as exc:  # a bad prompt before any step, or a failed step (then stopped)
            broadcast_control(("stop", ("error", f"{type(exc).__name__}: {exc}", self.stopped_reason)))
            raise
        broadcast_control(("stop", ("outputs", result, None)))
        return result

    def close(self) -> None:
        """Stop the workers, or leave torchrun's world (a no-op with one rank)."""
        if self._finalizer is not None:
            self._finalizer()
            if self.stopped_reason is None:
                self.stopped_reason = "this engine was closed; create a new one"
