"""The plugin module shardwise loads (entry point ``shardwise`` -> ``embedding``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch.nn.functional as F

from shardwise import ChunkShardingSpec, ShardedOp, ShardingSpec, hookimpl
from shardwise.sharded_tensor import local_tensor_op


def _embedding(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> Any:
    from shardwise_embedding._ops import sharded_embedding

    return sharded_embedding(args, kwargs or {}, process_group)


def _embedding_bag(types: Any, args: Any = (), kwargs: Any = None, process_group: Any = None) -> Any:
    from shardwise_embedding._ops import sharded_embedding_bag

    return sharded_embedding_bag(args, kwargs or {}, process_group)


def _softmax_dim(args: Any, kwargs: Any) -> int:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None:
        raise TypeError("softmax on a ShardedTensor needs an explicit dim")
    return int(dim) % max(int(args[0].dim()), 1)


def _not_along_sharded_dim(*args: Any, **kwargs: Any) -> None:
    """Softmax normalises along ``dim``: only a dim that every shard holds whole can be done shard by shard."""
    st = args[0]
    dim = _softmax_dim(args, kwargs)
    spec_dim = st.sharding_spec().dim % st.dim()
    if dim == spec_dim:
        raise NotImplementedError(
            f"softmax along dim {dim}, the dim the tensor is sharded on, is not supported; "
            "reshard it onto another dim first (st.reshard(ChunkShardingSpec(dim=...)))"
        )


@hookimpl
def shardwise_sharded_ops() -> Iterable[ShardedOp]:
    """``F.embedding`` and ``F.embedding_bag`` on weights sharded by rows (dim 0) or columns (dim 1)."""
    yield ShardedOp(
        op=F.embedding,
        spec=ChunkShardingSpec,
        impl=_embedding,
        description="row-wise (ids routed to their rows' owners) or column-wise; autograd, max_norm, padding_idx",
    )
    yield ShardedOp(
        op=F.embedding_bag,
        spec=ChunkShardingSpec,
        impl=_embedding_bag,
        description="row-wise (partial bags pooled by owners, reduce-scattered) or column-wise; sum/mean/max",
    )
    # Any other spec gets an error that says what is supported, rather than "no implementation".
    for op, impl in ((F.embedding, _embedding), (F.embedding_bag, _embedding_bag)):
        yield ShardedOp(
            op=op,
            spec=ShardingSpec,
            impl=impl,
            description="other specs: NotImplementedError naming the supported ones (ChunkShardingSpec dim 0 or 1)",
        )
    # Softmax over an embedding-sized tensor kept sharded (e.g. scores sharded over a
    # vocabulary dim): along any dim but the sharded one it runs on the local tensor.
    for softmax in (F.softmax, F.log_softmax):
        yield ShardedOp(
            op=softmax,
            spec=ChunkShardingSpec,
            impl=local_tensor_op(softmax, extra_check=_not_along_sharded_dim),
            description="on the local tensor, along a dim that is not sharded",
        )


@hookimpl
def shardwise_cli_commands() -> Iterable[Any]:
    """``shardwise plan``: plan the sharding of an embedding collection described in a JSON file."""
    # Imported when the command line asks for commands, so that loading this plugin for its ops does not
    # import the planner.
    from shardwise import CliCommand
    from shardwise_embedding import _plan_cli

    yield CliCommand(name="plan", help=_plan_cli.HELP, add_arguments=_plan_cli.add_arguments, run=_plan_cli.run)
