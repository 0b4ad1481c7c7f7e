"""``Sharder``, at torch 2.13's path ``sharder`` (public face of the modules layer).
"""

from __future__ import annotations

from shardwise._modules.sharder import (
    Sharder,
)

__all__ = [
    "Sharder",
]
