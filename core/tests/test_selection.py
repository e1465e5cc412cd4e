"""Selection strings for ``sparse_policy=`` and ``attention_backend=``: grammar, names, options."""

from __future__ import annotations

import attrs
import pytest
from nanovllm.plugins import (
    AttentionBackendInfo,
    PluginError,
    PluginSet,
    SparsePolicyInfo,
    discover,
)
from nanovllm.selection import (
    Selection,
    SelectionError,
    make_config,
    parse_selection,
    resolve_attention_backend,
    resolve_policies,
    resolve_sparse_policy,
)


def _positive(_inst, attribute, value):
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.define(frozen=True)
class ProbeConfig:
    topk: int = attrs.field(default=4, validator=[attrs.validators.instance_of(int), _positive])
    ratio: float = attrs.field(default=0.5, validator=attrs.validators.instance_of((int, float)))
    mode: str = attrs.field(default="max", validator=attrs.validators.in_(("max", "sum")))
    flag: bool = False


@pytest.fixture(scope="module")
def plugins() -> PluginSet:
    """Installed plugins (built-ins and first-party only) plus a policy and a backend with options."""
    ps = discover(allow="llama,qwen3")
    here = __name__
    ps.registry.sparse_policies["probe"] = SparsePolicyInfo(
        "probe", "nanovllm.policies.full:FullAttentionPolicy", "nanovllm-probe", f"{here}:ProbeConfig"
    )
    ps.registry.attention_backends["fastattn"] = AttentionBackendInfo(
        "fastattn", "nanovllm.attention.torch_backend:TorchBackend", "nanovllm-fastattn",
        config=f"{here}:ProbeConfig",
    )
    return ps


# -- grammar ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "name", "options"),
    [
        ("quest", "quest", {}),
        ("  Quest  ", "quest", {}),
        ("QUEST:topk=8", "quest", {"topk": 8}),
        ("quest: topk = 8 , ratio=0.25", "quest", {"topk": 8, "ratio": 0.25}),
        ("x:a=true,b=false,c=null", "x", {"a": True, "b": False, "c": None}),
        ("x:a=-3,b=1e3,c=fast", "x", {"a": -3, "b": 1000.0, "c": "fast"}),
        ('x:s="a,b",t="8"', "x", {"s": "a,b", "t": "8"}),  # quoted: a string, commas allowed
        ("x:path=/tmp/a.bin", "x", {"path": "/tmp/a.bin"}),
        ("x:l=[1]", "x", {"l": "[1]"}),  # JSON that is not a scalar stays a string
        ({"name": "Quest", "topk": 8}, "quest", {"topk": 8}),
        ({"name": "full"}, "full", {}),
    ],
)
def test_parse(spec, name, options):
    sel = parse_selection(spec)
    assert sel == Selection(name, options)
    assert type(sel.options.get("topk", 0)) is int
    assert parse_selection(sel) is sel
    assert parse_selection(str(sel)) == sel  # str() round-trips


def test_dict_form_is_not_mutated():
    spec = {"name": "quest", "topk": 8}
    parse_selection(spec)
    assert spec == {"name": "quest", "topk": 8}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "has no name before ':'"),
        ("   ", "has no name before ':'"),
        (":topk=8", "has no name before ':'"),
        ("quest:", "has ':' but no options after it"),
        ("quest:topk", "option 'topk' is not 'key=value'"),
        ("quest:topk=8,", "option '' is not 'key=value'"),
        ("quest:=8", "option '=8' is not 'key=value'"),
        ("quest:top k=8", "option 'top k=8' is not 'key=value'"),
        ("quest:a=1;b=2", None),  # one option whose value is '1;b=2': legal, see below
        ("quest:topk=1,topk=2", "option 'topk' is given twice"),
        ({"topk": 8}, "a dict selection needs a 'name' key"),
        ({"name": ""}, "a dict selection needs a 'name' key"),
        ({"name": 3}, "a dict selection needs a 'name' key"),
        (3, "must be a string like 'name:key=value' or a dict, not int"),
        (None, "not NoneType"),
    ],
)
def test_malformed(spec, message):
    if message is None:
        assert parse_selection(spec).options == {"a": "1;b=2"}
        return
    with pytest.raises(SelectionError, match=message) as info:
        parse_selection(spec)
    assert str(info.value).startswith("sparse_policy")
    assert isinstance(info.value, ValueError)


def test_the_example_in_grammar_errors_is_a_real_selection():
    """The hint names an option the policy has: Quest's token_budget (not a made-up one)."""
    with pytest.raises(SelectionError, match="write e.g. sparse_policy='quest:token_budget=2048'"):
        parse_selection("quest:")
    quest = pytest.importorskip("nanovllm_quest.config")
    assert "token_budget" in attrs.fields_dict(quest.QuestConfig)
    with pytest.raises(SelectionError, match="write e.g. attention_backend='name:key=value'"):
        parse_selection("torch:", "attention_backend")


def test_errors_name_the_option_they_are_about():
    with pytest.raises(SelectionError, match=r"^attention_backend='torch:' has ':'.*attention_backend="):
        parse_selection("torch:", "attention_backend")


# -- names --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["full", "FULL", " Full ", {"name": "Full"}])
def test_names_are_case_insensitive(plugins, spec):
    resolved = resolve_sparse_policy(spec, plugins)
    assert resolved.cls.__name__ == "FullAttentionPolicy"
    assert type(resolved.config).__name__ == "FullConfig"


@pytest.mark.parametrize("spec", ["torch", "TORCH", {"name": "Torch"}])
def test_backend_names_are_case_insensitive(plugins, spec):
    choice = resolve_attention_backend(spec, plugins)
    assert choice.info.name == "torch" and choice.info.dist == "nanovllm" and choice.config is None


def test_unknown_policy_lists_and_suggests_without_inventing_a_package(plugins):
    with pytest.raises(PluginError) as info:
        resolve_sparse_policy("prob:topk=3", plugins)
    msg = str(info.value)
    assert msg.startswith("unknown sparse policy 'prob'. Did you mean 'probe'? Installed: ")
    installed = msg.split("Installed: ")[1].split(" (")[0].split(", ")
    assert {"full", "probe"} <= set(installed) and installed == sorted(installed)
    assert "pip install" not in msg  # 'prob' is no first-party distribution: no package name is made up


def test_unknown_name_without_a_close_match(plugins):
    with pytest.raises(PluginError) as info:
        resolve_sparse_policy("Zzzyx", plugins)
    assert "Did you mean" not in str(info.value)
    assert "unknown sparse policy 'zzzyx'" in str(info.value)
    assert "pip install" not in str(info.value)


def test_first_party_policies_name_their_distribution(plugins):
    with pytest.raises(PluginError, match=r"'quest' is not installed; install it with: pip install nanovllm-quest"):
        resolve_sparse_policy("quest", plugins)
    with pytest.raises(PluginError, match=r"unknown sparse policy 'quets'. Did you mean 'quest' \(pip install "
                       r"nanovllm-quest\)\?"):
        resolve_sparse_policy("quets", plugins)
    with pytest.raises(PluginError, match=r"Did you mean 'xattn' \(pip install nanovllm-xattn\)"):
        resolve_sparse_policy("xatn", plugins)


def test_unknown_backend(plugins):
    with pytest.raises(PluginError) as info:
        resolve_attention_backend("torhc", plugins)
    msg = str(info.value)
    assert msg.startswith("unknown attention backend 'torhc'. Did you mean 'torch'? Installed: ")
    assert "torch" in msg.split("Installed: ")[1] and "fastattn" in msg
    assert "pip install" not in msg
    # The policy table and the backend table are separate.
    with pytest.raises(PluginError, match="unknown attention backend 'full'"):
        resolve_attention_backend("full", plugins)
    with pytest.raises(PluginError, match="unknown sparse policy 'torch'"):
        resolve_sparse_policy("torch", plugins)


# -- options ------------------------------------------------------------------------------------------


def test_options_build_the_attrs_config(plugins):
    config = resolve_sparse_policy('PROBE:topk=8,ratio=0.75,mode="sum",flag=true', plugins).config
    assert config == ProbeConfig(topk=8, ratio=0.75, mode="sum", flag=True)
    assert resolve_sparse_policy({"name": "probe", "topk": 2}, plugins).config == ProbeConfig(topk=2)
    assert resolve_sparse_policy("probe", plugins).config == ProbeConfig()
    choice = resolve_attention_backend("FastAttn:topk=16", plugins)
    assert choice.info.name == "fastattn" and choice.config == ProbeConfig(topk=16)


@pytest.mark.parametrize("spec", ["probe:TopK=8,Ratio=0.25", {"NAME": "probe", "TOPK": 8, "ratio": 0.25}])
def test_option_keys_are_case_insensitive(plugins, spec):
    assert resolve_sparse_policy(spec, plugins).config == ProbeConfig(topk=8, ratio=0.25)


def test_option_keys_differing_only_in_case_are_given_twice(plugins):
    with pytest.raises(SelectionError, match="option 'topk' is given twice"):
        resolve_sparse_policy("probe:topk=1,TOPK=2", plugins)
    with pytest.raises(SelectionError, match="option 'topk' is given twice"):
        resolve_sparse_policy({"name": "probe", "topk": 1, "TopK": 2}, plugins)


@pytest.mark.parametrize(
    ("resolve", "spec", "label"),
    [
        (resolve_sparse_policy, "probe:topk=8,top_k=3,size=1", "sparse policy 'probe'"),
        (resolve_attention_backend, "fastattn:top_k=3,size=1", "attention backend 'fastattn'"),
    ],
)
def test_unknown_key_lists_accepted_keys(plugins, resolve, spec, label):
    with pytest.raises(SelectionError) as info:
        resolve(spec, plugins)
    assert str(info.value) == f"{label}: unknown option 'top_k', 'size'. Accepted: topk, ratio, mode, flag"


def test_invalid_values_are_selection_errors(plugins):
    prefix = "sparse policy 'probe': invalid option value: "
    with pytest.raises(SelectionError, match=prefix + "topk must be positive"):
        resolve_sparse_policy("probe:topk=0", plugins)
    # attrs' own validators: one readable line, not the raw tuple of their arguments
    for spec, reason in [
        ("probe:topk=many", "topk must be of type int, got 'many' (str)"),
        ("probe:ratio=high", "ratio must be of type int or float, got 'high' (str)"),
        ("probe:mode=avg", "mode must be one of 'max', 'sum', got 'avg'"),
    ]:
        with pytest.raises(SelectionError) as info:
            resolve_sparse_policy(spec, plugins)
        assert str(info.value) == prefix + reason


def test_options_for_plugins_without_options(plugins):
    with pytest.raises(SelectionError, match=r"sparse policy 'full': unknown option 'topk'. Accepted: none"):
        resolve_sparse_policy("full:topk=8", plugins)
    with pytest.raises(SelectionError, match=r"attention backend 'torch' takes no options, got: block"):
        resolve_attention_backend("torch:block=64", plugins)


def test_make_config_accepts_a_class():
    assert make_config(ProbeConfig, {"topk": 3}, "x") == ProbeConfig(topk=3)
    assert make_config(None, {}, "x") is None


# -- through the engine -------------------------------------------------------------------------------


def test_engine_options_use_the_same_grammar(tiny_model):
    from nanovllm import LLM

    path = tiny_model()
    common = dict(kv_cache_memory=1 << 24, device="cpu")
    llm = LLM(path, sparse_policy="FULL", attention_backend="Torch", **common)
    assert type(llm.runner.hooks.decode).__name__ == "FullAttentionPolicy"
    assert llm.runner.backend.name == "torch"
    llm = LLM(path, sparse_policy={"name": "full"}, attention_backend={"name": "torch"}, **common)
    assert llm.runner.backend.name == "torch"
    with pytest.raises(PluginError, match="unknown sparse policy 'fulll'.*Did you mean 'full'"):
        LLM(path, sparse_policy="fulll", **common)
    with pytest.raises(PluginError, match="unknown attention backend 'troch'.*Did you mean 'torch'"):
        LLM(path, attention_backend="troch", **common)
    with pytest.raises(SelectionError, match="sparse policy 'full': unknown option 'topk'"):
        LLM(path, sparse_policy="full:topk=3", **common)
    with pytest.raises(SelectionError, match="attention_backend='torch:' has ':' but no options"):
        LLM(path, attention_backend="torch:", **common)


@pytest.mark.parametrize("spec", ["auto", "AUTO", " Auto", {"name": "auto"}, {"name": "Auto"}])
def test_auto_backend_is_case_insensitive(tiny_model, spec):
    from nanovllm import LLM

    llm = LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", attention_backend=spec)
    assert llm.runner.backend.name == "torch"


def test_auto_backend_takes_no_options(tiny_model):
    from nanovllm import LLM

    with pytest.raises(SelectionError, match="attention_backend='auto' takes no options, got: block"):
        LLM(tiny_model(), kv_cache_memory=1 << 24, device="cpu", attention_backend="auto:block=64")
