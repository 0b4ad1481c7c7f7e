"""Autograd-aware collectives over any shardwise :class:`~shardwise.Group`, with
``torch.distributed.nn.functional``'s signatures (public face of the comm layer).
"""

from __future__ import annotations

from shardwise._comm.autograd import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    reduce_scatter,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
]
