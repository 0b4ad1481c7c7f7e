"""Shard placement and metadata records, and the box arithmetic on them.

Everything here is plain data: it converts to and from JSON-safe dicts,
because that is the form in which metadata crosses between ranks
(``Group.exchange`` never unpickles).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch

__all__ = [
    "Placement",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
    "check_covering",
    "intersect",
    "validate_non_overlapping",
]

_PLACEMENT_RE = re.compile(r"^rank:(-?\d+)/(.+)$")


class Placement:
    """Where a shard lives: ``rank:R/DEVICE`` (``rank:0/cpu``, ``rank:3/cuda:1``).

    ``R`` is a rank of the group the tensor lives in. The methods mirror
    ``torch.distributed._remote_device`` so code written for torch keeps
    working: ``placement.rank()``, ``placement.device()``.

    Args:
        spec: A ``rank:R/DEVICE`` string, another :class:`Placement`, or a
            ``torch.distributed._remote_device`` that names a rank.

    Raises:
        ValueError: the string is not of that form, the rank is negative,
            or the device is not a torch device.
    """

    __slots__ = ("_rank", "_device")
    _rank: int
    _device: torch.device

    def __init__(self, spec: Union[str, Placement, Any]) -> None:
        if isinstance(spec, Placement):
            self._rank, self._device = spec._rank, spec._device
            return
        if not isinstance(spec, str):
            rank = getattr(spec, "rank", None)
            device = getattr(spec, "device", None)
            if callable(rank) and callable(device) and rank() is not None:
                spec = f"rank:{rank()}/{device()}"
            else:
                raise ValueError(
                    f"placement must be a string of the form 'rank:R/DEVICE' (e.g. 'rank:0/cpu'), got {spec!r}"
                )
        match = _PLACEMENT_RE.match(spec.strip())
        if match is None:
            raise ValueError(
                f"invalid placement {spec!r}: expected 'rank:R/DEVICE' with R a rank of the group "
                "(e.g. 'rank:0/cpu', 'rank:1/cuda:0')"
            )
        rank = int(match.group(1))
        if rank < 0:
            raise ValueError(f"invalid placement {spec!r}: rank must be >= 0")
        try:
            device = torch.device(match.group(2))
        except RuntimeError as exc:
            raise ValueError(f"invalid placement {spec!r}: {match.group(2)!r} is not a torch device ({exc})") from None
        self._rank = rank
        self._device = device

    def rank(self) -> int:
        """The rank (in the tensor's group) that holds the shard."""
        return self._rank

    def device(self) -> torch.device:
        """The device the shard lives on."""
        return self._device

    def __str__(self) -> str:
        return f"rank:{self._rank}/{self._device}"

    def __repr__(self) -> str:
        return f"Placement('{self}')"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Placement(other)
            except ValueError:
                return False
        if not isinstance(other, Placement):
            return NotImplemented
        return self._rank == other._rank and self._device == other._device

    def __hash__(self) -> int:
        return hash((self._rank, str(self._device)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Placement, (str(self),))


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
        placement: ``rank:R/DEVICE`` string or :class:`Placement` (or None
            for a shard whose placement is not yet known).

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
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ValueError(
                f"shard_offsets and shard_sizes must have the same number of dimensions, got "
                f"offsets {self.shard_offsets} and sizes {self.shard_sizes}"
            )
        if any(o < 0 for o in self.shard_offsets):
            raise ValueError(f"shard_offsets must be >= 0, got {self.shard_offsets}")
        if any(s < 0 for s in self.shard_sizes):
            raise ValueError(f"shard_sizes must be >= 0, got {self.shard_sizes}")

    @property
    def rank(self) -> Optional[int]:
        """The placement's rank, or None without a placement."""
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


# -- box arithmetic ---------------------------------------------------------


def intersect(
    a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int], b_sizes: Sequence[int]
) -> Optional[tuple[list[int], list[int]]]:
    """The intersection of two boxes as ``(offsets, sizes)``, or None if empty.

    Boxes with a zero-size dimension never intersect anything.

    Raises:
        ValueError: the offsets and sizes do not all have the same length.
    """
    if not len(a_offsets) == len(a_sizes) == len(b_offsets) == len(b_sizes):
        raise ValueError(
            f"cannot intersect boxes of different dimensions: offsets {list(a_offsets)} sizes {list(a_sizes)} "
            f"and offsets {list(b_offsets)} sizes {list(b_sizes)}"
        )
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True):
        lo = max(ao, bo)
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return offsets, sizes


def validate_non_overlapping(shards: Sequence[ShardMetadata]) -> None:
    """Raise if two non-empty shards overlap.

    Raises:
        ValueError: naming the first overlapping pair and their boxes, or
            two shards with different numbers of dimensions.
    """
    for i, shard in enumerate(shards):
        if len(shard.shard_offsets) != len(shards[0].shard_offsets):
            raise ValueError(
                f"shards 0 ({shards[0].describe()}) and {i} ({shard.describe()}) have different numbers "
                "of dimensions"
            )
    nonempty = [(i, s) for i, s in enumerate(shards) if s.numel() > 0]
    if not nonempty:
        return
    ndim = len(nonempty[0][1].shard_offsets)
    # Sweep along dim 0 so only shards whose dim-0 ranges overlap are compared.
    order = sorted(nonempty, key=lambda item: item[1].shard_offsets[0] if ndim else 0)
    active: list[tuple[int, ShardMetadata]] = []
    for i, shard in order:
        start = shard.shard_offsets[0] if ndim else 0
        active = [(j, s) for j, s in active if ndim == 0 or s.shard_offsets[0] + s.shard_sizes[0] > start]
        for j, other in active:
            if intersect(other.shard_offsets, other.shard_sizes, shard.shard_offsets, shard.shard_sizes) is not None:
                first, second = sorted([(j, other), (i, shard)], key=lambda item: item[0])
                raise ValueError(
                    f"shards {first[0]} ({first[1].describe()}) and {second[0]} ({second[1].describe()}) overlap"
                )
        active.append((i, shard))


def check_covering(shards: Sequence[ShardMetadata], tensor_size: Sequence[int]) -> None:
    """Raise unless the shards fit in the tensor and (with no overlaps) cover it.

    Call after :func:`validate_non_overlapping`: then covering is the same
    as the shard volumes adding up to the tensor's. An empty shard holds no
    element, so (as for overlaps) where it sits is not checked.

    Raises:
        ValueError: a shard has the wrong number of dimensions or a
            non-empty one sticks out of the tensor (naming it), or the
            shards leave elements uncovered.
    """
    size = list(tensor_size)
    total = 0
    for i, shard in enumerate(shards):
        if len(shard.shard_offsets) != len(size):
            raise ValueError(
                f"shard {i} ({shard.describe()}) has {len(shard.shard_offsets)} dimensions, "
                f"the tensor of size {size} has {len(size)}"
            )
        if shard.numel() == 0:
            continue
        for d, (end, limit) in enumerate(zip(shard.ends(), size, strict=True)):
            if end > limit:
                raise ValueError(
                    f"shard {i} ({shard.describe()}) ends at {end} in dim {d}, "
                    f"outside the tensor of size {size}"
                )
        total += shard.numel()
    expected = math.prod(size)
    if total != expected:
        raise ValueError(
            f"shards do not cover the tensor of size {size}: they hold {total} of its {expected} elements "
            f"(shards: {'; '.join(s.describe() for s in shards)})"
        )
