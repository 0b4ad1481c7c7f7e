"""The plugin manager and the tables built from its hooks.

Nothing here runs at import time. The first accessor call builds the plugin
manager (:func:`create_plugin_manager`), asks every plugin for its records
once, validates and sorts them, and caches the tables until :func:`reset`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, TypeVar

import pluggy

from shardwise import hookspecs
from shardwise._registry.records import Backend, CliCommand, Launcher, ShardedOp, qualified_name
from shardwise._vocab.logs import configure_logging
from shardwise.errors import BackendNotFoundError, OpNotFoundError, PluginError

ENTRY_POINT_GROUP = "shardwise"
AUTOLOAD_ENV = "SHARDWISE_DISABLE_PLUGIN_AUTOLOAD"
BLOCKED_ENV = "SHARDWISE_BLOCKED_PLUGINS"
PLUGINS_ENV = "SHARDWISE_PLUGINS"

#: The core's own plugins, registered through the same hooks as any other
#: plugin (and blockable by the same names).
#: They are named by module and imported by name when the plugin manager is built
#: (as entry points are), so this layer does not import the layers that hold them.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "shardwise._session.launchers",
    "shardwise._tensor.core_ops",
    "shardwise._tensor.custom_ops",
)

#: Which distribution to install for names users commonly ask for.
KNOWN_BACKEND_DISTRIBUTIONS: Mapping[str, str] = {
    "gloo": "shardwise-gloo",
    "nccl": "shardwise-nccl",
    "mpi": "shardwise-mpi[mpich]",
}
#: Which distribution provides the sharded implementation of a torch function the core lacks (by
#: qualified name): the install hint of OpNotFoundError. The one list of it: each plugin's tests check
#: that the plugin registers exactly the ops attributed to it here
#: (plugins/shardwise-embedding/tests/test_install_hints.py).
KNOWN_OP_DISTRIBUTIONS: Mapping[str, str] = {
    "torch.nn.functional.embedding": "shardwise-embedding",
    "torch.nn.functional.embedding_bag": "shardwise-embedding",
    "torch.nn.functional.log_softmax": "shardwise-embedding",
    "torch.nn.functional.softmax": "shardwise-embedding",
}

#: Which distribution provides a ``shardwise`` command the core lacks: the hint of an unknown command.
KNOWN_COMMAND_DISTRIBUTIONS: Mapping[str, str] = {"plan": "shardwise-embedding"}

#: What a plugin's command may be called: a word that cannot be mistaken for an option.
_COMMAND_NAME = re.compile(r"[a-z][a-z0-9_-]*")

_T = TypeVar("_T")

_log = logging.getLogger("shardwise.plugins")


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, as listed by ``shardwise info``.

    Attributes:
        name: Plugin name (the entry-point name, or the module name for the
            core's defaults and ``SHARDWISE_PLUGINS``).
        distribution: The pip distribution it came from, or ``""``.
        version: That distribution's version, or ``""``.
        module: Module (or object) the hooks live in.
    """

    name: str
    distribution: str
    version: str
    module: str


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _split_names(value: Optional[str]) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


class Registry:
    """A plugin manager plus the validated tables of its records."""

    def __init__(self, pm: pluggy.PluginManager, blocked: Iterable[str] = ()) -> None:
        self.pm = pm
        self.blocked: tuple[str, ...] = tuple(sorted(set(blocked)))
        self.distributions: dict[str, tuple[str, str]] = {}
        self._lock = threading.RLock()
        self._backends: Optional[dict[str, tuple[Backend, str]]] = None
        self._ops: Optional[dict[Any, dict[tuple[type, bool], tuple[ShardedOp, str]]]] = None
        self._launchers: Optional[list[tuple[Launcher, str]]] = None
        self._commands: Optional[dict[str, CliCommand]] = None
        self._op_cache: dict[tuple[Any, type], ShardedOp] = {}

    # -- collection --------------------------------------------------------
    def _collect(self, hook_name: str, record_type: type[_T]) -> list[tuple[_T, str]]:
        out: list[tuple[_T, str]] = []
        caller = getattr(self.pm.hook, hook_name)
        # Each impl is called on its own so every record is attributed to
        # the plugin that yielded it (duplicate errors name both plugins).
        for impl in caller.get_hookimpls():
            try:
                produced = impl.function()
                records = list(produced) if produced is not None else []
            except Exception as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} failed in {hook_name}(): "
                    f"{type(exc).__name__}: {exc}. Block it with "
                    f"{BLOCKED_ENV}={impl.plugin_name} to continue without it."
                ) from exc
            for record in records:
                if not isinstance(record, record_type):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} yielded {record!r} from "
                        f"{hook_name}(); expected {record_type.__name__} records"
                    )
                out.append((record, impl.plugin_name))
        return out

    def invalidate(self) -> None:
        """Forget collected records (after a plugin is (un)registered)."""
        with self._lock:
            self._backends = None
            self._ops = None
            self._launchers = None
            self._commands = None
            self._op_cache = {}

    @property
    def backends(self) -> dict[str, tuple[Backend, str]]:
        with self._lock:
            if self._backends is None:
                table: dict[str, tuple[Backend, str]] = {}
                for record, plugin in self._collect("shardwise_backends", Backend):
                    if record.name in table:
                        raise PluginError(
                            f"backend {record.name!r} is provided by two plugins: "
                            f"{table[record.name][1]!r} and {plugin!r}. Uninstall one, "
                            f"or block one with {BLOCKED_ENV}=<plugin name>."
                        )
                    table[record.name] = (record, plugin)
                self._backends = dict(sorted(table.items()))
            return self._backends

    @property
    def ops(self) -> dict[Any, dict[tuple[type, bool], tuple[ShardedOp, str]]]:
        with self._lock:
            if self._ops is None:
                table: dict[Any, dict[tuple[type, bool], tuple[ShardedOp, str]]] = {}
                for record, plugin in self._collect("shardwise_sharded_ops", ShardedOp):
                    if not isinstance(record.spec, type):
                        raise PluginError(
                            f"plugin {plugin!r} registered {record.op_name} for "
                            f"spec {record.spec!r}; spec must be a class"
                        )
                    by_spec = table.setdefault(record.op, {})
                    key = (record.spec, record.override)
                    if key in by_spec:
                        kind = "override " if record.override else ""
                        raise PluginError(
                            f"{kind}op {record.op_name} for {record.spec.__name__} is "
                            f"implemented by two plugins: {by_spec[key][1]!r} "
                            f"and {plugin!r}. Block one with {BLOCKED_ENV}=<plugin name>."
                        )
                    by_spec[key] = (record, plugin)
                self._ops = table
            return self._ops

    @property
    def launchers(self) -> list[tuple[Launcher, str]]:
        with self._lock:
            if self._launchers is None:
                found = self._collect("shardwise_launchers", Launcher)
                seen: dict[str, str] = {}
                for record, plugin in found:
                    if record.name in seen:
                        raise PluginError(
                            f"launcher {record.name!r} is provided by two plugins: "
                            f"{seen[record.name]!r} and {plugin!r}"
                        )
                    seen[record.name] = plugin
                self._launchers = sorted(found, key=lambda rp: (-rp[0].priority, rp[0].name))
            return self._launchers

    @property
    def cli_commands(self) -> dict[str, CliCommand]:
        """The plugins' commands by name, each with ``plugin`` set to the plugin that declared it."""
        with self._lock:
            if self._commands is None:
                table: dict[str, CliCommand] = {}
                for record, plugin in self._collect("shardwise_cli_commands", CliCommand):
                    if not isinstance(record.name, str) or not _COMMAND_NAME.fullmatch(record.name):
                        raise PluginError(
                            f"plugin {plugin!r} declared the command {record.name!r}; a command is a lower-case "
                            "word of letters, digits, '-' and '_'"
                        )
                    if record.name in table:
                        raise PluginError(
                            f"command {record.name!r} is provided by two plugins: {table[record.name].plugin!r} "
                            f"and {plugin!r}. Uninstall one, or block one with {BLOCKED_ENV}=<plugin name>."
                        )
                    table[record.name] = dataclasses.replace(record, plugin=plugin)
                self._commands = dict(sorted(table.items()))
            return self._commands

    # -- lookups -----------------------------------------------------------
    def get_backend(self, name: str) -> Backend:
        table = self.backends
        if name in table:
            return table[name][0]
        installed = ", ".join(table) or "(none)"
        msg = f"backend {name!r} is not installed; installed: {installed}."
        if self.blocked:
            msg += f" Blocked plugins ({BLOCKED_ENV}): {', '.join(self.blocked)}."
        dist = KNOWN_BACKEND_DISTRIBUTIONS.get(name)
        if dist is not None:
            msg += f" `pip install {dist}`"
            if name in self.blocked:
                msg += f", or remove {name!r} from {BLOCKED_ENV}"
            msg += "."
        raise BackendNotFoundError(msg)

    def find_op(self, op: Any, spec: Any) -> Optional[ShardedOp]:
        spec_cls = spec if isinstance(spec, type) else type(spec)
        key = (op, spec_cls)
        cached = self._op_cache.get(key)
        if cached is not None:
            return cached
        by_spec = self.ops.get(op, {})
        # Overrides (user code taking an op over) beat plugin implementations
        # whatever their spec; within each kind the most specific spec wins.
        for override in (True, False):
            for klass in spec_cls.__mro__:
                found = by_spec.get((klass, override))
                if found is not None:
                    self._op_cache[key] = found[0]
                    return found[0]
        return None

    def op_not_found(self, op: Any, spec: Any) -> OpNotFoundError:
        spec_cls = spec if isinstance(spec, type) else type(spec)
        name = qualified_name(op)
        registered = sorted({s.__name__ for s, _ in self.ops.get(op, {})})
        msg = f"no sharded implementation of {name} for {spec_cls.__name__}"
        if registered:
            msg += f"; it is implemented for: {', '.join(registered)}"
        else:
            msg += "; no installed plugin implements it"
        dist = KNOWN_OP_DISTRIBUTIONS.get(name)
        if dist is not None:
            msg += f". `pip install {dist}`"
        # Ends in torch 2.13's wording, which code written for it matches on.
        short = getattr(op, "__name__", name.rsplit(".", 1)[-1])
        return OpNotFoundError(f"{msg}. torch function '{short}' not supported for ShardedTensor!")

    def plugin_infos(self) -> list[PluginInfo]:
        infos = []
        core_version = _distribution_version("shardwise")
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            module = getattr(plugin, "__name__", None) or qualified_name(type(plugin))
            dist, version = self.distributions.get(name, ("", ""))
            if not dist and module.split(".")[0] == "shardwise":
                dist, version = "shardwise", core_version
            infos.append(PluginInfo(name=name, distribution=dist, version=version, module=module))
        return sorted(infos, key=lambda info: info.name)


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _load_entry_points(registry: Registry) -> None:
    pm = registry.pm
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else ""
        dist_version = dist.version if dist is not None else ""
        if pm.is_blocked(ep.name):
            continue
        if pm.has_plugin(ep.name):
            other = registry.distributions.get(ep.name, ("another source", ""))[0]
            raise PluginError(
                f"two plugins are named {ep.name!r}: from {other} and from "
                f"{dist_name or ep.value}. Uninstall one of them."
            )
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({dist_name} {dist_version}, {ep.value}) failed to "
                f"import: {type(exc).__name__}: {exc}. Reinstall it, or set "
                f"{BLOCKED_ENV}={ep.name} to run without it."
            ) from exc
        if pm.is_registered(plugin):
            # Already loaded under its module name through SHARDWISE_PLUGINS.
            continue
        registry.distributions[ep.name] = (dist_name, dist_version)
        pm.register(plugin, name=ep.name)


def _register_module(pm: pluggy.PluginManager, module_name: str, source: str) -> None:
    if pm.is_blocked(module_name) or pm.has_plugin(module_name):
        return
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import plugin module {module_name!r} ({source}): {exc}") from exc
    pm.register(module, name=module_name)


def create_registry(environ: Optional[Mapping[str, str]] = None) -> Registry:
    """Build a fresh plugin manager and its registry.

    Args:
        environ: Environment to read ``SHARDWISE_*`` settings from;
            defaults to ``os.environ``.

    Returns:
        A :class:`Registry` whose plugin manager holds the core's
        :data:`DEFAULT_PLUGINS`, the modules named in ``SHARDWISE_PLUGINS``
        and (unless ``SHARDWISE_DISABLE_PLUGIN_AUTOLOAD`` is set) every
        ``shardwise`` entry point, minus ``SHARDWISE_BLOCKED_PLUGINS``.

    Raises:
        PluginError: a plugin fails to import, two plugins share a name, or
            a hook implementation does not match its specification.
    """
    env = os.environ if environ is None else environ
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = _split_names(env.get(BLOCKED_ENV))
    for name in blocked:
        pm.set_blocked(name)
    registry = Registry(pm, blocked)
    for module_name in DEFAULT_PLUGINS:
        _register_module(pm, module_name, "built in")
    for module_name in _split_names(env.get(PLUGINS_ENV)):
        _register_module(pm, module_name, PLUGINS_ENV)
    if not _truthy(env.get(AUTOLOAD_ENV)):
        _load_entry_points(registry)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements a hook shardwise does not define: {exc}") from exc
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s", _describe(registry, env))
    return registry


def _describe(registry: Registry, env: Mapping[str, str]) -> str:
    """One line naming the plugins ``registry`` loaded, and the settings that left others out."""
    names = []
    for info in registry.plugin_infos():
        source = " ".join(part for part in (info.distribution, info.version) if part)
        names.append(f"{info.name} ({source})" if source else info.name)
    loaded = ", ".join(names)
    line = f"plugin manager built: {loaded or 'no plugins'}"
    if registry.blocked:
        line += f"; blocked ({BLOCKED_ENV}): {', '.join(registry.blocked)}"
    if _truthy(env.get(AUTOLOAD_ENV)):
        line += f"; entry points not loaded ({AUTOLOAD_ENV})"
    return line


_current: Optional[Registry] = None
_current_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, built on first use.

    Building it is shardwise's first use in a process, so it also applies
    ``SHARDWISE_LOGS`` (:func:`~shardwise._vocab.logs.configure_logging`).

    Raises:
        ValueError: ``SHARDWISE_LOGS`` is malformed.
        PluginError: see :func:`create_registry`.
    """
    global _current
    registry = _current
    if registry is None:
        with _current_lock:
            if _current is None:
                configure_logging()
                _current = create_registry()
            registry = _current
    return registry


def reset(registry: Optional[Registry] = None) -> Optional[Registry]:
    """Replace the process-wide registry; the next lookup rebuilds it.

    Args:
        registry: Registry to install, or None to rebuild lazily from the
            environment on next use.

    Returns:
        The registry that was installed before, so tests can restore it.
    """
    global _current
    with _current_lock:
        previous, _current = _current, registry
    return previous

