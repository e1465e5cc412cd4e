"""vLLM's step-by-step engine API: ``add_request(request_id, prompt, params)``, ``step() -> RequestOutput``s
as ``output_kind`` asks, ``abort_request`` and ``has_unfinished_requests``; and ``AsyncLLM`` on top."""

from __future__ import annotations

import asyncio

import pytest
from nanovllm import SamplingParams
from nanovllm.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["tok40 tok41 tok42", [5, 6, 7, 8, 9]]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(model):
    from nanovllm import LLM

    return LLM(model, kv_cache_memory=1 << 24, device="cpu", max_model_len=64, block_size=4)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)


def run_all(llm, limit: int = 200) -> list:
    outputs = []
    for _ in range(limit):
        if not llm.has_unfinished_requests():
            return outputs
        outputs += llm.step()
    raise AssertionError("requests did not finish within the step limit")


def assert_clean(llm) -> None:
    bm = llm.scheduler.block_manager
    assert not llm.has_unfinished_requests() and not llm._streams
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cumulative_delta_and_final_only_agree_with_generate(llm, reference, async_scheduling):
    llm.config.async_scheduling = async_scheduling
    try:
        kinds = list(RequestOutputKind)
        for kind in kinds:
            for i, prompt in enumerate(PROMPTS):
                llm.add_request(f"{kind.name}-{i}", prompt, greedy(logprobs=2, output_kind=kind))
        outputs = run_all(llm)
    finally:
        llm.config.async_scheduling = True
    assert_clean(llm)
    for kind in kinds:
        for i, ref in enumerate(reference):
            mine = [o for o in outputs if o.request_id == f"{kind.name}-{i}"]
            assert all(o.prompt_token_ids == ref.prompt_token_ids for o in mine)
            finals = [o for o in mine if o.outputs[0].finish_reason is not None]
            assert len(finals) == 1 and finals[0] is mine[-1] and finals[0].finish_reason == "length"
            if kind == RequestOutputKind.FINAL_ONLY:
                assert len(mine) == 1
            texts = [o.outputs[0].text for o in mine]
            tokens = [o.outputs[0].token_ids for o in mine]
            if kind == RequestOutputKind.DELTA:  # the pieces add up to the whole, each new token once
                assert "".join(texts) == ref.text
                assert [t for piece in tokens for t in piece] == ref.token_ids
                assert all(len(piece) == 1 for piece in tokens)  # one token per step, one output each
                logprobs = [lp for o in mine for lp in o.outputs[0].logprobs]
            else:  # every output is a prefix of the final one
                assert all(ref.text.startswith(t) and ref.token_ids[: len(k)] == k for t, k in zip(texts, tokens))
                assert texts[-1] == ref.text and tokens[-1] == ref.token_ids
                logprobs = mine[-1].outputs[0].logprobs
            if kind == RequestOutputKind.CUMULATIVE:
                assert [len(k) for k in tokens] == list(range(1, len(ref.token_ids) + 1))
            assert [sorted(d) for d in logprobs] == [sorted(d) for d in ref.outputs[0].logprobs]
            assert mine[-1].outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob)


def test_stop_string_is_never_streamed(llm, reference):
    words = reference[0].text.split()
    stop = " ".join(words[2:4])  # spans two tokens, so a partial match is held back between them
    llm.add_request("stop", PROMPTS[0], greedy(stop=[stop], output_kind=RequestOutputKind.DELTA))
    outputs = run_all(llm)
    assert_clean(llm)
    text = "".join(o.outputs[0].text for o in outputs)
    assert text == reference[0].text[: reference[0].text.find(stop)]
    assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].outputs[0].stop_reason == stop
    assert all(stop not in "".join(o.outputs[0].text for o in outputs[: i + 1]) for i in range(len(outputs)))


def test_abort_frees_blocks_at_once_and_others_go_on(llm, reference):
    bm = llm.scheduler.block_manager
    llm.add_request("keep", PROMPTS[0], greedy())
    llm.add_request("drop", PROMPTS[1], greedy(max_tokens=40))
    llm.step()
    llm.step()
    held = len(llm._streams["drop"].first.block_table)
    assert held > 0
    free_before = bm.num_free_blocks
    llm.abort_request("drop")
    assert bm.num_free_blocks == free_before + held
    outputs = run_all(llm)
    assert {o.request_id for o in outputs} <= {"keep"}
    assert outputs[-1].outputs[0].token_ids == reference[0].token_ids
    assert_clean(llm)


def test_bad_requests_fail_at_add_and_leave_the_engine_usable(llm, reference):
    llm.add_request("dup", PROMPTS[0], greedy())
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request("dup", PROMPTS[1], greedy())
    with pytest.raises(TypeError, match="request_id must be a non-empty string"):
        llm.add_request(7, PROMPTS[0], greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request("long", list(range(5, 70)), greedy())
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
    outputs = run_all(llm)
    assert [o.request_id for o in outputs] == ["dup"] * len(reference[0].token_ids)
    assert_clean(llm)
    llm.add_request("dup", PROMPTS[0], greedy())  # a finished request's id is free again
    assert run_all(llm)[-1].outputs[0].token_ids == reference[0].token_ids


def test_async_llm_streams_aborts_and_stays_usable(llm, reference):
    from nanovllm import AsyncLLM

    async def collect(engine, request_id, prompt, params):
        return [o async for o in engine.generate(prompt, params, request_id)]

    async def scenario():
        engine = AsyncLLM.from_engine(llm)
        try:
            delta = greedy(output_kind=RequestOutputKind.DELTA)
            both = await asyncio.wait_for(asyncio.gather(
                collect(engine, "a", PROMPTS[0], delta), collect(engine, "b", PROMPTS[1], greedy())), 60)
            # a consumer that stops early aborts its request
            stream = engine.generate(PROMPTS[1], greedy(max_tokens=40, output_kind=RequestOutputKind.DELTA), "c")
            first = await asyncio.wait_for(anext(stream), 60)
            await stream.aclose()
            with pytest.raises(ValueError, match="max_model_len"):
                await asyncio.wait_for(collect(engine, "bad", list(range(5, 70)), greedy()), 60)
            again = await asyncio.wait_for(collect(engine, "a", PROMPTS[0], greedy()), 60)
            # commands run in order, so c's abort ran before "again" was queued
            busy = await asyncio.wait_for(engine.call(lambda e: e.has_unfinished_requests()), 60)
            return both, first, again, busy
        finally:
            engine.shutdown()

    (a, b), first, again, busy = asyncio.run(scenario())
    assert not busy
    assert "".join(o.outputs[0].text for o in a) == reference[0].text
    # one output a step, or fewer where steps were applied before the consumer ran (merged)
    assert b[-1].outputs[0].token_ids == reference[1].token_ids and 1 <= len(b) <= len(reference[1].token_ids)
    assert all(reference[1].token_ids[: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids for o in b)
    assert first.outputs[0].token_ids and reference[1].token_ids[: len(first.outputs[0].token_ids)] == \
        first.outputs[0].token_ids
    assert again[-1].outputs[0].text == reference[0].text
    assert_clean(llm)


def test_delta_never_streams_the_start_of_a_stop_string(llm, reference):
    """A stop string longer than the text so far holds all of it back (none of it may be streamed)."""
    text = reference[0].outputs[0].text
    stop = text[: len(text.split()[0]) + 5]  # the first word and the start of the next: longer than one token's text
    llm.add_request("held", PROMPTS[0], greedy(stop=[stop], output_kind=RequestOutputKind.DELTA))
    outputs = run_all(llm)
    assert "".join(o.outputs[0].text for o in outputs) == "" and outputs[-1].outputs[0].stop_reason == stop
    assert_clean(llm)
