"""``nanovllm serve MODEL``: an OpenAI-compatible HTTP server on FastAPI and uvicorn.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (server-sent events when ``stream``), ``/v1/models``,
``/health``, ``/ping``, ``/version``, ``/tokenize``, ``/detokenize`` and Prometheus ``/metrics``. Requests are
checked before they reach the engine: a field the server does not know, or a sampling option the engine does not
support, is a 400 error naming it, never ignored. Prompts are tokenized and chat templates rendered on a worker
thread, so a long prompt never stalls the event loop. A client that goes away aborts its requests, which frees
their blocks. SIGTERM (or Ctrl-C) drains: new requests get 503, those in flight may finish for
``--shutdown-timeout`` seconds, then the rest end with an error; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Annotated, Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanovllm import __version__
from nanovllm.chat_utils import ChatOptions, render
from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from nanovllm.entrypoints import DEFAULT_MAX_JSON_BODY_SIZE, DEFAULT_SHUTDOWN_TIMEOUT
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's finished_reason values that this server gives
MAX_N = 256  # completions per prompt: each has its own mirror on the front-end, so n is bounded
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its requests were aborted."""


class APIError(Exception):
    """An error for the client, in OpenAI's JSON shape: it sent something wrong (4xx), or the server cannot take
    the request now (503)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object; its type is the status's name ("BadRequestError", "NotFoundError", ...)."""
    kind = {401: "AuthenticationError", 500: "InternalServerError"}.get(status)
    if kind is None:
        kind = HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status)


def client_error(exc: Exception) -> tuple[str, int]:
    """The message and status a client gets for ``exc``: an :class:`APIError`'s own; vLLM's 500 for a request
    the engine dropped, or that found the engine stopped (then the server must be restarted)."""
    if isinstance(exc, APIError):
        return str(exc), exc.status
    if isinstance(exc, EngineDeadError):
        return f"the server's engine has stopped and cannot serve requests; restart the server ({exc})", 500
    return str(exc), 500


# -- requests ---------------------------------------------------------------------------------------


class Closed(BaseModel):
    """A request part with no unknown fields, and no infinite or NaN numbers (JSON parsers accept Infinity)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Closed):
    include_usage: bool = False


class SamplingFields(Closed):
    """Fields both endpoints share. ``None`` means: not given, the engine's default."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's own sampling fields
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the end user's id, for the operator's logs; it changes nothing

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options may only be given with stream=true")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                 "allowed_token_ids", "bad_words")
        kwargs = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.n != 1:
            kwargs["n"] = self.n
        if self.logit_bias is not None:
            try:
                kwargs["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise APIError("logit_bias keys must be token ids", param="logit_bias") from None
        return kwargs


# A prompt's forms, tried in this order and the first that fits taken. Token ids exactly (ints, no bools) come
# first: pydantic's default 'smart' union checks a prompt against every form, which makes a long list of
# token ids cost the event loop several times more; this order reads every prompt as before
PromptField = Annotated[list[StrictInt] | str | list[str] | list[int] | list[list[int]],
                        Field(union_mode="left_to_right")]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message: a known role; the rest (content, name, tool calls, ...) is checked as it is rendered."""

    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_unset=True) for m in messages]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the template; calls come back as text


class TokenizeRequest(Closed):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Closed):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def make_params(fields: dict[str, Any], max_tokens: int | None, kind: RequestOutputKind, **extra: Any) -> SamplingParams:
    """SamplingParams from the request, its errors (a bad value, an option the engine lacks) as 400."""
    try:
        return SamplingParams(**fields, max_tokens=max_tokens, output_kind=kind, **extra)
    except TypeError as exc:  # an option this engine's SamplingParams does not have
        raise APIError(f"unsupported sampling option: {exc}") from None
    except ValueError as exc:
        raise APIError(str(exc)) from None


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None,
                check: Callable[[str, str], None] | None = None) -> list[int]:
    """The chat template, rendered as ``LLM.chat`` renders it (:mod:`nanovllm.chat_utils`), then its token ids,
    with the front-end's tokenizer; ``check(text, "messages")`` sees the text before it is tokenized."""
    try:
        options = ChatOptions(chat_template_kwargs=template_kwargs or {},
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools)
        (text,) = render(tokenizer, [messages], options)
    except ValueError as exc:
        raise APIError(str(exc).replace("conversation 0", "messages"), param="messages") from None
    if check is not None:
        check(text, "messages")
    return tokenizer.encode(text, add_special_tokens=False)


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can cover, when the tokenizer proves such a bound: byte-level BPE with no
    normalizer, where a token is at most its vocabulary entry's bytes of the text and a character at least one
    byte. None for any other tokenizer (a word-level one maps a word of any length to one unknown token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE" or not any(
        step.get("type") == "ByteLevel" for step in steps
    ):
        return None
    return max(len(token) for token in backend.get_vocab(with_added_tokens=True))


class Preprocessor:
    """Turns prompts and conversations into token ids on one worker thread, so that a long prompt never stalls
    the event loop (the tokenizer releases the GIL). At most ``max_pending`` jobs wait or run at once; more is a
    503, so a flood cannot pile up. A text whose character count alone proves it longer than the context is
    refused before it is tokenized (see :func:`max_token_chars`)."""

    def __init__(self, tokenizer, max_model_len: int, max_pending: int = 32) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.chars_per_token = None if tokenizer is None else max_token_chars(tokenizer)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-tokenize")
        self.slots = threading.BoundedSemaphore(max_pending)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker. A caller cancelled meanwhile (its client left) leaves the job to end
        there, still holding its slot."""
        if self.tokenizer is None:
            raise APIError("this server has no tokenizer (skip_tokenizer_init): send prompts as token ids")
        if not self.slots.acquire(blocking=False):
            raise APIError("the server is busy tokenizing other requests; retry shortly", 503)

        def job() -> T:
            try:
                return fn(*args)
            finally:
                self.slots.release()

        future = asyncio.wrap_future(self.executor.submit(job))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even when nobody awaits it
        return await asyncio.shield(future)

    def check_chars(self, text: str, what: str) -> None:
        """Refuse a text that must have at least ``max_model_len`` tokens."""
        if self.chars_per_token is not None and len(text) > self.chars_per_token * (self.max_model_len - 1):
            at_least = -(-len(text) // self.chars_per_token)
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"{what} of {len(text)} characters has at least {at_least} tokens. Please reduce the "
                           f"length of the {what}.", param="messages" if what == "messages" else "prompt")

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        for text in texts:
            self.check_chars(text, "prompt")
        return [self.tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's token ids, as the engine tokenizes a text prompt."""
        return await self.run(self._encode, texts, add_special_tokens)

    def _chat(self, messages: list[dict[str, Any]], *options: Any) -> list[int]:
        return render_chat(self.tokenizer, messages, *options, check=self.check_chars)

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's token ids (:func:`render_chat`)."""
        return await self.run(self._chat, messages, add_generation_prompt, continue_final_message,
                              template_kwargs, tools)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode, token_ids)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# -- metrics ----------------------------------------------------------------------------------------


class Series:
    """One Prometheus series under nanovllm's name and under vLLM's, whose dashboards read ``vllm:*`` series
    labelled with ``model_name``: both see every observation."""

    def __init__(self, kind: type, name: str, doc: str, registry: CollectorRegistry, model_name: str,
                 labels: tuple[str, ...] = (), vllm_name: str | None = None, **options: Any) -> None:
        self.ours = kind(f"nanovllm:{name}", doc, labels, registry=registry, **options)
        self.vllm = kind(f"vllm:{vllm_name or name}", doc, ("model_name", *labels), registry=registry, **options)
        self.model_name = model_name

    def labels(self, *values: str) -> list:
        return [self.ours.labels(*values) if values else self.ours, self.vllm.labels(self.model_name, *values)]

    def observe(self, value: float) -> None:
        for metric in self.labels():
            metric.observe(value)

    def inc(self, value: float = 1.0, *labels: str) -> None:
        for metric in self.labels(*labels):
            metric.inc(value)

    def set_function(self, fn: Callable[[], float]) -> None:
        for metric in self.labels():
            metric.set_function(fn)


class Metrics:
    """Prometheus metrics with vLLM's names and meanings, each as ``nanovllm:NAME`` and ``vllm:NAME``, in a
    registry of their own (one per server)."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()

        def series(kind: type, name: str, doc: str, labels: tuple[str, ...] = (), **options: Any) -> Series:
            return Series(kind, name, doc, registry, model_name, labels, **options)

        # the scheduler as of the engine's latest step
        series(Gauge, "num_requests_running", "Requests in the running batch").set_function(
            lambda: llm.stats.num_running)
        series(Gauge, "num_requests_waiting", "Requests waiting to be scheduled").set_function(
            lambda: llm.stats.num_waiting)
        series(Gauge, "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)").set_function(
            lambda: llm.stats.kv_cache_usage)
        self.prompt_tokens = series(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = series(Counter, "generation_tokens", "Tokens generated by finished requests")
        self.success = series(Counter, "request_success", "Completions ended, by why: stop, length, abort "
                              "(its client left, or a drain), error", ("finished_reason",))
        for reason in FINISH_REASONS:  # every series shown from the start, at 0, as vLLM's
            self.success.labels(reason)
        lengths = [b * 10**e for e in range(len(str(llm.max_model_len))) for b in (1, 2, 5)]
        lengths = [n for n in lengths if n < llm.max_model_len] + [llm.max_model_len]  # 1, 2, 5, 10, ... the limit
        self.request_prompt_tokens = series(Histogram, "request_prompt_tokens", "Prompt tokens per finished request",
                                            buckets=lengths)
        self.request_generation_tokens = series(Histogram, "request_generation_tokens",
                                                "Generated tokens per finished request", buckets=lengths)
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = series(Histogram, "time_to_first_token_seconds", "Time to the first token", buckets=latency)
        self.tpot = series(Histogram, "time_per_output_token_seconds", "Mean time per output token after the "
                           "first, per request", vllm_name="request_time_per_output_token_seconds",
                           buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1))
        self.e2e = series(Histogram, "e2e_request_latency_seconds", "Request latency", buckets=latency)
        self.throughput = Histogram("nanovllm:request_output_tokens_per_second", "Output tokens per second of "
                                    "a request, from its arrival", buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000),
                                    registry=registry)


class MeteredStream:
    """One engine request's outputs as the server reads them (``async for``; ``close()`` aborts it), reported
    to the metrics: its generated tokens (``count``), over DELTA or FINAL_ONLY outputs; each of its ``n``
    completions counted once in ``request_success`` when it ends, by its finish reason, as "error" when the
    engine dropped the request or stopped, as "abort" when it was closed or its reader cancelled before it
    finished (vLLM's "aborted by the client"); and when the request finishes, its tokens and times. The
    times are the output's ``metrics`` (arrival, first and last token, finish), so a final-only request,
    whose one output comes at the end, is timed as a streamed one is."""

    def __init__(self, stream: RequestStream, metrics: Metrics, n: int) -> None:
        self.stream, self.metrics, self.n = stream, metrics, n
        self.count = 0
        self.ended: set[int] = set()  # the completions counted in request_success

    def __aiter__(self) -> MeteredStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await anext(self.stream)
        except StopAsyncIteration:  # after its last output, or closed before it
            self._end("abort")
            raise
        except Exception:
            self._end("error")
            raise
        except BaseException:  # the reader was cancelled: the stream aborted the request
            self._end("abort")
            raise
        self._observe(out)
        return out

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Abort the request unless it finished."""
        self._end("abort")
        self.stream.close()

    def _end(self, reason: str) -> None:
        """Count every completion not counted yet as ended for ``reason``."""
        left = self.n - len(self.ended)
        if left:
            self.ended.update(range(self.n))
            self.metrics.success.inc(left, reason)

    def _observe(self, out: RequestOutput) -> None:
        m = self.metrics
        for c in out.outputs:
            self.count += len(c.token_ids)
            if c.finish_reason is not None and c.index not in self.ended:
                self.ended.add(c.index)
                m.success.inc(1, c.finish_reason)
        if not out.finished:
            return
        times = out.metrics
        e2e = times.finished_time - times.arrival_time
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(self.count)
        m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        m.request_generation_tokens.observe(self.count)
        m.throughput.observe(self.count / max(e2e, 1e-9))
        if times.first_token_time is not None:
            m.ttft.observe(times.first_token_time - times.arrival_time)
            if self.count > 1:
                m.tpot.observe((times.last_token_time - times.first_token_time) / (self.count - 1))


# -- admission and shutdown -------------------------------------------------------------------------


class Drain:
    """The server's requests in flight, and its shutdown. ``run(timeout)`` stops new requests (503), lets those
    in flight finish for ``timeout`` seconds, then aborts the engine requests left, whose clients get an error
    (a 503, or an error event on a stream), and returns once they have been told."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self.streams: weakref.WeakSet[MeteredStream] = weakref.WeakSet()  # every engine request submitted
        self.reason = "the request was aborted"
        self.aborting = False  # the drain's time is up: what is still in flight is aborted, nothing new starts
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def _until_idle(self, timeout: float) -> bool:
        self._idle = asyncio.Event()
        if self.in_flight:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                return False
        return True

    async def run(self, timeout: float) -> None:
        self.draining = True
        logger.info("shutting down: %d request(s) in flight may finish within %g s", self.in_flight, timeout)
        if await self._until_idle(timeout):
            return
        self.reason = (f"the server is shutting down and aborted this request, unfinished after the {timeout:g} s "
                       "it waits for requests in flight (--shutdown-timeout); send it again to another server")
        logger.warning("shutting down: aborting %d request(s) still in flight", self.in_flight)
        self.aborting = True
        for stream in list(self.streams):
            stream.close()
        await self._until_idle(5.0)  # each handler tells its client


class Admission:
    """ASGI middleware: what may come in. While the server drains, every request but ``/metrics`` gets a 503; a
    body over ``max_body_size`` bytes gets a 413 before the app parses it. Counts the requests in flight."""

    def __init__(self, app: ASGIApp, drain: Drain, max_body_size: int) -> None:
        self.app, self.drain, self.max_body_size = app, drain, max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] != "/metrics":
            return await error_response("the server is shutting down; send the request to another server",
                                        503)(scope, receive, send)
        self.drain.enter()
        try:
            body = await self._read_body(scope, receive)
            if body is None:
                return await error_response(
                    f"the request body is larger than the server's limit of {self.max_body_size} bytes; shorten "
                    "it, or start the server with a larger --max-json-body-size", 413)(scope, receive, send)
            replayed = False

            async def replay() -> Message:  # the body once, then the client's own messages (a disconnect)
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, send)
        finally:
            self.drain.leave()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None when it is over the limit (by its declared length, or as it arrives)."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_size:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app's next receive() says so too
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_size:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


# -- the app ----------------------------------------------------------------------------------------


def build_app(llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              max_json_body_size: int = DEFAULT_MAX_JSON_BODY_SIZE) -> FastAPI:
    """The FastAPI app over ``llm``; ``served_model_name`` is the name clients pass as ``model``. A request body
    over ``max_json_body_size`` bytes is refused (413). ``app.state.drain`` is its :class:`Drain`, and
    ``app.state.preprocessor`` its :class:`Preprocessor` (close it when the app is done with)."""
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    app.state.llm = llm
    metrics = Metrics(llm, served_model_name)
    tokenizer = llm.tokenizer
    preprocessor = app.state.preprocessor = Preprocessor(tokenizer, llm.max_model_len)
    drain = app.state.drain = Drain()
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(str(exc), exc.status, exc.param)

    @app.exception_handler(ClientGone)
    async def client_gone(_request: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"] if p != "body")
            if err["type"] == "json_invalid":
                problems.append(f"the body is not valid JSON ({err['ctx']['error']} at character {where})")
            elif err["type"] == "extra_forbidden":
                problems.append(f"unknown or unsupported field {where!r}")
            elif err["type"] == "value_error":
                problems.append(str(err["ctx"]["error"]))
            elif not where:  # the body as a whole
                problems.append("the body must be a JSON object" if err["type"] != "missing" else
                                "the body is empty; send a JSON object")
            else:
                problems.append(f"{where}: {err['msg']}")
        return error_response("; ".join(problems), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    if api_key is not None:
        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
            return await call_next(request)

    app.add_middleware(Admission, drain=drain, max_body_size=max_json_body_size)

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {served_model_name!r}", 404,
                           "model")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(*client_error(exc))

    @app.get("/health")
    async def health() -> Response:
        """200 while the server takes requests; vLLM's 503 once the engine has stopped (or while the server
        drains, from :class:`Admission`)."""
        try:
            await llm.check_health()
        except EngineDeadError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # vLLM's (SageMaker's) name for /health
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "nanovllm",
                "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            tokens = await preprocessor.chat(message_dicts(body.messages), body.add_generation_prompt)
        else:
            (tokens,) = await preprocessor.encode([body.prompt], body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < llm.vocab_size]
        if bad:
            raise APIError(f"token id(s) outside the vocabulary [0, {llm.vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": await preprocessor.decode(body.tokens)}

    def aborted() -> APIError:
        """The error of a request that ended unfinished: the server's drain aborted it."""
        return APIError(drain.reason, 503)

    def check_context(prompts: list[list[int]], params: SamplingParams) -> None:
        """vLLM's 400 for a completion that cannot fit the context (offline, it would stop there instead)."""
        for token_ids in prompts:
            try:
                llm.input_processor.check_context_length(len(token_ids), params.max_tokens)
            except ValueError as exc:
                raise APIError(str(exc), param="max_tokens") from None

    def submit(prompts: list[list[int]], params: SamplingParams, prefix: str) -> list[MeteredStream]:
        """Queue one engine request per prompt (token ids), at once: in the handler's own turn of the event
        loop, so the requests of a burst reach the engine together. A bad prompt is a 400, and the others are
        aborted."""
        check_context(prompts, params)
        if drain.aborting:  # it was still being tokenized when the drain's time ran out
            raise aborted()
        streams: list[MeteredStream] = []
        try:
            for i, prompt in enumerate(prompts):
                stream = llm.submit({"prompt_token_ids": prompt}, params, f"{prefix}-{i}")
                streams.append(MeteredStream(stream, metrics, params.n))
                drain.streams.add(streams[-1])
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, (ValueError, TypeError)):
                raise APIError(str(exc)) from None
            raise
        return streams

    async def first_outputs(request: Request, streams: list[MeteredStream]) -> list[RequestOutput]:
        """Streaming: each request's first output, before the response starts. If one fails, or the client
        leaves first, every request is aborted."""

        async def first(stream: MeteredStream) -> RequestOutput:
            async for out in stream:
                return out
            raise aborted()

        try:
            return await until_disconnected(request, asyncio.gather(*(first(s) for s in streams)))
        except BaseException:
            for stream in streams:
                stream.close()
            raise

    async def final_outputs(request: Request, streams: list[MeteredStream]) -> list[RequestOutput]:
        """Not streaming: each request's final output. If one fails, or the client leaves first, every
        request is aborted."""

        async def last(stream: MeteredStream) -> RequestOutput:
            out = None
            async for out in stream:
                pass
            if out is None or not out.finished:
                raise aborted()
            if (failed := failure(out)) is not None:  # a failed step was blamed on it: vLLM's 500
                raise APIError(failed, 500)
            return out

        try:
            return await until_disconnected(request, asyncio.gather(*(last(s) for s in streams)))
        finally:
            for stream in streams:
                stream.close()

    async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
        """``work``'s result; if the client disconnects first, ``work`` is cancelled, which closes the engine
        requests it waits on (aborting them: their blocks are freed at once), and :class:`ClientGone` raised.
        For what comes before the response starts: a non-streaming answer (sent only at the end), or the
        wait for a stream's first output; once streaming, Starlette notices a disconnect itself."""
        work = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        left = False
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            left = work not in done
        finally:
            watcher.cancel()
            if not work.done():  # the client left (or this handler was cancelled): stop generating for it
                work.cancel()
                await asyncio.wait({work})
        if left:  # a cancelled gather ends with a CancelledError as its exception, not as cancelled: read it
            work.cancelled() or work.exception()
            raise ClientGone
        return work.result()

    def usage(outputs: list[RequestOutput], completion_tokens: int) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    async def outputs_in_turn(
        firsts: list[RequestOutput], streams: list[MeteredStream],
    ) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        """The requests' outputs as they come, each with its request's position; an error instead of an output
        ends them. One request (most) is read straight from its stream, without a task and a queue between."""
        if len(streams) == 1:
            try:
                out = firsts[0]
                yield 0, out
                async for out in streams[0]:
                    yield 0, out
                if not out.finished:
                    yield 0, aborted()
            except Exception as exc:
                yield 0, exc
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, first: RequestOutput, stream: MeteredStream) -> None:
            try:
                out = first
                await merged.put((i, out))
                async for out in stream:
                    await merged.put((i, out))
                if not out.finished:
                    await merged.put((i, aborted()))
            except Exception as exc:
                await merged.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams, strict=True))]
        try:
            while True:
                yield await merged.get()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their cancellation closes the streams

    async def stream_events(
        firsts: list[RequestOutput], streams: list[MeteredStream], n: int,
        chunks: Callable[[int, CompletionOutput, RequestOutput], list[dict]], head: dict, include_usage: bool,
    ) -> AsyncIterator[str]:
        """Merge the requests' delta outputs into one event stream; closing it aborts what is unfinished."""
        # each chunk's event is json.dumps({**head, "choices": [chunk]}), with the head's part encoded once
        start = f"data: {json.dumps(head)[:-1]}, \"choices\": ["
        outputs = outputs_in_turn(firsts, streams)
        try:
            remaining = len(streams)
            while remaining:
                i, out = await anext(outputs)
                if isinstance(out, Exception):  # an error event, then [DONE], as vLLM ends a failed stream
                    yield sse(error_body(*client_error(out)))
                    yield sse("[DONE]")
                    return
                for c in out.outputs:
                    for chunk in chunks(i * n + c.index, c, out):
                        yield f"{start}{json.dumps(chunk)}]}}\n\n"
                if (failed := failure(out)) is not None:  # this request only: an error event, then [DONE]
                    yield sse(error_body(failed, 500))
                    yield sse("[DONE]")
                    return
                if out.finished:
                    remaining -= 1
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(firsts, sum(s.count for s in streams))})
            yield sse("[DONE]")
        finally:
            await outputs.aclose()
            for s in streams:
                await s.aclose()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise APIError("echo is not supported", param="echo")
        if body.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError("best_of is not supported (vLLM's V1 engine dropped it too); use n", param="best_of")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError("prompt must not be empty", param="prompt")
        kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        params = make_params(body.sampling_kwargs(), body.max_tokens, kind, logprobs=body.logprobs)
        if isinstance(prompts[0], str):
            if not all(prompts):
                raise APIError("prompt must not be an empty string; give at least one character", param="prompt")
            prompts = await preprocessor.encode(prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": served_model_name}

        def choice(index: int, c: CompletionOutput, offset: int = 0) -> dict:
            return {"index": index, "text": c.text, "finish_reason": finish(c), "stop_reason": c.stop_reason,
                    "logprobs": completion_logprobs(c, body.logprobs, offset)}

        if body.stream:
            streams = submit(prompts, params, request_id)
            firsts = await first_outputs(request, streams)
            offsets: dict[int, int] = {}

            def chunks(index: int, c: CompletionOutput, _out: RequestOutput) -> list[dict]:
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(c.text)
                return [choice(index, c, offset)] if c.text or c.token_ids or c.finish_reason else []

            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream_events(firsts, streams, body.n, chunks, head, include_usage),
                                     media_type="text/event-stream")
        outputs = await final_outputs(request, submit(prompts, params, request_id))
        choices = [choice(i * body.n + c.index, c) for i, out in enumerate(outputs) for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        # a JSONResponse of our own: FastAPI would first walk the plain-JSON dict with jsonable_encoder
        return JSONResponse({**head, "choices": choices, "usage": usage(outputs, completion_tokens)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = make_params(body.sampling_kwargs(), max_tokens, kind, logprobs=logprobs)
        prompt_ids = await preprocessor.chat(message_dicts(body.messages), body.add_generation_prompt,
                                             body.continue_final_message, body.chat_template_kwargs, body.tools)
        if max_tokens is None and len(prompt_ids) < llm.max_model_len:  # OpenAI's default: up to the limit
            params.max_tokens = llm.max_model_len - len(prompt_ids)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": served_model_name}
        top = body.top_logprobs or 0

        if body.stream:
            streams = submit([prompt_ids], params, request_id)
            firsts = await first_outputs(request, streams)
            started: set[int] = set()

            def chunks(index: int, c: CompletionOutput, _out: RequestOutput) -> list[dict]:
                out = []
                if index not in started:
                    started.add(index)
                    out.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
                if c.text or c.token_ids or c.finish_reason:
                    delta = {"content": c.text} if c.text else {}
                    out.append({"index": index, "delta": delta, "finish_reason": finish(c),
                                "logprobs": chat_logprobs(c, top) if body.logprobs else None})
                return out

            include_usage = body.stream_options is not None and body.stream_options.include_usage
            head = {**head, "object": "chat.completion.chunk"}
            return StreamingResponse(stream_events(firsts, streams, body.n, chunks, head, include_usage),
                                     media_type="text/event-stream")
        (out,) = await final_outputs(request, submit([prompt_ids], params, request_id))
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, top) if body.logprobs else None,
                    "finish_reason": finish(c), "stop_reason": c.stop_reason} for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return JSONResponse({**head, "choices": choices, "usage": usage([out], completion_tokens)})

    return app


def failure(out: RequestOutput) -> str | None:
    """The error of a completion that a failed engine step ended (finish reason "error"), else None."""
    for c in out.outputs:
        if c.finish_reason == "error":
            return c.error or "the engine failed this request"
    return None


def finish(c: CompletionOutput) -> Literal["stop", "length"] | None:
    return c.finish_reason if c.finish_reason in ("stop", "length") else None


def ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: item[1].rank or 0)[:k]


def completion_logprobs(c: CompletionOutput, k: int | None, offset: int) -> dict | None:
    """The legacy completions shape: tokens, their logprobs, the top ``k`` per position, text offsets."""
    if k is None or c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for _, lp in ranked(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> dict:
    """The chat shape: per token its text, logprob and UTF-8 bytes, and the top ``k``."""

    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=True):
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for _, lp in ranked(entry, k)]})
    return {"content": content}


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT runs the app's :class:`Drain` for ``shutdown_timeout``
    seconds before uvicorn stops, and whose second stops it at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain, self.shutdown_timeout = drain, shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False

    async def serve(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """A signal (on the main thread, between two bytecodes): the first drains, the second stops now. Unlike
        uvicorn's, it is not raised again once the server has stopped: ``serve`` returns instead."""
        if self.draining or self.loop is None:
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        task = asyncio.ensure_future(self.drain.run(self.shutdown_timeout))
        task.add_done_callback(lambda _: setattr(self, "should_exit", True))


def serve(llm: AsyncLLM, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info", *,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
          max_json_body_size: int = DEFAULT_MAX_JSON_BODY_SIZE) -> None:
    """Run the server until SIGTERM or Ctrl-C, then stop the engine and return. The first signal drains: new
    requests get 503, those in flight may finish for ``shutdown_timeout`` seconds (0: none), then the rest are
    aborted, each client told so; a second signal stops at once. A request body over ``max_json_body_size``
    bytes gets a 413."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout is in seconds, >= 0, got {shutdown_timeout!r}")
    if max_json_body_size < 1:
        raise ValueError(f"max_json_body_size is in bytes, >= 1, got {max_json_body_size!r}")
    app = build_app(llm, served_model_name, api_key, max_json_body_size)
    # the drain has ended every request before uvicorn stops; its own wait is only a backstop
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.drain, shutdown_timeout)
    try:
        server.run()
    finally:
        app.state.preprocessor.close()
        llm.shutdown(5.0 if server.force_exit else 60.0)
