"""Local argument checks of the public collectives, and the shape helpers they share.

Every check raises TypeError/ValueError/IndexError for a bad argument of
this rank; the handshake (:mod:`shardwise._comm.agreement`) then reports it
to the peers. The ``*_call`` functions check one collective's arguments and
describe the call as the :class:`~shardwise._comm.agreement.Call` its
handshake row carries.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch

from shardwise._comm.agreement import Call
from shardwise._vocab import wire as _wire

__all__ = [
    "all_to_all_single_call",
    "check_list",
    "check_output",
    "check_root",
    "check_splits",
    "check_tensor",
    "consecutive",
    "gathered_shape",
    "global_ranks",
    "prod",
    "rows_of",
    "split_out",
    "write_back",
]


def prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def rows_of(shape: tuple[int, ...]) -> int:
    """Length along dim 0, with a 0-d tensor counted as one row."""
    return shape[0] if shape else 1


def global_ranks(ranks: Optional[Sequence[int]], size: int) -> Optional[tuple[int, ...]]:
    """``ranks`` as a tuple, or None when group rank r is global rank r (nothing to translate)."""
    if ranks is None:
        return None
    out = tuple(int(r) for r in ranks)
    if len(out) != size or len(set(out)) != size or any(r < 0 for r in out):
        raise ValueError(f"ranks must list {size} distinct non-negative global ranks, got {list(out)}")
    return None if out == tuple(range(size)) else out


def check_root(root: Any, size: int, name: str) -> None:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"{name}={root!r} is not a rank of this group (size {size})")


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


def check_splits(splits: Optional[Sequence[int]], total: int, size: int, name: str) -> list[int]:
    """Rows per rank of a dim 0 of ``total`` rows: ``splits`` checked, or an equal split when None or empty (as torch).

    The one split-size rule of the collectives and their autograd forms.

    Raises:
        TypeError: a split is not an int.
        ValueError: not ``size`` non-negative splits summing to ``total``,
            or no splits and ``total`` does not divide by ``size``.
    """
    if splits is None or len(splits) == 0:
        if total % size:
            raise ValueError(f"{name} not given and dim 0 ({total}) does not divide by the group size ({size})")
        return [total // size] * size
    try:
        values = [operator.index(v) for v in splits]
    except TypeError:
        raise TypeError(f"{name} must be a list of ints, got {splits!r}") from None
    if len(values) != size or min(values) < 0:
        raise ValueError(f"{name} must be {size} non-negative ints, got {values!r}")
    if sum(values) != total:
        raise ValueError(f"{name} {values} sum to {sum(values)}, but dim 0 has {total} rows")
    return values


def gathered_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Shape of ``size`` equal pieces of ``shape`` stacked along dim 0 (0-d pieces make a vector)."""
    return (size * shape[0], *shape[1:]) if shape else (size,)


def all_to_all_single_call(
    tensor: Any,
    output_split_sizes: Optional[Sequence[int]],
    input_split_sizes: Optional[Sequence[int]],
    out: Any,
    size: int,
) -> Call:
    """Check ``all_to_all_single``'s arguments; ``splits_b`` holds the rows to receive when this rank knows them."""
    check_tensor(tensor, "tensor")
    if tensor.dim() == 0:
        raise ValueError("all_to_all_single needs a tensor with at least one dimension")
    ins = check_splits(input_split_sizes, tensor.shape[0], size, "input_split_sizes")
    # No splits or empty ones (torch's spelling of "derive them") are learnt from the senders.
    outs = list(output_split_sizes) if output_split_sizes else []
    if out is not None:
        if out.dim() == 0:
            raise ValueError("all_to_all_single: out needs at least one dimension")
        check_output(out, tensor.dtype, (out.shape[0], *tensor.shape[1:]), "out")
        outs = check_splits(output_split_sizes, out.shape[0], size, "output_split_sizes")
    elif outs:
        check_splits(outs, sum(outs), size, "output_split_sizes")
    return Call("all_to_all", tensor.dtype, tuple(tensor.shape), count=int(bool(outs) or out is not None),
                splits_a=ins, splits_b=outs)


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
    """Cut the byte buffer ``out`` into one tensor per rank: ``counts`` bytes, ``dims`` rows each."""
    out = out.to(device)
    pieces = []
    offset = 0
    for n, d in zip(counts, dims, strict=True):
        piece_shape = (d, *shape[1:]) if shape else ()
        pieces.append(_wire.from_bytes(out[offset:offset + n], dtype, piece_shape))
        offset += n
    return pieces
