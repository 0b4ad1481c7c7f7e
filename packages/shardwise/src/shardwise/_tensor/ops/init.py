"""``torch.nn.init`` on a ShardedTensor, and the in-place fills it reaches.

Two routes lead here. ``uniform_``, ``normal_``, ``constant_`` and
``kaiming_uniform_`` hand the call to ``__torch_function__`` themselves
(everything as keywords, ``tensor=...``). The others
(``kaiming_normal_``, ``xavier_uniform_``, ``xavier_normal_``,
``trunc_normal_``, ``ones_``, ``zeros_``) run torch's own code on the
wrapper, which reads the global shape (so fan-in/fan-out come from the
whole tensor, not the shard) and then calls ``Tensor.uniform_``,
``Tensor.normal_``, ``Tensor.fill_``, ``Tensor.zero_`` — and, for
``trunc_normal_``, comparisons, ``torch.where``, ``any`` and ``copy_``, all
global, so its rejection loop runs the same number of rounds on every
rank. Random fills go through :mod:`._random`: the same seed gives the
same whole tensor whatever the world size and spec. A ``generator=`` is
honoured: the base seed is drawn from it (seed it alike on every rank).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable

import torch

from shardwise._registry.records import ShardedOp
from shardwise._tensor.ops.common import map_shards, record
from shardwise._tensor.ops.random import fill_normal, fill_uniform
from shardwise._tensor.sharded_tensor import ShardedTensor

__all__ = ["records"]


def _bind(func: Callable[..., Any], args: Any, kwargs: Any) -> dict[str, Any]:
    bound = inspect.signature(func).bind(*args, **(kwargs or {}))
    bound.apply_defaults()
    tensor = bound.arguments["tensor"]
    if not isinstance(tensor, ShardedTensor):
        raise TypeError(f"torch.nn.init.{func.__name__}: tensor must be a ShardedTensor, got {type(tensor).__name__}")
    return bound.arguments


def _init_uniform(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    a = _bind(torch.nn.init.uniform_, args, kwargs)
    return fill_uniform(a["tensor"], a["a"], a["b"], a["generator"])


def _init_normal(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    a = _bind(torch.nn.init.normal_, args, kwargs)
    return fill_normal(a["tensor"], a["mean"], a["std"], a["generator"])


def _init_constant(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    a = _bind(torch.nn.init.constant_, args, kwargs)
    with torch.no_grad():
        return map_shards(torch.Tensor.fill_, (a["tensor"], a["val"]), {}, inplace=True)  # type: ignore[no-any-return]


def _init_kaiming_uniform(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    a = _bind(torch.nn.init.kaiming_uniform_, args, kwargs)
    st: ShardedTensor = a["tensor"]
    if 0 in st.size():
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=2)
        return st
    # torch's own fan rules, on a stand-in of the global size.
    fan = torch.nn.init._calculate_correct_fan(torch.empty(st.size(), device="meta"), a["mode"])
    gain = torch.nn.init.calculate_gain(a["nonlinearity"], a["a"])
    bound = math.sqrt(3.0) * gain / math.sqrt(fan)
    return fill_uniform(st, -bound, bound, a["generator"])


def _parse_fill(name: str, args: Any, kwargs: Any, names: tuple[str, str]) -> tuple[ShardedTensor, Any, Any, Any]:
    """``self, a, b, generator`` of ``Tensor.uniform_(from=0, to=1, *, generator=None)`` and ``normal_``."""
    st = args[0]
    if not isinstance(st, ShardedTensor):
        raise TypeError(f"torch.Tensor.{name}: self must be a ShardedTensor")
    rest = dict(kwargs or {})
    generator = rest.pop("generator", None)
    if len(args) > 3:
        raise TypeError(f"torch.Tensor.{name}() takes at most 2 positional arguments, got {len(args) - 1}")
    values = list(args[1:]) + [0.0, 1.0][len(args) - 1 :]
    for i, key in enumerate(names):
        if key in rest:
            if i < len(args) - 1:
                raise TypeError(f"torch.Tensor.{name}() got multiple values for {key!r}")
            values[i] = rest.pop(key)
    if rest:
        raise TypeError(f"torch.Tensor.{name}() got unexpected keyword arguments {sorted(rest)}")
    if torch.is_grad_enabled() and st.requires_grad:
        raise RuntimeError(
            f"torch.Tensor.{name} on a ShardedTensor that requires grad: a leaf that requires grad cannot "
            "be changed in place; call it under torch.no_grad() (torch.nn.init does)"
        )
    return st, values[0], values[1], generator


def _tensor_uniform(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    st, low, high, generator = _parse_fill("uniform_", args, kwargs, ("from", "to"))
    return fill_uniform(st, low, high, generator)


def _tensor_normal(types: Any, args: Any, kwargs: Any, process_group: Any) -> ShardedTensor:
    st, mean, std, generator = _parse_fill("normal_", args, kwargs, ("mean", "std"))
    return fill_normal(st, mean, std, generator)


def _in_place(op: Any) -> Callable[..., Any]:
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return map_shards(op, args, kwargs, inplace=True)

    return impl


def records() -> list[ShardedOp]:
    """``torch.nn.init`` entry points and the in-place fills torch's init code calls."""
    return [
        record(torch.nn.init.uniform_, _init_uniform, "uniform init; same seed, same whole tensor"),
        record(torch.nn.init.normal_, _init_normal, "normal init; same seed, same whole tensor"),
        record(torch.nn.init.constant_, _init_constant, "fill every shard"),
        record(torch.nn.init.kaiming_uniform_, _init_kaiming_uniform, "kaiming uniform; fan from the global size"),
        record(torch.Tensor.uniform_, _tensor_uniform, "uniform fill; same seed, same whole tensor"),
        record(torch.Tensor.normal_, _tensor_normal, "normal fill; same seed, same whole tensor"),
        record(torch.Tensor.fill_, _in_place(torch.Tensor.fill_), "fill every shard"),
        record(torch.Tensor.zero_, _in_place(torch.Tensor.zero_), "zero every shard"),
    ]
