"""The ``triton`` attention backend against the ``torch`` reference, on fresh random inputs.

Two modes: on CUDA (``gpu`` marker; head dims 64/128, GQA 1/2/4/8, block sizes 16/256, bf16/fp16,
lengths that are not multiples of any tile), and, on a machine without CUDA, the same checks at
small sizes under Triton's interpreter (``TRITON_INTERPRET=1``), in a subprocess that runs this
file's ``interp`` cases (about 80 s on two cores). Every output buffer the backend allocates is
poisoned with NaN first, so an element the kernels never write fails the check. ``attend_blocks`` is
checked with both forms of selection, one list per sequence and one per KV head.
"""

from __future__ import annotations

import os

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.policy import PolicyContext
from nanovllm.sparse import SparsePolicy

CUDA = torch.cuda.is_available()
# Interpreter mode: this file re-run by ``test_kernels_under_interpreter`` in a subprocess whose
# environment sets TRITON_INTERPRET=1 before anything imports triton (its own helpers are built at
# import time, so setting it later in a process that already imported triton does not work).
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"

pytest.importorskip("triton")

from nanovllm.attention import triton_backend as tb  # noqa: E402
from nanovllm.attention import triton_kernels as tk  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
LSE_TOL = {torch.bfloat16: 2e-3, torch.float16: 2e-3, torch.float32: 1e-4}

# (dtype, head_dim, group, block_size): every head dim meets every group and block size, and
# each dtype meets every head dim and block size.
GPU_CONFIGS = [
    (dt, d, g, bs)
    for d in (64, 128)
    for g in (1, 2, 4, 8)
    for bs in (16, 256)
    for dt in [(torch.bfloat16 if (g + bs // 16 + d // 64) % 2 == 0 else torch.float16)]
] + [(torch.float32, 128, 4, 16), (torch.bfloat16, 32, 2, 16), (torch.float16, 32, 1, 256)]
INTERP_CONFIGS = [
    (torch.bfloat16, 64, 1, 16),
    (torch.float16, 128, 2, 256),
    (torch.bfloat16, 64, 8, 16),
    (torch.float32, 32, 2, 16),
    (torch.bfloat16, 64, 2, 8),  # blocks smaller than the decode tile: selected tiles span several blocks
]


def _cfg_id(c) -> str:
    dt, d, g, bs = c
    return f"{str(dt).removeprefix('torch.')}-d{d}-g{g}-bs{bs}"


# the interpreter cases exist only inside the subprocess that test_kernels_under_interpreter starts
PARAMS = [pytest.param("cuda", *c, id="gpu-" + _cfg_id(c), marks=pytest.mark.gpu) for c in GPU_CONFIGS] + [
    pytest.param("cpu", *c, id="interp-" + _cfg_id(c)) for c in (INTERP_CONFIGS if INTERP else [])
]
cases = pytest.mark.parametrize("device,dtype,head_dim,group,block_size", PARAMS)
# the staged contexts' cases: the GPU's whose cache pages divide a staged page, and two interpreted ones (pages
# of 16 and of 8 tokens), which keep the interpreter's run short
STAGING_INTERP_CONFIGS = [INTERP_CONFIGS[0], INTERP_CONFIGS[4]]
STAGING_PARAMS = [p for p in PARAMS if p.values[0] == "cuda" and tk.STAGED_PAGE % p.values[4] == 0] + [
    pytest.param("cpu", *c, id="interp-" + _cfg_id(c)) for c in (STAGING_INTERP_CONFIGS if INTERP else [])
]
staging_cases = pytest.mark.parametrize("device,dtype,head_dim,group,block_size", STAGING_PARAMS)

# (query length, context length) per sequence: a fresh prompt, a prefix-cache hit / later chunk, a
# single token over a long prefix, a chunk crossing block and tile boundaries.
GPU_PREFILL = [(300, 300), (77, 1000), (1, 513), (129, 385)]
INTERP_PREFILL = [(20, 20), (7, 40), (1, 18), (17, 33)]
GPU_SHORT = [(1, 513), (40, 1000), (7, 70), (64, 64)]
GPU_DECODE = [1, 17, 1000, 4097, 300]
INTERP_DECODE = [1, 17, 70, 33]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Outputs start as NaN: an element a kernel does not write fails ``finite`` below."""
    monkeypatch.setattr(tb, "_empty_out", lambda q: torch.full_like(q, float("nan")))
    monkeypatch.setattr(
        tb, "_empty_lse",
        lambda q: torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device),
    )


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)  # the seed is in every failure message


class Case:
    """Random paged KV for a batch: cache blocks scattered in a shuffled pool, tables padded with -1."""

    def __init__(self, q_lens, ctx_lens, num_kv_heads, group, head_dim, block_size, dtype, device, gen):
        self.scale = head_dim**-0.5
        s = len(q_lens)
        nblk = [-(-c // block_size) for c in ctx_lens]
        total = sum(nblk) + 3  # a few blocks nobody owns
        perm = torch.randperm(total, generator=gen)
        tables = torch.full((s, max(nblk) + 1), -1, dtype=torch.int32)
        i = 0
        for j, n in enumerate(nblk):
            tables[j, :n] = perm[i : i + n].int()
            i += n

        def rnd(*shape, mult=1.0):
            return (torch.randn(*shape, generator=gen) * mult).to(dtype).to(device)

        h = num_kv_heads * group
        t = sum(q_lens)
        self.k_cache = rnd(total, block_size, num_kv_heads, head_dim)
        self.v_cache = rnd(total, block_size, num_kv_heads, head_dim)
        # q, k, v are views into one fused projection output, as the models pass them
        qkv = rnd(t, h + 2 * num_kv_heads, head_dim)
        self.q = qkv[:, :h].mul_(2.0)
        self.k = qkv[:, h : h + num_kv_heads]
        self.v = qkv[:, h + num_kv_heads :]
        slots = [
            int(tables[j, p // block_size]) * block_size + p % block_size
            for j in range(s)
            for p in range(ctx_lens[j] - q_lens[j], ctx_lens[j])
        ]
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        self.meta = PhaseMetadata(
            cu, torch.tensor(ctx_lens, dtype=torch.int32, device=device), tables.to(device),
            max(q_lens), max(ctx_lens),
        )
        self.nblk = nblk
        TorchBackend().store_kv(self.k, self.v, self.k_cache, self.v_cache, self.slots)


def _check(out, ref, dtype, what, gen):
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    assert torch.isfinite(out).all(), f"{what}: unwritten or non-finite output (seed {gen.initial_seed()})"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert err < TOL[dtype], f"{what}: relative error {err:.2e} (seed {gen.initial_seed()})"


def _check_lse(lse, ref, dtype, what, gen):
    assert lse.dtype == torch.float32 and lse.shape == ref.shape, what
    assert not torch.isnan(lse).any(), f"{what}: unwritten lse (seed {gen.initial_seed()})"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), f"{what}: -inf pattern differs"
    fin = torch.isfinite(ref)
    err = (lse[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err < LSE_TOL[dtype], f"{what}: lse error {err:.2e} (seed {gen.initial_seed()})"


def _kv_heads(device) -> int:
    return 2 if device == "cuda" else 1  # the interpreter's time grows with the number of programs


def _prefill_lens(device, short: bool = False):
    if short:  # every chunk short: the kernels' small-query-tile configuration
        return GPU_SHORT if device == "cuda" else INTERP_PREFILL
    return GPU_PREFILL if device == "cuda" else INTERP_PREFILL


@cases
def test_store_kv(device, dtype, head_dim, group, block_size, gen):
    c = Case([5, 40, 3], [5, 50, 300 if device == "cuda" else 30], _kv_heads(device), group, head_dim,
             block_size, dtype, device, gen)
    slots = c.slots.clone()
    slots[torch.randperm(slots.numel(), generator=gen)[:5].to(device)] = -1  # skipped tokens
    k_ref, v_ref = c.k_cache.clone(), c.v_cache.clone()
    k_tri, v_tri = c.k_cache.clone(), c.v_cache.clone()
    new_k, new_v = torch.randn_like(c.k), torch.randn_like(c.v)
    TorchBackend().store_kv(new_k, new_v, k_ref, v_ref, slots)
    tb.TritonBackend().store_kv(new_k, new_v, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    # non-contiguous inputs (views out of a fused qkv projection)
    qkv = torch.randn(c.k.shape[0], 3, *c.k.shape[1:], device=device).to(dtype)
    TorchBackend().store_kv(qkv[:, 1], qkv[:, 2], k_ref, v_ref, slots)
    tb.TritonBackend().store_kv(qkv[:, 1], qkv[:, 2], k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)


@cases
@pytest.mark.parametrize("short", [False, True], ids=["long", "short"])
def test_prefill_paged(device, dtype, head_dim, group, block_size, short, gen):
    if short and device != "cuda":
        pytest.skip("the interpreter uses one tile configuration")
    lens = _prefill_lens(device, short)
    c = Case([q for q, _ in lens], [k for _, k in lens], _kv_heads(device), group, head_dim, block_size,
             dtype, device, gen)
    args = (c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    _check(tb.TritonBackend().prefill(*args), TorchBackend().prefill(*args), dtype, "prefill", gen)


@cases
def test_prefill_paged_key_tiles(device, dtype, head_dim, group, block_size, gen):
    """Key tiles of 2 and 8 cache blocks of 16 (one block of 256), whose block-table entries the kernel
    reads a tile ahead: every tile, the last one past the table's end included, reads the right blocks.
    Interpreted: chunks behind a history of several unmasked key tiles."""
    lens = GPU_PREFILL if device == "cuda" else [(9, 100), (20, 90)]
    c = Case([q for q, _ in lens], [k for _, k in lens], _kv_heads(device), group, head_dim, block_size,
             dtype, device, gen)
    ref = TorchBackend().prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    m = c.meta
    configs = [(64, 128, 4, 3)] if device == "cuda" and dtype != torch.float32 else [(16, 32, 1, 1)]
    for cfg in configs:
        out = torch.full_like(c.q, float("nan"))
        tk.attention_rows(c.q, c.k_cache, c.v_cache, out, None, m.cu_seqlens_q, m.context_lens, m.block_tables,
                          None, m.max_query_len, c.scale, paged=True, causal=True, config=cfg)
        _check(out, ref, dtype, f"paged prefill, tiles {cfg}", gen)


@cases
def test_prefill_single_fresh(device, dtype, head_dim, group, block_size, gen):
    n = 1000 if device == "cuda" else 37
    c = Case([n], [n], _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    args = (c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    ref = TorchBackend().prefill(*args)
    backend = tb.TritonBackend()
    backend.sdpa_prefill = False  # the Triton kernel on the dense new k/v
    _check(backend.prefill(*args), ref, dtype, "fresh prefill (triton)", gen)
    backend.sdpa_prefill = True  # torch SDPA (CUDA only)
    for mode in ("cudnn", "priority", "plain") if device == "cuda" else ():
        backend.sdpa_mode = mode
        _check(backend.prefill(*args), ref, dtype, f"fresh prefill (sdpa {mode})", gen)


def _with_host_lens(meta: PhaseMetadata, q_lens, ctx_lens) -> PhaseMetadata:
    return PhaseMetadata(meta.cu_seqlens_q, meta.context_lens, meta.block_tables, meta.max_query_len,
                         meta.max_context_len, tuple(q_lens), tuple(ctx_lens))


def _staging_case(device, dtype, head_dim, group, block_size, gen, monkeypatch):
    """``(case, metadata with host lengths, backend)``: chunks with history, and a backend that stages every
    phase into a workspace exactly as large as their contexts' pages (each context from a page of its own)."""
    lens = GPU_PREFILL if device == "cuda" else INTERP_PREFILL
    q_lens, ctx_lens = [q for q, _ in lens], [k for _, k in lens]
    c = Case(q_lens, ctx_lens, _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    backend = tb.TritonBackend()
    backend.stage_contexts = True
    rows = sum(-(-n // tk.STAGED_PAGE) for n in ctx_lens) * tk.STAGED_PAGE
    backend.reserve_workspace(c.k_cache.shape[2], head_dim, block_size, dtype, torch.device(device), rows)
    assert backend.workspace.shape == (2, rows, c.k_cache.shape[2], head_dim)
    monkeypatch.setattr(tk, "stages_phase", lambda *lens: True)
    return c, _with_host_lens(c.meta, q_lens, ctx_lens), backend


@staging_cases
def test_stage_context_copies_each_context_into_its_own_pages(device, dtype, head_dim, group, block_size,
                                                               gen):
    lens = [300, 1, 129, 16] if device == "cuda" else [140, 1, 17]
    c = Case([1] * len(lens), lens, _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    ref_k, ref_v, ref_tables = tk.stage_context_reference(c.k_cache, c.v_cache, c.meta.block_tables, lens)
    pages = ref_k.shape[0]
    k = torch.full((pages + 1, tk.STAGED_PAGE, *c.k_cache.shape[2:]), float("nan"), dtype=dtype,
                   device=device)
    v = torch.full_like(k, float("nan"))
    tables = torch.full_like(ref_tables, 7)
    tk.stage_context(c.k_cache, c.v_cache, c.meta.block_tables, c.meta.context_lens, max(lens), k[:pages],
                     v[:pages], tables)
    assert torch.equal(tables, ref_tables)
    assert ref_tables[1, 0] == ref_tables[0, -1] + 1 and (ref_tables[1, 1:] == -1).all()  # one page, then -1
    for staged, ref in ((k, ref_k), (v, ref_v)):
        for s, n in enumerate(lens):  # each context's rows; nothing else is read
            rows = staged[tables[s, : -(-n // tk.STAGED_PAGE)].long()].flatten(0, 1)[:n]
            assert torch.equal(rows, ref[ref_tables[s, : -(-n // tk.STAGED_PAGE)].long()].flatten(0, 1)[:n])
        assert staged[pages:].isnan().all()  # nothing past the last page
    assert torch.equal(ref_k[ref_tables[1, 0]][0], c.k_cache[c.meta.block_tables[1, 0], 0])  # cache rows


@staging_cases
@pytest.mark.parametrize("fits", [True, False], ids=["staged", "too-long-for-the-workspace"])
def test_prefill_over_staged_contexts(device, dtype, head_dim, group, block_size, fits, gen, monkeypatch):
    """Chunks with history read their contexts from pages staged in the workspace, or, where the contexts
    do not fit it, through the block table: the reference's results either way."""
    c, meta, backend = _staging_case(device, dtype, head_dim, group, block_size, gen, monkeypatch)
    if not fits:
        backend.workspace = backend.workspace[:, :-1]
    staged = []
    stage = tk.stage_context
    monkeypatch.setattr(tk, "stage_context", lambda *a: staged.append(stage(*a)))
    ref = TorchBackend().prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, meta, c.scale)
    _check(backend.prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, meta, c.scale), ref, dtype, "prefill", gen)
    assert len(staged) == int(fits)


@staging_cases
def test_policies_read_the_staged_pages_through_their_context(device, dtype, head_dim, group, block_size, gen,
                                                             monkeypatch):
    """``PolicyContext.read_staged`` gives a paged cache of its own: read through its tables, the same
    attention as the cache's (the torch reference over both); None from a backend that stages nothing."""
    c, meta, backend = _staging_case(device, dtype, head_dim, group, block_size, gen, monkeypatch)
    context = PolicyContext(0, True, c.q, meta, c.k_cache, c.v_cache, c.scale, backend)
    k_pages, v_pages, tables = context.read_staged()
    assert k_pages.shape[1] == tk.STAGED_PAGE and tables.shape[0] == meta.num_seqs
    staged_meta = PhaseMetadata(meta.cu_seqlens_q, meta.context_lens, tables, meta.max_query_len,
                                meta.max_context_len)
    ref = TorchBackend().prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, meta, c.scale)
    assert torch.equal(TorchBackend().prefill(c.q, c.k, c.v, k_pages, v_pages, staged_meta, c.scale), ref)
    reference = PolicyContext(0, True, c.q, meta, c.k_cache, c.v_cache, c.scale, TorchBackend())
    assert reference.read_staged() is None


@cases
def test_fresh_sequences_read_their_new_keys(device, dtype, head_dim, group, block_size, gen):
    """Several prompts with nothing cached before them attend over their new keys and values, not the cache
    (here poisoned after the write): the host lengths say so without reading the device."""
    lens = [300, 77, 129] if device == "cuda" else [20, 7, 17]
    c = Case(lens, lens, _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    meta = _with_host_lens(c.meta, lens, lens)
    ref = TorchBackend().prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, meta, c.scale)
    c.k_cache.fill_(float("nan"))
    c.v_cache.fill_(float("nan"))
    out = tb.TritonBackend().prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, meta, c.scale)
    _check(out, ref, dtype, "fresh prompts", gen)


def test_the_workspace_is_reserved_only_where_staging_pays():
    backend = tb.TritonBackend()
    backend.reserve_workspace(8, 128, 16, torch.bfloat16, torch.device("cpu"), 1024)
    assert backend.workspace is None  # no TMA off CUDA: nothing to gain
    assert not tk.stages_paged_contexts(128, torch.bfloat16, torch.device("cpu"), 16)
    backend.stage_contexts = True
    backend.reserve_workspace(8, 128, 16, torch.bfloat16, torch.device("cpu"), 1024)
    assert backend.workspace.shape == (2, 1024, 8, 128) and backend.workspace.dtype == torch.bfloat16
    backend.reserve_workspace(8, 128, 16, torch.bfloat16, torch.device("cpu"), 1000)
    assert backend.workspace.shape[1] == 1024  # whole staged pages


def test_a_workspace_reserved_for_another_cache_stages_nothing(monkeypatch):
    monkeypatch.setattr(tk, "stages_phase", lambda *lens: True)
    backend = tb.TritonBackend()
    backend.stage_contexts = True
    backend.reserve_workspace(2, 64, 16, torch.float32, torch.device("cpu"), 256)
    meta = PhaseMetadata(torch.tensor([0, 32], dtype=torch.int32), torch.tensor([64], dtype=torch.int32),
                         torch.arange(4, dtype=torch.int32)[None], 32, 64, (32,), (64,))
    for cache in (torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 4, 64)):
        assert backend.staged_cache(cache, cache, meta) is None


def test_only_phases_with_long_chunks_and_much_attention_stage():
    assert tk.stages_phase(128, 128 * 1024) and tk.stages_phase(2048, 4096)
    assert not tk.stages_phase(64, 1 << 20)  # short chunks: the configuration without TMA
    assert not tk.stages_phase(1024, 4096)  # too little attention to repay the copy and its launch


@pytest.mark.gpu
def test_staging_pays_over_pages_smaller_than_the_key_tile():
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert tk.stages_paged_contexts(128, torch.bfloat16, device, 16) == hopper
    assert not tk.stages_paged_contexts(128, torch.bfloat16, device, 128)  # a page holds whole key tiles
    assert not tk.stages_paged_contexts(128, torch.float32, device, 16)  # no TMA configuration


@cases
def test_one_token_prompt_with_normed_keys(device, dtype, head_dim, group, block_size, gen):
    """A one-token prompt whose keys come out of RoPE packed while the values are a view of the qkv output:
    the two differ in the stride of their one row, which ``contiguous()`` leaves alone (and cuDNN takes no
    one-key prompt)."""
    c = Case([1], [1], _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    k = torch.empty(c.k.shape, dtype=dtype, device=device).copy_(c.k)  # row-major, as RoPE writes it
    assert k.stride() != c.v.stride()
    ref = TorchBackend().prefill(c.q, k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    backend = tb.TritonBackend()
    for sdpa in (False, True):
        backend.sdpa_prefill = sdpa
        _check(backend.prefill(c.q, k, c.v, c.k_cache, c.v_cache, c.meta, c.scale), ref, dtype,
               f"one-token prompt, sdpa {sdpa}", gen)
    out, _ = backend.attend_chunk(c.q, k, c.v, c.meta, c.scale)
    _check(out, ref, dtype, "one-token chunk", gen)


@cases
def test_decode(device, dtype, head_dim, group, block_size, gen):
    ctx = GPU_DECODE if device == "cuda" else INTERP_DECODE
    c = Case([1] * len(ctx), ctx, _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    args = (c.q, c.k_cache, c.v_cache, c.meta, c.scale)
    ref = TorchBackend().decode(*args)
    _check(tb.TritonBackend().decode(*args), ref, dtype, "decode", gen)
    for splits in (1, 3):  # the direct path and an explicit split count
        out = torch.full_like(c.q, float("nan"))
        tk.attention_decode(c.q, c.k_cache, c.v_cache, out, None, c.meta.context_lens, c.meta.block_tables,
                            None, c.meta.max_context_len, c.scale, num_splits=splits)
        _check(out, ref, dtype, f"decode ({splits} splits)", gen)


def _random_selection(c: Case, hist_blocks: list[int], gen, device):
    """Logical block indices per sequence, shuffled, -1 padded; the first sequence selects nothing."""
    width = max(max(hist_blocks), 1) + 1
    sel = torch.full((len(hist_blocks), width), -1, dtype=torch.int32)
    for j, n in enumerate(hist_blocks):
        if j == 0 or n == 0:
            continue
        chosen = torch.randperm(n, generator=gen)[: max(1, (n * 2 + 2) // 3)]
        cols = torch.randperm(width, generator=gen)[: chosen.numel()]
        sel[j, cols] = chosen.int()
    return sel.to(device)


@cases
def test_attend_blocks_decode(device, dtype, head_dim, group, block_size, gen):
    ctx = GPU_DECODE if device == "cuda" else INTERP_DECODE
    c = Case([1] * len(ctx), ctx, _kv_heads(device), group, head_dim, block_size, dtype, device, gen)
    kv_lens = (c.meta.context_lens - torch.tensor([0, 5, 1, 9][: len(ctx)] + [0] * (len(ctx) - 4),
                                                  device=device)).int().clamp(min=0)
    sel = _random_selection(c, c.nblk, gen, device)
    args = (c.q, c.k_cache, c.v_cache, c.meta, sel, kv_lens, c.scale)
    out, lse = tb.TritonBackend().attend_blocks(*args)
    ref_out, ref_lse = TorchBackend().attend_blocks(*args)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0])), "empty selection: out 0, lse -inf"
    _check(out, ref_out, dtype, "attend_blocks (decode)", gen)
    _check_lse(lse, ref_lse, dtype, "attend_blocks (decode)", gen)


@cases
def test_attend_blocks_prefill(device, dtype, head_dim, group, block_size, gen):
    lens = _prefill_lens(device)
    c = Case([q for q, _ in lens], [k for _, k in lens], _kv_heads(device), group, head_dim, block_size,
             dtype, device, gen)
    hist = c.meta.context_lens - c.meta.query_lens
    hist_blocks = [-(-(k - q) // block_size) for q, k in lens]
    sel = _random_selection(c, hist_blocks, gen, device)
    args = (c.q, c.k_cache, c.v_cache, c.meta, sel, hist, c.scale)
    out, lse = tb.TritonBackend().attend_blocks(*args)
    ref_out, ref_lse = TorchBackend().attend_blocks(*args)
    _check(out, ref_out, dtype, "attend_blocks (prefill)", gen)
    _check_lse(lse, ref_lse, dtype, "attend_blocks (prefill)", gen)


# a per-KV-head selection means something only with several KV heads: two, in the interpreter too
PER_HEAD_KV = 2


def _per_head_selection(hist_blocks: list[int], gen, device) -> torch.Tensor:
    """``[S, Hkv, width]`` random per KV head, ascending, -1 padded at the end. Sequence 0 selects
    nothing; in sequence 1, KV head 0 selects nothing (its other heads do)."""
    width = max(max(hist_blocks), 1) + 1
    sel = torch.full((len(hist_blocks), PER_HEAD_KV, width), -1, dtype=torch.int32)
    for j, n in enumerate(hist_blocks):
        for h in range(PER_HEAD_KV):
            if n == 0 or j == 0 or (j == 1 and h == 0):
                continue
            count = int(torch.randint(1, n + 1, (1,), generator=gen))
            sel[j, h, :count] = torch.randperm(n, generator=gen)[:count].sort().values.int()
    return sel.to(device)


def _poison_unselected(c: Case, sel: torch.Tensor) -> None:
    """NaN in every cache (block, KV head) that this KV head's selection rows do not name."""
    sel_cpu, tables = sel.cpu(), c.meta.block_tables.cpu()
    s, h, j = (sel_cpu >= 0).nonzero(as_tuple=True)
    keep = torch.zeros(c.k_cache.shape[0], c.k_cache.shape[2], dtype=torch.bool)
    keep[tables[s, sel_cpu[s, h, j]].long(), h] = True
    poison = ~keep.to(c.k_cache.device)[:, None, :, None]
    c.k_cache.masked_fill_(poison, float("nan"))
    c.v_cache.masked_fill_(poison, float("nan"))


def _check_shared_equals_per_head(c: Case, sel, kv_lens, what):
    """The shared form and the per-head form with identical rows: the same result, bit for bit."""
    backend = tb.TritonBackend()
    args = (c.q, c.k_cache, c.v_cache, c.meta)
    shared = sel[:, 1]  # KV head 1's lists (sequence 0: empty)
    out, lse = backend.attend_blocks(*args, shared, kv_lens, c.scale)
    same = shared[:, None, :].expand(-1, PER_HEAD_KV, -1).contiguous()
    out_h, lse_h = backend.attend_blocks(*args, same, kv_lens, c.scale)
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h), f"{what}: shared and per-head forms differ"


def _check_per_head(c: Case, sel, kv_lens, q_lens, dtype, what, gen):
    """Per-head triton against torch with every unselected (block, KV head) poisoned, and the empty
    selections: out 0, lse -inf."""
    _poison_unselected(c, sel)
    args = (c.q, c.k_cache, c.v_cache, c.meta, sel, kv_lens, c.scale)
    out, lse = tb.TritonBackend().attend_blocks(*args)
    ref_out, ref_lse = TorchBackend().attend_blocks(*args)
    _check(out, ref_out, dtype, f"{what}, per KV head", gen)
    _check_lse(lse, ref_lse, dtype, f"{what}, per KV head", gen)
    group = c.q.shape[1] // PER_HEAD_KV
    first, second = slice(0, q_lens[0]), slice(q_lens[0], q_lens[0] + q_lens[1])
    assert torch.all(out[first] == 0) and torch.all(torch.isneginf(lse[first])), f"{what}: empty sequence"
    assert torch.all(out[second, :group] == 0) and torch.all(torch.isneginf(lse[second, :group])), (
        f"{what}: empty KV head"
    )


@cases
@pytest.mark.parametrize("read_ahead", [False, True], ids=["in-step", "read-ahead"])
def test_attend_blocks_per_head_decode(device, dtype, head_dim, group, block_size, read_ahead, gen,
                                       monkeypatch):
    # both ways of reading a selected tile's entries (block_n > block_size only), whatever the batch
    monkeypatch.setattr(tk, "_read_ahead", lambda multi_block_tiles, *_: multi_block_tiles and read_ahead)
    ctx = GPU_DECODE if device == "cuda" else INTERP_DECODE
    c = Case([1] * len(ctx), ctx, PER_HEAD_KV, group, head_dim, block_size, dtype, device, gen)
    kv_lens = (c.meta.context_lens - torch.tensor([0, 0, 3, 1, 0][: len(ctx)], device=device)).int()
    sel = _per_head_selection([-(-int(n) // block_size) for n in kv_lens], gen, device)
    _check_shared_equals_per_head(c, sel, kv_lens, "attend_blocks (decode)")
    _check_per_head(c, sel, kv_lens, [1] * len(ctx), dtype, "attend_blocks (decode)", gen)


@cases
def test_attend_blocks_per_head_prefill(device, dtype, head_dim, group, block_size, gen):
    lens = _prefill_lens(device)
    c = Case([q for q, _ in lens], [k for _, k in lens], PER_HEAD_KV, group, head_dim, block_size,
             dtype, device, gen)
    hist = c.meta.context_lens - c.meta.query_lens
    sel = _per_head_selection([-(-(k - q) // block_size) for q, k in lens], gen, device)
    if device == "cuda":  # the interpreter is slow here; the decode case checks the same stride logic
        _check_shared_equals_per_head(c, sel, hist, "attend_blocks (prefill)")
    _check_per_head(c, sel, hist, [q for q, _ in lens], dtype, "attend_blocks (prefill)", gen)


@cases
@pytest.mark.parametrize("short", [False, True], ids=["long", "short"])
def test_attend_chunk(device, dtype, head_dim, group, block_size, short, gen):
    if short and device != "cuda":
        pytest.skip("the interpreter uses one tile configuration")
    lens = _prefill_lens(device, short)
    c = Case([q for q, _ in lens], [k for _, k in lens], _kv_heads(device), group, head_dim, block_size,
             dtype, device, gen)
    args = (c.q, c.k, c.v, c.meta, c.scale)
    out, lse = tb.TritonBackend().attend_chunk(*args)
    ref_out, ref_lse = TorchBackend().attend_chunk(*args)
    _check(out, ref_out, dtype, "attend_chunk", gen)
    _check_lse(lse, ref_lse, dtype, "attend_chunk", gen)


@cases
def test_policy_merge_equals_prefill(device, dtype, head_dim, group, block_size, gen):
    """History blocks + current chunk merged by log-sum-exp (the policies' default) == dense prefill."""
    lens = _prefill_lens(device)
    c = Case([q for q, _ in lens], [k for _, k in lens], _kv_heads(device), group, head_dim, block_size,
             dtype, device, gen)
    backend = tb.TritonBackend()
    ctx = PolicyContext(0, True, c.q, c.meta, c.k_cache, c.v_cache, c.scale, backend)
    out = SparsePolicy().compute_chunked_prefill(c.q, c.k, c.v, ctx)
    ref = TorchBackend().prefill(c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale)
    _check(out, ref, dtype, "policy prefill (attend_blocks + attend_chunk + merge)", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_cuda_graph(block_size, gen):
    """Decode captured once, replayed with other lengths and tables written into the same buffers."""
    dtype, device, group, head_dim, kv_heads = torch.bfloat16, "cuda", 4, 128, 2
    max_len, bs = 5000, 6
    pool = -(-max_len // block_size) * bs + 4
    backend = tb.TritonBackend()
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q = torch.empty(bs, kv_heads * group, head_dim, dtype=dtype, device=device)
    lens = torch.ones(bs, dtype=torch.int32, device=device)
    tables = torch.zeros(bs, -(-max_len // block_size), dtype=torch.int32, device=device)
    meta = PhaseMetadata(torch.arange(bs + 1, dtype=torch.int32, device=device), lens, tables, 1, max_len)
    scale = head_dim**-0.5
    backend.decode(q, k_cache, v_cache, meta, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, meta, scale)
    for _ in range(2):
        new_lens = torch.randint(1, max_len + 1, (bs,), generator=gen)
        new_lens[0] = max_len
        lens.copy_(new_lens)
        tables.copy_(torch.randperm(pool, generator=gen)[: tables.numel()].view_as(tables).int())
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        ref = TorchBackend().decode(q, k_cache, v_cache, meta, scale)
        _check(out, ref, dtype, "decode in a CUDA graph", gen)


@pytest.mark.gpu
def test_attend_blocks_per_head_cuda_graph(gen):
    """Per-KV-head selected decode captured once, replayed with other selections, lengths and tables
    written into the same buffers."""
    dtype, device, group, head_dim, block_size = torch.bfloat16, "cuda", 4, 128, 16
    max_len, bs, width = 3000, 5, 48
    nblk = -(-max_len // block_size)
    pool = nblk * bs + 4
    backend = tb.TritonBackend()
    k_cache = torch.randn(pool, block_size, PER_HEAD_KV, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(pool, block_size, PER_HEAD_KV, head_dim, generator=gen).to(dtype).to(device)
    q = torch.zeros(bs, PER_HEAD_KV * group, head_dim, dtype=dtype, device=device)
    lens = torch.ones(bs, dtype=torch.int32, device=device)
    tables = torch.zeros(bs, nblk, dtype=torch.int32, device=device)
    sel = torch.full((bs, PER_HEAD_KV, width), -1, dtype=torch.int32, device=device)
    meta = PhaseMetadata(torch.arange(bs + 1, dtype=torch.int32, device=device), lens, tables, 1, max_len)
    scale = head_dim**-0.5
    backend.attend_blocks(q, k_cache, v_cache, meta, sel, lens, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = backend.attend_blocks(q, k_cache, v_cache, meta, sel, lens, scale)
    for _ in range(2):
        new_lens = torch.randint(1, max_len + 1, (bs,), generator=gen)
        lens.copy_(new_lens)
        tables.copy_(torch.randperm(pool, generator=gen)[: tables.numel()].view_as(tables).int())
        new_sel = torch.full(sel.shape, -1, dtype=torch.int32)
        for s in range(bs):
            n = -(-int(new_lens[s]) // block_size)
            for h in range(PER_HEAD_KV):
                count = int(torch.randint(1, min(n, width) + 1, (1,), generator=gen))
                new_sel[s, h, :count] = torch.randperm(n, generator=gen)[:count].sort().values.int()
        sel.copy_(new_sel)
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = TorchBackend().attend_blocks(q, k_cache, v_cache, meta, sel, lens, scale)
        _check(out, ref_out, dtype, "per-head attend_blocks in a CUDA graph", gen)
        _check_lse(lse, ref_lse, dtype, "per-head attend_blocks in a CUDA graph", gen)


def test_selection_rows_must_be_contiguous():
    sel = torch.zeros(3, 2, 4, dtype=torch.int32).transpose(0, 2)  # [4, 2, 3], lists strided
    with pytest.raises(ValueError, match=r"block_indices.contiguous\(\)"):
        tk.attention_decode(torch.zeros(4, 4, 8), torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8),
                            torch.zeros(4, 4, 8), None, torch.ones(4, dtype=torch.int32),
                            torch.zeros(4, 1, dtype=torch.int32), sel, 48, 1.0)


def test_registration_lists_triton_for_cuda_only():
    from nanovllm.builtin import register_attention_backends
    from nanovllm.plugins import Registry

    registry = Registry()
    register_attention_backends(registry)
    info = registry.attention_backends["triton"]
    assert info.target == "nanovllm.attention.triton_backend:TritonBackend"
    assert info.supports("cuda", "bfloat16", 128) is None
    assert info.supports("cuda", "float16", 64) is None
    assert info.supports("cpu", "bfloat16", 128) is not None
    assert info.supports("cuda", "bfloat16", 96) is not None


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the gpu cases; the subprocess, the cases")
def test_kernels_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    case_tests = [
        f for f in globals().values()
        if any(m.name == "parametrize" and "device" in m.args[0] for m in getattr(f, "pytestmark", []))
    ]
    # each case once per config (their "short" variants skip there), the per-head decode twice (read-ahead);
    # the staging cases once per staging config, the prefill over staged contexts twice (fits or not)
    staging = [f for f in case_tests if any(m.name == "parametrize" and m.args[1] is STAGING_PARAMS
                                            for m in f.pytestmark)]
    assert len(staging) == 3
    expected = (len(case_tests) - len(staging) + 1) * len(INTERP_CONFIGS)
    assert passed == expected + (len(staging) + 1) * len(STAGING_INTERP_CONFIGS), tail


@pytest.mark.gpu
def test_the_engine_gives_the_same_tokens_with_its_contexts_staged(tiny_model, monkeypatch):
    """Long prompts in chunks over pages of 16, their contexts staged in the workspace (forced, as the rule
    stages only large phases) or read through the block table: the same tokens and logprobs."""
    from nanovllm import LLM, SamplingParams

    monkeypatch.setattr(tk, "stages_phase", lambda *lens: True)
    staged = []
    stage = tk.stage_context
    monkeypatch.setattr(tk, "stage_context", lambda *args: staged.append(stage(*args)))
    lengths = (900, 1500)
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 200 + 3 for j in range(n)]} for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    results = []
    for contexts_staged in (True, False):
        monkeypatch.setattr(tb.TritonBackend, "stage_contexts", contexts_staged)
        # head size 64
        model = tiny_model(hidden_size=256, intermediate_size=256, max_position_embeddings=2048)
        llm = LLM(model, attention_backend="triton", max_model_len=2048,
                  max_num_batched_tokens=512, block_size=16, enable_prefix_caching=False,
                  kv_cache_memory=1 << 26)
        assert (llm.runner.backend.workspace is not None) == contexts_staged
        results.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    assert staged, "no context was staged"
    for on, off in zip(*results, strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        for a, b in zip(on.outputs[0].logprobs, off.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
