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
