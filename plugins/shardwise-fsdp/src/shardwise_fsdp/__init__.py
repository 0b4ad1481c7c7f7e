"""shardwise-fsdp: shardwise tensors meet torch's DTensor.

:func:`to_dtensor` and :func:`from_dtensor` convert between a
:class:`~shardwise.ShardedTensor` and a ``torch.distributed.tensor.DTensor``
without copying the local data (see ``shardwise_fsdp._dtensor``).
"""

from __future__ import annotations

from shardwise_fsdp._dtensor import from_dtensor, to_dtensor

__all__ = ["from_dtensor", "to_dtensor"]
