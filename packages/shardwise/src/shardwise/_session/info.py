"""``shardwise info``: what is installed, what can run here, which ops exist."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any, Optional, Sequence

import torch

from shardwise._registry import access as plugins
from shardwise._registry.records import qualified_name
from shardwise._vocab.version import __version__
from shardwise.errors import ShardwiseError

__all__ = ["collect", "main", "render"]


def collect() -> dict[str, Any]:
    """Everything ``shardwise info`` shows, as JSON-safe data."""
    registry_plugins = plugins.list_plugins()
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
            for p in registry_plugins
        ],
        "backends": backends,
        "launchers": [
            {"name": launcher.name, "priority": launcher.priority, "description": launcher.description}
            for launcher in plugins.list_launchers()
        ],
        "sharded_ops": [
            {"op": op.op_name, "spec": qualified_name(op.spec), "description": op.description}
            for op in plugins.list_sharded_ops()
        ],
    }


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render(info: dict[str, Any]) -> str:
    """Plain-text form of :func:`collect`'s result."""
    lines = [f"shardwise {info['shardwise']} (torch {info['torch']}, python {info['python']})", "", "Plugins:"]
    rows: list[tuple[str, ...]] = [("name", "distribution", "version", "module")]
    rows += [(p["name"], p["distribution"] or "-", p["version"] or "-", p["module"]) for p in info["plugins"]]
    lines += _table(rows)
    lines += ["", "Backends:"]
    if info["backends"]:
        rows = [("name", "status", "devices", "distribution", "why")]
        for b in info["backends"]:
            rows.append(
                (
                    b["name"],
                    "available" if b["available"] else "unavailable",
                    ",".join(b["devices"]),
                    b["distribution"] or "-",
                    b["reason"] if not b["available"] else b["description"],
                )
            )
        lines += _table(rows)
    else:
        lines.append("  (none installed: `pip install shardwise-gloo`)")
    lines += ["", "Launchers (tried in this order):"]
    lines += _table([(entry["name"], entry["description"]) for entry in info["launchers"]])
    lines += ["", "Sharded ops:"]
    if info["sharded_ops"]:
        lines += _table([("op", "spec")] + [(o["op"], o["spec"]) for o in info["sharded_ops"]])
    else:
        lines.append("  (none registered)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``shardwise`` console script and ``python -m shardwise``."""
    parser = argparse.ArgumentParser(prog="shardwise", description="shardwise command line")
    sub = parser.add_subparsers(dest="command")
    info_parser = sub.add_parser("info", help="list plugins, backends, launchers and sharded ops")
    info_parser.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
    if args.command is None:
        args.command, args.json = "info", False
    try:
        info = collect()
    except ShardwiseError as exc:
        print(f"shardwise: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0
