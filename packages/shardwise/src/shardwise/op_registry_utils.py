"""Registering sharded op implementations in a table, at torch 2.13's path ``op_registry_utils``.

A torch-compatible face. torch's module has no public names; its private
helpers, which outside code uses to keep op tables of its own, are here.
shardwise's own registry is fed by plugins and the decorators of
:mod:`shardwise.sharded_tensor` and :mod:`shardwise.sharding_spec`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, MutableMapping

from shardwise.common_op_utils import _basic_validation

__all__: list[str] = []

Impl = Callable[..., Any]


def _register_op(op: Any, func: Impl, op_table: MutableMapping[Any, Impl]) -> None:
    """Put ``func`` in ``op_table`` under ``op``, once its signature is checked.

    Args:
        op: The torch op.
        func: ``func(types, args, kwargs, process_group)``.
        op_table: The table.

    Raises:
        TypeError: ``func`` does not take exactly four parameters.
    """
    signature = inspect.signature(func)
    if len(signature.parameters) != 4:
        raise TypeError(
            "Custom sharded op function expects signature: (types, args, kwargs, process_group), but received "
            f"signature: {signature}"
        )
    op_table[op] = func


def _decorator_func(wrapped_func: Impl, op: Any, op_table: MutableMapping[Any, Impl]) -> Impl:
    """Register ``wrapped_func`` for ``op`` in ``op_table``, behind the common checks.

    Args:
        wrapped_func: ``wrapped_func(types, args, kwargs, process_group)``.
        op: The torch op.
        op_table: The table.

    Returns:
        The registered wrapper: it runs
        :func:`~shardwise.common_op_utils._basic_validation`, then
        ``wrapped_func``.

    Raises:
        TypeError: ``wrapped_func`` does not take four parameters.
    """

    @functools.wraps(wrapped_func)
    def wrapper(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        _basic_validation(op, args, kwargs)
        return wrapped_func(types, args, kwargs, process_group)

    # inspect.signature follows functools.wraps to wrapped_func: that is the signature checked.
    _register_op(op, wrapper, op_table)
    return wrapper
