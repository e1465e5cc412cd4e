"""The example third-party plugin (examples/nanovllm-window), installed the way a user would install it.

pip builds and installs the distribution into a scratch directory; every check then runs in a fresh
process with that directory on PYTHONPATH, so discovery goes through real entry points and
dist-info metadata, exactly as for a plugin installed from PyPI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nanovllm-window"


@pytest.fixture(scope="module")
def window_env(tmp_path_factory) -> dict[str, str]:
    """Environment of a process in which nanovllm-window is installed."""
    scratch = tmp_path_factory.mktemp("window")
    source, target = scratch / "src", scratch / "site"
    # Build from a copy: pip builds in-tree and would leave build/ and *.egg-info in the repository.
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    assert (target / "nanovllm_window-0.1.0.dist-info").is_dir()
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_PLUGINS"}
    # the plugin first, then whatever this process was given (a checkout under test ahead of an install)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    env["NANOVLLM_EXAMPLE_SOURCE"] = str(source)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args[:3]} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def nanovllm_command() -> list[str]:
    script = Path(sys.executable).with_name("nanovllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "nanovllm.cli"]


def test_installed_plugin_is_listed(window_env):
    listed = {p["name"]: p for p in json.loads(run([*nanovllm_command(), "plugins", "--json"], window_env))}
    assert listed["window"] == {
        "name": "window",
        "distribution": "nanovllm-window",
        "version": "0.1.0",
        "module": "nanovllm_window.plugin",
        "registers": ["sparse_policy:window"],
        "error": None,
        "warning": None,
        "problems": None,  # targets are loaded by --check only
    }
    assert {"builtin", "llama", "qwen3"} <= set(listed)  # the others still load beside it
    text = run([*nanovllm_command(), "plugins"], window_env)
    assert "nanovllm-window 0.1.0" in text and "sparse_policy:window" in text
    checked = run([*nanovllm_command(), "plugins", "--check"], window_env)  # exits 0: every target loads
    assert "sparse_policy:window\n" in checked and "FAILED" not in checked


def test_plugin_module_imports_no_torch(window_env):
    code = textwrap.dedent("""
        import sys
        from nanovllm.plugins import get_plugins
        from nanovllm.selection import parse_selection
        info = get_plugins().registry.sparse_policies["window"]
        assert info.dist == "nanovllm-window", info
        assert "nanovllm_window.plugin" in sys.modules
        parse_selection("window:sink_blocks=1,recent_blocks=2")
        print("torch" in sys.modules)
    """)
    assert run([sys.executable, "-c", code], window_env).strip() == "False"


def test_example_own_tests_pass(window_env):
    from nanovllm.conformance import cases

    source = Path(window_env["NANOVLLM_EXAMPLE_SOURCE"])
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"]
    out = run(pytest_cmd, window_env, cwd=source)
    summary = out.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|error)", summary)}
    # 7 of its own and one per case of the conformance kit, none failed; a case skips only where the kit
    # says so (no GPU, no metadata, not graph-safe), never because the entry point was not found
    assert "failed" not in counts and "error" not in counts, out
    assert counts["passed"] + counts.get("skipped", 0) == 7 + len(cases()), out
    assert "entry point is registered only once" not in out, out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


GENERATE = textwrap.dedent("""
    import json, sys
    from nanovllm import LLM, SamplingParams

    path = sys.argv[1]

    def generate(policy, prompts):
        # block_size 4 and 16-token steps: the long prompt is prefilled in chunks, so the window
        # applies to the history of prefill chunks as well as to decode.
        llm = LLM(path, device="cpu", kv_cache_memory=1 << 24, block_size=4, max_num_batched_tokens=16,
                  sparse_policy=policy, max_logprobs=-1)
        assert type(llm.runner.hooks.prefill).__name__ == ("WindowPolicy" if policy != "full" else
                                                            "FullAttentionPolicy")
        vocab = llm.vocab_size  # logprobs of the whole vocabulary: each generated token's distribution
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=vocab)
        outs = llm.generate(prompts, params, use_tqdm=False)
        rows = [[[entry[t].logprob for t in range(vocab)] for entry in o.outputs[0].logprobs] for o in outs]
        return [o.outputs[0].token_ids for o in outs], rows

    short = [5, 6, 7, 8, 9, 10]                  # 6 + 5 tokens: 3 blocks, inside sink 1 + recent 2
    long = [(7 * i + 3) % 250 + 3 for i in range(40)]  # 10 blocks and more: the window drops most
    prompts = [short, long]
    result = {}
    for policy in ("full", "window:sink_blocks=1,recent_blocks=2"):
        result[policy] = generate(policy, prompts)
    print(json.dumps(result))
""")


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.slow
def test_window_policy_generates(window_env, tiny_model):
    path = tiny_model("LlamaForCausalLM")
    result = json.loads(run([sys.executable, "-c", GENERATE, path], window_env))
    dense_tokens, dense_logprobs = result["full"]
    window_tokens, window_logprobs = result["window:sink_blocks=1,recent_blocks=2"]

    # The short prompt never outgrows sink 1 + recent 2 blocks, and it shares its batch with a long
    # one (so the window's general selection runs, not its all-blocks shortcut): exactly dense.
    assert window_tokens[0] == dense_tokens[0]
    assert max_diff(window_logprobs[0], dense_logprobs[0]) < 1e-4
    # The long prompt attends to 3 of its 10+ blocks: the selection takes effect already in the last
    # prefill chunk (whose history is 8 blocks), and in every decode step.
    per_step = [max_diff([a], [b]) for a, b in zip(window_logprobs[1], dense_logprobs[1], strict=True)]
    assert len(per_step) == 5
    assert min(per_step) > 1e-3, per_step
