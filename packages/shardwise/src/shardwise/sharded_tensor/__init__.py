"""``ShardedTensor`` and its creation functions.

Names follow ``torch.distributed._shard.sharded_tensor`` (torch 2.13).
"""

from __future__ import annotations

from typing import Any

from shardwise._modules.state_dict import pre_load_state_dict_hook, state_dict_hook
from shardwise._tensor.creation import empty, full, init_from_local_shards, ones, rand, randn, zeros
from shardwise._tensor.custom_ops import custom_sharded_op_impl, local_shards_op, local_tensor_op
from shardwise._tensor.sharded_tensor import ShardedTensor, ShardedTensorBase
from shardwise._tensor.torch_interop import from_torch, to_torch
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise.sharded_tensor._torch_ops import allclose, constant_, equal, kaiming_uniform_, normal_, uniform_
from shardwise.sharding_spec import ShardingSpec  # noqa: F401 - torch's package has the name too
from shardwise.sharding_spec.chunk_sharding_spec_ops._plugin import load as _load_embedding_plugin

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
    "allclose",
    "constant_",
    "custom_sharded_op_impl",
    "empty",
    "equal",
    "from_torch",
    "full",
    "init_from_local_shards",
    "kaiming_uniform_",
    "local_shards_op",
    "local_tensor_op",
    "normal_",
    "ones",
    "pre_load_state_dict_hook",
    "rand",
    "randn",
    "state_dict_hook",
    "to_torch",
    "uniform_",
    "zeros",
]


#: Names torch's package exposes from its sharded embedding ops, which shardwise-embedding implements.
_EMBEDDING_OPS = ("sharded_embedding", "sharded_embedding_bag")


def __getattr__(name: str) -> Any:
    """``sharded_embedding``/``sharded_embedding_bag``, from the optional shardwise-embedding distribution.

    Raises:
        ModuleNotFoundError: shardwise-embedding is not installed (the
            message says to ``pip install shardwise-embedding``).
        AttributeError: any other unknown name.
    """
    if name in _EMBEDDING_OPS:
        return getattr(_load_embedding_plugin(f"{__name__}.{name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
