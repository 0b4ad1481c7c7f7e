"""Distributed checkpoints over any shardwise Group, written atomically (public face of the modules layer).

See :mod:`shardwise._modules.checkpoint` for the format and guarantees.
"""

from __future__ import annotations

from shardwise._modules.checkpoint import (
    load,
    load_optimizer,
    optimizer_state,
    save,
)

__all__ = [
    "load",
    "load_optimizer",
    "optimizer_state",
    "save",
]
