"""KV offload: the same tokens as the GPU-resident cache for dense and sparse policies, with one load slot
or many pieces per layer; the offload hooks; the load plans; errors at the boundary; and, on the GPU,
the pinned pool, the streams and the bounded GPU memory.

The conformance kit runs every policy's scenarios with offload too (test_conformance.py); these tests
cover what the kit does not: sparse budgets (selection-driven loads), the hooks, the plans themselves.
"""

from __future__ import annotations

import random

import pytest
import torch
from nanovllm import LLM, SamplingParams
from nanovllm.kv.offload import HostPhase, OffloadEngine
from nanovllm.plugins import get_plugins, reload_plugins
from nanovllm.kv import KVTransfer, KVWrite, PagedLayerKV
from nanovllm.policy import PolicyContext
from nanovllm.sparse import SparsePolicy
from quest_style import Plugin

HEAD_BLOCK_BYTES = 2 * 16 * 32 * 4  # K and V of one KV head of one 16-token block, head size 32, float32
# Two slots of 24 such head blocks (48 of the tiny Llama's, head size 16): several pieces per layer.
SMALL_BUFFER = 2 * 24 * HEAD_BLOCK_BYTES / 2**30
LLAMA_POOL_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads, head size 16


class KeyNormPolicy(SparsePolicy):
    """Selects, per sequence, the 2 history blocks whose keys have the largest norm, read through
    ``ctx.read_blocks``; the newest block always stays. Its tokens match across paths only if
    ``read_blocks`` gives the same keys on both (and ``read_keys`` and ``read_paged`` the same as ``read_blocks``)."""

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        every = ctx.all_history_blocks()
        keys, _ = ctx.read_blocks(every)  # [S, W, bs, Hkv, D]
        # the same bytes; past a sequence's end a block may hold uninitialised memory, NaN included
        torch.testing.assert_close(ctx.read_keys(every), keys, rtol=0, atol=0, equal_nan=True)
        # read_paged: the same blocks again, through a compact cache and its block tables
        present = every >= 0
        paged_k, paged_v, tables = ctx.read_paged(present)
        shown = present[..., None, None, None]
        for paged, full in ((paged_k, keys), (paged_v, ctx.read_blocks(every)[1])):
            torch.testing.assert_close(torch.where(shown, paged[tables.long()], 0), torch.where(shown, full, 0),
                                       rtol=0, atol=0, equal_nan=True)
        score = keys.float().norm(dim=-1).sum(dim=(2, 3))
        n = ctx.num_history_blocks.long()[:, None]
        idx = torch.arange(every.shape[1], device=score.device)
        score = torch.where(idx < n, score, float("-inf")).masked_fill(idx == n - 1, float("inf"))
        top = score.topk(min(3, every.shape[1]), dim=1)
        chosen = torch.where(top.values > float("-inf"), top.indices, every.shape[1]).sort(dim=1).values
        return torch.where(chosen < every.shape[1], chosen, -1).to(torch.int32)


class KeyNormPlugin:
    from nanovllm.hookspecs import hookimpl

    @hookimpl
    def register_sparse_policies(self, registry) -> None:
        registry.add_sparse_policy("key_norm", f"{__name__}:KeyNormPolicy")


@pytest.fixture(scope="module", autouse=True)
def registered(one_thread):
    plugins = get_plugins()
    plugins.register(Plugin(), "quest-style")
    plugins.register(KeyNormPlugin(), "key-norm")
    yield
    reload_plugins()


def _prompts(lengths: list[int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in lengths]


def _engine(model: str, device: str = "cpu", offload_buffer: float | None = None, **options) -> LLM:
    base = dict(device=device, dtype="float32", block_size=16, max_model_len=512, max_num_seqs=8,
                enforce_eager=True)
    base.update(options)
    if offload_buffer is None:
        return LLM(model, kv_cache_memory=64 << 20, **base)
    return LLM(model, kv_offloading_size=0.01, kv_offloading_buffer_size=offload_buffer, **base)


def _same_outputs(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert abs(g.outputs[0].cumulative_logprob - w.outputs[0].cumulative_logprob) < 1e-4


PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
# dense_layers=1: a dense layer prefetches the next layer's first dense piece, which a selection must not use
@pytest.mark.parametrize("policy", ["full", "quest_style:budget_blocks=2", "prefill=full;decode=quest_style:budget_blocks=3",
                                    "quest_style:budget_blocks=2,dense_layers=1", "key_norm"])
@pytest.mark.parametrize("chunk", [512, 16])
def test_offload_gives_the_gpu_cache_tokens(tiny_model, architecture, policy, chunk):
    """Sparse budgets included: the selection-driven loads read exactly the selected blocks per head."""
    model = tiny_model(architecture)
    prompts = _prompts([5, 40, 97, 130])
    want = _engine(model, sparse_policy=policy, max_num_batched_tokens=chunk).generate(prompts, PARAMS, use_tqdm=False)
    for buffer in (1.0, SMALL_BUFFER):
        llm = _engine(model, offload_buffer=buffer, sparse_policy=policy, max_num_batched_tokens=chunk)
        _same_outputs(llm.generate(prompts, PARAMS, use_tqdm=False), want)


def test_run_copies_give_the_gather_tokens(tiny_model, monkeypatch):
    from nanovllm.kv import offload

    prompts = _prompts([300, 200, 40])
    want = _engine(tiny_model(), offload_buffer=SMALL_BUFFER).generate(prompts, PARAMS, use_tqdm=False)
    monkeypatch.setattr(offload, "MIN_COPY_BYTES", 0)
    _same_outputs(_engine(tiny_model(), offload_buffer=SMALL_BUFFER).generate(prompts, PARAMS, use_tqdm=False), want)


def test_many_pieces_per_layer_are_really_used(tiny_model):
    llm = _engine(tiny_model(), offload_buffer=SMALL_BUFFER)
    engine = llm.runner.kv.engine
    assert engine.capacity == 48
    calls = []
    original = engine._load
    engine._load = lambda layer_id, *args: calls.append(layer_id) or original(layer_id, *args)
    llm.generate(_prompts([300, 200]), SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    per_layer = len(calls) / len(llm.runner.attention_layers)
    assert per_layer == 2 * 2  # two decode steps, each over 32 blocks x 2 heads in slots of 48 head blocks


def _all_offloaded(monkeypatch) -> None:
    """The quest-style policy without its dense layers resident: every layer in the host pool."""
    import quest_style

    monkeypatch.setattr(quest_style.QuestStylePolicy, "dense_layers", lambda self, num_layers: frozenset())


@pytest.mark.parametrize("chunk", [512, 16])
def test_dense_layers_stay_resident_with_the_same_tokens(tiny_model, monkeypatch, chunk):
    """A policy's dense layers keep their KV in a paged GPU cache under offload; the pool holds the rest.
    Tokens match the all-offloaded run and the run without offload."""
    model = tiny_model(num_hidden_layers=3)
    policy = "quest_style:budget_blocks=2,dense_layers=2"
    prompts = _prompts([5, 40, 97, 130])
    options = dict(sparse_policy=policy, max_num_batched_tokens=chunk)
    want = _engine(model, **options).generate(prompts, PARAMS, use_tqdm=False)
    llm = _engine(model, offload_buffer=SMALL_BUFFER, **options)
    runner = llm.runner
    store = runner.kv
    assert store.resident_layers == [0, 1] and store.engine.layers == [2]
    assert store.engine.pool.shape[0] == 1
    assert store.resident_kv_cache.shape == (2, 2, runner.num_blocks, 16, 2, 16)
    for layer in runner.attention_layers:  # resident layers read and write the GPU cache, without the engine
        assert isinstance(layer.kv, PagedLayerKV) == (layer.layer_id < 2)
        if layer.layer_id < 2:
            assert layer.k_cache.data_ptr() == store.resident_kv_cache[layer.layer_id, 0].data_ptr()
    stored, to_pool = [], store.engine.store
    store.engine.store = lambda layer_id, *args: stored.append(layer_id) or to_pool(layer_id, *args)
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    _same_outputs(got, want)
    assert set(stored) == {2}  # the resident layers' new K/V never go to the pool
    # the pool is sized by the offloaded layer alone
    assert runner.num_blocks == int(0.01 * 2**30 // (LLAMA_POOL_BLOCK_BYTES // 2))
    with monkeypatch.context() as patched:
        _all_offloaded(patched)
        everything = _engine(model, offload_buffer=SMALL_BUFFER, **options)
        assert everything.runner.kv.resident_layers == [] and everything.runner.kv.engine.layers == [0, 1, 2]
        _same_outputs(everything.generate(prompts, PARAMS, use_tqdm=False), got)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_resident_layer_between_offloaded_ones_is_skipped_by_the_prefetch(tiny_model, monkeypatch, device):
    """Layer 1 resident: the dense prefill of layer 0 prefetches layer 2's first piece, which layer 2 uses."""
    import quest_style

    monkeypatch.setattr(quest_style.QuestStylePolicy, "dense_layers", lambda self, num_layers: frozenset({1}))
    model = tiny_model(num_hidden_layers=3)
    options = dict(device=device, sparse_policy="prefill=full;decode=quest_style:budget_blocks=2",
                   max_num_batched_tokens=32)
    prompts = _prompts([97, 130])  # the first prompt's later chunks run alone: prefill-only steps prefetch
    want = _engine(model, **options).generate(prompts, PARAMS, use_tqdm=False)
    llm = _engine(model, offload_buffer=1.0, **options)
    assert llm.runner.kv.engine.layers == [0, 2]
    engine, used = llm.runner.kv.engine, []
    run = engine._run
    def recording_run(ctx, *args):
        used.append((ctx.layer_id, (ctx.layer_id, ctx.is_prefill) in engine._prefetched))
        return run(ctx, *args)

    engine._run = recording_run
    _same_outputs(llm.generate(prompts, PARAMS, use_tqdm=False), want)
    assert (2, True) in used  # a prefetched piece was waiting for layer 2


@pytest.mark.gpu
def test_gpu_resident_layers_that_do_not_fit_are_refused_naming_the_fix(tiny_model):
    with pytest.raises(ValueError, match="dense layers it keeps resident.*lower kv_offloading_size"):
        LLM(tiny_model(), device="cuda", dtype="float32", block_size=16, max_model_len=512,
            enforce_eager=True, sparse_policy="quest_style:dense_layers=1", kv_offloading_size=2,
            kv_offloading_buffer_size=0.01, gpu_memory_utilization=0.02)  # 2 GiB resident: over 2% of a GPU


def test_dense_layers_that_leave_nothing_to_offload_are_refused(tiny_model):
    with pytest.raises(ValueError, match="all 2 layers dense.*drop kv_offloading_size.*skip_layers"):
        _engine(tiny_model(), offload_buffer=1.0, sparse_policy="quest_style:dense_layers=2")
    # without offload the same policy runs, every layer dense
    _engine(tiny_model(), sparse_policy="quest_style:dense_layers=2")


def test_a_policy_that_refuses_offload_fails_at_start_and_only_with_offload(tiny_model, monkeypatch):
    import quest_style

    def refuse(self) -> None:
        raise ValueError("quest_style: this option needs the GPU cache; drop kv_offloading_size")

    monkeypatch.setattr(quest_style.QuestStylePolicy, "check_offload", refuse)
    with pytest.raises(ValueError, match="needs the GPU cache; drop kv_offloading_size"):
        _engine(tiny_model(), offload_buffer=1.0, sparse_policy="quest_style:budget_blocks=2")
    _engine(tiny_model(), sparse_policy="quest_style:budget_blocks=2")  # the GPU cache: never asked


@pytest.mark.parametrize("cached", [True, False])
def test_a_sparse_layer_costs_few_host_operations(tiny_model, monkeypatch, cached):
    """Torch ops the host issues per sparse layer on the selected-blocks path (``attend_selected``), with
    each call that is one launch on the GPU (the per-piece kernels, the backend's ``attend_blocks``)
    counted once, through the selection cache and through the ring. 103 before the piece kernels; the
    bound keeps it from creeping back."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from nanovllm.kv import offload

    llm = _engine(tiny_model(), offload_buffer=1.0, sparse_policy="quest_style:budget_blocks=2")
    if not cached:
        monkeypatch.setattr(llm.runner.kv.engine, "_cache_fits", lambda num_seqs, k: False)

    def one_range(owner, name):
        call = getattr(owner, name)

        def ranged(*args, **kwargs):
            with record_function(name):
                return call(*args, **kwargs)

        monkeypatch.setattr(owner, name, ranged)

    for owner, name in ((llm.runner.kv.engine, "attend_selected"), (llm.runner.backend, "attend_blocks"),
                        (offload, "selected_piece"), (offload, "cached_piece"), (offload, "patch_slot"),
                        (offload, "load_misses")):
        one_range(owner, name)
    prompts = _prompts([100, 130])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    per_layer = [[c.name for c in e.cpu_children] for e in prof.events() if e.name == "attend_selected"]
    assert len(per_layer) % 2 == 0 and len(per_layer) >= 4  # decode steps, two layers each
    # the prefill step's selections go through the ring, the decode steps' through the cache if it is on
    pieces = [[n for n in names if n in ("selected_piece", "cached_piece")] for names in per_layer]
    assert all(names.count("attend_blocks") == 1 for names in per_layer) and all(len(p) == 1 for p in pieces)
    assert sum(p == ["cached_piece"] for p in pieces) == (4 if cached else 0), pieces
    assert all(names.count("load_misses") == ("cached_piece" in names) for names in per_layer)
    # the step's first layer also builds the virtual batch's cu_seqlens (9 ops), which the second reuses,
    # the first piece of a new shape its block tables (2), and the first load into the ring empties the
    # selection cache (1)
    counts = [len(names) for names in per_layer]
    assert max(counts[1::2]) <= 16 and max(counts[0::2]) <= 28, per_layer


@pytest.mark.parametrize("lengths,max_tokens", [
    ([40, 97, 130, 33, 70], (30, 12, 40, 25, 33)),
    ([5, 9], (40, 30)),  # selections of 1, 2, then 3 blocks: the regions' layout changes as they grow
])
def test_the_selection_cache_gives_the_ring_tokens_and_reuses_blocks(tiny_model, monkeypatch, lengths, max_tokens):
    """Decode selections through the cache regions give the tokens of the ring and of the GPU cache, while
    sequences finish at different steps (the others move to other rows), and reuse head blocks."""
    model, policy = tiny_model(), "prefill=full;decode=quest_style:budget_blocks=3"
    prompts = _prompts(lengths, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in max_tokens]
    want = _engine(model, sparse_policy=policy).generate(prompts, params, use_tqdm=False)
    for cached in (True, False):
        llm = _engine(model, offload_buffer=1.0, sparse_policy=policy)
        engine = llm.runner.kv.engine
        uses = []
        fits = engine._cache_fits if cached else (lambda num_seqs, k: False)
        monkeypatch.setattr(engine, "_cache_fits",
                            lambda num_seqs, k: uses.append(fits(num_seqs, k)) or uses[-1])
        _same_outputs(llm.generate(prompts, params, use_tqdm=False), want)
        assert all(uses) == cached and len(uses) >= 2 * (max(max_tokens) - 1)  # two layers a decode step
        loaded, reused = engine.cache_counts.tolist()
        assert (reused > 0.2 * (loaded + reused)) if cached else loaded == reused == 0, (loaded, reused)


def test_blocks_handed_out_again_leave_the_selection_cache(tiny_model):
    """The model runner tells the offload engine which blocks a step hands out; the cache forgets exactly
    those blocks' head blocks, in every layer."""
    policy = "prefill=full;decode=quest_style:budget_blocks=3"
    llm = _engine(tiny_model(), offload_buffer=1.0, sparse_policy=policy)
    engine, told = llm.runner.kv.engine, []
    forget = engine.forget_blocks
    engine.forget_blocks = lambda ids: told.append(ids.tolist()) or forget(ids)
    llm.generate(_prompts([40, 20]), SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    # 3 + 2 blocks for the prompts, 2 + 2 more as they grow to 70 and 50 tokens
    assert sorted(b for ids in told for b in ids) == list(range(3 + 2 + 2 + 2))
    held, hkv, blocks = engine._held, engine.num_kv_heads, engine.num_blocks + 1
    with torch.inference_mode():  # as the model runner calls it
        # head blocks of both layers' pools, and some positions that hold nothing
        held.copy_(torch.arange(held.numel(), dtype=torch.int32) * 7 % (2 * blocks * hkv))
        held[::5] = -1
        before = held.clone()
        engine.forget_blocks(torch.tensor([2, 5]))
    gone = torch.isin(before // hkv % blocks, torch.tensor([2, 5])) & (before >= 0)
    assert (before // hkv >= blocks)[gone].any()  # the second layer's too
    assert gone.any() and (held[gone] == -1).all() and torch.equal(held[~gone], before[~gone])


class OffloadRecorder:
    """An observer of the offload notifications and of ``on_kv_write``: rows written at layer 0, and the
    transfers of each phase and kind."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {"prefill": 0, "decode": 0, "kv_write": 0}
        self.transfers: list[KVTransfer] = []

    def _told(self, transfer: KVTransfer, phase: str) -> None:
        assert transfer.is_prefill == (phase == "prefill") and transfer.kind in ("store", "load")
        self.transfers.append(transfer)
        if transfer.kind == "store" and transfer.layer_id == 0:
            self.rows[phase] += transfer.blocks.shape[0]

    def on_prefill_offload(self, transfer: KVTransfer) -> None:
        self._told(transfer, "prefill")

    def on_decode_offload(self, transfer: KVTransfer) -> None:
        self._told(transfer, "decode")

    def on_kv_write(self, write: KVWrite) -> None:
        self.rows["kv_write"] += write.key.shape[0] * (write.layer_id == 0)


class KVWriteOnly:
    def __init__(self) -> None:
        self.rows = 0
        self.fill_ok = True

    def on_kv_write(self, write: KVWrite) -> None:
        if write.layer_id == 0:
            self.rows += write.key.shape[0]
            self.fill_ok &= bool((write.block_fill() >= 1).all())


def test_offload_hooks_report_stores_and_loads_and_on_kv_write_runs_on_both_stores(tiny_model):
    """With offload the notifications report each phase's stores (every new row, at every offloaded layer)
    and loads; ``on_kv_write`` runs for every row on both stores, so no policy needs the notifications."""
    recorder, writes = OffloadRecorder(), KVWriteOnly()
    llm = _engine(tiny_model(), offload_buffer=1.0, max_num_batched_tokens=32, observers=[recorder, writes])
    llm.generate(_prompts([40, 7]), SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    # every prompt token stored in a prefill phase, every later token in a decode phase, and on_kv_write
    # saw them all
    assert recorder.rows == {"prefill": 47, "decode": 2 * 4, "kv_write": 47 + 8}
    assert writes.rows == 47 + 8 and writes.fill_ok
    loads = [t for t in recorder.transfers if t.kind == "load"]
    assert {t.is_prefill for t in loads} == {False, True}  # the 40-token prompt's later chunks read history
    assert {t.layer_id for t in recorder.transfers} == {0, 1}
    engine = llm.runner.kv.engine
    assert all(t.unit_bytes == engine.head_block_bytes for t in loads)

    on_gpu = OffloadRecorder()
    _engine(tiny_model(), observers=[on_gpu]).generate(_prompts([40, 7]), SamplingParams(max_tokens=5, ignore_eos=True),
                                                       use_tqdm=False)
    assert on_gpu.rows == {"prefill": 0, "decode": 0, "kv_write": 47 + 8} and not on_gpu.transfers


def _plan(capacity_heads: int, tables: list[list[int]], q_lens: list[int], ctx_lens: list[int], prefill: bool):
    engine = OffloadEngine([0], 64, 4, 2, 8, torch.float32, torch.device("cpu"), 2 * capacity_heads * 2 * 4 * 8 * 4, 2)
    assert engine.capacity == capacity_heads
    return engine, list(engine._dense_plan(HostPhase(tables, q_lens, ctx_lens), prefill))


@pytest.mark.parametrize("prefill", [False, True])
def test_dense_plan_loads_every_history_block_once_within_capacity(prefill):
    tables = [list(range(0, 9)), list(range(20, 23))]  # 9 and 3 blocks of 4 tokens
    q_lens, ctx_lens = ([5, 2], [35, 10]) if prefill else ([1, 1], [35, 10])
    engine, pieces = _plan(8, tables, q_lens, ctx_lens, prefill)
    history = [c - q if prefill else c for c, q in zip(ctx_lens, q_lens)]
    loaded = [int(i) for p in pieces for i in p.ids]
    assert all(p.ids.shape[0] <= engine.capacity for p in pieces)
    want = [b * 2 + h for s, t in enumerate(tables) for b in t[: -(-history[s] // 4)] for h in (0, 1)]
    assert sorted(loaded) == sorted(want)  # each head block of the history once
    tokens = torch.stack([p.kv_lens.view(2, 2) for p in pieces]).sum(0)
    assert tokens.tolist() == [history, history]  # both heads see every history token exactly once
    if prefill:
        assert all(p.rows is None for p in pieces)
    else:  # the new token is patched into exactly one piece per sequence and head
        patched = sum((p.rows != engine.scratch_row).long() for p in pieces)
        assert patched.tolist() == [[1, 1], [1, 1]]


def test_dense_plan_copies_blocks_in_any_allocation_order_as_few_runs(monkeypatch):
    from nanovllm.kv import offload

    monkeypatch.setattr(offload, "MIN_COPY_BYTES", 0)
    # the block manager hands a freed sequence's tail out first: descending ids, and a prefix shared by two
    tables = [list(range(30, 20, -1)), [30, 29, 5, 6]]
    engine, pieces = _plan(64, tables, [1, 1], [40, 16], False)
    (piece,) = pieces
    assert piece.runs == [(10, 0, 4), (42, 4, 20)]  # blocks 5-6 and 21-30, every head, shared blocks once
    tables_t = piece.tables.view(2, 2, -1)  # [head, sequence, block]
    for s, table in enumerate(tables):  # each sequence's j-th block of head h sits where its pool row went
        for j, block in enumerate(table):
            for h in (0, 1):
                slot_row = int(tables_t[h, s, j])
                first, at, _ = next(r for r in piece.runs if r[1] <= slot_row < r[1] + r[2])
                assert first + slot_row - at == block * 2 + h


def test_offload_errors_name_the_option_and_the_fix(tiny_model):
    with pytest.raises(ValueError, match="kv_offloading_buffer_size is too small.*at least .* GiB or lower max_num_seqs"):
        _engine(tiny_model(), offload_buffer=1e-6)
    with pytest.raises(ValueError, match="kv_offloading_size=1e-05 GiB holds .* fewer than max_model_len=512"):
        LLM(tiny_model(), device="cpu", kv_offloading_size=1e-5)
    for bad in (0, -1, "2", True):
        with pytest.raises(ValueError, match="kv_offloading_size is a size in GiB"):
            LLM(tiny_model(), device="cpu", kv_offloading_size=bad)


def test_offload_keeps_no_kv_cache_on_the_device_and_serves_preemption(tiny_model):
    # a pool of 12 blocks for three prompts that need 4-5 each plus their tokens: they preempt each other
    llm = LLM(tiny_model(), device="cpu", dtype="float32", block_size=16, max_model_len=96, max_num_seqs=8,
              enforce_eager=True, kv_offloading_size=12 * LLAMA_POOL_BLOCK_BYTES / 2**30,
              kv_offloading_buffer_size=SMALL_BUFFER)
    runner = llm.runner
    assert runner.num_blocks == 12 and not hasattr(runner.kv, "kv_cache")
    assert runner.kv.engine.pool.shape[1] == 13  # the pool's blocks and its scratch block
    prompts = _prompts([60, 55, 50], seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    want = _engine(tiny_model(), max_model_len=96).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


# -- on the GPU: pinned pool, streams, events, memory -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["full", "quest_style:budget_blocks=2", "quest_style:budget_blocks=2,dense_layers=1"])
@pytest.mark.parametrize("copies", ["gather", "runs"])
def test_gpu_offload_gives_the_gpu_cache_tokens(tiny_model, policy, copies, monkeypatch):
    from nanovllm.kv import offload

    if copies == "runs":  # every dense piece through the copy engines, however short its runs
        monkeypatch.setattr(offload, "MIN_COPY_BYTES", 0)
    model = tiny_model()
    prompts = _prompts([5, 40, 97, 130, 300])
    want = _engine(model, device="cuda", sparse_policy=policy, max_num_batched_tokens=64).generate(
        prompts, PARAMS, use_tqdm=False)
    for buffer in (1.0, SMALL_BUFFER):
        llm = _engine(model, device="cuda", offload_buffer=buffer, sparse_policy=policy, max_num_batched_tokens=64)
        engine = llm.runner.kv.engine
        assert engine.pool.is_pinned() and engine.pool.device.type == "cpu"
        assert engine.load_stream != torch.cuda.current_stream() != engine.store_stream
        _same_outputs(llm.generate(prompts, PARAMS, use_tqdm=False), want)


@pytest.mark.gpu
def test_gpu_selection_cache_under_cuda_graphs_gives_the_ring_tokens(tiny_model):
    """Decode graphs (batches padded to 1, 2, 4, 8) through the selection cache, against eager decode
    through the ring, while sequences finish at different steps (the tiny Qwen3: Triton's head sizes)."""
    model, policy = tiny_model("Qwen3ForCausalLM"), "prefill=full;decode=quest_style:budget_blocks=3"
    prompts = _prompts([40, 97, 130, 33, 70], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (30, 12, 40, 25, 33)]
    options = dict(device="cuda", attention_backend="triton", offload_buffer=1.0, sparse_policy=policy)
    want = _engine(model, **options, kv_offloading_reuse_selections=False).generate(prompts, params, use_tqdm=False)
    llm = _engine(model, **options, enforce_eager=False)
    assert llm.runner.cuda_graphs.graphs
    _same_outputs(llm.generate(prompts, params, use_tqdm=False), want)
    loaded, reused = llm.runner.kv.engine.cache_counts.tolist()
    assert reused > 0.2 * (loaded + reused), (loaded, reused)


@pytest.mark.gpu
def test_gpu_device_view_reads_and_writes_pinned_memory():
    from nanovllm.kv.offload import device_view

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        host = torch.randn(64, 33, pin_memory=True).to(dtype).pin_memory()
        view = device_view(host)
        assert view.device.type == "cuda" and view.dtype == dtype and view.shape == host.shape
        ids = torch.tensor([5, 0, 63], device="cuda")
        assert torch.equal(view[ids].cpu(), host[ids.cpu()])
        view[7] = 3.0
        torch.cuda.synchronize()
        assert (host[7] == 3.0).all()


@pytest.mark.gpu
def test_gpu_memory_for_kv_is_the_load_slots(tiny_model):
    """The GPU holds the load slots, whatever the pool's size."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = _engine(tiny_model(), device="cuda", offload_buffer=SMALL_BUFFER)
    weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    assert torch.cuda.memory_allocated() - before - weights <= llm.runner.kv.engine.gpu_bytes + (1 << 20)
    assert llm.runner.kv.engine.gpu_bytes <= SMALL_BUFFER * 2**30 + 2 * HEAD_BLOCK_BYTES
