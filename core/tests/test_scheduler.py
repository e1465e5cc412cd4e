"""Scheduler: token budget, chunked prefill, mixed steps, max_num_seqs, preemption by recompute.

The first half drives the scheduler alone with a fake model (every sampled token is 7); the second
half runs the engine on a tiny random model and compares greedy tokens against a roomy run.
"""

from __future__ import annotations

import pytest
from nanovllm.config import EngineConfig
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.kv.groups import KVCacheGroup
from nanovllm.plugins import get_plugins
from nanovllm.sampling_params import SamplingParams

# -- the scheduler alone --------------------------------------------------------------------------


def make(num_blocks: int = 64, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    return Scheduler(EngineConfig(**config), num_blocks)


def add(sched: Scheduler, prompt_len: int, max_tokens: int = 4, first: int = 10) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(list(range(first, first + prompt_len)), params)
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> list[tuple[Sequence, int, bool]]:
    """One step with a fake model: returns (sequence, tokens scheduled, was a decode) per sequence."""
    scheduled = sched.schedule()
    record = [(s, s.num_scheduled_tokens, s.is_decode) for s in scheduled]
    sampling = [s for s in scheduled if s.samples_this_step]
    sched.advance(scheduled)
    for seq in sampling:
        seq.token_ids.append(7)
        if seq.num_completion_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq, "length")
    return record


def run(sched: Scheduler, max_steps: int = 1000) -> list[list[tuple[Sequence, int, bool]]]:
    steps = []
    while sched.has_unfinished():
        steps.append(step(sched))
        assert len(steps) < max_steps, "the scheduler made no progress"
    return steps


def assert_all_blocks_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not bm.ref_counts.any()


def test_token_budget_is_respected_and_long_prompts_are_chunked():
    sched = make(max_num_batched_tokens=16)
    long = add(sched, 50)
    steps = run(sched)
    assert all(sum(n for _, n, _ in s) <= 16 for s in steps)
    chunks = [n for s in steps for seq, n, _ in s if seq is long]
    assert chunks[:4] == [16, 16, 16, 2]  # the prompt in budget-sized chunks, the last one samples
    assert chunks[4:] == [1, 1, 1]  # then one token per decode step
    assert long.is_finished and long.num_completion_tokens == 4
    assert_all_blocks_free(sched)


def test_prefill_chunks_and_decodes_share_a_step():
    sched = make(max_num_batched_tokens=8)
    short = add(sched, 3, max_tokens=10)
    step(sched)  # short's whole prompt
    long = add(sched, 30, first=100)
    mixed = step(sched)
    assert [(s, n, d) for s, n, d in mixed] == [(short, 1, True), (long, 7, False)]
    steps = run(sched)
    assert all(sum(n for _, n, _ in s) <= 8 for s in steps)
    assert short.is_finished and long.is_finished
    assert_all_blocks_free(sched)


def test_max_num_seqs_bounds_the_running_set():
    sched = make(max_num_seqs=2)
    seqs = [add(sched, 5, max_tokens=3, first=10 * i) for i in range(5)]
    peak = 0
    while sched.has_unfinished():
        step(sched)
        peak = max(peak, len(sched.running))
        assert len(sched.running) <= 2
    assert peak == 2
    assert all(s.is_finished and s.num_completion_tokens == 3 for s in seqs)
    assert_all_blocks_free(sched)


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens; each sequence grows to 5 + 10 = 15 tokens (4 blocks): both cannot fit.
    sched = make(num_blocks=6, enable_prefix_caching=False)
    a = add(sched, 5, max_tokens=10, first=10)
    b = add(sched, 5, max_tokens=10, first=50)
    victim_seen = False
    while sched.has_unfinished():
        before = sched.num_preemptions
        step(sched)
        if sched.num_preemptions > before and not victim_seen:
            victim_seen = True
            # The most recently admitted sequence goes back to the front of the queue, holding nothing.
            assert sched.waiting[0] is b and b.status == SequenceStatus.WAITING
            assert b.block_table == [] and b.num_computed_tokens == 0
            assert b.num_completion_tokens > 0  # its generated tokens are kept and recomputed
        used = sum(len(s.block_table) for s in sched.running)
        assert used + sched.block_manager.num_free_blocks == 6
    assert sched.num_preemptions >= 1
    assert a.is_finished and b.is_finished
    assert a.completion_token_ids == b.completion_token_ids == [7] * 10
    assert_all_blocks_free(sched)


def test_finished_sequences_release_their_blocks_at_once():
    sched = make()
    a = add(sched, 9, max_tokens=1)
    b = add(sched, 9, max_tokens=5, first=40)
    step(sched)
    assert a.is_finished and a.block_table == [] and a not in sched.running
    assert len(b.block_table) == 3
    run(sched)
    assert_all_blocks_free(sched)


def test_without_chunked_prefill_prompts_are_never_split():
    sched = make(max_num_batched_tokens=20, enable_chunked_prefill=False)
    first = add(sched, 15, max_tokens=3)
    second = add(sched, 15, max_tokens=3, first=100)
    steps = run(sched)
    assert [(s, n) for s, n, _ in steps[0]] == [(first, 15)]  # second does not fit the rest of the budget
    assert (second, 15) in [(s, n) for s, n, _ in steps[1]]
    for seq in (first, second):
        prefills = [n for s in steps for q, n, d in s if q is seq and not d]
        assert prefills == [15]
    assert all(sum(n for _, n, _ in s) <= 20 for s in steps)


def test_prefix_hits_shorten_the_prefill():
    sched = make()
    a = add(sched, 13, max_tokens=1)
    run(sched)
    b = add(sched, 13, max_tokens=1)  # same prompt: 3 full blocks cached, at most 12 tokens
    record = step(sched)
    assert record == [(b, 1, True)]  # the one token left runs as a decode (vLLM V1's rule)
    assert b.num_cached_tokens == 12
    assert a.is_finished and b.is_finished


def test_one_scheduled_token_is_a_decode_whatever_the_token():
    """vLLM V1's rule: a one-token prompt chunk, a one-token prompt and a generated token all run as
    decodes; only the last token of a sequence samples."""
    sched = make(max_num_batched_tokens=1)
    seq = add(sched, 3, max_tokens=2)
    steps = run(sched)
    assert [r for s in steps for r in s] == [(seq, 1, True)] * 4  # three prompt tokens, then one decode
    one = add(sched, 1, max_tokens=1)
    assert step(sched) == [(one, 1, True)] and one.is_finished


def test_a_sequence_larger_than_the_whole_cache_is_a_clear_error():
    sched = make(num_blocks=2)
    add(sched, 20)
    with pytest.raises(RuntimeError, match="cannot hold one sequence"):
        sched.schedule()


def check_block_accounting(sched: Scheduler) -> None:
    bm = sched.block_manager
    users: dict[int, int] = {}
    for seq in sched.running:
        for table in seq.block_tables:
            for b in table:
                if b != bm.null_block:
                    users[b] = users.get(b, 0) + 1
    for b, ref_count in enumerate(bm.ref_counts.tolist()):
        assert ref_count == users.get(b, 0)
        assert (b in bm.free_blocks) == (ref_count == 0)
    for g, cache in enumerate(bm.hash_to_block):
        for h, b in cache.items():
            assert bm.hashes[b] == h and bm.cache_groups[b] == g


# KV cache groups of the random workload: one full-attention group (every model without windows), a full
# group with two window groups (a hybrid model, as Gemma 3), and one window group (Mistral)
LAYOUTS = {
    "uniform": None,
    "hybrid": (KVCacheGroup((0,), None), KVCacheGroup((1,), 5), KVCacheGroup((2,), 3)),
    "windows": (KVCacheGroup((0,), 6),),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hashing", ["xxhash", "colliding"])
def test_random_workload_keeps_every_invariant(seed, hashing, layout, monkeypatch):
    """Random arrivals, shared prefixes, tight memory. A fake KV cache stores, per slot, the prefix that
    wrote it; every scheduled sequence must read exactly its own prefix back (so a wrong prefix hit, a
    block shared while written, or a lost block shows up), and the accounting must hold at every step.
    Window groups read only their window, hold at most what it and the chunk span, and never write the
    null block."""
    import random

    from nanovllm.engine import block_manager

    if hashing == "colliding":  # ignores the chain and collides often: hits must be verified, not trusted
        monkeypatch.setattr(block_manager, "chain_hashes", lambda prev, rows: [int(sum(r)) % 3 for r in rows])
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    chunked = seed % 3 != 0
    budget = rng.choice([8, 13, 32]) if chunked else 40
    groups = LAYOUTS[layout] or (KVCacheGroup((0,)),)
    config = dict(block_size=bs, max_num_batched_tokens=budget, max_num_seqs=rng.choice([2, 4, 8]),
                  enable_chunked_prefill=chunked, enable_prefix_caching=seed != 5)
    num_blocks = rng.choice([16, 24, 40]) * len(groups) + 1  # as tight for each group, and a null block
    sched = Scheduler(EngineConfig(**config), num_blocks, groups=groups)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    pending = []
    for _ in range(24):
        prompt = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)
        pending.append((rng.randrange(40), Sequence(prompt[:20] or [1], params)))
    pending.sort(key=lambda item: item[0])
    seqs = [s for _, s in pending]

    def next_token(tokens: list[int]) -> int:  # deterministic, so equal prefixes continue alike
        return hash(tuple(tokens)) % 3

    cache: dict[tuple[int, int], tuple[int, ...]] = {}  # (group, slot) -> the prefix that wrote it
    for step_no in range(2000):
        while pending and pending[0][0] <= step_no:
            sched.add(pending.pop(0)[1])
        if not pending and not sched.has_unfinished():
            break
        scheduled = sched.schedule()
        assert sum(s.num_scheduled_tokens for s in scheduled) <= budget
        assert len(sched.running) <= sched.max_num_seqs
        check_block_accounting(sched)

        def slot(seq: Sequence, g: int, pos: int) -> tuple[int, int]:
            block = seq.block_tables[g][pos // bs]
            return g, block * bs + pos % bs

        for seq in scheduled:  # every layer first stores the step's keys ...
            start = seq.num_computed_tokens
            if not chunked and start == seq.num_cached_tokens:
                assert seq.num_scheduled_tokens == seq.num_tokens - start  # whole prompt, never split
            for g, group in enumerate(groups):
                held = sum(b != sched.block_manager.null_block for b in seq.block_tables[g])
                assert held <= group.max_blocks(seq.num_tokens, bs, budget)
                for pos in range(start, start + seq.num_scheduled_tokens):
                    assert seq.block_tables[g][pos // bs] != sched.block_manager.null_block
                    cache[slot(seq, g, pos)] = tuple(seq.token_ids[: pos + 1])
        for seq in scheduled:  # ... then attends over its window up to each scheduled token
            first = seq.num_computed_tokens
            end = first + seq.num_scheduled_tokens
            for g, group in enumerate(groups):
                window = group.sliding_window or end
                for pos in range(max(0, first - window + 1), end):
                    assert cache.get(slot(seq, g, pos)) == tuple(seq.token_ids[: pos + 1])
        sampling = [s for s in scheduled if s.samples_this_step]
        sched.advance(scheduled)
        for seq in sampling:
            seq.token_ids.append(next_token(seq.token_ids))
            if seq.num_completion_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq, "length")
        check_block_accounting(sched)
    else:
        pytest.fail("the workload did not finish")

    for seq in seqs:
        assert seq.is_finished and seq.num_completion_tokens == seq.sampling_params.max_tokens
        expected = seq.token_ids[: seq.num_prompt_tokens]
        while len(expected) < seq.num_tokens:
            expected.append(next_token(expected))
        assert seq.token_ids == expected
    assert_all_blocks_free(sched)


def test_abort_all_returns_every_block():
    sched = make()
    add(sched, 9)
    add(sched, 9, first=50)
    step(sched)
    add(sched, 4, first=90)
    sched.abort_all()
    assert not sched.has_unfinished()
    assert_all_blocks_free(sched)


# -- the engine on a tiny model ---------------------------------------------------------------------

needs_llama = pytest.mark.skipif(
    "LlamaForCausalLM" not in get_plugins().registry.model_families, reason="needs the nanovllm-llama plugin"
)

PROMPT_LENS = (20, 33, 7, 26)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[(13 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def greedy(path: str, **config) -> tuple[list[list[int]], object]:
    from nanovllm import LLM

    llm = LLM(path, kv_cache_memory=config.pop("kv_cache_memory", 1 << 24), device="cpu", **config)
    out = llm.generate(prompts(), GREEDY, use_tqdm=False)
    return [o.token_ids for o in out], llm


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(model):
    tokens, _ = greedy(model, enable_prefix_caching=False)
    return tokens


def spy_steps(llm) -> list[list[tuple[int, bool]]]:
    """Record (tokens scheduled, is decode) per sequence for every step the runner executes."""
    steps: list[list[tuple[int, bool]]] = []
    launch = llm.runner.launch

    def recording(seqs, *rest):
        steps.append([(s.num_scheduled_tokens, s.is_decode) for s in seqs])
        return launch(seqs, *rest)

    llm.runner.launch = recording
    return steps


def engine_blocks_all_free(llm) -> bool:
    bm = llm.scheduler.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks and not llm.scheduler.has_unfinished()


@needs_llama
def test_chunked_mixed_steps_give_the_same_tokens(model, reference):
    from nanovllm import LLM

    llm = LLM(model, kv_cache_memory=1 << 24, device="cpu", max_num_batched_tokens=16, max_num_seqs=3)
    steps = spy_steps(llm)
    out = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in out] == reference
    assert all(sum(n for n, _ in s) <= 16 for s in steps)
    assert all(len(s) <= 3 for s in steps)
    assert any(any(d for _, d in s) and any(not d for _, d in s) for s in steps), "no mixed step"
    assert engine_blocks_all_free(llm)


@needs_llama
def test_one_token_steps_give_the_same_tokens(model, reference):
    """max_num_batched_tokens=1: every prompt token is a one-token step that runs as a decode (the
    prompt logprobs of such runs are checked against Hugging Face in tests/test_parity.py)."""
    from nanovllm import LLM

    llm = LLM(model, kv_cache_memory=1 << 24, device="cpu", max_num_batched_tokens=1)
    steps = spy_steps(llm)
    out = llm.generate([*prompts(), [42]], GREEDY, use_tqdm=False)  # and a one-token prompt
    assert [o.token_ids for o in out[:-1]] == reference
    assert all(s == [(1, True)] for s in steps)
    alone = llm.generate([[42]], GREEDY, use_tqdm=False)[0]
    assert out[-1].token_ids == alone.token_ids and len(alone.token_ids) == GREEDY.max_tokens
    assert engine_blocks_all_free(llm)


@needs_llama
def test_preemption_recomputes_and_keeps_greedy_tokens(model, reference):
    # 16-token blocks of 8 KiB each; 6 blocks hold 96 tokens, the four requests need up to 57 each.
    tokens, llm = greedy(model, kv_cache_memory=6 * 8192, max_model_len=96)
    assert llm.runner.num_blocks == 6
    assert llm.scheduler.num_preemptions > 0
    assert tokens == reference
    assert engine_blocks_all_free(llm)


@needs_llama
def test_without_chunked_prefill_tokens_match(model, reference):
    tokens, llm = greedy(model, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    assert tokens == reference
    assert engine_blocks_all_free(llm)


@needs_llama
def test_without_chunked_prefill_budget_must_hold_a_whole_prompt(model):
    from nanovllm import LLM

    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        LLM(model, kv_cache_memory=1 << 24, enable_chunked_prefill=False, max_num_batched_tokens=32)


@needs_llama
def test_prefix_cache_hits_keep_tokens(model, reference):
    from nanovllm import LLM

    llm = LLM(model, kv_cache_memory=1 << 24, device="cpu", max_num_batched_tokens=32)
    first = llm.generate(prompts(), GREEDY, use_tqdm=False)
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == reference
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
    assert engine_blocks_all_free(llm)


@needs_llama
def test_hash_collisions_never_change_tokens(model, reference, monkeypatch):
    """With every block hashing alike, the prefix cache must fall back to verification, not trust."""
    from nanovllm import LLM
    from nanovllm.engine import block_manager

    # The first block again at the second position: a hash that ignores the chain maps it to the cached
    # first block, whose keys were computed at positions 0-3.
    doubled = [p[:4] + p[:4] + p[4:] for p in prompts()]
    plain = LLM(model, kv_cache_memory=1 << 24, device="cpu", enable_prefix_caching=False)
    doubled_reference = [o.token_ids for o in plain.generate(doubled, GREEDY, use_tqdm=False)]

    monkeypatch.setattr(block_manager, "chain_hashes", lambda prev, rows: [hash(tuple(r)) & 3 for r in rows.tolist()])
    llm = LLM(model, kv_cache_memory=1 << 24, device="cpu", block_size=4)
    for batch, expected in ((prompts(), reference), (doubled, doubled_reference), (prompts(), reference)):
        out = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in out] == expected
    assert engine_blocks_all_free(llm)


# -- async scheduling: step N+1 launched before step N's tokens are read ------------------------------


def _outcomes(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


@needs_llama
@pytest.mark.parametrize("config", [{}, {"kv_cache_memory": 6 * 8192, "max_model_len": 96},
                                    {"max_num_batched_tokens": 16, "max_num_seqs": 3}],
                         ids=["plain", "preempting", "chunked"])
def test_async_scheduling_gives_the_sync_results(model, reference, config, monkeypatch):
    """Stops on a token, on max_tokens (1 and more) and on the context limit, under preemption and
    chunked prefill: the same tokens, reasons and free blocks as when each step is read back at once.
    A sequence that stops on a token still ran one more step, whose token must be discarded. Steps read
    last step's tokens as they lie where every row is the one that sampled them, and gather them otherwise:
    both happen here."""
    from nanovllm import LLM
    from nanovllm.engine.model_runner import ModelRunner

    prepare, plans = ModelRunner.prepare, []

    def recorded(*args):
        planned = prepare(*args)
        plans.append(planned[0])
        return planned

    monkeypatch.setattr(ModelRunner, "prepare", recorded)

    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reference[0][5]]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reference[3][0]]),
    ]
    results = {}
    for mode in (False, True):
        opts = {"kv_cache_memory": 1 << 24, **config}
        llm = LLM(model, device="cpu", async_scheduling=mode, **opts)
        results[mode] = [_outcomes(llm.generate(prompts(), params, use_tqdm=False)) for _ in range(2)]
        assert engine_blocks_all_free(llm)
        assert llm._pending is None or all(s.is_finished for s in llm._pending.seqs)
    assert results[True] == results[False]
    assert any(p.inputs_last_sampled for p in plans) and any(p.placeholder_rows is not None for p in plans)
    first = results[True][0]
    assert first[0][0] == reference[0][: reference[0].index(reference[0][5]) + 1] and first[0][1] == "stop"
    assert first[1][0] == reference[1][:1] and first[1][1] == "length"
    assert first[2][0] == reference[2]
    assert first[3][0] == reference[3][:1] and first[3][2] == reference[3][0]
    assert all(t >= 0 for run in results[True] for out in run for t in out[0])


@needs_llama
def test_async_scheduling_stops_at_the_context_limit(model):
    from nanovllm import LLM

    outs = {}
    for mode in (False, True):
        llm = LLM(model, device="cpu", kv_cache_memory=1 << 24, max_model_len=40, async_scheduling=mode)
        outs[mode] = _outcomes(llm.generate(prompts(), GREEDY, use_tqdm=False))
        assert engine_blocks_all_free(llm)
    assert outs[True] == outs[False]
    assert [len(p) + len(o[0]) for p, o in zip(prompts(), outs[True], strict=True)] == [
        min(len(p) + 24, 40) for p in prompts()
    ]
