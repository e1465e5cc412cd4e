"""LLMEngine: tokenizer, scheduler and model runner behind ``generate`` and ``chat``."""

from __future__ import annotations

import gc
import json
import logging
import time
import warnings
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import attrs

from nanovllm.chat_utils import ChatOptions
from nanovllm.chat_utils import render as render_chat
from nanovllm.config import EngineConfig
from nanovllm.default_model import is_packaged_model, packaged_model_dir
from nanovllm.distributed import (
    broadcast_control,
    destroy_tensor_parallel,
    init_tensor_parallel,
    torchrun_ranks,
    tp_rank,
    tp_size,
)
from nanovllm.engine.input_processor import InputProcessor, Prompt
from nanovllm.engine.loader import ModelDirectoryError, read_config_json
from nanovllm.engine.model_runner import (
    CAPTURE_TIMEOUT_VARIABLE,
    CaptureTimeout,
    LaunchedStep,
    ModelRunner,
    resolve_device,
)
from nanovllm.engine.output_stream import OutputBuilder, OutputStream
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.tp_workers import RunnerSpec, TPWorkers, check_observers_travel
from nanovllm.hub import is_hub_id, resolve_hub_id
from nanovllm.inputs import TokensPrompt
from nanovllm.outputs import RequestOutput
from nanovllm.plugins import get_plugins, load_registered
from nanovllm.presets import is_preset, preset_dir
from nanovllm.sampling_params import SamplingParams
from nanovllm.selection import resolve_attention_backend, resolve_observer, resolve_policies


_log = logging.getLogger(__name__)


def names_hub_model(model: str | None) -> bool:
    """``model`` is looked up on the hub: not the built-in model, a preset or an existing directory."""
    if is_packaged_model(model) or is_preset(model) or Path(model).expanduser().is_dir():
        return False
    return is_hub_id(model)


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local directory, the built-in model or another packaged one (``"gemma-3-270m"``), a preset, or a
    hub ID looked up in (or downloaded to) the Hugging Face cache (``download_dir``, default
    ``HF_HUB_CACHE``) at ``revision``."""
    hub = names_hub_model(model)
    if revision is not None and not hub:
        raise ValueError(f"revision={revision!r} applies to hub model IDs only; model {model!r} is not one, "
                         "so leave revision unset")
    if is_packaged_model(model):
        return packaged_model_dir(model)
    if is_preset(model):
        return preset_dir(model)
    if hub:
        return resolve_hub_id(model, revision, download_dir)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelDirectoryError(
            f"model {model!r} is not a directory, nor a hub ID like 'Qwen/Qwen3-0.6B'. nanovllm loads Hugging "
            "Face-format directories and hub models; leave model unset for the built-in SmolLM2-135M-Instruct"
        )
    return path


def load_tokenizer(path: Path):
    """The Hugging Face tokenizer in ``path``; one shipped as code with the checkpoint fails: it is never run."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise ModelDirectoryError(
            f"cannot load a tokenizer from {str(path)!r}: {exc}; pass tokenizer= (a directory or hub ID of one "
            "transformers can load), or skip_tokenizer_init=True to run on token ids only"
        ) from exc


# vLLM arguments for features nanovllm does not have: accepted as None, a clear error otherwise
_UNSUPPORTED_ARGUMENTS = {
    "lora_request": "nanovllm has no LoRA support; merge the adapter into the model's weights and load that",
    "mm_processor_kwargs": "nanovllm has no multimodal support: it runs text-only models",
}


def _check_unsupported(**arguments: object) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(f"{name}={value!r:.80} is not supported: {_UNSUPPORTED_ARGUMENTS[name]}; leave {name} "
                             "unset (None)")


def override_config(hf_config: Any, overrides: dict[str, Any] | None) -> None:
    """Replace fields of a model's config (``hf_overrides``); a name the config lacks is an error, since
    setting it would change nothing."""
    for name, value in (overrides or {}).items():
        if not hasattr(hf_config, name):
            raise ValueError(f"hf_overrides names {name!r}, which {type(hf_config).__name__} does not have; "
                             "use a field name from the model's config.json")
        setattr(hf_config, name, value)


class LLMEngine:
    def __init__(
        self, model: str | None = None, *, observers: SequenceABC[object] = (), **kwargs: Any
    ) -> None:
        """``observers``: objects implementing notification hooks of :class:`nanovllm.hookspecs.PolicySpec`
        (``on_kv_write``, ``on_blocks_allocated``, ``on_blocks_selected``), e.g. statistics, or the
        selection strings of observers that plugins registered (``"name:key=value"``)."""
        if is_preset(model):  # a published shape with random weights and no tokenizer
            kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, **kwargs}
        self.config = config = EngineConfig.from_kwargs(model, kwargs)
        if tp_size() > 1:  # the layers would shard themselves for that world
            raise RuntimeError(
                f"this process already runs a tensor-parallel world of {tp_size()} ranks (an engine with "
                "tensor_parallel_size > 1 that is still open); close() it before creating another engine"
            )
        self._external = config.distributed_executor_backend == "external_launcher"
        if self._external:  # checked before anything is loaded: a script started without torchrun fails at once
            self._torchrun_ranks = torchrun_ranks(config.tensor_parallel_size)
        plugins = get_plugins()
        # Resolved once, before any file is read or weight loaded, so a bad name or option fails fast.
        self.policy_plan = resolve_policies(config.sparse_policy, plugins)
        if isinstance(observers, (str, dict)):
            observers = [observers]
        observer_choices = tuple(observers)  # tensor-parallel workers resolve them again
        if config.tensor_parallel_size > 1 and not self._external:
            check_observers_travel(observer_choices, config.tensor_parallel_size)
        observers = tuple(resolve_observer(o, plugins) for o in observers)
        backend_choice = resolve_attention_backend(config.attention_backend, plugins)
        self.model_path = resolve_model_path(config.model, config.revision, config.download_dir)
        self.tokenizer_path = self._tokenizer_path()
        if config.download_dir is not None and not (
            names_hub_model(config.model) or (config.tokenizer is not None and names_hub_model(config.tokenizer))
        ):
            raise ValueError(f"download_dir={config.download_dir!r} is where hub models are cached; neither the model "
                             "nor the tokenizer is a hub ID, so leave it unset")
        raw = read_config_json(self.model_path)
        families = plugins.registry.model_families
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in families), None)
        if arch is None and raw.get("auto_map"):
            raise ModelDirectoryError(
                f"{str(self.model_path)!r} needs the model code shipped with its checkpoint (auto_map in "
                f"config.json, architecture {', '.join(archs) or '(none)'}); nanovllm never runs checkpoint code, "
                "with or without trust_remote_code. It runs the architectures its plugins provide: "
                f"{', '.join(sorted(families)) or 'none'}"
            )
        if arch is None:
            raise ModelDirectoryError(
                f"no installed plugin provides architecture {', '.join(archs) or '(none in config.json)'}. "
                f"Installed: {', '.join(sorted(families)) or 'none'} (e.g. pip install nanovllm-qwen3)"
            )
        from transformers import AutoConfig

        try:
            self.hf_config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=False)
        except Exception as exc:
            raise ModelDirectoryError(f"config.json in {str(self.model_path)!r} cannot be read: {exc}") from exc
        override_config(self.hf_config, config.hf_overrides)
        self.max_model_len = self._max_model_len()
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is below max_model_len="
                f"{self.max_model_len}; with enable_chunked_prefill=False a whole prompt must fit one step"
            )
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(self.tokenizer_path)
        self.vocab_size = self.hf_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, config.max_logprobs)
        self.output_builder = OutputBuilder(self.tokenizer)
        model_cls = load_registered(families[arch].target, families[arch].dist, f"model family {arch!r}")
        self._check_tensor_parallel()
        self._workers: TPWorkers | None = None
        self._finalizer: weakref.finalize | None = None  # leaves the tensor-parallel world
        self._stopped_reason: str | None = None  # set when a tensor-parallel engine is closed or broken
        runner_args = (model_cls, plugins, backend_choice, observers, arch, observer_choices)
        try:
            self.runner = self._start_ranks(*runner_args)
            late = None
        except CaptureTimeout as exc:
            if self._external:  # torchrun's ranks cannot be started again from here
                raise CaptureTimeout(f"{exc}; start every rank again with enforce_eager=True") from exc
            late = str(exc)
        if late is not None:  # the world is stopped: a new one decodes eagerly
            warnings.warn(
                f"{late}, so the engine started its {config.tensor_parallel_size} ranks again without CUDA "
                f"graphs (slower decoding). Pass enforce_eager=True to skip the capture, or set "
                f"{CAPTURE_TIMEOUT_VARIABLE} to more seconds if it was only slow",
                RuntimeWarning, stacklevel=2,
            )
            self.config = config = attrs.evolve(config, enforce_eager=True)
            gc.collect()  # the failed runner's model and cache, before the new one sizes its cache
            self.runner = self._start_ranks(*runner_args)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.max_model_len)
        self._pending: LaunchedStep | None = None  # the step in flight, its tokens not yet applied
        self._next_request = 0
        self._streams: dict[str, OutputStream] = {}  # requests of add_request(request_id, ...), unfinished

    def _start_ranks(self, model_cls: type, plugins, backend_choice, observers: tuple[object, ...], arch: str,
                     observer_choices: tuple[object, ...]) -> ModelRunner:
        """Join or start the tensor-parallel world (if any) and build this rank's model runner; a failure
        stops the engine's workers (a worker's error, with its traceback, is the one raised)."""
        config = self.config
        if self._external:
            rank, local_rank = self._torchrun_ranks
            init_tensor_parallel(rank, config.tensor_parallel_size, resolve_device(config.device).type,
                                 local_rank=local_rank)
            self._finalizer = weakref.finalize(self, destroy_tensor_parallel)
        elif config.tensor_parallel_size > 1:
            spec = RunnerSpec(config, self.hf_config, self.model_path, arch, self.max_model_len, observer_choices)
            self._workers = TPWorkers(spec, config.tensor_parallel_size, resolve_device(config.device).type)
            # the workers stop when the engine is closed or garbage-collected (the finalizer holds no engine)
            self._finalizer = weakref.finalize(self, self._workers.stop)
        try:
            return ModelRunner(
                config, self.hf_config, self.model_path, model_cls, self.max_model_len, plugins,
                self.policy_plan, backend_choice, observers,
            )
        except BaseException as exc:
            if self._workers is None:
                raise
            error = self._workers.worker_failure()
            self._finalizer.detach()
            self._workers.stop(graceful=False)
            if error is None:
                raise
            raise error from exc

    def _check_tensor_parallel(self) -> None:
        """Each rank takes an equal share of the heads and MLP features, and a GPU of its own."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return
        hf = self.hf_config
        heads = getattr(hf, "num_attention_heads", None)
        for name, value in (("num_attention_heads", heads),
                            ("num_key_value_heads", getattr(hf, "num_key_value_heads", None) or heads),
                            ("intermediate_size", getattr(hf, "intermediate_size", None))):
            if value is not None and value % size:
                raise ValueError(f"tensor_parallel_size={size} must divide the model's {name}={value}: each rank "
                                 "takes an equal share; choose a divisor of it")
        import torch

        if resolve_device(self.config.device).type != "cuda":
            return
        if self._external:  # the ranks may be on several hosts: this one needs the GPU of its LOCAL_RANK
            local_rank = self._torchrun_ranks[1]
            if torch.cuda.device_count() <= local_rank:
                raise ValueError(f"torchrun gave this process LOCAL_RANK={local_rank}, but PyTorch sees "
                                 f"{torch.cuda.device_count()} GPU(s) on this host; start at most that many "
                                 "processes per host (--nproc-per-node)")
        elif torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs one GPU per rank, but PyTorch sees "
                             f"{torch.cuda.device_count()}; lower it, or use device='cpu'")

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        wanted = self.config.max_model_len
        if wanted is None:
            return limit or 4096
        if limit is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}")
        return wanted

    def _tokenizer_path(self) -> Path:
        """``tokenizer=`` (a directory or hub ID, at ``tokenizer_revision``), else the model's directory."""
        config = self.config
        if config.tokenizer is None:
            if config.tokenizer_revision is not None:
                raise ValueError("tokenizer_revision applies to tokenizer=; without it use revision=")
            return self.model_path
        path = Path(config.tokenizer).expanduser()
        if path.is_dir():
            if config.tokenizer_revision is not None:
                raise ValueError(f"tokenizer_revision applies to hub IDs; tokenizer {config.tokenizer!r} is a directory")
            return path
        if not is_hub_id(config.tokenizer):
            raise ModelDirectoryError(f"tokenizer {config.tokenizer!r} is neither a directory nor a hub ID")
        return resolve_hub_id(config.tokenizer, config.tokenizer_revision, config.download_dir)

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes and decodes with."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True); load it without that option")
        return self.tokenizer

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        sources = [getattr(self.tokenizer, "eos_token_id", None), getattr(self.hf_config, "eos_token_id", None)]
        gen_file = self.model_path / "generation_config.json"
        if gen_file.is_file():
            sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    # -- requests -----------------------------------------------------------------------------------

    def add_request(
        self, request_id: str | Prompt, prompt: Prompt | SamplingParams | None = None,
        params: SamplingParams | None = None,
    ) -> Sequence | None:
        """vLLM's form, ``add_request(request_id, prompt, params)``: queue a request whose outputs ``step()``
        returns, as ``params.output_kind`` asks. The older form ``add_request(prompt, params)`` returns the
        queued :class:`Sequence` and gets no outputs from ``step()`` (the caller reads the sequence)."""
        if self._external and tp_size() > 1:  # the other ranks follow rank 0 only inside generate
            raise RuntimeError("with distributed_executor_backend='external_launcher' the ranks run requests "
                               "together in generate() or chat(), called on every rank; add_request/step are "
                               "for one rank or tensor_parallel_size with the engine's own ranks")
        if prompt is None or isinstance(prompt, SamplingParams):  # the older form
            return self._add(request_id, prompt or SamplingParams(), None)
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request; "
                             "give each request a unique id")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self._streams[request_id] = OutputStream(self._add(prompt, params, request_id))
        return None

    def _add(self, prompt: Prompt, params: SamplingParams, request_id: str | None) -> Sequence:
        text, token_ids = self.input_processor.process(prompt, params)
        return self._enqueue(text, token_ids, params, request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Finish waiting or running requests with reason "abort" and free their blocks at once; a token a
        step in flight sampled for them is discarded. Unknown or finished ids are ignored."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.request_id in ids]:
            self.scheduler.abort(seq)
        for request_id in ids:
            self._streams.pop(request_id, None)

    def _enqueue(
        self, text: str | None, token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Queue a request; returns its first completion's sequence (``seq.group``: all ``n`` of them)."""
        seq = Sequence(token_ids, params, request_id or str(self._next_request), text)
        self._next_request += 1
        self._prepare_sampling(seq)
        self.scheduler.add(seq)
        for sibling in seq.group[1:]:
            self.scheduler.add(sibling)
        return seq

    # -- sampling options beyond temperature, top-k/p --------------------------------------------------

    def _prepare_sampling(self, seq: Sequence) -> None:
        """The token ids that the sampler masks for ``seq``; for ``n > 1`` its siblings (seeds ``seed + i``),
        which wait for its prompt blocks and then share them through the prefix cache."""
        params = seq.sampling_params
        if params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            seq.min_tokens_banned = sorted(banned)
        if params.bad_words:
            seq.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.n == 1:
            return
        children = []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            if i > 0:
                child.prompt_logprobs = None  # the first completion reports them
            children.append(child)
        seq.sampling_params = children[0]
        for i, child in enumerate(children[1:], start=1):
            sibling = Sequence(seq.token_ids, child, seq.request_id, seq.prompt_text)
            sibling.index, sibling.group, sibling.arrival_time = i, seq.group, seq.arrival_time
            sibling.min_tokens_banned, sibling.bad_words_token_ids = seq.min_tokens_banned, seq.bad_words_token_ids
            if self.config.enable_prefix_caching:
                sibling.prefix_source = seq
            seq.group.append(sibling)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as it would appear at the start of a text and after a space."""
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    # -- stepping -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, apply sampled tokens; returns the outputs owed to the requests of
        ``add_request(request_id, ...)``, as their ``output_kind`` asks.

        With ``async_scheduling`` the tokens applied are the previous step's, read back only after this
        step is launched, so the host's work overlaps the GPU's. A sequence sampled but not yet read
        back holds a placeholder as its last token, which the next step takes from the GPU; one that
        turns out to have finished wastes that one step's compute, which is discarded.

        An exception in a step (a policy, the model, the sampler) does not escape it, with one rank: the
        tokens of the step before it are kept if they can be read, and the sequences of the failed step
        become suspects (``Scheduler.isolate``): they are recomputed alone, one at a time, and a suspect whose
        own step fails again is finished with reason ``"error"`` and the exception's text in its
        ``CompletionOutput.error``. Every other request goes on with the same tokens; nothing vanishes, every
        block is returned, and the engine stays usable. A KeyboardInterrupt (or other BaseException) aborts
        every request and frees every block, then is raised. With tensor parallelism the ranks may be out of
        step after any failure: the engine stops its workers and raises an error that says why."""
        if self._stopped_reason is not None:
            raise RuntimeError(self._stopped_reason)
        scheduled: list[Sequence] = []
        reading = False  # the failure, if any, came from reading a step's results
        try:
            scheduled = self.scheduler.schedule()
            # blocks handed out for a step that is not launched are told with the next one, before any write
            launched = (self.runner.launch(scheduled, self.scheduler.block_manager.take_newly_allocated())
                        if scheduled else None)
            if self.config.async_scheduling:
                reading = True
                self._apply_pending()
                reading = False
            self.scheduler.advance([s for s in scheduled if not s.is_finished])
            if launched is not None:
                for seq in launched.seqs:
                    if not seq.is_finished:
                        seq.token_ids.append(PLACEHOLDER)
                self._pending = launched
            if not self.config.async_scheduling:
                reading = True
                self._apply_pending()
        except BaseException as exc:
            if isinstance(exc, Exception) and self._workers is None and not (self._external and tp_size() > 1):
                self._contain(exc, scheduled, reading)
                return self._stream_outputs() if self._streams else []
            self._abort()
            if self._external and tp_size() > 1:  # torchrun's ranks may be out of step: none steps again
                self._stopped_reason = (f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); "
                                        "the ranks may be out of step: restart every rank")
            if self._workers is None:
                raise
            error = self._workers.failure(exc)
            self._workers.stop(graceful=False)
            self._stopped_reason = str(error)
            raise error from exc
        return self._stream_outputs() if self._streams else []

    def _contain(self, exc: Exception, scheduled: list[Sequence], reading: bool) -> None:
        """After ``exc`` in a step on one rank: blame the sequences of the step that failed, keep the tokens of
        the step before it where they can be read, finish a suspect that failed alone with reason "error", and
        make the other sequences of the steps dropped suspects (see ``Scheduler.isolate``)."""
        scheduler = self.scheduler
        pending, self._pending = self._pending, None
        dropped: list[Sequence] = []
        if reading and pending is not None:  # that step failed; the one launched after it read its tokens
            failed, dropped = list(pending.seqs), scheduled
        else:  # planning or launching failed (a failure in schedule(): the sequences it scheduled so far)
            failed = [*scheduled, *(s for s in (*scheduler.running, *scheduler.waiting) if s.num_scheduled_tokens)]
            if pending is not None:  # the step before: its tokens are good if they can be read
                self._pending = pending
                try:
                    self._apply_pending()
                except Exception:
                    self._pending = None
                    failed += pending.seqs
        if not failed and not dropped:  # nothing to pin it on
            failed = scheduler.suspects[:1] or [*scheduler.running, *scheduler.waiting]
        culprits = {id(s): s for s in failed}
        alone = next(iter(culprits.values())) if len(culprits) == 1 else None
        if alone is not None and alone.solo_steps_left and not alone.is_finished:  # it failed on its own
            _log.warning("request %r failed in a step of its own; it ends with finish reason 'error'",
                         alone.request_id, exc_info=exc)
            self._fail(alone, exc)
        elif failed:
            _log.warning("a step of %d sequence(s) failed; they will run alone to find the one that fails",
                         len(culprits), exc_info=exc)
        scheduler.isolate([s for s in (*failed, *dropped) if not s.is_finished])

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(seq, "error")

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank); the engine cannot step afterwards.
        Garbage collection of the engine does the same."""
        if self._finalizer is not None:
            self._finalizer()
            if self._stopped_reason is None:
                self._stopped_reason = "this engine was closed; create a new one"

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stream_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id, stream in list(self._streams.items()):
            out = stream.poll(self.output_builder)
            if out is not None:
                outputs.append(out)
            if stream.finished:
                del self._streams[request_id]
        return outputs

    def _apply_pending(self) -> None:
        """Wait for the step in flight; put its tokens in place of the placeholders, check stops. The step
        stays pending until its results are read, so a failed read can be retried or blamed on it."""
        launched = self._pending
        if launched is None:
            return
        result = launched.result()
        self._pending = None
        for seq, position, entries in result.prompt_logprobs:
            if not seq.is_finished:  # by position: a recompute after preemption overwrites, never appends
                seq.prompt_logprobs[position : position + len(entries)] = entries
        now = time.time()
        scheduler = self.scheduler
        for seq, token, logprobs in zip(launched.seqs, result.tokens, result.logprobs, strict=True):
            if seq.is_finished:  # stopped on the token before, or aborted; this one is discarded
                continue
            seq.token_ids[-1] = token
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            if seq.solo_steps_left:
                scheduler.passed(seq)
            try:
                reason = self._stop_reason(seq, token)
            except Exception as exc:  # its own text (stop strings): only this sequence fails
                _log.warning("request %r failed in its stop check; it ends with finish reason 'error'",
                             seq.request_id, exc_info=exc)
                self._fail(seq, exc)
                continue
            if reason is not None:
                scheduler.finish(seq, reason)

    def _abort(self) -> None:
        """After an error in a step: drop everything in flight and leave the engine empty and usable."""
        self._pending = None
        self._streams.clear()
        self.scheduler.abort_all()

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling_params
        if seq.num_completion_tokens < params.min_tokens:  # EOS and stop tokens were masked; no stop string
            return "length" if seq.num_tokens >= self.max_model_len else None
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if params.stop and self._find_stop_string(seq) is not None:
            return "stop"
        if seq.reached_length(self.max_model_len):
            return "length"
        return None

    def _find_stop_string(self, seq: Sequence) -> int | None:
        """Index in the completion text where the first stop string begins (sets ``stop_reason``)."""
        text = self.output_builder.completion_text(seq)
        hits = [(text.find(s), s) for s in seq.sampling_params.stop if s in text]
        if not hits:
            return None
        index, seq.stop_reason = min(hits)
        return index

    # -- the offline API ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt; outputs come back in prompt order. ``lora_request`` is
        vLLM's and must stay None: nanovllm runs no LoRA adapters.

        Under ``torchrun`` (``distributed_executor_backend="external_launcher"``) every rank calls this with
        the same arguments: rank 0 runs the call, the others follow its steps, and every rank returns
        rank 0's outputs (or raises when rank 0 did)."""
        _check_unsupported(lora_request=lora_request)
        if not self._external or tp_size() == 1:
            return self._generate(prompts, sampling_params, use_tqdm)
        if self._stopped_reason is not None:
            raise RuntimeError(self._stopped_reason)
        if tp_rank() != 0:
            kind, value, self._stopped_reason = self.runner.follow()
            if kind == "error":
                raise RuntimeError(f"rank 0 raised in generate(), so this rank does too: {value}")
            return value
        try:
            outputs = self._generate(prompts, sampling_params, use_tqdm)
        except BaseException as exc:  # a bad prompt before any step, or a failed step (then stopped)
            broadcast_control(("stop", ("error", f"{type(exc).__name__}: {exc}", self._stopped_reason)))
            raise
        broadcast_control(("stop", ("outputs", outputs, None)))
        return outputs

    def _generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings, token-id lists or dicts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise TypeError("sampling_params must be SamplingParams or a list of them, one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        requests = [self.input_processor.process(prompt, params, i)
                    for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True))]
        seqs = [self._enqueue(t, ids, p) for (t, ids), p in zip(requests, sampling_params, strict=True)]
        return self._run(seqs, use_tqdm)

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seqs), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        scheduler = self.scheduler
        unfinished = seqs  # requests with a completion still running
        num_finished = scheduler.num_finished
        try:
            with bar:
                while unfinished:
                    if not scheduler.has_unfinished():
                        raise RuntimeError("the scheduler ran dry before every request finished")
                    self.step()  # outputs are only for add_request(request_id, ...) requests
                    if scheduler.num_finished != num_finished:  # some sequence finished: look which requests
                        num_finished = scheduler.num_finished
                        unfinished = [seq for seq in unfinished if not all(s.is_finished for s in seq.group)]
                        bar.update(len(seqs) - len(unfinished) - bar.n)
        except BaseException:  # e.g. KeyboardInterrupt between steps: drop this call's requests, keep others
            for seq in unfinished:
                for s in seq.group:
                    if not s.is_finished:
                        scheduler.abort(s)
            raise
        return [self.output_builder.output(seq) for seq in seqs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply a chat template (the tokenizer's, or ``chat_template``) to one conversation or a list of
        them, then generate; each output's ``prompt`` is the rendered text. The options are vLLM's:
        ``chat_template_kwargs`` are extra template variables (e.g. Qwen3's ``enable_thinking``),
        ``continue_final_message`` extends the last (assistant) message instead of starting a new one.
        ``lora_request`` and ``mm_processor_kwargs`` must stay None: nanovllm runs no LoRA adapters and no
        multimodal models."""
        _check_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if not messages or not isinstance(messages, list):
            raise ValueError("messages must be a conversation (list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        options = ChatOptions(
            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs or {},
            chat_template_content_format=chat_template_content_format, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
        )
        texts = render_chat(self.tokenizer, conversations, options)
        # the template writes any special tokens (BOS) itself, so the tokenizer adds none
        prompts = [TokensPrompt(prompt_token_ids=self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs
