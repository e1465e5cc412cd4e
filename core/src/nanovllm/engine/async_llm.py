"""``AsyncLLM``: the engine behind an asyncio API, with vLLM's name.

The engine runs on its own thread, which owns it: requests, aborts and any other engine work reach it as
commands through a queue and run between steps, so the event loop never waits on the model and the engine
is never touched by two threads at once. Outputs go back to the loop once per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

T = TypeVar("T")
_STOP = object()


def is_finished(output: RequestOutput) -> bool:
    return all(c.finish_reason is not None for c in output.outputs)


class AsyncLLM:
    """``AsyncLLM(model=None, **config)`` takes what ``LLM`` takes; ``AsyncLLM.from_engine(engine)`` wraps an
    engine already built. Use it from one event loop; ``shutdown()`` stops the engine thread."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self._setup(LLMEngine(model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncLLM:
        self = cls.__new__(cls)
        self._setup(engine)
        return self

    def _setup(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}  # per live request: its outputs, or the error that ended it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- the asyncio side ---------------------------------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._stopped:
            raise RuntimeError("this AsyncLLM was shut down; make a new one")
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
            self._thread.start()
        elif loop is not self._loop:
            raise RuntimeError("an AsyncLLM serves the event loop it was first used from; make one per loop")

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as ``sampling_params.output_kind`` asks, the last one
        finished. A bad request raises here, from the engine's checks. Closing the generator early (or
        cancelling its consumer) aborts the request and frees its blocks."""
        self._start()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request; "
                             "give each request a unique id")
        params = sampling_params or SamplingParams()
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = outputs
        self._commands.put(lambda: self._add(request_id, prompt, params))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine dropped it already
                    raise item
                finished = is_finished(item)
                yield item
        finally:
            del self._queues[request_id]
            if not finished:
                self._commands.put(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (their generators end with no further output); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self.call(lambda engine: engine.abort_request(ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (e.g. to use its tokenizer)."""
        self._start()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)

        self._commands.put(command)
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Abort what is left, stop the engine thread, and close the engine (its tensor-parallel workers)."""
        self._stopped = True
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")
        self.engine.close()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:  # else its consumer left; the abort is on its way
                target.put_nowait(out)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            target = self._queues.get(request_id)
            if target is not None:
                target.put_nowait(exc)

    # -- the engine thread --------------------------------------------------------------------------

    def _post(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to receive it
            pass

    def _add(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:
            self._post(self._fail, [request_id], exc)

    def _run(self) -> None:
        engine = self.engine
        while True:
            # Wait for work when idle; between steps, take whatever arrived without waiting.
            commands = [self._commands.get()] if not engine.has_unfinished_requests() else []
            while not self._commands.empty():
                commands.append(self._commands.get())
            for command in commands:
                if command is _STOP:
                    engine.abort_request([s.request_id for s in (*engine.scheduler.running, *engine.scheduler.waiting)])
                    return
                command()
            if not engine.has_unfinished_requests():
                continue
            request_ids = list(engine._streams)
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine aborted everything and is usable again
                self._post(self._fail, request_ids, RuntimeError(f"the engine step failed: {exc!r}"))
                continue
            if outputs:
                self._post(self._deliver, outputs)
