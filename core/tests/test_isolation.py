"""Request isolation: one request's failure ends only that request.

A request the engine cannot honour is refused at the API (``ValueError``). A step that still fails (a policy,
the model or the sampler raising) ends the requests it is blamed on with finish reason "error" and the error's
text, found by running the failed step's sequences alone; every other request finishes with the tokens it
would have had without the failing one, offline, with the step API, with ``AsyncLLM`` and over HTTP. Nothing
vanishes, no block leaks, and the engine stays usable."""

from __future__ import annotations

import asyncio
import json
import math

import attrs
import pytest
from nanovllm import SamplingParams
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.engine.model_runner import LaunchedStep
from nanovllm.engine.scheduler import SOLO_STEPS, Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HEALTHY = [[5, 6, 7, 8, 9], [10, 11, 12], "tok40 tok41 tok42", [13, 14, 15, 16]]
POISON = 99  # a prompt that starts with this token is the one the injected faults fail
POISONED = [POISON, 20, 21]
LONG = 16  # the decode policy of these tests fails a step with a sequence longer than this (only POISONED_LONG's)
POISONED_LONG = list(range(30, 30 + LONG + 2))


@pytest.fixture(scope="module")
def llm(model):
    from nanovllm import LLM

    return LLM(model, kv_cache_memory=1 << 24, device="cpu", max_model_len=64, block_size=4)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """The healthy requests' greedy tokens, run without a poisoned one."""
    return [o.token_ids for o in llm.generate(HEALTHY, GREEDY, use_tqdm=False)]


def is_poisoned(seq: Sequence) -> bool:
    return seq.token_ids[0] == POISON


@attrs.define
class UnreadableStep(LaunchedStep):
    def result(self):
        raise RuntimeError("injected fault")


def fail_steps(monkeypatch, llm, where: str = "launch", when=lambda seqs: any(map(is_poisoned, seqs))) -> None:
    """Steps whose sequences ``when`` picks fail: as they launch, or as their results are read."""
    runner, launch = llm.runner, llm.runner.launch

    def launch_or_fail(seqs, *rest):
        if when(seqs) and where == "launch":
            raise RuntimeError("injected fault")
        launched = launch(seqs, *rest)
        if when(seqs) and where == "result" and launched is not None:
            launched = UnreadableStep(**{f.name: getattr(launched, f.name) for f in attrs.fields(LaunchedStep)})
        return launched

    monkeypatch.setattr(runner, "launch", launch_or_fail)


def fail_decodes(monkeypatch, llm, longer_than: int = 0) -> None:
    """The decode policy raises in a step with a sequence longer than ``longer_than`` tokens, from inside the
    model's forward pass (after some layers wrote their keys and values)."""
    policy = llm.runner.hooks.decode
    compute = policy.compute_chunked_decode

    def failing(q, ctx):
        if ctx.layer_id == 1 and bool((ctx.meta.context_lens > longer_than).any()):
            raise ValueError("the policy failed")
        return compute(q, ctx)

    monkeypatch.setattr(policy, "compute_chunked_decode", failing)


def assert_blocks_accounted(llm) -> None:
    """Every block's reference count is its number of users among the running sequences, and a block is free
    exactly when nobody uses it."""
    sched, bm = llm.scheduler, llm.scheduler.block_manager
    users: dict[int, int] = {}
    for seq in sched.running:
        for b in seq.block_table:
            users[b] = users.get(b, 0) + 1
    assert all(not s.block_table for s in sched.waiting)
    for b, ref_count in enumerate(bm.ref_counts.tolist()):
        assert ref_count == users.get(b, 0)
        assert (b in bm.free_blocks) == (ref_count == 0)


def assert_idle(llm) -> None:
    bm = llm.scheduler.block_manager
    assert not llm.has_unfinished_requests() and not llm._streams and not llm.scheduler.suspects
    assert bm.num_free_blocks == bm.num_usable_blocks


def run_step_api(llm, prompts: dict[str, object], params=GREEDY) -> dict[str, list]:
    outputs: dict[str, list] = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        llm.add_request(request_id, prompt, params)
    for _ in range(400):
        if not llm.has_unfinished_requests():
            return outputs
        for out in llm.step():
            outputs[out.request_id].append(out)
        assert_blocks_accounted(llm)
    raise AssertionError("requests did not finish within the step limit")


# -- refused at the API ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_tokens=4, min_tokens=2, stop_token_ids=[10000000]),
         "token_id(s) [10000000] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 256"),
        (dict(stop_token_ids=[3, 256]), "[256] in stop_token_ids"),
        (dict(allowed_token_ids=[5, 300]), "[300] in allowed_token_ids"),
        (dict(logit_bias={256: 1.0}), "[256] in logit_bias"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(llm, reference, kw, words):
    bad = SamplingParams(**kw)
    before = llm._next_request
    with pytest.raises(ValueError) as info:
        llm.generate(HEALTHY + [[5, 6]], [GREEDY] * len(HEALTHY) + [bad], use_tqdm=False)
    assert words in str(info.value) and f"request {len(HEALTHY)}" in str(info.value)
    with pytest.raises(ValueError, match="out-of-vocab"):
        llm.add_request("bad", [5, 6], bad)
    assert llm._next_request == before and not llm.has_unfinished_requests()
    assert [o.token_ids for o in llm.generate(HEALTHY, GREEDY, use_tqdm=False)] == reference


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 10**400])
def test_floats_must_be_finite(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(field) and "finite" in message and "got" in message


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan])
def test_logit_bias_values_must_be_finite(bias):
    with pytest.raises(ValueError, match="logit_bias maps token ids .* to finite numbers"):
        SamplingParams(logit_bias={5: bias})
    assert SamplingParams(logit_bias={5: 1e9}).logit_bias == {5: 100.0}  # finite: clamped, as vLLM does


def test_the_context_length_check_has_vllms_words():
    inputs = InputProcessor(None, vocab_size=256, max_model_len=64, max_logprobs=20)
    inputs.check_context_length(60, 4)  # exactly the context: fits
    inputs.check_context_length(63, None)  # up to the limit: always fits
    with pytest.raises(ValueError) as info:
        inputs.check_context_length(60, 5)
    assert str(info.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens (60 in the messages, "
        "5 in the completion). Please reduce the length of the messages or completion."
    )


def test_offline_a_completion_past_the_context_stops_with_length(llm):
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


# -- the scheduler: suspects run alone --------------------------------------------------------------------


def test_suspects_run_alone_one_at_a_time_and_waiting_requests_stay():
    from nanovllm.config import EngineConfig

    sched = Scheduler(EngineConfig(block_size=4), num_blocks=16)
    seqs = [Sequence(list(range(10 + i, 16 + i)), GREEDY) for i in range(3)]
    waiting = Sequence([40, 41, 42], GREEDY)
    for seq in seqs:
        sched.add(seq)
    assert sched.schedule() == seqs
    sched.advance(seqs)
    for seq in seqs:
        seq.token_ids.append(PLACEHOLDER)  # sampled by the step, not read back
    sched.add(waiting)
    sched.isolate([seqs[2], seqs[0]])
    assert sched.suspects == [seqs[0], seqs[2]] and seqs[1] in sched.running
    assert all(PLACEHOLDER not in s.token_ids and not s.block_table for s in sched.suspects)
    assert list(sched.waiting) == [seqs[0], seqs[2], waiting]
    for suspect in (seqs[0], seqs[2]):
        for solo in range(SOLO_STEPS):
            assert sched.schedule() == [suspect]  # alone: no other running or waiting sequence
            sched.advance([suspect])
            suspect.token_ids.append(7)
            sched.passed(suspect)
        assert suspect not in sched.suspects
    assert waiting in sched.waiting and not waiting.block_table
    assert set(sched.schedule()) == {*seqs, waiting}  # everyone together again


def test_a_suspect_takes_the_blocks_of_running_sequences_when_it_needs_them():
    from nanovllm.config import EngineConfig

    sched = Scheduler(EngineConfig(block_size=4), num_blocks=6)
    first, second = Sequence(list(range(10, 22)), GREEDY), Sequence(list(range(30, 42)), GREEDY)
    sched.add(first)
    sched.add(second)
    assert sched.schedule() == [first, second]  # 3 blocks each: the cache is full
    sched.advance([first, second])
    first.token_ids.append(7)
    sched.isolate([first])
    assert sched.schedule() == [first] and not second.block_table and second in sched.waiting
    assert sched.block_manager.num_free_blocks == 2


def test_a_suspect_keeps_within_max_num_seqs():
    from nanovllm.config import EngineConfig

    sched = Scheduler(EngineConfig(block_size=4, max_num_seqs=2), num_blocks=16)
    seqs = [Sequence(list(range(10 + 8 * i, 14 + 8 * i)), GREEDY) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    sched.advance(sched.schedule())
    assert sched.running == seqs[:2]
    sched.isolate([seqs[2]])  # a waiting suspect, with max_num_seqs running: one makes room
    assert sched.schedule() == [seqs[2]] and sched.running == [seqs[0], seqs[2]] and seqs[1] in sched.waiting


# -- a step that fails: offline, the step API, AsyncLLM ---------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("where", ["launch", "result"])
def test_a_poisoned_request_fails_alone_and_the_others_finish(llm, reference, monkeypatch, async_scheduling, where):
    monkeypatch.setattr(llm.config, "async_scheduling", async_scheduling)
    fail_steps(monkeypatch, llm, where)
    prompts = {f"healthy-{i}": p for i, p in enumerate(HEALTHY[:2])}
    prompts["poisoned"] = POISONED
    prompts.update({f"healthy-{i}": p for i, p in enumerate(HEALTHY[2:], start=2)})
    outputs = run_step_api(llm, prompts)
    for i, ref in enumerate(reference):
        finals = [o for o in outputs[f"healthy-{i}"] if o.finished]
        assert len(finals) == 1 and finals[0] is outputs[f"healthy-{i}"][-1]
        assert finals[0].token_ids == ref and finals[0].finish_reason == "length"
    last = outputs["poisoned"][-1]  # every step with it fails: it ends with no token, and the error
    assert last.finished and last.finish_reason == "error" and last.token_ids == []
    assert last.outputs[0].error == "RuntimeError: injected fault"
    assert_idle(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(HEALTHY, GREEDY, use_tqdm=False)] == reference


def test_a_failed_request_with_prompt_logprobs_reports_what_was_computed(llm, monkeypatch):
    fail_steps(monkeypatch, llm)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    [out] = llm.generate([POISONED], params, use_tqdm=False)
    assert out.finished and out.finish_reason == "error"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(POISONED)
    assert all(entry is None or isinstance(entry, dict) for entry in out.prompt_logprobs)
    assert_idle(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["launch", "result"])
def test_on_the_gpu_a_poisoned_request_fails_alone(model, monkeypatch, where):
    """As above on CUDA, with decode graphs and async scheduling: the step before the failed one is read from
    its pinned copies, and the placeholders of a step never read back are dropped."""
    from nanovllm import LLM

    llm = LLM(model, kv_cache_memory=1 << 26, device="cuda", dtype="float32", max_model_len=64, block_size=4)
    reference = [o.token_ids for o in llm.generate(HEALTHY, GREEDY, use_tqdm=False)]
    fail_steps(monkeypatch, llm, where)
    outputs = llm.generate([*HEALTHY, POISONED], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs[:-1]] == reference
    assert outputs[-1].finish_reason == "error" and outputs[-1].outputs[0].error == "RuntimeError: injected fault"
    assert_idle(llm)


def test_a_policy_that_fails_one_requests_decodes_offline(llm, reference, monkeypatch):
    """The policy raises mid-forward, after earlier layers wrote this step's keys and values."""
    fail_decodes(monkeypatch, llm, longer_than=LONG)
    outputs = llm.generate([*HEALTHY, POISONED_LONG], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs[:-1]] == reference
    assert all(o.finish_reason == "length" for o in outputs[:-1])
    poisoned = outputs[-1]  # its prefill, and its recompute's alone, passed: two tokens, then the error
    assert poisoned.finish_reason == "error" and len(poisoned.token_ids) == 2
    assert poisoned.outputs[0].error == "ValueError: the policy failed"
    assert_idle(llm)


def test_a_policy_that_fails_every_decode_ends_every_request_with_an_error(llm, reference, monkeypatch):
    fail_decodes(monkeypatch, llm)
    outputs = run_step_api(llm, {f"r{i}": p for i, p in enumerate(HEALTHY)})
    for i, ref in enumerate(reference):  # only prefills pass (one in the batch, one alone; a prefix-cache hit
        last = outputs[f"r{i}"][-1]  # leaves a one-token prompt chunk, which runs as a decode)
        assert last.finished and last.finish_reason == "error"
        assert len(last.token_ids) <= 2 and last.token_ids == ref[: len(last.token_ids)]
        assert last.outputs[0].error == "ValueError: the policy failed"
    assert_idle(llm)
    one = llm.generate(HEALTHY[0], GREEDY, use_tqdm=False)[0]  # usable: the next request fails on its own
    assert one.finish_reason == "error" and len(one.token_ids) <= 2
    assert one.token_ids == reference[0][: len(one.token_ids)]
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(HEALTHY, GREEDY, use_tqdm=False)] == reference
    assert_idle(llm)


def test_a_failing_stop_check_ends_only_its_request(llm, reference, monkeypatch):
    stop_reason = llm._stop_reason

    def failing(seq, token):
        if is_poisoned(seq):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return stop_reason(seq, token)

    monkeypatch.setattr(llm.llm_engine, "_stop_reason", failing)
    outputs = llm.generate([*HEALTHY, POISONED], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs[:-1]] == reference
    assert outputs[-1].finish_reason == "error" and len(outputs[-1].token_ids) == 1
    assert outputs[-1].outputs[0].error.startswith("UnicodeDecodeError")
    assert_idle(llm)


def test_async_llm_ends_only_the_poisoned_stream(llm, reference, monkeypatch):
    from nanovllm import AsyncLLM

    fail_steps(monkeypatch, llm)
    engine = AsyncLLM.from_engine(llm)

    async def collect(prompt, request_id):
        return [out async for out in engine.generate(prompt, GREEDY, request_id)]

    async def scenario():
        bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10000000])
        with pytest.raises(ValueError, match=r"\[10000000\] in stop_token_ids contain out-of-vocab"):
            engine.submit([5, 6], bad)  # refused at the API, before it reaches the engine
        prompts = [*HEALTHY[:2], POISONED, *HEALTHY[2:]]
        return await asyncio.wait_for(asyncio.gather(*(collect(p, f"r{i}") for i, p in enumerate(prompts))), 60)

    try:
        results = asyncio.run(scenario())
    finally:
        engine.shutdown()
    poisoned = results.pop(2)
    assert [outs[-1].token_ids for outs in results] == reference
    assert all(outs[-1].finish_reason == "length" for outs in results)
    assert poisoned[-1].finished and poisoned[-1].finish_reason == "error"
    assert poisoned[-1].outputs[0].error == "RuntimeError: injected fault"
    assert_idle(llm)


# -- over HTTP ----------------------------------------------------------------------------------------------


def test_over_http_a_poisoned_request_ends_only_its_own_stream(model, monkeypatch):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from nanovllm import LLM, AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app
    from nanovllm.testing import local_server

    llm = LLM(model, kv_cache_memory=1 << 24, device="cpu", max_model_len=64, block_size=4)
    prompts = [p for p in HEALTHY if isinstance(p, list)]
    expected = [o.text for o in llm.generate(prompts, GREEDY, use_tqdm=False)]  # offline, without the poisoned
    fail_steps(monkeypatch, llm)
    engine = AsyncLLM.from_engine(llm)

    async def stream(client, url, prompt) -> list:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]

    async def clients(url):
        async with httpx.AsyncClient(timeout=60) as client:
            events = await asyncio.gather(*(stream(client, url, p) for p in [*prompts[:1], POISONED, *prompts[1:]]))
            body = {"model": "tiny", "prompt": POISONED, "max_tokens": 8}
            return events, await client.post(url, json=body)

    try:
        with local_server(build_app(engine, "tiny")) as served:
            events, unstreamed = asyncio.run(clients(f"{served.url}/v1/completions"))
    finally:
        engine.shutdown()
    poisoned = events.pop(1)
    for healthy, text in zip(events, expected, strict=True):  # every healthy client: its whole text, then [DONE]
        assert healthy[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in healthy[:-1]]
        assert "".join(c["text"] for c in chunks) == text
        assert chunks[-1]["finish_reason"] == "length"
    assert poisoned[-1] == "[DONE]"  # its own stream: an error event, then [DONE]
    error = json.loads(poisoned[-2])["error"]
    assert error["code"] == 500 and error["message"] == "RuntimeError: injected fault"
    assert unstreamed.status_code == 500 and unstreamed.json()["error"]["message"] == "RuntimeError: injected fault"
    assert_idle(llm)
