"""Plugin discovery: entry points of group ``nanovllm``, loaded in order, each in isolation.

Installed distributions are faked without pip: a ``<name>-<version>.dist-info`` folder (METADATA
and entry_points.txt) plus a module, in a scratch directory put on ``sys.path``; importlib.metadata
finds them there as it finds anything pip installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nanovllm.builtin
import nanovllm.plugins as plugins_mod
import pytest
from nanovllm.plugins import PluginError, discover, get_plugins, reload_plugins
from nanovllm.selection import resolve_attention_backend, resolve_sparse_policy

REGISTER_POLICY = """
from nanovllm.hookspecs import hookimpl

@hookimpl
def register_sparse_policies(registry):
    registry.add_sparse_policy({name!r}, "nanovllm.policies.full:FullAttentionPolicy")
"""


def write_dist(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str],
               version: str = "1.0") -> None:
    """Fake an installed distribution ``dist`` under ``root`` with ``nanovllm`` entry points."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[nanovllm]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def policy_dist(root: Path, short: str) -> None:
    """Distribution ``nanovllm-<short>``: entry point ``<short>`` registering sparse policy ``<short>``."""
    write_dist(root, f"nanovllm-{short}", {f"fake_{short}": REGISTER_POLICY.format(name=short)},
               {short: f"fake_{short}"})


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A scratch directory on sys.path; the plugin set and fake modules are restored afterwards."""
    saved_plugins, saved_modules = plugins_mod._plugins, set(sys.modules)
    monkeypatch.delenv(plugins_mod.ALLOW_ENV, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in set(sys.modules) - saved_modules:
        if name.startswith("fake_"):
            del sys.modules[name]
    plugins_mod._plugins = saved_plugins


def names(plugin_set) -> list[str]:
    return [p.name for p in plugin_set.plugins]


# -- built-ins and the real installed plugins ---------------------------------------------------------


def test_builtins_register_through_the_entry_point_group():
    eps = [ep for ep in md.entry_points(group="nanovllm") if ep.dist.name == "nanovllm"]
    assert [(ep.name, ep.value) for ep in eps] == [("builtin", "nanovllm.builtin")]
    ps = discover()
    builtin = ps.plugins[0]
    assert (builtin.name, builtin.dist, builtin.error) == ("builtin", "nanovllm", None)
    assert {"sparse_policy:full", "attention_backend:torch"} <= set(builtin.registered)
    assert ps.manager.get_plugin("nanovllm:builtin") is nanovllm.builtin
    assert ps.registry.sparse_policies["full"].dist == "nanovllm"
    assert ps.registry.attention_backends["torch"].dist == "nanovllm"


def test_first_party_plugins_are_discovered():
    ps = discover()
    by_name = {p.name: p for p in ps.plugins}
    assert by_name["llama"].dist == "nanovllm-llama" and by_name["llama"].error is None
    assert by_name["qwen3"].dist == "nanovllm-qwen3" and by_name["qwen3"].error is None
    assert "model:LlamaForCausalLM" in by_name["llama"].registered
    assert "model:Qwen3ForCausalLM" in by_name["qwen3"].registered
    assert by_name["llama"].version == md.version("nanovllm-llama")
    families = ps.registry.model_families
    assert families["LlamaForCausalLM"].target == "nanovllm_llama.model:LlamaForCausalLM"
    assert families["Qwen3ForCausalLM"].dist == "nanovllm-qwen3"


def test_get_plugins_is_idempotent(site):
    plugins_mod._plugins = None
    first = get_plugins()
    assert get_plugins() is first
    assert reload_plugins() is not first and get_plugins() is plugins_mod._plugins


# -- fake distributions -------------------------------------------------------------------------------


def test_load_order_is_deterministic(tmp_path, site, monkeypatch):
    # Two directories, with the later dist name first on sys.path: order follows names, not paths.
    other = tmp_path / "other"
    policy_dist(site, "zeta")
    write_dist(other, "nanovllm-Alpha", {"fake_alpha": REGISTER_POLICY.format(name="alpha")},
               {"alpha": "fake_alpha"})
    write_dist(other, "nanovllm-mid", {"fake_mid1": REGISTER_POLICY.format(name="mid1"),
                                       "fake_mid2": REGISTER_POLICY.format(name="mid2")},
               {"mid2": "fake_mid2", "mid1": "fake_mid1"})  # one distribution, two entry points
    monkeypatch.setattr(sys, "path", [*sys.path, str(other)])
    importlib.invalidate_caches()
    allow = "zeta,nanovllm-alpha,nanovllm-mid"
    order = names(discover(allow))
    assert order == ["builtin", "alpha", "mid1", "mid2", "zeta"]
    assert names(discover(allow)) == order
    ps = discover(allow)
    assert list(ps.registry.sparse_policies) == ["full", "alpha", "mid1", "mid2", "zeta"]
    assert [p.dist for p in ps.plugins] == ["nanovllm", "nanovllm-Alpha", "nanovllm-mid", "nanovllm-mid",
                                            "nanovllm-zeta"]


BROKEN = """
import nanovllm_missing_dependency  # not installed

from nanovllm.hookspecs import hookimpl
"""


def test_broken_plugin_is_recorded_and_the_others_load(site):
    write_dist(site, "nanovllm-broken", {"fake_broken": BROKEN}, {"broken": "fake_broken"})
    policy_dist(site, "good")
    ps = discover("broken,good,llama")
    by_name = {p.name: p for p in ps.plugins}
    assert names(ps) == ["builtin", "broken", "good", "llama"]
    broken = by_name["broken"]
    assert broken.error == "ModuleNotFoundError: No module named 'nanovllm_missing_dependency'"
    assert isinstance(broken.exception, ModuleNotFoundError)
    assert broken.registered == [] and broken.version == "1.0"
    assert broken.as_dict()["error"] == broken.error
    assert by_name["good"].error is None and "good" in ps.registry.sparse_policies
    assert "LlamaForCausalLM" in ps.registry.model_families
    assert [p.name for p in ps.failed()] == ["broken"]

    # Selecting it raises the recorded error, whichever of its names is used.
    for spec in ("broken", "BROKEN:topk=3", "nanovllm-broken", {"name": "broken"}):
        with pytest.raises(PluginError, match="failed to load: ModuleNotFoundError") as info:
            resolve_sparse_policy(spec, ps)
        assert info.value.__cause__ is broken.exception
        assert "nanovllm-broken 1.0" in str(info.value)
    with pytest.raises(PluginError, match="'broken'.*failed to load"):
        resolve_attention_backend("broken", ps)


RAISES_IN_HOOK = """
from nanovllm.hookspecs import hookimpl

@hookimpl
def register_sparse_policies(registry):
    registry.add_sparse_policy("half_done", "fake_half:Policy")
    raise RuntimeError("registration went wrong")
"""


def test_plugin_failing_in_its_hook_is_rolled_back(site):
    write_dist(site, "nanovllm-half", {"fake_half": RAISES_IN_HOOK}, {"half": "fake_half"})
    ps = discover("half")
    half = ps.plugins[-1]
    assert half.error == "RuntimeError: registration went wrong" and half.registered == []
    assert "half_done" not in ps.registry.sparse_policies
    with pytest.raises(PluginError, match="registration went wrong"):
        resolve_sparse_policy("half", ps)


def test_selecting_a_broken_plugin_through_the_engine(site, tiny_model):
    from nanovllm import LLM

    write_dist(site, "nanovllm-broken", {"fake_broken2": BROKEN}, {"broken": "fake_broken2"})
    reload_plugins()
    assert get_plugins().failure_for("broken") is not None
    with pytest.raises(PluginError, match="No module named 'nanovllm_missing_dependency'"):
        LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", sparse_policy="broken")


# -- hook argument names ------------------------------------------------------------------------------

WRONG_REGISTRATION_ARGUMENTS = """
from nanovllm.hookspecs import hookimpl

@hookimpl
def register_sparse_policies(reg):  # the spec passes registry
    reg.add_sparse_policy("never", "nanovllm.policies.full:FullAttentionPolicy")
"""

WRONG_POLICY_ARGUMENTS = """
from nanovllm.hookspecs import hookimpl
from nanovllm.sparse import SparsePolicy

class Policy(SparsePolicy):
    def select_blocks(self, context):  # the spec passes ctx
        return context.all_history_blocks()

    def on_kv_write(self, kv):  # the spec passes write
        pass

@hookimpl
def register_sparse_policies(registry):
    registry.add_sparse_policy("renamed", "fake_renamed:Policy")
"""


def test_a_registration_hook_with_other_argument_names_fails_at_discovery(site):
    write_dist(site, "nanovllm-reg", {"fake_reg": WRONG_REGISTRATION_ARGUMENTS}, {"reg": "fake_reg"})
    ps = discover("reg")
    reg = ps.plugins[-1]
    assert reg.error == ("register_sparse_policies takes 'reg', which the hook does not pass; the hook's "
                         "arguments are register_sparse_policies(registry) "
                         "(nanovllm.hookspecs.RegistrationSpec)")
    assert reg.registered == [] and "never" not in ps.registry.sparse_policies
    with pytest.raises(PluginError, match="nanovllm-reg 1.0.*register_sparse_policies takes 'reg'"):
        resolve_sparse_policy("reg", ps)


def test_a_policy_hook_with_other_argument_names_fails_before_the_weights_load(site, tiny_model, monkeypatch):
    import nanovllm.engine.model_loading as model_loading
    from nanovllm import LLM

    write_dist(site, "nanovllm-renamed", {"fake_renamed": WRONG_POLICY_ARGUMENTS},
               {"renamed": "fake_renamed"})
    reload_plugins()
    monkeypatch.setattr(model_loading, "load_weights", lambda *a: pytest.fail("the weights were loaded"))
    with pytest.raises(PluginError) as info:
        LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", sparse_policy="renamed")
    assert str(info.value) == (
        "sparse policy 'renamed' registered by distribution 'nanovllm-renamed' (fake_renamed:Policy): "
        "select_blocks takes 'context', which the hook does not pass; the hook's arguments are "
        "select_blocks(ctx); on_kv_write takes 'kv', which the hook does not pass; the hook's arguments are "
        "on_kv_write(write); rename the method's arguments (nanovllm.sparse)"
    )


def test_an_observer_object_with_other_argument_names_is_refused_by_name(tiny_model):
    from nanovllm import LLM

    class Watcher:
        def on_blocks_selected(self, ctx, blocks):  # the spec passes block_indices
            pass

    with pytest.raises(PluginError, match=r"observer .*Watcher \(test_plugins\): on_blocks_selected takes "
                                          "'blocks'"):
        LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", observers=[Watcher()])


def test_duplicate_name_is_an_error_naming_both_distributions(site):
    write_dist(site, "nanovllm-one", {"fake_one": REGISTER_POLICY.format(name="same")}, {"one": "fake_one"})
    write_dist(site, "nanovllm-two", {"fake_two": REGISTER_POLICY.format(name="Same")}, {"two": "fake_two"})
    with pytest.raises(PluginError, match="'same' is registered twice") as info:
        discover("one,two")
    assert "'nanovllm-one'" in str(info.value) and "'nanovllm-two'" in str(info.value)
    assert {p.name for p in discover("one").plugins} == {"builtin", "one"}  # each alone is fine


def test_duplicate_of_a_builtin_names_the_core(site):
    write_dist(site, "nanovllm-fuller", {"fake_fuller": REGISTER_POLICY.format(name="full")},
               {"fuller": "fake_fuller"})
    with pytest.raises(PluginError, match="'full' is registered twice: by distribution 'nanovllm' and by "
                                          "'nanovllm-fuller'"):
        discover("fuller")


def test_duplicate_model_family(site):
    source = """
    from nanovllm.hookspecs import hookimpl

    @hookimpl
    def register_model_families(registry):
        registry.add_model_family("LlamaForCausalLM", "fake_llama2:Model")
    """
    write_dist(site, "nanovllm-llama2", {"fake_llama2": source}, {"llama2": "fake_llama2"})
    with pytest.raises(PluginError, match="'LlamaForCausalLM'.*'nanovllm-llama'.*'nanovllm-llama2'"):
        discover("llama,llama2")


def test_allow_list_limits_what_loads(site, monkeypatch):
    write_dist(site, "nanovllm-broken", {"fake_broken3": BROKEN}, {"broken": "fake_broken3"})
    everything = names(discover())
    assert {"builtin", "llama", "qwen3", "broken"} <= set(everything)

    monkeypatch.setenv("NANOVLLM_PLUGINS", "qwen3")  # by entry-point name
    ps = discover()
    assert names(ps) == ["builtin", "qwen3"]
    families = ps.registry.model_families
    assert "Qwen3ForCausalLM" in families and {f.dist for f in families.values()} == {"nanovllm-qwen3"}
    assert ps.failed() == []
    assert "full" in ps.registry.sparse_policies  # the built-ins always load

    monkeypatch.setenv("NANOVLLM_PLUGINS", " NanoVLLM-Llama , nonexistent ")  # by distribution name
    assert names(discover()) == ["builtin", "llama"]
    assert names(discover(allow="broken")) == ["builtin", "broken"]  # the argument wins over the variable
    monkeypatch.setenv("NANOVLLM_PLUGINS", "")  # empty: no limit
    assert names(discover()) == everything

    monkeypatch.setenv("NANOVLLM_PLUGINS", "llama")
    plugins_mod._plugins = None
    assert names(get_plugins()) == ["builtin", "llama"]


def test_installing_a_plugin_then_reloading(site):
    reload_plugins()
    assert "late" not in get_plugins().registry.sparse_policies
    policy_dist(site, "late")
    reload_plugins()
    resolved = resolve_sparse_policy("late")
    assert resolved.cls.__name__ == "FullAttentionPolicy" and resolved.config is None


# -- no torch -----------------------------------------------------------------------------------------


def run_python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "NANOVLLM_PLUGINS"}
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_listing_plugins_imports_no_torch(site):
    write_dist(site, "nanovllm-broken", {"fake_broken4": BROKEN}, {"broken": "fake_broken4"})
    out = run_python(
        """
        import sys
        from nanovllm.cli import main
        from nanovllm.plugins import get_plugins
        main(["plugins"])
        main(["plugins", "--json"])
        ps = get_plugins()
        assert {"builtin", "llama", "qwen3", "broken"} <= {p.name for p in ps.plugins}
        assert ps.registry.model_families and ps.registry.sparse_policies and ps.registry.attention_backends
        heavy = sorted(m for m in ("torch", "transformers", "triton", "numpy") if m in sys.modules)
        print("HEAVY", heavy)
        """,
        PYTHONPATH=str(site),
    )
    assert "FAILED TO LOAD" in out
    assert out.strip().splitlines()[-1] == "HEAVY []"
