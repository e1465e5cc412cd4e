"""``nanovllm plugins [--json]``: every plugin, its distribution and version, what it registers, and
why it failed to load."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nanovllm.plugins as plugins_mod
import pytest
from nanovllm.cli import main
from nanovllm.plugins import reload_plugins

KEYS = {"name", "distribution", "version", "module", "registers", "error", "warning", "problems"}


def write_dist(root: Path, dist: str, module: str, source: str, entry: str) -> None:
    info = root / f"{dist.replace('-', '_')}-2.5.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 2.5\n")
    (info / "entry_points.txt").write_text(f"[nanovllm]\n{entry} = {module}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(source))


POLICY = """
from nanovllm.hookspecs import hookimpl

@hookimpl
def register_sparse_policies(registry):
    registry.add_sparse_policy({name!r}, "nanovllm.policies.full:FullAttentionPolicy")
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    saved_plugins, saved_modules = plugins_mod._plugins, set(sys.modules)
    monkeypatch.delenv(plugins_mod.ALLOW_ENV, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in set(sys.modules) - saved_modules:
        if name.startswith("fakecli_"):
            del sys.modules[name]
    plugins_mod._plugins = saved_plugins


def nanovllm(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The installed console script (``python -m nanovllm.cli`` if there is none)."""
    script = Path(sys.executable).with_name("nanovllm")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nanovllm.cli"]
    environ = {k: v for k, v in os.environ.items() if k != "NANOVLLM_PLUGINS"}
    environ.update(env)
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=environ, timeout=60)


def test_text_listing(site, capsys):
    reload_plugins()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    core, llama, qwen3 = (md.version(d) for d in ("nanovllm", "nanovllm-llama", "nanovllm-qwen3"))
    assert f"builtin      nanovllm {core}  (nanovllm.builtin)" in out
    assert f"llama        nanovllm-llama {llama}  (nanovllm_llama.plugin)" in out
    assert f"qwen3        nanovllm-qwen3 {qwen3}  (nanovllm_qwen3.plugin)" in out
    for entry in ("sparse_policy:full", "attention_backend:torch", "model:LlamaForCausalLM",
                  "model:Qwen3ForCausalLM"):
        assert f"    {entry}\n" in out
    assert "FAILED" not in out
    assert out.index("builtin") < out.index("llama") < out.index("qwen3")


def test_json_listing(site, capsys):
    reload_plugins()
    assert main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert all(set(p) == KEYS for p in listed)
    by_name = {p["name"]: p for p in listed}
    assert listed[0]["name"] == "builtin"
    assert by_name["builtin"]["distribution"] == "nanovllm"
    assert {"sparse_policy:full", "attention_backend:torch"} <= set(by_name["builtin"]["registers"])
    llama = by_name["llama"]
    assert (llama["distribution"], llama["version"], llama["module"], llama["error"]) == (
        "nanovllm-llama", md.version("nanovllm-llama"), "nanovllm_llama.plugin", None
    )
    assert "model:LlamaForCausalLM" in llama["registers"]
    assert "model:Qwen3ForCausalLM" in by_name["qwen3"]["registers"]
    assert all(p["problems"] is None for p in listed)  # targets are not loaded without --check


def test_broken_plugin_is_shown_with_its_error(site, capsys):
    write_dist(site, "nanovllm-broken", "fakecli_broken", "raise ImportError('needs libfoo >= 2')", "broken")
    write_dist(site, "nanovllm-fine", "fakecli_fine", POLICY.format(name="fine"), "fine")
    reload_plugins()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert ("broken       nanovllm-broken 2.5  (fakecli_broken)\n"
            "    FAILED TO LOAD: ImportError: needs libfoo >= 2") in out
    assert "fine         nanovllm-fine 2.5  (fakecli_fine)\n    sparse_policy:fine" in out
    assert "model:LlamaForCausalLM" in out

    assert main(["plugins", "--json"]) == 0
    by_name = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert by_name["broken"]["error"] == "ImportError: needs libfoo >= 2"
    assert by_name["broken"]["registers"] == [] and by_name["broken"]["version"] == "2.5"
    assert by_name["fine"]["error"] is None


def test_console_script(site):
    write_dist(site, "nanovllm-broken", "fakecli_broken2", "raise ImportError('needs libfoo >= 2')", "broken")
    proc = nanovllm("plugins", "--json", PYTHONPATH=str(site))
    assert proc.returncode == 0, proc.stderr
    by_name = {p["name"]: p for p in json.loads(proc.stdout)}
    assert {"builtin", "llama", "qwen3", "broken"} <= set(by_name)
    assert by_name["broken"]["error"] == "ImportError: needs libfoo >= 2"

    proc = nanovllm("plugins", PYTHONPATH=str(site), NANOVLLM_PLUGINS="qwen3")
    assert proc.returncode == 0, proc.stderr
    assert "qwen3" in proc.stdout and "llama" not in proc.stdout and "broken" not in proc.stdout
    assert "sparse_policy:full" in proc.stdout


def test_duplicate_names_fail_the_listing_naming_both(site):
    write_dist(site, "nanovllm-one", "fakecli_one", POLICY.format(name="twin"), "one")
    write_dist(site, "nanovllm-two", "fakecli_two", POLICY.format(name="twin"), "two")
    proc = nanovllm("plugins", PYTHONPATH=str(site))
    assert proc.returncode == 2
    assert proc.stderr.startswith("nanovllm: error: sparse policy 'twin' is registered twice")
    assert "'nanovllm-one'" in proc.stderr and "'nanovllm-two'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_plugin_that_registers_nothing_is_flagged(site, capsys):
    write_dist(site, "nanovllm-empty", "fakecli_empty", "def register_sparse_policies(registry):\n    pass\n",
               "empty")  # forgot @hookimpl: pluggy sees no implementation
    reload_plugins()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "empty        nanovllm-empty 2.5  (fakecli_empty)\n    WARNING: registers nothing" in out
    assert main(["plugins", "--json"]) == 0
    by_name = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert by_name["empty"]["warning"].startswith("registers nothing") and by_name["empty"]["error"] is None
    assert by_name["builtin"]["warning"] is None


def test_a_typo_in_a_lazy_target_is_one_line_naming_plugin_and_target(site, tiny_model):
    source = POLICY.replace("FullAttentionPolicy", "FulAttentionPolicy").format(name="typo")
    write_dist(site, "nanovllm-typo", "fakecli_typo", source, "typo")
    proc = nanovllm("generate", "--model", tiny_model(), "--no-chat", "--device", "cpu", "--sparse-policy", "typo",
                    "tok5", PYTHONPATH=str(site))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "sparse policy 'typo' registered by distribution 'nanovllm-typo' points at " in lines[0]
    assert "'nanovllm.policies.full:FulAttentionPolicy', which cannot be loaded" in lines[0]


# -- --check: every registered target loaded -------------------------------------------------------------

WRONG_ARGUMENTS = """
from nanovllm.hookspecs import hookimpl
from nanovllm.sparse import SparsePolicy

class Policy(SparsePolicy):
    def select_blocks(self, context):  # the spec passes ctx
        return context.all_history_blocks()

@hookimpl
def register_sparse_policies(registry):
    registry.add_sparse_policy("renamed", "fakecli_args:Policy")
"""


def test_check_loads_every_target_and_flags_the_ones_that_fail(site, capsys):
    source = POLICY.replace("FullAttentionPolicy", "FulAttentionPolicy").format(name="typo")
    write_dist(site, "nanovllm-typo", "fakecli_typo2", source, "typo")
    write_dist(site, "nanovllm-args", "fakecli_args", WRONG_ARGUMENTS, "args")
    write_dist(site, "nanovllm-fine", "fakecli_fine2", POLICY.format(name="fine"), "fine")
    reload_plugins()
    assert main(["plugins"]) == 0  # listing alone loads no target: nothing is flagged
    out = capsys.readouterr().out
    assert "FAILED" not in out and "--check" in out

    assert main(["plugins", "--check"]) == 1
    out = capsys.readouterr().out
    assert ("typo         nanovllm-typo 2.5  (fakecli_typo2)\n    sparse_policy:typo\n"
            "        FAILED: sparse policy 'typo' registered by distribution 'nanovllm-typo' points at "
            "'nanovllm.policies.full:FulAttentionPolicy', which cannot be loaded (AttributeError: ") in out
    assert ("    sparse_policy:renamed\n        FAILED: sparse policy 'renamed' registered by distribution "
            "'nanovllm-args' (fakecli_args:Policy): select_blocks takes 'context', which the hook does not "
            "pass; the hook's arguments are select_blocks(ctx)") in out
    assert "fine         nanovllm-fine 2.5  (fakecli_fine2)\n    sparse_policy:fine\n" in out
    assert "sparse_policy:fine\n        FAILED" not in out
    assert "model:LlamaForCausalLM\n        FAILED" not in out

    assert main(["plugins", "--check", "--json"]) == 1
    by_name = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert set(by_name["typo"]["problems"]) == {"sparse_policy:typo"}
    assert by_name["fine"]["problems"] == {} and by_name["builtin"]["problems"] == {}


def test_check_passes_on_the_installed_plugins(site, capsys):
    reload_plugins()
    assert main(["plugins", "--check"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and out.rstrip().endswith("every registered target loads")
