"""The benchmark's bookkeeping (CPU): kernel rows get their target bound, TTFT rows their speedup over
``full`` at the same context, and the table shows both; a fixed index lands near its density."""

import torch
from nanovllm_minference import bench
from nanovllm_minference.index import computed_density

ENV = {"device": "test", "date": "today", "commit": "abc", "torch": "2.11"}


def test_ratios_and_table():
    results = [
        {"benchmark": "kernel", "context": 1024, "index": "fixed", "density": 0.2, "dense_ms": 10.0,
         "dense_paged_ms": 12.0, "cudnn_ms": 8.0, "sparse_ms": 3.0, "ratio": 0.3},
        {"benchmark": "ttft", "context": 1024, "policy": "full", "ttft_s": 4.0},
        {"benchmark": "ttft", "context": 1024, "policy": "minference", "ttft_s": 2.0, "ttft_first_s": 5.0,
         "ttft_rounds_s": [2.5, 2.0, 1.5]},
        {"benchmark": "ttft", "context": 2048, "policy": "minference", "error": "exit 1"},
        {"benchmark": "ttft", "context": 1024, "policy": "a_shape", "ttft_s": 1.0, "paired_with": "full",
         "ttft_rounds_s": [1.0, 1.1], "speedup_rounds": [3.0, 3.4], "paired_speedup": 3.2},
    ]
    rows = bench.with_ratios(results)
    assert abs(rows[0]["bound"] - 0.25) < 1e-12 and rows[0]["ratio_paged"] == 0.25
    assert rows[2]["speedup"] == 2.0 and "speedup" not in rows[1] and "speedup" not in rows[3]
    assert rows[4]["speedup"] == 3.2  # a paired row: its rounds' median, not 4.0 / 1.0 from another process
    table = bench.markdown({"environment": ENV, "results": rows}, "t")
    assert "| 1024 | minference | 2.000 | 2.00x | 2.500, 2.000, 1.500 | - | 5.000 |" in table
    assert "| 1024 | full | 4.000 | - | - | - | - |" in table
    assert "| 1024 | a_shape | 1.000 | 3.20x | 1.000, 1.100 | 3.000x, 3.400x | - |" in table
    assert "exit 1" in table and "| 0.250 |" in table


def test_fixed_index_lands_near_its_density():
    """Near: whole tiles on the band's edges add about two tiles per query tile."""
    n = 16384
    for target in (0.1, 0.3):
        index = bench.fixed_index(n, target, 64, "cpu")
        density = computed_density(index, torch.tensor([0, n]), torch.tensor([n]))
        assert abs(density - target) < 0.02


def test_ttft_policies_join_the_defaults_once_at_each_context():
    local = "minference:num_recent_diags=6096,dense_below=0"
    all_jobs = bench.jobs([32768], [32768, 131072], [0.1], [local, "full"], ttft_rounds=3)
    ttft = [(j["context"], j["policy"], j["rounds"]) for j in all_jobs if j["kind"] == "ttft"]
    assert ttft == [(c, p, 3) for c in (32768, 131072) for p in (*bench.TTFT_POLICIES, local)]
    paired_jobs = bench.jobs([32768], [131072], [0.1], [local], ttft_rounds=3, ttft_paired=True)[1:]
    paired = [(j["kind"], j["context"], j["policies"]) for j in paired_jobs]
    assert paired == [("ttft-paired", 131072, ["full", p]) for p in (*bench.TTFT_POLICIES[1:], local)]
    alone = bench.jobs([32768], [131072], [0.1], [local], ttft_paired=True, default_policies=False)[1:]
    assert [j["policies"] for j in alone] == [["full", local]]
    assert [j["policy"] for j in bench.jobs([], [8192], [], [], default_policies=False)[1:]] == ["full"]
