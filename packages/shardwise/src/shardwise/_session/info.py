"""The ``shardwise`` command line: ``shardwise info``, ``shardwise --version`` and plugins' commands.

``shardwise info`` says what is installed, what can run here and which
sharded ops exist, grouped by the plugin that provides them. Its default
output fits a screen; ``--all`` lists every op with its spec and plugin, and
``--json`` gives everything as data. Plugins add commands through the
``shardwise_cli_commands`` hook (``shardwise plan`` comes from
shardwise-embedding); they are loaded only when the command line names a
command that is not built in, or prints the help. This is the one module of
the core that writes to stdout and stderr: it is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Optional, Sequence

import torch

from shardwise._comm import buffers
from shardwise._registry import access as plugins
from shardwise._registry.manager import BLOCKED_ENV, KNOWN_COMMAND_DISTRIBUTIONS
from shardwise._registry.records import CliCommand, qualified_name
from shardwise._vocab.version import __version__
from shardwise.errors import PluginError, ShardwiseError

__all__ = ["BUILTIN_COMMANDS", "collect", "is_internal", "main", "render", "version_line"]

#: The commands of the core itself; a plugin's command may not take one of these names.
BUILTIN_COMMANDS = ("info",)

#: The variable that sizes the freed-buffer cache (read by ``shardwise._comm.buffers.cache_limit``).
CACHE_ENV = "SHARDWISE_BUFFER_CACHE_MB"

#: The list of op names on a line of the default op summary is cut to this many characters. A fixed budget
#: (not the line's remaining width) keeps each plugin's lines the same whatever other plugins are installed.
NAMES_WIDTH = 64

_INTERNAL_NOTE = "dunder methods, attribute accessors, private names (--all lists them)"


def version_line() -> str:
    """``shardwise X (torch Y, python Z)``: what ``--version`` prints and ``info`` starts with."""
    return f"shardwise {__version__} (torch {torch.__version__}, python {platform.python_version()})"


def _buffer_cache() -> dict[str, Any]:
    try:
        limit: Optional[int] = buffers.cache_limit()
        error = ""
    except ValueError as exc:  # a malformed SHARDWISE_BUFFER_CACHE_MB: info reports it instead of failing
        limit, error = None, str(exc)
    return {"held_bytes": buffers.cached_bytes(), "limit_bytes": limit, "env": CACHE_ENV, "error": error}


def collect() -> dict[str, Any]:
    """Everything ``shardwise info`` shows, as JSON-safe data.

    Returns:
        A dict with the versions (``shardwise``, ``torch``, ``python``),
        ``plugins``, ``backends`` (with availability and the reason when
        unavailable), ``launchers``, ``buffer_cache`` (bytes held, limit,
        the variable that sets it) and ``sharded_ops`` (each op with its
        spec, description, providing ``plugin`` and ``override`` flag).

    Raises:
        PluginError: a plugin fails to load or two plugins register the same
            name, backend or op.
    """
    backends = []
    for backend in plugins.list_backends():
        availability = plugins.availability(backend)
        backends.append(
            {
                "name": backend.name,
                "available": availability.available,
                "reason": availability.reason,
                "devices": list(backend.devices),
                "distribution": backend.distribution,
                "plugin": plugins.plugin_for_backend(backend.name),
                "description": backend.description,
            }
        )
    return {
        "shardwise": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "module": p.module}
            for p in plugins.list_plugins()
        ],
        "backends": backends,
        "launchers": [
            {"name": launcher.name, "priority": launcher.priority, "description": launcher.description}
            for launcher in plugins.list_launchers()
        ],
        "buffer_cache": _buffer_cache(),
        "sharded_ops": [
            {
                "op": op.op_name,
                "spec": qualified_name(op.spec),
                "description": op.description,
                "plugin": plugin,
                "override": op.override,
            }
            for op, plugin in plugins.list_sharded_ops_with_plugins()
        ],
    }


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _mib(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n / (1 << 20):.1f} MiB"


def _cache_line(cache: dict[str, Any]) -> str:
    if cache["error"]:
        return f"Buffer cache: {cache['error']}"
    if not cache["limit_bytes"]:
        return f"Buffer cache: off ({cache['env']}=0)"
    return (
        f"Buffer cache: {_mib(cache['held_bytes'])} held, limit {_mib(cache['limit_bytes'])} "
        f"({cache['env']}; shardwise.empty_cache() frees it)"
    )


def is_internal(op_name: str) -> bool:
    """Whether an op is a torch internal, listed only by ``--all``.

    Dunder methods (``torch.Tensor.__reduce_ex__``), attribute accessors
    (``torch.Tensor.shape.__get__``) and private names
    (``torch._C._nn.gelu``): any dotted part starting with ``_``.
    """
    return any(part.startswith("_") for part in op_name.split("."))


def _fold_inplace(names: Sequence[str]) -> list[str]:
    """``add``, ``add_`` -> ``add(_)``: a method and its in-place twin read as one entry."""
    present = set(names)
    folded = []
    for name in sorted(present):
        if name.endswith("_") and name[:-1] in present:
            continue
        folded.append(f"{name}(_)" if f"{name}_" in present else name)
    return folded


def _cut(names: Sequence[str], width: int) -> str:
    """``names`` joined by ``, `` in at most ``width`` characters, ending in ``, ...`` when some do not fit."""
    text = ""
    for i, name in enumerate(names):
        candidate = f"{text}, {name}" if text else name
        more = i < len(names) - 1
        if len(candidate) + (5 if more else 0) > width:
            return f"{text}, ..." if text else "..."
        text = candidate
    return text


def _op_summary(info: dict[str, Any]) -> list[str]:
    """Per providing plugin: its op count, then its public ops by namespace."""
    by_plugin: dict[str, set[str]] = {}
    for op in info["sharded_ops"]:
        by_plugin.setdefault(op["plugin"], set()).add(op["op"])
    order = [p["name"] for p in info["plugins"]]
    order += sorted(set(by_plugin) - set(order))
    blocks: list[tuple[str, list[tuple[str, str, str]]]] = []
    for plugin in order:
        names = by_plugin.get(plugin)
        if not names:
            continue
        namespaces: dict[str, list[str]] = {}
        internal = 0
        for name in names:
            if is_internal(name):
                internal += 1
                continue
            namespace, _, short = name.rpartition(".")
            namespaces.setdefault(namespace or "(top level)", []).append(short)
        rows = [
            (ns, str(len(shorts)), _cut(_fold_inplace(shorts), NAMES_WIDTH))
            for ns, shorts in sorted(namespaces.items())
        ]
        if internal:
            rows.append(("internal", str(internal), _INTERNAL_NOTE))
        blocks.append((f"{plugin}: {len(names)} op{'' if len(names) == 1 else 's'}", rows))
    # One column layout for every plugin's rows, so the blocks line up.
    all_rows = [row for _, rows in blocks for row in rows]
    ns_width = max((len(ns) for ns, _, _ in all_rows), default=0)
    count_width = max((len(count) for _, count, _ in all_rows), default=0)
    lines = []
    for title, rows in blocks:
        lines.append(f"  {title}")
        for ns, count, text in rows:
            lines.append(f"    {ns.ljust(ns_width)}  {count.rjust(count_width)}  {text}")
    return lines


def render(info: dict[str, Any], all_ops: bool = False) -> str:
    """Plain-text form of :func:`collect`'s result.

    Args:
        info: What :func:`collect` returned.
        all_ops: List every op with its spec and providing plugin instead of
            the per-plugin summary (``shardwise info --all``).

    Returns:
        The text ``shardwise info`` prints, without a trailing newline.
    """
    lines = [f"shardwise {info['shardwise']} (torch {info['torch']}, python {info['python']})", "", "Plugins:"]
    rows: list[tuple[str, ...]] = [("name", "distribution", "version", "module")]
    rows += [(p["name"], p["distribution"] or "-", p["version"] or "-", p["module"]) for p in info["plugins"]]
    lines += _table(rows)
    lines += ["", "Backends:"]
    if info["backends"]:
        rows = [("name", "status", "devices", "plugin", "why")]
        for b in info["backends"]:
            rows.append(
                (
                    b["name"],
                    "available" if b["available"] else "unavailable",
                    ",".join(b["devices"]),
                    b["plugin"],
                    b["reason"] if not b["available"] else b["description"],
                )
            )
        lines += _table(rows)
    else:
        lines.append("  (none installed: `pip install shardwise-gloo`)")
    lines += ["", "Launchers (tried in this order):"]
    lines += _table([(entry["name"], entry["description"]) for entry in info["launchers"]])
    lines += ["", _cache_line(info["buffer_cache"]), ""]
    ops = info["sharded_ops"]
    if not ops:
        lines += ["Sharded ops:", "  (none registered)"]
    elif all_ops:
        lines.append(f"Sharded ops ({len(ops)} implementations):")
        table = [("op", "spec", "plugin")]
        table += [(o["op"], o["spec"], o["plugin"] + (" (override)" if o["override"] else "")) for o in ops]
        lines += _table(table)
    else:
        lines.append("Sharded ops by providing plugin (each op with its spec and plugin: shardwise info --all):")
        lines += _op_summary(info)
    return "\n".join(lines)


def _parser(commands: Sequence[CliCommand] = (), note: str = "") -> argparse.ArgumentParser:
    """The parser of the built-in commands, plus ``commands`` from plugins (``note``: why some are missing)."""
    epilog = "Run `shardwise info` to list plugins, backends, launchers and sharded ops."
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="shardwise command line: what is installed and what can run here.",
        epilog=f"{epilog} {note}" if note else epilog,
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info_parser = sub.add_parser(
        "info",
        help="list plugins, backends, launchers, the buffer cache and sharded ops",
        description="List plugins, backends (with availability), launchers, the freed-buffer cache "
        "and the sharded ops, grouped by the plugin that provides them.",
    )
    info_parser.add_argument("--all", action="store_true", help="list every op with its spec and providing plugin")
    info_parser.add_argument("--json", action="store_true", help="print everything as JSON (always every op)")
    for command in commands:
        if command.name in BUILTIN_COMMANDS:
            raise PluginError(
                f"plugin {command.plugin!r} declares the command {command.name!r}, a built-in command of shardwise; "
                f"block it with SHARDWISE_BLOCKED_PLUGINS={command.plugin}"
            )
        command_parser = sub.add_parser(
            command.name, help=f"{command.help} (plugin {command.plugin})", description=command.help
        )
        try:
            command.add_arguments(command_parser)
        except Exception as exc:  # a plugin's bug: name the plugin rather than show a traceback
            raise PluginError(
                f"plugin {command.plugin!r} failed to declare the arguments of command {command.name!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return parser


def _command_word(argv: Sequence[str]) -> Optional[str]:
    """The command ``argv`` names: its first word that is not an option (the top level's options take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``shardwise`` console script and ``python -m shardwise``.

    Plugins' commands are loaded only when ``argv`` names a command that is
    not built in, or asks for the help (``shardwise``, ``shardwise -h``):
    ``shardwise --version`` and ``shardwise info`` behave the same whatever
    the plugins' commands.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or what a plugin's command returned; with no command it prints
        the help.

    Raises:
        SystemExit: ``--help`` / ``--version`` (status 0), a bad argument or
            an unknown command (2), or a :class:`~shardwise.errors.ShardwiseError`
            such as a plugin that fails to load (1, with the error's message).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    word = _command_word(argv)
    commands: list[CliCommand] = []
    if word is not None and word not in BUILTIN_COMMANDS:
        try:
            commands = plugins.list_cli_commands()
            parser = _parser(commands)
        except ShardwiseError as exc:
            _parser().exit(1, f"shardwise: error: the plugins' commands cannot be loaded: {exc}\n")
        hint = KNOWN_COMMAND_DISTRIBUTIONS.get(word)
        if hint is not None and word not in {c.name for c in commands}:
            blocked = os.environ.get(BLOCKED_ENV, "").strip()
            unblock = f", or unblock its plugin ({BLOCKED_ENV}={blocked})" if blocked else ""
            parser.error(f"no installed plugin provides the command {word!r}: `pip install {hint}`{unblock}")
    elif word is None and (not argv or "-h" in argv or "--help" in argv):
        try:  # the help lists the plugins' commands; a plugin that fails to load must not hide the help
            commands = plugins.list_cli_commands()
            parser = _parser(commands)
        except ShardwiseError as exc:
            parser = _parser(note=f"(Plugin commands unavailable: {exc})")
    else:
        parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command != "info":
            return int(next(c for c in commands if c.name == args.command).run(args))
        info = collect()
    except ShardwiseError as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    sys.stdout.write((json.dumps(info, indent=2) if args.json else render(info, all_ops=args.all)) + "\n")
    return 0
