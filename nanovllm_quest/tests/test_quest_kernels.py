"""The Triton kernels against their torch references (:mod:`nanovllm_quest.reference`), on random inputs:
on CUDA (``gpu``), and at small sizes under Triton's interpreter in a subprocess on machines without
CUDA (``test_kernels_under_interpreter``)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata  # noqa: E402
from nanovllm_quest import kernels, reference  # noqa: E402
from nanovllm_quest.policy import page_rows  # noqa: E402
from nanovllm_quest.reference import PageRows  # noqa: E402

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter cases exist only inside the subprocess that test_kernels_under_interpreter starts
PARAMS = [pytest.param("cuda", dt, id=f"gpu-{str(dt)[6:]}", marks=pytest.mark.gpu)
          for dt in (torch.bfloat16, torch.float32)]
PARAMS += [pytest.param("cpu", torch.float32, id="interp-float32")] if INTERP else []
cases = pytest.mark.parametrize("device,dtype", PARAMS)


def random_write(gen, num_blocks: int, block_size: int, seqs: list[tuple[int, int]], num_kv_heads: int,
                 head_dim: int, dtype):
    """A step's new rows: for each ``(start position, count)`` a run of one sequence's tokens in its own
    randomly numbered blocks, plus a few skipped rows (slot -1). Returns (key, slots, positions)."""
    perm = torch.randperm(num_blocks, generator=gen)
    slots, positions, used = [], [], 0
    for start, count in seqs:
        first, last = start // block_size, (start + count - 1) // block_size
        table = perm[used: used + last + 1].tolist()
        used += last + 1
        for p in range(start, start + count):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
        slots.append(-1)  # padding between runs, as CUDA-graph decode batches have at their end
        positions.append(0)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    return key, torch.tensor(slots), torch.tensor(positions)


def rows_on(rows: PageRows, device) -> PageRows:
    return PageRows(rows.anchor.to(device), None if rows.order is None else rows.order.to(device))


def bits(metadata: torch.Tensor) -> torch.Tensor:
    """Comparable bits (float8 has no ``torch.equal``; NaN bits compare equal)."""
    return metadata.cpu().view(torch.int8 if metadata.element_size() == 1 else torch.int16
                               if metadata.element_size() == 2 else torch.int32)


def stale_bounds(gen, shape, dtype, fp8: bool) -> torch.Tensor:
    """Random bounds of earlier owners, some float8 ones unbounded (NaN)."""
    start = torch.randn(*shape, generator=gen)
    if not fp8:
        return start.to(dtype)
    start[..., 0] = float("nan")
    return start.to(reference.FP8)


@cases
@pytest.mark.parametrize(("block_size", "bound"), [(4, 4), (16, 16), (16, 4)])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv-dtype", "fp8"])
def test_update_metadata(device, dtype, block_size, bound, fp8, d=48):
    """Pages of one block: the anchor is each row's own block, and with bounds below the page each row's
    bound is ``slot // bound``, bound ``slot % block_size // bound`` of its block. Float8 bounds: keys past
    the format's range make their bounds unbounded."""
    gen = torch.Generator().manual_seed(block_size)
    hkv, n = 2, 64
    # decode rows mid-block, a fresh block's first token, chunks starting mid-block and spanning blocks
    seqs = [(5, 1), (2 * block_size, 1), (3, 2 * block_size + 1), (0, 3 * block_size), (block_size - 1, 2)]
    key, slots, pos = random_write(gen, n, block_size, seqs, hkv, d, dtype)
    if fp8:
        key[::7, :, 1] *= 1000
    rows = page_rows(StepMetadata(slots, pos, 0, None, None), block_size, block_size, bound)
    start = stale_bounds(gen, (n, hkv, 2 * block_size // bound, d), dtype, fp8)
    want = start.clone()
    reference.update_metadata(want, key, pos, rows, bound)
    if fp8:
        assert want.float().isnan().any() and not want.float().isnan().all()
    got = start.to(device)
    kernels.update_metadata(got, key.to(device), pos.to(device), rows_on(rows, device), bound)
    assert torch.equal(bits(got), bits(want)), "min/max (rounded outward) must match bit for bit"


def shared_anchor_step(gen, block: int, page: int, num_blocks: int) -> StepMetadata:
    """Decodes of three sequences (and one padding row), then prefill chunks of two. Sequences 0, 1 and 4
    share block 0 as the anchor of their page 0 (a prefix-cache hit) and write its later blocks; sequence
    2 writes its page 1's first token; sequence 3's chunk spans pages 0 and 1."""
    width = 3 * (page // block)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: 5 * width] + 1).view(5, width).int()
    tables[[0, 1, 4], 0] = 0
    decode_pos, chunks = [9, page - 3, page], [(3, page + 3), (4, 4)]
    positions = decode_pos + [0] + [p for start, count in chunks for p in range(start, start + count)]
    seqs = [0, 1, 2, -1] + [s for s, (_, count) in zip((3, 4), chunks, strict=True) for _ in range(count)]
    slots = [int(tables[s, p // block]) * block + p % block if s >= 0 else -1
             for s, p in zip(seqs, positions, strict=True)]
    decode_tables = torch.cat([tables[:3], torch.zeros(1, width, dtype=torch.int32)])  # padding row: zeros
    decode = PhaseMetadata(torch.arange(5, dtype=torch.int32), torch.tensor(decode_pos + [1], dtype=torch.int32),
                           decode_tables, 1, page + 1)
    cu = torch.tensor([0, chunks[0][1], chunks[0][1] + chunks[1][1]], dtype=torch.int32)
    prefill = PhaseMetadata(cu, torch.tensor([sum(c) for c in chunks], dtype=torch.int32), tables[3:], page + 3,
                            2 * page + 6)
    return StepMetadata(torch.tensor(slots), torch.tensor(positions), 4, decode, prefill)


@cases
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv-dtype", "fp8"])
def test_update_metadata_of_shared_pages(device, dtype, page, fp8):
    """Pages of several blocks: rows of three sequences fold into one shared anchor in one step (decode and
    prefill rows, not adjacent), so the kernel must see them as one run."""
    gen = torch.Generator().manual_seed(page)
    block, hkv, d, n = 4, 2, 48, 128
    step = shared_anchor_step(gen, block, page, n)
    rows = page_rows(step, block, page)
    shared = (rows.anchor == 0).nonzero().flatten()
    assert sorted(rows.order[shared].tolist()) == [0, 1] + list(range(4 + page + 3, 4 + page + 7))  # seqs 0, 1, 4
    key = torch.randn(len(step.positions), hkv, d, generator=gen).to(dtype)
    start = torch.randn(n, hkv, 2, d, generator=gen)
    start = torch.stack([start.amin(2), start.amax(2)], dim=2).to(reference.FP8 if fp8 else dtype)
    want = start.clone()
    reference.update_metadata(want, key, step.positions, rows, page)
    new = key[rows.order[shared]].float()
    low = torch.minimum(start[0, :, 0].float(), new.amin(0))  # widened, not restarted
    high = torch.maximum(start[0, :, 1].float(), new.amax(0))
    if fp8:
        low, high = reference.round_fp8(low, up=False), reference.round_fp8(high, up=True)
    assert torch.equal(bits(want[0, :, 0]), bits(low.to(want.dtype)))
    assert torch.equal(bits(want[0, :, 1]), bits(high.to(want.dtype)))
    got = start.to(device)
    kernels.update_metadata(got, key.to(device), step.positions.to(device), rows_on(rows, device),
                            page)
    assert torch.equal(bits(got), bits(want)), "min/max (rounded outward) must match bit for bit"


@cases
@pytest.mark.parametrize("reduction", ["max", "sum", "mass"])
@pytest.mark.parametrize("keep_sink", [False, True])
@pytest.mark.parametrize(("per_page", "bounds"), [(1, 1), (3, 1), (1, 2)])
@pytest.mark.parametrize("recent", [1, 4])
def test_page_scores(device, dtype, reduction, keep_sink, per_page, bounds, recent, d=64):
    gen = torch.Generator().manual_seed(7)
    seqs, heads, hkv, width = 3, 8, 2, 150 if device == "cuda" else 70
    block, page = 16, 16 * per_page
    num_blocks = seqs * width
    metadata = torch.randn(num_blocks, hkv, bounds, 2, d, generator=gen)
    metadata = torch.stack([metadata.amin(3), metadata.amax(3)], dim=3).flatten(2, 3).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width).int()
    lens = torch.tensor([width * block - 5, 1, (width // 2 + 3) * block], dtype=torch.int32)
    tables[1:, :] = torch.where(torch.arange(width) < ((lens[1:, None] + block - 1) // block), tables[1:], -1)
    n = (lens + page - 1) // page
    q = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    want = reference.page_scores(q, metadata, tables, lens, block, page, reduction, keep_sink, recent, d**-0.5)
    assert want.shape == (seqs, hkv, -(-width // per_page))
    # the newest pages (and the sink, when older than them) forced to +inf
    finite_pages = (n - recent).clamp(min=0) - (keep_sink & (n > recent)).int()
    assert torch.equal(torch.isfinite(want).sum(-1), finite_pages[:, None].expand(-1, hkv))
    pages = torch.arange(want.shape[-1])
    newest = (pages >= n[:, None] - recent) & (pages < n[:, None])
    assert torch.isposinf(want[newest[:, None].expand_as(want)]).all()
    got = kernels.page_scores(q.to(device), metadata.to(device), tables.to(device), lens.to(device), block, page,
                              reduction, keep_sink, recent, d**-0.5).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.sign(), want.sign())
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


@cases
@pytest.mark.parametrize("per_page", [1, 2])
@pytest.mark.parametrize("step", [None, 16])
def test_page_scores_with_fp8_bounds(device, dtype, per_page, step, monkeypatch, d=64):
    """Float8 bounds score as their float32 values; a page with an unbounded bound (a NaN channel) scores
    ``+inf``. The query's channels span 7.5 orders of magnitude, past float16's range: on the GPU a 16-bit
    query is scaled into it. The widths reach each scoring tile on an H100 (32, 64 and 128 bounds a program,
    the last in two steps); ``step`` 16 takes every program in several steps."""
    if step is not None:
        monkeypatch.setattr(kernels, "SCORE_STEP", step)
    gen = torch.Generator().manual_seed(11)
    seqs, hkv, block = 2, 8 if device == "cuda" else 2, 16
    for width in (40, 700, 2200) if device == "cuda" else (40,):
        bounds = torch.randn(seqs * width, hkv, per_page, 2, d, generator=gen) * 3
        metadata = torch.stack([reference.round_fp8(bounds.amin(3), up=False),
                                reference.round_fp8(bounds.amax(3), up=True)], dim=3).flatten(2, 3)
        tables = torch.randperm(seqs * width, generator=gen).view(seqs, width).int()
        # the second sequence's history ends a third of the way in: the scoring programs past it only store
        lens = torch.tensor([width * block, width // 3 * block - 9], dtype=torch.int32)
        metadata[tables[0, 5], 1, -1, 3] = float("nan")  # sequence 0, KV head 1, page 5: its last bound's max
        magnitude = 10 ** (torch.rand(d, generator=gen) * 7.5 - 3)  # some past float16's 65504
        q = (torch.randn(seqs, 4 * hkv, d, generator=gen) * magnitude).to(dtype)
        want = reference.page_scores(q, metadata, tables, lens, block, block, "max", True)
        assert want[0, 1, 5] == float("inf") and torch.isfinite(want[0, 0, 1:-1]).all()
        got = kernels.page_scores(q.to(device), metadata.to(device), tables.to(device), lens.to(device), block,
                                  block, "max", True).cpu()
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-6 * want[finite].abs().max())


@cases
@pytest.mark.parametrize(("width", "k", "tile", "per_page"), [
    (37, 8, None, 1), (200, 16, None, 1), (160, 40, 64, 1), (20, 32, None, 1),
    (37, 8, None, 3), (40, 6, 16, 3), (20, 32, None, 3),
])
@pytest.mark.parametrize("ties", [True, False])
def test_top_pages(device, dtype, width, k, tile, per_page, ties, monkeypatch):
    if tile is not None:  # rows longer than a tile: the looping path
        monkeypatch.setattr(kernels, "MAX_TOPK_TILE", tile)
    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(4, 3, width, generator=gen) * 4
    if ties:
        scores = scores.round()
    # distinct scores: the search mostly ends early, on a candidate with exactly k scores at or above it
    scores[0, 0, width // 2:] = float("-inf")  # fewer valid pages than k in some rows
    scores[0, 1, k:] = float("-inf")  # exactly k valid pages (where the row is wider): taken unsearched
    scores[1, :, :3] = float("inf")  # forced pages
    scores[1, 2, : k + 1] = float("inf")  # more forced pages than k: the search starts from the top
    scores[2, 1, :] = -0.0
    scores[3, 2, 5] = float("nan")
    # histories that end inside a page: its blocks past the history are not selected
    lens = torch.tensor([width * per_page * 16, width * per_page * 16 - 17, 5, 40 * 16 - 1], dtype=torch.int32)
    want = reference.top_pages(scores, k, lens, 16, 16 * per_page)
    assert want.shape == (4, 3, k * per_page)
    got = kernels.top_pages(scores.to(device), k, lens.to(device), 16, 16 * per_page).cpu()
    assert torch.equal(got, want)


@cases
@pytest.mark.parametrize("shape", ["heavy-tailed", "two-clusters", "one-gap", "descending"])
def test_top_pages_on_skewed_rows(device, dtype, shape):
    """The selection is exact on rows whose scores are far from evenly spread: a few huge scores, two clusters
    far apart whose scores tie exactly (the noise is below float32's step at 1e6), a gap right at the K-th
    score, the row in order (a search that guesses the K-th score from the spread of the scores, measured on
    the H100 and not kept, needed such rows)."""
    gen = torch.Generator().manual_seed(3)
    width, k = (3000, 100) if device == "cuda" else (600, 20)  # the interpreter takes a pass lane by lane
    if shape == "heavy-tailed":
        scores = torch.exp(torch.randn(2, 4, width, generator=gen) * 8)
    elif shape == "two-clusters":
        base = torch.where(torch.rand(2, 4, width, generator=gen) < 0.1, 1e6, -1e6)
        scores = base + torch.randn(2, 4, width, generator=gen) * 1e-3
    elif shape == "one-gap":
        scores = torch.rand(2, 4, width, generator=gen)
        top = scores.topk(k, dim=-1).indices
        scores.scatter_(-1, top, scores.gather(-1, top) + 1e4)
    else:
        scores = torch.linspace(1e3, -1e3, width).expand(2, 4, width).clone()
    scores[:, :, -3:] = float("inf")  # forced pages
    lens = torch.full((2,), width * 16, dtype=torch.int32)
    want = reference.top_pages(scores, k, lens, 16, 16)
    got = kernels.top_pages(scores.to(device), k, lens.to(device), 16, 16).cpu()
    assert torch.equal(got, want)


@cases
@pytest.mark.parametrize("reduction", ["max", "mass"])
@pytest.mark.parametrize(("per_page", "tile"), [(1, None), (3, None), (1, 16)])
def test_select_pages(device, dtype, reduction, per_page, tile, monkeypatch):
    """Scores and their ``k`` best pages' blocks in one call (with ``mass`` the shares and the selection in
    one launch): the scores as ``page_scores``, the blocks as ``top_pages`` selects from them. ``tile``: rows
    longer than a tile, for both passes of the shares and for the selection."""
    if tile is not None:
        monkeypatch.setattr(kernels, "SHARES_TILE", 4 * tile)  # 4 query heads a KV head
        monkeypatch.setattr(kernels, "MAX_TOPK_TILE", tile)
    gen = torch.Generator().manual_seed(11)
    seqs, heads, hkv, d, width, block, k = 3, 8, 2, 32, 40, 4, 6
    page = block * per_page
    metadata = torch.randn(seqs * width, hkv, 2, d, generator=gen)
    metadata = torch.stack([metadata.amin(2), metadata.amax(2)], dim=2).to(dtype)
    tables = torch.randperm(seqs * width, generator=gen).view(seqs, width).int()
    lens = torch.tensor([width * block - 1, 37, 3], dtype=torch.int32)
    q = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    options = (k, reduction, True, 2, d**-0.5)
    want_scores, want = reference.select_pages(q, metadata, tables, lens, block, page, *options)
    args = [t.to(device) for t in (q, metadata, tables, lens)]
    scores, got = kernels.select_pages(*args, block, page, *options)
    scores, got = scores.cpu(), got.cpu()
    assert torch.equal(torch.isinf(scores), torch.isinf(want_scores))
    finite = torch.isfinite(want_scores)
    torch.testing.assert_close(scores[finite], want_scores[finite], rtol=1e-5, atol=1e-4)
    assert torch.equal(got, reference.top_pages(scores, k, lens, block, page))
    assert torch.equal(got, want)


def rescore_case(gen, dtype, d: int, num_nominees: int = 12):
    """``(q, k_cache, tables, lens, nominees, scores)``: nominees of three sequences, one with fewer valid
    pages than nominees (-1 padding), one whose history ends inside its last page, the sink forced."""
    seqs, heads, hkv, width, block = 3, 8, 2, 30, 16
    k_cache = torch.randn(seqs * width, block, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(seqs * width, generator=gen).view(seqs, width).int()
    lens = torch.tensor([width * block, width * block - 9, 5 * block + 3], dtype=torch.int32)
    q = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    scores = torch.randn(seqs, hkv, width, generator=gen)
    scores[:, :, 0] = float("inf")  # the sink
    scores[2, :, 6:] = float("-inf")  # past sequence 2's history
    nominees = reference.top_pages(scores, num_nominees, lens, block, block)
    assert (nominees[2] == -1).any()
    return q, k_cache, tables, lens, nominees, scores


@cases
@pytest.mark.parametrize("reduction", ["max", "sum", "mass"])
def test_rescore_pages(device, dtype, reduction, d=64):
    """Nominees' exact scores: a row with fewer valid pages than nominees (-1 padding: ``-inf``), a history
    ending inside its last page (keys past it left out), forced pages kept ``+inf``."""
    case = rescore_case(torch.Generator().manual_seed(13), dtype, d)
    nominees = case[4]
    want = reference.rescore_pages(*case, reduction, d**-0.5)
    assert want.shape == nominees.shape and torch.equal(torch.isneginf(want), nominees < 0)
    assert torch.isposinf(want).sum() == 3 * 2  # the sink, nominated first in every row
    got = kernels.rescore_pages(*[t.to(device) for t in case], reduction, d**-0.5).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-3)
    assert torch.equal(got[~finite], want[~finite])


@cases
@pytest.mark.parametrize("reduction", ["max", "mass"])
@pytest.mark.parametrize("tile", [None, 16])
def test_pick_by_keys(device, dtype, reduction, tile, monkeypatch, d=32):
    """The nominees' rescoring and the pick in one call (with ``mass`` the shares and the pick in one
    launch): ``pick_nominees`` of ``rescore_pages``. ``tile``: 20 nominees are two tiles, for both passes
    of the shares and for the pick."""
    if tile is not None:
        monkeypatch.setattr(kernels, "SHARES_TILE", 4 * tile)  # 4 query heads a KV head
        monkeypatch.setattr(kernels, "MAX_TOPK_TILE", tile)
    case = rescore_case(torch.Generator().manual_seed(17), dtype, d, num_nominees=20)
    nominees = case[4]
    want = reference.pick_by_keys(*case, 7, reduction, d**-0.5)
    args = [t.to(device) for t in case]
    got = kernels.pick_by_keys(*args, 7, reduction, d**-0.5).cpu()
    exact = kernels.rescore_pages(*args, reduction, d**-0.5).cpu()
    assert torch.equal(got, reference.pick_nominees(exact, nominees, 7))
    assert torch.equal(got, want)


@cases
@pytest.mark.parametrize("reduction", ["max", "mass"])
def test_the_policy_selects_on_the_kernels_what_it_selects_on_the_references(device, dtype, reduction):
    """``select_blocks`` end to end, bound alone and rescored: the kernels' launches give the references'
    selection (float8 bounds where the device has them, as the policy's default)."""
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.sparse import KVWrite, PolicyContext
    from nanovllm_quest.config import QuestConfig
    from nanovllm_quest.policy import QuestPolicy

    gen = torch.Generator().manual_seed(19)
    lens, heads, hkv, d, block, width = [150, 77, 40], 8, 2, 32, 4, 40
    k_cache = torch.randn(len(lens) * width, block, hkv, d, generator=gen).to(dtype).to(device)
    tables = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width).int().to(device)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype).to(device)
    meta = PhaseMetadata(torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
                         torch.tensor(lens, dtype=torch.int32, device=device), tables, 1, max(lens))
    ctx = PolicyContext(0, False, q, meta, k_cache, k_cache, d**-0.5, TorchBackend())
    for rescore in (1, 2):
        policy = QuestPolicy(QuestConfig(token_budget=6 * block, skip_layers=0, group_reduction=reduction,
                                         rescore=rescore))
        policy.initialize(1, hkv, d, k_cache.shape[0], block, dtype, torch.device(device))
        for s, n in enumerate(lens):
            policy.on_kv_write(KVWrite.of_sequence(0, k_cache, k_cache, tables[s].tolist(), n))
        policy.ops = reference
        want = policy.select_blocks(ctx).cpu()
        policy.ops = kernels
        assert torch.equal(policy.select_blocks(ctx).cpu(), want), f"rescore={rescore}"


@cases
@pytest.mark.parametrize(("width", "k"), [(24, 8), (40, 16), (6, 8)])
def test_pick_nominees(device, dtype, width, k):
    """The ``k`` best nominees (ties: the earlier; ``-inf``, NaN and padding never) as their pages."""
    gen = torch.Generator().manual_seed(width)
    pages = torch.randperm(500, generator=gen)[: 3 * 2 * width].view(3, 2, width)
    nominees = torch.sort(pages, dim=-1).values
    exact = (torch.randn(3, 2, width, generator=gen) * 3).round()  # ties, -0.0 with 0.0 among them
    assert (exact == 0).any() and torch.signbit(exact[exact == 0]).any()
    exact[0, 0, : width // 2] = float("-inf")  # padding: fewer than k in some rows
    nominees[0, 0, : width // 2] = -1
    exact[1, :, 1] = float("inf")  # forced
    exact[2, 1, 3] = float("nan")
    want = reference.pick_nominees(exact, nominees.int(), k)
    assert want.shape == (3, 2, k) and (want[0, 0] == -1).any() == (width - width // 2 < k)
    for s in range(3):
        for h in range(2):
            got_pages = [p for p in want[s, h].tolist() if p >= 0]
            assert got_pages == sorted(got_pages) and set(got_pages) <= set(nominees[s, h].tolist())
    got = kernels.pick_nominees(exact.to(device), nominees.int().to(device), k).cpu()
    assert torch.equal(got, want)


@cases
def test_kernels_at_head_size_256(device, dtype, monkeypatch):
    """Gemma 3's head size (256, 4 query heads on 1 KV head): metadata updates in both formats, scoring
    with 16-bit and float8 bounds, and rescoring, each against its reference."""
    for fp8 in (False, True):
        test_update_metadata(device, dtype, 16, 16, fp8, d=256)
    test_page_scores(device, dtype, "max", True, 1, 2, 1, d=256)
    test_page_scores(device, dtype, "mass", True, 1, 2, 8, d=256)
    test_page_scores_with_fp8_bounds(device, dtype, 1, None, monkeypatch, d=256)
    test_rescore_pages(device, dtype, "max", d=256)
    test_rescore_pages(device, dtype, "mass", d=256)
    test_pick_by_keys(device, dtype, "mass", None, monkeypatch, d=256)


def test_kernels_under_interpreter():
    """Every ``interp`` case of this file under Triton's interpreter on the CPU, in a fresh process."""
    if CUDA or INTERP:
        pytest.skip("runs the interpreter cases in a subprocess on machines without CUDA")
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == 3 * 2 + 2 * 2 + 3 * 2 * 3 * 2 + 2 * 2 + 7 * 2 + 4 + 2 * 3 + 3 + 2 * 2 + 2 + 3 + 1, tail
