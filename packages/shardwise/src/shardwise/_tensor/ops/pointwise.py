"""Pointwise ops between ShardedTensors of one layout, Python scalars and 0-d tensors.

torch 2.13 rejects all of these. Each op runs on matching local shards
(:func:`._common.map_shards`): no communication, autograd shard by shard,
dtype by torch's type promotion (comparisons give bool tensors), in-place
forms return the tensor they changed. Operands of different layouts are a
ValueError naming both; a plain tensor with dimensions is an UnsupportedOperandError
(a TypeError and an OpNotFoundError, so a RuntimeError as in torch; shard
it first) — both decided from the global metadata, so on every rank.

The operators route here as torch hands them to ``__torch_function__``:
``a + b`` and ``1 + a`` arrive as ``Tensor.add``, ``1 - a`` as
``Tensor.__rsub__``, ``2 / a`` as ``Tensor.__rdiv__``, ``a ** 2`` as
``Tensor.__pow__``, ``a == b`` as ``Tensor.__eq__``, ``a != b`` as
``Tensor.ne``, ``a < b`` as ``Tensor.lt``, ``-a`` as ``Tensor.neg``,
``abs(a)`` as ``Tensor.abs``, ``a += 1`` as ``Tensor.add_``, ``a **= 2`` as
``Tensor.__ipow__``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from shardwise._registry.records import ShardedOp
from shardwise._tensor.ops.common import map_shards, record, records_for

__all__ = ["records"]

T = torch.Tensor


def _named(*owners_and_names: tuple[Any, str]) -> list[Any]:
    """The attributes that exist (aliases vary between torch versions)."""
    out = []
    for owner, name in owners_and_names:
        value = getattr(owner, name, None)
        if value is not None:
            out.append(value)
    return out


def _both(*names: str) -> list[Any]:
    """``torch.NAME`` and ``torch.Tensor.NAME`` for each name."""
    return _named(*[(owner, name) for name in names for owner in (torch, T)])


#: Ops returning a new tensor of the same layout.
OUT_OF_PLACE: list[Any] = [
    *_both("add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide"),
    *_both("floor_divide", "remainder", "fmod", "neg", "negative", "abs", "absolute"),
    *_both("relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "pow", "clamp", "clip"),
    *_both("maximum", "minimum", "isclose", "logical_not", "logical_and", "logical_or"),
    *_both("eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal"),
    *_both("bitwise_and", "bitwise_or", "bitwise_not"),
    *_named((T, "__rsub__"), (T, "__rdiv__"), (T, "__rtruediv__"), (T, "__floordiv__"), (T, "__rfloordiv__")),
    *_named((T, "__pow__"), (T, "__rpow__"), (T, "__eq__"), (T, "__ne__"), (T, "__lt__"), (T, "__le__")),
    *_named((T, "__gt__"), (T, "__ge__"), (T, "__neg__"), (T, "__abs__"), (T, "__mod__")),
    *_named((T, "__and__"), (T, "__or__"), (T, "__invert__"), (T, "where"), (F, "gelu")),
]

#: Ops that change their first argument in place and return it.
IN_PLACE: list[Any] = [
    *_both("relu_", "sigmoid_", "tanh_", "neg_", "abs_", "exp_", "sqrt_", "clamp_", "clip_"),
    *_named((T, "add_"), (T, "sub_"), (T, "subtract_"), (T, "mul_"), (T, "multiply_"), (T, "div_")),
    *_named((T, "divide_"), (T, "true_divide_"), (T, "floor_divide_"), (T, "remainder_"), (T, "negative_")),
    *_named((T, "absolute_"), (T, "log_"), (T, "rsqrt_"), (T, "pow_"), (T, "__ipow__"), (T, "__iadd__")),
    *_named((T, "__isub__"), (T, "__imul__"), (T, "__itruediv__"), (T, "__idiv__"), (T, "__ior__")),
    *_named((T, "__iand__"), (T, "bitwise_or_"), (T, "bitwise_and_"), (T, "logical_not_")),
]

#: ``F.relu(x, inplace=...)`` and friends: in place or not, by argument.
INPLACE_FLAG: list[Any] = _named((F, "relu"), (F, "relu6"), (F, "leaky_relu"), (F, "elu"), (F, "silu"), (F, "hardtanh"))


def _mapped(op: Any, inplace: bool) -> Callable[..., Any]:
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return map_shards(op, args, kwargs, inplace=inplace)

    return impl


def _flagged(op: Any) -> Callable[..., Any]:
    signature = inspect.signature(op)

    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        inplace = bool(signature.bind(*args, **(kwargs or {})).arguments.get("inplace", False))
        return map_shards(op, args, kwargs, inplace=inplace)

    return impl


def _where(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    if len(args) + len(kwargs or {}) < 3:
        raise TypeError(
            "torch.where(condition) on a ShardedTensor (the indices of nonzero elements) is not supported; "
            "pass torch.where(condition, input, other)"
        )
    return map_shards(torch.where, args, kwargs)


def records() -> list[ShardedOp]:
    """Every pointwise op, out of place and in place."""
    return (
        records_for(OUT_OF_PLACE, lambda op: _mapped(op, False), "pointwise, shard by shard")
        + records_for(IN_PLACE, lambda op: _mapped(op, True), "pointwise in place, shard by shard")
        + records_for(INPLACE_FLAG, _flagged, "pointwise (inplace= honoured), shard by shard")
        + [record(torch.where, _where, "pointwise select, shard by shard")]
    )
