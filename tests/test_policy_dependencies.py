"""The sparse-policy plugins sit on the policy API: their code imports nothing from the core's benchmarks
(``nanovllm.bench``) or quality harness (``nanovllm.quality``), which live above the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
POLICY_PLUGINS = ("nanovllm_quest", "nanovllm_minference", "nanovllm_xattn")
FORBIDDEN = ("nanovllm.bench", "nanovllm.quality")


def imported_modules(source: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, with ``from nanovllm import bench`` as
    ``nanovllm.bench``."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


def forbidden_imports(source: str) -> list[str]:
    return sorted(m for m in imported_modules(source)
                  if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


@pytest.mark.parametrize("plugin", POLICY_PLUGINS)
def test_policy_plugins_import_nothing_from_bench_or_quality(plugin):
    files = sorted((ROOT / plugin / "src").rglob("*.py"))
    assert files, f"no sources found under {plugin}/src"
    found = {str(f.relative_to(ROOT)): bad for f in files if (bad := forbidden_imports(f.read_text()))}
    assert not found, f"policy plugin code imports the benchmarks or the quality harness: {found}"


def test_the_check_sees_every_form_of_import():
    assert forbidden_imports("from nanovllm.bench import markdown_row") == ["nanovllm.bench",
                                                                             "nanovllm.bench.markdown_row"]
    assert forbidden_imports("def f():\n    import nanovllm.quality.corpus\n") == ["nanovllm.quality.corpus"]
    assert forbidden_imports("from nanovllm import quality") == ["nanovllm.quality"]
    assert forbidden_imports("from nanovllm import benchmarks, policy\nimport nanovllm.qualityx") == []
