"""The public policy API, ``nanovllm.sparse``: the only nanovllm module policy plugins import besides the
attention backend's, versioned, and importable without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from nanovllm import sparse
from nanovllm.hookspecs import hookimpl
from nanovllm.plugins import PluginError, PluginSet, Registry, reload_plugins
from nanovllm.sparse import API_VERSION, APIVersionError, check_api_version

ROOT = Path(__file__).resolve().parents[2]
# The source of every policy plugin: the first-party distributions, the core's built-in policies and the
# plugin-authoring example.
POLICY_SOURCES = [
    ROOT / "nanovllm_quest" / "src" / "nanovllm_quest",
    ROOT / "nanovllm_minference" / "src" / "nanovllm_minference",
    ROOT / "nanovllm_xattn" / "src" / "nanovllm_xattn",
    ROOT / "core" / "src" / "nanovllm" / "policies",
    ROOT / "examples" / "nanovllm-window" / "src" / "nanovllm_window",
]
ALLOWED = {"nanovllm.sparse", "nanovllm.attention.backend"}


def nanovllm_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a ``nanovllm`` module in ``path``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == "nanovllm" or n.startswith("nanovllm.")]
    return found


def test_policy_plugins_import_only_the_policy_api_and_the_backend_api():
    sources = [p for d in POLICY_SOURCES for p in sorted(d.rglob("*.py"))]
    assert len(sources) > 20  # the scan sees the plugins
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in sources for line, module in nanovllm_imports(p)
           if module not in ALLOWED]
    assert not bad, "import from nanovllm.sparse (or nanovllm.attention.backend) instead:\n" + "\n".join(bad)


def test_the_scan_finds_every_form_of_import(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(textwrap.dedent("""
        import nanovllm.policy
        from nanovllm.attention import triton_kernels
        from . import sibling
        from nanovllm_quest import config

        def late():
            from nanovllm.sparse import SparsePolicy
    """))
    found = nanovllm_imports(source)
    assert found == [(2, "nanovllm.policy"), (3, "nanovllm.attention"), (8, "nanovllm.sparse")]


def test_the_api_names_are_imported_from_the_api_or_their_home():
    # a name of nanovllm.sparse that code imports from a third module keeps a stray re-export alive there;
    # its home is the defining module or a package above it (nanovllm.kv for nanovllm.kv.store)
    homes = {name: {"nanovllm.sparse"} | {module.rsplit(".", n)[0] for n in range(module.count("."))}
             for name, module in sparse._LAZY.items()}
    folders = [ROOT / d for d in ("core", "plugins", "tests", "benchmarks", "examples")] + [
        p for p in ROOT.glob("nanovllm_*") if p.is_dir()]
    bad = []
    for path in (p for d in folders for p in sorted(d.rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanovllm."):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}"
                        for alias in node.names if node.module not in homes.get(alias.name, {node.module})]
    assert not bad, "import these from nanovllm.sparse:\n" + "\n".join(bad)


# -- what the module offers ----------------------------------------------------------------------------


def test_every_exported_name_resolves_to_its_definition():
    from nanovllm.attention import metadata, triton_kernels
    from nanovllm.kv import store
    from nanovllm.policy import PolicyContext

    for name in sparse.__all__:
        assert getattr(sparse, name) is not None, name
    assert sparse.PolicyContext is PolicyContext and sparse.StepMetadata is metadata.StepMetadata
    assert sparse.KVWrite is store.KVWrite and sparse.num_sms is triton_kernels.num_sms
    assert sparse.online_softmax_step is triton_kernels.online_softmax_step
    assert sparse.hookimpl is hookimpl and set(sparse.__all__) <= set(dir(sparse))
    with pytest.raises(AttributeError, match="has no attribute 'store_kv'"):
        _ = sparse.store_kv  # the backend's own kernels are not plugin helpers


def test_importing_the_api_and_registration_imports_no_torch():
    code = """
        import sys
        from nanovllm.sparse import API_VERSION, SparsePolicy, hookimpl, check_api_version
        import nanovllm_quest.plugin, nanovllm_minference.plugin, nanovllm_xattn.plugin
        class Mine(SparsePolicy):
            requires_block_selection = False
        print(sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -- the version ---------------------------------------------------------------------------------------


def test_the_version_is_major_dot_minor():
    major, minor = (int(part) for part in API_VERSION.split("."))
    assert major >= 1 and minor >= 0


def bumped(major: int = 0, minor: int = 0) -> str:
    have_major, have_minor = (int(part) for part in API_VERSION.split("."))
    return f"{have_major + major}.{max(have_minor + minor, 0)}"


def test_a_plugin_written_for_this_or_an_older_minor_version_runs():
    check_api_version(API_VERSION)
    check_api_version(f"{API_VERSION.split('.')[0]}.0")


@pytest.mark.parametrize(("declared", "fix"), [
    (bumped(minor=1), "upgrade nanovllm to a release that provides policy API"),
    (bumped(major=1), "upgrade nanovllm"),
    (bumped(major=-1), "upgrade the plugin to a release written for policy API"),
])
def test_another_version_is_an_error_naming_both_and_the_fix(declared, fix):
    with pytest.raises(APIVersionError) as info:
        check_api_version(declared, "sparse policy 'x'")
    message = str(info.value)
    assert f"sparse policy 'x' is written for policy API {declared}" in message
    assert f"this nanovllm provides {API_VERSION}" in message and fix in message


@pytest.mark.parametrize("declared", ["1", "one.zero", "1.0.0", ""])
def test_a_malformed_version_says_how_to_write_it(declared):
    with pytest.raises(APIVersionError, match="write it as 'MAJOR.MINOR'"):
        check_api_version(declared)


def test_registration_checks_the_declared_version():
    registry = Registry()
    registry.add_sparse_policy("now", "pkg:Policy", api_version=API_VERSION)
    registry.add_observer("old_style", "pkg:Observer")  # no declaration: not checked
    assert set(registry.sparse_policies) == {"now"} and set(registry.observers) == {"old_style"}
    with pytest.raises(APIVersionError, match="observer 'later' of distribution 'nanovllm'"):
        registry.add_observer("later", "pkg:Observer", api_version=bumped(major=1))


class FuturePlugin:
    @hookimpl
    def register_sparse_policies(self, registry):
        registry.add_sparse_policy("future", "nanovllm.policies.full:FullAttentionPolicy",
                                   api_version=bumped(major=1))


@pytest.fixture
def plugins():
    from nanovllm.plugins import get_plugins

    yield get_plugins()
    reload_plugins()


def test_a_plugin_of_another_version_is_recorded_and_refused_when_selected(plugins: PluginSet):
    from nanovllm.selection import resolve_sparse_policy

    with pytest.raises(PluginError, match="in-process plugin 'future' failed to register: .*policy API"):
        plugins.register(FuturePlugin(), "future")
    [info] = [p for p in plugins.plugins if p.name == "future"]
    assert "APIVersionError" in info.error and info.registered == []
    assert "future" not in plugins.registry.sparse_policies
    with pytest.raises(PluginError, match="policy API"):
        resolve_sparse_policy("future", plugins)
