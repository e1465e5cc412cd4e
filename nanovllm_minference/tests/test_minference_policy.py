"""The ``minference`` policy on the CPU (torch references): budgets covering everything are dense, planted
columns and diagonals are found, each pattern and a per-head file run, small chunks run dense, the
offload path reads the same keys, and bad options are refused with the fix."""

import json

import attrs
import pytest
import torch
from nanovllm.kv import PagedLayerKV
from nanovllm.quality import planted
from nanovllm.testing import prefill_context
from nanovllm_minference.config import MInferenceConfig
from nanovllm_minference.index import index_mask, lines_to_index_reference, tile_slash_lines
from nanovllm_minference.policy import MInferencePolicy, budget_share

BLOCK = 16


def run(policy, q, ctx):
    return policy.compute_chunked_prefill(q, ctx.new_keys, ctx.new_values, ctx)


@pytest.mark.parametrize("pattern", ["vertical_slash", "a_shape", "block_sparse"])
@pytest.mark.parametrize("q_len", [300, 77])
def test_budgets_covering_everything_are_dense(pattern, q_len):
    case = planted.needles(num_tokens=300)
    q, ctx = prefill_context(case.q, case.k, case.v, q_len, case.scale)
    big = dict(vertical_size=300, slash_size=300, n_init=300, n_local=300, top_k_blocks=5)
    policy = MInferencePolicy(MInferenceConfig(pattern=pattern, dense_below=0, dense_above=None, **big))
    got = run(policy, q, ctx)
    want = ctx.attend_all(q, ctx.new_keys, ctx.new_values)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slash_unit, slash_size", [("diagonal", 8), ("tile", 256)])
def test_planted_columns_and_diagonals_are_found(slash_unit, slash_size):
    columns = planted.vertical_columns(num_tokens=512, columns_per_head=3)
    diagonals = planted.slash_diagonals(num_tokens=512, offsets=(0, 48, 160))
    for case, kind in ((columns, "columns"), (diagonals, "offsets")):
        q, ctx = prefill_context(case.q, case.k, case.v, 512, case.scale)
        policy = MInferencePolicy(MInferenceConfig(vertical_size=8, slash_size=slash_size, num_sink_tokens=1,
                                                   num_recent_diags=1, dense_below=0, slash_unit=slash_unit))
        from nanovllm_minference.policy import _ops

        index = policy.build_index(q, ctx, ctx.k_cache, ctx.meta.block_tables, _ops(q.device))
        mask = index_mask(index, ctx.meta.cu_seqlens_q, ctx.meta.context_lens)
        group = q.shape[1] // case.num_kv_heads
        for h in range(q.shape[1]):
            if kind == "columns":
                truth = case.truth[-1, h // group].nonzero().flatten().tolist()
                chosen = index.columns[0, h, : index.column_counts[0, h]].tolist()
                assert set(truth) <= set(chosen)
            else:
                # every planted diagonal lies in the head's slash tiles: each row reads its targets
                assert (mask[:, h] | ~case.truth[:, h // group]).all()


@pytest.mark.parametrize("phase", [0, 5])
def test_tile_slashes_keep_the_best_bands_within_the_budget(phase):
    """A band is scored by its diagonals' shares of it; the nearest diagonals' bands count in the budget; the
    band kept is its middle diagonal, which crosses that key tile alone."""
    ctx, q_len = 1024, 512
    slash = torch.zeros(1, 2, ctx)
    slash[0, 0, 300:311] = 1.0  # head 0: diagonals 300-310, mostly in band 5 (middle 320 + phase)
    slash[0, 1, 440:450] = 1.0  # head 1: band 7 (middle 448 + phase)
    starts, lens = torch.tensor([ctx - q_len + phase]), torch.tensor([ctx + phase])
    sizes = torch.tensor([4 * 64, 4 * 64])  # 4 tiles: the 3 bands of the 100 nearest diagonals and 1 more
    offsets, valid = tile_slash_lines(slash, starts, lens, sizes, 100, 4 * 64)
    assert offsets[valid].view(2, -1)[:, :100].eq(torch.arange(100)).all()  # the nearest, as themselves
    assert offsets[0, 0][valid[0, 0]][100:].tolist() == [320 + phase]
    assert offsets[0, 1][valid[0, 1]][100:].tolist() == [448 + phase]
    index = lines_to_index_reference(torch.zeros(1, 2, 1, dtype=torch.long), torch.zeros(1, 2, 1, dtype=torch.bool),
                                     offsets, valid, starts, ctx + phase)
    assert (index.slash_counts <= 4 + (phase > 0)).all()  # the main diagonal's next tile, for a phase
    # a smaller budget than the nearest diagonals' bands keeps those alone
    offsets, valid = tile_slash_lines(slash, starts, lens, torch.tensor([64, 64]), 100, 64)
    assert valid.sum().item() == 2 * 100


@pytest.mark.gpu
def test_tile_index_on_the_gpu_is_the_reference_index():
    """The GPU's ops (the select and index kernels) give the tile-slash index the torch references give."""
    from nanovllm_minference.policy import _ops

    case = planted.slash_diagonals(num_tokens=480, offsets=(0, 100, 300))
    config = MInferenceConfig(vertical_size=8, slash_size=192, slash_unit="tile", dense_below=0)
    indexes = []
    for device in ("cpu", "cuda"):
        q, ctx = prefill_context(case.q, case.k, case.v, 480, case.scale, device=device)
        indexes.append(MInferencePolicy(config).build_index(q, ctx, ctx.k_cache, ctx.meta.block_tables,
                                                            _ops(q.device)))
    cpu, gpu = indexes
    for name in ("slash_tiles", "slash_counts", "slash_cover", "column_counts"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    assert 0 < cpu.slash_counts.max() <= 3 + 1


def test_tile_slashes_covering_everything_are_dense():
    case = planted.needles(num_tokens=300)
    q, ctx = prefill_context(case.q, case.k, case.v, 200, case.scale)
    config = MInferenceConfig(vertical_size=300, slash_size=7 * 64, slash_unit="tile", dense_below=0,
                              dense_above=None)
    want = ctx.attend_all(q, ctx.new_keys, ctx.new_values)
    torch.testing.assert_close(run(MInferencePolicy(config), q, ctx), want, atol=1e-5, rtol=1e-5)


def test_sparse_output_matches_its_mask():
    """The output is attention over exactly the index's keys (the mask the quality harness measures)."""
    case = planted.local_band(num_tokens=400, window=40)
    q, ctx = prefill_context(case.q, case.k, case.v, 400, case.scale)
    policy = MInferencePolicy(MInferenceConfig(vertical_size=20, slash_size=70, dense_below=0,
                                               dense_above=None))
    from nanovllm_minference.policy import _ops

    index = policy.build_index(q, ctx, ctx.k_cache, ctx.meta.block_tables, _ops(q.device))
    mask = index_mask(index, ctx.meta.cu_seqlens_q, ctx.meta.context_lens)
    assert 0.1 < mask.float().mean() < 0.6  # sparse, and not empty
    group = q.shape[1] // case.num_kv_heads
    scores = torch.einsum("thd,shd->hts", q, case.k.repeat_interleave(group, 1)) * case.scale
    scores = scores.masked_fill(~mask.permute(1, 0, 2), float("-inf"))
    want = torch.einsum("hts,shd->thd", scores.softmax(-1), case.v.repeat_interleave(group, 1))
    torch.testing.assert_close(run(policy, q, ctx), want, atol=2e-4, rtol=1e-4)  # logits reach ~100


def test_short_chunks_and_skipped_layers_run_dense(monkeypatch):
    case = planted.needles(num_tokens=200)
    q, ctx = prefill_context(case.q, case.k, case.v, 200, case.scale)
    import nanovllm_minference.policy as module

    monkeypatch.setattr(module, "_ops", lambda device: pytest.fail("a dense chunk must not estimate"))
    want = ctx.attend_all(q, ctx.new_keys, ctx.new_values)
    for config in (MInferenceConfig(dense_below=201), MInferenceConfig(dense_below=0, skip_layers=4)):
        torch.testing.assert_close(run(MInferencePolicy(config), q, ctx), want)


def test_a_per_head_file_mixes_patterns(tmp_path):
    case = planted.vertical_columns(num_tokens=256)
    q, ctx = prefill_context(case.q, case.k, case.v, 256, case.scale)
    heads = {"0": ["stream_llm", 4, 64, 0], "1": ["vertical_and_slash", 4, 20, 0], "2": ["block_sparse", 2, 1, 0]}
    path = tmp_path / "heads.json"
    path.write_text(json.dumps([heads] * 4))
    policy = MInferencePolicy(MInferenceConfig(config_path=str(path), dense_below=0,
                                               dense_above=None))
    policy.initialize(4, 2, 64, 16, BLOCK, torch.float32, torch.device("cpu"))
    from nanovllm_minference.policy import _ops

    index = policy.build_index(q, ctx, ctx.k_cache, ctx.meta.block_tables, _ops(q.device))
    mask = index_mask(index, ctx.meta.cu_seqlens_q, ctx.meta.context_lens)
    pos = torch.arange(256)
    a_shape = (pos[None, :] < 4) | ((pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] < 64))
    assert (mask[:, 0] >= (a_shape & (pos[None, :] <= pos[:, None]))).all()  # A-shape head: sink + band
    assert index.block_counts[0, 0].sum() == 0 and index.block_counts[0, 2].sum() > 0
    assert index.column_counts[0, 2] == 0 and index.slash_counts[0, 2] == 0
    assert index.column_counts[0, 1] == 4 and index.column_counts[0, 3] == 256  # head 3: the default, capped
    out = run(policy, q, ctx)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="describes 4 layers, but the model has 6"):
        policy.initialize(6, 2, 64, 16, BLOCK, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("options", [dict(vertical_size=10, slash_size=40),
                                     dict(pattern="a_shape", n_init=10, n_local=40)])
def test_offload_reads_the_keys_the_resident_path_reads(monkeypatch, options):
    """The offload path (every key for the estimate, then only the touched blocks) gives the resident
    path's output; here the 'pool' is the same cache read through ``read_keys`` / ``read_blocks``."""
    case = planted.slash_diagonals(num_tokens=480, offsets=(0, 100, 300))
    q, ctx = prefill_context(case.q, case.k, case.v, 150, case.scale)
    policy = MInferencePolicy(MInferenceConfig(**options, dense_below=0, dense_above=None))
    resident = run(policy, q, ctx)

    reads = []

    class CompactReads(PagedLayerKV):  # the paged cache, read as the host store reads it
        def read_paged(self, ctx, blocks, values=True, width=None):
            present = blocks() if callable(blocks) else blocks
            if values:
                reads.append(int(present.sum()))
            return self.compact_copy(ctx, present, values, width)

    ctx.kv = CompactReads(ctx.layer_id, ctx.k_cache, ctx.v_cache)
    offloaded = run(policy, q, ctx)
    torch.testing.assert_close(offloaded, resident)
    assert reads and reads[0] < 480 // BLOCK  # only the touched blocks' values crossed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("offload", [False, True])
def test_a_pattern_that_is_not_sparse_runs_dense(offload, device):
    """An index computing more than ``dense_above`` of dense work gives dense attention, one below it the
    sparse output. With a store that copies the decision comes after the estimate and before any value is
    read (a dense chunk streams the history, no touched block is read); on the GPU cache the kernel takes
    it itself, on the GPU."""
    case = planted.slash_diagonals(num_tokens=480, offsets=(0, 100, 300))
    q, ctx = prefill_context(case.q, case.k, case.v, 480, case.scale, device=device)
    dense = ctx.attend_all(q, ctx.new_keys, ctx.new_values)
    budget = dict(vertical_size=4, slash_size=40, dense_below=0)
    sparse = run(MInferencePolicy(MInferenceConfig(**budget, dense_above=None)), q, ctx)
    assert not torch.allclose(sparse, dense, atol=1e-3)  # the index leaves keys out
    dense_streams, value_reads = [], []
    if offload:
        class DenseStreams(PagedLayerKV):  # the paged cache, read as the host store reads it
            def read_paged(self, ctx, blocks, values=True, width=None):
                present = blocks() if callable(blocks) else blocks
                if values:
                    value_reads.append(int(present.sum()))
                return self.compact_copy(ctx, present, values, width)

            def attend_all(self, ctx, q, k, v):
                dense_streams.append(1)
                return super().attend_all(ctx, q, k, v)

        ctx.kv = DenseStreams(ctx.layer_id, ctx.k_cache, ctx.v_cache)
    import nanovllm_minference.policy as module

    policy = MInferencePolicy(MInferenceConfig(**budget))
    index = policy.build_index(q, ctx, ctx.k_cache, ctx.meta.block_tables, module._ops(q.device))
    density = module.computed_density(index, ctx.meta.cu_seqlens_q, ctx.meta.context_lens)
    assert 0.05 < density < 0.8
    for limit, want in ((density - 0.01, dense), (density + 0.01, sparse), (None, sparse), (0.8, sparse)):
        dense_streams.clear()
        value_reads.clear()
        got = run(MInferencePolicy(MInferenceConfig(**budget, dense_above=limit)), q, ctx)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if offload:
            assert bool(dense_streams) == (want is dense)
            assert value_reads == [0] if want is dense else value_reads[0] > 0


def test_a_budget_covering_most_keys_runs_dense_without_estimating(monkeypatch):
    """A budget naming more than dense_above of the keys the chunk's rows see: dense, known before
    estimating; one key fewer a row and the estimate decides."""
    case = planted.needles(num_tokens=200)
    q, ctx = prefill_context(case.q, case.k, case.v, 120, case.scale)
    import nanovllm_minference.policy as module

    lens = (120,), (200,)  # one sequence: 80 keys of history, a chunk of 120
    budget = next(b for b in range(1, 201) if budget_share(b, *lens) > 0.8)
    want = ctx.attend_all(q, ctx.new_keys, ctx.new_values)
    monkeypatch.setattr(module, "_ops", lambda device: pytest.fail("a dense chunk must not estimate"))
    config = MInferenceConfig(vertical_size=1, slash_size=budget - 1, dense_below=0, dense_above=0.8)
    torch.testing.assert_close(run(MInferencePolicy(config), q, ctx), want)
    with pytest.raises(pytest.fail.Exception):
        run(MInferencePolicy(attrs.evolve(config, slash_size=budget - 2)), q, ctx)
    with pytest.raises(pytest.fail.Exception):  # without dense_above nothing runs dense by its budget
        run(MInferencePolicy(attrs.evolve(config, slash_size=200, dense_above=None)), q, ctx)


@pytest.mark.parametrize("budget", [1, 7, 30, 64, 100, 150])
def test_budget_share_counts_each_row_up_to_the_budget(budget):
    query_lens, context_lens = (40, 70, 1), (100, 70, 5)
    covered = seen = 0
    for q_len, ctx in zip(query_lens, context_lens):
        for pos in range(ctx - q_len, ctx):
            covered, seen = covered + min(pos + 1, budget), seen + pos + 1
    assert budget_share(budget, query_lens, context_lens) == pytest.approx(covered / seen)
    assert budget_share(budget, (), ()) == 0.0


@pytest.mark.parametrize("options, match", [
    ({"pattern": "dilated"}, "pattern must be one of"),
    ({"vertical_size": 0}, "vertical_size must be an int >= 1"),
    ({"adaptive_budget": 1.5}, r"fraction in \(0, 1\]"),
    ({"config_path": ""}, "path of a JSON file"),
    ({"dense_above": 0}, "dense_above must be a share of dense work above 0"),
    ({"slash_unit": "band"}, "slash_unit must be one of"),
])
def test_bad_options_name_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        MInferenceConfig(**options)


def test_adaptive_budget_scales_with_the_context():
    case = planted.needles(num_tokens=400)
    q, ctx = prefill_context(case.q, case.k, case.v, 400, case.scale)
    policy = MInferencePolicy(MInferenceConfig(adaptive_budget=0.1, dense_below=0))
    from nanovllm_minference.policy import _ops

    index = policy.build_index(q, ctx, ctx.k_cache, ctx.meta.block_tables, _ops(q.device))
    assert index.column_counts.unique().tolist() == [8]  # 20% of 10% of 400


def test_skip_layers_are_the_dense_layers_kept_resident_under_offload():
    assert MInferencePolicy(MInferenceConfig(skip_layers=2)).dense_layers(32) == {0, 1}
    assert MInferencePolicy(MInferenceConfig()).dense_layers(32) == frozenset()
