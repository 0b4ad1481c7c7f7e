"""Shared machinery of the core's sharded ops: operands, layouts, metadata, shard-by-shard mapping.

Every op here works from the global metadata, which is the same on every
rank, so each check that can fail (layouts differ, a plain tensor operand,
an op torch rejects for these dtypes) fails the same way on every rank,
including ranks that hold no shard. Only what torch checks on the data
itself (an in-place op on a leaf shard that requires grad) fails on the
ranks that hold shards alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from shardwise._registry.records import ShardedOp, qualified_name
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec, infer_sharding_spec
from shardwise._vocab.metadata import Placement, ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise.errors import UnsupportedOperandError

__all__ = [
    "BoxKey",
    "box_key",
    "check_same_layout",
    "describe_layout",
    "layout_key",
    "local_by_box",
    "map_shards",
    "moved",
    "op_name",
    "record",
    "set_properties",
    "sharded_operands",
    "with_properties",
]

BoxKey = tuple[tuple[int, ...], tuple[int, ...]]
Impl = Callable[..., Any]


def op_name(func: Any) -> str:
    """``torch.Tensor.add`` for messages."""
    return qualified_name(func)


def record(op: Any, impl: Impl, description: str) -> ShardedOp:
    """A core record: ``op`` implemented by ``impl`` for every spec."""
    return ShardedOp(op=op, spec=ShardingSpec, impl=impl, description=description)


def records_for(ops: Sequence[Any], make: Callable[[Any], Impl], description: str) -> list[ShardedOp]:
    """One record per distinct op object (aliases such as ``__neg__``/``neg`` are one object)."""
    seen: dict[int, Any] = {}
    for op in ops:
        seen.setdefault(id(op), op)
    return [record(op, make(op), description) for op in seen.values()]


def sharded_operands(args: Any, kwargs: Any) -> list[ShardedTensor]:
    """Every ShardedTensor among ``args`` and ``kwargs`` (nested containers included), in order."""
    return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, ShardedTensor)]


def box_key(md: ShardMetadata) -> BoxKey:
    """A shard's box, to match the local shards of two tensors of one layout."""
    return tuple(md.shard_offsets), tuple(md.shard_sizes)


def local_by_box(st: ShardedTensor) -> dict[BoxKey, torch.Tensor]:
    """This rank's shard tensors keyed by box."""
    return {box_key(shard.metadata): shard.tensor for shard in st.local_shards()}


def layout_key(st: ShardedTensor, devices: bool = True) -> tuple[Any, ...]:
    """Size and sorted shard boxes with placements (or only ranks): equal keys, same layout."""
    md = st.metadata()
    shards = sorted(
        (tuple(s.shard_offsets), tuple(s.shard_sizes), str(s.placement) if devices else str(s.rank))
        for s in md.shards_metadata
    )
    return tuple(md.size), tuple(shards)


def describe_layout(st: ShardedTensor) -> str:
    """Size, spec class and every shard's box and placement, for error messages."""
    md = st.metadata()
    shards = "; ".join(s.describe() for s in md.shards_metadata)
    return f"size {list(md.size)} sharded by {type(st.sharding_spec()).__name__} into [{shards}]"


def check_same_layout(name: str, tensors: Sequence[ShardedTensor], *, devices: bool = True) -> None:
    """Raise unless every tensor has the first one's size, shard boxes and placements.

    Args:
        name: The op, for the message.
        tensors: The ShardedTensor operands.
        devices: Compare placement devices too (else only boxes and ranks).

    Raises:
        ValueError: naming both layouts and how to bring them together.
    """
    first = layout_key(tensors[0], devices)
    for i, other in enumerate(tensors[1:], start=1):
        if layout_key(other, devices) != first:
            raise ValueError(
                f"{name}: ShardedTensor operands have different layouts: operand 0 has "
                f"{describe_layout(tensors[0])}; operand {i} has {describe_layout(other)}. "
                "Bring one to the other's layout first, e.g. b.reshard(a.sharding_spec())"
            )


def with_properties(md: ShardedTensorMetadata, props: TensorProperties) -> ShardedTensorMetadata:
    """A new metadata object with the same shards and size and ``props``.

    Metadata objects are shared between tensors (an out-of-place result may
    reuse its input's), so properties are never changed in place.
    """
    return ShardedTensorMetadata(list(md.shards_metadata), md.size, props)


def set_properties(st: ShardedTensor, props: TensorProperties) -> None:
    """Give ``st`` new tensor properties after an in-place change, and keep the wrapper's flag in step."""
    if props == st.metadata().tensor_properties:
        return
    st._replace(metadata=with_properties(st.metadata(), props))
    with torch._C.DisableTorchFunctionSubclass():
        # The wrapper's own autograd flag: read by code that looks below the
        # registry (torch's C++ checks); shards carry the real autograd state.
        torch.Tensor.requires_grad_(st, props.requires_grad)


def result_properties(dtype: torch.dtype, requires_grad: bool) -> TensorProperties:
    """Properties of a fresh result: strided, contiguous, not pinned."""
    return TensorProperties(dtype=dtype, requires_grad=requires_grad)


def _stand_in(x: Any) -> Any:
    """An empty CPU tensor with ``x``'s dtype and grad flag (0-d tensors keep their shape)."""
    if isinstance(x, ShardedTensor):
        props = x.metadata().tensor_properties
        t = torch.empty([0] * max(x.dim(), 1), dtype=props.dtype)
        if props.requires_grad:
            # A non-leaf stand-in: in-place ops on results of other ops are legal.
            with torch.enable_grad():
                t = t.requires_grad_().clone()
        return t
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return t.requires_grad_() if x.requires_grad else t
    return x


def probe(func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``func`` on empty stand-ins: the result's dtype and grad flag, and torch's own errors.

    Every rank runs it with the same global properties, so a call torch
    rejects (bad dtype combination, in-place type change) raises on every
    rank, not only on those holding shards. (Empty CPU tensors rather than
    meta ones: a meta op imports torch._dynamo, seconds on first use.)
    """
    margs, mkwargs = pytree.tree_map(_stand_in, (tuple(args), dict(kwargs)))
    return func(*margs, **mkwargs)


def _reject_plain(name: str, leaves: Sequence[Any]) -> None:
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, ShardedTensor) and x.dim() != 0:
            # An OpNotFoundError (torch's RuntimeError) and a TypeError; the message ends in torch's wording.
            raise UnsupportedOperandError(
                f"{name}: got a plain torch.Tensor of size {list(x.shape)} next to a ShardedTensor; sharded "
                "pointwise ops take ShardedTensors of one layout, Python scalars and 0-d tensors. Shard it "
                "first with the same spec: shardwise.shard_tensor(tensor, st.sharding_spec()). torch function "
                f"'{name.rsplit('.', 1)[-1]}' with a plain tensor operand not supported for ShardedTensor!"
            )


def map_shards(
    func: Any, args: Sequence[Any], kwargs: Optional[dict[str, Any]], *, inplace: bool = False, devices: bool = True
) -> Any:
    """Apply a pointwise ``func`` to matching local shards of its ShardedTensor operands.

    ShardedTensor operands must share one layout; other operands must be
    Python scalars or 0-d tensors. The result keeps the layout and takes
    the dtype (type promotion) and grad flag torch gives. Results hold
    local tensors computed from the inputs' local tensors, so autograd
    runs shard by shard.

    Args:
        func: The torch op; called as ``func(*args, **kwargs)`` with each
            ShardedTensor replaced by its local shard tensor.
        args: Positional arguments as the caller passed them.
        kwargs: Keyword arguments as the caller passed them.
        inplace: ``func`` changes ``args[0]`` in place; return it.
        devices: Operands must agree on placement devices too (``copy_``
            between CPU and CUDA tensors of one layout passes False).

    Returns:
        A new ShardedTensor, or ``args[0]`` for an in-place op.

    Raises:
        UnsupportedOperandError: a plain tensor with dimensions is an
            operand (a ``TypeError`` and an ``OpNotFoundError``).
        TypeError: an in-place op's first argument is not a ShardedTensor.
        ValueError: ShardedTensor operands have different layouts.
    """
    kwargs = kwargs or {}
    name = op_name(func)
    leaves = pytree.tree_leaves((tuple(args), kwargs))
    _reject_plain(name, leaves)
    tensors = [x for x in leaves if isinstance(x, ShardedTensor)]
    ref = tensors[0]
    if inplace and not (args and isinstance(args[0], ShardedTensor)):
        raise TypeError(f"{name}: the tensor changed in place must be a ShardedTensor")
    check_same_layout(name, tensors, devices=devices)
    out_meta = probe(func, args, kwargs)
    props = result_properties(out_meta.dtype, out_meta.requires_grad)
    tables = {id(t): local_by_box(t) for t in tensors}
    shards = []
    for shard in ref.local_shards():
        key = box_key(shard.metadata)

        def local(x: Any, key: BoxKey = key) -> Any:
            return tables[id(x)][key] if isinstance(x, ShardedTensor) else x

        largs, lkwargs = pytree.tree_map(local, (tuple(args), kwargs))
        out = func(*largs, **lkwargs)
        if not inplace:
            shards.append(Shard(out, shard.metadata))
    if inplace:
        target: ShardedTensor = args[0]
        set_properties(target, replace(target.metadata().tensor_properties, requires_grad=props.requires_grad))
        return target
    return ShardedTensor._create(
        ref.sharding_spec(), with_properties(ref.metadata(), props), shards, ref.process_group
    )


def moved(st: ShardedTensor, device: torch.device) -> tuple[ShardingSpec, list[ShardMetadata]]:
    """``st``'s spec and shards with every placement on ``device`` (same ranks, or none, and boxes)."""

    def on_device(placement: Optional[Placement]) -> Optional[Placement]:
        return None if placement is None else placement.with_device(device)

    shards = [
        ShardMetadata(s.shard_offsets, s.shard_sizes, on_device(s.placement)) for s in st.metadata().shards_metadata
    ]
    spec = st.sharding_spec()
    new_spec: ShardingSpec
    if isinstance(spec, ChunkShardingSpec):
        new_spec = ChunkShardingSpec(spec.dim, [p.with_device(device) for p in spec.placements])
    elif isinstance(spec, EnumerableShardingSpec):
        new_spec = EnumerableShardingSpec(
            [ShardMetadata(s.shard_offsets, s.shard_sizes, on_device(s.placement)) for s in spec.shards]
        )
    else:
        new_spec = infer_sharding_spec(shards)
    return new_spec, shards
