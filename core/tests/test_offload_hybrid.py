"""KV offload on a hybrid model (tiny Gemma 3: four sliding-window layers, two global): the full-attention
layers' KV in the host pool, the window layers' windows in a GPU pool of their own.

Greedy tokens equal a roomy GPU-cache engine's on prompts that cross the window many times, in chunks whose
boundaries fall inside it, with prefix hits past the window and preemption by either pool; no block of
either pool stays held; a decoding sequence holds at most ``ceil(window / block) + 1`` window blocks; the
per-block hooks see the host pool's blocks only; a sparse policy gives the GPU cache's tokens; random arrivals
and aborts leave the accounting of both pools right at every step.
"""

from __future__ import annotations

import random

import pytest
from nanovllm import LLM, SamplingParams
from nanovllm.plugins import get_plugins, reload_plugins
from nanovllm.testing import HYBRID_BLOCK_SIZE, HYBRID_WINDOW, TINY_CONFIGS

ARCH = "Gemma3ForCausalLM"
CONFIG = TINY_CONFIGS[ARCH]
FULL_LAYERS = [i for i, kind in enumerate(CONFIG["layer_types"]) if kind == "full_attention"]
WINDOW_LAYERS = [i for i in range(CONFIG["num_hidden_layers"]) if i not in FULL_LAYERS]
TOKEN_BYTES = 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4  # K and V, a token, a layer, fp32
HOST_BLOCK = len(FULL_LAYERS) * HYBRID_BLOCK_SIZE * TOKEN_BYTES  # a host pool block: every full layer
WINDOW_BLOCK = len(WINDOW_LAYERS) * HYBRID_BLOCK_SIZE * TOKEN_BYTES  # a window pool block: one window group
MAX_MODEL_LEN = 320
CHUNK = 40  # no multiple of the block size: prefill chunks end inside the window
MAX_NEW = 24
# a sequence's most window blocks in prefill: the window before the chunk and the chunk, and the null block
WINDOW_SEQ = -(-(HYBRID_WINDOW - 1 + CHUNK) // HYBRID_BLOCK_SIZE) + 1 + 1
# host pool GiB, window pool bytes: roomy, or tight enough in one of them that requests preempt one another
SETTINGS = {
    "roomy": (0.01, 4 << 20),
    "host-tight": (1.5 * MAX_MODEL_LEN // HYBRID_BLOCK_SIZE * HOST_BLOCK / 2**30, 4 << 20),
    "window-tight": (0.01, 2 * WINDOW_SEQ * WINDOW_BLOCK),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def registered(one_thread):
    from quest_style import Plugin

    get_plugins().register(Plugin(), "quest-style")
    yield
    reload_plugins()


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    if ARCH not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-gemma3 plugin")
    return tiny_model(ARCH)


def rounds(seed: int = 3) -> list[list[list[int]]]:
    """Two rounds: fresh prompts of up to 9 windows, then prompts that share their first 100-200 tokens."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 90, 290, 150, 61, 230)]
    second = [p[: rng.randrange(100, 200)] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))]
              for p in first if len(p) > 200] + [first[3][:140] + [7, 8, 9]]
    return [first, second]


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def engine(model: str, device: str = "cpu", **options) -> LLM:
    base = dict(device=device, dtype="float32", block_size=HYBRID_BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=CHUNK, max_num_seqs=8, enforce_eager=True, skip_tokenizer_init=True)
    return LLM(model, **(base | options))


def offload_engine(model: str, setting: str = "roomy", **options) -> LLM:
    host_gib, window_bytes = SETTINGS[setting]
    return engine(model, kv_offloading_size=host_gib, kv_offloading_buffer_size=0.01,
                  kv_cache_memory=window_bytes, **options)


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for r in rounds() for o in llm.generate(r, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def roomy_tokens(model) -> list[list[int]]:
    """The GPU cache, room for everything, no prefix caching: nothing preempts, nothing is shared."""
    return generate(engine(model, kv_cache_memory=64 << 20, enable_prefix_caching=False))


def watch_windows(llm: LLM) -> list[int]:
    """At each launch, the blocks each decoding sequence holds in the window group, which must be ids of the
    window pool and at most ``ceil(window / block) + 1``; returns the list of the counts."""
    bm, runner, held = llm.scheduler.block_manager, llm.runner, []
    window_ids = range(runner.num_blocks, runner.num_blocks + runner.num_window_blocks)
    launch = runner.launch

    def checking(seqs, *rest):
        for seq in seqs:
            assert all(b in window_ids for b in seq.block_tables[1]), seq.block_tables[1]
            assert all(b < runner.num_blocks for b in seq.block_tables[0]), seq.block_tables[0]
            if seq.is_decode:
                held.append(sum(b != bm.null_block for b in seq.block_tables[1]))
                assert held[-1] <= -(-HYBRID_WINDOW // HYBRID_BLOCK_SIZE) + 1, seq.block_tables[1]
        return launch(seqs, *rest)

    runner.launch = checking
    return held


def assert_nothing_held(llm: LLM) -> None:
    bm, runner = llm.scheduler.block_manager, llm.runner
    host, window = bm.free_queues
    assert len(host) == runner.num_blocks, f"{runner.num_blocks - len(host)} host pool blocks leaked"
    assert len(window) == runner.num_window_blocks - 1, "window pool blocks leaked"  # less the null block
    assert not bm.ref_counts.any()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tokens_equal_the_roomy_gpu_cache_engine(model, roomy_tokens, setting):
    llm = offload_engine(model, setting)
    kv = llm.runner.kv
    # the layout: the global layers in the pool, the window layers in a GPU pool holding only windows
    assert [(g.layer_ids, g.sliding_window, g.pool) for g in llm.kv_cache_groups] == [
        (tuple(FULL_LAYERS), None, 0), (tuple(WINDOW_LAYERS), HYBRID_WINDOW, 1)]
    assert kv.engine.layers == FULL_LAYERS and kv.resident_layers == WINDOW_LAYERS
    assert kv.window_kv_cache.shape[:3] == (len(WINDOW_LAYERS), 2, SETTINGS[setting][1] // WINDOW_BLOCK)
    held = watch_windows(llm)
    got = [o.outputs[0].token_ids for r in rounds() for o in llm.generate(r, PARAMS, use_tqdm=False)]
    assert got == roomy_tokens
    assert held, "no decode step was watched"
    assert_nothing_held(llm)
    if setting != "roomy":
        assert llm.scheduler.num_preemptions > 0, "the tight pool should force preemption"


def test_prefix_hits_reach_past_the_window(model, roomy_tokens):
    llm = offload_engine(model)
    first, second = rounds()
    llm.generate(first, PARAMS, use_tqdm=False)
    out = llm.generate(second, PARAMS, use_tqdm=False)
    assert max(o.num_cached_tokens for o in out) > 2 * HYBRID_WINDOW
    assert [o.outputs[0].token_ids for o in out] == roomy_tokens[len(first):]
    assert_nothing_held(llm)


def assert_blocks_accounted(llm: LLM) -> None:
    """Each block's reference count is its users among the running sequences, in either pool; a block is in
    its pool's free queue exactly when no one uses it."""
    bm, users = llm.scheduler.block_manager, {}
    for seq in llm.scheduler.running:
        for table in seq.block_tables:
            for b in table:
                if b != bm.null_block:
                    users[b] = users.get(b, 0) + 1
    for b, ref_count in enumerate(bm.ref_counts.tolist()):
        assert ref_count == users.get(b, 0), b
        assert (b in bm.free_blocks) == (ref_count == 0), b


@pytest.mark.parametrize("setting", ["host-tight", "window-tight"])
def test_random_arrivals_and_aborts_free_every_block_of_both_pools(model, setting):
    """Requests arrive over time, share long prefixes, and a fifth are aborted: every step the accounting
    holds in both pools; finished requests' tokens are a fresh engine's; nothing stays held."""
    rng = random.Random(11)
    stems = [[rng.randrange(3, 250) for _ in range(rng.randrange(40, 150))] for _ in range(2)]
    requests = []  # (id, prompt, max_tokens, arrival step, steps before an abort or None)
    for i in range(14):
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 80))]
        prompt = tail if i % 3 == 0 else rng.choice(stems) + tail
        abort = rng.randrange(1, 20) if rng.random() < 0.2 else None
        requests.append((f"r{i}", prompt, rng.randrange(1, MAX_NEW), rng.randrange(15), abort))
    llm, outputs, live, aborted = offload_engine(model, setting), {}, {}, []
    for step in range(3000):
        for rid, prompt, max_tokens, arrival, abort in requests:
            if arrival == step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                llm.add_request(rid, prompt, params)
                live[rid] = step + abort if abort is not None else None
        for rid in [r for r, at in live.items() if at == step]:
            llm.abort_request(rid)
            del live[rid]
            aborted.append(rid)
        if step >= 15 and not llm.has_unfinished_requests():
            break
        for out in llm.step():
            outputs[out.request_id] = out
            if out.finished:
                live.pop(out.request_id, None)
        assert_blocks_accounted(llm)
    assert_nothing_held(llm)
    assert llm.scheduler.num_preemptions > 0 and aborted, "the workload should preempt and abort"
    fresh = engine(model, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    done = [(rid, prompt, n) for rid, prompt, n, _, _ in requests
            if rid in outputs and outputs[rid].finish_reason == "length"]
    assert len(done) >= len(requests) // 2
    want = fresh.generate([p for _, p, _ in done], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                  ignore_eos=True), use_tqdm=False)
    for (rid, _, n), w in zip(done, want, strict=True):
        assert outputs[rid].token_ids == w.outputs[0].token_ids[:n], rid


class HookRecorder:
    """The layers whose writes ``on_kv_write`` sees, the blocks it sees written, and those reallocated."""

    def __init__(self) -> None:
        self.layers: set[int] = set()
        self.written: set[int] = set()
        self.allocated: set[int] = set()

    def on_kv_write(self, write) -> None:
        self.layers.add(write.layer_id)
        self.written |= {b for b in write.block_ids.tolist() if b >= 0}

    def on_blocks_allocated(self, block_ids) -> None:
        self.allocated |= set(block_ids.tolist())


def test_per_block_hooks_see_the_host_pools_blocks_only(model):
    """The window pool keeps no per-block metadata: its layers tell no KV write and its blocks are never
    reported reallocated (their ids would name the pool's blocks)."""
    recorder = HookRecorder()
    llm = offload_engine(model, "window-tight", observers=[recorder],
                         sparse_policy="quest_style:budget_blocks=64")
    llm.generate(rounds()[0], PARAMS, use_tqdm=False)
    assert recorder.layers == set(FULL_LAYERS)
    assert recorder.allocated and max(recorder.allocated) < llm.runner.num_blocks
    assert recorder.written <= recorder.allocated


@pytest.mark.parametrize("policy", ["quest_style:budget_blocks=2",
                                    "prefill=full;decode=quest_style:budget_blocks=3"])
def test_a_sparse_policy_gives_the_gpu_cache_tokens(model, policy):
    """The policy selects on the global layers, reading the pool, with the metadata it keeps of the pool's
    blocks. Roomy pools: a sparse policy's tokens depend on the scheduling (a preempted sequence's recompute
    attends in chunks to other selections), so both engines must schedule alike."""
    want = generate(engine(model, kv_cache_memory=64 << 20, sparse_policy=policy))
    llm = offload_engine(model, sparse_policy=policy)
    assert generate(llm) == want
    assert llm.scheduler.num_preemptions == 0
    assert_nothing_held(llm)


def test_uniform_layout_keeps_the_window_layers_over_the_pool(model, roomy_tokens):
    """disable_hybrid_kv_cache_manager: one group, the window layers resident for every pool block."""
    llm = offload_engine(model, disable_hybrid_kv_cache_manager=True)
    kv = llm.runner.kv
    assert len(llm.kv_cache_groups) == 1 and kv.window_kv_cache is None and kv.num_window_blocks == 0
    assert kv.resident_layers == WINDOW_LAYERS and kv.resident_kv_cache.shape[2] == llm.runner.num_blocks
    assert generate(llm) == roomy_tokens


def test_a_window_pool_that_holds_no_sequence_is_refused_naming_the_fix(model):
    with pytest.raises(ValueError, match="sliding-window layers' GPU KV budget.*raise kv_cache_memory"):
        engine(model, kv_offloading_size=0.01, kv_offloading_buffer_size=0.01, kv_cache_memory=WINDOW_BLOCK)


@pytest.mark.gpu
def test_triton_with_cuda_graphs_gives_the_roomy_tokens(model):
    """On CUDA with the Triton backend and decode graphs (a decode policy that selects on the device, its
    budget covering every block): the roomy GPU-cache engine's tokens, in every setting."""
    policy = "prefill=full;decode=quest_style:budget_blocks=64"
    cuda = dict(device="cuda", attention_backend="triton", enforce_eager=False, sparse_policy=policy)
    want = generate(engine(model, kv_cache_memory=64 << 20, enable_prefix_caching=False, **cuda))
    for setting in SETTINGS:
        llm = offload_engine(model, setting, **cuda)
        assert llm.runner.cuda_graphs.graphs, "no decode graph was captured"
        assert generate(llm) == want, setting
        assert_nothing_held(llm)
