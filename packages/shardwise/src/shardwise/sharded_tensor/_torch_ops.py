"""torch 2.13's sharded op functions that its ``sharded_tensor`` package exposes by name.

torch's ``sharded_tensor`` package re-exports its built-in implementations of
``torch.equal``, ``torch.allclose`` and four ``torch.nn.init`` functions,
callable as ``impl(types, args, kwargs, process_group)``. shardwise's
implementations are registered ops (``shardwise._tensor.ops``); these
functions run the op on their arguments, so they do what calling the torch
function on a ShardedTensor does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["allclose", "constant_", "equal", "kaiming_uniform_", "normal_", "uniform_"]


def _run(op: Callable[..., Any], args: Any, kwargs: Optional[dict[str, Any]]) -> Any:
    return op(*args, **(kwargs or {}))


def equal(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    """``torch.equal(*args, **kwargs)`` on ShardedTensors: the same answer on every rank of their group."""
    return _run(torch.equal, args, kwargs)


def allclose(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    """``torch.allclose(*args, **kwargs)`` on ShardedTensors: the same answer on every rank of their group."""
    return _run(torch.allclose, args, kwargs)


def uniform_(types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None, pg: Any = None) -> Any:
    """``torch.nn.init.uniform_`` on a ShardedTensor (``kwargs["tensor"]``, ``a``, ``b``)."""
    return _run(torch.nn.init.uniform_, args, kwargs)


def normal_(types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None, pg: Any = None) -> Any:
    """``torch.nn.init.normal_`` on a ShardedTensor (``kwargs["tensor"]``, ``mean``, ``std``)."""
    return _run(torch.nn.init.normal_, args, kwargs)


def kaiming_uniform_(types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None, pg: Any = None) -> Any:
    """``torch.nn.init.kaiming_uniform_`` on a ShardedTensor (``kwargs["tensor"]``, ``a``, ``mode``, ...)."""
    return _run(torch.nn.init.kaiming_uniform_, args, kwargs)


def constant_(types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None, pg: Any = None) -> Any:
    """``torch.nn.init.constant_`` on a ShardedTensor (``kwargs["tensor"]``, ``val``)."""
    return _run(torch.nn.init.constant_, args, kwargs)
