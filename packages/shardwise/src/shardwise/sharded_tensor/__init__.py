"""``ShardedTensor`` and its creation functions.

Names follow ``torch.distributed._shard.sharded_tensor`` (torch 2.13).
"""

from __future__ import annotations

from shardwise._custom_ops import custom_sharded_op_impl, local_shards_op, local_tensor_op
from shardwise._metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._modules import pre_load_state_dict_hook, state_dict_hook
from shardwise.sharded_tensor._api import ShardedTensor, ShardedTensorBase
from shardwise.sharded_tensor._creation import empty, full, ones, rand, randn, zeros
from shardwise.sharded_tensor._from_shards import init_from_local_shards
from shardwise.sharded_tensor._shard import Shard

# Public module paths in reprs, messages and pickles (the classes live in private modules).
for _cls in (Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata, TensorProperties):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "TensorProperties",
    "custom_sharded_op_impl",
    "empty",
    "full",
    "init_from_local_shards",
    "local_shards_op",
    "local_tensor_op",
    "ones",
    "pre_load_state_dict_hook",
    "rand",
    "randn",
    "state_dict_hook",
    "zeros",
]
