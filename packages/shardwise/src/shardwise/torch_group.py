"""A :class:`~shardwise.Group` over a ``torch.distributed`` process group (public face of the comm layer).
"""

from __future__ import annotations

from shardwise._comm.torch_group import (
    TorchGroup,
    init_torch_process_group,
    wrap_process_group,
)

__all__ = [
    "TorchGroup",
    "init_torch_process_group",
    "wrap_process_group",
]
