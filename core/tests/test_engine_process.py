"""``AsyncLLM`` with its engine in a process of its own (the default): the same outputs as the engine on a
thread and as the step API (tokens, text, logprobs, finish and stop reasons, ``n``, stop strings, every
``output_kind``); bad requests raise in the front-end as ``LLM`` raises them; aborts free blocks; a failed step
or add fails only its requests; the child ends on ``shutdown()``, on garbage collection, and a killed child
fails what is pending with a clear error. Every wait is bounded."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import attrs
import pytest
from merged_outputs import merged_like
from nanovllm import LLM, AsyncLLM, SamplingParams
from nanovllm.outputs import RequestOutput
from nanovllm.plugins import get_plugins
from nanovllm.sampling_params import RequestOutputKind
from nanovllm.testing import wait_until

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(kv_cache_memory=1 << 24, device="cpu", max_model_len=64, block_size=4)
TIMEOUT = 60


@pytest.fixture(scope="module")
def model(tiny_model):
    if "LlamaForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-llama plugin")
    return tiny_model(initializer_range=0.3)  # varied tokens (the default repeats one)


@pytest.fixture(scope="module")
def engine(model):
    llm = AsyncLLM(model, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def run():
    """Runs a coroutine on the event loop of this module's tests (an AsyncLLM serves one loop), bounded."""
    loop = asyncio.new_event_loop()
    yield lambda coroutine: loop.run_until_complete(asyncio.wait_for(coroutine, TIMEOUT))
    loop.close()


def requests(model) -> dict[str, tuple]:
    """Request id -> (prompt, params): every output kind, logprobs, n > 1 seeded, a stop string, a stop token."""
    with LLM(model, **ENGINE) as llm:  # where the stop string and token of the text come from
        text = llm.generate("tok11 tok12", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    stop_word, stop_token = text.outputs[0].text.split()[3], text.outputs[0].token_ids[5]
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    made = {}
    for kind in RequestOutputKind:
        made[f"logprobs-{kind.name}"] = ("tok21 tok22 tok23", SamplingParams(**greedy, logprobs=2, prompt_logprobs=1,
                                                                              output_kind=kind))
        made[f"n-{kind.name}"] = ([31, 32, 33, 34, 35], SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6,
                                                                       output_kind=kind))
        made[f"stop-{kind.name}"] = ("tok11 tok12", SamplingParams(**greedy, stop=[stop_word], output_kind=kind))
    made["stop-token"] = ("tok11 tok12", SamplingParams(**greedy, stop_token_ids=[stop_token]))
    made["stop-kept"] = ("tok11 tok12", SamplingParams(**greedy, stop=stop_word, include_stop_str_in_output=True,
                                                       output_kind=RequestOutputKind.DELTA))
    return made


def comparable(outputs: list) -> tuple[list, list[float]]:
    """The outputs without their wall-clock times and logprob values, and those values apart: they differ in
    the last bits with the batch each step happened to run in."""
    values: list[float] = []

    def entries(positions):
        if positions is None:
            return None
        out = []
        for entry in positions:
            if entry is not None:
                values.extend(lp.logprob for lp in entry.values())
                entry = {t: attrs.evolve(lp, logprob=0.0) for t, lp in entry.items()}
            out.append(entry)
        return out

    def completion(c):
        values.append(c.cumulative_logprob or 0.0)
        return attrs.evolve(c, cumulative_logprob=None, logprobs=entries(c.logprobs))

    structure = [attrs.evolve(out, metrics=None, prompt_logprobs=entries(out.prompt_logprobs),
                              outputs=[completion(c) for c in out.outputs]) for out in outputs]
    return structure, values


def assert_same(outputs: list, expected: list, request_id: str) -> None:
    (structure, values), (expected_structure, expected_values) = comparable(outputs), comparable(expected)
    assert structure == expected_structure, request_id
    assert values == pytest.approx(expected_values, rel=1e-4, abs=1e-4), request_id


def step_api_outputs(model, made: dict[str, tuple]) -> dict[str, list]:
    outputs: dict[str, list] = {request_id: [] for request_id in made}
    with LLM(model, **ENGINE) as llm:
        for request_id, (prompt, params) in made.items():
            llm.add_request(request_id, prompt, params)
        while llm.has_unfinished_requests():
            for out in llm.step():
                outputs[out.request_id].append(out)
    return outputs


async def collect(llm: AsyncLLM, made: dict[str, tuple]) -> dict[str, list]:
    async def one(request_id, prompt, params):
        return [out async for out in llm.generate(prompt, params, request_id)]

    results = await asyncio.wait_for(asyncio.gather(*(one(r, *args) for r, args in made.items())), TIMEOUT)
    return dict(zip(made, results, strict=True))


def test_the_engine_process_gives_the_thread_engines_and_the_step_apis_outputs(model, engine, run):
    made = requests(model)
    with LLM(model, **ENGINE) as llm:
        thread = AsyncLLM.from_engine(llm)
        on_thread = asyncio.run(collect(thread, made))
        thread.shutdown()
    in_process = run(collect(engine, made))
    step_api = step_api_outputs(model, made)
    for request_id, (_, params) in made.items():  # steps the front-end applied before a consumer ran: one output
        for outputs in (in_process[request_id], on_thread[request_id]):
            assert_same(outputs, merged_like(outputs, step_api[request_id], params.output_kind), request_id)
    # the requests did what they ask for
    final = {request_id: outs[-1] for request_id, outs in step_api.items()}
    assert all(out.finished and out.metrics.finished_time for out in final.values())
    assert {c.finish_reason for c in final["stop-CUMULATIVE"].outputs} == {"stop"}
    assert isinstance(final["stop-CUMULATIVE"].outputs[0].stop_reason, str)
    assert final["stop-token"].outputs[0].stop_reason == final["stop-token"].outputs[0].token_ids[-1]
    assert len(final["n-FINAL_ONLY"].outputs) == 3 and len(step_api["n-FINAL_ONLY"]) == 1
    assert final["logprobs-CUMULATIVE"].prompt_logprobs[0] is None and final["logprobs-CUMULATIVE"].prompt_logprobs[1]
    assert len(final["logprobs-CUMULATIVE"].outputs[0].logprobs) == 8
    kept = "".join(out.outputs[0].text for out in step_api["stop-kept"])
    assert kept.endswith(final["stop-kept"].outputs[0].stop_reason)


def test_bad_requests_raise_in_the_front_end_as_llm_raises_them(model, engine, run):
    async def first(prompt, params=None, request_id=None):
        return await anext(engine.generate(prompt, params, request_id))

    with LLM(model, **ENGINE) as llm:
        for prompt, params in ((list(range(5, 70)), None), ("", None), ([1, 10**6], None),
                               ([5, 6], SamplingParams(logprobs=10**6)),
                               ([5, 6], SamplingParams(logit_bias={10**6: 1.0})),
                               ({"prompt": "tok5", "multi_modal_data": {}}, None)):
            with pytest.raises(ValueError) as offline:
                llm.generate(prompt, params, use_tqdm=False)
            with pytest.raises(ValueError) as served:
                run(first(prompt, params))
            assert str(served.value) == str(offline.value)
    with pytest.raises(TypeError, match="request_id must be a non-empty string"):
        run(first([5, 6], None, 7))
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        run(first([5, 6], {"max_tokens": 2}))


def has_no_request_and_no_block(engine) -> bool:
    blocks = engine.scheduler.block_manager
    return not engine.has_unfinished_requests() and blocks.num_free_blocks == blocks.num_usable_blocks


def test_abort_frees_blocks_and_ends_the_generator(engine, run):
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def scenario():
        closed = engine.generate([5, 6, 7, 8, 9], long, "closed")
        await anext(closed)
        await closed.aclose()  # a consumer that leaves aborts its request
        aborted = engine.generate([9, 8, 7, 6, 5], long, "aborted")
        first = await anext(aborted)
        await engine.abort("aborted")
        rest = [out async for out in aborted]
        return first, rest, await engine.call(has_no_request_and_no_block), engine.stats

    first, rest, idle, stats = run(scenario())
    # a delta holds every token made since the last read: on a loaded machine the first may hold several
    assert 1 <= len(first.outputs[0].token_ids) < 40 and rest == []
    assert idle and stats.num_running == 0 and stats.kv_cache_usage == 0


def fail_the_steps_of_poisoned(engine) -> None:
    """From now on, a step with a sequence of request "poisoned" fails."""
    launch = engine.runner.launch

    def launch_or_fail(seqs, *rest):
        if any(s.request_id == "poisoned" for s in seqs):
            raise RuntimeError("injected step failure")
        return launch(seqs, *rest)

    engine.runner.launch = launch_or_fail


def mend_the_steps(engine) -> None:
    del engine.runner.launch


def refuse_requests(engine) -> None:
    def refused(*args):
        raise RuntimeError("injected add failure")

    engine.enqueue = refused


def accept_requests(engine) -> None:
    del engine.enqueue


def test_a_failed_step_or_add_fails_its_requests_and_the_engine_goes_on(engine, run):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def outputs(prompt, request_id):
        return [out async for out in engine.generate(prompt, params, request_id)]

    async def scenario():
        await engine.call(fail_the_steps_of_poisoned)
        healthy, poisoned = await asyncio.gather(outputs([5, 6, 7], "healthy"), outputs([8, 9], "poisoned"))
        await engine.call(mend_the_steps)
        await engine.call(refuse_requests)
        with pytest.raises(RuntimeError, match="could not queue request 'refused'.*injected add failure"):
            await outputs([5, 6, 7], "refused")
        await engine.call(accept_requests)
        with pytest.raises(TypeError, match="must be picklable"):
            await engine.call(lambda e: e.has_unfinished_requests())
        alone = await outputs([5, 6, 7], "alone")
        return healthy, poisoned, alone, await engine.call(has_no_request_and_no_block)

    healthy, poisoned, alone, idle = run(scenario())
    assert healthy[-1].finish_reason == "length" and healthy[-1].token_ids == alone[-1].token_ids
    assert len(alone[-1].token_ids) == 4 and idle
    last = poisoned[-1]  # the failed request ends like any other: a finished output, the error in it
    assert last.finished and last.finish_reason == "error" and last.token_ids == []
    assert last.outputs[0].error == "RuntimeError: injected step failure"


def record_what_each_step_sees(engine) -> None:
    """From now on, each step notes how many requests wait as it is planned."""
    schedule, engine.waiting_per_step = engine.scheduler.schedule, []

    def recording():
        engine.waiting_per_step.append(len(engine.scheduler.waiting))
        return schedule()

    engine.scheduler.schedule = recording


def what_each_step_saw(engine) -> list[int]:
    del engine.scheduler.schedule
    return engine.waiting_per_step


def test_a_burst_of_requests_reaches_the_scheduler_together(engine, run):
    """Requests started together (as a burst's HTTP handlers start in one turn of the event loop) reach the
    engine as one message, so the first step is planned with all of them, not with the first to arrive."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    burst = 48

    async def scenario():
        await engine.call(record_what_each_step_sees)

        async def one(i: int) -> RequestOutput:
            return [out async for out in engine.generate([5 + i % 9, 6, 7], params)][-1]

        outputs = await asyncio.gather(*(one(i) for i in range(burst)))
        return outputs, await engine.call(what_each_step_saw)

    outputs, waiting_per_step = run(scenario())
    assert all(len(out.outputs[0].token_ids) == 2 for out in outputs)
    assert waiting_per_step[0] == burst, f"the first step saw {waiting_per_step[0]} of {burst} requests"


def test_a_request_closed_in_the_turn_that_queued_it_is_aborted(engine, run):
    """Its abort goes after its add, which is still waiting for the end of the turn: not before, where the
    engine would ignore it and then run the request to its end."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def scenario():
        stream = engine.submit([5, 6, 7, 8], long)
        await stream.aclose()  # does not wait: still the turn that queued the request
        outputs = [out async for out in stream]
        return outputs, await engine.call(has_no_request_and_no_block)

    outputs, idle = run(scenario())
    assert outputs == [] and idle


def test_the_default_and_the_way_back_to_a_thread(model, engine, monkeypatch):
    with pytest.raises(AttributeError, match="process of its own"):
        engine.engine  # noqa: B018
    monkeypatch.setenv("NANOVLLM_ENGINE_PROCESS", "0")
    on_thread = AsyncLLM(model, **ENGINE)
    assert on_thread.engine.max_model_len == 64
    on_thread.shutdown()
    monkeypatch.setenv("NANOVLLM_ENGINE_PROCESS", "maybe")
    with pytest.raises(ValueError, match="NANOVLLM_ENGINE_PROCESS='maybe'"):
        AsyncLLM(model, **ENGINE)


@pytest.mark.slow
def test_a_bad_engine_option_raises_from_the_constructor(model):
    with pytest.raises(TypeError, match="unknown engine option"):  # at once, before a process starts
        AsyncLLM(model, **ENGINE, max_num_seq=4)
    with pytest.raises(ValueError, match="max_model_len=10000 exceeds"):  # raised in the engine's process
        AsyncLLM(model, **{**ENGINE, "max_model_len": 10_000})


@pytest.mark.slow
def test_the_child_ends_with_shutdown_collection_or_death(model):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def first_then_rest(llm):
        stream = llm.generate([5, 6, 7], params)
        await anext(stream)
        return stream

    async def rest(stream):
        return [out async for out in stream]

    async def killed(llm):
        stream = await first_then_rest(llm)
        os.kill(llm._core.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process \\(pid \\d+\\) was killed by signal SIGKILL"):
            await rest(stream)
        with pytest.raises(RuntimeError, match="was killed by signal SIGKILL; make a new AsyncLLM"):
            await anext(llm.generate([5, 6, 7], params))

    llm = AsyncLLM(model, **ENGINE)
    process = llm._core.process
    asyncio.run(asyncio.wait_for(killed(llm), TIMEOUT))
    assert not process.is_alive()

    llm = AsyncLLM(model, **ENGINE)
    process = llm._core.process

    async def shut_down_while_pending(llm):
        stream = await first_then_rest(llm)
        llm.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await rest(stream)

    asyncio.run(asyncio.wait_for(shut_down_while_pending(llm), TIMEOUT))
    assert not process.is_alive() and process.exitcode == 0

    llm = AsyncLLM(model, **ENGINE)
    process = llm._core.process
    asyncio.run(asyncio.wait_for(rest(llm.generate([5, 6, 7], params)), TIMEOUT))
    del llm
    gc.collect()
    assert wait_until(lambda: not process.is_alive(), TIMEOUT) and process.exitcode == 0
