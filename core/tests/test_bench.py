"""``nanovllm bench``: the B1 workload, the job runner, the results files (the timings are GPU-only)."""

from __future__ import annotations

import json

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


def test_render_needs_a_file(capsys):
    assert cli_main(["bench", "render"]) == 2
    assert "needs a results file" in capsys.readouterr().err
