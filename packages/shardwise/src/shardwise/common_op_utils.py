"""Checks and defaults shared by sharded op implementations, at torch 2.13's path ``common_op_utils``.

A torch-compatible face. torch's module has no public names; outside code
that writes its own sharded ops imports its two private helpers, which are
here over shardwise's ``ShardedTensor`` and registry decorators.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from shardwise._tensor.sharded_tensor import ShardedTensor

__all__: list[str] = []


def _op_name(op: Any) -> str:
    return str(getattr(op, "__name__", op))


def _same_group(a: Any, b: Any) -> bool:
    """Whether two tensors' groups are one (two shardwise Groups wrapping one torch ProcessGroup are)."""
    pg = getattr(a, "pg", None)
    return a is b or (pg is not None and pg is getattr(b, "pg", None))


def _basic_validation(op: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> None:
    """The checks every sharded op runs first: there are inputs, one is a ShardedTensor, all share a group.

    Args:
        op: The torch op being called (for messages).
        args: Its positional arguments (nested containers are searched).
        kwargs: Its keyword arguments.

    Raises:
        ValueError: there are no arguments at all.
        TypeError: no argument is a ShardedTensor.
        RuntimeError: ShardedTensor arguments live on different groups.
    """
    if len(args) == 0 and not kwargs:
        raise ValueError(f" No input for '{_op_name(op)}'! (a sharded op needs a ShardedTensor argument)")
    sharded = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, ShardedTensor)]
    if not sharded:
        raise TypeError(
            f"torch function '{_op_name(op)}', with args: {args} and kwargs: {kwargs} are called without any "
            "distributed tensor!"
        )
    first = sharded[0].process_group
    for st in sharded[1:]:
        if not _same_group(first, st.process_group):
            raise RuntimeError(
                "All distributed tensors should use the same ProcessGroup if used together in an op. "
                f"('{_op_name(op)}' got tensors on {first!r} and {st.process_group!r}; reshard or rebuild one "
                "of them on the other's group)"
            )


def _register_default_op(op: Any, decorator: Callable[[Any], Callable[[Any], Any]]) -> None:
    """Register, through ``decorator(op)``, an implementation of ``op`` that runs torch's own.

    For ops that behave on a ShardedTensor as on any tensor (attribute
    getters such as ``torch.Tensor.dtype``): the implementation calls
    ``op`` with ``__torch_function__`` subclass dispatch disabled, so it
    does not come back to the sharded registry.

    Args:
        op: The torch op.
        decorator: A registration decorator factory such as
            :func:`shardwise.sharded_tensor.custom_sharded_op_impl`.
    """

    @decorator(op)
    def tensor_default_op(types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None, pg: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return op(*args, **(kwargs or {}))
