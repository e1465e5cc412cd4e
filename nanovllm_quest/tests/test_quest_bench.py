"""The benchmark's bookkeeping on synthetic rows (the measurements themselves need the GPU)."""

import pytest
from nanovllm_quest import bench


def test_quest_rows_get_their_speedup_target_and_floor():
    kv_per_token = 32 * 2 * 8 * 128 * 2  # llama-3.1-8b, bfloat16
    rows = [
        {"benchmark": "offload-copy", "h2d_gbs": 50.0},
        {"benchmark": "offload", "context": 131072, "batch": 1, "policy": "full", "decode_ms_per_step": 400.0,
         "kv_tokens_per_step": 131072, "kv_bytes_per_token": kv_per_token},
        {"benchmark": "offload", "context": 131072, "batch": 1, "policy": "quest:token_budget=2048,skip_layers=0",
         "decode_ms_per_step": 20.0, "kv_tokens_per_step": 131072, "kv_bytes_per_token": kv_per_token},
        {"benchmark": "attention", "context": 32768, "batch": 1, "budget": 2048, "dense_us": 60.0, "quest_us": 20.0,
         "score_us": 1.0, "topk_us": 1.0, "attend_us": 1.0, "speedup": 3.0, "ceiling": 8.0, "layers_in_graph": 8,
         "page_size": 16,
         "dense_one_layer_us": 66.0, "quest_one_layer_us": 33.0, "speedup_one_layer": 2.0},
    ]
    full, quest, attention = bench.with_ratios(rows)[1:]
    assert full["floor_ms"] == pytest.approx(131072 * kv_per_token / 50e9 * 1e3)
    assert quest["speedup"] == pytest.approx(20.0) and quest["target"] == 20.0
    # every layer sparse: 2,048 tokens of each of the 32 layers
    assert quest["h2d_bytes_per_step"] == pytest.approx(2048 * kv_per_token)
    assert quest["vs_floor"] == pytest.approx(20.0 / (2048 * kv_per_token / 50e9 * 1e3))
    assert attention["target"] == 5.0
    text = bench.markdown({"environment": {"device": "d", "date": "-", "commit": "c", "torch": "t"},
                           "results": [full, quest, attention]}, "t")
    assert "| host pool | 131072 | 1 | quest:token_budget=2048,skip_layers=0 | 20.00 | 20.00x | >= 20.0x |" in text
    assert "| 32768 | 1 | 2048 | 16 | 8 | 60.0 | 20.0 |" in text
    assert "| 66.0 | 33.0 | 2.00x |" in text


def test_layers_in_graph_keep_the_kv_under_16_gib():
    assert bench.layers_in_graph(32768, 1) == 8
    assert bench.layers_in_graph(131072, 8) == 4  # 4 GiB of KV a layer
    assert bench.layers_in_graph(1 << 22, 8) == 1


def test_the_attention_job_times_each_page_size():
    (job,) = [j for j in bench.jobs([32768], [1], [2048], 2048, 4, [16, 64]) if j["kind"] == "attention"]
    assert job["page_sizes"] == [16, 64]


def test_rescore_factors_become_attention_rows_and_engine_policies():
    all_jobs = bench.jobs([32768], [1], [2048], 2048, 4, [16], ["auto"], [], [4])
    (attention,) = [j for j in all_jobs if j["kind"] == "attention"]
    assert attention["rescores"] == [4]
    policies = {j["policy"] for j in all_jobs if j["kind"] == "decode" and j["context"] != 131072}
    assert policies == {"full", "quest:token_budget=2048", "quest:token_budget=2048,rescore=4"}
    row = {"page_size": 16, "bound_size": 8, "metadata_dtype": "fp8", "rescore": 4}
    assert bench.page_label(row) == "16/8 fp8 r4"
    assert bench.page_label({"page_size": 16, "rescore": 1}) == "16"


def test_metadata_variants_lay_out_auto_as_the_policy_does():
    import torch

    cpu = torch.device("cpu")  # float8 bounds are available there, as on an H100
    assert bench.metadata_variants([16], ["auto"], [], cpu) == [(16, "fp8", 8)]  # halves, not one bound
    assert bench.metadata_variants([16, 64], ["kv", "fp8", "auto"], [4, 16, 32], cpu) == [
        (16, "kv", 16), (16, "kv", 4), (16, "fp8", 8), (16, "fp8", 4), (16, "fp8", 16), (64, "kv", 64),
        (64, "fp8", 64),
    ]


@pytest.mark.parametrize("page", [16, 48])
def test_page_metadata_bounds_each_page_at_its_anchor(page):
    import torch

    gen = torch.Generator().manual_seed(page)
    batch, width = 2, 6
    k_cache = torch.randn(batch * width, bench.BLOCK_SIZE, 2, 8, generator=gen)
    tables = torch.randperm(batch * width, generator=gen).view(batch, width).int()
    metadata = bench.page_metadata(k_cache, tables, page)
    per_page = page // bench.BLOCK_SIZE
    for s in range(batch):
        keys = k_cache[tables[s].long()].flatten(0, 1).view(-1, page, 2, 8)  # [pages, page, Hkv, D]
        anchors = tables[s, ::per_page].long()
        assert torch.equal(metadata[anchors, :, 0], keys.amin(1)) and torch.equal(metadata[anchors, :, 1], keys.amax(1))


def test_offload_rows_through_the_selection_cache_count_the_bytes_they_move():
    kv_per_token = 32 * 2 * 8 * 128 * 2
    head_block = kv_per_token / 32 / 8 * 16
    common = {"benchmark": "offload", "context": 131072, "batch": 1, "kv_tokens_per_step": 131072,
              "kv_bytes_per_token": kv_per_token}
    rows = [{"benchmark": "offload-copy", "h2d_gbs": 50.0},
            {**common, "policy": "quest:token_budget=2048", "decode_ms_per_step": 10.0,
             "cache_loaded_head_blocks_per_step": 3072.0, "cache_reused_head_blocks_per_step": 27648.0},
            {**common, "policy": "recent_window:budget_blocks=128", "decode_ms_per_step": 8.0,
             "options": {"kv_offloading_reuse_selections": False}}]
    cached, ring = bench.with_ratios(rows)[1:]
    selected = 30 * 2048 * kv_per_token / 32  # the 30 sparse layers' 2,048 tokens
    assert cached["selected_bytes_per_step"] == ring["selected_bytes_per_step"] == pytest.approx(selected)
    assert cached["reused_share"] == pytest.approx(0.9) and "reused_share" not in ring
    assert cached["h2d_bytes_per_step"] == pytest.approx(3072 * head_block) == pytest.approx(0.1 * selected)
    assert cached["vs_selected_floor"] == pytest.approx(10.0 / (selected / 50e9 * 1e3))
    assert ring["h2d_bytes_per_step"] == pytest.approx(selected)
    text = bench.markdown({"environment": {"device": "d", "date": "-", "commit": "c", "torch": "t"},
                           "results": [cached, ring]}, "t")
    assert "| quest:token_budget=2048 | on | 0.900 |" in text
    assert "| recent_window:budget_blocks=128 | off | - |" in text


def test_offload_rows_get_the_offloads_own_time_from_the_resident_row_of_their_policy():
    kv_per_token = 32 * 2 * 8 * 128 * 2
    common = {"context": 131072, "batch": 1, "kv_tokens_per_step": 131072, "kv_bytes_per_token": kv_per_token}
    quest = "quest:token_budget=2048"
    resident, offload = {**common, "benchmark": "offload-resident"}, {**common, "benchmark": "offload"}
    rows = [{"benchmark": "offload-copy", "h2d_gbs": 50.0},
            {**resident, "policy": "full", "decode_ms_per_step": 12.0},
            {**resident, "policy": quest, "decode_ms_per_step": 8.0},
            {**resident, "policy": quest, "batch": 8, "decode_ms_per_step": 30.0},
            {**common, "benchmark": "decode", "policy": quest + ",skip_layers=0", "decode_ms_per_step": 9.0},
            {**offload, "policy": "full", "decode_ms_per_step": 400.0},
            {**offload, "policy": quest, "decode_ms_per_step": 13.0,
             "options": {"kv_offloading_reuse_selections": False}},
            {**offload, "policy": quest + ",skip_layers=0", "decode_ms_per_step": 14.0}]
    full, cold, unmatched = bench.with_ratios(rows)[5:]
    assert full["resident_ms_per_step"] == 12.0 and full["offload_ms_per_step"] == pytest.approx(388.0)
    assert full["offload_vs_floor"] == pytest.approx(388.0 / full["floor_ms"])
    assert cold["resident_ms_per_step"] == 8.0  # the batch-1 row of its policy, not the batch-8 one
    assert cold["offload_vs_floor"] == pytest.approx(5.0 / (30 * 2048 * kv_per_token / 32 / 50e9 * 1e3))
    assert "offload_ms_per_step" not in unmatched  # no row of the offload job with that policy resident
    text = bench.markdown({"environment": {"device": "d", "date": "-", "commit": "c", "torch": "t"},
                           "results": [full, cold, unmatched]}, "t")
    floor, ratio = cold["floor_ms"], cold["offload_vs_floor"]
    assert f"| {quest} | off | 13.00 | 8.00 | 5.00 | {floor:.2f} | {ratio:.2f} |" in text
    assert "| full | - | 400.00 | 12.00 | 388.00 |" in text


def test_the_offload_job_times_each_offloaded_policy_with_its_kv_on_the_gpu_too():
    all_jobs = bench.jobs([131072], [1], [2048], 2048, 4)
    resident = [j["policy"] for j in all_jobs if j["kind"] == "offload-resident"]
    offloaded = [j["policy"] for j in all_jobs if j["kind"] == "offload"]
    assert sorted(resident) == sorted(set(offloaded)) and len(offloaded) > len(resident)
    assert {(j["context"], j["batch"]) for j in all_jobs if j["kind"] == "decode"} == {(131072, 1)}
    from nanovllm.bench import jobs_of_kinds

    kinds = {j["kind"] for j in jobs_of_kinds(all_jobs, ["offload"])}
    assert kinds == {"offload", "offload-copy", "offload-resident"}


def test_the_recent_window_selection_is_the_first_and_newest_blocks_and_reuses_the_rest(monkeypatch):
    """The bench's best case for the selection cache: every step selects the blocks of the step before,
    but for the block being written, so the cache loads only that one."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.conformance import tiny_model
    from nanovllm.plugins import get_plugins, reload_plugins

    get_plugins().register(bench.RecentWindowPlugin(), "quest-bench-recent-window")
    try:
        options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, enforce_eager=True,
                       sparse_policy="recent_window:budget_blocks=4,skip_layers=1")
        seen, select = [], bench.RecentWindowPolicy.select_blocks

        def recorded(self, ctx):
            seen.append((ctx.num_history_blocks.tolist(), select(self, ctx)))
            return seen[-1][1]

        monkeypatch.setattr(bench.RecentWindowPolicy, "select_blocks", recorded)
        llm = LLM(tiny_model(), kv_offloading_size=0.01, kv_offloading_buffer_size=0.004, **options)
        prompt = [{"prompt_token_ids": [(5 * j) % 200 + 3 for j in range(60)]}]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        got = llm.generate(prompt, params, use_tqdm=False)
        loaded, reused = llm.runner.offload.cache_counts.tolist()
        n, chosen = seen[-1]
        assert chosen.tolist() == [[0, n[0] - 3, n[0] - 2, n[0] - 1]]
        assert reused > 0.6 * (loaded + reused), (loaded, reused)
        want = LLM(tiny_model(), kv_cache_memory=2**23, **options).generate(prompt, params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    finally:
        reload_plugins()


def test_reuse_rows_get_their_table():
    row = {"benchmark": "reuse", "budget": 1024, "text": "GPL-3", "prompt_tokens": 7600, "decode_steps": 96,
           "device": "cpu", "dtype": "torch.bfloat16", "loaded_head_blocks": 100, "reused_head_blocks": 300,
           "reused_share": 0.75}
    text = bench.markdown({"environment": {"device": "d", "date": "-", "commit": "c", "torch": "t"},
                           "results": bench.with_ratios([row])}, "t")
    assert "| 1024 | GPL-3 | 7600 | 96 | cpu, torch.bfloat16 | 100 | 300 | 0.750 |" in text
    failed = {"kind": "reuse", "benchmark": "reuse", "budgets": [1024], "error": "exit 1"}
    text = bench.markdown({"environment": {"device": "d", "date": "-", "commit": "c", "torch": "t"},
                           "results": bench.with_ratios([failed])}, "t")
    assert "| [1024] | exit 1 |" in text
