"""Selection strings for ``sparse_policy=`` and ``attention_backend=``.

Grammar: ``name`` or ``name:key=value,key=value``; values are JSON scalars (``8``, ``0.9``, ``true``,
``null``, ``"a,b"``) or else plain strings. A dict ``{"name": "quest", "topk": 8}`` works in Python.
Names are case-insensitive; keys are checked against the plugin's attrs config class.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import attrs

from nanovllm.plugins import PluginError, PluginSet, get_plugins, load_target


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


def _split_options(body: str) -> list[str]:
    """Split on commas outside double quotes."""
    parts, current, quoted = [], [], False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
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
        options = dict(spec)
        name = options.pop("name", None)
        if not isinstance(name, str) or not name.strip():
            raise SelectionError(f"{what}={spec!r}: a dict selection needs a 'name' key, e.g. {{'name': 'full'}}")
        return Selection(name.strip().lower(), options)
    if not isinstance(spec, str):
        raise SelectionError(f"{what} must be a string like 'name:key=value' or a dict, not {type(spec).__name__}")
    name, sep, body = spec.strip().partition(":")
    name = name.strip().lower()
    example = f"{what}='quest:topk=8'"
    if not name:
        raise SelectionError(f"{what}={spec!r} has no name before ':'; write e.g. {example}")
    options: dict[str, Any] = {}
    if sep:
        if not body.strip():
            raise SelectionError(f"{what}={spec!r} has ':' but no options after it; write e.g. {example}")
        for item in _split_options(body):
            key, eq, value = item.partition("=")
            key = key.strip()
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
    close = difflib.get_close_matches(name, installed, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return PluginError(
        f"unknown {kind} {name!r}. Installed: {', '.join(sorted(installed)) or 'none'}.{hint} "
        f"If it is a plugin, install the distribution that provides it: pip install nanovllm-{name}"
    )


def make_config(config_target: str | type | None, options: dict[str, Any], label: str) -> Any:
    """Build the attrs config of a plugin from selection options, checking every key."""
    if config_target is None:
        if options:
            raise SelectionError(f"{label} takes no options, got: {', '.join(options)}")
        return None
    config_cls = load_target(config_target) if isinstance(config_target, str) else config_target
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
        raise SelectionError(f"{label}: invalid option value: {exc}") from exc


def resolve_sparse_policy(spec: str | dict | Selection, plugins: PluginSet | None = None):
    """Return ``(policy_class, config)`` for a selection; errors name the problem and the fix."""
    plugins = plugins or get_plugins()
    sel = parse_selection(spec, "sparse_policy")
    table = plugins.registry.sparse_policies
    if sel.name not in table:
        raise _unknown_name(sel.name, list(table), "sparse policy", plugins)
    info = table[sel.name]
    config = make_config(info.config, sel.options, f"sparse policy {sel.name!r}")
    return load_target(info.target), config


def resolve_attention_backend(spec: str | dict | Selection, plugins: PluginSet | None = None):
    """Return ``(info, config)`` for an attention-backend selection (``auto`` is resolved by the runner)."""
    plugins = plugins or get_plugins()
    sel = parse_selection(spec, "attention_backend")
    table = plugins.registry.attention_backends
    if sel.name not in table:
        raise _unknown_name(sel.name, list(table), "attention backend", plugins)
    info = table[sel.name]
    return info, make_config(info.config, sel.options, f"attention backend {sel.name!r}")
