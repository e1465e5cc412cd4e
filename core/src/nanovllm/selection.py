"""Selection strings for ``sparse_policy=`` and ``attention_backend=``.

Grammar: ``name`` or ``name:key=value,key=value``; values are JSON scalars (``8``, ``0.9``, ``true``,
``null``, ``"a,b"``) or else plain strings. A dict ``{"name": "quest", "topk": 8}`` works in Python.
Names and keys are case-insensitive; keys are checked against the plugin's attrs config class.

``sparse_policy=`` may select one prefill policy and one decode policy together:
``"xattn:threshold=0.9;quest:token_budget=2048"`` (each runs the phases it supports),
``"prefill=window;decode=quest"`` or ``{"prefill": "window", "decode": {"name": "quest"}}`` (explicit
phases). A phase no selected policy covers runs ``full``. Everything is resolved once, at engine start,
into a :class:`PolicyPlan` and a :class:`BackendChoice`.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import attrs

from nanovllm.plugins import AttentionBackendInfo, PluginError, PluginSet, get_plugins, load_registered
from nanovllm.sparse import contract_problems

PHASES = ("prefill", "decode")
# The first-party policy distributions: the only package names an error message may send users to.
FIRST_PARTY_POLICIES = {
    "quest": "nanovllm-quest", "minference": "nanovllm-minference", "xattn": "nanovllm-xattn",
}


class SelectionError(ValueError):
    """A selection string is malformed, names nothing installed, or has a bad option."""


@attrs.define(frozen=True)
class Selection:
    name: str
    options: dict[str, Any] = attrs.Factory(dict)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={json.dumps(v)}" for k, v in self.options.items())


def _scalar(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if value is None or isinstance(value, (bool, int, float, str)) else text


def _split_outside_quotes(body: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside double quotes."""
    parts, current, quoted = [], [], False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == sep and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def parse_selection(spec: str | dict | Selection, what: str = "sparse_policy") -> Selection:
    """Parse a selection string or dict into a :class:`Selection` (names lower-cased)."""
    if isinstance(spec, Selection):
        return spec
    if isinstance(spec, dict):
        options = {}
        for key, value in spec.items():
            lowered = key.lower() if isinstance(key, str) else key
            if lowered in options:
                raise SelectionError(f"{what}={spec!r}: option {lowered!r} is given twice")
            options[lowered] = value
        name = options.pop("name", None)
        if not isinstance(name, str) or not name.strip():
            raise SelectionError(f"{what}={spec!r}: a dict selection needs a 'name' key, e.g. {{'name': 'full'}}")
        return Selection(name.strip().lower(), options)
    if not isinstance(spec, str):
        raise SelectionError(f"{what} must be a string like 'name:key=value' or a dict, not {type(spec).__name__}")
    name, sep, body = spec.strip().partition(":")
    name = name.strip().lower()
    # a well-formed selection for error messages; a policy's with an option Quest really has
    example = f"{what}='quest:token_budget=2048'" if what == "sparse_policy" else f"{what}='name:key=value'"
    if not name:
        raise SelectionError(f"{what}={spec!r} has no name before ':'; write e.g. {example}")
    options: dict[str, Any] = {}
    if sep:
        if not body.strip():
            raise SelectionError(f"{what}={spec!r} has ':' but no options after it; write e.g. {example}")
        for item in _split_outside_quotes(body):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or not key.isidentifier():
                raise SelectionError(
                    f"{what}={spec!r}: option {item.strip()!r} is not 'key=value'; write e.g. {example}"
                )
            if key in options:
                raise SelectionError(f"{what}={spec!r}: option {key!r} is given twice")
            options[key] = _scalar(value.strip())
    return Selection(name, options)


def _unknown_name(name: str, installed: list[str], kind: str, plugins: PluginSet) -> PluginError:
    failed = plugins.failure_for(name)
    if failed is not None:
        err = PluginError(
            f"{kind} {name!r} comes from plugin {failed.name!r} (distribution {failed.dist} {failed.version}), "
            f"which failed to load: {failed.error}"
        )
        err.__cause__ = failed.exception
        return err
    listing = f"Installed: {', '.join(sorted(installed)) or 'none'} (see `nanovllm plugins`)."
    first_party = FIRST_PARTY_POLICIES if kind == "sparse policy" else {}
    if name in first_party:
        return PluginError(
            f"{kind} {name!r} is not installed; install it with: pip install {first_party[name]}. {listing}"
        )
    candidates = installed + [n for n in first_party if n not in installed]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = ""
    if close and close[0] in installed:
        hint = f" Did you mean {close[0]!r}?"
    elif close:
        hint = f" Did you mean {close[0]!r} (pip install {first_party[close[0]]})?"
    return PluginError(f"unknown {kind} {name!r}.{hint} {listing}")


def make_config(
    config_target: str | type | None, options: dict[str, Any], label: str, dist: str = "?"
) -> Any:
    """Build the attrs config of a plugin from selection options, checking every key."""
    if config_target is None:
        if options:
            raise SelectionError(f"{label} takes no options, got: {', '.join(options)}")
        return None
    if isinstance(config_target, str):
        config_cls = load_registered(config_target, dist, f"the config of {label}")
    else:
        config_cls = config_target
    accepted = attrs.fields_dict(config_cls)
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise SelectionError(
            f"{label}: unknown option {', '.join(map(repr, unknown))}. "
            f"Accepted: {', '.join(accepted) or 'none'}"
        )
    try:
        return config_cls(**options)
    except (TypeError, ValueError) as exc:
        raise SelectionError(f"{label}: invalid option value: {_validator_message(exc)}") from exc


def _validator_message(exc: Exception) -> str:
    """A config's validation error as one readable line. attrs' own validators raise with the field, the
    accepted values and the value as further arguments, which ``str()`` shows as a raw tuple."""
    args = exc.args
    if len(args) != 4 or not isinstance(args[1], attrs.Attribute):
        return str(exc)
    name, accepted, value = args[1].name, args[2], args[3]
    if isinstance(exc, TypeError) and all(isinstance(t, type) for t in _as_tuple(accepted)):  # instance_of
        types = " or ".join(t.__name__ for t in _as_tuple(accepted))
        return f"{name} must be of type {types}, got {value!r} ({type(value).__name__})"
    if isinstance(exc, ValueError) and isinstance(accepted, (tuple, list, set, frozenset, dict)):  # in_
        return f"{name} must be one of {', '.join(map(repr, accepted))}, got {value!r}"
    return str(args[0])


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


# -- sparse policies ------------------------------------------------------------------------------------


@attrs.define(frozen=True, eq=False)
class ResolvedPolicy:
    """A policy selection resolved to its class and checked config."""

    selection: Selection
    cls: type
    config: Any

    def supports(self, phase: str) -> bool:
        return bool(getattr(self.cls, f"supports_{phase}", True))


@attrs.define(frozen=True)
class PolicyPlan:
    """Which policy runs each phase. The same :class:`ResolvedPolicy` in both means one instance."""

    prefill: ResolvedPolicy
    decode: ResolvedPolicy

    def __str__(self) -> str:
        if self.prefill is self.decode:
            return str(self.prefill.selection)
        return f"prefill={self.prefill.selection};decode={self.decode.selection}"


def _load_named(sel: Selection, table: dict, kind: str, plugins: PluginSet) -> tuple[type, Any]:
    """The class a plugin registered under ``sel.name`` in ``table``, and its config built from the
    options; errors name the problem and the fix."""
    if sel.name not in table:
        raise _unknown_name(sel.name, list(table), kind, plugins)
    info = table[sel.name]
    label = f"{kind} {sel.name!r}"
    config = make_config(info.config, sel.options, label, info.dist)
    return load_registered(info.target, info.dist, label, policy=True), config


def resolve_sparse_policy(spec: str | dict | Selection, plugins: PluginSet | None = None) -> ResolvedPolicy:
    """Resolve one policy selection; errors name the problem and the fix."""
    plugins = plugins or get_plugins()
    sel = parse_selection(spec, "sparse_policy")
    cls, config = _load_named(sel, plugins.registry.sparse_policies, "sparse policy", plugins)
    return ResolvedPolicy(sel, cls, config)


def _policy_parts(spec: str | dict | Selection) -> list[tuple[str | None, str | dict | Selection]]:
    """``(phase or None, one policy's selection)`` for each policy a ``sparse_policy=`` value names."""
    if isinstance(spec, dict) and "name" not in {str(k).lower() for k in spec}:
        phases = {str(k).lower(): v for k, v in spec.items()}
        unknown = [k for k in phases if k not in PHASES]
        if unknown or not phases:
            raise SelectionError(
                f"sparse_policy={spec!r}: a dict selection has a 'name' key, or the keys 'prefill' and/or "
                "'decode', e.g. {'prefill': 'xattn', 'decode': 'quest:token_budget=2048'}"
            )
        return list(phases.items())
    if not isinstance(spec, str):
        return [(None, spec)]
    parts = []
    for part in _split_outside_quotes(spec, ";"):
        head, colon, rest = part.partition(":")
        phase, eq, name = head.partition("=")
        if eq:
            phase = phase.strip().lower()
            if phase not in PHASES:
                raise SelectionError(
                    f"sparse_policy={spec!r}: {phase!r} is not a phase; "
                    "write e.g. 'prefill=xattn;decode=quest'"
                )
            parts.append((phase, name + colon + rest))
        else:
            parts.append((None, part))
    return parts


def resolve_policies(spec: str | dict | Selection, plugins: PluginSet | None = None) -> PolicyPlan:
    """Resolve ``sparse_policy=`` into the policy of each phase (``full`` where none is selected)."""
    plugins = plugins or get_plugins()
    assigned: dict[str, ResolvedPolicy] = {}
    for phase, part in _policy_parts(spec):
        policy = resolve_sparse_policy(part, plugins)
        name = policy.selection.name
        if phase is not None and not policy.supports(phase):
            raise SelectionError(
                f"sparse_policy={spec!r}: {name!r} cannot run the {phase} phase (supports_{phase}=False); "
                f"select it for the other phase or choose another policy"
            )
        phases = [phase] if phase is not None else [p for p in PHASES if policy.supports(p)]
        if not phases:
            raise SelectionError(f"sparse policy {name!r} supports neither prefill nor decode; it cannot run")
        for p in phases:
            if p in assigned:
                other = assigned[p].selection.name
                raise SelectionError(
                    f"sparse_policy={spec!r}: both {other!r} and {name!r} would run the {p} phase; "
                    "select one "
                    f"policy per phase, e.g. 'prefill={other};decode={name}'"
                )
            assigned[p] = policy
    if len(assigned) < len(PHASES):
        full = resolve_sparse_policy("full", plugins)
        for p in PHASES:
            assigned.setdefault(p, full)
    return PolicyPlan(assigned["prefill"], assigned["decode"])


# -- observers --------------------------------------------------------------------------------------------


def resolve_observer(spec: object, plugins: PluginSet | None = None) -> object:
    """An observer instance: given as an object, or a registered observer's selection (``"name"``,
    ``"name:key=value"``, a dict), built with its checked config."""
    if not isinstance(spec, (str, dict, Selection)):
        problems = contract_problems(spec)
        if problems:
            raise PluginError(f"observer {type(spec).__qualname__} ({type(spec).__module__}): "
                              f"{'; '.join(problems)}; rename the method's arguments (nanovllm.sparse)")
        return spec
    plugins = plugins or get_plugins()
    sel = parse_selection(spec, "observers")
    cls, config = _load_named(sel, plugins.registry.observers, "observer", plugins)
    return cls(config) if config is not None else cls()


# -- attention backends ---------------------------------------------------------------------------------


@attrs.define(frozen=True)
class BackendChoice:
    """An attention-backend selection: a registered backend and its config, or ``auto`` (``info`` None),
    which the model runner settles once it knows the device, dtype and head size."""

    info: AttentionBackendInfo | None
    config: Any = None

    def load(self) -> type:
        return load_registered(self.info.target, self.info.dist, f"attention backend {self.info.name!r}")


def resolve_attention_backend(
    spec: str | dict | Selection, plugins: PluginSet | None = None
) -> BackendChoice:
    plugins = plugins or get_plugins()
    sel = parse_selection(spec, "attention_backend")
    if sel.name == "auto":
        if sel.options:
            raise SelectionError(
                f"attention_backend='auto' takes no options, got: {', '.join(sel.options)}; "
                "name the backend to pass it options, e.g. attention_backend='torch'"
            )
        return BackendChoice(None)
    table = plugins.registry.attention_backends
    if sel.name not in table:
        raise _unknown_name(sel.name, list(table), "attention backend", plugins)
    info = table[sel.name]
    label = f"attention backend {sel.name!r}"
    if info.unavailable is not None:
        raise PluginError(
            f"{label} (distribution {info.dist}) is unavailable on this machine: {info.unavailable}"
        )
    return BackendChoice(info, make_config(info.config, sel.options, label, info.dist))
