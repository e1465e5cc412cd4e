"""The OpenAI-compatible server, through the real ``openai`` client, against one live server on 127.0.0.1
(a free port) with the built-in model on the CPU, its engine in a process of its own (AsyncLLM's default).
Every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import attrs
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
import httpx  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.testing import local_server, wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
TIMEOUT = 60


@pytest.fixture(scope="module")
def llm(one_thread):
    from nanovllm import LLM

    return LLM(max_model_len=256, device="cpu", kv_cache_memory=1 << 26)


@pytest.fixture(scope="module")
def reference(llm):
    """Offline greedy completions of the same engine, taken before the server owns it."""
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def server(llm, reference):
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    engine = AsyncLLM(max_model_len=256, device="cpu", kv_cache_memory=1 << 26)  # the same engine as llm's
    try:
        with local_server(build_app(engine, MODEL), timeout=TIMEOUT) as served:
            yield served.url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", timeout=TIMEOUT).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def wait_idle(server) -> None:
    """Every request gone and every block back (as the engine's latest step reports), within the timeout."""
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    assert wait_until(lambda: not any(metrics(server)[f"nanovllm:{name}"] for name in names), TIMEOUT), \
        "requests or blocks were left behind"


def greedy(**kw):
    return {"model": MODEL, "temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}, **kw}


def test_models_health_tokenize(client, server, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).status_code == 200
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}, timeout=TIMEOUT).json()
    assert tokens["tokens"] == llm.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}, timeout=TIMEOUT).json()
    assert text["prompt"] == PROMPT
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      timeout=TIMEOUT).json()
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert chat["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_completion_matches_offline_and_streams_the_same(client, reference, server):
    done = client.completions.create(prompt=PROMPT, **greedy())
    assert done.choices[0].text == reference.text and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == len(reference.prompt_token_ids)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                            **greedy()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    two = client.completions.create(prompt=[reference.prompt_token_ids, reference.prompt_token_ids], **greedy())
    assert [c.index for c in two.choices] == [0, 1] and {c.text for c in two.choices} == {reference.text}
    wait_idle(server)


def test_streamed_events_are_json_dumps_of_each_chunk_for_one_prompt_or_several(server, reference):
    """Each event is ``json.dumps`` of its chunk (the head's part is encoded once per stream); one prompt is
    read straight from its request, several merged as they come."""
    for prompts in (PROMPT, [PROMPT, PROMPT]):
        body = {"model": MODEL, "prompt": prompts, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as response:
            lines = [line for line in response.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert [f"data: {json.dumps(event)}" for event in events] == lines[:-1]
        texts: dict[int, str] = {}
        for event in events[:-1]:
            (choice,) = event["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == dict.fromkeys(range(1 if isinstance(prompts, str) else 2), reference.text)
        assert events[-1]["usage"]["completion_tokens"] == 12 * len(texts)
    wait_idle(server)


def test_chat_streaming_and_not_agree(client, server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    done = client.chat.completions.create(messages=messages, **greedy())
    message = done.choices[0].message
    assert message.role == "assistant" and message.content and done.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_idle(server)


def test_chat_renders_as_llm_chat_does_tools_included(client, server, llm):
    """The server's chat prompt is LLM.chat's rendering (nanovllm.chat_utils), with tools and template kwargs."""
    from nanovllm.chat_utils import ChatOptions, render

    messages = [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    done = client.chat.completions.create(messages=messages, tools=tools, **greedy(max_tokens=2))
    (text,) = render(llm.get_tokenizer(), [messages], ChatOptions(tools=tools))
    assert done.usage.prompt_tokens == len(llm.get_tokenizer().encode(text, add_special_tokens=False))
    wait_idle(server)
    # SmolLM2's template ignores tools: a template that shows them proves they reach it
    import copy

    from nanovllm.entrypoints.openai_server import render_chat

    tokenizer = copy.deepcopy(llm.get_tokenizer())
    tokenizer.chat_template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    ids = render_chat(tokenizer, messages, False, tools=tools)
    assert tokenizer.decode(ids) == "[weather]What is the weather in Paris?"


def test_n_gives_n_choices_or_a_clear_error(client):
    if "n" in {f.name for f in attrs.fields(SamplingParams)}:
        out = client.completions.create(prompt=PROMPT, n=3, seed=1, **greedy(temperature=1.0))
        assert sorted(c.index for c in out.choices) == [0, 1, 2]
    else:
        with pytest.raises(openai.BadRequestError, match="'n'"):
            client.completions.create(prompt=PROMPT, n=3, **greedy())


def test_stop_string_ends_the_text(client, reference):
    stop = reference.text[4:8]
    for stream in (False, True):
        out = client.completions.create(prompt=PROMPT, stop=[stop], stream=stream, **greedy())
        choices = [c.choices[0] for c in out if c.choices] if stream else out.choices
        text = "".join(c.text for c in choices)
        assert text == reference.text[: reference.text.find(stop)] and choices[-1].finish_reason == "stop"


def test_logprobs(client, reference):
    out = client.completions.create(prompt=PROMPT, logprobs=2, **greedy())
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == reference.text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-5
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=3, **greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert chat.choices[0].message.content.startswith(content[0].token + content[1].token)


def test_32_concurrent_streams_all_answered(server):
    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(prompt=f"Count to {i}:", stream=True, **greedy(max_tokens=4))
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", timeout=TIMEOUT,
                                      max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 3 * TIMEOUT)

    results = asyncio.run(main())
    assert len(results) == 32 and all(text and finish == "length" for text, finish in results)
    wait_idle(server)


def test_disconnect_mid_stream_aborts_and_leaks_no_block(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
        assert metrics(server)["nanovllm:num_requests_running"] == 1
    wait_idle(server)  # long before 200 tokens could have been generated


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_disconnect_while_waiting_for_a_whole_answer_aborts_and_leaks_no_block(server, endpoint):
    """Not streaming: nothing is sent before the end, yet a client that leaves aborts its request at once (it
    never finishes, so no request latency is recorded) and its blocks come back."""
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True,
            **({"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})}
    finished_before = metrics(server)["nanovllm:e2e_request_latency_seconds_count"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{server}/v1/{endpoint}", json=body, timeout=httpx.Timeout(TIMEOUT, read=1.0))
    wait_idle(server)
    assert metrics(server)["nanovllm:e2e_request_latency_seconds_count"] == finished_before, \
        "the request ran to its end: the server did not notice the client leave"


def test_bad_requests_get_openai_shaped_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="'frobnicate'"):
        client.completions.create(prompt=PROMPT, **greedy(extra_body={"frobnicate": 1}))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(prompt=PROMPT, **greedy(temperature=-1))
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        client.completions.create(prompt="word " * 400, **greedy())
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], **greedy())
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(prompt=PROMPT, echo=True, **greedy())
    response = httpx.get(f"{server}/v1/nothing-here", timeout=TIMEOUT)
    assert response.status_code == 404 and response.json()["error"]["code"] == 404
    wait_idle(server)
    assert client.completions.create(prompt=PROMPT, **greedy(max_tokens=2)).usage.completion_tokens == 2


def test_a_10_mb_text_is_refused_by_its_length_before_tokenizing(server):
    """SmolLM2's byte-level BPE bounds the characters a token covers, so 10 MB cannot fit 256 tokens: the 400
    says so by the character count, for a prompt and for a conversation, without tokenizing it."""
    text = "word " * (2 << 20)
    for path, body in (("completions", {"prompt": text}), ("chat/completions", {"messages": [{"role": "user",
                                                                                             "content": text}]})):
        response = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=TIMEOUT)
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and "maximum context length is 256 tokens" in message
        assert "characters has at least" in message, message  # refused by its length, not its tokens
    wait_idle(server)


@pytest.mark.parametrize("stream", [False, True])
def test_metrics(server, client, stream):
    """Gauges back to zero; each finished request's times as the engine took them, whether its answer came
    whole (one output at the end) or streamed: its first token long before its end."""
    names = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds")
    before = metrics(server)
    out = client.completions.create(prompt=PROMPT, stream=stream, **greedy(max_tokens=12))
    if stream:
        list(out)
    values = metrics(server)
    assert values["nanovllm:num_requests_running"] == 0 and values["nanovllm:num_requests_waiting"] == 0
    assert values["nanovllm:kv_cache_usage_perc"] == 0
    assert values["nanovllm:generation_tokens_total"] - before.get("nanovllm:generation_tokens_total", 0) == 12
    assert values["nanovllm:request_output_tokens_per_second_count"] >= 1
    counts, sums = ({name: values[f"nanovllm:{name}_{part}"] - before.get(f"nanovllm:{name}_{part}", 0)
                     for name in names} for part in ("count", "sum"))
    assert set(counts.values()) == {1}, counts
    ttft, tpot, e2e = (sums[name] for name in names)
    assert 0 < ttft < e2e and 0 < tpot and ttft + 11 * tpot == pytest.approx(e2e, rel=0.2, abs=0.05)


def test_api_key(llm):
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    app = build_app(AsyncLLM.from_engine(llm), MODEL, api_key="sesame")  # /v1/models never starts its engine

    async def models(key):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)
            return [m.id async for m in client.models.list()]

    assert asyncio.run(models("sesame")) == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(models("wrong"))


def test_bench_serve_measures_every_request(server):
    from nanovllm.bench.serve import markdown, run_rate

    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10]]
    for rate, stream in ((float("inf"), True), (50.0, True), (float("inf"), False)):
        r = asyncio.run(asyncio.wait_for(run_rate(server, MODEL, prompts, [3, 3, 3, 3], rate, 0, TIMEOUT, stream),
                                         3 * TIMEOUT))
        assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] == 12
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] <= r["p99_e2e_ms"]
        assert r["mean_tpot_ms"] > 0 if stream else r["p50_ttft_ms"] == r["p50_e2e_ms"]
        if rate == 50.0:
            at_fifty = r
    env = {"device": "cpu", "date": "today", "commit": "x", "torch": "t"}
    settings = {"base_url": server, "model": MODEL, "num_prompts": 4}
    assert "| 50.0 | 4/4 |" in markdown({"environment": env, "settings": settings, "results": [at_fifty]}, "serve")


@pytest.mark.slow
def test_the_nanovllm_serve_command_answers_and_exits_cleanly(tmp_path):
    """The real command in a process of its own: up, one completion, then SIGTERM stops it and its engine's process."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "nanovllm.cli", "serve", "--port", str(port), "--device", "cpu",
               "--max-model-len", "256", "--kv-cache-memory", str(1 << 26), "--uvicorn-log-level", "warning"]
    log = (tmp_path / "serve.log").open("w+")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 4 * TIMEOUT
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens <= 4
        engine_processes = psutil.Process(server.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(p.cmdline()) for p in engine_processes)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(TIMEOUT)
    log.seek(0)
    output = log.read()
    assert code == 0 and "Traceback" not in output, output

    def lingers(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    # a child may still be exiting when the server has (seen here: no command line, gone a moment later)
    assert wait_until(lambda: not any(lingers(p) for p in engine_processes), TIMEOUT), \
        [p.cmdline() for p in engine_processes if lingers(p)]


def test_prompt_forms_read_as_pydantics_smart_union_reads_them():
    """The completion prompt's ordered union (token ids first, for speed) takes each form as the smart union
    of every form did, and refuses what it refused."""
    from pydantic import BaseModel, ValidationError

    from nanovllm.entrypoints.openai_server import CompletionRequest

    class Smart(BaseModel):
        prompt: str | list[str] | list[int] | list[list[int]]

    def read(model, prompt):
        try:
            value = model.model_validate({"prompt": prompt}).prompt
            return value, [type(x) for x in value] if isinstance(value, list) else type(value)
        except ValidationError:
            return "refused"

    prompts = ["text", "", ["one", "two"], ["1", "2"], [1, 2, 3], [], [[1, 2], [3]], [1.0, 2.0], [True, 2],
               ["a", 1], [1, "a"], [[1, "a"]], [1.5], 3, {"prompt": "x"}, None, [[]], [["a"]]]
    for prompt in prompts:
        assert read(CompletionRequest, prompt) == read(Smart, prompt), prompt
    assert read(CompletionRequest, [1, 2, 3]) == ([1, 2, 3], [int] * 3)
    assert read(CompletionRequest, ["1", "2"]) == (["1", "2"], [str] * 2)


@pytest.mark.parametrize("prompt", [[1, "a"], [[1, "a"]], {"prompt": "x"}, [1.5], None])
def test_a_prompt_of_no_form_is_an_openai_shaped_400(llm, prompt):
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    app = build_app(AsyncLLM.from_engine(llm), MODEL)  # refused before the engine is started

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            return await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})

    response = asyncio.run(post())
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert "prompt" in error["message"]
