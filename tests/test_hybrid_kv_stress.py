"""Hybrid KV under stress: random requests on the tiny models with sliding-window layers.

Each workload mixes arrivals over time, prompts sharing long prefixes (prefix-cache hits that reach past
the window), aborts, a KV budget so tight that the scheduler preempts, and a token budget that is no
multiple of the block size, so prefill chunks end inside the window. Every step the block accounting must
hold (a block's reference count is its users among the running sequences, in every KV group; a block is
free exactly when unused; waiting sequences hold nothing; a decoding sequence holds at most
``ceil(window / block_size) + 1`` blocks in a sliding-window group); at the end no block is held, every
finished request's greedy tokens equal a roomy engine's (a big cache, no prefix caching, no preemption) and
an aborted request's tokens are a prefix of them. Runs in both KV layouts where the engine has both, once
with block hashes that collide all the time, so that a prefix hit the block manager does not verify shows.
"""

from __future__ import annotations

import random

import attrs
import pytest
from nanovllm import SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.plugins import get_plugins
from nanovllm.testing import HYBRID_BLOCK_SIZE, HYBRID_WINDOW, tiny_kv_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID = "disable_hybrid_kv_cache_manager" in attrs.fields_dict(EngineConfig)
MODELS = ["Gemma3ForCausalLM", "MistralForCausalLM"]
MAX_MODEL_LEN = 320
MAX_NEW = 40
ROOMY = 1 << 26  # bytes of KV: every request of a workload at once


def layout(uniform: bool) -> dict:
    """The engine option that picks the KV layout; nothing on an engine that has only the uniform one."""
    return {"disable_hybrid_kv_cache_manager": uniform} if HYBRID else {}


ONE_LAYOUT = pytest.mark.skipif(not HYBRID, reason="the engine has one KV layout")
LAYOUTS = [pytest.param(False, id="hybrid", marks=ONE_LAYOUT), pytest.param(True, id="uniform")]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    def get(architecture: str) -> str:
        if architecture not in get_plugins().registry.model_families:
            pytest.skip(f"needs the model-family plugin of {architecture}")
        return tiny_model(architecture)

    return get


@attrs.frozen
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: int  # the step before which it is added
    abort_after: int | None  # steps after its arrival at which it is aborted, if it has not finished


def workload(seed: int) -> list[Request]:
    """24 requests: a third fresh, the others a shared stem (40-150 tokens, past the window) and a tail."""
    rng = random.Random(seed)
    stems = [[rng.randrange(3, 256) for _ in range(rng.randrange(40, 150))] for _ in range(3)]
    requests = []
    for i in range(24):
        if i % 3 == 0:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 200))]
        else:
            prompt = rng.choice(stems) + [rng.randrange(3, 256) for _ in range(rng.randrange(0, 60))]
        abort_after = rng.randrange(1, 30) if rng.random() < 0.2 else None
        max_tokens, arrival = rng.randrange(1, MAX_NEW + 1), rng.randrange(60)
        requests.append(Request(f"r{i}", prompt, max_tokens, arrival, abort_after))
    return sorted(requests, key=lambda r: r.arrival)


def block_tables(seq) -> list[list[int]]:
    """A sequence's block tables, one per KV group (the uniform layout has one)."""
    return list(getattr(seq, "block_tables", None) or [seq.block_table])


def assert_blocks_accounted(scheduler) -> None:
    """Every block's reference count is its number of users among the running sequences, over all groups;
    a block is free exactly when nobody uses it; waiting sequences hold no block."""
    bm = scheduler.block_manager
    null = getattr(bm, "null_block", None)  # what a window group's table names a freed block by
    users: dict[int, int] = {}
    for seq in scheduler.running:
        for table in block_tables(seq):
            for b in table:
                if b != null:
                    users[b] = users.get(b, 0) + 1
    assert all(not any(block_tables(s)) for s in scheduler.waiting if s not in scheduler.running)
    for b, ref_count in enumerate(bm.ref_counts.tolist()):
        assert ref_count == users.get(b, 0), f"block {b}"
        assert (b in bm.free_blocks) == (ref_count == 0), f"block {b}"


def watch_window_blocks(llm) -> list[int]:
    """As each step launches, the blocks each decoding sequence holds in each sliding-window group, checked
    against the window: at most ``ceil(window / block_size) + 1``, the blocks that the window of the token
    being computed reaches. Returns the list the counts go to."""
    bm, held, launch = llm.scheduler.block_manager, [], llm.runner.launch
    windows = [(g, group.sliding_window) for g, group in enumerate(llm.kv_cache_groups)
               if group.sliding_window is not None]

    def checking(seqs, *rest):
        for seq in (s for s in seqs if s.is_decode):
            for g, window in windows:
                held.append(sum(b != bm.null_block for b in seq.block_tables[g]))
                assert held[-1] <= -(-window // bm.block_size) + 1, (seq.request_id, seq.block_tables[g])
        return launch(seqs, *rest)

    llm.runner.launch = checking
    return held


def assert_nothing_held(llm) -> None:
    bm = llm.scheduler.block_manager
    assert not llm.has_unfinished_requests()
    leaked = bm.num_usable_blocks - bm.num_free_blocks
    assert not leaked, f"{leaked} blocks leaked"
    assert not bm.ref_counts.any()


def run_workload(llm, requests: list[Request]) -> dict[str, object]:
    """Drive the step API; returns each request's last output."""
    params = {r.request_id: SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in requests}
    pending, last, live = list(requests), {}, {}
    for step in range(5000):
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            llm.add_request(r.request_id, r.prompt, params[r.request_id])
            live[r.request_id] = (r, step)
        for r, arrived in list(live.values()):
            if r.abort_after is not None and step - arrived == r.abort_after and r.request_id in live:
                llm.abort_request(r.request_id)
                del live[r.request_id]
        if not pending and not llm.has_unfinished_requests():
            return last
        for out in llm.step():
            last[out.request_id] = out
            if out.finished:
                live.pop(out.request_id, None)
        assert_blocks_accounted(llm.scheduler)
    raise AssertionError("the workload did not finish")


@pytest.fixture(scope="module")
def reference(model_dir):
    """A roomy engine's greedy tokens for every prompt, ``MAX_NEW`` of them (a shorter request: a prefix)."""
    from nanovllm import LLM

    made: dict[tuple[str, int], dict[tuple[int, ...], list[int]]] = {}

    def get(architecture: str, seed: int) -> dict[tuple[int, ...], list[int]]:
        if (architecture, seed) not in made:
            llm = LLM(model_dir(architecture), device="cpu", block_size=HYBRID_BLOCK_SIZE,
                      kv_cache_memory=ROOMY, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
                      skip_tokenizer_init=True, **layout(True))
            prompts = [r.prompt for r in workload(seed)]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                                use_tqdm=False)
            assert llm.scheduler.num_preemptions == 0
            made[(architecture, seed)] = {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}
        return made[(architecture, seed)]

    return get


@pytest.mark.parametrize("uniform", LAYOUTS)
@pytest.mark.parametrize("architecture", MODELS)
@pytest.mark.parametrize(("seed", "hashing"), [(0, "xxhash"), (1, "colliding")])
def test_random_workload_gives_the_roomy_tokens_and_frees_every_block(
    model_dir, reference, monkeypatch, architecture, seed, hashing, uniform
):
    from nanovllm import LLM
    from nanovllm.engine import block_manager

    if hashing == "colliding":  # ignores the chain and collides often: a hit must be verified, not trusted
        monkeypatch.setattr(block_manager, "chain_hashes", lambda prev, rows: [int(sum(r)) % 3 for r in rows])

    rng = random.Random(seed)
    budget = rng.choice([24, 40, 56])  # no multiple of the block size: chunks end inside the window
    # room for two sequences of MAX_MODEL_LEN tokens in the layout: the workload must preempt
    kv_bytes = 2 * tiny_kv_bytes(architecture, MAX_MODEL_LEN, budget, hybrid=not uniform)
    llm = LLM(model_dir(architecture), device="cpu", block_size=HYBRID_BLOCK_SIZE, kv_cache_memory=kv_bytes,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget, max_num_seqs=8,
              skip_tokenizer_init=True, **layout(uniform))
    requests = workload(seed)
    window_blocks = watch_window_blocks(llm) if not uniform else []
    outputs = run_workload(llm, requests)
    expected = reference(architecture, seed)

    assert_nothing_held(llm)
    aborted = 0
    for r in requests:
        want = expected[tuple(r.prompt)][: r.max_tokens]
        out = outputs.get(r.request_id)
        got = out.token_ids if out is not None else []
        if out is not None and out.finished and out.finish_reason == "length":
            assert got == want, f"{r.request_id} ({len(r.prompt)} prompt tokens): tokens differ"
        else:  # aborted before it finished: what it got so far
            aborted += 1
            assert got == want[: len(got)], f"{r.request_id} (aborted): tokens differ"
    assert aborted > 0, "the workload should abort some requests"
    assert llm.scheduler.num_preemptions > 0, "the tight KV budget should force preemption"
    hits = [o.num_cached_tokens for o in outputs.values()]
    if hashing == "xxhash":  # three hash values leave room for few cached blocks
        assert max(hits) > HYBRID_WINDOW, "prefix-cache hits should reach past the window"
    if not uniform:  # sequences past the window decoded holding only their windows
        assert window_blocks and max(window_blocks) == HYBRID_WINDOW // HYBRID_BLOCK_SIZE + 1
