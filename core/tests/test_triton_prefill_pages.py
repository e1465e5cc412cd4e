"""Paged prefill through tensor-memory box loads, one per page (``PrefillConfig.page_boxes``: joined into the
key and value tiles, a dot a page for both, or plain key loads and a dot a page for the values): the same
results as the ``torch`` reference over pages smaller than the key tile, chunks with history, GQA, head sizes
64/128/256, sliding windows, selections (which keep the plain loads), float32 and bfloat16. Under Triton's
interpreter on the CPU (in a subprocess, as in test_triton_backend.py; the interpreter runs tensor
descriptors over CPU tensors) at small sizes; on CUDA a few cases at GPU sizes (``gpu`` marker). A sm_90
compile (no GPU needed) checks that the modes build and use tensor-memory loads."""

from __future__ import annotations

import os

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
KERNELS = pytest.mark.gpu if CUDA else pytest.mark.skipif(not INTERP, reason="in the interpreter's run")

pytest.importorskip("triton")

from nanovllm.attention import triton_kernels as tk  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def paged_case(lens, block_size, kv_heads, group, head_dim, dtype, gen):
    """Keys and values of each sequence's whole context in shuffled cache blocks; queries for the last
    ``q_len`` positions of each ``(q_len, ctx_len)`` in ``lens``; the metadata."""
    nblk = [-(-c // block_size) for _, c in lens]
    pool = sum(nblk) + 2  # blocks nobody owns
    perm = torch.randperm(pool, generator=gen)
    tables = torch.full((len(lens), max(nblk) + 1), -1, dtype=torch.int32)
    used = 0
    for j, n in enumerate(nblk):
        tables[j, :n] = perm[used:used + n].int()
        used += n

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    k_cache, v_cache = rnd(pool, block_size, kv_heads, head_dim), rnd(pool, block_size, kv_heads, head_dim)
    q = rnd(sum(a for a, _ in lens), kv_heads * group, head_dim)
    q_lens = torch.tensor([a for a, _ in lens])
    cu = torch.tensor([0, *q_lens.cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    meta = PhaseMetadata(cu, torch.tensor([c for _, c in lens], dtype=torch.int32, device=DEVICE),
                         tables.to(DEVICE), int(q_lens.max()), max(c for _, c in lens))
    return q, k_cache, v_cache, meta


def rel(a, b) -> float:
    assert torch.isfinite(a).all(), "unwritten or non-finite output"
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def config(q, meta, block_n, **knobs) -> tk.PrefillConfig:
    cfg = tk._prefill_config(q.shape[-1], q.dtype, q.device, meta.max_query_len, True)
    small = dict(block_m=16, num_warps=1) if INTERP else dict(block_m=64 if q.shape[-1] > 128 else 128)
    return cfg._replace(block_n=block_n, tma=True, **small, **knobs)


# (page size, pages a key tile, head dim, group, dtype, page_boxes, windowed): every page size and tile width,
# every way of taking the pages, each head size and dtype, GQA and windows
INTERP_CASES = [
    (16, 2, 64, 2, torch.bfloat16, "join", False),
    (16, 2, 64, 2, torch.bfloat16, "dots", False),
    (16, 4, 128, 4, torch.bfloat16, "values", False),
    (16, 4, 128, 4, torch.bfloat16, "dots", False),
    (8, 4, 128, 1, torch.bfloat16, "join", False),  # pages of 8: joined boxes only
    (32, 2, 256, 2, torch.bfloat16, "values", False),
    (16, 4, 64, 2, torch.float32, "dots", False),
    (16, 2, 128, 2, torch.float32, "join", True),
    (16, 4, 64, 2, torch.bfloat16, "values", True),
    (16, 2, 64, 1, torch.float32, "values", False),
]
# on the GPU, few compiles: the engine's pages under the sweep's 128-key tiles, and the other axes once each
GPU_CASES = [
    (16, 8, 128, 4, torch.bfloat16, "join", False),
    (16, 8, 128, 4, torch.bfloat16, "dots", False),
    (16, 8, 128, 4, torch.bfloat16, "values", False),
    (32, 4, 128, 8, torch.bfloat16, "dots", True),
    (32, 2, 256, 2, torch.bfloat16, "values", False),
    (16, 4, 64, 2, torch.float32, "join", True),
]
CASES = GPU_CASES if CUDA else INTERP_CASES


def _case_id(c) -> str:
    bs, pages, d, g, dt, mode, windowed = c
    name = f"bs{bs}-x{pages}-d{d}-g{g}-{str(dt).removeprefix('torch.')}-{mode}"
    return name + ("-window" if windowed else "")


@KERNELS
@pytest.mark.parametrize("block_size,pages,head_dim,group,dtype,mode,windowed", CASES,
                         ids=map(_case_id, CASES))
def test_interp_prefill_page_boxes(block_size, pages, head_dim, group, dtype, mode, windowed, gen):
    """A fresh prompt, chunks behind history (one starting mid-page), a single query over a long prefix; a
    window wide enough that some key tiles lie wholly inside every row's window (those take the boxes)."""
    block_n = block_size * pages
    lens = ([(40, 40), (9, 3 * block_n + 5), (1, 2 * block_n + 1), (block_n // 2 + 3, 4 * block_n)] if INTERP
            else [(700, 700), (77, 3000), (1, 1025), (513, 2100)])
    q, k_cache, v_cache, meta = paged_case(lens, block_size, 2, group, head_dim, dtype, gen)
    scale = head_dim**-0.5
    cfg = config(q, meta, block_n, page_boxes=mode, fused_scale=not windowed)
    window = 3 * block_n + cfg.block_m + 7 if windowed else None
    empty = q.new_empty(q.shape[0], k_cache.shape[2], head_dim)
    ref = TorchBackend().prefill(q, empty, empty, k_cache, v_cache, meta, scale, window=window)
    out = torch.full_like(q, float("nan"))
    tk.attention_rows(q, k_cache, v_cache, out, None, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                      None, meta.max_query_len, scale, paged=True, causal=True, config=cfg, window=window)
    assert rel(out, ref) < TOL[dtype], f"paged prefill {cfg}, window {window} (seed {gen.initial_seed()})"
    if INTERP:  # the case ran the box loads
        assert tk._kv_descriptors(k_cache, v_cache, True, block_n, mode) is not None
        assert tk._kv_descriptors(k_cache, v_cache, True, block_n) is None


@KERNELS
@pytest.mark.parametrize("mode", sorted(tk.PAGE_BOX_MODES))
def test_interp_prefill_page_boxes_selection_and_lse(mode, gen):
    """A selection of history blocks with the knobs on (it keeps the plain loads), with its log-sum-exp."""
    block_size, block_n = 16, 32 if INTERP else 128
    lens = [(7, 90), (20, 70)] if INTERP else [(77, 3000), (300, 1000)]
    q, k_cache, v_cache, meta = paged_case(lens, block_size, 2, 2, 64, torch.bfloat16, gen)
    hist = meta.context_lens - (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1])
    hist_blocks = [-(-int(h) // block_size) for h in hist]
    width = max(hist_blocks)
    sel = torch.full((len(lens), width), -1, dtype=torch.int32)
    for j, n in enumerate(hist_blocks):
        keep = torch.randperm(n, generator=gen)[:max(1, n // 2)].sort().values
        sel[j, :len(keep)] = keep.int()
    sel = sel.to(DEVICE)
    scale = 64**-0.5
    ref_out, ref_lse = TorchBackend().attend_blocks(q, k_cache, v_cache, meta, sel, hist, scale)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    cfg = config(q, meta, block_n, page_boxes=mode)
    tk.attention_rows(q, k_cache, v_cache, out, lse, meta.cu_seqlens_q, hist, meta.block_tables, sel,
                      meta.max_query_len, scale, paged=True, causal=False, config=cfg)
    assert rel(out, ref_out) < TOL[torch.bfloat16], f"selection {cfg} (seed {gen.initial_seed()})"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3


# --- no kernel runs below ---


def test_page_boxes_serve_whole_power_of_two_pages_only():
    fit = tk._page_boxes_fit
    assert fit("join", 16, 128) and fit("join", 8, 32) and fit("dots", 64, 128) and fit("values", 16, 64)
    assert not fit("dots", 8, 32) and not fit("values", 8, 32)  # a dot a page needs 16 keys
    assert not fit("join", 4, 32)  # a box of fewer than 8 rows
    assert not fit("join", 24, 48)  # not a power of two
    assert not fit("join", 32, 48)  # the tile is not whole pages
    assert not fit("", 16, 128) and tk.PrefillConfig(64, 64, 4, 3).page_boxes == ""  # off unless asked


def test_unknown_page_boxes_mode_is_refused():
    q = torch.zeros(4, 2, 32)
    cache = torch.zeros(2, 16, 1, 32)
    cu, lens, table = torch.tensor([0, 4]), torch.tensor([4]), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_boxes='gather'.*dots"):
        tk.attention_rows(q, cache, cache, torch.empty_like(q), None, cu, lens, table, None, 4, 1.0,
                          paged=True, causal=True,
                          config=tk.PrefillConfig(16, 32, 1, 1, tma=True, page_boxes="gather"))


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the cases; the subprocess, the interpreter's")
def test_prefill_page_boxes_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == len(CASES) + len(tk.PAGE_BOX_MODES), tail


HOPPER_COMPILE = r'''
H, HKV, D, N, bs, bf = 32, 8, 128, 1024, 16, torch.bfloat16
q = torch.empty(N, H, D, dtype=bf)
cu, lens = torch.tensor([0, N], dtype=torch.int32), torch.tensor([N], dtype=torch.int32)
cache, table = torch.empty(N // bs, bs, HKV, D, dtype=bf), torch.zeros(1, N // bs, dtype=torch.int32)
for knobs in VARIANTS:
    cfg = tk.PREFILL_LONG_PAGED._replace(**knobs)
    tk.attention_rows(q, cache, cache, torch.empty_like(q), None, cu, lens, table, None, N, 0.1,
                      paged=True, causal=True, config=cfg)
for kernel in tk._prefill_kernel.device_caches[0][0].values():
    print("kernel", "cp.async.bulk.tensor" in kernel.asm["ptx"], kernel.metadata.shared)
'''


@pytest.mark.slow
@pytest.mark.skipif(CUDA or INTERP, reason="CUDA compiles for itself; the interpreter compiles nothing")
def test_prefill_page_boxes_compile_for_hopper(tmp_path):
    """The sweep's page-box settings over pages of 16 compile for sm_90 with the bundled ptxas (no GPU
    needed), use tensor-memory loads and fit the multiprocessor's shared memory."""
    from nanovllm.testing import compile_for_hopper

    variants = [dict(page_boxes=mode) for mode in sorted(tk.PAGE_BOX_MODES)]
    stdout = compile_for_hopper(HOPPER_COMPILE.replace("VARIANTS", repr(variants)), ("_prefill_kernel",), tmp_path)
    kernels = [line.split()[1:] for line in stdout.splitlines() if line.startswith("kernel")]
    assert len(kernels) == len(variants), stdout
    for tma, shared in kernels:
        assert tma == "True" and int(shared) <= 232448, stdout  # sm_90: 227 KiB a block
