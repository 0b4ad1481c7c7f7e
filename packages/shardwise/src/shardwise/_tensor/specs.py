"""Sharding specs: how a tensor is cut into shards and where each shard lives."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from shardwise._registry.records import qualified_name
from shardwise._vocab.metadata import (
    Placement,
    ShardMetadata,
    ShardedTensorMetadata,
    TensorProperties,
    _as_int_list,
    _fields,
    check_covering,
    validate_non_overlapping,
)
from shardwise.errors import InvalidArgumentError

#: What :meth:`ShardingSpec.shard` runs: :func:`shardwise._tensor.scatter.scatter_tensor`,
#: bound by the tensor layer's package init (``shardwise/_tensor/__init__.py``). The specs
#: sit below ``ShardedTensor`` (which infers and rebuilds specs), while ``shard`` returns a
#: ``ShardedTensor``; this one seam keeps the module graph acyclic instead of importing
#: the class back from inside the method.
_scatter: Optional[Callable[..., Any]] = None


def bind_scatter(scatter: Callable[..., Any]) -> None:
    """Set the function :meth:`ShardingSpec.shard` runs (the tensor layer's init does, once)."""
    global _scatter
    _scatter = scatter

__all__ = [
    "ChunkShardingSpec",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "PlacementSpec",
    "ShardingSpec",
    "chunk_sizes",
    "infer_sharding_spec",
    "spec_from_dict",
]


class PlacementSpec(ABC):  # noqa: B024 - a marker base, as in torch
    """Base class for specs that say where a whole tensor (or shard) lives."""


@dataclass
class DevicePlacementSpec(PlacementSpec):
    """Place a whole tensor on one rank and device.

    Mutable and unhashable, as torch 2.13's dataclass; assigning ``device``
    parses it as the constructor does.

    Args:
        device: ``rank:R/DEVICE`` string or :class:`Placement`.

    Raises:
        ValueError: the placement is malformed.
    """

    device: Placement

    def __init__(self, device: Union[str, Placement, Any]) -> None:
        self.device = device  # type: ignore[assignment]  # __setattr__ makes it a Placement

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "device":
            value = Placement(value)
        super().__setattr__(name, value)


class ShardingSpec(ABC):
    """How a tensor is cut into shards and where the shards live.

    Subclasses implement :meth:`build_metadata`. The built-in specs compare
    by value and, as torch 2.13's dataclasses, are mutable and so
    unhashable; :meth:`to_dict` gives a JSON-safe form that ranks exchange
    to check that they agree.
    """

    @abstractmethod
    def build_metadata(self, tensor_sizes: Sequence[int], tensor_properties: TensorProperties) -> ShardedTensorMetadata:
        """The metadata of a tensor of ``tensor_sizes`` sharded by this spec.

        Raises:
            TypeError: ``tensor_sizes`` is not a sequence of integers.
            ValueError: a size is negative, or the spec cannot shard a
                tensor of that size.
        """

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group: Any = None) -> Any:
        """Shard ``tensor`` (held by ``src_rank``) across the group by this spec.

        Every rank calls it; only ``src_rank``'s ``tensor`` is read, the
        others need only pass a tensor of the same size and dtype. Each
        element crosses the wire once, straight to the rank that owns it.

        Args:
            tensor: The whole tensor (on ``src_rank``).
            src_rank: Rank of the group whose ``tensor`` is the truth.
            process_group: Group, torch ProcessGroup or None (default).

        Returns:
            The :class:`~shardwise.sharded_tensor.ShardedTensor`.
        """
        if _scatter is None:
            raise RuntimeError("shardwise's tensor layer is not initialised; import shardwise first")
        return _scatter(tensor, self, src_rank, process_group)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; a spec of another class is described by its repr."""
        return {"type": qualified_name(type(self)), "repr": repr(self)}


def chunk_sizes(dim_size: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` pieces of ``dim_size`` as ``torch.chunk`` cuts them.

    Trailing pieces may be empty: ``chunk_sizes(10, 4) == [3, 3, 3, 1]``,
    ``chunk_sizes(3, 4) == [1, 1, 1, 0]``, ``chunk_sizes(5, 4) == [2, 2, 1, 0]``.

    Raises:
        TypeError: either argument is not an int.
        ValueError: ``dim_size`` is negative or ``chunks`` is not positive.
    """
    for name, value in (("dim_size", dim_size), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if dim_size < 0:
        raise ValueError(f"dim_size must not be negative, got {dim_size}")
    if chunks <= 0:
        raise ValueError(f"chunks must be positive, got {chunks}")
    split = math.ceil(dim_size / chunks) if dim_size else 0
    return [max(min(dim_size, split * (i + 1)) - split * i, 0) for i in range(chunks)]


def _tensor_sizes(tensor_sizes: Sequence[int]) -> list[int]:
    """``tensor_sizes`` as a list of non-negative ints (what ``build_metadata`` may shard)."""
    sizes = _as_int_list(tensor_sizes, "tensor_sizes")
    if any(n < 0 for n in sizes):
        raise ValueError(f"tensor_sizes must not be negative, got {sizes}")
    return sizes


def _placements(values: Sequence[Any]) -> tuple[Placement, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"placements must be a list of 'rank:R/DEVICE' strings, got {values!r}")
    placed = tuple(Placement(v) for v in values)
    if not placed:
        raise ValueError("ChunkShardingSpec needs at least one placement")
    return placed


def _chunk_dim(dim: Any) -> int:
    if isinstance(dim, str):
        raise NotImplementedError(f"ChunkShardingSpec does not support named dimensions (dim={dim!r})")
    if isinstance(dim, bool) or not isinstance(dim, int):
        # Also a ValueError, which torch 2.13 raised here.
        raise InvalidArgumentError(
            f"ChunkShardingSpec dim must be an int, got {dim!r} (Sharding dim needs to be an integer)"
        )
    return dim


@dataclass
class ChunkShardingSpec(ShardingSpec):
    """Shard along one dimension into ``torch.chunk``-sized pieces.

    Piece ``i`` goes to ``placements[i]``, so ``len(placements)`` pieces are
    made; when the dimension is shorter than that, trailing pieces are empty.

    Mutable and unhashable, as torch 2.13's dataclass: ``spec.placements =
    [...]`` and ``spec.dim = ...`` are checked and normalised as the
    constructor's arguments are (placements become a tuple of
    :class:`Placement`). A tensor built from the spec keeps the spec object
    (as torch's), so mutate a spec only before sharding with it.

    Args:
        dim: The dimension to shard (negative counts from the end).
        placements: ``rank:R/DEVICE`` strings or :class:`Placement` objects.

    Raises:
        NotImplementedError: ``dim`` is a name (named dimensions are not
            supported).
        InvalidArgumentError: ``dim`` is not an int (a ``TypeError``,
            and the ``ValueError`` torch 2.13 raised).
        TypeError: placements is not a list.
        ValueError: a placement is malformed or the list is empty.
    """

    dim: int
    placements: tuple[Placement, ...]

    def __init__(self, dim: Union[int, str], placements: Sequence[Union[str, Placement, Any]]) -> None:
        self.dim = dim  # type: ignore[assignment]  # __setattr__ checks it (a str raises)
        self.placements = placements  # type: ignore[assignment]  # __setattr__ makes it a tuple

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignments are checked as the constructor's arguments, so a spec is never left invalid.
        if name == "dim":
            value = _chunk_dim(value)
        elif name == "placements":
            value = _placements(value)
        super().__setattr__(name, value)

    def build_metadata(
        self, tensor_sizes: Sequence[int], tensor_properties: Optional[TensorProperties] = None
    ) -> ShardedTensorMetadata:
        sizes = _tensor_sizes(tensor_sizes)
        ndim = len(sizes)
        if not -ndim <= self.dim < ndim:
            raise ValueError(
                f"cannot shard dim {self.dim} of a tensor of size {sizes} ({ndim} dimensions) "
                f"(Invalid sharding dim: {self.dim})"
            )
        dim = self.dim % ndim
        shards = []
        offset = 0
        for placement, length in zip(self.placements, chunk_sizes(sizes[dim], len(self.placements)), strict=False):
            offsets = [0] * ndim
            offsets[dim] = offset
            shard_sizes = list(sizes)
            shard_sizes[dim] = length
            shards.append(ShardMetadata(offsets, shard_sizes, placement))
            offset += length
        return ShardedTensorMetadata(shards, torch.Size(sizes), tensor_properties or TensorProperties())

    def to_dict(self) -> dict[str, Any]:
        return {"type": "chunk", "dim": self.dim, "placements": [str(p) for p in self.placements]}


def _own_metadata(shard: Any, i: int) -> ShardMetadata:
    """``shard`` as shardwise's ShardMetadata; torch's own (code written for torch passes it) is converted.

    Raises:
        TypeError: ``shard`` is neither.
    """
    if isinstance(shard, ShardMetadata):
        return shard
    # Imported only here: torch's _shard package is needed only when code hands over one of its objects.
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata

    if not isinstance(shard, TorchShardMetadata):
        raise TypeError(f"shard {i} must be a ShardMetadata, got {type(shard).__name__}")
    return ShardMetadata(shard.shard_offsets, shard.shard_sizes, shard.placement)


def _checked_shards(values: Sequence[ShardMetadata]) -> list[ShardMetadata]:
    """``values`` as a list, checked as :class:`EnumerableShardingSpec` requires."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"shards must be a list of ShardMetadata, got {type(values).__name__}")
    shards = list(values)
    if not shards:
        raise ValueError("EnumerableShardingSpec needs at least one shard (Empty shard list provided)")
    shards = [_own_metadata(shard, i) for i, shard in enumerate(shards)]
    ndim = len(shards[0].shard_offsets)
    for i, shard in enumerate(shards):
        if len(shard.shard_offsets) != ndim:
            raise ValueError(
                f"all shards must have the same number of dimensions: shard 0 ({shards[0].describe()}) "
                f"has {ndim}, shard {i} ({shard.describe()}) has {len(shard.shard_offsets)} "
                "(Found inconsistent ranks for shards)"
            )
    validate_non_overlapping(shards)
    return shards


class EnumerableShardingSpec(ShardingSpec):
    """Shards listed explicitly (grids, uneven blocks), one :class:`ShardMetadata` each.

    Mutable and unhashable, as torch 2.13's dataclass; assigning ``shards``
    checks the new list as the constructor does.

    Args:
        shards: The shards; they must not overlap and must all have the same
            number of dimensions. Whether they cover a tensor is checked when
            metadata is built for its size.

    Raises:
        TypeError: ``shards`` is not a sequence of :class:`ShardMetadata`.
        ValueError: the list is empty, shards differ in rank, or two overlap
            (the message names both).
    """

    shards: list[ShardMetadata]

    def __init__(self, shards: Sequence[ShardMetadata]) -> None:
        self.shards = shards  # type: ignore[assignment]  # __setattr__ checks it and makes it a list

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "shards":
            value = _checked_shards(value)
        super().__setattr__(name, value)

    def build_metadata(
        self, tensor_sizes: Sequence[int], tensor_properties: Optional[TensorProperties] = None
    ) -> ShardedTensorMetadata:
        sizes = _tensor_sizes(tensor_sizes)
        check_covering(self.shards, sizes)
        return ShardedTensorMetadata(
            [ShardMetadata(s.shard_offsets, s.shard_sizes, s.placement) for s in self.shards],
            torch.Size(sizes),
            tensor_properties or TensorProperties(),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"type": "enumerable", "shards": [s.to_dict() for s in self.shards]}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnumerableShardingSpec):
            return NotImplemented
        return self.shards == other.shards

    # Mutable, so unhashable (as torch's dataclass): a hash of the shards would change under assignment.
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EnumerableShardingSpec(shards={self.shards!r})"


def spec_from_dict(data: dict[str, Any]) -> ShardingSpec:
    """Rebuild a built-in spec from :meth:`ShardingSpec.to_dict`.

    Raises:
        ValueError: the dict describes a spec class this function cannot
            rebuild (a user-defined one), lacks a key, or holds values the
            spec's constructor rejects.
        TypeError: the dict holds values of the wrong type (as the spec's
            constructor raises).
    """
    if not isinstance(data, dict):
        raise ValueError(f"a sharding spec dict is needed, got {type(data).__name__}")
    kind = data.get("type")
    if kind == "chunk":
        dim, placements = _fields(data, ("dim", "placements"), "chunk sharding spec")
        if isinstance(dim, str):
            # A named dim is NotImplementedError for the constructor; from a dict it is malformed data.
            raise ValueError(f"chunk sharding spec dim must be an int, got {dim!r}")
        return ChunkShardingSpec(dim, placements)
    if kind == "enumerable":
        (shards,) = _fields(data, ("shards",), "enumerable sharding spec")
        if not isinstance(shards, list):
            raise ValueError(f"enumerable sharding spec 'shards' must be a list, got {type(shards).__name__}")
        return EnumerableShardingSpec([ShardMetadata.from_dict(s) for s in shards])
    raise ValueError(f"cannot rebuild a sharding spec of type {kind!r} from a dict")


def infer_sharding_spec(
    shards_metadata: Sequence[ShardMetadata], tensor_size: Optional[Sequence[int]] = None
) -> ShardingSpec:
    """The spec that produces ``shards_metadata``: a chunk spec when one does, else Enumerable.

    A chunk spec is found for any sharded dim, including dim 0 and a single
    shard covering the whole tensor (torch 2.13 infers Enumerable for those
    and can misread shards cut along two dims as a chunk spec).

    Args:
        shards_metadata: The shards.
        tensor_size: The size of the tensor they tile, when known. Shards of
            a tensor with no elements need not span it (empty shards hold
            nothing anywhere), so only with the size can a chunk spec be
            told to cut them for exactly that tensor.

    Raises:
        TypeError: an entry is not a :class:`ShardMetadata`.
        ValueError: there are no shards, or they overlap or differ in
            their number of dimensions (as :class:`EnumerableShardingSpec`).
    """
    shards = [_own_metadata(shard, i) for i, shard in enumerate(shards_metadata)]
    if not shards or any(s.placement is None for s in shards):
        return EnumerableShardingSpec(shards)
    ndim = len(shards[0].shard_offsets)
    if ndim == 0 or any(len(s.shard_offsets) != ndim for s in shards):
        return EnumerableShardingSpec(shards)
    for dim in range(ndim):
        others = [d for d in range(ndim) if d != dim]
        full = [shards[0].shard_sizes[d] for d in others]
        if any(s.shard_offsets[d] != 0 for s in shards for d in others):
            continue
        if any([s.shard_sizes[d] for d in others] != full for s in shards):
            continue
        # Empty trailing chunks go last wherever they sit: torch puts them at split * index, shardwise where
        # the tensor ends, and either way they hold nothing.
        ordered = sorted(shards, key=lambda s: (s.shard_sizes[dim] == 0, s.shard_offsets[dim]))
        total = sum(s.shard_sizes[dim] for s in ordered)
        if tensor_size is not None and [*full[:dim], total, *full[dim:]] != list(tensor_size):
            continue
        expected = chunk_sizes(total, len(ordered))
        offset = 0
        ok = True
        for shard, length in zip(ordered, expected, strict=False):
            if shard.shard_sizes[dim] != length or (length and shard.shard_offsets[dim] != offset):
                ok = False
                break
            offset += length
        if ok:
            return ChunkShardingSpec(dim, [s.placement for s in ordered])
    return EnumerableShardingSpec(shards)
