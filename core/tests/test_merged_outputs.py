"""``AsyncLLM``'s front-end behind the engine: the steps it applies before a request's consumer runs reach the
consumer as one output, the per-step outputs merged (DELTA: their text, tokens and logprobs concatenated;
CUMULATIVE: the latest; FINAL_ONLY: the one). Fed step messages directly, with a byte-level tokenizer so
that characters split across tokens (and across the bursts of steps) are covered; an error or an abort
that arrives behind a step still ends the request as before."""

from __future__ import annotations

import asyncio
import itertools

import attrs
import pytest
from merged_outputs import merged_like
from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.engine.engine_core import EngineInfo, SchedulerStats
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY
TEXTS = ("héllo wörld, 你好 😀 ok", "ok 😀 你好, wörld")  # completion 0's, completion 1's (n=2)
REQUESTS = {  # request id -> params, and the stop string that ends it (None: its length)
    "delta": (SamplingParams(max_tokens=64, logprobs=1, output_kind=DELTA), None),
    "held": (SamplingParams(max_tokens=64, stop=["never there"], output_kind=DELTA), None),
    "stop": (SamplingParams(max_tokens=64, stop=["!"], output_kind=DELTA), "!"),
    "n2": (SamplingParams(n=2, max_tokens=64, output_kind=DELTA), None),
    "cumulative": (SamplingParams(max_tokens=64, logprobs=1, output_kind=CUMULATIVE), None),
    "final": (SamplingParams(n=2, max_tokens=64, output_kind=FINAL_ONLY), None),
}
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A byte-level tokenizer of 256 tokens, one per byte, and its token ids of a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("byte_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path), lambda text: tok.encode(text).ids


class RecordingCore:
    """Stands in for ``AsyncLLM``'s engine core: records the commands it is sent and runs nothing; a test feeds
    the front-end step messages itself (``llm._outputs.handle``)."""

    def __init__(self, info) -> None:
        self.info = info
        self.commands: list[tuple] = []
        self.post = None

    def start(self, post) -> None:
        self.post = post

    def send(self, command: tuple) -> None:
        self.commands.append(command)

    def shutdown(self, timeout: float = 0.0) -> None:
        pass


def recording_front_end(tokenizer_path: str | None, vocab_size: int) -> tuple[AsyncLLM, RecordingCore]:
    """An ``AsyncLLM`` over a :class:`RecordingCore` (no model, no engine process): its front-end alone, with
    the tokenizer at ``tokenizer_path`` (None: token ids only). Returns ``(llm, core)``."""
    core = RecordingCore(EngineInfo(tokenizer_path, vocab_size, max_model_len=1 << 20, max_logprobs=20))
    llm = AsyncLLM.__new__(AsyncLLM)
    llm._setup(core)
    return llm, core


def step_messages(encode) -> list[tuple]:
    """One token a step for every completion, each finishing with its last token (a stop string's last)."""
    tokens = {}
    for request_id, (params, stop) in REQUESTS.items():
        for index in range(params.n):
            tokens[request_id, index] = encode(TEXTS[index] + (stop or ""))
    messages = []
    for step in range(max(map(len, tokens.values()))):
        updates = []
        for (request_id, index), ids in tokens.items():
            if step >= len(ids):
                continue
            params, stop = REQUESTS[request_id]
            logprobs = [([ids[step]], [-0.25 - step / 64], [1])] if params.logprobs is not None else None
            finish = None
            if step == len(ids) - 1:
                reason = ("length", None) if stop is None else ("stop", stop)
                finish = (*reason, 1000.0 + step, None, None)  # no prompt logprobs, no error
            updates.append((request_id, index, [ids[step]], logprobs, 1000.0, 1000.0 + step, 0, finish))
        messages.append(("step", updates, SchedulerStats(len(updates), 0, 0.5)))
    return messages


async def settle() -> None:
    """Let every woken consumer run until it waits again."""
    for _ in range(4):
        await asyncio.sleep(0)


async def outputs_of(tokenizer_path: str, messages: list[tuple], bursts: list[int]) -> dict[str, list]:
    """Each request's outputs, with the consumers run after each burst of ``bursts`` (cycled) messages."""
    llm, _ = recording_front_end(tokenizer_path, vocab_size=256)
    outputs: dict[str, list] = {request_id: [] for request_id in REQUESTS}

    async def consume(request_id: str, params: SamplingParams) -> None:
        async for out in llm.generate(PROMPT, params, request_id):
            outputs[request_id].append(attrs.evolve(out, metrics=None))  # its arrival time differs a run

    consumers = [asyncio.ensure_future(consume(r, params)) for r, (params, _) in REQUESTS.items()]
    await settle()
    start = 0
    for burst in itertools.cycle(bursts):
        for message in messages[start : start + burst]:
            llm._outputs.handle(message)
        await settle()
        start += burst
        if start >= len(messages):
            break
    await asyncio.wait_for(asyncio.gather(*consumers), 10)
    return outputs


def test_steps_applied_before_the_consumer_runs_make_one_output_the_steps_merged(byte_tokenizer):
    path, encode = byte_tokenizer
    messages = step_messages(encode)
    per_step = asyncio.run(outputs_of(path, messages, [1]))
    # one a step, as the step API: every token its own DELTA, characters split over tokens held until whole
    assert len(per_step["delta"]) == len(encode(TEXTS[0]))
    assert "".join(out.outputs[0].text for out in per_step["delta"]) == TEXTS[0]
    assert "".join(out.outputs[0].text for out in per_step["stop"]) == TEXTS[0]
    for bursts in ([2], [3, 1, 4, 2, 5], [len(messages)]):
        merged = asyncio.run(outputs_of(path, messages, bursts))
        for request_id, (params, _) in REQUESTS.items():
            kind = params.output_kind
            assert merged[request_id] == merged_like(merged[request_id], per_step[request_id], kind), request_id
            if kind != FINAL_ONLY:
                assert len(merged[request_id]) < len(per_step[request_id]), (request_id, bursts)
        texts = {index: "".join(c.text for out in merged["n2"] for c in out.outputs if c.index == index)
                 for index in (0, 1)}
        assert texts == dict(enumerate(TEXTS))
        last = merged["cumulative"][-1].outputs[0]
        assert last.text == TEXTS[0] and last.cumulative_logprob == pytest.approx(sum(
            lps[0] for m in messages for r, _, _, lp, *_ in m[1] if r == "cumulative" for _, lps, _ in lp))
    everything = asyncio.run(outputs_of(path, messages, [len(messages)]))
    assert all(len(outs) == 1 and outs[0].finished for outs in everything.values())


def test_an_error_behind_a_step_follows_its_output_and_an_abort_drops_what_is_pending(byte_tokenizer):
    path, encode = byte_tokenizer
    messages = step_messages(encode)

    async def scenario():
        llm, _ = recording_front_end(path, vocab_size=256)
        params = REQUESTS["delta"][0]
        failing = llm.generate(PROMPT, params, "delta")
        aborted = llm.generate(PROMPT, params, "held")
        first = asyncio.ensure_future(anext(failing))
        pending = asyncio.ensure_future(anext(aborted))
        await settle()
        llm._outputs.handle(messages[0])
        llm._outputs.handle(messages[1])
        llm._outputs.handle(("error", ["delta"], "the engine step failed"))
        await llm.abort("held")
        out = await first
        with pytest.raises(RuntimeError, match="the engine step failed"):
            await anext(failing)
        with pytest.raises(StopAsyncIteration):
            await pending
        return out

    out = asyncio.run(scenario())
    assert out.outputs[0].token_ids == encode(TEXTS[0])[:2] and out.outputs[0].logprobs


def test_the_builders_decode_is_the_tokenizers(tiny_model, byte_tokenizer):
    """OutputBuilder decodes with the Rust tokenizer where that is what the tokenizer's decode does: the same
    text for every option, special tokens included."""
    from pathlib import Path

    from nanovllm.engine.llm_engine import load_tokenizer
    from nanovllm.engine.output_stream import OutputBuilder

    for path in (tiny_model(), byte_tokenizer[0]):
        tokenizer = load_tokenizer(Path(path))
        builder = OutputBuilder(tokenizer)
        assert builder._backend_decode is not None  # the fast path is what is checked
        ids = [*tokenizer.all_special_ids, *range(5, 40), *tokenizer.all_special_ids, 60, 61]
        for params in (None, SamplingParams(), SamplingParams(skip_special_tokens=False),
                       SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)):
            for window in (ids, ids[:3], ids[-4:], ids[20:21], []):
                skip = params is None or params.skip_special_tokens
                spaces = params is None or params.spaces_between_special_tokens
                expected = tokenizer.decode(window, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                assert builder.detokenize(window, params) == expected
