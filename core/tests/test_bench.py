"""``nanovllm bench``: the B1 workload, the job runner, the results files (the timings are GPU-only)."""

from __future__ import annotations

import json
import statistics

import pytest
from nanovllm import bench
from nanovllm.bench.engine import bench_latency, throughput_workload
from nanovllm.cli import main as cli_main


def test_throughput_workload_is_nano_vllms():
    prompts, max_tokens = throughput_workload()
    assert len(prompts) == len(max_tokens) == 256
    assert sum(max_tokens) == 133_966  # the output-token count of nano-vLLM's bench.py (ANCHORS.md)
    assert all(100 <= len(p) <= 1024 and max(p) <= 10_000 for p in prompts)
    assert all(100 <= m <= 1024 for m in max_tokens)
    assert throughput_workload() == (prompts, max_tokens)


def test_jobs_cover_each_benchmark():
    jobs = bench.jobs_for("all", ["qwen3-0.6b", "qwen3-8b"], 64, {})
    kinds = [(j["kind"], j.get("preset")) for j in jobs]
    assert kinds[0] == ("kernels", None)
    for preset in ("qwen3-0.6b", "qwen3-8b"):
        assert {("throughput", preset), ("profile", preset), ("transformers", preset)} <= set(kinds)
        assert [j["options"]["eager"] for j in jobs if j["kind"] == "latency" and j["preset"] == preset] == [True, False]
    assert [j["kind"] for j in bench.jobs_for("kernels", ["qwen3-8b"], 0, {})] == ["kernels"]


def test_latency_on_a_tiny_model(tiny_model, one_thread):
    result = bench_latency(tiny_model("LlamaForCausalLM"), eager=True, device="cpu", max_model_len=512)
    assert result["benchmark"] == "latency-eager" and result["settings"]["output_len"] == 512
    assert 0 < result["ms_per_token"] < 1000


def test_kernels_dry_run_and_results_files(tmp_path, monkeypatch):
    """The B3 job in its own process, under Triton's interpreter at tiny sizes (checks the code, not
    the speed), then the results files with targets and ratios."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    [kernels] = bench.run_job_in_subprocess({"kind": "kernels", "options": {}})
    assert "error" not in kernels, kernels
    kinds = {r["kind"] for r in kernels["rows"]}
    assert kinds == {"copy", "prefill", "decode"}
    triton_prefill = [r for r in kernels["rows"] if r["kind"] == "prefill" and "triton" in r["name"]]
    assert triton_prefill and all(float(r["note"].split()[1]) < 1e-2 for r in triton_prefill)

    throughput = {"benchmark": "throughput", "preset": "qwen3-0.6b", "output_tok_per_s": 9000.0, "settings": {}}
    latency = {"benchmark": "latency", "preset": "qwen3-8b", "ms_per_token": 7.5, "settings": {}}
    failed = {"benchmark": "latency", "preset": "qwen3-8b", "error": "exit 1"}
    path = bench.write_results([kernels, throughput, latency, failed], tmp_path, "t", {"benchmark": "all"})
    payload = json.loads(path.read_text())
    assert {"device", "date", "commit", "torch"} <= set(payload["environment"])
    by = {(r["benchmark"], r["preset"]): r for r in payload["results"] if "error" not in r}
    assert by["throughput", "qwen3-0.6b"]["vs_target"] == pytest.approx(0.5)
    assert by["latency", "qwen3-8b"]["vs_target"] == pytest.approx(0.8)  # lower is better: 6.0 / 7.5
    decode_rows = [r for r in by["kernels", "-"]["rows"] if r["kind"] == "decode"]
    assert all(r["target"] == bench.DECODE_TARGET and "vs_copy" in r for r in decode_rows)
    md = (tmp_path / "t.md").read_text()
    assert "| throughput | qwen3-0.6b | output_tok_per_s | 9,000 | 18,000 | 0.500 |" in md
    assert "failed: exit 1" in md

    payload["results"].append({"benchmark": "throughput", "preset": "qwen3-8b", "output_tok_per_s": 4000.0})
    path.write_text(json.dumps(payload))
    bench.render(path)
    assert "| throughput | qwen3-8b | output_tok_per_s | 4,000 | 8,000 | 0.500 |" in (tmp_path / "t.md").read_text()


def test_engine_options_from_the_command_line():
    from nanovllm.bench import engine_options
    from nanovllm.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--tensor-parallel-size", "2"])
    assert engine_options(args) == {"tensor_parallel_size": 2}
    args = build_parser().parse_args(["bench", "throughput", "--attention-backend", "torch"])
    assert engine_options(args) == {"attention_backend": "torch"}


def test_render_needs_a_file(capsys):
    assert cli_main(["bench", "render"]) == 2
    assert "needs a results file" in capsys.readouterr().err


def test_offload_bench_on_a_tiny_model(tiny_model, one_thread, tmp_path):
    """B5's whole path on the CPU (in this process; the CLI runs each job in its own): jobs, rows, the
    ratios that join rows of different jobs, the results files. Checks the arithmetic, not the speed."""
    from nanovllm.bench import offload

    model, steps = tiny_model("LlamaForCausalLM"), 3
    shape = offload.model_shape(model, {"device": "cpu"})
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V x layers x KV heads x head_dim x float32
    budget = 64  # prefill chunks of 64 tokens: the prompts prefill over several steps
    engine = {"device": "cpu", "max_num_batched_tokens": budget}

    def pool_bytes(context, batch):  # the largest pool is made too big for "this host's RAM"
        _, max_len = offload.lengths(context, batch, steps, shape.max_positions, budget)
        return offload.pool_gib(batch, max_len, 16, shape.kv_bytes_per_token) * 2**30

    fraction = 0.99 * pool_bytes(200, 3) / offload.host_memory_bytes()
    assert pool_bytes(200, 1) < fraction * offload.host_memory_bytes()
    jobs = offload.jobs([model], [96, 200], [1, 3], steps, copy_mib=4, small_kv_gib=1e-4, engine_options=engine,
                        host_memory_fraction=fraction)
    assert [j["kind"] for j in jobs] == ["offload-copy"] + ["offload-resident", "offload-decode", "offload-decode"] * 2 \
        + ["offload-small"] * 2
    results = [row for job in jobs for row in bench.run_job(job)]
    path = bench.write_results(results, tmp_path, "b5", {"benchmark": "offload"})
    rows = json.loads(path.read_text())["results"]

    [copy] = [r for r in rows if r["benchmark"] == "offload-copy"]
    assert min(copy["h2d_gbs"], copy["d2h_gbs"], copy["both_h2d_gbs"], copy["both_d2h_gbs"]) > 0
    assert copy["both_total_gbs"] == pytest.approx(2 * min(copy["both_h2d_gbs"], copy["both_d2h_gbs"]))
    resident = {r["context"]: r for r in rows if r["benchmark"] == "offload-resident"}
    decode = {(r["context"], r["batch"]): r for r in rows if r["benchmark"] == "offload-decode"}
    assert "of this host's" in decode[200, 3]["skipped"] and "ttft_s" not in decode[200, 3]
    for (context, batch), r in decode.items():
        if "skipped" in r:
            continue
        assert r["prompt_len"] == context and r["settings"]["kv_offloading_size"] > 0
        if batch == 1:  # after one untimed step, the timed steps read the prompt, the first token and
            # each decoded one
            assert r["kv_tokens_per_step"] == context + 1 + (steps + 1) / 2
            assert r["ttft_vs_resident"] == pytest.approx(r["ttft_s"] / resident[context]["ttft_s"])
            assert r["vs_target"] == pytest.approx(bench.OFFLOAD_TTFT_TARGET / r["ttft_vs_resident"])
        else:  # early sequences decode while later ones prefill
            assert batch * (context + 1) < r["kv_tokens_per_step"] < batch * r["settings"]["max_model_len"]
            assert "ttft_vs_resident" not in r
        assert r["h2d_bytes_per_step"] == r["kv_tokens_per_step"] * shape.kv_bytes_per_token
        assert r["d2h_bytes_per_step"] == batch * shape.kv_bytes_per_token
        assert r["h2d_gbs"] == pytest.approx(r["h2d_bytes_per_step"] / r["decode_ms_per_step"] / 1e6)
        assert r["floor_ms"] == pytest.approx(r["h2d_bytes_per_step"] / copy["h2d_gbs"] / 1e6)
        assert r["vs_floor"] == pytest.approx(r["floor_ms"] / r["decode_ms_per_step"])
        assert r["gpu_bytes"] > 0
    assert all("kv_offloading_size" not in r["settings"] and "h2d_bytes_per_step" not in r for r in resident.values())
    small = {r["offload"]: r for r in rows if r["benchmark"] == "offload-small"}
    assert "fewer than max_model_len" in small[False]["refused"] and "ttft_s" not in small[False]
    assert small[True]["refused"] is None and small[True]["ttft_s"] > 0
    assert small[True]["settings"]["kv_cache_memory"] == small[False]["settings"]["kv_cache_memory"]
    assert small[True]["vs_target"] == pytest.approx(bench.OFFLOAD_GPU_KV_TARGET_GIB / small[True]["gpu_kv_gib"])

    md = (tmp_path / "b5.md").read_text()
    assert "## B5 offload" in md and "| resident |" in md and "refused: the KV cache budget" in md
    assert "| decode | " + model + " | 200 | 3 |" in md
    bench.render(path)  # the ratios are redone from the raw rows, to the same values
    assert json.loads(path.read_text())["results"] == rows


def test_ttft_after_a_full_length_warm_up(tiny_model, one_thread):
    """The TTFT job's warm-up is a prompt as long as the timed one (so every kernel has compiled), timed on
    its own; the prompts drawn for it extend, not change, the ones drawn without it."""
    from nanovllm.bench import offload

    model = tiny_model("LlamaForCausalLM")
    options = {"device": "cpu", "max_num_batched_tokens": 64}
    row = offload.bench_decode(model, 96, 1, 1, False, full_warm_up=True, **options)
    assert row["ttft_first_s"] > 0 and row["ttft_s"] > 0 and row["prompt_len"] == 96
    assert "ttft_first_s" not in offload.bench_decode(model, 96, 1, 1, False, **options)
    assert offload._prompts(2, 96, 1000)[0] == offload._prompts(1, 96, 1000)[0]


def test_paired_ttft_engines_take_turns_in_one_process(tiny_model, one_thread, monkeypatch):
    from nanovllm.bench import offload, prefill

    model = tiny_model("LlamaForCausalLM")
    order, timed = [], offload._time_to_first_tokens

    def recorded(llm, prompts):
        order.append((id(llm), tuple(prompts[0])))
        return timed(llm, prompts)

    monkeypatch.setattr(offload, "_time_to_first_tokens", recorded)
    options = {"device": "cpu", "max_num_batched_tokens": 64}
    full, other = offload.bench_paired_ttft(model, 96, ["full", "full"], 3, **options)
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
            offload.bench_paired_ttft(model, 96, policies, rounds, **options)
    monkeypatch.setattr(offload, "bench_paired_ttft", lambda *a, **k: [dict(full), dict(other)])
    rows = prefill.bench_ttft_paired(model, 96, ["full", "full"], 3)
    assert rows[1]["paired_speedup"] == statistics.median(other["speedup_rounds"])
    assert all(r["benchmark"] == "ttft" and r["paired_with"] == "full" for r in rows)


def test_ttft_rounds_time_fresh_prompts_and_report_their_median(tiny_model, one_thread):
    from nanovllm.bench import offload

    model = tiny_model("LlamaForCausalLM")
    options = {"device": "cpu", "max_num_batched_tokens": 64}
    row = offload.bench_decode(model, 96, 1, 1, False, full_warm_up=True, ttft_rounds=3, **options)
    assert len(row["ttft_rounds_s"]) == 3 and all(t > 0 for t in row["ttft_rounds_s"])
    assert row["ttft_s"] == sorted(row["ttft_rounds_s"])[1]
    prompts = offload._prompts(4, 96, 1000)
    assert len({tuple(p) for p in prompts}) == 4  # no round meets another's prompt in the prefix cache
    with pytest.raises(ValueError, match="ttft_rounds must be at least 1"):
        offload.bench_decode(model, 96, 1, 1, False, ttft_rounds=0, **options)


def test_offload_bench_refuses_bad_sizes(capsys):
    assert cli_main(["bench", "offload", "--decode-steps", "0"]) == 2
    assert "--decode-steps takes positive numbers" in capsys.readouterr().err


def test_plugin_jobs_write_after_each_job_and_report_failures(tmp_path):
    """A job whose process fails is a row with its error, the files are written, and the run returns 1."""
    charted = []
    status = bench.run_plugin_jobs(
        [{"kind": "a"}, {"kind": "b"}], "nanovllm_no_such_module", tmp_path, "t", {"x": 1},
        lambda rows: [{**r, "seen": True} for r in rows], lambda payload, name: f"{name}: {len(payload['results'])}\n",
        lambda payload, path: charted.append(path),
    )
    assert status == 1 and charted == [tmp_path / "t.png"]
    payload = json.loads((tmp_path / "t.json").read_text())
    assert [(r["kind"], r["seen"], r["error"]) for r in payload["results"]] == [("a", True, "exit 1"), ("b", True, "exit 1")]
    assert payload["settings"] == {"x": 1} and (tmp_path / "t.md").read_text() == "t: 2\n"


def test_paged_prompt_caches_hold_the_prompt_through_its_table():
    """The sparse-prefill benchmarks' inputs: reading the caches through the shuffled table gives k and v, and
    the metadata describes one fresh prompt (the torch backend's paged prefill of its last rows, behind the
    rest as history, equals the same rows of its dense prefill)."""
    import torch
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.bench.prefill import paged_prompt

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


def test_serve_ceiling_stand_in_runs_the_real_scheduler_and_paces_its_steps(tiny_model, one_thread):
    """The stand-in model of ``bench serve_ceiling``: every request gets exactly its tokens through the real
    engine, a step takes at least its set time, and the first steps' batches are logged."""
    import functools
    import time

    from nanovllm.bench.serve_ceiling import STAND_IN_MODEL, offline, stand_in_engine

    model = tiny_model(**STAND_IN_MODEL)
    prompts, max_tokens = [[5] * 40, [9] * 300, [3] * 7], [4, 9, 1]
    build = functools.partial(stand_in_engine, step_ms=2.0, prefill_us=0.0)
    start = time.perf_counter()
    r = offline(model, build, prompts, max_tokens)
    steps = r["first_steps"]
    assert r["output_tok_per_s"] * r["duration_s"] == pytest.approx(sum(max_tokens))
    assert steps[0] == (3, 347) and all(n <= 3 for n, _ in steps) and len(steps) >= max(max_tokens)
    assert time.perf_counter() - start >= 0.002 * len(steps)


def test_allreduce_bench_on_the_cpu(tmp_path, monkeypatch):
    """B6's all-reduces of a decode step, the whole command on two gloo ranks (eager only: no CUDA graphs
    on the CPU): rows of the preset's shape in the results files. Checks the code, not the speed."""
    from nanovllm.bench import allreduce

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cli_main(["bench", "allreduce", "--tensor-parallel-size", "2", "--presets", "qwen3-0.6b",
                     "--allreduce-batches", "1", "3", "--allreduce-steps", "2", "--out", str(tmp_path)]) == 0
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


def test_tp_summary_speedups_against_issue_12s_targets(tmp_path):
    from nanovllm.bench import tp_summary

    env = {"device": "NVIDIA H200", "date": "2026-11-24 00:00 UTC", "commit": "abc", "torch": "2.11"}

    def write(name, results):
        payload = {"environment": env, "settings": {}, "results": results}
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))

    def latency(preset, ms):
        return {"benchmark": "latency", "preset": preset, "ms_per_token": ms, "metric": "ms_per_token"}

    def throughput(preset, tok_s):
        return {"benchmark": "throughput", "preset": preset, "output_tok_per_s": tok_s,
                "metric": "output_tok_per_s"}

    eager = {"benchmark": "latency-eager", "preset": "qwen3-8b", "ms_per_token": 20.0}
    write("b6_latency_tp1", [eager, latency("qwen3-8b", 5.0), latency("llama-3.1-8b", 4.8)])
    write("b6_latency_tp2", [latency("qwen3-8b", 3.5)])
    write("b6_throughput_tp1", [throughput("qwen3-8b", 9000.0)])
    write("b6_throughput_tp2", [throughput("qwen3-8b", 14_500.0)])
    tp_summary.main([str(tmp_path), "--name", "b6"])
    summary = json.loads((tmp_path / "b6.json").read_text())
    rows = {(r["benchmark"], r["preset"]): r for r in summary["rows"]}
    assert set(rows) == {("latency", "qwen3-8b"), ("throughput", "qwen3-8b")}
    assert rows["latency", "qwen3-8b"]["speedup"] == pytest.approx(5.0 / 3.5)  # lower is better
    assert rows["latency", "qwen3-8b"]["met"] is False  # 1.43x against 1.45x
    assert rows["throughput", "qwen3-8b"]["speedup"] == pytest.approx(14_500 / 9000)
    assert rows["throughput", "qwen3-8b"]["met"] is True
    assert summary["missing"] == ["latency llama-3.1-8b at TP2"]
    text = (tmp_path / "b6.md").read_text()
    assert "1.429x | >= 1.45x | missed" in text and "Not in this run: latency llama-3.1-8b at TP2." in text
