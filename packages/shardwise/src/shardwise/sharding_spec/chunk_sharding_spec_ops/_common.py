"""Helpers for ChunkShardingSpec ops, at torch 2.13's path ``chunk_sharding_spec_ops._common``.

A torch-compatible public face: the names outside code imports from torch's
module, over :mod:`shardwise._tensor.custom_ops` and the chunk arithmetic of
:mod:`shardwise.sharding_spec._internals`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from shardwise._tensor.custom_ops import custom_sharding_spec_op, register_sharded_op_on_local_tensor
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec
from shardwise.sharding_spec._internals import get_chunk_sharding_params, get_chunked_dim_size, get_split_size

__all__ = [
    "ChunkShardingSpec",
    "ShardedTensor",
    "custom_sharding_spec_op",
    "get_chunk_sharding_params",
    "get_chunked_dim_size",
    "get_split_size",
]


def _register_sharded_op_on_local_tensor(
    op: Any,
    early_stop_func: Optional[Callable[..., bool]] = None,
    extra_check: Optional[Callable[..., None]] = None,
    customized_func: Optional[Callable[..., Any]] = None,
) -> Callable[..., Any]:
    """Register ``op`` on ChunkShardingSpec tensors to run on each rank's single local tensor (torch 2.13's name).

    For ops such as ``softmax`` along a dim that is not sharded, or
    ``view``: the result keeps the input's spec and size unless
    ``customized_func`` says otherwise. The registration overrides plugin
    implementations of ``op``. Plugins should instead put
    ``ShardedOp(op, ChunkShardingSpec, shardwise.sharded_tensor.local_tensor_op(op, ...))``
    in their ``shardwise_sharded_ops`` hook.

    Args:
        op: The torch op; called as ``op(local_tensor, *args[1:], **kwargs)``.
        early_stop_func: ``f(*args, **kwargs) -> bool``; when true the input
            is returned unchanged.
        extra_check: ``f(*args, **kwargs)``, raising to reject the call.
        customized_func: ``f(args, kwargs, process_group) -> (local_tensor,
            sharding_spec, size)`` computing the result itself.

    Returns:
        The registered implementation, ``impl(types, args, kwargs, process_group)``.
    """
    return register_sharded_op_on_local_tensor(op, early_stop_func, extra_check, customized_func)
