"""The ``quest`` policy: its bound, its selection and its attention, on the CPU (torch references) and,
where marked ``gpu``, in the engine on CUDA (Triton kernels, CUDA graphs, offload)."""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.kv import PagedLayerKV
from nanovllm.plugins import get_plugins
from nanovllm.quality import planted
from nanovllm.quality.capture import Capture, LayerActivations
from nanovllm.quality.evaluate import evaluate_policy
from nanovllm.selection import SelectionError, resolve_sparse_policy
from nanovllm.sparse import KVWrite, PolicyContext
from nanovllm_quest import reference
from nanovllm_quest.config import QuestConfig
from nanovllm_quest.policy import QuestPolicy, bound_layout, nominee_marks

BLOCK = 4


def installed() -> None:
    if "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")


def decode_batch(lens: list[int], heads: int = 8, kv_heads: int = 2, dim: int = 16, seed: int = 0,
                 **config) -> tuple[QuestPolicy, PolicyContext]:
    """A Quest policy (no dense layers) over a random paged cache of one decode step."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(len(lens), max(lens), kv_heads, dim, generator=g)
    values = torch.randn(len(lens), max(lens), kv_heads, dim, generator=g)
    return paged_decode(keys, values, torch.randn(len(lens), heads, dim, generator=g), lens, **config)


def paged_decode(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, lens: list[int], block: int = BLOCK,
                 **config) -> tuple[QuestPolicy, PolicyContext]:
    """Sequence ``s`` holds ``keys[s, :lens[s]]`` in physical blocks numbered in reverse, written through
    ``on_kv_write`` as one prefill each; ``q [S, H, D]`` is the decode step's queries. Pages are one block
    unless ``page_size`` says otherwise, and only the newest page is forced (the paper's selection, which
    these tests rank, by the bound alone) unless ``recent_pages`` and ``rescore`` say otherwise."""
    num_seqs, _, kv_heads, dim = keys.shape
    width = max(-(-n // block) for n in lens)
    k_cache = torch.zeros(num_seqs * width, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    policy = QuestPolicy(QuestConfig(**{"skip_layers": 0, "page_size": block, "recent_pages": 1, "rescore": 1,
                                        **config}))
    policy.initialize(1, kv_heads, dim, num_seqs * width, block, torch.float32, torch.device("cpu"))
    for s, n in enumerate(lens):
        used = -(-n // block)
        tables[s, :used] = torch.arange(used, dtype=torch.int32).flip(0) + s * width
        for j, b in enumerate(tables[s, :used].tolist()):
            rows = slice(j * block, min(n, (j + 1) * block))
            k_cache[b, : rows.stop - rows.start] = keys[s, rows]
            v_cache[b, : rows.stop - rows.start] = values[s, rows]
        policy.on_kv_write(KVWrite.of_sequence(0, k_cache, v_cache, tables[s, :used].tolist(), n))
    meta = PhaseMetadata(torch.arange(num_seqs + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                         tables, 1, max(lens))
    return policy, PolicyContext(0, False, q, meta, k_cache, v_cache, dim**-0.5, TorchBackend())


def test_config_is_checked_at_the_selection():
    installed()
    resolved = resolve_sparse_policy("quest:token_budget=1024,group_reduction=sum,keep_sink=true")
    assert resolved.cls is QuestPolicy
    # page: a block
    assert resolved.config == QuestConfig(1024, 2, "sum", True, 8, None, None, "auto", None, False)
    assert resolve_sparse_policy("quest:recent_pages=1").config.recent_pages == 1
    assert resolve_sparse_policy("quest:metadata_dtype=fp8").config.metadata_dtype == "fp8"
    assert resolve_sparse_policy("quest:page_size=64").config.page_size == 64
    assert resolve_sparse_policy("quest:bound_size=8").config.bound_size == 8
    assert resolve_sparse_policy("quest:oracle=true").config.oracle is True
    for bad, message in [("token_budget=0", "token_budget must be an int >= 1"),
                         ("skip_layers=-1", "skip_layers must be an int >= 0"),
                         ("group_reduction=mean", "group_reduction must be one of 'max', 'sum'"),
                         ("keep_sink=2", "keep_sink must be true or false"),
                         ("recent_pages=0", "recent_pages must be an int >= 1"),
                         ("page_size=0", "page_size must be an int >= 1"),
                         ("bound_size=0", "bound_size must be an int >= 1"),
                         ("oracle=3", "oracle must be true or false, got 3"),
                         ("metadata_dtype=fp16", "metadata_dtype must be one of 'auto', 'kv', 'fp8'"),
                         ("budget=4", "Accepted: token_budget, skip_layers, group_reduction, keep_sink, "
                                      "recent_pages, page_size, bound_size, metadata_dtype, rescore, oracle"),
                         ("rescore=0", "rescore must be an int >= 1"),
                         ("rescore=2,oracle=true", "rescore has nothing to refine; use one of them")]:
        with pytest.raises(SelectionError, match=message):
            resolve_sparse_policy(f"quest:{bad}")


def test_the_oracle_is_not_captured_in_cuda_graphs():
    assert QuestPolicy(QuestConfig()).cuda_graph_safe
    assert not QuestPolicy(QuestConfig(oracle=True)).cuda_graph_safe


def test_a_budget_below_one_page_is_refused_at_start():
    with pytest.raises(ValueError, match=r"token_budget=8 is less than one page \(page_size=16, block_size=16\)"):
        QuestPolicy(QuestConfig(token_budget=8)).initialize(4, 2, 16, 10, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"token_budget=32 is less than one page \(page_size=64"):
        QuestPolicy(QuestConfig(token_budget=32, page_size=64)).initialize(4, 2, 16, 10, 16, torch.float32,
                                                                           torch.device("cpu"))


@pytest.mark.parametrize(("page", "block", "fit"), [(24, 16, 32), (8, 16, 16), (16, 32, 32)])
def test_a_page_that_is_not_whole_blocks_is_refused_at_start(page, block, fit):
    with pytest.raises(ValueError, match=rf"page_size={page} is not a multiple of the KV block size "
                                         rf"\(block_size={block}\); use a multiple of {block}, e.g. "
                                         rf"sparse_policy='quest:page_size={fit}'"):
        QuestPolicy(QuestConfig(page_size=page)).initialize(4, 2, 16, 10, block, torch.float32, torch.device("cpu"))


def assert_pages_bound_their_keys(metadata: torch.Tensor, k_cache: torch.Tensor, tables: torch.Tensor,
                                  lens: list[int], page: int, bound: int | None = None) -> None:
    """Every bound's min/max, kept at its page's anchor, bounds each channel of each of its keys
    (``metadata``: one layer's ``[blocks, Hkv, 2 * bounds a page, D]``; ``bound``: tokens a bound covers,
    the page by default)."""
    block, bound = k_cache.shape[1], bound or page
    per_page = page // bound
    for s, n in enumerate(lens):
        keys = k_cache[tables[s, : -(-n // block)].long()].flatten(0, 1)[:n].float()  # [n, Hkv, D]
        bounds = metadata.float()
        for p in range(-(-n // page)):
            anchor = int(tables[s, p * (page // block)])
            for j in range(per_page):
                covered = keys[p * page + j * bound: p * page + (j + 1) * bound]
                if len(covered):
                    row = bounds[anchor, :, 2 * j: 2 * j + 2]
                    where = f"seq {s} page {p} bound {j}"
                    assert (row[:, reference.MIN] <= covered.amin(0)).all(), f"{where}: min"
                    assert (row[:, reference.MAX] >= covered.amax(0)).all(), f"{where}: max"


@pytest.mark.parametrize(("page", "bound"), [(BLOCK, None), (3 * BLOCK, None), (BLOCK, 2), (BLOCK, 1)])
@pytest.mark.parametrize("metadata_dtype", ["auto", "kv", "fp8"])
def test_the_bound_holds_for_every_key(page, bound, metadata_dtype):
    """Each query head's bound for a page is at least ``q . k`` of every key in it; a KV head's score
    (max over its group) at least the best ``q . k`` of any of its query heads. Float8 bounds, and bounds
    over part of a page (``bound_size``; unset with float8 bounds: halves of a page of one block), too."""
    lens = [37, 64, 5]
    policy, ctx = decode_batch(lens, seed=3, page_size=page, bound_size=bound, metadata_dtype=metadata_dtype)
    float8 = metadata_dtype != "kv"  # auto: float8 on the CPU
    assert policy.bound_size == (bound or (page // 2 if float8 and page == BLOCK else page))
    bound, per_page = policy.bound_size, policy.bounds_per_page
    assert policy.metadata.shape[1:4] == (ctx.k_cache.shape[0], 2, 2 * per_page)
    if float8:
        assert policy.metadata.dtype == reference.FP8
        cpu = torch.device("cpu")
        bytes_per_block = policy.metadata_bytes_per_block(3, 2, 16, BLOCK, torch.bfloat16, cpu)
        assert bytes_per_block == 3 * 2 * 2 * 16 * per_page
    else:
        assert policy.metadata.dtype == torch.float32
    assert_pages_bound_their_keys(policy.metadata[0], ctx.k_cache, ctx.meta.block_tables, lens, page, bound)
    q = ctx.query
    for reduction in ("max", "sum"):
        scores = reference.page_scores(q, policy.metadata[0], ctx.meta.block_tables, ctx.history_lens,
                                       BLOCK, page, reduction)
        per_head = reference.page_scores(q, policy.metadata[0].repeat_interleave(4, dim=1),
                                         ctx.meta.block_tables, ctx.history_lens, BLOCK, page)  # MHA: G = 1
        for s, n in enumerate(lens):
            keys = ctx.k_cache[ctx.meta.block_tables[s, : -(-n // BLOCK)].long()].flatten(0, 1)[:n]  # [n, Hkv, D]
            qk = torch.einsum("hd,nhd->hn", q[s], keys.repeat_interleave(4, dim=1))  # [H, n]
            best = torch.full((8, -(-n // page)), float("-inf"))
            best = best.scatter_reduce(1, (torch.arange(n) // page).expand(8, n), qk, "amax")
            last = -(-n // page) - 1
            assert (per_head[s, :, :last] >= best[:, :last] - 1e-5).all()
            group_best = best.view(2, 4, -1).amax(1)
            if reduction == "max":
                assert (scores[s, :, :last] >= group_best[:, :last] - 1e-5).all()
            assert torch.isinf(scores[s, :, last]).all() and (scores[s, :, last + 1:] == float("-inf")).all()


@pytest.mark.parametrize("metadata_dtype", ["kv", "fp8"])
def test_bounds_over_part_of_a_page_are_tighter(metadata_dtype):
    """A page scored by bounds over halves of it scores at most what its whole-page bound scores (the min/max
    of the halves' min/max), and less wherever the halves' keys differ; the policy selects by the halves."""
    lens = [37, 64, 5]
    policy, ctx = decode_batch(lens, seed=4, bound_size=BLOCK // 2, metadata_dtype=metadata_dtype,
                               token_budget=4 * BLOCK, group_reduction="max")
    halves = policy.metadata[0].float()  # [blocks, Hkv, min|max of each half, D]
    whole = torch.stack([halves[:, :, reference.MIN::2].amin(2), halves[:, :, reference.MAX::2].amax(2)], 2)
    args = (ctx.meta.block_tables, ctx.history_lens, BLOCK, BLOCK, "max", False)
    tight = reference.page_scores(ctx.query, policy.metadata[0], *args)
    loose = reference.page_scores(ctx.query, whole, *args)
    finite = torch.isfinite(loose)
    assert torch.equal(finite, torch.isfinite(tight))
    assert (tight[finite] <= loose[finite] + 1e-5).all()
    assert (tight[finite] < loose[finite] - 1e-3).float().mean() > 0.5
    lens = ctx.history_lens
    forced = (ctx.meta.block_tables, lens, BLOCK, BLOCK, "max", policy.keep_sink, policy.recent_pages)
    want = reference.top_pages(reference.page_scores(ctx.query, policy.metadata[0], *forced), 4, lens, BLOCK,
                               BLOCK)
    assert torch.equal(policy.select_blocks(ctx), want)
    by_pages = reference.top_pages(reference.page_scores(ctx.query, whole, *forced), 4, lens, BLOCK, BLOCK)
    assert not torch.equal(by_pages, want)  # whole-page bounds select otherwise


@pytest.mark.parametrize(("device", "capability", "block", "want"), [
    ("cpu", None, 16, (16, 8, True)), ("cuda", (9, 0), 16, (16, 8, True)),
    ("cuda", (8, 9), 32, (32, 16, True)), ("cuda", (8, 0), 16, (16, 16, False)),
    ("cpu", None, 4, (4, 2, True)), ("cpu", None, 5, (5, 5, True)),
])
def test_the_default_bounds_are_float8_halves_of_the_page_where_float8_is(device, capability, block, want,
                                                                          monkeypatch):
    """``auto``: two float8 bounds a page of one block (as many bytes as one 16-bit bound) where Triton has
    float8; on a GPU without it, the paper's one bound in the KV dtype. Larger pages keep one bound."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = torch.device(device)
    assert tuple(bound_layout(QuestConfig(), block, device)) == want
    assert tuple(bound_layout(QuestConfig(metadata_dtype="kv"), block, device)) == (block, block, False)
    assert bound_layout(QuestConfig(page_size=4 * block), block, device).bound_size == 4 * block
    assert bound_layout(QuestConfig(bound_size=1), block, device).bound_size == 1


def test_float8_bounds_on_a_gpu_without_float8_are_refused_at_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"metadata_dtype=fp8 needs .* compute capability 8\.9 or newer .* this "
                                         r"one is 8\.0: use metadata_dtype=kv"):
        QuestPolicy(QuestConfig(metadata_dtype="fp8")).initialize(4, 2, 16, 10, 16, torch.bfloat16,
                                                                  torch.device("cuda"))


def test_metadata_bytes_are_counted_on_the_engines_device(monkeypatch):
    """A CPU engine keeps float8 bounds (torch has them) on a machine whose GPU lacks them: its bytes are
    counted for the CPU, and the GPU's are in the KV dtype."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    shape = (4, 2, 16, 16, torch.bfloat16)  # 2 sparse layers of the 4 (skip_layers=2)
    auto, fp8 = QuestPolicy(QuestConfig()), QuestPolicy(QuestConfig(metadata_dtype="fp8"))
    assert auto.metadata_bytes_per_block(*shape, torch.device("cpu")) == 2 * 2 * 4 * 16 * 1  # float8 halves
    assert fp8.metadata_bytes_per_block(*shape, torch.device("cpu")) == 2 * 2 * 4 * 16 * 1
    assert auto.metadata_bytes_per_block(*shape, torch.device("cuda")) == 2 * 2 * 2 * 16 * 2  # one bf16 bound
    with pytest.raises(ValueError, match="metadata_dtype=fp8 needs float8"):
        fp8.metadata_bytes_per_block(*shape, torch.device("cuda"))


@pytest.mark.parametrize(("bound", "page", "block"), [(3, None, 4), (8, None, 4), (2, 8, 4), (6, 16, 16)])
def test_a_bound_that_does_not_split_the_page_is_refused_at_start(bound, page, block):
    with pytest.raises(ValueError, match=rf"bound_size={bound} does not split the page .* e\.g\. "
                                         rf"sparse_policy='quest:bound_size={block // 2}'"):
        QuestPolicy(QuestConfig(bound_size=bound, page_size=page)).initialize(
            4, 2, 16, 10, block, torch.float32, torch.device("cpu"))


def test_a_float8_page_past_its_range_is_always_kept():
    """A key channel beyond float8's +-448 leaves its page without a bound (NaN): it scores ``+inf`` and is
    selected whatever the query, until the page restarts; the other pages keep finite float8 bounds."""
    lens = [40]
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 40, 2, 16, generator=g)
    keys[0, 9, 1, 4] = 900.0  # page 2 (blocks of 4), KV head 1
    q = torch.randn(1, 8, 16, generator=g)
    q[0, :, 4] = -1.0  # every query head would rank the page low on that channel
    policy, ctx = paged_decode(keys, torch.randn_like(keys), q, lens, metadata_dtype="fp8", token_budget=8,
                               keep_sink=False)
    anchor = int(ctx.meta.block_tables[0, 2])
    assert policy.metadata[0, anchor, 1, reference.MAX].float().isnan().any()
    assert not policy.metadata[0, anchor, 0].float().isnan().any()  # KV head 0 keeps its bound
    scores = reference.page_scores(q, policy.metadata[0], ctx.meta.block_tables, ctx.history_lens, BLOCK, BLOCK)
    assert scores[0, 1, 2] == float("inf") and torch.isfinite(scores[0, 0, :-1]).all()
    assert 2 in policy.select_blocks(ctx)[0, 1].tolist()


def test_selection_keeps_the_contract():
    lens = [3, 17, 40, 41, 64]
    policy, ctx = decode_batch(lens, token_budget=4 * BLOCK, keep_sink=True)
    sel = policy.select_blocks(ctx)
    assert sel.dtype == torch.int32 and sel.shape == (5, 2, 4)
    for s, n in enumerate(lens):
        blocks = -(-n // BLOCK)
        for h in range(2):
            row = sel[s, h].tolist()
            picked = [b for b in row if b >= 0]
            assert row == picked + [-1] * (4 - len(picked)) and picked == sorted(set(picked))
            assert all(b < blocks for b in picked) and len(picked) == min(4, blocks)
            assert blocks - 1 in picked and 0 in picked  # the newest block, and the sink


@pytest.mark.parametrize("per_page", [1, 2])
def test_the_newest_pages_are_kept_whatever_their_bounds(per_page):
    """``recent_pages``: the newest pages are selected even when their bounds rank last, and never more of
    them than the budget holds besides the sink, the page being written first."""
    page, n = per_page * BLOCK, 12 * per_page * BLOCK + 3  # 13 pages, the newest partly written
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, n, 2, 16, generator=g).abs()
    keys[0, n - 4 * page:] = -keys[0, n - 4 * page:]  # the newest pages' keys point away from every query
    q = torch.ones(1, 8, 16)
    pages = -(-n // page)

    def kept(budget_pages: int, **config) -> list[int]:
        policy, ctx = paged_decode(keys, torch.randn_like(keys), q, [n], token_budget=budget_pages * page,
                                   page_size=page, **config)
        blocks = policy.select_blocks(ctx)[0, 0].tolist()
        return sorted({b // per_page for b in blocks if b >= 0})

    newest = list(range(pages - 3, pages))
    assert not set(newest[:2]) & set(kept(6, keep_sink=True))  # ranked by the bound: the newest page alone
    assert set(newest) | {0} <= set(kept(6, keep_sink=True, recent_pages=3))
    assert kept(6, keep_sink=False, recent_pages=3)[-3:] == newest and 0 not in newest
    assert kept(3, keep_sink=True, recent_pages=8) == [0, pages - 2, pages - 1]  # 2 recent + the sink
    assert kept(1, keep_sink=True, recent_pages=8) == [pages - 1]  # one page: the one being written


@pytest.mark.parametrize("options", [{}, {"group_reduction": "mass"}, {"group_reduction": "mass", "rescore": 2}])
def test_a_budget_covering_every_block_is_dense_attention(options):
    policy, ctx = decode_batch([3, 17, 40], token_budget=64 * BLOCK, **options)
    dense = TorchBackend().decode(ctx.query, ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
    ctx.selected_blocks = policy.select_blocks(ctx)
    torch.testing.assert_close(policy.compute_chunked_decode(ctx.query, ctx), dense)
    # a sequence within the budget selects all its blocks while a longer one is sparse
    policy, ctx = decode_batch([9, 60], token_budget=3 * BLOCK, **options)
    sel = policy.select_blocks(ctx)
    assert sorted(set(sel[0].flatten().tolist())) == [0, 1, 2]
    ctx.selected_blocks = sel
    out = policy.compute_chunked_decode(ctx.query, ctx)
    dense = TorchBackend().decode(ctx.query, ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
    torch.testing.assert_close(out[0], dense[0])
    assert (out[1] - dense[1]).abs().max() > 1e-3


@pytest.mark.parametrize("page", [BLOCK, 2 * BLOCK])
def test_the_selected_pages_are_the_top_bounds(page):
    policy, ctx = decode_batch([62], token_budget=5 * page, page_size=page)
    sel = policy.select_blocks(ctx)
    per_page = page // BLOCK
    assert sel.shape == (1, 2, 5 * per_page)
    cfg = policy.config
    scores = reference.page_scores(ctx.query, policy.metadata[0], ctx.meta.block_tables, ctx.history_lens,
                                   BLOCK, page, cfg.group_reduction, cfg.keep_sink, policy.recent_pages, ctx.scale)
    pages = -(-62 // page)
    for h in range(2):
        chosen = sorted({b // per_page for b in sel[0, h].tolist() if b >= 0})
        assert len(chosen) == 5 and pages - 1 in chosen and 0 in chosen  # the newest page, and the sink
        # a chosen page brings each of its blocks that hold history, and nothing else
        assert [b for b in sel[0, h].tolist() if b >= 0] == [
            b for p in chosen for b in range(p * per_page, (p + 1) * per_page) if b < -(-62 // BLOCK)]
        others = [p for p in range(pages) if p not in chosen]
        assert min(scores[0, h, chosen]) >= max(scores[0, h, others])


@pytest.mark.parametrize("page", [BLOCK, 3 * BLOCK])
def test_page_masses_are_each_heads_softmax_summed_by_page(page):
    """Per query head, the softmax of ``scale * q . k`` over the history, summed over each page's keys and
    combined over the GQA group by ``group_reduction``; the forced pages and those past the history as in
    ``page_scores``. With one query head per KV head the masses over all pages sum to 1."""
    lens = [37, 64, 5]
    for heads, kv_heads in [(2, 2), (8, 2)]:
        policy, ctx = decode_batch(lens, heads=heads, kv_heads=kv_heads, seed=5, page_size=page)
        keys = ctx.read_keys(ctx.all_history_blocks())
        group = heads // kv_heads
        for reduction, keep_sink in [("sum", False), ("max", True)]:
            got = reference.page_masses(ctx.query, keys, ctx.history_lens, page, ctx.scale, reduction, keep_sink)
            assert got.shape == (3, kv_heads, -(-keys.shape[1] // (page // BLOCK)))
            for s, n in enumerate(lens):
                k = ctx.k_cache[ctx.meta.block_tables[s, : -(-n // BLOCK)].long()].flatten(0, 1)[:n]
                probs = (ctx.scale * torch.einsum("hd,nhd->hn", ctx.query[s],
                                                  k.repeat_interleave(group, dim=1))).softmax(-1)  # [H, n]
                pages = -(-n // page)
                per_head = torch.zeros(heads, pages).index_add_(1, torch.arange(n) // page, probs)
                grouped = per_head.view(kv_heads, group, pages)
                want = grouped.sum(1) if reduction == "sum" else grouped.amax(1)
                first = 1 if keep_sink and pages > 1 else 0
                torch.testing.assert_close(got[s, :, first: pages - 1], want[:, first: pages - 1])
                assert torch.isposinf(got[s, :, pages - 1]).all() and torch.isneginf(got[s, :, pages:]).all()
                assert not keep_sink or torch.isposinf(got[s, :, 0]).all()
                if group == 1 and reduction == "sum":
                    unforced = got[s, :, : pages - 1].sum(-1) + want[:, pages - 1]
                    torch.testing.assert_close(unforced, torch.ones(kv_heads))


def test_the_oracle_keeps_the_page_of_the_largest_q_dot_k_where_the_bound_misleads():
    """Page 5 holds a key aligned with every query (q . k = 32); page 9 holds two keys of opposite signs
    whose channel ranges give the bound 80 but q . k = 0. With the newest page and one more (no sink page),
    Quest's bound keeps page 9; the oracle keeps page 5, which holds nearly all the attention, and so does
    rescoring the bound's best pages by their keys."""
    lens, dim = [64], 16
    g = torch.Generator().manual_seed(0)
    keys = 0.1 * torch.randn(1, 64, 2, dim, generator=g)
    keys[0, 5 * BLOCK + 1] = 2.0
    half = torch.cat([torch.full((dim // 2,), 5.0), torch.full((dim // 2,), -5.0)])
    keys[0, 9 * BLOCK], keys[0, 9 * BLOCK + 2] = half, -half
    q = torch.ones(1, 8, dim)
    values = torch.randn(keys.shape, generator=g)
    for options, kept in [({}, 9), ({"oracle": True}, 5), ({"rescore": 2}, 5)]:
        policy, ctx = paged_decode(keys, values, q, lens, token_budget=2 * BLOCK, keep_sink=False, **options)
        assert policy.select_blocks(ctx).tolist() == [[[kept, 15], [kept, 15]]], f"{options}"


@pytest.mark.parametrize("reduction", ["max", "sum"])
def test_rescoring_every_page_keeps_those_whose_keys_score_highest(reduction):
    """Nominating every page, the selection is the forced pages and the best by each page's largest
    ``q . k`` per query head (combined over the GQA group), computed here from the keys themselves."""
    lens = [150, 77]
    policy, ctx = decode_batch(lens, seed=9, token_budget=5 * BLOCK, rescore=20, group_reduction=reduction)
    sel = policy.select_blocks(ctx)
    for s, n in enumerate(lens):
        pages = -(-n // BLOCK)
        k = ctx.k_cache[ctx.meta.block_tables[s, :pages].long()].flatten(0, 1)[:n]  # [n, Hkv, D]
        qk = torch.einsum("hd,nhd->hn", ctx.query[s], k.repeat_interleave(4, dim=1))  # [H, n]
        best = torch.full((8, pages), float("-inf")).scatter_reduce(
            1, (torch.arange(n) // BLOCK).expand(8, n), qk, "amax").view(2, 4, pages)
        exact = best.amax(1) if reduction == "max" else best.sum(1)
        for h in range(2):
            chosen = sorted(b for b in sel[s, h].tolist() if b >= 0)
            ranked = exact[h, 1: pages - 1].argsort(descending=True)[:3] + 1  # besides sink and newest
            assert chosen == sorted([0, pages - 1, *ranked.tolist()]), f"seq {s} KV head {h}"


def test_mass_keeps_each_query_heads_own_pages_whatever_the_scale_of_its_logits():
    """Two query heads on one KV head. Head 0's logits span a wide range: pages 1-3 score 30, the other
    old pages 10; head 1's a narrow one: pages 4-6 score 3, the rest 0. The largest raw bound (``max``)
    fills the budget from head 0's second tier; ``mass`` compares attention shares, where head 1's pages
    hold far more of its attention than head 0's second tier holds of head 0's, and keeps them."""
    dim, n = 16, 16 * BLOCK
    keys = torch.zeros(1, n, 1, dim)
    keys[0, :, 0, 0] = 1.0  # q0 . k = 10
    keys[0, BLOCK: 4 * BLOCK, 0, 0] = 3.0  # pages 1-3: q0 . k = 30
    keys[0, 4 * BLOCK: 7 * BLOCK, 0, 0] = 0.0
    keys[0, 4 * BLOCK: 7 * BLOCK, 0, 1] = 3.0  # pages 4-6: q1 . k = 3
    q = torch.zeros(1, 2, dim)
    q[0, 0, 0], q[0, 1, 1] = 10.0, 1.0
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(0))
    for reduction, kept in [("max", {1, 2, 3}), ("mass", {1, 2, 3, 4, 5, 6})]:
        policy, ctx = paged_decode(keys, values, q, [n], token_budget=7 * BLOCK, keep_sink=False,
                                   group_reduction=reduction)
        chosen = set(policy.select_blocks(ctx)[0, 0].tolist()) - {15}  # the newest page, always kept
        assert kept <= chosen and len(chosen) == 6, reduction
        assert reduction == "mass" or not chosen & {4, 5, 6}


def test_combined_shares_are_each_heads_softmax_summed():
    """A head's constant shift changes nothing; with one head the order is its own; the shares of a
    group sum to one per head; ``+inf`` (an unbounded page) and ``-inf`` (past the history) pass
    through."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 4, 20, generator=g) * torch.tensor([1.0, 5.0, 20.0, 0.1])[:, None]
    logits[0, 0, :, 15:] = float("-inf")
    got = reference.combine_shares(logits)
    shifted = reference.combine_shares(logits + torch.randn(2, 3, 4, 1, generator=g) * 100)
    torch.testing.assert_close(got, shifted, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.exp().sum(-1), torch.full((2, 3), 4.0))
    assert torch.isneginf(got[0, 0, 15:]).all() and torch.isfinite(got[0, 0, :15]).all()
    one = reference.combine_shares(logits[:, :, :1])
    assert torch.equal(one.argsort(-1), logits[:, :, 0].argsort(-1))
    logits[1, 2, 3, 7] = float("inf")
    got = reference.combine_shares(logits)
    assert torch.isposinf(got[1, 2, 7]) and torch.isfinite(got[1, 2, :7]).all()


def test_rescoring_every_page_by_mass_keeps_the_oracles_pages():
    """Nominating every page, ``mass`` ranks by each query head's exact attention share summed over the
    group: the oracle's ranking (``page_masses`` summed)."""
    lens = [150, 77]
    policy, ctx = decode_batch(lens, seed=9, token_budget=5 * BLOCK, rescore=20, group_reduction="mass")
    sel = policy.select_blocks(ctx)
    keys = ctx.read_keys(ctx.all_history_blocks())
    masses = reference.page_masses(ctx.query, keys, ctx.history_lens, BLOCK, ctx.scale, "sum")
    for s, n in enumerate(lens):
        pages = -(-n // BLOCK)
        for h in range(2):
            chosen = sorted(b for b in sel[s, h].tolist() if b >= 0)
            ranked = masses[s, h, 1: pages - 1].argsort(descending=True)[:3] + 1  # besides sink and newest
            assert chosen == sorted([0, pages - 1, *ranked.tolist()]), f"seq {s} KV head {h}"


@pytest.mark.parametrize(("options", "block", "want"), [
    ({}, 16, 3), ({"page_size": 16}, 16, 3), ({"page_size": 32}, 16, 1), ({"oracle": True}, 16, 1),
    ({"rescore": 1}, 16, 1), ({"rescore": 4, "page_size": 8}, 8, 4)])
def test_unset_rescore_rescores_pages_of_one_block(options, block, want):
    """Unset, ``rescore`` is 3 with pages of one KV block, and 1 where it cannot run (larger pages) or has
    nothing to refine (the oracle); set, it is what was set."""
    policy = QuestPolicy(QuestConfig(**options))
    policy.initialize(4, 2, 16, 10, block, torch.float32, torch.device("cpu"))
    assert policy.rescore == want


def test_rescore_is_refused_with_pages_of_several_blocks():
    with pytest.raises(ValueError, match=r"rescore=2 ranks pages of one KV block, but page_size=32 holds 2 "
                                         r"blocks of 16; leave page_size unset, or use rescore=1"):
        QuestPolicy(QuestConfig(rescore=2, page_size=32)).initialize(4, 2, 16, 10, 16, torch.float32,
                                                                     torch.device("cpu"))


@pytest.mark.parametrize("reduction", ["max", "mass"])
def test_rescore_reads_only_the_nominees_keys_from_a_store_that_copies(reduction):
    """Through a store that copies what it reads (the host pool's way), rescore reads the nominated blocks'
    keys alone, into a copy of a fixed size (no host sync), and selects what it selects on the GPU cache."""
    lens = [150, 40, 90]
    policy, ctx = decode_batch(lens, seed=9, token_budget=5 * BLOCK, rescore=3, group_reduction=reduction)
    want = policy.select_blocks(ctx)
    reads = []

    class CompactReads(PagedLayerKV):
        def read_paged(self, ctx, blocks, values=True, width=None):
            present = blocks()
            reads.append((int(present.sum(-1).max()), values, width))
            return self.compact_copy(ctx, present, values, width)

    ctx.kv = CompactReads(ctx.layer_id, ctx.k_cache, ctx.v_cache)
    torch.testing.assert_close(policy.select_blocks(ctx), want)
    [(most, values, width)] = reads
    num_blocks = ctx.meta.block_tables.shape[1]
    assert not values and width == ctx.num_kv_heads * 3 * 5 and most <= width < num_blocks


def test_nominee_marks_are_the_blocks_any_kv_head_nominates():
    """The blocks a store that copies reads: every KV head's nominees, -1 padding none (not the last)."""
    nominees = torch.tensor([[[3, 5, -1], [0, 5, 7]], [[-1, -1, -1], [2, 3, 8]]], dtype=torch.int32)
    marks = nominee_marks(nominees, 9)
    assert marks.shape == (2, 9) and marks.dtype == torch.bool
    for s in range(2):
        assert set(marks[s].nonzero().flatten().tolist()) == {b for b in nominees[s].flatten().tolist() if b >= 0}


def planted_capture(case: planted.PlantedAttention, num_layers: int = 1) -> Capture:
    layers = [LayerActivations(0, case.q, case.k, case.v, case.scale)]
    return Capture(list(range(case.num_tokens)), layers, num_layers, case.block_size, torch.float32,
                   torch.device("cpu"), TorchBackend())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("per_page", "kept", "gap"), [(1, 2, 0.05), (2, 3, 0.1)])
@pytest.mark.parametrize("keep_sink", [False, True])
def test_the_needles_page_is_selected_among_distractors(seed, per_page, kept, gap, keep_sink):
    """Planted needles: one key per KV head that every later query looks for, and eight near-miss
    distractors at cosine 0.7 in other blocks. With a budget of the newest page and one more (and the sink
    page, when it is kept), Quest keeps each needle's block. Without the sink page, on the attention metrics
    it matches the oracle and beats a random choice (these planted keys have no sink: the kept one takes
    a block the oracle spends elsewhere).
    Pages of two blocks hold twice the random keys, whose channel extremes loosen the bound: a distractor's
    page can outrank the needle's (seeds 1, 2 and 4), so they keep the newest page and two more; and they
    take whole pages, where the oracle takes as many blocks anywhere (``gap``: its lead in mass recall)."""
    installed()
    case = planted.needles(num_tokens=512, seed=seed)
    page = per_page * case.block_size
    positions = [479, 495, 511]
    truth = case.true_blocks()[positions]  # [P, Hkv, blocks]
    assert truth.sum(-1).eq(1).all(), "every query sees its head's needle"
    lens = [p + 1 for p in positions]
    keys = case.k.expand(len(positions), -1, -1, -1)
    budget = (kept + keep_sink) * page
    policy, ctx = paged_decode(keys, case.v.expand_as(keys), case.q[positions], lens, block=case.block_size,
                               token_budget=budget, page_size=page, keep_sink=keep_sink)
    sel = policy.select_blocks(ctx)  # [P, Hkv, budget // BLOCK]
    for p in range(len(positions)):
        for h in range(case.num_kv_heads):
            needle = int(truth[p, h].nonzero())
            assert needle in sel[p, h].tolist(), f"query {positions[p]}, KV head {h}: needle block {needle}"
            assert not keep_sink or 0 in sel[p, h].tolist()
    if keep_sink:
        return
    layers = evaluate_policy(f"quest:token_budget={budget},skip_layers=0,page_size={page},keep_sink=false,"
                             "recent_pages=1",
                             planted_capture(case), positions)
    got, oracle, rand = (layers[0][w] for w in ("policy", "oracle", "random"))
    assert got["mass_recall"] >= oracle["mass_recall"] - gap and got["mass_recall"] > rand["mass_recall"] + 0.4
    assert got["policy_output_error"] == pytest.approx(got["output_error"], abs=1e-4)


def test_skip_layers_are_dense():
    installed()
    case = planted.needles(num_tokens=256, seed=4)
    layers = evaluate_policy("quest:token_budget=16,skip_layers=1", planted_capture(case, num_layers=2), [255])
    assert layers[0]["policy"]["density"] == pytest.approx(1.0)
    assert layers[0]["policy"]["policy_output_error"] < 1e-5


@pytest.mark.parametrize("block", [4, 16, 32])
def test_the_default_page_is_one_kv_block(block):
    policy = QuestPolicy(QuestConfig(token_budget=64 * block))
    policy.initialize(4, 2, 16, 10, block, torch.float32, "cpu")
    assert (policy.page_size, policy.blocks_per_page, policy.budget_pages) == (block, 1, 64)


def test_float8_rounding_is_outward_and_tight():
    """Rounding up gives the smallest float8 at or above ``x``, down the largest at or below; past the range
    on the rounding side (and NaN) gives NaN, which scoring reads as no bound."""
    values = torch.arange(256, dtype=torch.int32).to(torch.int8).view(reference.FP8).float()
    grid = values[~values.isnan()].unique()  # ascending, -448 .. 448
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 40, torch.randn(2000, generator=g) * 1e-3, grid,
                   torch.tensor([0.0, -0.0, 1e-12, -1e-12, 448.5, -448.5, 1e4, -1e4, float("nan")])])
    up, down = reference.round_fp8(x, up=True).float(), reference.round_fp8(x, up=False).float()
    assert torch.equal(up.isnan(), (x > 448) | x.isnan()) and torch.equal(down.isnan(), (x < -448) | x.isnan())
    fine = ~up.isnan()
    assert torch.equal(up[fine], grid[torch.searchsorted(grid, x[fine])])
    fine = ~down.isnan()
    assert torch.equal(down[fine], grid[torch.searchsorted(grid, x[fine], right=True) - 1])
