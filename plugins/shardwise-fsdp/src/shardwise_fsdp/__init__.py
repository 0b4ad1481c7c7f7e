"""shardwise-fsdp: shardwise tensors meet torch's DTensor.

:func:`to_dtensor` and :func:`from_dtensor` convert between a
:class:`~shardwise.ShardedTensor` and a ``torch.distributed.tensor.DTensor``
without copying the local data (see ``shardwise_fsdp._dtensor``);
:func:`state_dict_from_dtensors` and :func:`state_dict_to_dtensors` do it for
whole state dicts, such as an FSDP2 (``fully_shard``) model's; and
:func:`install` (or :func:`install_on_wrap`, for FSDP1 over tensor
parallelism) gives an FSDP1 model :class:`ShardwiseFSDPExtensions`, so its
``SHARDED_STATE_DICT`` holds shardwise ShardedTensors.
"""

from __future__ import annotations

from shardwise_fsdp._dtensor import from_dtensor, to_dtensor
from shardwise_fsdp._fsdp1 import ShardwiseFSDPExtensions, install, install_on_wrap
from shardwise_fsdp._state_dict import state_dict_from_dtensors, state_dict_to_dtensors

__all__ = [
    "ShardwiseFSDPExtensions",
    "from_dtensor",
    "install",
    "install_on_wrap",
    "state_dict_from_dtensors",
    "state_dict_to_dtensors",
    "to_dtensor",
]
