"""The ``quest`` policy: its bound, its selection and its attention, on the CPU (torch references) and,
where marked ``gpu``, in the engine on CUDA (Triton kernels, CUDA graphs, offload)."""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.plugins import get_plugins
from nanovllm.policy import KVWrite, PolicyContext
from nanovllm.quality import planted
from nanovllm.quality.capture import Capture, LayerActivations
from nanovllm.quality.evaluate import evaluate_policy
from nanovllm.selection import SelectionError, resolve_sparse_policy
from nanovllm_quest import reference
from nanovllm_quest.config import QuestConfig
from nanovllm_quest.policy import QuestPolicy

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
    ``on_kv_write`` as one prefill each; ``q [S, H, D]`` is the decode step's queries."""
    num_seqs, _, kv_heads, dim = keys.shape
    width = max(-(-n // block) for n in lens)
    k_cache = torch.zeros(num_seqs * width, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    policy = QuestPolicy(QuestConfig(**{"skip_layers": 0, **config}))
    policy.initialize(1, kv_heads, dim, num_seqs * width, block, torch.float32, torch.device("cpu"))
    for s, n in enumerate(lens):
        used = -(-n // block)
        tables[s, :used] = torch.arange(used, dtype=torch.int32).flip(0) + s * width
        for j, b in enumerate(tables[s, :used].tolist()):
            rows = slice(j * block, min(n, (j + 1) * block))
            k_cache[b, : rows.stop - rows.start] = keys[s, rows]
            v_cache[b, : rows.stop - rows.start] = values[s, rows]
        counts = [min(block, n - j * block) for j in range(used)]
        policy.on_kv_write(KVWrite.of_blocks(0, k_cache, v_cache, tables[s, :used].tolist(), counts,
                                             [j * block for j in range(used)]))
    meta = PhaseMetadata(torch.arange(num_seqs + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                         tables, 1, max(lens))
    return policy, PolicyContext(0, False, q, meta, k_cache, v_cache, dim**-0.5, TorchBackend())


def test_config_is_checked_at_the_selection():
    installed()
    resolved = resolve_sparse_policy("quest:token_budget=1024,group_reduction=sum,keep_sink=true")
    assert resolved.cls is QuestPolicy
    assert resolved.config == QuestConfig(1024, 2, "sum", True)
    for bad, message in [("token_budget=0", "token_budget must be an int >= 1"),
                         ("skip_layers=-1", "skip_layers must be an int >= 0"),
                         ("group_reduction=mean", "group_reduction must be one of 'max', 'sum'"),
                         ("keep_sink=2", "keep_sink must be true or false"),
                         ("budget=4", "Accepted: token_budget, skip_layers, group_reduction, keep_sink")]:
        with pytest.raises(SelectionError, match=message):
            resolve_sparse_policy(f"quest:{bad}")


def test_a_budget_below_one_block_is_refused_at_start():
    with pytest.raises(ValueError, match=r"token_budget=8 is less than one KV block \(block_size=16\)"):
        QuestPolicy(QuestConfig(token_budget=8)).initialize(4, 2, 16, 10, 16, torch.float32, torch.device("cpu"))


def test_the_bound_holds_for_every_key():
    """Each query head's bound for a block is at least ``q . k`` of every key in it; a KV head's score
    (max over its group) at least the best ``q . k`` of any of its query heads."""
    lens = [37, 64, 5]
    policy, ctx = decode_batch(lens, seed=3)
    q = ctx.query
    for reduction in ("max", "sum"):
        scores = reference.block_scores(q, policy.metadata[0], ctx.meta.block_tables, ctx.history_lens,
                                        BLOCK, reduction)
        per_head = reference.block_scores(q, policy.metadata[0].repeat_interleave(4, dim=1),
                                          ctx.meta.block_tables, ctx.history_lens, BLOCK)  # MHA view: G = 1
        for s, n in enumerate(lens):
            keys = ctx.k_cache[ctx.meta.block_tables[s, : -(-n // BLOCK)].long()].flatten(0, 1)[:n]  # [n, Hkv, D]
            qk = torch.einsum("hd,nhd->hn", q[s], keys.repeat_interleave(4, dim=1))  # [H, n]
            best = torch.full((8, -(-n // BLOCK)), float("-inf"))
            best = best.scatter_reduce(1, (torch.arange(n) // BLOCK).expand(8, n), qk, "amax")
            last = -(-n // BLOCK) - 1
            assert (per_head[s, :, :last] >= best[:, :last] - 1e-5).all()
            group_best = best.view(2, 4, -1).amax(1)
            if reduction == "max":
                assert (scores[s, :, :last] >= group_best[:, :last] - 1e-5).all()
            assert torch.isinf(scores[s, :, last]).all() and (scores[s, :, last + 1:] == float("-inf")).all()


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


def test_a_budget_covering_every_block_is_dense_attention():
    policy, ctx = decode_batch([3, 17, 40], token_budget=64 * BLOCK)
    dense = TorchBackend().decode(ctx.query, ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
    ctx.selected_blocks = policy.select_blocks(ctx)
    torch.testing.assert_close(policy.compute_chunked_decode(ctx.query, ctx), dense)
    # a sequence within the budget selects all its blocks while a longer one is sparse
    policy, ctx = decode_batch([9, 60], token_budget=3 * BLOCK)
    sel = policy.select_blocks(ctx)
    assert sorted(set(sel[0].flatten().tolist())) == [0, 1, 2]
    ctx.selected_blocks = sel
    out = policy.compute_chunked_decode(ctx.query, ctx)
    dense = TorchBackend().decode(ctx.query, ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
    torch.testing.assert_close(out[0], dense[0])
    assert (out[1] - dense[1]).abs().max() > 1e-3


def test_the_selected_blocks_are_the_top_bounds():
    policy, ctx = decode_batch([64], token_budget=5 * BLOCK)
    sel = policy.select_blocks(ctx)
    scores = reference.block_scores(ctx.query, policy.metadata[0], ctx.meta.block_tables, ctx.history_lens, BLOCK)
    for h in range(2):
        chosen = set(sel[0, h].tolist())
        others = [b for b in range(16) if b not in chosen]
        assert min(scores[0, h, list(chosen)]) >= max(scores[0, h, others])


def planted_capture(case: planted.PlantedAttention, num_layers: int = 1) -> Capture:
    layers = [LayerActivations(0, case.q, case.k, case.v, case.scale)]
    return Capture(list(range(case.num_tokens)), layers, num_layers, case.block_size, torch.float32,
                   torch.device("cpu"), TorchBackend())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_needles_block_is_selected_among_distractors(seed):
    """Planted needles: one key per KV head that every later query looks for, and eight near-miss
    distractors at cosine 0.7 in other blocks. With a budget of the newest block and one more, Quest
    keeps each needle's block; on the attention metrics it matches the oracle and beats a random choice."""
    installed()
    case = planted.needles(num_tokens=512, seed=seed)
    positions = [479, 495, 511]
    truth = case.true_blocks()[positions]  # [P, Hkv, blocks]
    assert truth.sum(-1).eq(1).all(), "every query sees its head's needle"
    lens = [p + 1 for p in positions]
    keys = case.k.expand(len(positions), -1, -1, -1)
    policy, ctx = paged_decode(keys, case.v.expand_as(keys), case.q[positions], lens, block=case.block_size,
                               token_budget=2 * case.block_size)
    sel = policy.select_blocks(ctx)  # [P, Hkv, 2]
    for p in range(len(positions)):
        for h in range(case.num_kv_heads):
            needle = int(truth[p, h].nonzero())
            assert needle in sel[p, h].tolist(), f"query {positions[p]}, KV head {h}: needle block {needle}"
    layers = evaluate_policy("quest:token_budget=32,skip_layers=0", planted_capture(case), positions)
    got, oracle, rand = (layers[0][w] for w in ("policy", "oracle", "random"))
    assert got["mass_recall"] >= oracle["mass_recall"] - 0.05 and got["mass_recall"] > rand["mass_recall"] + 0.4
    assert got["policy_output_error"] == pytest.approx(got["output_error"], abs=1e-4)


def test_skip_layers_are_dense():
    installed()
    case = planted.needles(num_tokens=256, seed=4)
    layers = evaluate_policy("quest:token_budget=16,skip_layers=1", planted_capture(case, num_layers=2), [255])
    assert layers[0]["policy"]["density"] == pytest.approx(1.0)
    assert layers[0]["policy"]["policy_output_error"] < 1e-5
