"""Conversion between torch 2.13's ``ShardedTensor`` and shardwise's, sharing local storage.

Both classes hold the same facts: the global metadata (size, every shard's
box and ``rank:R/DEVICE`` placement, R a global rank in both), the tensor
properties, the sharding spec, the process group and this rank's shards.
Converting rebuilds the metadata and spec objects of the other library and
wraps the very same local shard tensors, so nothing is copied and nothing
is communicated: the metadata is already global, and both libraries'
"from local shards and global metadata" constructors check only local
facts (torch's ``_init_from_local_shards_and_global_metadata`` runs no
collective either).

Specs map class to class: ``ChunkShardingSpec`` to ``ChunkShardingSpec``,
``EnumerableShardingSpec`` to ``EnumerableShardingSpec``. A spec of any
other class (a user's) cannot be mapped: the conversion raises
``TypeError`` naming it, unless the caller passes ``sharding_spec=`` (a
spec of the target library, or ``"infer"`` for the chunk or enumerable spec
that produces the shards). torch builds a tensor's metadata from its spec
(its ``_init_from_local_shards_and_global_metadata`` only checks the given
metadata), so the spec handed to torch must produce exactly the shards;
shardwise keeps the metadata it is given and does not check its spec
against it. A spec that does not produce the tensor's shards is therefore
replaced by the inferred one, with a warning: the shards are the truth.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed._shard import sharding_spec as torch_specs
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata as TorchShardedTensorMetadata,
)
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchTensorProperties
from torch.distributed._shard.sharded_tensor.shard import Shard as TorchShard
from torch.distributed.remote_device import _remote_device

from shardwise._comm.default_group import resolve_group
from shardwise._comm.torch_group import TorchGroup
from shardwise._registry.records import qualified_name
from shardwise._tensor.sharded_tensor import ShardedTensor
from shardwise._tensor.specs import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec, infer_sharding_spec
from shardwise._vocab.metadata import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard

__all__ = ["from_torch", "is_torch_sharded_tensor", "load_torch_sharded_tensor", "to_torch"]

logger = logging.getLogger("shardwise")

SpecChoice = Union[ShardingSpec, torch_specs.ShardingSpec, Literal["infer"], None]
_Key = tuple[tuple[int, ...], tuple[int, ...], str]


def _type_name(value: Any) -> str:
    """``torch.Tensor``, ``str``: a value's type for messages."""
    return qualified_name(type(value)).removeprefix("builtins.")


def is_torch_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed._shard.sharded_tensor.ShardedTensor``."""
    return isinstance(value, TorchShardedTensor)


def _key(md: Any) -> _Key:
    """A shard's box and placement in a form both libraries' metadata give alike."""
    return tuple(md.shard_offsets), tuple(md.shard_sizes), str(md.placement)


def _same_shards(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return sorted(map(_key, a)) == sorted(map(_key, b))


def _local_indices(local: Sequence[Any], shards: Sequence[Any], what: str) -> list[int]:
    """For each local shard, the index of its entry in the global ``shards`` (each entry used once)."""
    by_id = {id(md): i for i, md in enumerate(shards)}
    free: dict[_Key, list[int]] = {}
    for i, md in enumerate(shards):
        free.setdefault(_key(md), []).append(i)
    out = []
    for shard in local:
        index = by_id.get(id(shard.metadata))
        candidates = free.get(_key(shard.metadata), [])
        if index is None or index not in candidates:
            if not candidates:
                raise ValueError(
                    f"{what}: a local shard (offsets={list(shard.metadata.shard_offsets)} "
                    f"sizes={list(shard.metadata.shard_sizes)} on {shard.metadata.placement}) is not among "
                    "the tensor's global shards metadata, or is listed twice; the tensor is inconsistent"
                )
            index = candidates[0]
        candidates.remove(index)
        out.append(index)
    return out


# -- torch -> shardwise ---------------------------------------------------------------------------


def _placement_from_torch(placement: Any, what: str) -> Any:
    if isinstance(placement, _remote_device) and placement.worker_name() is not None:
        raise ValueError(
            f"{what}: placement {placement} names an RPC worker; shardwise places shards on ranks "
            "('rank:R/DEVICE'), RPC is not supported"
        )
    return placement


def _shard_md_from_torch(md: TorchShardMetadata, what: str) -> ShardMetadata:
    return ShardMetadata(md.shard_offsets, md.shard_sizes, _placement_from_torch(md.placement, what))


def _spec_from_torch(spec: Any, what: str) -> Optional[ShardingSpec]:
    """torch's built-in spec as shardwise's, or None for a class that has no counterpart."""
    if isinstance(spec, torch_specs.ChunkShardingSpec):
        if isinstance(spec.dim, str):
            raise NotImplementedError(f"{what}: named dimensions (dim={spec.dim!r}) are not supported")
        return ChunkShardingSpec(spec.dim, [_placement_from_torch(p, what) for p in spec.placements])
    if isinstance(spec, torch_specs.EnumerableShardingSpec):
        return EnumerableShardingSpec([_shard_md_from_torch(md, what) for md in spec.shards])
    return None


def _pick_spec(
    recorded: Any,
    mapping: Callable[[Any], Optional[Any]],
    choice: SpecChoice,
    shards: Sequence[Any],
    build: Callable[[Any], Sequence[Any]],
    infer: Callable[[], Any],
    spec_class: type,
    what: str,
) -> Any:
    """The spec of the converted tensor (see the module docstring for the rules).

    Args:
        recorded: The source tensor's spec.
        mapping: ``spec -> the target library's spec of the same class``,
            or None for a class without a counterpart.
        choice: The caller's ``sharding_spec=``.
        shards: The converted global shards metadata.
        build: ``spec -> shards metadata`` of the target library.
        infer: ``() -> spec`` inferred from the shards.
        spec_class: The target library's ``ShardingSpec`` base class.
        what: The call, for messages.

    Raises:
        TypeError: ``choice`` is of the wrong type, or ``recorded`` cannot
            be mapped and ``choice`` is None.
        ValueError: ``choice`` does not build ``shards``.
    """
    target = qualified_name(spec_class)
    if isinstance(choice, str) and choice == "infer":
        return infer()
    if choice is not None and not isinstance(choice, spec_class):
        raise TypeError(f"{what}: sharding_spec must be a {target}, 'infer' or None, got {_type_name(choice)}")
    if choice is not None:
        try:
            built = build(choice)
        except Exception as exc:
            raise ValueError(f"{what}: sharding_spec={choice!r} cannot shard this tensor: {exc}") from exc
        if not _same_shards(built, shards):
            raise ValueError(
                f"{what}: sharding_spec={choice!r} does not produce the tensor's shards; pass a spec that "
                "builds the same shard boxes and placements, or sharding_spec='infer'"
            )
        return choice
    mapped = mapping(recorded)
    if mapped is None:
        raise TypeError(
            f"{what}: the tensor is sharded by {_type_name(recorded)}, a spec class with no "
            f"counterpart (only ChunkShardingSpec and EnumerableShardingSpec map class to class); "
            f"pass sharding_spec= a {target} that builds the same shards, or "
            "sharding_spec='infer' for the chunk or enumerable spec that does"
        )
    if _same_shards(build(mapped), shards):
        return mapped
    inferred = infer()
    logger.warning(
        "%s: the tensor's spec %r does not produce its shards; using %r, inferred from them", what, recorded, inferred
    )
    return inferred



def _properties(p: Any, cls: Any) -> Any:
    """``p`` (either library's ``TensorProperties``) as a ``cls``: the two have the same fields."""
    return cls(
        dtype=p.dtype,
        layout=p.layout,
        requires_grad=bool(p.requires_grad),
        memory_format=p.memory_format,
        pin_memory=bool(p.pin_memory),
    )


def from_torch(
    tensor: TorchShardedTensor,
    *,
    sharding_spec: Union[ShardingSpec, Literal["infer"], None] = None,
) -> ShardedTensor:
    """A shardwise ShardedTensor over the same local shard tensors as torch's ``tensor``.

    No data is copied and no collective runs: the result's local shards hold
    the very tensors of ``tensor.local_shards()`` (an in-place change through
    either is seen by both), with the same global metadata (sizes, offsets,
    placements, tensor properties), and it lives in the same process group
    (wrapped as a shardwise :class:`~shardwise.Group`). Every rank of the
    group converts its own object; as the metadata is global, every rank
    reaches the same result or the same error.

    Args:
        tensor: A ``torch.distributed._shard.sharded_tensor.ShardedTensor``.
        sharding_spec: None maps torch's ``ChunkShardingSpec`` and
            ``EnumerableShardingSpec`` to shardwise's; ``"infer"`` uses the
            chunk or enumerable spec that produces the shards; a shardwise
            :class:`~shardwise.ShardingSpec` is used as given, and must
            build the tensor's shards.

    Returns:
        The shardwise :class:`~shardwise.ShardedTensor`.

    Raises:
        TypeError: ``tensor`` is not torch's ShardedTensor, or its spec is
            of a class shardwise cannot map and ``sharding_spec`` is None
            (the message names the class).
        ValueError: ``sharding_spec`` does not build the tensor's shards, a
            placement names an RPC worker, or the metadata is invalid for
            shardwise (as for ``_init_from_local_shards_and_global_metadata``).

    Example::

        import torch.distributed._shard.sharded_tensor as torch_st
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunk

        theirs = torch_st.zeros(TorchChunk(0, ["rank:0/cpu", "rank:1/cpu"]), 4, 2)
        ours = shardwise.from_torch(theirs)
        assert ours.local_tensor().data_ptr() == theirs.local_tensor().data_ptr()
        whole = ours.full_tensor()
    """
    what = "from_torch"
    if not isinstance(tensor, TorchShardedTensor):
        hint = ""
        if isinstance(tensor, ShardedTensor):
            hint = " (it is already shardwise's; to_torch converts the other way)"
        raise TypeError(
            f"{what} takes a torch.distributed._shard.sharded_tensor.ShardedTensor, got {_type_name(tensor)}{hint}"
        )
    torch_md = tensor.metadata()
    shards = [_shard_md_from_torch(md, what) for md in torch_md.shards_metadata]
    props = _properties(torch_md.tensor_properties, TensorProperties)
    metadata = ShardedTensorMetadata(shards, torch.Size(torch_md.size), props)
    local = tensor.local_shards()
    indices = _local_indices(local, torch_md.shards_metadata, what)
    local_shards = [Shard(shard.tensor, shards[i]) for shard, i in zip(local, indices, strict=True)]
    spec = _pick_spec(
        tensor.sharding_spec(),
        lambda s: _spec_from_torch(s, what),
        sharding_spec,
        shards,
        lambda s: s.build_metadata(metadata.size, props).shards_metadata,
        lambda: infer_sharding_spec(shards, metadata.size),
        ShardingSpec,
        what,
    )
    # A tensor torch built without a process group (ShardedTensorBase) has none: use the default.
    group = resolve_group(getattr(tensor, "_process_group", None))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=group, sharding_spec=spec
    )


# -- shardwise -> torch ---------------------------------------------------------------------------


def _shard_md_to_torch(md: ShardMetadata) -> TorchShardMetadata:
    placement = None if md.placement is None else _remote_device(str(md.placement))
    return TorchShardMetadata(list(md.shard_offsets), list(md.shard_sizes), placement)


def _spec_to_torch(spec: ShardingSpec) -> Optional[torch_specs.ShardingSpec]:
    """shardwise's built-in spec as torch's, or None for a class that has no counterpart."""
    if isinstance(spec, ChunkShardingSpec):
        return torch_specs.ChunkShardingSpec(spec.dim, [str(p) for p in spec.placements])
    if isinstance(spec, EnumerableShardingSpec):
        return torch_specs.EnumerableShardingSpec([_shard_md_to_torch(md) for md in spec.shards])
    return None


def _torch_process_group(group: Any, process_group: Any, what: str) -> Any:
    """The torch ProcessGroup the converted tensor lives in."""
    if process_group is None:
        if isinstance(group, TorchGroup):
            return group.pg
        if not getattr(group, "is_member", True):
            # A rank outside a subgroup: torch's tensor there holds this marker and no shards.
            return dist.GroupMember.NON_GROUP_MEMBER
        raise TypeError(
            f"{what}: the tensor lives in a shardwise group of the {getattr(group, 'backend', '?')!r} backend "
            f"({type(group).__name__}), which has no torch ProcessGroup, and torch's ShardedTensor needs one; "
            "pass process_group= a torch.distributed ProcessGroup over the same processes in the same order "
            "(for MPI: after shardwise.init() under mpiexec, process_group=torch.distributed.group.WORLD)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{what}: process_group must be a torch.distributed.ProcessGroup or None, got {_type_name(process_group)}"
        )
    theirs = list(dist.get_process_group_ranks(process_group))
    # Global ranks of the members, in group-rank order: placements mean the same processes in both.
    ours = list(getattr(group, "ranks", range(group.size)))
    if theirs != ours:
        raise ValueError(
            f"{what}: process_group holds the global ranks {theirs}, but the tensor's group holds {ours}; "
            "pass a ProcessGroup over the same processes in the same order"
        )
    return process_group


def to_torch(
    tensor: ShardedTensor,
    *,
    sharding_spec: Union[torch_specs.ShardingSpec, Literal["infer"], None] = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> TorchShardedTensor:
    """torch 2.13's ShardedTensor over the same local shard tensors as shardwise's ``tensor``.

    The inverse of :func:`from_torch`: no data is copied and no collective
    runs; the result passes ``isinstance(x,
    torch.distributed._shard.sharded_tensor.ShardedTensor)`` and works with
    torch's own ops, ``gather`` and state-dict code.

    Args:
        tensor: A shardwise :class:`~shardwise.ShardedTensor`.
        sharding_spec: None maps shardwise's ``ChunkShardingSpec`` and
            ``EnumerableShardingSpec`` to torch's; ``"infer"`` uses the
            chunk or enumerable spec that produces the shards; a torch
            ``ShardingSpec`` is used as given, and must build the tensor's
            shards.
        process_group: The torch ProcessGroup for the result. Default: the
            one the tensor's group wraps (gloo, nccl or any torch group).
            A tensor on a group without one (shardwise's ``mpi`` backend)
            needs it: a torch group over the same processes in the same
            order.

    Returns:
        The torch ``ShardedTensor``.

    Raises:
        TypeError: ``tensor`` is not shardwise's ShardedTensor; its group
            has no torch ProcessGroup and none is given; or its spec is of
            a class torch cannot take and ``sharding_spec`` is None.
        ValueError: ``process_group`` holds other global ranks (or in
            another order) than the tensor's group, ``sharding_spec`` does
            not build the tensor's shards, or torch rejects the metadata (a
            placement outside the process group).

    Example::

        st = shardwise.shard_tensor(torch.arange(8.0).reshape(4, 2), spec)
        theirs = shardwise.to_torch(st)
        assert isinstance(theirs, torch.distributed._shard.sharded_tensor.ShardedTensor)
        assert shardwise.from_torch(theirs).local_tensor() is st.local_tensor()
    """
    what = "to_torch"
    if not isinstance(tensor, ShardedTensor):
        hint = ""
        if isinstance(tensor, TorchShardedTensor):
            hint = " (it is already torch's; from_torch converts the other way)"
        raise TypeError(f"{what} takes a shardwise ShardedTensor, got {_type_name(tensor)}{hint}")
    pg = _torch_process_group(tensor.process_group, process_group, what)
    md = tensor.metadata()
    shards = [_shard_md_to_torch(s) for s in md.shards_metadata]
    props = _properties(md.tensor_properties, TorchTensorProperties)
    torch_md = TorchShardedTensorMetadata(shards, torch.Size(md.size), props)
    local = tensor.local_shards()
    indices = _local_indices(local, md.shards_metadata, what)
    local_shards = [TorchShard(shard.tensor, shards[i]) for shard, i in zip(local, indices, strict=True)]

    def infer() -> torch_specs.ShardingSpec:
        inferred = _spec_to_torch(infer_sharding_spec(md.shards_metadata, md.size))
        assert inferred is not None  # inference gives a chunk or an enumerable spec
        return inferred

    spec = _pick_spec(
        tensor.sharding_spec(),
        _spec_to_torch,
        sharding_spec,
        shards,
        lambda s: s.build_metadata(torch_md.size, props).shards_metadata,
        infer,
        torch_specs.ShardingSpec,
        what,
    )
    try:
        return TorchShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, torch_md, process_group=pg, sharding_spec=spec
        )
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{what}: torch's ShardedTensor rejects the tensor's metadata: {exc}") from exc


# -- state dicts ------------------------------------------------------------------------------------


def _layout(st: ShardedTensor) -> tuple[Any, ...]:
    """Size and sorted shard boxes with their ranks: equal for tensors whose shards line up."""
    md = st.metadata()
    return tuple(md.size), tuple(
        sorted((tuple(s.shard_offsets), tuple(s.shard_sizes), s.rank or 0) for s in md.shards_metadata)
    )


def load_torch_sharded_tensor(value: TorchShardedTensor, like: ShardedTensor) -> ShardedTensor:
    """A torch ShardedTensor from a state dict, as a shardwise tensor laid out as ``like``.

    Shares ``value``'s storage when the layouts already match; otherwise
    reshards a converted view (a collective in ``value``'s group, which
    every rank runs: the decision depends only on global metadata), leaving
    ``value`` as it was. Any spec class is accepted (only the data is
    loaded).

    Raises:
        ValueError: ``like``'s spec cannot lay out ``value``'s size, or its
            placements are outside ``value``'s group (on every rank).
    """
    converted = from_torch(value, sharding_spec="infer")
    if _layout(converted) != _layout(like):
        converted.reshard(like.sharding_spec())
        if _layout(converted) != _layout(like):
            raise ValueError(
                f"cannot load a torch ShardedTensor into a parameter sharded by {like.sharding_spec()!r}: "
                "that spec does not reproduce the parameter's own shards"
            )
    return converted
