"""``nanovllm serve MODEL``: an OpenAI-compatible HTTP server on FastAPI and uvicorn.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (server-sent events when ``stream``), ``/v1/models``,
``/health``, ``/tokenize``, ``/detokenize`` and Prometheus ``/metrics``. Requests are checked before they reach
the engine: a field the server does not know, or a sampling option the engine does not support, is a 400
error naming it, never ignored. A client that goes away aborts its requests, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.chat_utils import ChatOptions, render
from nanovllm.engine.async_llm import AsyncLLM, RequestStream
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its requests were aborted."""


class APIError(Exception):
    """An error the client caused (400) or asked for something missing (404), in OpenAI's JSON shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


# -- requests ---------------------------------------------------------------------------------------


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Closed):
    include_usage: bool = False


class SamplingFields(Closed):
    """Fields both endpoints share. ``None`` means: not given, the engine's default."""

    model: str | None = None
    n: int = 1
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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the end user's id, for the operator's logs; it changes nothing

    def sampling_kwargs(self) -> dict[str, Any]:
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
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
# first: pydantic's default 'smart' union checks a prompt against every form, which costs a request of a
# thousand token ids ~0.3 ms of the event loop; this order takes 40 us and reads every prompt as before
PromptField = Annotated[list[StrictInt] | str | list[str] | list[int] | list[list[int]],
                        Field(union_mode="left_to_right")]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
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
    messages: list[dict[str, Any]] | None = None
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
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template, rendered as ``LLM.chat`` renders it (:mod:`nanovllm.chat_utils`), then its token ids,
    with the front-end's tokenizer."""
    try:
        options = ChatOptions(chat_template_kwargs=template_kwargs or {},
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools)
        (text,) = render(tokenizer, [messages], options)
    except ValueError as exc:
        raise APIError(str(exc).replace("conversation 0", "messages"), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


# -- metrics ----------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics with vLLM-like names, in a registry of their own (one per server)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.registry = registry = CollectorRegistry()
        # the scheduler as of the engine's latest step
        Gauge("nanovllm:num_requests_running", "Requests in the running batch", registry=registry
              ).set_function(lambda: llm.stats.num_running)
        Gauge("nanovllm:num_requests_waiting", "Requests waiting to be scheduled", registry=registry
              ).set_function(lambda: llm.stats.num_waiting)
        Gauge("nanovllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", registry=registry
              ).set_function(lambda: llm.stats.kv_cache_usage)
        self.prompt_tokens = Counter("nanovllm:prompt_tokens", "Prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("nanovllm:generation_tokens", "Tokens generated", registry=registry)
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("nanovllm:time_to_first_token_seconds", "Time to the first token",
                              buckets=latency, registry=registry)
        self.tpot = Histogram("nanovllm:time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request", buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
                              registry=registry)
        self.e2e = Histogram("nanovllm:e2e_request_latency_seconds", "Request latency", buckets=latency,
                             registry=registry)
        self.throughput = Histogram("nanovllm:request_output_tokens_per_second", "Output tokens per second of "
                                    "a request, from its arrival", buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000),
                                    registry=registry)


class RequestTimer:
    """One engine request's generated tokens, counted over its DELTA or FINAL_ONLY outputs; when it finishes,
    they and its times are reported to the metrics. The times are the output's ``metrics`` (arrival, first
    and last token, finish), so a final-only request, whose one output comes at the end, is timed as a
    streamed one is."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.count = metrics, 0

    def observe(self, out: RequestOutput) -> None:
        self.count += sum(len(c.token_ids) for c in out.outputs)
        if not out.finished:
            return
        m, times = self.metrics, out.metrics
        e2e = times.finished_time - times.arrival_time
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(self.count)
        m.throughput.observe(self.count / max(e2e, 1e-9))
        if times.first_token_time is not None:
            m.ttft.observe(times.first_token_time - times.arrival_time)
            if self.count > 1:
                m.tpot.observe((times.last_token_time - times.first_token_time) / (self.count - 1))


# -- the app ----------------------------------------------------------------------------------------


def build_app(llm: AsyncLLM, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over ``llm``; ``served_model_name`` is the name clients pass as ``model``."""
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    app.state.llm = llm
    metrics = Metrics(llm)
    tokenizer = llm.tokenizer
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
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown or unsupported field {where!r}")
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

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {served_model_name!r}", 404,
                           "model")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

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
            tokens = render_chat(tokenizer, body.messages, body.add_generation_prompt)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < llm.vocab_size]
        if bad:
            raise APIError(f"token id(s) outside the vocabulary [0, {llm.vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    def submit(prompts: list, params: SamplingParams, prefix: str) -> list[RequestStream]:
        """Queue one engine request per prompt, at once: in the handler's own turn of the event loop, so the
        requests of a burst reach the engine together. A bad prompt is a 400, and the others are aborted."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(llm.submit(prompt, params, f"{prefix}-{i}"))
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, (ValueError, TypeError)):
                raise APIError(str(exc)) from None
            raise
        return streams

    async def first_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Streaming: each request's first output, before the response starts. If one fails, or the client
        leaves first, every request is aborted."""
        try:
            return await until_disconnected(request, asyncio.gather(*(anext(s) for s in streams)))
        except BaseException:
            for stream in streams:
                stream.close()
            raise

    async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Not streaming: each request's final output. If one fails, or the client leaves first, every
        request is aborted."""

        async def last(stream: RequestStream) -> RequestOutput:
            timer = RequestTimer(metrics)
            async for out in stream:
                timer.observe(out)
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
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():  # the client left (or this handler was cancelled): stop generating for it
                work.cancel()
                await asyncio.wait({work})
        if work.cancelled():
            raise ClientGone
        return work.result()

    def usage(outputs: list[RequestOutput], completion_tokens: int) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    async def outputs_in_turn(
        firsts: list[RequestOutput], streams: list[RequestStream],
    ) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        """The requests' outputs as they come, each with its request's position; an error instead of an output
        ends them. One request (most) is read straight from its stream, without a task and a queue between."""
        if len(streams) == 1:
            try:
                yield 0, firsts[0]
                async for out in streams[0]:
                    yield 0, out
            except Exception as exc:
                yield 0, exc
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, first: RequestOutput, stream: RequestStream) -> None:
            try:
                await merged.put((i, first))
                async for out in stream:
                    await merged.put((i, out))
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
        firsts: list[RequestOutput], streams: list[RequestStream], n: int,
        chunks: Callable[[int, CompletionOutput, RequestOutput], list[dict]], head: dict, include_usage: bool,
    ) -> AsyncIterator[str]:
        """Merge the requests' delta outputs into one event stream; closing it aborts what is unfinished."""
        timers = [RequestTimer(metrics) for _ in streams]
        # each chunk's event is json.dumps({**head, "choices": [chunk]}), with the head's part encoded once
        start = f"data: {json.dumps(head)[:-1]}, \"choices\": ["
        outputs = outputs_in_turn(firsts, streams)
        try:
            remaining = len(streams)
            while remaining:
                i, out = await anext(outputs)
                if isinstance(out, Exception):
                    yield sse({"error": {"message": str(out), "type": "InternalServerError", "code": 500}})
                    return
                timers[i].observe(out)
                for c in out.outputs:
                    for chunk in chunks(i * n + c.index, c, out):
                        yield f"{start}{json.dumps(chunk)}]}}\n\n"
                if out.finished:
                    remaining -= 1
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(firsts, sum(t.count for t in timers))})
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
        # a JSONResponse of our own: FastAPI would first walk the plain-JSON dict with jsonable_encoder (~0.15 ms)
        return JSONResponse({**head, "choices": choices, "usage": usage(outputs, completion_tokens)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        prompt_ids = render_chat(tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                                 body.chat_template_kwargs, body.tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's default: up to the context limit
            max_tokens = max(1, llm.max_model_len - len(prompt_ids))
        kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = make_params(body.sampling_kwargs(), max_tokens, kind, logprobs=logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": served_model_name}
        top = body.top_logprobs or 0

        if body.stream:
            streams = submit([{"prompt_token_ids": prompt_ids}], params, request_id)
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
        (out,) = await final_outputs(request, submit([{"prompt_token_ids": prompt_ids}], params, request_id))
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, top) if body.logprobs else None,
                    "finish_reason": finish(c), "stop_reason": c.stop_reason} for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return JSONResponse({**head, "choices": choices, "usage": usage([out], completion_tokens)})

    return app


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


def serve(llm: AsyncLLM, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info") -> None:
    """Run the server until Ctrl-C or SIGTERM, then stop the engine and return."""
    import signal
    import threading

    import uvicorn

    def interrupt(_signum, _frame) -> None:
        raise KeyboardInterrupt

    app = build_app(llm, served_model_name, api_key)
    # uvicorn stops gracefully on either signal, then raises it again once its own handlers are gone: SIGTERM
    # then ends the server as Ctrl-C does, so that the engine is shut down before the process exits
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if main else None
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    except KeyboardInterrupt:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        llm.shutdown()
