"""The long-context speed benchmark script end to end on the CPU with the tiny random model: every policy's
TTFT and decode speed at every batch size land in its JSON, table and plot; an unknown policy is refused
before any model loads."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("long_context_speed",
                                                  ROOT / "benchmarks" / "long_context_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_policy_and_batch_size_is_measured(tmp_path, tiny_model, one_thread):
    from nanovllm.plugins import get_plugins

    registry = get_plugins().registry
    plugins = {"quest", "xattn"} <= set(registry.sparse_policies)
    if not plugins or "LlamaForCausalLM" not in registry.model_families:
        pytest.skip("needs the nanovllm-quest, nanovllm-xattn and nanovllm-llama plugins")
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=256)
    rng = random.Random(0)
    text = tmp_path / "text.txt"  # words of the tiny vocabulary
    text.write_text(" ".join(f"tok{rng.randrange(3, 256)}" for _ in range(500)))
    policies = ["full", "quest:token_budget=32", "xattn+quest"]
    script = _script()
    rc = script.main([
        "--model", model, "--lengths", "64", "--batch-sizes", "1,3", "--decode-tokens", "8",
        "--repeats", "2", "--policies", ";".join(policies), "--max-num-batched-tokens", "64", "--no-hf",
        "--device", "cpu", "--text-file", str(text), "--out", str(tmp_path), "--name", "tiny",
    ])
    assert rc == 0
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert "partial" not in result and not result["errors"]
    assert result["runners"] == policies and "transformers" not in result["speed"]
    assert result["policy_phases"]["xattn+quest"] == {"prefill": "xattn", "decode": "quest"}
    for policy in policies:
        for length in ("64",):
            by_batch = result["speed"][policy][length]
            assert set(by_batch) == {"1", "3"}
            assert by_batch["1"]["ttft_ms"] > 0 and by_batch["1"]["engine_ttft_ms"] > 0
            for batch, m in by_batch.items():
                assert len(m["repeats"]) == 2
                alone = []
                for r in m["repeats"]:  # wall times of both runs, and the engine's clock of its decode steps
                    assert r["t_n_s"] > 0 and r["t_1_s"] > 0
                    assert r["decode_tok_s"] == pytest.approx(int(batch) * 8 / (r["t_n_s"] - r["t_1_s"]))
                    metrics, steps = r["engine_metrics_n"], r["engine_steps_n"]
                    assert 0 < metrics["first_token_s"] < metrics["last_token_s"]
                    # the last prompt decodes its 8 tokens after every prompt is prefilled, the others fewer
                    assert 8 <= steps["decode_tokens_after_prefill"] <= int(batch) * 8
                    alone.append(steps["decode_tokens_after_prefill"]
                                 / (metrics["last_token_s"] - metrics["first_token_s"]))
                    check_steps(r["engine_steps_1"], r["engine_steps_n"], int(batch), 64, 64)
                    for key in ("1", "n"):  # the warm-up ran the same steps, so it compiled what they need
                        timed = {k: v for k, v in r[f"engine_steps_{key}"].items() if k != "triton_compiles"}
                        assert timed == {k: v for k, v in m["warmup_steps"][key].items() if k in timed}
                for key, values in (("decode_tok_s", [r["decode_tok_s"] for r in m["repeats"]]),
                                    ("engine_decode_tok_s", alone)):
                    assert min(values) <= m[key] <= max(values)
    table = (tmp_path / "tiny.md").read_text()
    for policy in policies:
        assert f"| {policy} |" in table
    assert "TTFT / full" in table and "TTFT <= full" in table  # xattn's target is reported next to it


def check_steps(one: dict, more: dict, batch: int, length: int, chunk: int) -> None:
    """The steps of a run with one token and of one with more: ``batch`` prompts of ``length`` tokens in
    chunks of ``chunk`` (the token budget of a step). Nothing is preempted; each prompt is prefilled once;
    the decode rows of a mixed step take one token each of the budget and the prefill chunk the rest, so
    decoding adds no more prefill steps than it takes budget."""
    for run in (one, more):
        # the warm-up compiled what the timed runs need (on the CPU, Triton interprets: nothing compiles)
        assert run["preemptions"] == 0 and run["triton_compiles"] in (None, [])
        prefill_steps = run["prefill_only_steps"] + run["mixed_steps"]
        assert run["mean_prefill_tokens"] * prefill_steps == batch * length
    assert one["mixed_steps"] == one["decode_only_steps"] == one["decode_tokens_after_prefill"] == 0
    assert one["prefill_only_steps"] == -(-batch * length // chunk)
    rows = more["decode_rows_with_prefill"]  # the first prompts decode while the later ones prefill
    assert (more["mixed_steps"] > 0) == (batch > 1) and all(1 <= n < batch for n in rows)
    assert more["decode_only_steps"] > 0
    most_prefill_steps = -(-batch * length // (chunk - max(rows, default=0)))
    assert more["prefill_only_steps"] + more["mixed_steps"] <= most_prefill_steps


def test_prompts_differ_and_have_the_length(tmp_path):
    prompts = _script().batch_prompts([1], list(range(10, 110)), 40, 4)
    assert len(prompts) == 4 and len({tuple(p) for p in prompts}) == 4
    assert all(len(p) == 40 and p[0] == 1 and 1 not in p[1:] for p in prompts)


def test_an_unknown_policy_is_refused_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "out"
    rc = _script().main(["--model", str(tmp_path / "no-such-model"), "--device", "cpu", "--out", str(out),
                         "--policies", "full;quets:token_budget=64"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "quets" in err and "quest" in err  # names the bad item and the installed policies
    assert not out.exists()  # nothing ran


def test_targets_compare_with_dense_and_transformers():
    script = _script()
    speed = {"full": {"32768": {"1": {"ttft_ms": 100.0, "decode_tok_s": 900.0}}},
             "xattn": {"32768": {"1": {"ttft_ms": 120.0, "decode_tok_s": 900.0}}},
             "transformers": {"32768": {"1": {"ttft_ms": 300.0, "decode_tok_s": 80.0}}}}
    result = {"speed": speed, "policy_phases": {"full": {"prefill": "full"}, "xattn": {"prefill": "xattn"}}}
    assert script.target_of(result, "full", "32768").endswith("met")  # 11.25x
    assert script.target_of(result, "xattn", "32768").endswith("MISSED")  # slower than dense
    speed["transformers"]["32768"]["1"]["decode_tok_s"] = 95.0
    speed["xattn"]["32768"]["1"]["ttft_ms"] = 99.0
    assert script.target_of(result, "full", "32768").endswith("MISSED")
    assert script.target_of(result, "xattn", "32768").endswith("met")
    assert script.target_of(result, "transformers", "32768") == ""


def test_step_stats_count_what_each_step_scheduled():
    # (decode rows, prefill tokens) per step: two prompts of 6 tokens in a budget of 4, then decoding
    steps = [(0, 4), (0, 4), (1, 3), (0, 0), (2, 0), (1, 0)]
    stats = _script().step_stats(steps)
    assert stats["steps"] == 5  # the empty step only read tokens back
    assert (stats["prefill_only_steps"], stats["mixed_steps"], stats["decode_only_steps"]) == (2, 1, 2)
    assert stats["mean_prefill_tokens"] == pytest.approx(11 / 3)
    assert stats["decode_rows_with_prefill"] == [1]
    assert stats["decode_tokens_after_prefill"] == 3
    assert _script().step_stats([(0, 8)])["decode_tokens_after_prefill"] == 0


def test_triton_compiles_are_counted_and_the_hook_restored():
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook")
    from types import SimpleNamespace

    seen = []
    previous = knobs.runtime.jit_post_compile_hook

    def outer(**kwargs):  # a hook someone else set: still called
        seen.append(kwargs["fn"].name)

    knobs.runtime.jit_post_compile_hook = outer
    try:
        with _script().triton_compiles() as names:
            knobs.runtime.jit_post_compile_hook(key=1, fn=SimpleNamespace(name="_decode_kernel"))
            knobs.runtime.jit_post_compile_hook(key=2, fn=SimpleNamespace(name="_reduce_kernel"))
        assert names == ["_decode_kernel", "_reduce_kernel"] and seen == names
        assert knobs.runtime.jit_post_compile_hook is outer
    finally:
        knobs.runtime.jit_post_compile_hook = previous


@pytest.mark.gpu
@pytest.mark.slow
def test_timed_runs_compile_nothing_on_the_gpu(tmp_path, tiny_model):
    """A hybrid model (sliding-window and global layers) at a context where a mixed step's number of decode
    rows (1 to 7 here) sets the decode kernels' split count: the warm-up compiles whatever the timed runs
    need."""
    from nanovllm.plugins import get_plugins

    if "Gemma3ForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-gemma3 plugin")
    model = tiny_model("Gemma3ForCausalLM", max_position_embeddings=8192)
    rng = random.Random(0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"tok{rng.randrange(3, 256)}" for _ in range(5000)))
    rc = _script().main([
        "--model", model, "--lengths", "4096", "--batch-sizes", "1,8", "--decode-tokens", "64",
        "--repeats", "1", "--policies", "full", "--max-num-batched-tokens", "1024", "--no-hf",
        "--device", "cuda", "--text-file", str(text), "--out", str(tmp_path), "--name", "gpu",
    ])
    assert rc == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    for batch, m in result["speed"]["full"]["4096"].items():
        for r in m["repeats"]:
            check_steps(r["engine_steps_1"], r["engine_steps_n"], int(batch), 4096, 1024)
            assert r["engine_steps_n"]["triton_compiles"] == []  # this Triton has the compile hook
        assert m["engine_decode_tok_s"] > 0
    assert "compiled while timed" not in (tmp_path / "gpu.md").read_text()


def test_timed_runs_that_compiled_or_preempted_are_named():
    def steps(compiles, preemptions=0):
        return {"triton_compiles": compiles, "preemptions": preemptions}

    clean = {"repeats": [{"engine_steps_1": steps([]), "engine_steps_n": steps(None)}]}
    dirty = {"repeats": [{"engine_steps_1": steps([]), "engine_steps_n": steps(["_decode_kernel"] * 2, 3)}]}
    notes = _script().timing_notes("full", {"1": clean, "8": dirty, "16": {"error": "out of memory"}})
    assert len(notes) == 2 and all(n.startswith("- full, batch 8: ") for n in notes)
    assert "2 Triton kernel variants compiled while timed (_decode_kernel)" in notes[0]
    assert "3 preemptions while timed" in notes[1]
