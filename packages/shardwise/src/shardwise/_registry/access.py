"""Typed accessors over the installed plugins.

Use these rather than the plugin manager's ``hook`` attribute::

    from shardwise._registry import access as plugins

    plugins.get_backend("gloo").is_available()
    plugins.find_op(torch.nn.functional.embedding, ChunkShardingSpec)

The plugin manager is built on the first call (not at import) from the
core's default plugins, ``SHARDWISE_PLUGINS`` and the ``shardwise``
entry-point group; see :func:`shardwise._registry.manager.create_registry`.
"""

from __future__ import annotations

from typing import Any, Optional

import pluggy

from shardwise._registry import manager as _registry
from shardwise._registry.manager import DEFAULT_PLUGINS, ENTRY_POINT_GROUP, PluginInfo
from shardwise._registry.records import Availability, Backend, CliCommand, Launcher, ShardedOp

__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "availability",
    "find_op",
    "find_op_or_none",
    "get_backend",
    "get_plugin_manager",
    "list_backends",
    "list_cli_commands",
    "list_launchers",
    "list_plugins",
    "list_sharded_ops",
    "list_sharded_ops_with_plugins",
    "plugin_for_backend",
    "register",
    "reset",
    "unregister",
]


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide pluggy manager (built on first use)."""
    return _registry.get_registry().pm


def reset() -> None:
    """Drop the plugin manager; the next call rebuilds it from the environment.

    Tests call this to start from a fresh manager; programs normally never
    need it.
    """
    _registry.reset()


def register(plugin: object, name: Optional[str] = None) -> str:
    """Register a plugin object or module programmatically.

    Args:
        plugin: A module or object with ``@hookimpl`` functions.
        name: Plugin name (defaults to pluggy's canonical name).

    Returns:
        The name it was registered under.

    Raises:
        ValueError: the name is already registered or is blocked.
    """
    registry = _registry.get_registry()
    registered = registry.pm.register(plugin, name=name)
    if registered is None:
        raise ValueError(f"plugin {name or plugin!r} is blocked and was not registered")
    registry.pm.check_pending()
    registry.invalidate()
    return registered


def unregister(name: str) -> None:
    """Unregister the plugin called ``name`` (no error if absent)."""
    registry = _registry.get_registry()
    if registry.pm.has_plugin(name):
        registry.pm.unregister(name=name)
    registry.invalidate()


def get_backend(name: str) -> Backend:
    """The backend called ``name``.

    Raises:
        BackendNotFoundError: no installed plugin provides it; the message
            lists installed backends and the distribution to install.
        PluginError: two plugins provide the same backend.
    """
    return _registry.get_registry().get_backend(name)


def list_backends() -> list[Backend]:
    """Every installed backend, sorted by name."""
    return [record for record, _ in _registry.get_registry().backends.values()]


def plugin_for_backend(name: str) -> str:
    """Name of the plugin that provides backend ``name``."""
    registry = _registry.get_registry()
    registry.get_backend(name)
    return registry.backends[name][1]


def availability(backend: Backend) -> Availability:
    """Call ``backend.is_available()``, turning a crash into a reason."""
    try:
        result = backend.is_available()
    except Exception as exc:  # a broken probe must not break `shardwise info`
        return Availability(False, f"availability check raised {type(exc).__name__}: {exc}")
    if isinstance(result, Availability):
        return result
    return Availability(True) if result else Availability(False, "is_available() returned False")


def find_op(op: Any, spec: Any) -> ShardedOp:
    """The implementation of ``op`` for tensors sharded with ``spec``.

    Args:
        op: The torch callable (``torch.nn.functional.embedding``).
        spec: A sharding-spec instance or class; the most specific
            registration along its MRO wins.

    Raises:
        OpNotFoundError: nothing implements it; the message lists the specs
            it is implemented for and which distribution provides it.
    """
    registry = _registry.get_registry()
    found = registry.find_op(op, spec)
    if found is None:
        raise registry.op_not_found(op, spec)
    return found


def find_op_or_none(op: Any, spec: Any) -> Optional[ShardedOp]:
    """Like :func:`find_op` but returns None when nothing implements it."""
    return _registry.get_registry().find_op(op, spec)


def list_sharded_ops() -> list[ShardedOp]:
    """Every registered sharded op, sorted by op name then spec name."""
    return [record for record, _ in list_sharded_ops_with_plugins()]


def list_sharded_ops_with_plugins() -> list[tuple[ShardedOp, str]]:
    """Every registered sharded op with the name of the plugin that provides it.

    Returns:
        ``(record, plugin name)`` pairs in :func:`list_sharded_ops`' order;
        the name is the one ``shardwise info`` lists and
        ``SHARDWISE_BLOCKED_PLUGINS`` takes.
    """
    pairs = [pair for by_spec in _registry.get_registry().ops.values() for pair in by_spec.values()]
    return sorted(pairs, key=lambda pair: (pair[0].op_name, pair[0].spec.__name__, pair[0].override))


def list_launchers() -> list[Launcher]:
    """Every known launcher, in the order ``shardwise.init`` tries them."""
    return [record for record, _ in _registry.get_registry().launchers]


def list_cli_commands() -> list[CliCommand]:
    """Every plugin's ``shardwise`` subcommand, sorted by name, each naming its plugin.

    Raises:
        PluginError: a plugin fails to load, declares a malformed name, or
            two plugins declare the same command.
    """
    return list(_registry.get_registry().cli_commands.values())


def list_plugins() -> list[PluginInfo]:
    """Every registered plugin with its distribution and version."""
    return _registry.get_registry().plugin_infos()
