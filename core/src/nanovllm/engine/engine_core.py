"""The engine core: an ``LLMEngine`` stepping in a loop, told what to do by commands and telling what each
step produced in one compact message. ``AsyncLLM`` runs it in a child process of its own (the default,
:class:`EngineProcess`) or on a thread of the caller's process (:class:`EngineThread`). Either way the
front-end (``AsyncLLM``) keeps a tokenizer of its own, checks and tokenizes requests, and turns the messages
into outputs (text, logprob dicts, ``RequestOutput``): in a process of its own, the engine's host work
(scheduling, building steps, reading back tokens) shares no interpreter lock with that, nor with HTTP.

Commands (tuples, their kind first):
    ("add", [(request_id, token_ids, params), ...])
                                             queue requests the front-end checked and tokenized: those it
                                             queued in one turn of its event loop, so a burst of requests
                                             reaches the scheduler together, before it plans a step
    ("abort", request_ids)                   drop requests, free their blocks
    ("call", call_id, fn)                    run fn(engine) between steps; answered by a "result" message
    ("shutdown",)                            abort what is left and stop (the end of the pipe does the same)
Messages:
    ("step", updates, stats)                 after each turn of the loop: what advanced, SchedulerStats
    ("error", request_ids, message)          those requests were dropped: their add failed
    ("result", call_id, value, error)        a call's return value, or the exception it raised
    ("closed", reason)                       the loop ended (shutdown, or a failure: then the reason says so)
An update is one completion that produced tokens or finished:
    (request_id, index, new_token_ids, new_logprobs, first_token_time, last_token_time, num_cached_tokens,
     finish), with finish None or (finish_reason, stop_reason, finished_time, prompt_logprobs, error).

A step that fails ends only the requests it is to blame on (the engine finishes them with reason "error" and
the exception's text as ``error``; see ``LLMEngine.step``); the others go on. An "error" message is for a
request the engine could not queue. A step that raises nonetheless (tensor parallelism: the ranks may be out
of step), or a tensor-parallel worker that dies while the engine is idle, ends the loop: the engine can no
longer step, and "closed" says why.

Stop strings stay the engine's: it checks them on its own tokenizer's text after every token (as the step
API does), so a sequence stops, and frees its blocks, on the step that completes one; the update carries the
stop string as ``stop_reason``, where the front-end cuts its text.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import attrs

from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)
STOP_TIMEOUT = 30.0  # seconds the engine may take to stop when told to, before it is killed
IDLE_CHECK_INTERVAL = 1.0  # seconds between an idle engine's checks that it can still step


@attrs.frozen
class EngineInfo:
    """What the front-end needs of the engine to check requests and build outputs."""

    tokenizer_path: str | None  # None: the engine has no tokenizer (skip_tokenizer_init)
    vocab_size: int
    max_model_len: int
    max_logprobs: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        path = None if engine.tokenizer is None else str(engine.tokenizer_path)
        return cls(path, engine.vocab_size, engine.max_model_len, engine.config.max_logprobs)


@attrs.frozen
class SchedulerStats:
    """The scheduler after a turn of the loop, for the server's metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use


class _Progress:
    """One completion of a request, and how many of its tokens the front-end was told of."""

    __slots__ = ("seq", "num_sent", "finished")

    def __init__(self, seq: Sequence) -> None:
        self.seq, self.num_sent, self.finished = seq, 0, False


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.requests: dict[str, list[_Progress]] = {}  # live requests: one entry per completion

    def run(self, receive: Callable[[float], list[tuple]], send: Callable[[tuple], None]) -> None:
        """Until told to shut down, or until the engine can no longer step: take the commands that arrived
        (``receive(timeout)`` waits up to ``timeout`` seconds for one; 0 while there is something to step),
        step once, report: the step, then the answers to the commands, so that an answer finds the
        front-end's stats as recent as itself. An idle engine checks every ``IDLE_CHECK_INTERVAL`` seconds
        that it can still step (:meth:`check_alive`). A step that raises (with tensor parallelism: the engine
        stopped, see ``LLMEngine.step``) or a failed check ends the loop with that exception, and with it
        every request."""
        engine = self.engine
        while True:
            answers = []
            commands = receive(0.0 if engine.has_unfinished_requests() else IDLE_CHECK_INTERVAL)
            for command in commands:
                if command[0] == "shutdown":
                    self.abort(list(self.requests))
                    return
                answers += self.handle(command)
            failure = None
            try:
                if engine.has_unfinished_requests():
                    engine.step()
                elif not commands:
                    self.check_alive()
            except Exception as exc:  # its requests end with the loop: the front-end fails them with exc
                failure, self.requests = exc, {}
            send(("step", self.updates(), self.stats()))
            for answer in answers:
                try:
                    send(answer)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:  # raised before anything is sent
                    send(("result", answer[1], None, TypeError(f"call() returned what cannot be sent back: {exc}")))
            if failure is not None:
                raise failure

    def check_alive(self) -> None:
        """Raise when the engine can no longer step although no step failed: a tensor-parallel worker exited
        or failed while the engine was idle. That stops the engine's world, as a failed step does."""
        world = self.engine.world
        failure = None if world.workers is None else world.workers.worker_failure(wait=0)
        if failure is not None:
            raise world.step_failed(failure)

    def handle(self, command: tuple) -> list[tuple]:
        """Run one command; its answers (an error, a call's result)."""
        kind = command[0]
        if kind == "add":
            errors = []
            for request_id, token_ids, params in command[1]:
                try:
                    seq = self.engine.enqueue(None, token_ids, params, request_id)
                except Exception as exc:
                    errors.append(("error", [request_id], f"the engine could not queue request {request_id!r}: "
                                                          f"{exc!r}"))
                    continue
                self.requests[request_id] = [_Progress(s) for s in seq.group]
            return errors
        elif kind == "abort":
            self.abort(command[1])
        elif kind == "call":
            _, call_id, fn = command
            try:
                return [("result", call_id, fn(self.engine), None)]
            except Exception as exc:
                return [("result", call_id, None, _picklable(exc))]
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return []

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def updates(self) -> list[tuple]:
        """Per completion that produced tokens or finished since the last call, what the front-end lacks."""
        updates = []
        for request_id, completions in list(self.requests.items()):
            for progress in completions:
                seq = progress.seq
                if progress.finished or (seq.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY
                                         and not seq.is_finished):
                    continue  # a final-only completion's tokens all go in its finishing update
                start = seq.num_prompt_tokens + progress.num_sent
                end = seq.num_tokens - (seq.token_ids[-1] == PLACEHOLDER)  # a token in flight is not known yet
                if end == start and not seq.is_finished:
                    continue
                logprobs = None
                if seq.sampling_params.logprobs is not None:
                    logprobs = seq.logprobs[progress.num_sent : end - seq.num_prompt_tokens]
                finish = None
                if seq.is_finished:
                    progress.finished = True
                    prompt_logprobs = seq.prompt_logprobs if seq.index == 0 else None  # the first reports them
                    finish = (seq.finish_reason, seq.stop_reason, seq.finished_time, prompt_logprobs, seq.error)
                updates.append((request_id, seq.index, seq.token_ids[start:end], logprobs, seq.first_token_time,
                                seq.last_token_time, seq.num_cached_tokens, finish))
                progress.num_sent = end - seq.num_prompt_tokens
            if all(p.finished for p in completions):
                del self.requests[request_id]
        return updates

    def stats(self) -> SchedulerStats:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        return SchedulerStats(len(scheduler.running), len(scheduler.waiting),
                              1 - blocks.num_free_blocks / blocks.num_usable_blocks)


def _failure(where: str, exc: BaseException) -> str:
    """Why the core's loop in the engine's ``where`` ("thread", "process") ended with ``exc``, for the
    front-end; the traceback goes to the log."""
    logger.error("the engine %s failed", where, exc_info=exc)
    return f"the engine {where} failed ({type(exc).__name__}: {exc}); make a new AsyncLLM"


# -- the engine on a thread of this process -----------------------------------------------------------


class EngineThread:
    """The core on a daemon thread; commands through a queue, messages handed to ``post`` (set by ``start``),
    which is called on that thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, post: Callable[[tuple], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(post,), name="nanovllm-engine", daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    def _receive(self, timeout: float) -> list[tuple]:
        try:
            commands = [self._commands.get(timeout=timeout)] if timeout else []
        except queue.Empty:
            return []
        while not self._commands.empty():
            commands.append(self._commands.get())
        return commands

    def _run(self, post: Callable[[tuple], None]) -> None:
        reason = "this AsyncLLM was shut down; make a new one"
        try:
            EngineCore(self.engine).run(self._receive, post)
        except BaseException as exc:
            reason = _failure("thread", exc)
        post(("closed", reason))

    def shutdown(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the thread, then close the engine (its tensor-parallel workers)."""
        if self._thread is not None:
            self._commands.put(("shutdown",))
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")
        self.engine.close()


# -- the engine in a child process --------------------------------------------------------------------


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _engine_process_main(model: str | None, kwargs: dict[str, Any], commands: Connection, messages: Connection,
                         num_threads: int, build: Callable[..., LLMEngine]) -> None:
    """The child: build the engine, say whether that worked, then run the core until shut down or until the
    front-end's end of the pipe closes (its process ended)."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front-end, which shuts this down
    torch.set_num_threads(num_threads)
    try:
        engine = build(model, **kwargs)
    except BaseException as exc:
        messages.send(("failed", _picklable(exc)))
        return

    def receive(timeout: float) -> list[tuple]:
        received = []
        try:
            if commands.poll(timeout):
                received.append(commands.recv())
                while commands.poll():
                    received.append(commands.recv())
        except (EOFError, OSError):  # the front-end is gone
            received.append(("shutdown",))
        return received

    messages.send(("ready", EngineInfo.of(engine)))
    try:
        EngineCore(engine).run(receive, messages.send)
        reason = "this AsyncLLM was shut down; make a new one"
    except (BrokenPipeError, EOFError):  # the front-end is gone: nobody to tell
        return
    except BaseException as exc:
        reason = _failure("process", exc)
    finally:
        engine.close()
    try:
        messages.send(("closed", reason))
    except OSError:
        pass


class EngineProcess:
    """The core in a child process (``spawn``; the engine built there as ``build(model, **kwargs)``, all three
    pickled: ``build`` is ``LLMEngine`` but for measurements with a stand-in model). Commands are pickled by
    the caller and written by a sender thread, so the caller never waits on a full pipe; a reader thread
    hands each message to ``post``. The constructor waits until the engine is built and raises its error if
    that fails."""

    def __init__(
        self, model: str | None, kwargs: dict[str, Any], build: Callable[..., LLMEngine] = LLMEngine
    ) -> None:
        import multiprocessing

        import torch

        # the options' own checks at once, not after the child has started and imported everything
        EngineConfig.from_kwargs(model, {k: v for k, v in kwargs.items() if k != "observers"})
        context = multiprocessing.get_context("spawn")
        commands_in, self._commands = context.Pipe(duplex=False)
        self._messages, messages_out = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_engine_process_main, name="nanovllm-engine",
            args=(model, kwargs, commands_in, messages_out, torch.get_num_threads(), build),
        )
        try:
            self.process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"the engine process takes the engine's arguments by pickling, and one cannot be "
                            f"pickled ({exc}); pass picklable arguments, or engine_process=False to run the "
                            "engine on a thread of this process") from None
        finally:  # the child's ends: closed here, so that either side sees the other one's exit
            commands_in.close()
            messages_out.close()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # pickled commands, for the sender thread
        self._stopping = False
        self._threads: list[threading.Thread] = []
        try:
            message = self._messages.recv()
        except EOFError:
            self.process.join(STOP_TIMEOUT)
            raise RuntimeError(f"the engine process {self._death()} before the engine was built; its error "
                               "is above") from None
        if message[0] == "failed":
            self.process.join(STOP_TIMEOUT)
            raise message[1]
        self.info: EngineInfo = message[1]
        # before multiprocessing's own exit handler, which waits for every child it did not tell to stop
        atexit.register(self.shutdown)

    def _death(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            return f"(pid {self.process.pid}) was killed by signal {signal.Signals(-code).name}"
        return f"(pid {self.process.pid}) exited with code {code}"

    def start(self, post: Callable[[tuple], None]) -> None:
        self._threads = [threading.Thread(target=self._send_loop, name="nanovllm-engine-sender", daemon=True),
                         threading.Thread(target=self._receive_loop, args=(post,), name="nanovllm-engine-reader",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, command: tuple) -> None:
        """Pickled here, so that what cannot be pickled fails in the caller."""
        from multiprocessing.reduction import ForkingPickler

        self._outbox.put(bytes(ForkingPickler.dumps(command)))

    def _send_loop(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._commands.send_bytes(data)
            except OSError:  # the child is gone; the reader says so
                return

    def _receive_loop(self, post: Callable[[tuple], None]) -> None:
        try:
            while True:
                message = self._messages.recv()
                post(message)
                if message[0] == "closed":
                    return
        except (EOFError, OSError):  # the child ended without saying why
            self.process.join(STOP_TIMEOUT if self._stopping else 1.0)
            post(("closed", f"the engine process {self._death()}; make a new AsyncLLM"))
        finally:
            self._messages.close()

    def shutdown(self, timeout: float = STOP_TIMEOUT) -> None:
        """Tell the child to stop and wait for it (it closes the engine); kill it if it does not stop in time."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self._threads:
            self.send(("shutdown",))
            self._outbox.put(None)
            self._threads[0].join(timeout)
        else:
            try:
                self._commands.send(("shutdown",))
            except OSError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._commands.close()
        if not self._threads:
            self._messages.close()  # else the reader closes nothing: it ends on the child's exit

