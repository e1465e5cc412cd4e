"""Plugin discovery: entry points in group ``nanovllm``, loaded in a deterministic order, each in isolation.

The process-wide :class:`PluginSet` (``get_plugins()``) is the one piece of global state the core
keeps besides the per-step forward context; it is built once, idempotently, in every process that
needs it. Nothing here imports torch: targets are ``"module:Name"`` strings resolved on selection, or
all at once by :meth:`PluginSet.check` (``nanovllm plugins --check``).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
import traceback
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from nanovllm.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, RegistrationSpec, argument_problems
from nanovllm.sparse import check_api_version, contract_problems

ALLOW_ENV = "NANOVLLM_PLUGINS"
REGISTRATION_HOOKS = tuple(n for n in vars(RegistrationSpec) if n.startswith("register_"))
CORE_DIST = "nanovllm"


class PluginError(RuntimeError):
    """A plugin could not be loaded, is ambiguous, or is not installed."""


def load_target(target: str) -> Any:
    """Import ``"package.module:Name"`` and return the named object."""
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def load_registered(target: str, dist: str, what: str, policy: bool = False) -> Any:
    """:func:`load_target` for an entry a plugin registered; a bad target is a one-line error naming the
    distribution, the entry and the target. With ``policy`` (a policy or observer), a method of the loaded
    class named like a per-layer method or notification hook whose argument names the contract does not
    pass is an error too, naming the method (:func:`nanovllm.sparse.contract_problems`)."""
    try:
        obj = load_target(target)
    except (ImportError, AttributeError) as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise PluginError(
            f"{what} registered by distribution {dist!r} points at {target!r}, which cannot be loaded "
            f"({reason}); fix the target in its registration hook, or reinstall {dist}"
        ) from exc
    problems = contract_problems(obj) if policy else []
    if problems:
        raise PluginError(
            f"{what} registered by distribution {dist!r} ({target}): {'; '.join(problems)}; rename the "
            "method's arguments (nanovllm.sparse)"
        )
    return obj


@attrs.define(frozen=True)
class ModelFamily:
    architecture: str
    target: str
    dist: str


@attrs.define(frozen=True)
class AttentionBackendInfo:
    name: str
    target: str
    dist: str
    devices: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    head_sizes: tuple[int, ...] | None = None
    config: str | None = None
    # why the backend cannot run on this machine at all (a missing wheel, no suitable GPU), with the fix
    unavailable: str | None = None
    # the ``kv_cache_dtype`` options its kernels read and write ("auto": the model's dtype)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def supports(self, device: str, dtype: str, head_size: int, kv_cache_dtype: str = "auto") -> str | None:
        """``None`` when the backend supports the combination, else the reason it does not."""
        if self.unavailable is not None:
            return f"unavailable on this machine: {self.unavailable}"
        for what, value, allowed in (
            ("device", device, self.devices),
            ("dtype", dtype, self.dtypes),
            ("head size", head_size, self.head_sizes),
            ("kv_cache_dtype", kv_cache_dtype, self.kv_cache_dtypes),
        ):
            if allowed is not None and value not in allowed:
                return f"{what} {value} is not among {', '.join(map(str, allowed))}"
        return None


@attrs.define(frozen=True)
class SparsePolicyInfo:
    name: str
    target: str
    dist: str
    config: str | None = None


@attrs.define(frozen=True)
class ObserverInfo(SparsePolicyInfo):
    """A registered observer of the runtime hooks: the same fields as a policy's."""


@attrs.define
class PluginInfo:
    """One entry point of group ``nanovllm``: what it registered, or why it failed to load."""

    name: str
    dist: str
    version: str
    value: str
    registered: list[str] = attrs.Factory(list)
    error: str | None = None
    exception: BaseException | None = attrs.field(default=None, repr=False)
    # after PluginSet.check(): registered entry -> why its target or config cannot be loaded
    problems: dict[str, str] | None = None

    @property
    def warning(self) -> str | None:
        """What looks wrong with a plugin that loaded: it registered nothing."""
        if self.error is None and not self.registered:
            return ("registers nothing: its register_* hooks added no names, or none is marked @hookimpl "
                    "(from nanovllm.hookspecs import hookimpl)")
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.dist,
            "version": self.version,
            "module": self.value,
            "registers": list(self.registered),
            "error": self.error,
            "warning": self.warning,
            "problems": self.problems,
        }


class Registry:
    """What the registration hooks fill in. One per :class:`PluginSet`."""

    def __init__(self) -> None:
        self.model_families: dict[str, ModelFamily] = {}
        self.attention_backends: dict[str, AttentionBackendInfo] = {}
        self.sparse_policies: dict[str, SparsePolicyInfo] = {}
        self.observers: dict[str, ObserverInfo] = {}
        self._dist = CORE_DIST
        self._added: list[tuple[dict, str]] = []

    def add_model_family(self, architecture: str, target: str) -> None:
        self._add(self.model_families, architecture, ModelFamily(architecture, target, self._dist), "model")

    def add_attention_backend(
        self,
        name: str,
        target: str,
        *,
        devices: Iterable[str] | None = None,
        dtypes: Iterable[str] | None = None,
        head_sizes: Iterable[int] | None = None,
        config: str | None = None,
        unavailable: str | None = None,
        kv_cache_dtypes: Iterable[str] = ("auto",),
    ) -> None:
        """``unavailable``: why the backend cannot run on this machine, naming the fix; it is still listed
        (``nanovllm plugins`` shows the reason), ``auto`` passes it over and selecting it raises the reason.
        ``kv_cache_dtypes``: the ``kv_cache_dtype`` options it reads and writes (default: the model's dtype
        only). Find it without importing heavy modules: listing plugins imports no torch."""
        info = AttentionBackendInfo(
            name.lower(),
            target,
            self._dist,
            tuple(devices) if devices is not None else None,
            tuple(dtypes) if dtypes is not None else None,
            tuple(head_sizes) if head_sizes is not None else None,
            config,
            unavailable,
            tuple(kv_cache_dtypes),
        )
        self._add(self.attention_backends, name.lower(), info, "attention backend")

    def add_observer(
        self, name: str, target: str, *, config: str | None = None, api_version: str | None = None
    ) -> None:
        """``api_version``: the policy API (``nanovllm.sparse.API_VERSION``) the observer is written for;
        an incompatible one fails this plugin's registration, naming the fix. ``None``: not checked."""
        self._check_api_version(api_version, f"observer {name.lower()!r}")
        info = ObserverInfo(name.lower(), target, self._dist, config)
        self._add(self.observers, name.lower(), info, "observer")

    def add_sparse_policy(
        self, name: str, target: str, *, config: str | None = None, api_version: str | None = None
    ) -> None:
        """``api_version``: as for :meth:`add_observer`."""
        self._check_api_version(api_version, f"sparse policy {name.lower()!r}")
        info = SparsePolicyInfo(name.lower(), target, self._dist, config)
        self._add(self.sparse_policies, name.lower(), info, "sparse policy")

    def _check_api_version(self, api_version: str | None, what: str) -> None:
        if api_version is not None:
            check_api_version(api_version, f"{what} of distribution {self._dist!r}")

    def _add(self, table: dict, key: str, entry: Any, kind: str) -> None:
        if key in table:
            raise PluginError(
                f"{kind} {key!r} is registered twice: by distribution {table[key].dist!r} and by "
                f"{entry.dist!r}; uninstall one of them (pip uninstall ...)"
            )
        table[key] = entry
        self._added.append((table, key))

    def _begin(self, dist: str) -> None:
        self._dist, self._added = dist, []

    def _rollback(self) -> None:
        for table, key in self._added:
            table.pop(key, None)
        self._added = []

    def _added_names(self) -> list[str]:
        kinds = {
            id(self.model_families): "model",
            id(self.attention_backends): "attention_backend",
            id(self.sparse_policies): "sparse_policy",
            id(self.observers): "observer",
        }
        return [f"{kinds[id(table)]}:{key}" for table, key in self._added]


@attrs.define
class PluginSet:
    """The loaded plugins of this process and what they registered."""

    registry: Registry
    plugins: list[PluginInfo]
    manager: pluggy.PluginManager

    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error is not None]

    def register(self, plugin: object, name: str) -> PluginInfo:
        """Register a plugin from inside this process (a module or object with ``@hookimpl`` registration
        hooks), as if an entry point named it; for tests and notebooks. ``reload_plugins()`` forgets it."""
        info = PluginInfo(name, name, "(in process)", repr(plugin))
        self.plugins.append(info)
        _register(self.manager, self.registry, plugin, info)
        if info.error is not None:
            raise PluginError(f"in-process plugin {name!r} failed to register: {info.error}") from info.exception
        return info

    def check(self) -> bool:
        """Load every registered target and config as selecting it would (this imports the plugins' code,
        torch included), and check the hook argument names of policies and observers. Fills each loaded
        plugin's ``problems``; True when every plugin loaded and has none."""
        registry = self.registry
        tables = {"model": registry.model_families, "attention_backend": registry.attention_backends,
                  "sparse_policy": registry.sparse_policies, "observer": registry.observers}
        for plugin in self.plugins:
            if plugin.error is not None:
                continue
            plugin.problems = {}
            for name in plugin.registered:
                kind, _, key = name.partition(":")
                entry = tables[kind][key]
                what = f"{kind.replace('_', ' ')} {key!r}"
                try:
                    load_registered(entry.target, plugin.dist, what, kind in ("sparse_policy", "observer"))
                    if getattr(entry, "config", None) is not None:
                        load_registered(entry.config, plugin.dist, f"the config of {what}")
                except PluginError as exc:
                    plugin.problems[name] = str(exc)
                except Exception as exc:  # a module that fails to import in another way
                    plugin.problems[name] = f"importing it raised {type(exc).__name__}: {exc}"
        return not any(p.error or p.problems for p in self.plugins)

    def failure_for(self, name: str) -> PluginInfo | None:
        """A plugin that failed to load and would have provided ``name`` (matched by entry point or dist)."""
        name = name.lower()
        for p in self.failed():
            if name in (p.name.lower(), p.dist.lower(), p.dist.lower().removeprefix("nanovllm-")):
                return p
        return None


def _register(manager: pluggy.PluginManager, registry: Registry, module: object, info: PluginInfo) -> None:
    """Run the registration hooks of one plugin; a failure is recorded on ``info`` and rolled back."""
    problems = argument_problems(module, RegistrationSpec, marked_only=True)
    if problems:
        info.error = f"{'; '.join(problems)} (nanovllm.hookspecs.RegistrationSpec)"
        info.exception = PluginError(f"distribution {info.dist!r}: {info.error}")
        return
    try:
        manager.register(module, name=f"{info.dist}:{info.name}")
    except Exception as exc:
        info.error = "".join(traceback.format_exception_only(exc)).strip()
        info.exception = exc
        return
    registry._begin(info.dist)
    try:
        for hook_name in REGISTRATION_HOOKS:
            for impl in getattr(manager.hook, hook_name).get_hookimpls():
                if impl.plugin is module:
                    impl.function(registry=registry)
    except PluginError:
        raise
    except Exception as exc:
        registry._rollback()
        info.error = "".join(traceback.format_exception_only(exc)).strip()
        info.exception = exc
        return
    info.registered = registry._added_names()


def _entry_points() -> list[md.EntryPoint]:
    eps = list(md.entry_points(group=ENTRY_POINT_GROUP))

    def key(ep: md.EntryPoint) -> tuple:
        dist = ep.dist.name if ep.dist is not None else ""
        return (dist != CORE_DIST, dist.lower(), ep.name)

    unique: dict[tuple, md.EntryPoint] = {}
    for ep in sorted(eps, key=key):  # an editable install can list a distribution twice
        unique.setdefault(key(ep) + (ep.value,), ep)
    return list(unique.values())


def _allowed(env_value: str | None) -> set[str] | None:
    if env_value is None or not env_value.strip():
        return None
    return {part.strip().lower() for part in env_value.split(",") if part.strip()}


def discover(allow: str | None = None) -> PluginSet:
    """Load every ``nanovllm`` entry point (or the allow-listed ones) and run its registration hooks.

    ``allow`` (default: the ``NANOVLLM_PLUGINS`` environment variable) is a comma-separated list of
    entry-point or distribution names; the core's built-in defaults always load.
    """
    allowed = _allowed(os.environ.get(ALLOW_ENV) if allow is None else allow)
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(RegistrationSpec)
    registry = Registry()
    plugins: list[PluginInfo] = []

    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        if allowed is not None and dist != CORE_DIST and not allowed & {ep.name.lower(), dist.lower()}:
            continue
        info = PluginInfo(ep.name, dist, version, ep.value)
        plugins.append(info)
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            info.error = "".join(traceback.format_exception_only(exc)).strip()
            info.exception = exc
            continue
        _register(manager, registry, module, info)
    return PluginSet(registry, plugins, manager)


_plugins: PluginSet | None = None
_lock = threading.Lock()


def get_plugins() -> PluginSet:
    """The process-wide plugin set, discovered on first use."""
    global _plugins
    with _lock:
        if _plugins is None:
            _plugins = discover()
        return _plugins


def reload_plugins(allow: str | None = None) -> PluginSet:
    """Discover again (after installing a plugin, or with another allow-list)."""
    global _plugins
    with _lock:
        _plugins = discover(allow)
        return _plugins
