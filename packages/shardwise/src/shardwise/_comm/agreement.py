"""The handshake that precedes every collective, and local argument checks.

Each rank encodes its call into one fixed-width int64 row (:class:`Call`);
:class:`Rows` decodes the table of every rank's rows that the all-gather
returns. The row width depends only on the group size, so ranks that call
different collectives still exchange rows of the same size and can detect it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from shardwise._vocab import wire as _wire

_OPS = (
    "barrier", "broadcast", "all_reduce", "all_gather", "reduce_scatter",
    "all_to_all", "scatter", "gather", "exchange", "new_group",
)
STATUS_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, IndexError)
#: Public name of :data:`STATUS_ERRORS` (the plugin SDK's): the error kinds an agreement carries to the peers.
AGREED_ERRORS = STATUS_ERRORS
_HEADER = 8  # op, dtype, status, ndim, root, reduce op, count, reserved
_MAX_DIMS = 16
NO_TENSOR = -1


@dataclass
class Call:
    """One rank's description of its call, as carried by the handshake."""

    op: str
    dtype: Optional[torch.dtype] = None
    shape: Optional[tuple[int, ...]] = None  # None: this rank passes no tensor
    root: int = -1
    reduce_op: str = ""
    count: int = 0
    splits_a: Sequence[int] = ()
    splits_b: Sequence[int] = ()

    def encode(self, size: int) -> list[int]:
        row = [0] * (_HEADER + _MAX_DIMS + 2 * size)
        row[0] = _OPS.index(self.op)
        row[1] = _wire.dtype_code(self.dtype) if self.dtype is not None else NO_TENSOR
        row[3] = NO_TENSOR if self.shape is None else len(self.shape)
        row[4] = self.root
        row[5] = _wire.REDUCE_OPS.index(self.reduce_op) if self.reduce_op else NO_TENSOR
        row[6] = self.count
        if self.shape is not None:
            if len(self.shape) > _MAX_DIMS + 1:
                raise ValueError(f"collectives take tensors of at most {_MAX_DIMS + 1} dims, got {len(self.shape)}")
            row[_HEADER:_HEADER + len(self.shape) - 1] = list(self.shape[1:])
        base = _HEADER + _MAX_DIMS
        row[base:base + len(self.splits_a)] = list(self.splits_a)
        row[base + size:base + size + len(self.splits_b)] = list(self.splits_b)
        return row


class Rows:
    """The handshake result: every rank's row, decoded on demand."""

    def __init__(self, table: list[list[int]], size: int) -> None:
        self.table = table
        self.size = size

    def op(self, r: int) -> str:
        code = self.table[r][0]
        return _OPS[code] if 0 <= code < len(_OPS) else f"<unknown op {code}>"

    def dtype(self, r: int) -> Optional[torch.dtype]:
        code = self.table[r][1]
        return None if code == NO_TENSOR else _wire.DTYPES[code]

    def ndim(self, r: int) -> int:
        return self.table[r][3]

    def trailing(self, r: int) -> tuple[int, ...]:
        ndim = self.ndim(r)
        return tuple(self.table[r][_HEADER:_HEADER + max(ndim - 1, 0)])

    def root(self, r: int) -> int:
        return self.table[r][4]

    def reduce_op(self, r: int) -> str:
        """Rank r's reduce op by name (``"sum"``), or ``"none"``: error messages show it to users."""
        code = self.table[r][5]
        return _wire.REDUCE_OPS[code] if 0 <= code < len(_wire.REDUCE_OPS) else "none"

    def count(self, r: int) -> int:
        return self.table[r][6]

    def splits_a(self, r: int) -> list[int]:
        base = _HEADER + _MAX_DIMS
        return self.table[r][base:base + self.size]

    def splits_b(self, r: int) -> list[int]:
        base = _HEADER + _MAX_DIMS + self.size
        return self.table[r][base:base + self.size]


def prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def rows_of(shape: tuple[int, ...]) -> int:
    """Length along dim 0, with a 0-d tensor counted as one row."""
    return shape[0] if shape else 1



def show(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if value == NO_TENSOR:
        return "none"
    return str(value)


def check_tensor(tensor: Any, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    _wire.dtype_code(tensor.dtype)
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"{name} has layout {tensor.layout}; collectives take dense (strided) tensors")


def check_list(tensors: Any, size: int, name: str) -> tuple[int, ...]:
    """Validate one tensor per rank; returns the first tensor's shape."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list of {size} tensors, got {type(tensors).__name__}")
    if len(tensors) != size:
        raise ValueError(f"{name} must hold one tensor per rank ({size}), got {len(tensors)}")
    for i, t in enumerate(tensors):
        check_tensor(t, f"{name}[{i}]")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype:
            raise TypeError(f"{name}[{i}] is {t.dtype} but {name}[0] is {first.dtype}; all must share one dtype")
        if t.dim() != first.dim() or tuple(t.shape[1:]) != tuple(first.shape[1:]):
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} but {name}[0] has {tuple(first.shape)}; "
                "only dim 0 may differ"
            )
    return tuple(first.shape)


def check_output(out: Any, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> None:
    """Validate a caller's preallocated result tensor."""
    check_tensor(out, name)
    if out.dtype != dtype:
        raise TypeError(f"{name} is {out.dtype} but the result is {dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)} but the result has shape {tuple(shape)}")


def gathered_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Shape of ``size`` equal pieces of ``shape`` stacked along dim 0 (0-d pieces make a vector)."""
    return (size * shape[0], *shape[1:]) if shape else (size,)


def consecutive(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat tensor viewing ``tensors`` back to back, if they already lie so in memory.

    ``t.split(...)``/``t.chunk(...)`` of a contiguous ``t`` qualify; then a
    collective reads them in place instead of concatenating a copy.
    """
    first = tensors[0]
    if first.device.type == "meta" or first.is_conj() or first.is_neg():
        return None
    end = first.data_ptr()
    total = 0
    for t in tensors:
        if not t.is_contiguous() or t.is_conj() or t.is_neg() or t.device != first.device:
            return None
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            return None
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
        total += t.numel()
    if total == 0:
        return None
    return first.detach().as_strided((total,), (1,), first.storage_offset())


def check_splits(splits: Optional[Sequence[int]], total: int, size: int, name: str) -> list[int]:
    if splits is None:
        if total % size:
            raise ValueError(f"{name} not given and dim 0 ({total}) does not divide by the group size ({size})")
        return [total // size] * size
    values = list(splits)
    if len(values) != size or any(not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{name} must be {size} non-negative ints, got {values!r}")
    if sum(values) != total:
        raise ValueError(f"{name} {values} sum to {sum(values)}, but dim 0 has {total} rows")
    return values


def write_back(tensor: torch.Tensor, result: torch.Tensor) -> None:
    """Copy ``result`` into ``tensor`` unless it already lives in ``tensor``'s memory."""
    target = tensor.detach()
    if result.device == target.device and result.untyped_storage().data_ptr() == target.untyped_storage().data_ptr():
        return
    target.copy_(result.to(tensor.device))


def split_out(
    out: torch.Tensor,
    counts: Sequence[int],
    dims: Sequence[int],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    out = out.to(device)
    pieces = []
    offset = 0
    for n, d in zip(counts, dims, strict=True):
        piece_shape = (d, *shape[1:]) if shape else ()
        pieces.append(_wire.from_bytes(out[offset:offset + n], dtype, piece_shape))
        offset += n
    return pieces
