"""The Triton kernels' tuning knobs (``DecodeConfig``, ``PrefillConfig``) change no result: the settings the
kernel sweep tries, against the ``torch`` reference, under Triton's interpreter at small sizes (in a
subprocess, as in test_triton_backend.py; on CUDA the same cases run on the GPU); the sweep's dry run; the
split-count and knob rules."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
# the kernel cases: GPU tests on CUDA; on the CPU only inside the interpreter's subprocess
KERNELS = pytest.mark.gpu if CUDA else pytest.mark.skipif(not INTERP, reason="in the interpreter's run")

pytest.importorskip("triton")

from nanovllm.attention import triton_kernels as tk  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOL = 2e-2  # bfloat16 inputs


def paged_case(q_lens, ctx_lens, block_size, gen, kv_heads=2, group=2, head_dim=32):
    """Random bf16 KV scattered over shuffled cache blocks; q ``[sum(q_lens), H, D]``; the metadata."""
    nblk = [-(-c // block_size) for c in ctx_lens]
    pool = sum(nblk) + 2
    perm = torch.randperm(pool, generator=gen)
    tables = torch.full((len(ctx_lens), max(nblk)), -1, dtype=torch.int32)
    used = 0
    for j, n in enumerate(nblk):
        tables[j, :n] = perm[used:used + n].int()
        used += n

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEVICE)

    k_cache, v_cache = rnd(pool, block_size, kv_heads, head_dim), rnd(pool, block_size, kv_heads, head_dim)
    q = rnd(sum(q_lens), kv_heads * group, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    meta = PhaseMetadata(cu, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), tables.to(DEVICE),
                         max(q_lens), max(ctx_lens))
    return q, k_cache, v_cache, meta


def rel(a, b) -> float:
    assert torch.isfinite(a).all(), "unwritten or non-finite output"
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


DECODE_KNOBS = [
    dict(page_ahead=True),  # tiles of one page
    dict(page_ahead=True, block_n=32),  # tiles over two pages
    dict(programs_per_sm=4, max_splits=3),
    dict(heads_inner=True),
    dict(heads_inner=True, page_ahead=True),
    dict(page_ahead=True, tma=True, block_n=16),  # tensor-memory loads of one page a tile
]


@KERNELS
@pytest.mark.parametrize("knobs", DECODE_KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_interp_decode_knobs(knobs, gen):
    # contexts ending inside a tile, on a tile boundary, within the first tile, and a single key
    ctx = [70, 32, 9, 1] if INTERP else [4097, 1024, 9, 1]
    q, k_cache, v_cache, meta = paged_case([1] * len(ctx), ctx, 16, gen)
    scale = q.shape[-1] ** -0.5
    ref = TorchBackend().decode(q, k_cache, v_cache, meta, scale)
    cfg = tk._decode_config(q.shape[-1], q.dtype, q.device, 16)._replace(**knobs)
    for splits in (None, 1, 3):  # the rule's count, the direct path, splits ending mid-context
        out = torch.full_like(q, float("nan"))
        tk.attention_decode(q, k_cache, v_cache, out, None, meta.context_lens, meta.block_tables, None,
                            meta.max_context_len, scale, num_splits=splits, config=cfg)
        assert rel(out, ref) < TOL, f"decode {knobs}, {splits} splits (seed {gen.initial_seed()})"
    if INTERP and knobs.get("tma"):
        assert tk._kv_descriptors(k_cache, v_cache, True, cfg.block_n) is not None, "TMA was not used"


@KERNELS
def test_interp_decode_reduces_many_splits_in_chunks(gen):
    """More splits than ``REDUCE_CHUNK``: the reduce merges them a chunk at a time, to the same output and
    log-sum-exp as a reduce over few splits (empty splits included)."""
    ctx = [300, 70] if INTERP else [20000, 700]
    q, k_cache, v_cache, meta = paged_case([1] * len(ctx), ctx, 16, gen)
    scale = q.shape[-1] ** -0.5
    ref = TorchBackend().decode(q, k_cache, v_cache, meta, scale)
    lse_few = None
    for splits in (3, tk.REDUCE_CHUNK + 1, 2 * tk.REDUCE_CHUNK + 5):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device=q.device)
        tk.attention_decode(q, k_cache, v_cache, out, lse, meta.context_lens, meta.block_tables, None,
                            meta.max_context_len, scale, num_splits=splits)
        assert rel(out, ref) < TOL, f"decode in {splits} splits (seed {gen.initial_seed()})"
        lse_few = lse if lse_few is None else lse_few
        assert (lse - lse_few).abs().max().item() < 1e-3, f"lse over {splits} splits"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_decode_graph_replays_keep_the_tma_loads_right(gen):
    """Over pages of 128 the decode kernel reads key tiles through TMA descriptors, which a CUDA graph keeps
    by value: replays after the cache, the queries and the lengths changed give the eager output."""
    ctx = [1000, 300, 4097]
    q, k_cache, v_cache, meta = paged_case([1] * len(ctx), ctx, 128, gen, kv_heads=8, group=4, head_dim=128)
    assert tk._decode_config(128, q.dtype, q.device, 128).tma
    assert tk._kv_descriptors(k_cache, v_cache, True, 64) is not None
    scale, out = 128**-0.5, torch.empty_like(q)

    def step():
        tk.attention_decode(q, k_cache, v_cache, out, None, meta.context_lens, meta.block_tables, None, 4097,
                            scale, num_splits=4)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([999, 129, 4000], [1000, 300, 64]):
        for t in (q, k_cache, v_cache):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        meta.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out), f"replay differs from eager at lengths {lens}"
        assert rel(out, TorchBackend().decode(q, k_cache, v_cache, meta, scale)) < TOL, lens


PAGE = 64 if CUDA else 16  # the GPU's dots need tiles of 16 and more


@KERNELS
@pytest.mark.parametrize("pages_a_tile", [0.5, 1, 2], ids=["half-page", "page", "two-pages"])
def test_interp_prefill_knobs_paged(pages_a_tile, gen):
    """TMA over key tiles of half a page and of a page; over two pages the plain loads run instead."""
    lens = [(20, 20), (9, 100), (17, 50)] if INTERP else [(300, 300), (77, 1000), (129, 385)]
    q, k_cache, v_cache, meta = paged_case([a for a, _ in lens], [b for _, b in lens], PAGE, gen)
    scale = q.shape[-1] ** -0.5
    empty = q.new_empty(q.shape[0], k_cache.shape[2], q.shape[-1])
    ref = TorchBackend().prefill(q, empty, empty, k_cache, v_cache, meta, scale)
    block_n = int(PAGE * pages_a_tile)
    cfg = tk._prefill_config(q.shape[-1], q.dtype, q.device, meta.max_query_len, True)
    cfg = cfg._replace(block_m=16 if INTERP else 64, block_n=block_n, num_warps=1 if INTERP else 4, tma=True,
                       heads_first=pages_a_tile != 1, fused_scale=pages_a_tile < 2)
    out = torch.full_like(q, float("nan"))
    tk.attention_rows(q, k_cache, v_cache, out, None, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                      None, meta.max_query_len, scale, paged=True, causal=True, config=cfg)
    assert rel(out, ref) < TOL, f"paged prefill {cfg} (seed {gen.initial_seed()})"
    if INTERP:
        tma = tk._kv_descriptors(k_cache, v_cache, True, block_n) is not None
        assert tma == (pages_a_tile <= 1), "TMA serves pages of at least one key tile, and only those"


@KERNELS
def test_interp_prefill_knobs_packed(gen):
    """Packed keys as the models pass them: views into one fused projection output."""
    n, kv_heads, group, d = (45, 2, 2, 32) if INTERP else (700, 2, 4, 128)
    qkv = torch.randn(n, kv_heads * (group + 2), d, generator=gen).to(torch.bfloat16).to(DEVICE)
    q, k, v = qkv[:, :kv_heads * group], qkv[:, kv_heads * group:-kv_heads], qkv[:, -kv_heads:]
    scale = d**-0.5
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    qh, kh, vh = (t.float().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1),
                                                       v.repeat_interleave(group, 1)))
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    ref = ref.transpose(0, 1)
    cfg = tk._prefill_config(d, q.dtype, q.device, n)._replace(tma=True, heads_first=True, fused_scale=True)
    out = torch.full_like(q, float("nan"))
    tk.attention_rows(q, k, v, out, None, cu, None, None, None, n, scale, paged=False, causal=True,
                      config=cfg)
    assert rel(out, ref) < TOL, f"packed prefill {cfg} (seed {gen.initial_seed()})"
    if INTERP:
        assert tk._kv_descriptors(k, v, False, cfg.block_n) is not None, "packed views take TMA loads"


@pytest.mark.skipif(not INTERP, reason="the dry run: CPU under the interpreter only")
def test_interp_kernel_sweep_dry_run(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_sweep
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert kernel_sweep.main(["--out", str(tmp_path), "--name", "dry"]) == 0
    result = json.loads((tmp_path / "dry.json").read_text())
    assert (tmp_path / "dry.md").read_text().startswith("# dry")
    timed = [r for r in result["rows"] if r["variant"] != "cudnn sdpa"]
    shapes = {r["shape"] for r in timed}
    assert len(timed) == sum(len(s["variants"]) for s in kernel_sweep.shapes(False)) and len(shapes) >= 4
    assert all(r["value"] and r["err"] is not None and r["err"] < kernel_sweep.WRONG for r in timed), timed
    assert set(result["best"]) == shapes
    # B1's step, also in one split (the direct path: its 32 groups fill 4 waves of 2 programs on 4 SMs)
    assert any("ctx=B1" in r["shape"] and r["variant"] == "one split from 4 waves" for r in timed)
    one = kernel_sweep.decode_config("one split from 4 waves", 16)
    assert tk.num_decode_splits(kernel_sweep.B1_BATCH, kernel_sweep.HKV, kernel_sweep.B1_MAX_MODEL_LEN, 16,
                                torch.device("cpu"), one.programs_per_sm, one.max_splits, one.wave_fit,
                                one.one_split_waves, 0) == 1
    assert {"DECODE (bs=16)", "PREFILL_LONG (packed)", "PREFILL_LONG_PAGED"} <= set(result["recommended"])
    paged = result["recommended"]["PREFILL_LONG_PAGED"]
    assert eval(paged["paste"], {"PrefillConfig": tk.PrefillConfig}) == tk.PrefillConfig(**paged["config"])


# --- no kernel runs below: the rules ---


def test_split_count_follows_programs_per_sm_and_caps(monkeypatch):
    monkeypatch.setattr(tk, "num_sms", lambda device: 132)
    dev = torch.device("cuda")
    def plain(*args, **knobs):  # the rule without wave_fit, at the old defaults unless given
        return tk.num_decode_splits(*args, dev, **({"programs_per_sm": 2, "max_splits": 64} | knobs),
                                    wave_fit=False, full_wave_programs=0)

    assert plain(1, 8, 131072, 64) == 33  # 2 programs per multiprocessor
    assert plain(1, 8, 131072, 64, programs_per_sm=4) == 64  # capped
    assert plain(1, 8, 131072, 64, programs_per_sm=4, max_splits=128) == 66
    assert plain(1, 8, 1024, 64, programs_per_sm=8, max_splits=256) == 8  # 2 tiles each
    assert plain(64, 8, 4096, 64, programs_per_sm=1) == 2  # never fewer than two


@pytest.mark.parametrize("programs_per_sm", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8, 13, 64, 256])
def test_wave_fit_splits_end_in_whole_waves(batch, programs_per_sm, monkeypatch):
    """With ``wave_fit`` the programs fill their last wave at least as well as the plain rule's, within the
    same caps, and take no longer in the model it minimises (waves / splits)."""
    monkeypatch.setattr(tk, "num_sms", lambda device: 132)
    dev, groups, slots = torch.device("cuda"), batch * 8, programs_per_sm * 132

    def model_time(n):
        return -(-groups * n // slots) / n

    plain = tk.num_decode_splits(batch, 8, 16384, 64, dev, programs_per_sm, 128, one_split_waves=0,
                                 full_wave_programs=0)
    fit = tk.num_decode_splits(batch, 8, 16384, 64, dev, programs_per_sm, 128, wave_fit=True,
                               one_split_waves=0, full_wave_programs=0)
    assert 2 <= fit <= 128
    assert model_time(fit) <= model_time(plain) + 1e-9


@pytest.mark.parametrize("waves", [1, 2, 4])
def test_one_split_waves_is_a_threshold_on_the_groups(waves, monkeypatch):
    """``one_split_waves``: one split once the (sequence, KV head) groups fill that many waves of programs,
    for good (every larger batch too); below it, the rule's count without the knob."""
    monkeypatch.setattr(tk, "num_sms", lambda device: 132)
    dev, slots = torch.device("cuda"), tk.DECODE.programs_per_sm * 132
    knobs = (tk.DECODE.programs_per_sm, tk.DECODE.max_splits, tk.DECODE.wave_fit)
    for kv_heads in (1, 8):
        for batch in range(1, 513):
            splits = tk.num_decode_splits(batch, kv_heads, 4096, 64, dev, *knobs, one_split_waves=waves,
                                          full_wave_programs=0)
            without = tk.num_decode_splits(batch, kv_heads, 4096, 64, dev, *knobs, one_split_waves=0,
                                           full_wave_programs=0)
            assert without >= 2
            assert splits == (1 if batch * kv_heads >= waves * slots else without), (batch, kv_heads)


@pytest.mark.parametrize("programs", [3, 4])
def test_full_wave_programs_take_one_split_where_the_last_wave_is_nearly_full(programs, monkeypatch):
    """``full_wave_programs``: one split exactly where the groups' last wave of that many programs per
    multiprocessor holds at least ``ONE_SPLIT_FILL`` of a wave; elsewhere the count without the knob."""
    monkeypatch.setattr(tk, "num_sms", lambda device: 132)
    dev, wave = torch.device("cuda"), programs * 132
    knobs = (tk.DECODE.programs_per_sm, tk.DECODE.max_splits, tk.DECODE.wave_fit, 0)
    picked = []
    for groups in range(1, 4 * wave + 1):
        splits = tk.num_decode_splits(groups, 1, 4096, 64, dev, *knobs, full_wave_programs=programs)
        without = tk.num_decode_splits(groups, 1, 4096, 64, dev, *knobs, full_wave_programs=0)
        last = groups % wave or wave
        assert splits == (1 if last >= tk.ONE_SPLIT_FILL * wave else without), groups
        picked.append(splits == 1)
    if programs == 4:  # B1 mid-run (8 KV heads, 132 SMs): 64 sequences in one split, not 96 (1.45 waves)
        assert picked[64 * 8 - 1] and not picked[96 * 8 - 1]


def test_decode_rule_follows_page_size_not_batch():
    for bs, default in ((16, tk.DECODE), (128, tk.DECODE_LARGE_PAGES)):
        assert tk._decode_config(128, torch.bfloat16, torch.device("cuda"), bs) == default
    assert tk._decode_config(256, torch.bfloat16, torch.device("cuda"), 16).block_n == 32
    eight_bit = torch.float8_e4m3fn
    assert tk._decode_config(128, torch.bfloat16, torch.device("cuda"), 16, eight_bit) == tk.DECODE_8BIT
    assert tk._decode_config(128, torch.bfloat16, torch.device("cuda"), 128, eight_bit) == tk.DECODE_LARGE_PAGES


def test_prefill_rule_and_tuple_configs():
    cuda = torch.device("cuda")
    assert tk._prefill_config(128, torch.bfloat16, cuda, 16384) == tk.PREFILL_LONG
    assert tk._prefill_config(128, torch.bfloat16, cuda, 16384, paged=True) == tk.PREFILL_LONG_PAGED
    assert tk._prefill_config(128, torch.bfloat16, cuda, 64, paged=True) == tk.PREFILL_SHORT
    # the leading fields alone (benchmarks pass 4-tuples) leave the structural knobs off
    assert tk.PrefillConfig(*(64, 128, 4, 3)) == tk.PrefillConfig(64, 128, 4, 3, False, False, False)


def test_wide_heads_take_wide_tiles_where_shared_memory_holds_them(monkeypatch):
    cuda, narrow = torch.device("cuda"), tk.PrefillConfig(64, 32, 4, 2)
    for shared, want in ((227 * 1024, tk.PREFILL_WIDE_HEADS), (163 * 1024, narrow)):  # Hopper, A100
        monkeypatch.setattr(tk, "max_shared_memory", lambda device, shared=shared: shared)
        assert tk._prefill_config(256, torch.bfloat16, cuda, 8192, paged=True) == want
        assert tk._prefill_config(256, torch.bfloat16, cuda, 64) == narrow  # a short chunk: no 128-row tile
        assert tk._prefill_config(256, torch.float32, cuda, 8192) == tk.PrefillConfig(32, 32, 4, 2)


@pytest.mark.skipif(INTERP or CUDA, reason="plain CPU: the interpreter is off")
def test_no_tma_descriptors_without_a_kernel_to_take_them():
    k = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)
    assert tk._kv_descriptors(k, k, True, 16) is None


def test_sweep_compiles_runtime_only_settings_once():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_sweep
    finally:
        sys.path.remove(str(BENCHMARKS))
    decode = next(s for s in kernel_sweep.shapes(False) if s["kind"] == "decode")
    keys = {kernel_sweep._compile_key(decode, v) for v in kernel_sweep.DECODE_VARIANTS}
    runtime_only = [v for v, knobs in kernel_sweep.DECODE_VARIANTS.items()
                    if set(knobs) <= {"programs_per_sm", "max_splits"}]
    assert len(runtime_only) > 1
    assert len({kernel_sweep._compile_key(decode, v) for v in runtime_only}) == 1
    assert len(keys) > 1  # the compiled knobs do make kernels of their own


@pytest.mark.skipif(INTERP, reason="the sweep's full sizes")
def test_sweep_b1_decode_step(monkeypatch):
    """B1's decode step: its 256 sequences at their prompt (as ``nanovllm bench throughput`` draws them) and
    a few decoded tokens, GQA 16/8, rated over the KV it reads, in the decode group of its page size; ``b1``
    picks it alone. "one split from 4 waves" changes its split count, and no other shape's."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_sweep as ks
    finally:
        sys.path.remove(str(BENCHMARKS))
    from nanovllm.bench.engine import throughput_workload

    contexts = ks.b1_contexts()
    prompts, _ = throughput_workload()
    assert len(contexts) == 256 and all(c > len(p) for c, p in zip(contexts, prompts, strict=False))
    assert 100 < min(contexts) and max(contexts) < 1100 and 500 < sum(contexts) / 256 < 650
    b1 = ks.shapes(False, ("b1",), ks.PAGES, ks.B1_VARIANTS)
    assert [s["label"] for s in b1] == [f"b=256 ctx={ctx} gqa=16/8 bs={bs}"
                                        for ctx in ("B1", "B1 longest first") for bs in ks.PAGES]
    assert ks.b1_contexts(longest_first=True) == tuple(sorted(contexts, reverse=True))
    assert all(sorted(s["variants"]) == sorted(["default", *ks.B1_VARIANTS]) for s in b1)
    assert b1[0]["work"] == 2 * sum(contexts) * 8 * 128 * 2  # K and V, bf16
    every = ks.shapes(False, ("decode",))
    groups = ks.groups_of([ks.empty_row(s, "default") for s in every])
    assert b1[0]["label"] in groups["DECODE (bs=16)"]
    assert b1[1]["label"] in groups["DECODE_LARGE_PAGES (bs=128)"]
    assert b1[2]["label"] in groups["DECODE (bs=16)"]
    same_pages = next(s for s in every if s["build"][3] == 16)
    assert ks._compile_key(b1[0], "default") != ks._compile_key(same_pages, "default")  # its own GQA group

    monkeypatch.setattr(tk, "num_sms", lambda device: 132)
    for shape in every:
        batch, ctx, bs, _ = shape["build"][1:]
        b1_step = str(ctx).startswith("B1")
        max_keys = ks.B1_MAX_MODEL_LEN if b1_step else ctx

        def splits(variant):
            cfg = ks.decode_config(variant, bs)
            return tk.num_decode_splits(batch, ks.HKV, max_keys, cfg.block_n, torch.device("cuda"),
                                        cfg.programs_per_sm, cfg.max_splits, cfg.wave_fit,
                                        cfg.one_split_waves, cfg.full_wave_programs)

        wave = ks.decode_config("default", bs).full_wave_programs * 132
        full_wave = wave and batch * ks.HKV - (batch * ks.HKV - 1) // wave * wave >= tk.ONE_SPLIT_FILL * wave
        assert splits("split at every batch") >= 2
        assert (splits("one split from 4 waves only") == 1) == b1_step, shape["label"]
        assert splits("default") == (1 if b1_step or full_wave else splits("split at every batch"))


def test_sweep_narrows_to_the_variants_asked():
    """``--variants``: the settings named and the default, on every shape of the kinds asked; a compiled knob
    (pages read ahead) makes a kernel of its own."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_sweep
    finally:
        sys.path.remove(str(BENCHMARKS))
    decode = kernel_sweep.shapes(False, ("decode",), kernel_sweep.PAGES, ("page ahead",))
    assert len(decode) == (len(kernel_sweep.DECODE_SHAPES) + 2) * len(kernel_sweep.PAGES)  # and B1's two
    assert all(s["kind"] == "decode" and s["variants"] == ["default", "page ahead"] for s in decode)
    in_step, ahead = (kernel_sweep._compile_key(decode[0], v) for v in ("default", "page ahead"))
    assert ahead != in_step


@pytest.mark.slow
@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the cases; the subprocess, the interpreter's")
def test_knobs_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == len(DECODE_KNOBS) + 1 + 3 + 1 + 1, tail


def test_sweep_combines_the_best_of_each_axis_and_recommends_by_group():
    """On made-up rates: the combined pass joins the best kernel knob and the best split knob of a group,
    skips a union that is a variant already, and the recommendation is the best geometric mean."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_sweep as ks
    finally:
        sys.path.remove(str(BENCHMARKS))
    faster = {"page ahead": 1.05, "wave fit": 1.03, "tma": 1.04, "128x64": 1.02}
    rows = []
    for shape in ks.shapes(False):
        for variant in shape["variants"]:
            rate = faster.get(variant, 0.99 if variant != "default" else 1.0)
            rows.append(ks.empty_row(shape, variant) | dict(value=rate, vs_default=rate, err=0.0))
    combined = ks.combined_variants(rows)
    assert combined["DECODE (bs=16)"] == ("page ahead + wave fit", dict(page_ahead=True, wave_fit=True))
    assert "PREFILL_LONG (packed)" not in combined  # "tma, 128x64" is a variant already
    recommended = ks.recommend(rows)
    assert recommended["DECODE (bs=16)"]["variant"] == "page ahead"
    assert recommended["PREFILL_LONG_PAGED"]["variant"] == "tma"
    assert recommended["PREFILL_LONG_PAGED"]["paste"].startswith("PrefillConfig(block_m=128")


HOPPER_COMPILE = r'''
H, HKV, D, N, bf = 32, 8, 128, 1024, torch.bfloat16
q1, q = torch.empty(2, H, D, dtype=bf), torch.empty(N, H, D, dtype=bf)
cu, lens = torch.tensor([0, N], dtype=torch.int32), torch.tensor([N], dtype=torch.int32)
for bs in (16, 128):
    cache, table = torch.empty(N // bs, bs, HKV, D, dtype=bf), torch.zeros(2, N // bs, dtype=torch.int32)
    ahead = tk.DECODE._replace(page_ahead=True)
    tk.attention_decode(q1, cache, cache, torch.empty_like(q1), torch.empty(2, H), lens.repeat(2), table,
                        None, N, 0.1, num_splits=tk.REDUCE_CHUNK + 1, config=ahead)
    if bs == 128:
        tk.attention_decode(q1, cache, cache, torch.empty_like(q1), None, lens.repeat(2), table, None, N, 0.1,
                            num_splits=2, config=tk.DECODE_LARGE_PAGES._replace(tma=True))
        cfg = tk.PREFILL_LONG._replace(tma=True, fused_scale=True)
        tk.attention_rows(q, cache, cache, torch.empty_like(q), None, cu, lens, table[:1], None, N, 0.1,
                          paged=True, causal=True, config=cfg)
packed = torch.empty(N, HKV, D, dtype=bf)
tk.attention_rows(q, packed, packed, torch.empty_like(q), None, cu, None, None, None, N, 0.1, paged=False,
                  causal=True, config=tk.PREFILL_LONG._replace(tma=True, heads_first=True))
tma = [k for kernel in (tk._prefill_kernel, tk._decode_kernel) for k in kernel.device_caches[0][0].values()
       if "cp.async.bulk.tensor" in k.asm["ptx"]]
print("compiled", sum(len(k.device_caches[0][0]) for k in (tk._prefill_kernel, tk._decode_kernel,
                                                        tk._reduce_kernel)), "tma", len(tma))
'''


@pytest.mark.slow
@pytest.mark.skipif(CUDA or INTERP, reason="CUDA compiles for itself; the interpreter compiles nothing")
def test_structural_knobs_compile_for_hopper(tmp_path):
    """The new kernel paths (decode pages read ahead, the chunked split reduce, TMA decode over pages and TMA
    prefill over packed and paged keys, heads first, the fused scale) compile for sm_90 with the bundled
    ptxas, no GPU needed; the TMA settings use tensor-memory loads."""
    from nanovllm.testing import compile_for_hopper

    stdout = compile_for_hopper(HOPPER_COMPILE, ("_prefill_kernel", "_decode_kernel", "_reduce_kernel"), tmp_path)
    assert "compiled 7 tma 3" in stdout, stdout
