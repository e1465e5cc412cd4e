"""``nanovllm bench``: the throughput workload, the job runner, the results files (the timings are GPU-only)."""

from __future__ import annotations

import json

import pytest
from nanovllm import bench
from nanovllm.bench.engine import bench_latency, throughput_workload
from nanovllm.cli import main as cli_main


def test_throughput_workload_is_nano_vllms():
    prompts, max_tokens = throughput_workload()
    assert len(prompts) == len(max_tokens) == 256
    assert sum(max_tokens) == 133_966  # the output-token count nano-vLLM's bench.py reports
    assert all(100 <= len(p) <= 1024 and max(p) <= 10_000 for p in prompts)
    assert all(100 <= m <= 1024 for m in max_tokens)
    assert throughput_workload() == (prompts, max_tokens)


def test_jobs_cover_each_benchmark():
    jobs = bench.jobs_for("all", ["qwen3-0.6b", "qwen3-8b"], 64, {})
    kinds = [(j["kind"], j.get("preset")) for j in jobs]
    assert kinds[0] == ("kernels", None)
    for preset in ("qwen3-0.6b", "qwen3-8b"):
        assert {("throughput", preset), ("transformers", preset)} <= set(kinds)
        assert [j["options"]["eager"] for j in jobs if j["kind"] == "latency" and j["preset"] == preset] == [True, False]
    assert [j["kind"] for j in bench.jobs_for("kernels", ["qwen3-8b"], 0, {})] == ["kernels"]


def test_latency_on_a_tiny_model(tiny_model, one_thread):
    result = bench_latency(tiny_model("LlamaForCausalLM"), eager=True, device="cpu", max_model_len=512)
    assert result["benchmark"] == "latency-eager" and result["settings"]["output_len"] == 512
    assert 0 < result["ms_per_token"] < 1000


def test_kernels_dry_run_and_results_files(tmp_path, monkeypatch):
    """The kernels job in its own process, under Triton's interpreter at tiny sizes (checks the code, not
    the speed), then the results files."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    [kernels] = bench.run_job_in_subprocess({"kind": "kernels", "options": {}})
    assert "error" not in kernels, kernels
    kinds = {r["kind"] for r in kernels["rows"]}
    assert kinds == {"copy", "prefill", "decode"}
    triton_prefill = [r for r in kernels["rows"] if r["kind"] == "prefill" and "triton" in r["name"]]
    assert triton_prefill and all(float(r["note"].split()[1]) < 1e-2 for r in triton_prefill)
    peers = [r for r in kernels["rows"] if "peer" in r]  # the peer table: our kernels and backends, dense and paged
    assert {(r["kind"], r["backend"]) for r in peers} >= {("prefill", "triton"), ("decode", "triton"), ("prefill", None)}
    assert all(r["of_best"] == 1.0 for r in peers)  # every dry timing is the same
    [absent] = [r for r in kernels["rows"] if r["name"] == "fa4 and the flash_attn backend: not measured"]
    assert absent["note"]  # why: FA4 is not installed, or no GPU

    throughput = {"benchmark": "throughput", "preset": "qwen3-0.6b", "output_tok_per_s": 9000.0, "settings": {}}
    latency = {"benchmark": "latency", "preset": "qwen3-8b", "ms_per_token": 7.5, "settings": {}}
    failed = {"benchmark": "latency", "preset": "qwen3-8b", "error": "exit 1"}
    path = bench.write_results([kernels, throughput, latency, failed], tmp_path, "t", {"benchmark": "all"})
    payload = json.loads(path.read_text())
    assert {"device", "date", "commit", "torch"} <= set(payload["environment"])
    md = (tmp_path / "t.md").read_text()
    assert "| throughput | qwen3-0.6b | output_tok_per_s | 9,000 |" in md
    assert "| latency | qwen3-8b | ms_per_token | 7.500 |" in md
    assert "| latency | qwen3-8b | failed: exit 1 |" in md
    assert md.count("| decode | ") == sum(r["kind"] == "decode" for r in kernels["rows"])
    assert "target" not in md

    payload["results"].append({"benchmark": "throughput", "preset": "qwen3-8b", "output_tok_per_s": 4000.0})
    path.write_text(json.dumps(payload))
    bench.render(path)
    assert "| throughput | qwen3-8b | output_tok_per_s | 4,000 |" in (tmp_path / "t.md").read_text()


def test_engine_options_from_the_command_line():
    from nanovllm.bench import engine_options
    from nanovllm.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--tensor-parallel-size", "2"])
    assert engine_options(args) == {"tensor_parallel_size": 2}
    args = build_parser().parse_args(["bench", "throughput", "--attention-backend", "torch"])
    assert engine_options(args) == {"attention_backend": "torch"}
    args = build_parser().parse_args(["bench", "throughput", "--kv-cache-dtype", "fp8"])
    assert engine_options(args) == {"kv_cache_dtype": "fp8"}


def test_render_needs_a_file(capsys):
    assert cli_main(["bench", "render"]) == 2
    assert "needs a results file" in capsys.readouterr().err


def test_offload_bench_on_a_tiny_model(tiny_model, one_thread, tmp_path):
    """The offload benchmark's whole path on the CPU (in this process; the CLI runs each job in its own): jobs, rows, the
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
    assert small[True]["gpu_kv_gib"] == pytest.approx(small[True]["gpu_bytes"] / 2**30)

    md = (tmp_path / "b5.md").read_text()
    assert "## Offload" in md and "| resident |" in md and "refused: the KV cache budget" in md
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
    assert offload.random_prompts(2, 96, 1000)[0] == offload.random_prompts(1, 96, 1000)[0]


def test_ttft_rounds_time_fresh_prompts_and_report_their_median(tiny_model, one_thread):
    from nanovllm.bench import offload

    model = tiny_model("LlamaForCausalLM")
    options = {"device": "cpu", "max_num_batched_tokens": 64}
    row = offload.bench_decode(model, 96, 1, 1, False, full_warm_up=True, ttft_rounds=3, **options)
    assert len(row["ttft_rounds_s"]) == 3 and all(t > 0 for t in row["ttft_rounds_s"])
    assert row["ttft_s"] == sorted(row["ttft_rounds_s"])[1]
    prompts = offload.random_prompts(4, 96, 1000)
    assert len({tuple(p) for p in prompts}) == 4  # no round meets another's prompt in the prefix cache
    with pytest.raises(ValueError, match="ttft_rounds must be at least 1"):
        offload.bench_decode(model, 96, 1, 1, False, ttft_rounds=0, **options)


def test_offload_bench_refuses_bad_sizes(capsys):
    assert cli_main(["bench", "offload", "--decode-steps", "0"]) == 2
    assert "--decode-steps takes positive numbers" in capsys.readouterr().err
