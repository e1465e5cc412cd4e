"""The OpenAI-compatible server under bad and heavy input, disconnects and shutdown: a table of bad HTTP
requests (each a 4xx with vLLM's status, the server serving on), a 10 MB prompt that must not stall /health,
a client that leaves, vLLM's /version, /ping and ``vllm:`` metrics, and SIGTERM's bounded drain in a real
``nanovllm serve`` process. The tiny random Llama model on the CPU (with a chat template of its own); every
wait is bounded."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from nanovllm.testing import local_server, wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's finished_reason values

MODEL = "tiny"
# the context: the tiny model's positions stretched, so that a request may outlast a client's patience
MAX_MODEL_LEN = 4096
BODY_LIMIT = 16 << 20
TIMEOUT = 60
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    """A copy of the tiny model, its tokenizer given a chat template (a word per message's content); the
    session's tiny model stays without one, as other tests need it."""
    path = tmp_path_factory.mktemp("robustness") / "model"
    shutil.copytree(tiny_model(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(path)


class Logged(logging.Handler):
    """The server's log records, to look for tracebacks."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info or "Traceback" in r.getMessage()]


@pytest.fixture(scope="module")
def logged(server):
    """Attached once the server is configured: uvicorn's logging set-up replaces its loggers' handlers."""
    handler = Logged()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "nanovllm")]
    for log in loggers:
        log.addHandler(handler)
    yield handler
    for log in loggers:
        log.removeHandler(handler)


@pytest.fixture(scope="module")
def server(model_dir):
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    engine = AsyncLLM(model_dir, engine_process=False, device="cpu", max_model_len=MAX_MODEL_LEN,
                      hf_overrides={"max_position_embeddings": MAX_MODEL_LEN}, kv_cache_memory=1 << 26)
    app = build_app(engine, MODEL, max_json_body_size=BODY_LIMIT)
    try:
        with local_server(app, timeout=TIMEOUT) as served:
            yield served.url
    finally:
        app.state.preprocessor.close()
        engine.shutdown()


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", timeout=TIMEOUT).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and line[0] != "#"}


def wait_idle(server) -> None:
    """Every request gone and every block back, as the engine's latest step reports."""
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    assert wait_until(lambda: not any(metrics(server)[f"nanovllm:{name}"] for name in names), TIMEOUT), \
        "requests or blocks were left behind"


def good(server) -> None:
    out = httpx.post(f"{server}/v1/completions", timeout=TIMEOUT,
                     json={"model": MODEL, "prompt": "tok5 tok6", "max_tokens": 3, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3, out.text


# -- the table of bad requests ----------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": MODEL, "prompt": "tok5 tok6", "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "tok5"}], "max_tokens": 2}


def completion(**fields):
    return {**COMPLETION, **fields}


def chat(**fields):
    return {**CHAT_BODY, **fields}


def message(**fields):
    return chat(messages=[fields])


def raw(body: dict, **replaced: str) -> bytes:
    """JSON text with some values replaced by literal text (Infinity, NaN: what Python's parser accepts)."""
    text = json.dumps({**body, **dict.fromkeys(replaced, "@@")})
    for key, literal in replaced.items():
        text = text.replace(f'"{key}": "@@"', f'"{key}": {literal}')
    return text.encode()


# (name, method, path, JSON body or raw bytes, expected status)
BAD = [
    # not JSON, or not an object
    ("truncated JSON", "POST", C, b'{"model": "tiny", "prompt": ', 400),
    ("empty body", "POST", C, b"", 400),
    ("JSON array", "POST", C, b"[]", 400),
    ("JSON null", "POST", C, b"null", 400),
    ("plain text", "POST", C, b"hello", 400),
    ("JSON string", "POST", CHAT, b'"messages"', 400),
    # the prompt
    ("no prompt", "POST", C, {"model": MODEL, "max_tokens": 2}, 400),
    ("prompt an int", "POST", C, completion(prompt=5), 400),
    ("prompt an object", "POST", C, completion(prompt={"text": "tok5"}), 400),
    ("prompt an empty list", "POST", C, completion(prompt=[]), 400),
    ("prompt an empty string", "POST", C, completion(prompt=""), 400),
    ("prompt a list with an empty string", "POST", C, completion(prompt=["tok5", ""]), 400),
    ("prompt an empty token list", "POST", C, completion(prompt=[[]]), 400),
    ("prompt of floats", "POST", C, completion(prompt=[1.5, 2.5]), 400),
    ("prompt a negative token id", "POST", C, completion(prompt=[-1, 5]), 400),
    ("prompt a token id past the vocabulary", "POST", C, completion(prompt=[5, 256]), 400),
    ("prompt of mixed lists", "POST", C, completion(prompt=[[1, "a"]]), 400),
    ("prompt null", "POST", C, completion(prompt=None), 400),
    ("prompt of token ids too long", "POST", C, completion(prompt=[5] * MAX_MODEL_LEN), 400),
    ("text prompt too long", "POST", C, completion(prompt="tok5 " * MAX_MODEL_LEN), 400),
    # the model
    ("unknown model", "POST", C, completion(model="gpt-4"), 404),
    ("model an int", "POST", C, completion(model=5), 400),
    ("unknown model (chat)", "POST", CHAT, chat(model="gpt-4"), 404),
    # max_tokens
    ("max_tokens 0", "POST", C, completion(max_tokens=0), 400),
    ("max_tokens negative", "POST", C, completion(max_tokens=-1), 400),
    ("max_tokens 1e30", "POST", C, completion(max_tokens=1e30), 400),
    ("max_tokens past the context", "POST", C, completion(max_tokens=10**9), 400),
    ("max_tokens just past the context", "POST", C, completion(max_tokens=MAX_MODEL_LEN - 1), 400),
    ("max_tokens a string", "POST", C, completion(max_tokens="ten"), 400),
    ("max_tokens fractional", "POST", C, completion(max_tokens=2.5), 400),
    ("max_completion_tokens 0", "POST", CHAT, chat(max_completion_tokens=0), 400),
    ("max_completion_tokens past the context", "POST", CHAT, chat(max_completion_tokens=10**9), 400),
    # sampling values
    ("temperature negative", "POST", C, completion(temperature=-0.5), 400),
    ("temperature a string", "POST", C, completion(temperature="hot"), 400),
    ("temperature Infinity", "POST", C, raw(COMPLETION, temperature="Infinity"), 400),
    ("temperature NaN", "POST", C, raw(COMPLETION, temperature="NaN"), 400),
    ("temperature 1e999", "POST", C, raw(COMPLETION, temperature="1e999"), 400),
    ("top_p 0", "POST", C, completion(top_p=0), 400),
    ("top_p above 1", "POST", C, completion(top_p=1.5), 400),
    ("top_p NaN", "POST", CHAT, raw(CHAT_BODY, top_p="NaN"), 400),
    ("top_k -2", "POST", C, completion(top_k=-2), 400),
    ("top_k fractional", "POST", C, completion(top_k=1.5), 400),
    ("min_p above 1", "POST", C, completion(min_p=2), 400),
    ("presence_penalty above 2", "POST", C, completion(presence_penalty=3), 400),
    ("frequency_penalty below -2", "POST", C, completion(frequency_penalty=-3), 400),
    ("repetition_penalty 0", "POST", C, completion(repetition_penalty=0), 400),
    ("repetition_penalty -Infinity", "POST", C, raw(COMPLETION, repetition_penalty="-Infinity"), 400),
    ("seed a string", "POST", C, completion(seed="x"), 400),
    ("seed past 64 bits", "POST", C, completion(seed=2**70), 400),
    ("min_tokens negative", "POST", C, completion(min_tokens=-1), 400),
    ("min_tokens above max_tokens", "POST", C, completion(min_tokens=5), 400),
    ("ignore_eos a string", "POST", C, completion(ignore_eos="maybe"), 400),
    ("user an int", "POST", C, completion(user=5), 400),
    # n
    ("n 0", "POST", C, completion(n=0), 400),
    ("n negative", "POST", C, completion(n=-1), 400),
    ("n huge", "POST", C, completion(n=100_000), 400),
    ("n a string", "POST", C, completion(n="two"), 400),
    ("n 0 (chat)", "POST", CHAT, chat(n=0), 400),
    # stop
    ("stop an int", "POST", C, completion(stop=5), 400),
    ("stop an empty string", "POST", C, completion(stop=[""]), 400),
    ("stop of ints", "POST", C, completion(stop=[1, 2]), 400),
    ("stop_token_ids negative", "POST", C, completion(stop_token_ids=[-1]), 400),
    ("stop_token_ids past the vocabulary", "POST", C, completion(stop_token_ids=[100_000]), 400),
    ("stop_token_ids a string", "POST", C, completion(stop_token_ids="2"), 400),
    # logit_bias
    ("logit_bias key not a token id", "POST", C, completion(logit_bias={"abc": 1}), 400),
    ("logit_bias token past the vocabulary", "POST", C, completion(logit_bias={"99999": 1}), 400),
    ("logit_bias value a string", "POST", C, completion(logit_bias={"5": "x"}), 400),
    ("logit_bias value Infinity", "POST", C, raw(COMPLETION, logit_bias='{"5": Infinity}'), 400),
    # vLLM's own sampling fields
    ("allowed_token_ids empty", "POST", C, completion(allowed_token_ids=[]), 400),
    ("allowed_token_ids past the vocabulary", "POST", C, completion(allowed_token_ids=[5, 300]), 400),
    ("bad_words a string", "POST", C, completion(bad_words="tok5"), 400),
    ("bad_words blank", "POST", C, completion(bad_words=[" "]), 400),
    ("skip_special_tokens a list", "POST", C, completion(skip_special_tokens=[]), 400),
    # logprobs
    ("logprobs negative", "POST", C, completion(logprobs=-1), 400),
    ("logprobs above max_logprobs", "POST", C, completion(logprobs=21), 400),
    ("logprobs huge", "POST", C, completion(logprobs=10**6), 400),
    ("chat logprobs an int", "POST", CHAT, chat(logprobs=3), 400),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400),
    ("top_logprobs negative", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400),
    ("top_logprobs above max_logprobs", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    # streaming options
    ("stream an int", "POST", C, completion(stream=5), 400),
    ("stream_options without stream", "POST", C, completion(stream_options={"include_usage": True}), 400),
    ("stream_options without stream (chat)", "POST", CHAT, chat(stream_options={"include_usage": True}), 400),
    ("stream_options unknown field", "POST", C, completion(stream=True, stream_options={"every": 1}), 400),
    # unknown and unsupported fields
    ("unknown field", "POST", C, completion(frobnicate=1), 400),
    ("unknown field (chat)", "POST", CHAT, chat(functions_v2=[]), 400),
    ("echo", "POST", C, completion(echo=True), 400),
    ("suffix", "POST", C, completion(suffix="!"), 400),
    ("best_of above n", "POST", C, completion(best_of=3), 400),
    # messages
    ("no messages", "POST", CHAT, {"model": MODEL}, 400),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400),
    ("messages a string", "POST", CHAT, chat(messages="hi"), 400),
    ("messages of lists", "POST", CHAT, chat(messages=[["user", "hi"]]), 400),
    ("message without a role", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400),
    ("unknown role", "POST", CHAT, message(role="wizard", content="hi"), 400),
    ("role an int", "POST", CHAT, message(role=5, content="hi"), 400),
    ("content an int", "POST", CHAT, message(role="user", content=5), 400),
    ("user message without content", "POST", CHAT, message(role="user"), 400),
    ("image content", "POST", CHAT, message(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]),
     400),
    ("text part without text", "POST", CHAT, message(role="user", content=[{"type": "text"}]), 400),
    ("conversation too long", "POST", CHAT, message(role="user", content="tok5 " * MAX_MODEL_LEN), 400),
    ("continue_final_message with add_generation_prompt", "POST", CHAT, chat(continue_final_message=True), 400),
    ("chat_template_kwargs a string", "POST", CHAT, chat(chat_template_kwargs="x"), 400),
    ("chat_template_kwargs naming an argument", "POST", CHAT, chat(chat_template_kwargs={"tools": []}), 400),
    ("tools a string", "POST", CHAT, chat(tools="x"), 400),
    # routes and methods
    ("GET a POST route", "GET", C, None, 405),
    ("PUT the chat route", "PUT", CHAT, CHAT_BODY, 405),
    ("POST the models route", "POST", "/v1/models", {}, 405),
    ("DELETE /health", "DELETE", "/health", None, 405),
    ("unknown route", "GET", "/v1/nothing-here", None, 404),
    ("embeddings (not served)", "POST", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404),
    # tokenize and detokenize
    ("tokenize both prompt and messages", "POST", "/tokenize", {"prompt": "tok5", "messages": CHAT_BODY["messages"]},
     400),
    ("tokenize neither", "POST", "/tokenize", {}, 400),
    ("tokenize empty messages", "POST", "/tokenize", {"messages": []}, 400),
    ("tokenize unknown model", "POST", "/tokenize", {"model": "gpt-4", "prompt": "tok5"}, 404),
    ("detokenize a negative id", "POST", "/detokenize", {"tokens": [-1]}, 400),
    ("detokenize a string", "POST", "/detokenize", {"tokens": "abc"}, 400),
]


def test_the_table_has_every_kind_of_bad_input():
    assert len(BAD) >= 77 and len({name for name, *_ in BAD}) == len(BAD)


@pytest.mark.parametrize("name, method, path, body, status", BAD, ids=[case[0] for case in BAD])
def test_bad_request_is_a_4xx_and_the_server_serves_on(server, logged, name, method, path, body, status):
    headers = {"content-type": "application/json"}
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    response = httpx.request(method, f"{server}{path}", content=content, headers=headers, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"].endswith("Error")
    assert not logged.tracebacks()


def test_after_every_bad_request_a_good_one_succeeds_and_nothing_leaked(server, logged):
    good(server)
    wait_idle(server)
    assert not logged.tracebacks()


def test_a_body_over_the_limit_is_a_413_declared_or_chunked(server):
    big = b'{"model": "tiny", "prompt": "' + b"tok5 " * (BODY_LIMIT // 5) + b'"}'
    response = httpx.post(f"{server}{C}", content=big, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert response.status_code == 413 and "--max-json-body-size" in response.json()["error"]["message"]

    def chunks():  # no content-length: counted as it arrives
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    response = httpx.post(f"{server}{C}", content=chunks(), headers={"content-type": "application/json"},
                          timeout=TIMEOUT)
    assert response.status_code == 413
    small = json.dumps({**COMPLETION, "prompt": "tok5 " * 100}).encode()  # chunked and under the limit: read whole
    response = httpx.post(f"{server}{C}", content=(small[i:i + 100] for i in range(0, len(small), 100)),
                          headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 100
    good(server)


def test_tokenizing_jobs_are_bounded(model_dir):
    """One job runs, the next waits; past ``max_pending`` a request gets a 503 at once, and the slots come back."""
    import asyncio

    from nanovllm.engine.llm_engine import load_tokenizer
    from nanovllm.entrypoints.openai_server import APIError, Preprocessor

    preprocessor = Preprocessor(load_tokenizer(Path(model_dir)), MAX_MODEL_LEN, max_pending=2)
    release = threading.Event()

    async def main():
        held = [asyncio.ensure_future(preprocessor.run(release.wait, TIMEOUT)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await preprocessor.run(len, "x")
        assert refused.value.status == 503
        release.set()
        await asyncio.gather(*held)
        return await preprocessor.encode(["tok5 tok6"])

    try:
        assert asyncio.run(main()) == [[5, 6]]
    finally:
        preprocessor.close()


def test_vllms_own_sampling_fields_are_honoured(server):
    """allowed_token_ids limits what is sampled; include_stop_str_in_output keeps the stop string."""
    body = completion(max_tokens=8, ignore_eos=True, allowed_token_ids=[7, 9], temperature=1.0, seed=3)
    text = httpx.post(f"{server}{C}", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    assert set(text.split()) <= {"tok7", "tok9"} and len(text.split()) == 8
    body = completion(max_tokens=8, allowed_token_ids=[7], stop=["tok7"], include_stop_str_in_output=True)
    choice = httpx.post(f"{server}{C}", json=body, timeout=TIMEOUT).json()["choices"][0]
    assert choice["text"].strip() == "tok7" and choice["finish_reason"] == "stop"


def test_the_context_error_is_vllms(server):
    response = httpx.post(f"{server}{C}", json=completion(max_tokens=MAX_MODEL_LEN), timeout=TIMEOUT)
    assert response.json()["error"]["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{MAX_MODEL_LEN + 2} tokens (2 in the messages, {MAX_MODEL_LEN} in the completion). Please reduce the "
        "length of the messages or completion.")
    # what fits exactly is taken; chat without max_tokens asks for the rest of the context
    exact = completion(prompt=[5] * (MAX_MODEL_LEN - 3), max_tokens=3, ignore_eos=True)
    assert httpx.post(f"{server}{C}", json=exact, timeout=TIMEOUT).json()["usage"]["completion_tokens"] == 3
    rest = chat(messages=[{"role": "user", "content": "tok5 " * (MAX_MODEL_LEN - 4)}], ignore_eos=True, max_tokens=None)
    usage = httpx.post(f"{server}{CHAT}", json=rest, timeout=TIMEOUT).json()["usage"]
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == MAX_MODEL_LEN


# -- a huge prompt on the event loop ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """A real ``nanovllm serve`` process (its engine in a process of its own), shutdown timeout 1 s; the SIGTERM
    test, the last to use it, stops it."""
    process, url, log = start_server(model_dir, tmp_path_factory.mktemp("serve"), shutdown_timeout=1.0)
    yield process, url, log
    if process.poll() is None:
        process.kill()
        process.wait(TIMEOUT)


@pytest.mark.slow  # a server process of its own to start (seconds)
def test_a_10_mb_prompt_never_stalls_health(served):
    """Tokenizing 10 MB (seconds) runs on the worker thread: /health answers within 0.2 s all the while, and the
    prompt gets its 400. The tiny model's word-level tokenizer proves no bound on characters per token, so the
    prompt is tokenized in full. The server runs in a process of its own, so that the test's threads do not
    share its GIL."""
    _, url, _ = served
    prompt = "tok5-word " * (1 << 20)  # 10 MiB, a million tokens
    result = {}

    def post():
        result["response"] = httpx.post(f"{url}{C}", json=completion(prompt=prompt), timeout=TIMEOUT)

    poster = threading.Thread(target=post)
    started = time.monotonic()
    poster.start()
    latencies = []
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        while poster.is_alive() and time.monotonic() - started < TIMEOUT:
            t = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.02)
    poster.join(TIMEOUT)
    assert result["response"].status_code == 400 and "maximum context length" in result["response"].text
    assert len(latencies) > 10, "the prompt was answered too fast to show anything"
    assert max(latencies) < 0.2, sorted(latencies)[-5:]


def test_a_byte_level_bpe_text_too_long_by_its_characters_is_refused_before_tokenizing():
    """SmolLM2's tokenizer: a token covers at most its entry's bytes, so the bound is sound (checked on texts
    of many kinds), and a text past it is refused without tokenizing."""
    from nanovllm.default_model import default_model_dir
    from nanovllm.engine.llm_engine import load_tokenizer
    from nanovllm.entrypoints.openai_server import APIError, Preprocessor, max_token_chars

    tokenizer = load_tokenizer(Path(default_model_dir()))
    bound = max_token_chars(tokenizer)
    assert bound is not None and bound >= max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))
    texts = ["#" * 5000, " " * 5000, "\n" * 3000, "héllo wörld 🙂 " * 200, "<|im_start|>" * 300, "a" * 4000]
    for text in texts:
        assert len(tokenizer.encode(text)) >= len(text) / bound, text[:20]
    preprocessor = Preprocessor(tokenizer, max_model_len=64)
    try:
        preprocessor.check_chars("x" * (bound * 63), "prompt")  # may fit: not refused
        with pytest.raises(APIError, match="maximum context length is 64 tokens"):
            preprocessor.check_chars("x" * (bound * 63 + 1), "prompt")
    finally:
        preprocessor.close()


def test_a_word_level_tokenizer_proves_no_bound(model_dir):
    from nanovllm.engine.llm_engine import load_tokenizer
    from nanovllm.entrypoints.openai_server import max_token_chars

    tokenizer = load_tokenizer(Path(model_dir))
    assert max_token_chars(tokenizer) is None
    assert len(tokenizer.encode("x" * 1000)) == 1  # one unknown token of any length


# -- disconnects ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [C, CHAT])
def test_a_client_that_leaves_is_a_quiet_499_and_its_request_is_aborted(server, logged, path, stream):
    body = {**(COMPLETION if path == C else CHAT_BODY), "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True,
            "stream": stream}
    before = metrics(server)
    logged.records.clear()
    if stream:
        with httpx.stream("POST", f"{server}{path}", json=body, timeout=TIMEOUT) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{server}{path}", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.3))
    wait_idle(server)
    after = metrics(server)
    latencies = "nanovllm:e2e_request_latency_seconds_count"
    assert after.get(latencies, 0) == before.get(latencies, 0), "it ran to its end"
    for reason in FINISH_REASONS:  # counted once, as aborted (vLLM's "abort": aborted by the client)
        key = f'vllm:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}}'
        assert after[key] - before[key] == (reason == "abort"), reason
    time.sleep(0.2)  # what the server logs as the handler ends
    assert not logged.tracebacks()


# -- vLLM's endpoints and metrics --------------------------------------------------------------------


def test_version_and_ping(server):
    from nanovllm import __version__

    assert httpx.get(f"{server}/version", timeout=TIMEOUT).json() == {"version": __version__}
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{server}/ping", timeout=TIMEOUT)
        assert response.status_code == 200 and response.content == b""


def test_vllm_named_metrics_match_ours(server):
    before = metrics(server)
    for finish in ({"max_tokens": 3, "ignore_eos": True}, {"max_tokens": 5, "stop_token_ids": list(range(256))}):
        assert httpx.post(f"{server}{C}", json={**COMPLETION, **finish}, timeout=TIMEOUT).status_code == 200
    after = metrics(server)
    label = f'model_name="{MODEL}"'
    for ours, vllm in (("prompt_tokens_total", "prompt_tokens_total"),
                       ("generation_tokens_total", "generation_tokens_total"),
                       ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count"),
                       ("time_to_first_token_seconds_sum", "time_to_first_token_seconds_sum"),
                       ("time_per_output_token_seconds_count", "request_time_per_output_token_seconds_count"),
                       ("request_prompt_tokens_sum", "request_prompt_tokens_sum"),
                       ("request_generation_tokens_count", "request_generation_tokens_count"),
                       ("num_requests_running", "num_requests_running"),
                       ("num_requests_waiting", "num_requests_waiting"),
                       ("kv_cache_usage_perc", "kv_cache_usage_perc")):
        assert after[f"nanovllm:{ours}"] == after[f"vllm:{vllm}{{{label}}}"], ours
    assert after["nanovllm:generation_tokens_total"] - before.get("nanovllm:generation_tokens_total", 0) == 4
    generated = after["nanovllm:request_generation_tokens_sum"] - before.get("nanovllm:request_generation_tokens_sum", 0)
    assert generated == 4 and after['nanovllm:request_generation_tokens_bucket{le="5.0"}'] >= 2
    for reason in FINISH_REASONS:  # every reason's series is there, at 0 until one ends so
        key = f'vllm:request_success_total{{finished_reason="{reason}",{label}}}'
        assert after[key] - before[key] == (reason in ("length", "stop")), reason
        assert after[f'nanovllm:request_success_total{{finished_reason="{reason}"}}'] == after[key]


# -- a dead engine ----------------------------------------------------------------------------------


SMALL_ENGINE = dict(device="cpu", max_model_len=512, kv_cache_memory=1 << 24)


def injected_failure(engine) -> None:
    """From now on a step raises, as a tensor-parallel step does once the ranks may be out of step."""

    def fail() -> None:
        raise RuntimeError("injected step failure")

    engine.step = fail


async def dead_engine_answers(engine, app) -> dict:
    """What the app answers while the engine lives, and once a step has ended its loop."""
    transport = httpx.ASGITransport(app=app)
    answers = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as client:
        answers["health alive"] = (await client.get("/health")).status_code
        await engine.call(injected_failure)
        answers["in flight"] = await client.post(C, json=COMPLETION)
        answers["health dead"] = (await client.get("/health")).status_code
        answers["ping dead"] = (await client.get("/ping")).status_code
        start = time.monotonic()
        answers["after"] = await client.post(CHAT, json={**CHAT_BODY, "stream": True})
        answers["after_s"] = time.monotonic() - start
        answers["metrics"] = (await client.get("/metrics")).text
    return answers


def test_a_dead_engine_makes_health_503_and_requests_fail_at_once(model_dir):
    import asyncio

    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    engine = AsyncLLM(model_dir, engine_process=False, **SMALL_ENGINE)
    app = build_app(engine, MODEL)
    try:
        answers = asyncio.run(asyncio.wait_for(dead_engine_answers(engine, app), TIMEOUT))
    finally:
        app.state.preprocessor.close()
        engine.shutdown()
    assert answers["health alive"] == 200
    assert answers["health dead"] == answers["ping dead"] == 503  # vLLM's answer for a dead engine
    for name in ("in flight", "after"):  # vLLM's 500, saying what happened and what to do
        response = answers[name]
        assert response.status_code == 500, (name, response.text)
        message = response.json()["error"]["message"]
        assert "engine has stopped" in message and "restart the server" in message, message
        assert "RuntimeError: injected step failure" in message, message
    assert answers["after_s"] < 1.0  # at once, not after a wait
    errors = f'vllm:request_success_total{{finished_reason="error",model_name="{MODEL}"}} 1.0'
    assert errors in answers["metrics"]  # the request in flight


def test_a_dead_tensor_parallel_worker_makes_health_503_while_idle(model_dir):
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    engine = AsyncLLM(model_dir, engine_process=False, tensor_parallel_size=2, **SMALL_ENGINE)
    app = build_app(engine, MODEL)
    try:
        with local_server(app, timeout=TIMEOUT) as served:
            url = served.url
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200  # the engine's loop runs
            (worker,) = engine.engine.world.workers.processes
            os.kill(worker.pid, signal.SIGKILL)
            assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10), \
                "the idle engine did not notice"
            response = httpx.post(f"{url}{C}", json=COMPLETION, timeout=5)
            assert response.status_code == 500
            assert "worker rank 1" in response.json()["error"]["message"], response.text
    finally:
        app.state.preprocessor.close()
        engine.shutdown()


# -- SIGTERM -----------------------------------------------------------------------------------------


def start_server(model_dir: str, tmp_path: Path, shutdown_timeout: float) -> tuple[subprocess.Popen, str, object]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "nanovllm.cli", "serve", model_dir, "--port", str(port), "--device", "cpu",
               "--hf-overrides", json.dumps({"max_position_embeddings": MAX_MODEL_LEN}),
               "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory", str(1 << 26), "--uvicorn-log-level", "warning",
               "--served-model-name", MODEL, "--shutdown-timeout", str(shutdown_timeout)]
    log = (tmp_path / "serve.log").open("w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, "the server exited"
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    assert wait_until(up, 2 * TIMEOUT, poll=0.2), "the server did not start"
    return process, url, log


class Client(threading.Thread):
    """One long request, streamed or not; what came back: the events, or the status and body."""

    def __init__(self, url: str, stream: bool, max_tokens: int = MAX_MODEL_LEN - 8) -> None:
        super().__init__(daemon=True)
        self.url, self.stream, self.max_tokens = url, stream, max_tokens
        self.events: list = []
        self.status, self.body, self.failure = None, None, None
        self.first = threading.Event()

    def run(self) -> None:
        body = {**COMPLETION, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": self.stream}
        try:
            if self.stream:
                with httpx.stream("POST", f"{self.url}{C}", json=body, timeout=TIMEOUT) as response:
                    self.status = response.status_code
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            data = line.removeprefix("data: ")
                            self.events.append(data if data == "[DONE]" else json.loads(data))
                            self.first.set()
            else:
                self.first.set()
                response = httpx.post(f"{self.url}{C}", json=body, timeout=TIMEOUT)
                self.status, self.body = response.status_code, response.json()
        except Exception as exc:  # noqa: BLE001 - a broken connection is what the test must not see
            self.failure = exc
        finally:
            self.first.set()

    def outcome(self) -> str:
        """'complete' (the whole answer), 'error' (an error that says the server shut down), else what it got."""
        assert self.failure is None, f"the connection broke: {self.failure!r}"
        if not self.stream:
            if self.status == 200 and self.body["choices"][0]["finish_reason"] == "length":
                return "complete"
            assert self.status == 503 and "shutting down" in self.body["error"]["message"], self.body
            return "error"
        assert self.events[-1] == "[DONE]", self.events[-1]
        if "error" not in self.events[-2]:
            assert self.events[-2]["choices"][0]["finish_reason"] == "length"
            return "complete"
        error = self.events[-2]["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
        return "error"


@pytest.mark.slow  # a server process of its own to start (seconds)
def test_sigterm_drains_for_the_shutdown_timeout_then_aborts_with_an_error_to_each_client(served):
    drain_limit = 1.0
    process, url, log = served
    try:
        clients = [Client(url, stream) for stream in (True, True, True, False)]
        for client in clients:
            client.start()
        assert all(client.first.wait(TIMEOUT) for client in clients)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # while it drains, a new request is refused with 503
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, drain_limit)
        refused = httpx.post(f"{url}{C}", json=COMPLETION, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        code = process.wait(drain_limit + 5)
        exited = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)
    for client in clients:
        client.join(TIMEOUT)
    outcomes = [client.outcome() for client in clients]
    log.seek(0)
    output = log.read()
    assert code == 0 and exited <= drain_limit + 5 and "Traceback" not in output, output
    assert "error" in outcomes, "every request finished within the drain: the test proves nothing about aborts"


def test_a_second_signal_stops_at_once(model_dir):
    """The server's signal handler called as the main thread's would be: the first starts a long drain (new
    requests get 503, a stream in flight goes on), the second stops the server at once."""
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import DrainingServer, build_app

    engine = AsyncLLM(model_dir, engine_process=False, device="cpu", max_model_len=512, kv_cache_memory=1 << 24)
    app = build_app(engine, MODEL)
    try:
        with local_server(app, DrainingServer, TIMEOUT, drain=app.state.drain, shutdown_timeout=600) as served:
            url, srv, thread = served
            try:
                client = Client(url, stream=True, max_tokens=500)
                client.start()
                assert wait_until(lambda: len(client.events) > 1, TIMEOUT)
                srv.handle_exit(signal.SIGTERM, None)
                assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 5)
                assert httpx.post(f"{url}{C}", json=COMPLETION, timeout=5).status_code == 503
                assert "nanovllm:num_requests_running" in httpx.get(f"{url}/metrics", timeout=5).text  # still scraped
                assert not any("error" in event for event in client.events if isinstance(event, dict)), \
                    "the drain stopped the stream in flight"
                srv.handle_exit(signal.SIGTERM, None)
                signalled = time.monotonic()
                thread.join(10)
                assert not thread.is_alive() and time.monotonic() - signalled < 5
            finally:  # a failed check must not leave the drain waiting on the stream
                srv.force_exit = True
    finally:
        app.state.preprocessor.close()
        engine.shutdown()
