"""Arguments of the sharded ops: parsed as the dense ops take them, checked, and put in one form.

Everything here is local to a rank and moves no data. A check that fails
does not raise at once: the op first tells its peers (see ``_agree``), so
that every rank raises instead of one raising and the others waiting.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from shardwise import ChunkShardingSpec, ShardedTensor

__all__ = ["BadIds", "Bags", "Options", "Table", "bags_of", "check_ids", "options_of", "table_of", "zeros_in_graph"]

MODES = ("sum", "mean", "max")


class BadIds(IndexError):
    """An id outside ``[0, num_embeddings)``; carries the id so peers can name it."""

    def __init__(self, message: str, value: int) -> None:
        super().__init__(message)
        self.value = value


@dataclass(frozen=True)
class Table:
    """The sharded weight: global size, how it is cut, and this rank's shards.

    Attributes:
        weight: The ShardedTensor.
        dim: 0 (row-wise) or 1 (column-wise).
        rows: ``num_embeddings``.
        cols: ``embedding_dim``.
        shards: ``(offset along dim, size along dim, owner's rank in the weight's group)`` of every
            shard, sorted by offset.
        local: ``(offset, size, tensor)`` of this rank's shards, by offset.
        device: Where this rank computes and returns its lookups: its
            shards' device, or (on a rank without a shard) its ids' device
            once :meth:`on` has been given them; None before that.
    """

    weight: ShardedTensor
    dim: int
    rows: int
    cols: int
    shards: tuple[tuple[int, int, int], ...]
    local: tuple[tuple[int, int, torch.Tensor], ...]
    device: Optional[torch.device] = None

    def on(self, device: torch.device) -> Table:
        """This table, computing on ``device`` unless its shards already fix the device."""
        return self if self.device is not None else replace(self, device=device)


@dataclass(frozen=True)
class Options:
    """The dense op's keyword options, normalised (``padding_idx`` non-negative or None)."""

    padding_idx: Optional[int]
    max_norm: Optional[float]
    norm_type: float
    scale_grad_by_freq: bool
    mode: str = "sum"

    def signature(self, op_code: int, dim: int, has_weights: int) -> list[int]:
        """Integers every rank must agree on, so ranks never run different algorithms.

        ``has_weights``: 0 without ``per_sample_weights``, 1 with, 2 when
        they require grad (every rank must then join their backward).
        """
        return [
            op_code,
            dim,
            MODES.index(self.mode),
            has_weights,
            -1 if self.padding_idx is None else self.padding_idx,
            -1 if self.max_norm is None else _bits(self.max_norm),
            _bits(self.norm_type),
            int(self.scale_grad_by_freq),
        ]


def zeros_in_graph(table: Table, rows: int, cols: Optional[int] = None) -> torch.Tensor:
    """Zeros standing in for lookups on a rank that owns nothing.

    They require grad whenever the weight does, so that rank, too, takes
    part in the backward collectives its peers will enter (else they hang).
    """
    grad = table.weight.requires_grad and torch.is_grad_enabled()
    shape = (rows, table.cols if cols is None else cols)
    return torch.zeros(shape, dtype=table.weight.dtype, device=table.device, requires_grad=grad)


def _bits(value: float) -> int:
    """The float64 bit pattern of ``value`` as a signed integer (so options travel in an int64 row exactly)."""
    return int.from_bytes(struct.pack("<d", float(value)), "little", signed=True)


def table_of(weight: Any, op: str) -> Table:
    """The :class:`Table` of a weight passed to ``op``.

    Raises:
        TypeError: the weight is not a ShardedTensor.
        NotImplementedError: not a 2-D weight chunk-sharded on dim 0 or 1.
    """
    if not isinstance(weight, ShardedTensor):
        raise TypeError(f"{op}: weight must be a shardwise ShardedTensor, got {type(weight).__name__}")
    spec = weight.sharding_spec()
    supported = "a 2-D weight sharded with ChunkShardingSpec on dim 0 (row-wise) or dim 1 (column-wise)"
    if not isinstance(spec, ChunkShardingSpec):
        raise NotImplementedError(f"{op}: weight is sharded with {type(spec).__name__}; supported: {supported}")
    if weight.dim() != 2:
        raise NotImplementedError(f"{op}: weight has {weight.dim()} dimensions; supported: {supported}")
    dim = spec.dim if isinstance(spec.dim, int) else -1
    dim = dim + 2 if dim in (-1, -2) else dim
    if dim not in (0, 1):
        raise NotImplementedError(f"{op}: weight is sharded on dim {spec.dim}; supported: {supported}")
    placed = []
    group = weight.process_group
    for md in weight.metadata().shards_metadata:
        rank = None if md.placement is None else md.placement.rank()
        if rank is None:
            raise ValueError(f"{op}: weight shard ({md.describe()}) is placed on no rank")
        # Placements name global ranks; lookups are routed by rank within the weight's group.
        placed.append((md.shard_offsets[dim], md.shard_sizes[dim], group.group_rank(rank)))
    shards = sorted(placed)
    local = sorted(
        ((s.metadata.shard_offsets[dim], s.metadata.shard_sizes[dim], s.tensor) for s in weight.local_shards()),
        key=lambda item: item[0],
    )
    rows, cols = weight.size()
    # Lookups run where the shards are (a rank without one follows its ids, see Table.on).
    device = local[0][2].device if local else None
    return Table(weight, dim, int(rows), int(cols), tuple(shards), tuple(local), device)


#: The weight dtypes the dense ``embedding_bag`` pools.
_BAG_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def options_of(
    table: Table,
    op: str,
    padding_idx: Any,
    max_norm: Any,
    norm_type: Any,
    scale_grad_by_freq: Any,
    sparse: Any,
    mode: str = "sum",
) -> Options:
    """Check and normalise the options the dense op takes.

    Raises:
        NotImplementedError: ``sparse=True``.
        ValueError: ``padding_idx`` outside the table, a bad ``max_norm``,
            ``norm_type`` or ``mode``.
        RuntimeError: ``embedding_bag`` of a weight that is not floating
            point (the dense op's error; raised here, before the ranks
            agree, so that ranks owning no columns raise it too).
    """
    if op == "embedding_bag" and table.weight.dtype not in _BAG_DTYPES:
        raise RuntimeError(
            f"{op}: expected the weight to have one of the following scalar types: Half, BFloat16, Float, Double; "
            f"but got {table.weight.dtype}"
        )
    if sparse:
        raise NotImplementedError(
            f"{op}: sparse=True is not supported for a sharded weight; each rank's gradient is a dense tensor "
            "the size of its shard already, so pass sparse=False"
        )
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or not -table.rows <= padding_idx < table.rows:
            raise ValueError(f"{op}: padding_idx={padding_idx!r} must be within num_embeddings ({table.rows})")
        padding_idx = padding_idx % table.rows
    if max_norm is not None:
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ValueError(f"{op}: max_norm must be positive, got {max_norm}")
    norm = float(norm_type)
    if not (norm > 0 or math.isinf(norm)) or math.isnan(norm):
        raise ValueError(f"{op}: norm_type must be positive (or inf), got {norm_type!r}")
    if mode == "max" and scale_grad_by_freq:
        raise ValueError(f"{op}: max mode does not support scaling the gradient by the frequency")
    return Options(padding_idx, max_norm, norm, bool(scale_grad_by_freq), mode)


def check_ids(ids: Any, table: Table, op: str, name: str = "input") -> torch.Tensor:
    """``ids`` as flat int64 on ``table.device`` (or their own device), after checking type and range.

    Ids on another device than the shards are moved to the shards' device,
    where every step of the lookup runs (a CUDA weight with CPU ids, say).

    Raises:
        TypeError: not an integer tensor.
        BadIds: an id outside ``[0, num_embeddings)``.
    """
    if not isinstance(ids, torch.Tensor) or isinstance(ids, ShardedTensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: {name} must hold int64 or int32 ids, got {ids.dtype}")
    device = table.device if table.device is not None else ids.device
    flat = ids.reshape(-1).to(device=device, dtype=torch.int64)
    if flat.numel():
        # One read of both bounds: on a GPU every read back is a synchronisation.
        low, high = torch.stack(torch.aminmax(flat)).tolist()
        bad = low if low < 0 else high if high >= table.rows else None
        if bad is not None:
            raise BadIds(
                f"{op}: id {bad} in {name} is out of range for an embedding of {table.rows} rows "
                f"(valid ids are 0..{table.rows - 1})",
                bad,
            )
    return flat


@dataclass(frozen=True)
class Bags:
    """One rank's ``embedding_bag`` input in one form.

    Attributes:
        ids: The ids that belong to a bag, flat int64, bag by bag.
        lengths: Number of ids in each bag (int64, one per bag).
        weights: ``per_sample_weights`` matching ``ids``, or None.
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]

    @property
    def count(self) -> int:
        """Number of bags."""
        return int(self.lengths.numel())

    def bag_of_each_id(self) -> torch.Tensor:
        """Bag index of each entry of ``ids``."""
        return torch.repeat_interleave(torch.arange(self.count, device=self.lengths.device), self.lengths)


def bags_of(
    table: Table,
    ids: Any,
    offsets: Any,
    per_sample_weights: Any,
    include_last_offset: bool,
    mode: str,
) -> Bags:
    """Check an ``embedding_bag`` input the way the dense op does, and return its :class:`Bags`.

    Raises:
        TypeError: ids or offsets that are not integer tensors.
        ValueError: bad shapes or offsets.
        NotImplementedError: ``per_sample_weights`` with a mode other than sum.
        BadIds: an id out of range.
    """
    op = "embedding_bag"
    if isinstance(ids, torch.Tensor) and ids.dim() not in (1, 2):
        raise ValueError(f"{op}: input has to be 1-D or 2-D, got a tensor of dimension {ids.dim()}")
    flat = check_ids(ids, table, op)
    assert isinstance(ids, torch.Tensor)
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(
                f"{op}: per_sample_weights is only supported for mode='sum' (got mode={mode!r}), as in the dense op"
            )
        if not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.shape != ids.shape:
            shape = getattr(per_sample_weights, "shape", type(per_sample_weights).__name__)
            raise ValueError(f"{op}: per_sample_weights must have the input's shape {tuple(ids.shape)}, got {shape}")
        if per_sample_weights.dtype != table.weight.dtype:
            raise TypeError(
                f"{op}: per_sample_weights is {per_sample_weights.dtype} but the weight is {table.weight.dtype}"
            )
        per_sample_weights = per_sample_weights.to(flat.device)
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError(f"{op}: offsets must be None for 2-D input (each row of the input is one bag)")
        count, length = ids.shape
        lengths = torch.full((count,), length, dtype=torch.int64, device=flat.device)
        weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
        return Bags(flat, lengths, weights)
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
        raise ValueError(f"{op}: 1-D input needs offsets, a 1-D tensor of bag starts; got {offsets!r:.60}")
    if offsets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: offsets must be int64 or int32, got {offsets.dtype}")
    starts = offsets.to(device=flat.device, dtype=torch.int64)
    n = flat.numel()
    if starts.numel() and int(starts[0]) != 0:
        raise ValueError(f"{op}: offsets[0] must be 0 (the first bag starts at the first id), got {int(starts[0])}")
    if starts.numel() > 1 and bool((starts[1:] < starts[:-1]).any()):
        raise ValueError(f"{op}: offsets must be non-decreasing, got {starts.tolist()[:16]}")
    if starts.numel() and int(starts[-1]) > n:
        raise ValueError(f"{op}: offsets[-1] ({int(starts[-1])}) is beyond the input's length {n}")
    if include_last_offset:
        if starts.numel() == 0:
            raise ValueError(f"{op}: include_last_offset=True needs at least one offset")
        bounds = starts
    else:
        bounds = torch.cat([starts, torch.tensor([n], dtype=torch.int64, device=flat.device)])
    # Without a bag (no offsets, or include_last_offset with one) no id belongs to one:
    # ids left in would be pooled into no bag (a RuntimeError row-wise, a crash of
    # torch's max kernel). They are still range-checked above, as documented.
    end = int(bounds[-1]) if bounds.numel() > 1 else 0
    weights = None if per_sample_weights is None else per_sample_weights[:end]
    return Bags(flat[:end], bounds[1:] - bounds[:-1], weights)
