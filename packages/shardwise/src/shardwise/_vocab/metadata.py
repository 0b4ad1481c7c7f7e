"""Shard placement and metadata records, and the box arithmetic on them.

Everything here is plain data: it converts to and from JSON-safe dicts,
because that is the form in which metadata crosses between ranks
(``Group.exchange`` never unpickles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from shardwise._vocab.box_index import intersect
from shardwise._vocab.placement import Placement, PlacementError, PlacementTypeError
from shardwise._vocab.validation import check_covering, validate_non_overlapping

__all__ = [
    "Placement",
    "PlacementError",
    "PlacementTypeError",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
    "check_covering",
    "intersect",
    "validate_non_overlapping",
]

def _as_int_list(values: Iterable[Any], what: str) -> list[int]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of integers, got {values!r}")
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of integers, got {values!r}") from None
    out = []
    for v in items:
        if isinstance(v, bool):
            # int(False) == False would let it through below.
            raise TypeError(f"{what} must be integers, got {v!r}")
        if not isinstance(v, int):
            try:
                iv = int(v)
            except (TypeError, ValueError, OverflowError):
                # OverflowError: int(float("inf")).
                raise TypeError(f"{what} must be integers, got {v!r}") from None
            if iv != v:
                raise TypeError(f"{what} must be integers, got {v!r}")
            v = iv
        out.append(int(v))
    return out


def _fields(data: Any, keys: Sequence[str], what: str) -> list[Any]:
    """``data[key]`` for each key, or a ValueError naming what is missing (the dict may come from a peer or a file)."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a dict with keys {list(keys)}, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"{what} lacks the key(s) {missing}: {data!r:.200}")
    return [data[k] for k in keys]


class ShardMetadata:
    """One shard of a tensor: where it starts, its size, and where it lives.

    Args:
        shard_offsets: Start of the shard in each dimension of the tensor.
        shard_sizes: Size of the shard in each dimension.
        placement: A placement in any form :class:`Placement` takes
            (``rank:R/DEVICE`` with ``R`` a global rank, ``rank:R``, a
            device), or None for a shard whose placement is not yet known.

    Raises:
        TypeError: offsets or sizes are not sequences of integers.
        ValueError: offsets and sizes differ in length, or any is negative,
            or the placement is malformed.
    """

    __slots__ = ("shard_offsets", "shard_sizes", "placement")

    def __init__(
        self,
        shard_offsets: Sequence[int],
        shard_sizes: Sequence[int],
        placement: Union[str, Placement, Any, None] = None,
    ) -> None:
        self.shard_offsets = _as_int_list(shard_offsets, "shard_offsets")
        self.shard_sizes = _as_int_list(shard_sizes, "shard_sizes")
        self.placement: Optional[Placement] = None if placement is None else Placement(placement)
        # The messages also carry torch 2.13's wording, which code written for it matches on.
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ValueError(
                f"shard_offsets and shard_sizes must have the same number of dimensions (the same number of "
                f"elements), got offsets {self.shard_offsets} and sizes {self.shard_sizes}"
            )
        if any(o < 0 for o in self.shard_offsets):
            raise ValueError(f"shard_offsets must be >= 0 (shard_offsets should be >=0), got {self.shard_offsets}")
        if any(s < 0 for s in self.shard_sizes):
            raise ValueError(f"shard_sizes must be >= 0 (shard_sizes should be >= 0), got {self.shard_sizes}")

    @property
    def rank(self) -> Optional[int]:
        """The placement's (global) rank, or None without a placement or a rank."""
        return None if self.placement is None else self.placement.rank()

    def numel(self) -> int:
        """Number of elements in the shard."""
        return math.prod(self.shard_sizes)

    def ends(self) -> list[int]:
        """Exclusive end of the shard in each dimension."""
        return [o + s for o, s in zip(self.shard_offsets, self.shard_sizes, strict=False)]

    def describe(self) -> str:
        """``offsets=[0, 0] sizes=[3, 4] on rank:0/cpu`` for error messages."""
        return f"offsets={self.shard_offsets} sizes={self.shard_sizes} on {self.placement}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (what crosses between ranks)."""
        return {
            "offsets": list(self.shard_offsets),
            "sizes": list(self.shard_sizes),
            "placement": None if self.placement is None else str(self.placement),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardMetadata:
        """Inverse of :meth:`to_dict`; validates as the constructor does.

        Raises:
            ValueError: ``data`` is not such a dict, or as the constructor.
            TypeError: as the constructor.
        """
        offsets, sizes = _fields(data, ("offsets", "sizes"), "shard metadata")
        return cls(offsets, sizes, data.get("placement"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardMetadata):
            return NotImplemented
        return (
            self.shard_offsets == other.shard_offsets
            and self.shard_sizes == other.shard_sizes
            and self.placement == other.placement
        )

    def __hash__(self) -> int:
        return hash((tuple(self.shard_offsets), tuple(self.shard_sizes), self.placement))

    def __repr__(self) -> str:
        return (
            f"ShardMetadata(shard_offsets={self.shard_offsets}, shard_sizes={self.shard_sizes}, "
            f"placement={str(self.placement) if self.placement is not None else None!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = ShardMetadata.from_dict(state)
        self.shard_offsets, self.shard_sizes, self.placement = other.shard_offsets, other.shard_sizes, other.placement


_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ValueError for unknown names."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _default_dtype() -> torch.dtype:
    return torch.get_default_dtype()


@dataclass
class TensorProperties:
    """Properties every shard of a tensor shares.

    Attributes:
        dtype: Element type (defaults to ``torch.get_default_dtype()``).
        layout: Only ``torch.strided`` is supported.
        requires_grad: Whether the local shards require grad.
        memory_format: Only ``torch.contiguous_format`` is supported for
            creation.
        pin_memory: Whether CPU shards are pinned.
    """

    dtype: torch.dtype = field(default_factory=_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        """The properties of ``tensor``."""
        return TensorProperties(
            dtype=tensor.dtype,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
            memory_format=torch.contiguous_format,
            pin_memory=tensor.is_pinned() if tensor.device.type == "cpu" else False,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        memory_format = next((k for k, v in _MEMORY_FORMATS.items() if v == self.memory_format), None)
        if memory_format is None:
            raise ValueError(f"unsupported memory_format {self.memory_format}")
        return {
            "dtype": dtype_name(self.dtype),
            "layout": str(self.layout).removeprefix("torch."),
            "requires_grad": bool(self.requires_grad),
            "memory_format": memory_format,
            "pin_memory": bool(self.pin_memory),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorProperties:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: ``data`` is not such a dict, names an unknown
                dtype, layout or memory format, or a flag is not a bool.
        """
        keys = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
        dtype, layout_name, requires_grad, memory_format, pin_memory = _fields(data, keys, "tensor properties")
        layout = getattr(torch, str(layout_name), None)
        if not isinstance(layout, torch.layout):
            raise ValueError(f"unknown layout {layout_name!r}")
        if not isinstance(memory_format, str) or memory_format not in _MEMORY_FORMATS:
            raise ValueError(f"unknown memory_format {memory_format!r}")
        for name, flag in (("requires_grad", requires_grad), ("pin_memory", pin_memory)):
            if not isinstance(flag, bool):
                # bool() would take "false" for True (and fail on a tensor).
                raise ValueError(f"tensor properties {name!r} must be true or false, got {flag!r:.60}")
        return cls(
            dtype=dtype_from_name(dtype),
            layout=layout,
            requires_grad=bool(requires_grad),
            memory_format=_MEMORY_FORMATS[memory_format],
            pin_memory=bool(pin_memory),
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = TensorProperties.from_dict(state)
        self.__dict__.update(other.__dict__)


@dataclass
class ShardedTensorMetadata:
    """The global view of a sharded tensor: every shard, the size, the properties.

    Attributes:
        shards_metadata: One :class:`ShardMetadata` per shard, on any rank.
        size: Size of the whole tensor.
        tensor_properties: dtype, layout, requires_grad, ... of the shards.

    Raises:
        TypeError: ``size`` is not a sequence of integers.
        ValueError: ``size`` has a negative entry. (The shards are not
            checked against the size here; specs and constructors do that.)
    """

    shards_metadata: list[ShardMetadata] = field(default_factory=list)
    size: torch.Size = field(default_factory=torch.Size)
    tensor_properties: TensorProperties = field(default_factory=TensorProperties)

    def __post_init__(self) -> None:
        size = _as_int_list(self.size, "size")
        if any(s < 0 for s in size):
            raise ValueError(f"size must not be negative, got {size}")
        self.size = torch.Size(size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {
            "shards": [s.to_dict() for s in self.shards_metadata],
            "size": list(self.size),
            "tensor_properties": self.tensor_properties.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardedTensorMetadata:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: ``data`` (or a part of it) is not such a dict, or
                holds invalid values.
            TypeError: sizes or offsets that are not integers.
        """
        shards, size, props = _fields(data, ("shards", "size", "tensor_properties"), "tensor metadata")
        if not isinstance(shards, list):
            raise ValueError(f"tensor metadata 'shards' must be a list, got {type(shards).__name__}")
        return cls(
            shards_metadata=[ShardMetadata.from_dict(s) for s in shards],
            size=size,  # checked by __post_init__
            tensor_properties=TensorProperties.from_dict(props),
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = ShardedTensorMetadata.from_dict(state)
        self.__dict__.update(other.__dict__)
