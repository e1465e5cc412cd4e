"""``AsyncLLM``: the engine behind an asyncio API, with vLLM's name.

The engine runs in a child process of its own (the default), or on a thread of this process
(``engine_process=False`` or ``NANOVLLM_ENGINE_PROCESS=0``; always for ``from_engine``); see
:mod:`nanovllm.engine.engine_core` for the commands and messages between the two. Either way this side, the
front-end, checks and tokenizes a request before sending it (a bad request raises here, with the errors of
``LLM.generate``), mirrors each live request's sequences from the engine's per-step messages, and builds the
outputs from the mirror with the step API's :class:`OutputStream` (incremental text, stop-string hold-back,
``output_kind``), so they are the step API's outputs. The requests queued in one turn of the event loop go to
the engine as one message at the turn's end (a burst of HTTP requests is planned as one batch, not one request
first and the others a step later). A step's message updates the mirrors and wakes the
consumers; each polls its stream when it runs, so the steps applied before it does (a front-end behind the
engine) reach it as one output, as vLLM merges them: fewer outputs and events to build when it is behind.
"""

from __future__ import annotations

import asyncio
import os
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from nanovllm.engine.engine_core import EngineProcess, EngineThread, SchedulerStats
from nanovllm.engine.input_processor import InputProcessor, Prompt
from nanovllm.engine.llm_engine import LLMEngine, load_tokenizer
from nanovllm.engine.output_stream import OutputBuilder, OutputStream
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
ENGINE_PROCESS_ENV = "NANOVLLM_ENGINE_PROCESS"  # "0": AsyncLLM runs the engine on a thread of this process


class EngineDeadError(RuntimeError):
    """The engine has stopped for good (it failed, a tensor-parallel worker died, or it was shut down): every
    request fails with this, at once. Make a new ``AsyncLLM`` (vLLM's name)."""


def engine_process_default() -> bool:
    """Whether ``AsyncLLM`` runs its engine in a process of its own when not told: yes, unless
    ``NANOVLLM_ENGINE_PROCESS=0``."""
    value = os.environ.get(ENGINE_PROCESS_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{ENGINE_PROCESS_ENV}={value!r}: use 1 (the engine in its own process) or 0 (on a thread)")
    return value in ("1", "true")


class _Request:
    """A live request on the front-end: its mirrored sequences, their output stream, and what its consumer has
    not seen yet. The consumer polls the stream itself when woken, so every step applied before it runs
    becomes one output (a DELTA's text, tokens and logprobs those of the steps' deltas together)."""

    __slots__ = ("seqs", "stream", "every_step", "news", "error", "aborted", "waiter")

    def __init__(self, request_id: str, prompt_text: str | None, token_ids: list[int], params: SamplingParams):
        first = Sequence(token_ids, params, request_id, prompt_text)
        for index in range(1, params.n):
            sibling = Sequence(token_ids, params, request_id, prompt_text)
            sibling.index, sibling.group, sibling.prompt_logprobs = index, first.group, None
            first.group.append(sibling)
        self.seqs = first.group
        self.stream = OutputStream(first)
        self.every_step = params.output_kind != RequestOutputKind.FINAL_ONLY  # else woken when one finishes
        self.news = False  # the mirrors changed since the consumer last polled
        self.error: BaseException | None = None  # the engine dropped the request: raised after the news
        self.aborted = False  # abort(): the generator ends with no further output
        self.waiter: asyncio.Future | None = None  # the consumer's, while it waits

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class OutputProcessor:
    """The front-end's state, used on the event loop only: live requests, calls waiting for their result, the
    engine's latest scheduler stats, and why the engine stopped (None while it runs)."""

    def __init__(self, tokenizer) -> None:
        self.builder = OutputBuilder(tokenizer)
        self.requests: dict[str, _Request] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self.stats = SchedulerStats()
        self.closed: str | None = None

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            self._apply(message[1])
            self.stats = message[2]
        elif kind == "error":
            _, request_ids, text = message
            for request_id in request_ids:
                if (request := self.requests.get(request_id)) is not None:
                    request.error = RuntimeError(text)
                    request.wake()
        elif kind == "result":
            _, call_id, value, error = message
            future = self.calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(value) if error is None else future.set_exception(error)
        elif kind == "closed":
            self.closed = message[1]
            for request in self.requests.values():
                request.error = EngineDeadError(self.closed)
                request.wake()
            for future in self.calls.values():
                if not future.done():
                    future.set_exception(EngineDeadError(self.closed))
            self.calls.clear()

    def _apply(self, updates: list[tuple]) -> None:
        """Bring the mirrors up to date and wake the consumers that have something to poll."""
        for request_id, index, token_ids, logprobs, first_time, last_time, num_cached, finish in updates:
            request = self.requests.get(request_id)
            if request is None:  # its consumer left; the abort is on its way
                continue
            seq = request.seqs[index]
            seq.token_ids += token_ids
            if logprobs:
                seq.logprobs += logprobs
            seq.first_token_time, seq.last_token_time, seq.num_cached_tokens = first_time, last_time, num_cached
            if finish is not None:
                seq.finish_reason, seq.stop_reason, seq.finished_time, prompt_logprobs, seq.error = finish
                seq.status = SequenceStatus.FINISHED
                if index == 0:
                    seq.prompt_logprobs = prompt_logprobs
            elif not request.every_step:
                continue
            request.news = True
            request.wake()


class RequestStream:
    """The outputs of one queued request (``AsyncLLM.submit``), read with ``async for``; the last one is
    finished. Each read polls the request's output stream once, so the steps applied before it come as one
    output. ``aclose()``, or an error or cancellation while waiting, aborts a request not read to its end."""

    def __init__(self, llm: AsyncLLM, request_id: str, request: _Request) -> None:
        self._llm, self.request_id, self._request = llm, request_id, request
        self._done = False  # finished, failed, aborted or closed: no further output

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        request, outputs = self._request, self._llm._outputs
        while not self._done:
            if request.aborted:
                break
            if request.news:
                request.news = False
                out = request.stream.poll(outputs.builder)
                if out is not None:
                    if out.finished:
                        self._end(abort=False)
                    return out
                continue
            if request.error is not None:  # the engine dropped it already
                self._end(abort=False)
                raise request.error
            request.waiter = asyncio.get_running_loop().create_future()
            try:
                await request.waiter
            except BaseException:  # the consumer was cancelled: it will not read on
                self._end(abort=True)
                raise
        self._done = True
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Abort the request unless it ended; a read waiting on it ends with no further output."""
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        self._request.wake()
        llm = self._llm
        if llm._outputs.requests.get(self.request_id) is self._request:
            del llm._outputs.requests[self.request_id]
            if abort and llm._outputs.closed is None:
                llm._send(("abort", [self.request_id]))


class AsyncLLM:
    """``AsyncLLM(model=None, engine_process=None, **config)`` takes what ``LLM`` takes; the engine runs in a
    process of its own unless ``engine_process=False`` (default: ``NANOVLLM_ENGINE_PROCESS``, else True).
    ``AsyncLLM.from_engine(engine)`` wraps an engine already built, on a thread. Use it from one event loop;
    ``shutdown()`` (or garbage collection) stops the engine."""

    def __init__(self, model: str | None = None, *, engine_process: bool | None = None, **kwargs: Any) -> None:
        if engine_process is None:
            engine_process = engine_process_default()
        self._setup(EngineProcess(model, kwargs) if engine_process else EngineThread(LLMEngine(model, **kwargs)))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncLLM:
        self = cls.__new__(cls)
        self._setup(EngineThread(engine))
        return self

    def _setup(self, core: EngineProcess | EngineThread) -> None:
        self._core = core
        self._finalizer = weakref.finalize(self, core.shutdown)  # holds the core, never self
        info = core.info
        # the front-end's own tokenizer: on a thread, the engine's is in use by the engine thread
        self.tokenizer = None if info.tokenizer_path is None else load_tokenizer(Path(info.tokenizer_path))
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        # the checks and tokenization of requests, as LLMEngine.input_processor (check_context_length: the server's)
        self.input_processor = InputProcessor(self.tokenizer, info.vocab_size, info.max_model_len, info.max_logprobs)
        self._outputs = OutputProcessor(self.tokenizer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._adds: list[tuple] = []  # (request_id, token_ids, params) queued this turn, not sent yet
        self._next_call = 0

    @property
    def engine(self) -> LLMEngine:
        """The engine, when it runs on a thread of this process."""
        if not isinstance(self._core, EngineThread):
            raise AttributeError("the engine runs in a process of its own (engine_process=True); reach it with "
                                 "call(fn), or make the AsyncLLM with engine_process=False")
        return self._core.engine

    @property
    def errored(self) -> bool:
        """Whether the engine has stopped (failed, lost a tensor-parallel worker, or was shut down): every
        request would fail with :class:`EngineDeadError`."""
        return self._outputs.closed is not None or not self._finalizer.alive

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError`, saying why, once the engine has stopped (vLLM's health check). The
        first call starts the engine's loop, which from then on checks, while idle, that it can still step."""
        self._start()

    @property
    def stats(self) -> SchedulerStats:
        """Running and waiting requests and KV cache usage, as of the engine's latest step."""
        return self._outputs.stats

    # -- the asyncio side ---------------------------------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._outputs.closed is not None:
            raise EngineDeadError(self._outputs.closed)
        if not self._finalizer.alive:
            raise EngineDeadError("this AsyncLLM was shut down; make a new one")
        if self._loop is None:
            self._loop = loop
            handle = self._outputs.handle  # the engine's threads hold these, never self (garbage collection)

            def post(message: tuple) -> None:
                try:
                    loop.call_soon_threadsafe(handle, message)
                except RuntimeError:  # the loop is closed: nobody is left to receive it
                    pass

            self._core.start(post)
        elif loop is not self._loop:
            raise RuntimeError("an AsyncLLM serves the event loop it was first used from; make one per loop")

    def submit(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request now and return its outputs to read (``async for``), as ``generate`` yields them. A
        bad request raises here. The requests queued in one turn of the event loop reach the engine together,
        in one message at the end of the turn, so a burst is planned as one batch. Close the stream
        (``aclose()``) to abort a request not read to its end."""
        self._start()
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
        requests = self._outputs.requests
        if request_id in requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request; "
                             "give each request a unique id")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self.input_processor.process(prompt, params)
        if not self._adds:
            self._loop.call_soon(self._send_adds)
        self._adds.append((request_id, token_ids, params))
        request = requests[request_id] = _Request(request_id, text, token_ids, params)
        return RequestStream(self, request_id, request)

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as ``sampling_params.output_kind`` asks, the last one
        finished. A bad request raises here, before it reaches the engine. A request that a failed step is
        blamed on ends like any other, with a last output whose ``finish_reason`` is ``"error"`` (the text in
        ``CompletionOutput.error``); other requests are not affected. Closing the generator early (or
        cancelling its consumer) aborts the request and frees its blocks."""
        stream = self.submit(prompt, sampling_params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _send_adds(self) -> None:
        """Send the requests queued since the last call as one command."""
        adds, self._adds = self._adds, []
        if not adds:
            return
        try:
            self._core.send(("add", adds))
        except Exception as exc:  # pickling: what fails depends on the object
            for request_id, _, _ in adds:
                if (request := self._outputs.requests.get(request_id)) is not None:
                    request.error = RuntimeError(f"request {request_id!r} could not be sent to the engine: {exc!r}")
                    request.wake()

    def _send(self, command: tuple) -> None:
        """Send a command after the adds still queued, which it may concern (an abort of one of them)."""
        self._send_adds()
        self._core.send(command)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: their generators end with no further output. Unknown ids are ignored."""
        self._start()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if (request := self._outputs.requests.pop(rid, None)) is not None:
                request.aborted = True
                request.wake()
        self._send(("abort", ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` where the engine runs, between steps, and return its result. With the engine in
        its own process, ``fn`` and its result are pickled: use a module-level function, not a lambda."""
        self._start()
        call_id, self._next_call = self._next_call, self._next_call + 1
        try:
            self._send(("call", call_id, fn))
        except Exception as exc:  # pickling: what fails depends on the object
            raise TypeError(f"call() sends fn to the engine's process, so it must be picklable (a module-level "
                            f"function, not a lambda or closure): {exc}; or use engine_process=False") from None
        future = self._outputs.calls[call_id] = asyncio.get_running_loop().create_future()
        return await future

    def shutdown(self, timeout: float = 60.0) -> None:
        """Abort what is left and stop the engine (its process, or its thread, then close it); requests still
        waiting for outputs end with an error."""
        self._finalizer.detach()
        self._core.shutdown(timeout)
