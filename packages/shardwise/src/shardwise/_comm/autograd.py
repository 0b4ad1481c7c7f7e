"""Autograd-aware collectives over any shardwise :class:`~shardwise.Group`.

Same names and signatures as ``torch.distributed.nn.functional``, except that
``group`` is a shardwise Group, a torch ``ProcessGroup`` or None (the default
group); dim 0 may differ between ranks (all_gather's tensors, reduce_scatter's
chunks, all_to_all's splits); and all_reduce differentiates max, min and
product (torch all-reduces the gradient with the forward's op instead).

Every backward pass is a collective: once one rank runs backward through a
result, every rank must, in the same order, so an input must require grad on
every rank or on none.

Argument errors are found before any data moves. The rank at fault raises
TypeError/ValueError and, through the group's handshake, makes its peers
raise :class:`~shardwise.errors.PeerError` rather than wait for it (unless
the group has ``verify=False``). Receive sizes that do not match what is
sent raise :class:`~shardwise.errors.CollectiveMismatchError` on every rank.

Each also takes ``async_op=True`` (torch's ``torch.distributed.nn.functional``
has no such form; its plain collectives do): the arguments are checked and
agreed at the call, the data moves on the group's worker thread, and the
call returns a :class:`~shardwise._comm.work.Work` whose ``wait()`` returns
the result connected to the autograd graph (grad mode as at the call). Do
not modify the inputs, nor read the outputs, before ``wait()``. Backward
passes stay blocking.

The autograd ``Function`` classes behind these functions (each collective's
forward and backward) are in :mod:`shardwise._comm.autograd_functions`.

Example:
    >>> import shardwise._comm.autograd as F
    >>> pieces = F.all_gather(x)            # one tensor per rank
    >>> total = F.all_reduce(x, op="sum")   # a new tensor; x is unchanged
    >>> work = F.all_to_all_single(out, x, async_op=True)
    >>> y = work.wait()                     # out, differentiable w.r.t. x
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Sequence, TypeVar, Union, cast, overload

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from shardwise._comm.autograd_functions import (
    _AllGather,
    _AllReduce,
    _AllToAll,
    _AllToAllSingle,
    _ReduceScatter,
    _copy,
    _send_rows,
)
from shardwise._comm.checks import check_splits
from shardwise._comm.default_group import resolve_group
from shardwise._comm.group import Group
from shardwise._comm.work import Work, chain
from shardwise._vocab import wire as _wire

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "reduce_scatter"]

GroupLike = Union[Group, "ProcessGroup", None]
T = TypeVar("T")
U = TypeVar("U")


# -- public API ----------------------------------------------------------------


@overload
def all_gather(tensor: Tensor, group: GroupLike = None, *, async_op: Literal[False] = False) -> tuple[Tensor, ...]: ...


@overload
def all_gather(tensor: Tensor, group: GroupLike = None, *, async_op: Literal[True]) -> Work[tuple[Tensor, ...]]: ...


def all_gather(
    tensor: Tensor, group: GroupLike = None, *, async_op: bool = False
) -> Union[tuple[Tensor, ...], Work[tuple[Tensor, ...]]]:
    """Gather every rank's ``tensor`` on every rank.

    Args:
        tensor: This rank's tensor; dim 0 may differ between ranks, dtype
            and the other dims must agree.
        group: The group to work on (None: the default group).
        async_op: Return a :class:`~shardwise._comm.work.Work` whose
            ``wait()`` returns the result (see the module docstring).

    Returns:
        One tensor per rank, in rank order. The gradient of a rank's
        ``tensor`` is the sum over all ranks of the gradients of its slot.

    Raises:
        TypeError: ``group`` is not a group, or ``tensor`` is not a tensor.
    """
    grp = resolve_group(group)
    if async_op:
        work = grp.all_gather(tensor, async_op=True)
        return _later(work, lambda pieces: cast(tuple[Tensor, ...], _AllGather.apply(grp, [pieces], tensor)))
    return cast(tuple[Tensor, ...], _AllGather.apply(grp, None, tensor))


@overload
def all_reduce(
    tensor: Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None, *, async_op: Literal[False] = False
) -> Tensor: ...


@overload
def all_reduce(
    tensor: Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None, *, async_op: Literal[True]
) -> Work[Tensor]: ...


def all_reduce(
    tensor: Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None, *, async_op: bool = False
) -> Union[Tensor, Work[Tensor]]:
    """Reduce ``tensor`` across ranks into a new tensor (``tensor`` is unchanged).

    With ``G`` the sum of every rank's result gradient and ``W`` ranks, the
    gradient of ``tensor`` is: sum: ``G``; avg: ``G / W``; max/min: ``G``
    split evenly between the ranks holding the result, 0 elsewhere;
    product: ``G`` times the other ranks' product (exact at zeros).

    Args:
        tensor: Same dtype and shape on every rank.
        op: ``ReduceOp.SUM``/``AVG``/``MAX``/``MIN``/``PRODUCT``, or its name.
        group: The group to work on (None: the default group).
        async_op: See :func:`all_gather`.

    Returns:
        The reduction, the same on every rank.

    Raises:
        TypeError: ``group`` is not a group, or ``op`` is undefined for the
            dtype (avg of integers).
        ValueError: ``op`` is not a known reduction.
    """
    grp = resolve_group(group)
    if async_op:
        work = grp.all_reduce(_copy(tensor), op, async_op=True)
        return _later(work, lambda result: cast(Tensor, _AllReduce.apply(grp, [result], op, tensor)))
    return cast(Tensor, _AllReduce.apply(grp, None, op, tensor))


@overload
def reduce_scatter(
    output: Tensor,
    input_list: Sequence[Tensor],
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    *,
    async_op: Literal[False] = False,
) -> Tensor: ...


@overload
def reduce_scatter(
    output: Tensor,
    input_list: Sequence[Tensor],
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    *,
    async_op: Literal[True],
) -> Work[Tensor]: ...


def reduce_scatter(
    output: Tensor,
    input_list: Sequence[Tensor],
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[Tensor, Work[Tensor]]:
    """Reduce ``input_list[r]`` across ranks into rank r's ``output``.

    Args:
        output: Receives the result: dtype and shape of ``input_list[rank]``;
            must not require grad.
        input_list: One tensor per rank; ``input_list[r]`` has the same shape
            on every rank, but dim 0 may differ between r's.
        op: As for :func:`all_reduce`; only sum and avg are differentiable.
        group: The group to work on (None: the default group).
        async_op: See :func:`all_gather`.

    Returns:
        ``output``, filled. The gradient of ``input_list[r]`` is rank r's
        output gradient (divided by the group size for avg).

    Raises:
        TypeError: an argument is not a tensor (list), or dtypes differ.
        ValueError: ``input_list`` does not hold one tensor per rank,
            ``output`` has the wrong shape, or an input requires grad with
            an op other than sum and avg.
    """
    grp = resolve_group(group)
    try:
        inputs = _tensor_list(input_list, grp.size, "input_list")
        _check_output(output, inputs[grp.rank], "output", same_shape=True)
        name = _wire.normalize_reduce_op(op)
        if name not in ("sum", "avg") and torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            raise ValueError(f"reduce_scatter with op {name!r} has no gradient; use sum or avg, or detach the inputs")
    except (TypeError, ValueError) as exc:
        grp.reject(exc)
    if async_op:
        work = grp.reduce_scatter(inputs, name, out=output, async_op=True)
        return _later(work, lambda result: cast(Tensor, _ReduceScatter.apply(grp, [result], [output], name, *inputs)))
    return cast(Tensor, _ReduceScatter.apply(grp, None, [output], name, *inputs))


@overload
def all_to_all(
    output_tensor_list: Sequence[Tensor],
    input_tensor_list: Sequence[Tensor],
    group: GroupLike = None,
    *,
    async_op: Literal[False] = False,
) -> tuple[Tensor, ...]: ...


@overload
def all_to_all(
    output_tensor_list: Sequence[Tensor],
    input_tensor_list: Sequence[Tensor],
    group: GroupLike = None,
    *,
    async_op: Literal[True],
) -> Work[tuple[Tensor, ...]]: ...


def all_to_all(
    output_tensor_list: Sequence[Tensor],
    input_tensor_list: Sequence[Tensor],
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[tuple[Tensor, ...], Work[tuple[Tensor, ...]]]:
    """Send ``input_tensor_list[r]`` to rank r and receive into ``output_tensor_list``.

    Args:
        output_tensor_list: One tensor per rank, shaped like what that rank
            sends here; filled in place; must not require grad.
        input_tensor_list: One tensor per rank. Dim 0 may differ; dtype and
            the other dims agree between tensors, outputs, and ranks.
        group: The group to work on (None: the default group).
        async_op: See :func:`all_gather`.

    Returns:
        ``output_tensor_list`` as a tuple, filled. Gradients go back along
        the routes the data came.

    Raises:
        TypeError: an argument is not a list of tensors, or dtypes differ.
        ValueError: a list does not hold one tensor per rank, or shapes
            differ beyond dim 0.
        CollectiveMismatchError: (every rank) outputs do not fit what is sent.
    """
    grp = resolve_group(group)
    try:
        inputs = _tensor_list(input_tensor_list, grp.size, "input_tensor_list")
        outputs = _tensor_list(output_tensor_list, grp.size, "output_tensor_list")
        for i, out in enumerate(outputs):
            _check_output(out, inputs[0], f"output_tensor_list[{i}]")
    except (TypeError, ValueError) as exc:
        grp.reject(exc)
    rows = [_rows(t) for t in outputs], [_rows(t) for t in inputs]
    if async_op:
        work = _send_rows(grp, inputs, rows, async_op=True)
        return _later(
            work, lambda received: cast(tuple[Tensor, ...], _AllToAll.apply(grp, [received], outputs, rows, *inputs))
        )
    return cast(tuple[Tensor, ...], _AllToAll.apply(grp, None, outputs, rows, *inputs))


@overload
def all_to_all_single(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
    *,
    async_op: Literal[False] = False,
) -> Tensor: ...


@overload
def all_to_all_single(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
    *,
    async_op: Literal[True],
) -> Work[Tensor]: ...


def all_to_all_single(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[Tensor, Work[Tensor]]:
    """Split ``input`` along dim 0, send piece r to rank r, and concatenate what arrives into ``output``.

    Args:
        output: Receives ``sum(output_split_sizes)`` rows; dtype and other
            dims as ``input``; must not require grad.
        input: At least 1-D; dtype and other dims agree on all ranks.
        output_split_sizes: Rows to receive from each rank; None or empty:
            ``output``'s dim 0 split evenly (it must divide by the group size).
        input_split_sizes: Rows to send to each rank; None or empty:
            ``input``'s dim 0 split evenly.
        group: The group to work on (None: the default group).
        async_op: See :func:`all_gather`.

    Returns:
        ``output``, filled. The gradient of ``input`` is the output's
        gradient sent back with the splits swapped.

    Raises:
        TypeError: an argument is not a tensor, or the dtypes differ.
        ValueError: bad split sizes, or shapes that do not fit them.
        CollectiveMismatchError: (every rank) splits do not fit what is sent.
    """
    grp = resolve_group(group)
    try:
        _check_tensor(input, "input")
        if input.dim() == 0:
            raise ValueError("all_to_all_single needs an input with at least one dimension")
        _check_output(output, input, "output")
        in_rows = check_splits(input_split_sizes, input.shape[0], grp.size, "input_split_sizes")
        out_rows = check_splits(output_split_sizes, output.shape[0], grp.size, "output_split_sizes")
    except (TypeError, ValueError) as exc:
        grp.reject(exc)
    rows = (out_rows, in_rows)
    if async_op:
        work = grp.all_to_all_single(input, out_rows, in_rows, out=output, async_op=True)
        return _later(work, lambda result: cast(Tensor, _AllToAllSingle.apply(grp, [result], [output], rows, input)))
    return cast(Tensor, _AllToAllSingle.apply(grp, None, [output], rows, input))


# -- helpers -------------------------------------------------------------------


def _later(work: Work[T], connect: Callable[[T], U]) -> Work[U]:
    """``work``, whose ``wait()`` also runs ``connect(result)`` (once), under the grad mode of this call."""
    grad = torch.is_grad_enabled()

    def then(value: T) -> U:
        with torch.set_grad_enabled(grad):
            return connect(value)

    return chain(work, then)


def _rows(tensor: Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _check_tensor(value: Any, name: str) -> None:
    if not torch.is_tensor(value):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _tensor_list(value: Any, size: int, name: str) -> list[Tensor]:
    """``value`` as one tensor per rank, sharing a dtype and the dims after dim 0."""
    if torch.is_tensor(value) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of {size} tensors, got {type(value).__name__}")
    if len(value) != size:
        raise ValueError(f"{name} must hold one tensor per rank ({size}), got {len(value)}")
    tensors = list(value)
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{name}[{i}]")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name}[{i}] is {t.dtype} but {name}[0] is {tensors[0].dtype}; all must share one dtype")
        if t.dim() != tensors[0].dim() or t.shape[1:] != tensors[0].shape[1:]:
            shapes = f"{name}[{i}] has shape {tuple(t.shape)} but {name}[0] has {tuple(tensors[0].shape)}"
            raise ValueError(f"{shapes}; only dim 0 may differ")
    return tensors


def _check_output(output: Any, like: Tensor, name: str, *, same_shape: bool = False) -> None:
    """Check that ``output`` can receive data like ``like`` (with any dim 0 unless ``same_shape``)."""
    _check_tensor(output, name)
    if output.dtype != like.dtype:
        raise TypeError(f"{name} is {output.dtype} but the input is {like.dtype}; they must match")
    if same_shape and output.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(output.shape)}, but this rank's result has {tuple(like.shape)}")
    if output.dim() != like.dim() or output.shape[1:] != like.shape[1:]:
        shapes = f"{name} has shape {tuple(output.shape)} but the input has {tuple(like.shape)}"
        raise ValueError(f"{shapes}; only dim 0 may differ")
    if output.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad; pass a fresh tensor (torch.empty) to receive into")
