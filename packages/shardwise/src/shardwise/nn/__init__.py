"""Autograd-aware building blocks for sharded modules.

:mod:`shardwise._comm.autograd` holds the differentiable collectives.
"""

from __future__ import annotations

from shardwise._comm import autograd as functional

__all__ = ["functional"]
