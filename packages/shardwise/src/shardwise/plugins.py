"""Typed accessors over the installed plugins (public face of the registry layer).

Usage::

    from shardwise import plugins
    [b.name for b in plugins.list_backends()]

The plugin manager is built on the first call (not at import) from the
core's built-in plugins and the ``shardwise`` entry-point group.
"""

from __future__ import annotations

from shardwise._registry.access import (
    DEFAULT_PLUGINS,
    ENTRY_POINT_GROUP,
    PluginInfo,
    availability,
    find_op,
    find_op_or_none,
    get_backend,
    get_plugin_manager,
    list_backends,
    list_cli_commands,
    list_launchers,
    list_plugins,
    list_sharded_ops,
    plugin_for_backend,
    register,
    reset,
    unregister,
)

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
    "plugin_for_backend",
    "register",
    "reset",
    "unregister",
]
