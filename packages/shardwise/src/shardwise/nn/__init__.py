"""Autograd-aware building blocks for sharded modules.

:mod:`shardwise.nn.functional` holds the differentiable collectives.
"""

from __future__ import annotations

from shardwise.nn import functional

__all__ = ["functional"]
