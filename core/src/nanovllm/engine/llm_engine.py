"""LLMEngine: the tokenizer, the scheduler and the model runner behind the step API (``add_request``,
``step``, ``abort_request``), which ``LLM``, ``AsyncLLM`` and the server drive.

Start-up runs named steps, each once: the options are checked (:class:`~nanovllm.config.EngineConfig`), the
plugin selections resolved (:func:`~nanovllm.engine.model_loading.select_parts`), the model found and every
derived option settled (:func:`~nanovllm.engine.model_loading.resolve_config`), the tokenizer loaded, and the
tensor-parallel world started with this rank's model runner
(:class:`~nanovllm.engine.tp_world.TensorParallelWorld`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from typing import Any

from nanovllm.config import EngineConfig
from nanovllm.engine.input_processor import InputProcessor, Prompt
from nanovllm.engine.model_loading import eos_token_ids, load_tokenizer, resolve_config, select_parts
from nanovllm.engine.model_runner import LaunchedStep
from nanovllm.engine.output_stream import OutputBuilder, OutputStream
from nanovllm.engine.sampling_inputs import prepare_request
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.tp_world import TensorParallelWorld
from nanovllm.outputs import RequestOutput
from nanovllm.plugins import get_plugins
from nanovllm.presets import is_preset
from nanovllm.sampling_params import SamplingParams

_log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, model: str | None = None, *, observers: SequenceABC[object] = (), **kwargs: Any
    ) -> None:
        """``model`` and ``kwargs``: as :class:`nanovllm.LLM` takes them. ``observers``: objects implementing
        notification hooks of :class:`nanovllm.hookspecs.ObserverSpec` (``on_kv_write``, ``on_blocks_allocated``,
        ``on_blocks_selected``), e.g. statistics, or the selection strings of observers that plugins registered
        (``"name:key=value"``)."""
        if is_preset(model):  # a published shape with random weights and no tokenizer
            kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, **kwargs}
        options = EngineConfig.from_kwargs(model, kwargs)
        observers = tuple([observers] if isinstance(observers, (str, dict)) else observers)
        self.world = TensorParallelWorld(options, observers)
        plugins = get_plugins()
        parts = select_parts(options, plugins, observers)  # before any file is read: a bad name fails fast
        self.policy_plan = parts.policy_plan
        config = resolve_config(options, plugins, observers)
        self.model_path, self.tokenizer_path = config.model_config.path, config.model_config.tokenizer_path
        self.hf_config, self.vocab_size = config.hf_config, config.hf_config.vocab_size
        self.max_model_len = config.max_model_len
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(self.tokenizer_path)
        self.eos_token_ids = eos_token_ids(self.tokenizer, config)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, config.max_logprobs)
        self.output_builder = OutputBuilder(self.tokenizer)
        self.runner, self.config = self.world.start(config, parts)
        # layers sharing a block table (sliding-window layers keep only their window; see nanovllm.kv.groups),
        # and the KV bytes one token costs in each group's blocks
        self.kv_cache_groups = self.runner.kv_cache_groups
        self.kv_cache_group_bytes_per_token = self.runner.kv_cache_group_bytes_per_token
        self.scheduler = Scheduler(self.config, self.runner.num_blocks, self.max_model_len,
                                   self.kv_cache_groups, self.runner.num_window_blocks)
        self._pending: LaunchedStep | None = None  # the step in flight, its tokens not yet applied
        self._next_request = 0
        self._streams: dict[str, OutputStream] = {}  # requests of add_request(request_id, ...), unfinished

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes and decodes with."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True); load it without that option")
        return self.tokenizer

    # -- requests -----------------------------------------------------------------------------------

    def add_request(
        self, request_id: str | Prompt, prompt: Prompt | SamplingParams | None = None,
        params: SamplingParams | None = None,
    ) -> Sequence | None:
        """vLLM's form, ``add_request(request_id, prompt, params)``: queue a request whose outputs ``step()``
        returns, as ``params.output_kind`` asks. The older form ``add_request(prompt, params)`` returns the
        queued :class:`Sequence` and gets no outputs from ``step()`` (the caller reads the sequence)."""
        if self.world.follows_rank0:  # the other ranks follow rank 0 only inside generate
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
        return self.enqueue(text, token_ids, params, request_id)

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

    def enqueue(
        self, text: str | None, token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Queue a request already checked and tokenized (``input_processor.process``; ``text`` is None for
        token ids); returns its first completion's sequence (``seq.group``: all ``n`` of them)."""
        seq = Sequence(token_ids, params, request_id or str(self._next_request), text)
        self._next_request += 1
        prepare_request(seq, self.eos_token_ids, self.tokenizer, self.config.enable_prefix_caching)
        self.scheduler.add(seq)
        for sibling in seq.group[1:]:
            self.scheduler.add(sibling)
        return seq

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
        if self.world.stopped_reason is not None:
            raise RuntimeError(self.world.stopped_reason)
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
            if isinstance(exc, Exception) and self.world.single:
                self._contain(exc, scheduled, reading)
                return self._stream_outputs() if self._streams else []
            self._abort()
            error = self.world.step_failed(exc)
            if error is None:
                raise
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
        self.world.close()

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

