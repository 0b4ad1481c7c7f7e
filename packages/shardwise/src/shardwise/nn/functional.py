"""Autograd-aware collectives over any shardwise :class:`~shardwise.Group`.

The functions have the names and signatures of ``torch.distributed.nn.functional``
and can replace it, with these differences:

* ``group`` is a shardwise :class:`~shardwise.Group`, a
  ``torch.distributed.ProcessGroup``, or None for the default group
  (:func:`shardwise.resolve_group`).
* Sizes along dim 0 may differ between ranks: :func:`all_gather` takes a
  tensor of any length per rank, :func:`reduce_scatter` chunks of any length,
  :func:`all_to_all` and :func:`all_to_all_single` any split per rank pair.
* :func:`all_reduce` differentiates ``max``, ``min`` and ``product``
  correctly (torch all-reduces the gradient with the forward's op instead).

Every backward pass is itself a collective, so every rank must run backward
through a result (and in the same order) once any rank does, and an input
must require grad on every rank or on none.

Argument errors are found before any data moves. The rank at fault raises
a ``TypeError``/``ValueError``; it then tells its peers through the group's
handshake, so they raise :class:`~shardwise.errors.PeerError` instead of
waiting for it (with ``verify=False`` groups they wait, as for any
collective). Disagreements between ranks (sizes one rank expects but
another does not send) raise :class:`~shardwise.errors.CollectiveMismatchError`
on every rank.

Example:
    >>> import shardwise.nn.functional as F
    >>> pieces = F.all_gather(x)                # one tensor per rank
    >>> total = F.all_reduce(x, op="sum")       # differentiable, x unchanged
"""

from __future__ import annotations

import contextlib
import operator
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence, Union, cast

import torch
from torch.autograd import Function
from torch.distributed import ReduceOp

from shardwise import _wire
from shardwise._group import Group
from shardwise._runtime import resolve_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "reduce_scatter"]

GroupLike = Union[Group, "ProcessGroup", None]

#: reduce_scatter ops whose gradient is defined here.
_DIFFERENTIABLE_SCATTER_OPS = ("sum", "avg")


# -- autograd functions --------------------------------------------------------
# Backward passes call these same functions (not the bare Group collectives),
# so gradients of gradients (create_graph=True) are tracked too.


class _AllGather(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        pieces = group.all_gather(tensor)
        if ctx.needs_input_grad[1]:
            # The pieces are views of one buffer; autograd forbids in-place
            # changes to such views, which callers may reasonably make.
            pieces = [p.clone() for p in pieces]
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        group: Group = ctx.group
        # Rank r's tensor is slot r on every rank: it collects that slot's
        # gradient from all of them.
        out = torch.empty_like(grads[group.rank])
        return None, _ReduceScatter.apply(group, [out], "sum", *grads)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, box: list[torch.Tensor], op: str, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.op = group, op
        # The output travels in a list so that autograd does not take it for
        # an input and returns the caller's own tensor.
        return box[0].copy_(group.reduce_scatter(list(inputs), op))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        group: Group = ctx.group
        # Chunk r of each rank's input reaches only rank r's output, so its
        # gradient is rank r's output gradient.
        grads = _AllGather.apply(group, grad)
        if ctx.op == "avg":
            grads = tuple(g / group.size for g in grads)
        return (None, None, None, *grads)


class _AllToAll(Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, outputs: list[torch.Tensor], out_rows: list[int], in_rows: list[int],
        *inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.rows = group, (out_rows, in_rows)
        ctx.in_shapes = [t.shape for t in inputs]
        # One all_to_all_single (rather than Group.all_to_all) lets the group
        # check, on every rank, that each rank receives the rows it expects.
        received = _a2a_single(group, torch.cat([_as_rows(t) for t in inputs]), out_rows, in_rows)
        for out, piece in zip(outputs, received.split(out_rows), strict=True):
            out.copy_(piece.reshape(out.shape))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        out_rows, in_rows = ctx.rows
        # Gradients retrace the data's route: what came from rank r goes back to it.
        back = [grads[0].new_empty(shape) for shape in ctx.in_shapes]
        return (None, None, None, None, *_AllToAll.apply(ctx.group, back, in_rows, out_rows, *grads))


class _AllToAllSingle(Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, box: list[torch.Tensor], out_rows: list[int], in_rows: list[int],
        tensor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.in_shape = group, (out_rows, in_rows), tensor.shape
        return box[0].copy_(_a2a_single(group, tensor, out_rows, in_rows))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        out_rows, in_rows = ctx.rows
        back = grad.new_empty(ctx.in_shape)
        return None, None, None, None, _AllToAllSingle.apply(ctx.group, [back], in_rows, out_rows, grad)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, op: Any, tensor: torch.Tensor) -> torch.Tensor:
        # A non-tensor goes to the group as is, which rejects it on every rank.
        buf = tensor.detach().clone(memory_format=torch.contiguous_format) if torch.is_tensor(tensor) else tensor
        result = group.all_reduce(buf, op)
        ctx.group, ctx.op = group, _wire.normalize_reduce_op(op)
        if ctx.needs_input_grad[2]:
            if ctx.op in ("max", "min"):
                ctx.save_for_backward(tensor.detach() == result)
            elif ctx.op == "product":
                ctx.save_for_backward(tensor)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        group: Group = ctx.group
        op: str = ctx.op
        # Every rank's loss sees the same result y, so dL/dx_r is
        # dy/dx_r times the sum of all ranks' gradients.
        if op == "avg":
            return None, None, _AllReduce.apply(group, "avg", grad)
        total = _AllReduce.apply(group, "sum", grad)
        if op == "sum":
            return None, None, total
        (saved,) = ctx.saved_tensors
        if op in ("max", "min"):
            hit = saved.to(grad.dtype)
            # Ranks tied for the extremum share the gradient, as with
            # torch.amax; where no rank matches (NaN) the clamp yields zero.
            count = group.all_reduce(hit.clone(), "sum").clamp_(min=1)
            return None, None, total * hit / count
        # product: dy/dx_r is the product of the other ranks' values. y / x_r
        # fails where x_r == 0, so build it from the product of the nonzero
        # values and the number of zeros. zero_sum is 0 but carries the
        # zero entries' derivative, which keeps second derivatives exact.
        zero = saved == 0
        zeros = group.all_reduce(zero.to(saved.dtype), "sum")
        nonzero = torch.where(zero, torch.ones_like(saved), saved)
        nonzero_prod = _AllReduce.apply(group, "product", nonzero)
        zero_sum = _AllReduce.apply(group, "sum", torch.where(zero, saved, torch.zeros_like(saved)))
        when_zero = (zeros == 1) + (zero_sum - saved) * (zeros == 2)
        when_nonzero = ((zeros == 0) + zero_sum * (zeros == 1)) / nonzero
        return None, None, total * nonzero_prod * torch.where(zero, when_zero, when_nonzero)


# -- public API -------------------------------------------------------------------


def all_gather(tensor: torch.Tensor, group: GroupLike = None) -> tuple[torch.Tensor, ...]:
    """Gather every rank's ``tensor`` on every rank.

    Args:
        tensor: This rank's contribution; dim 0 may differ between ranks,
            dtype and the other dims must agree.
        group: The group to work on (None: the default group).

    Returns:
        One tensor per rank, in rank order. The gradient of each rank's
        ``tensor`` is the sum over all ranks of the gradients of its slot.

    Raises:
        TypeError: ``group`` is not a group, or ``tensor`` is not a tensor.
    """
    return cast(tuple[torch.Tensor, ...], _AllGather.apply(resolve_group(group), tensor))


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks into a new tensor; ``tensor`` is not modified.

    Gradients, with ``g_s`` the gradient of rank s's result and ``W`` ranks:
    sum: ``sum_s g_s``; avg: ``sum_s g_s / W``; max/min: ``sum_s g_s`` on
    the ranks whose value is the result, split evenly between ties, zero
    elsewhere; product: ``sum_s g_s`` times the product of the other ranks'
    values (exact where some values are zero: nothing is divided by zero).

    Args:
        tensor: Same dtype and shape on every rank.
        op: ``ReduceOp.SUM``/``AVG``/``MAX``/``MIN``/``PRODUCT`` or its name.
        group: The group to work on (None: the default group).

    Returns:
        The reduction, identical on every rank.

    Raises:
        TypeError: ``group`` is not a group, or ``op`` is undefined for
            the dtype (avg of integers).
        ValueError: ``op`` is not a reduction shardwise knows.
    """
    return cast(torch.Tensor, _AllReduce.apply(resolve_group(group), op, tensor))


def reduce_scatter(
    output: torch.Tensor, input_list: Sequence[torch.Tensor], op: Any = ReduceOp.SUM, group: GroupLike = None
) -> torch.Tensor:
    """Reduce ``input_list[r]`` across ranks and write the result into rank r's ``output``.

    Args:
        output: Receives the result; same dtype and shape as
            ``input_list[rank]``; must not require grad.
        input_list: One tensor per rank; ``input_list[r]`` has the same
            shape on every rank, but dim 0 may differ between r's.
        op: As for :func:`all_reduce`. Only sum and avg are differentiable.
        group: The group to work on (None: the default group).

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
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        if needs_grad and name not in _DIFFERENTIABLE_SCATTER_OPS:
            raise ValueError(
                f"reduce_scatter with op {name!r} has no gradient here; use sum or avg, or detach the inputs"
            )
    except (TypeError, ValueError) as exc:
        _reject(exc, lambda bad: grp.reduce_scatter(bad), [])
    return cast(torch.Tensor, _ReduceScatter.apply(grp, [output], name, *inputs))


def all_to_all(
    output_tensor_list: Sequence[torch.Tensor], input_tensor_list: Sequence[torch.Tensor], group: GroupLike = None
) -> tuple[torch.Tensor, ...]:
    """Send ``input_tensor_list[r]`` to rank r; receive into ``output_tensor_list``.

    Args:
        output_tensor_list: One tensor per rank, shaped like what that rank
            sends here; filled in place; must not require grad.
        input_tensor_list: One tensor per rank. Dim 0 may differ between
            tensors; dtype and the other dims must agree with each other,
            with the outputs, and across ranks.
        group: The group to work on (None: the default group).

    Returns:
        ``output_tensor_list`` as a tuple, filled. Gradients travel back
        along the same routes.

    Raises:
        TypeError: an argument is not a list of tensors, or dtypes differ.
        ValueError: a list does not hold one tensor per rank, or shapes
            differ beyond dim 0.
        CollectiveMismatchError: (on every rank) a rank's output sizes do
            not match what the others send it.
    """
    grp = resolve_group(group)
    try:
        inputs = _tensor_list(input_tensor_list, grp.size, "input_tensor_list")
        outputs = _tensor_list(output_tensor_list, grp.size, "output_tensor_list")
        for i, out in enumerate(outputs):
            _check_output(out, inputs[0], f"output_tensor_list[{i}]")
    except (TypeError, ValueError) as exc:
        _reject_all_to_all(grp, exc)
    rows = [_rows(t) for t in outputs], [_rows(t) for t in inputs]
    return cast(tuple[torch.Tensor, ...], _AllToAll.apply(grp, outputs, *rows, *inputs))


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
) -> torch.Tensor:
    """Split ``input`` along dim 0, send piece r to rank r, and concatenate what arrives into ``output``.

    Args:
        output: Receives ``sum(output_split_sizes)`` rows; same dtype and
            trailing dims as ``input``; must not require grad.
        input: At least 1-D; dtype and trailing dims agree on all ranks.
        output_split_sizes: Rows to receive from each rank; None or empty:
            dim 0 of ``output`` split evenly (it must divide by the group size).
        input_split_sizes: Rows to send to each rank; None or empty: dim 0
            of ``input`` split evenly.
        group: The group to work on (None: the default group).

    Returns:
        ``output``, filled. The gradient of ``input`` is the output
        gradient sent back with the splits swapped.

    Raises:
        TypeError: an argument is not a tensor, or dtypes differ.
        ValueError: bad split sizes, or shapes that do not fit them.
        CollectiveMismatchError: (on every rank) a rank's output splits do
            not match what the others send it.
    """
    grp = resolve_group(group)
    try:
        _check_tensor(input, "input")
        if input.dim() == 0:
            raise ValueError("all_to_all_single needs an input with at least one dimension")
        _check_output(output, input, "output")
        in_rows = _split_sizes(input_split_sizes, input.shape[0], grp.size, "input_split_sizes")
        out_rows = _split_sizes(output_split_sizes, output.shape[0], grp.size, "output_split_sizes")
    except (TypeError, ValueError) as exc:
        _reject_all_to_all(grp, exc)
    return cast(torch.Tensor, _AllToAllSingle.apply(grp, [output], out_rows, in_rows, input))


# -- helpers ----------------------------------------------------------------------


def _rows(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _a2a_single(group: Group, tensor: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
    return group.all_to_all_single(tensor, output_split_sizes=out_rows, input_split_sizes=in_rows)


def _reject(exc: Exception, collective: Callable[[Any], object], invalid: Any) -> NoReturn:
    """Raise ``exc``, after making the peers raise too.

    The peers are entering ``collective``. Joining it with an argument the
    group rejects (``None``: a TypeError; ``invalid``: a ValueError) moves no
    data: the group's handshake tells every peer this rank refused, and they
    raise PeerError rather than wait for it.
    """
    with contextlib.suppress(Exception):
        collective(None if isinstance(exc, TypeError) else invalid)
    raise exc


def _reject_all_to_all(group: Group, exc: Exception) -> NoReturn:
    zeros = [0] * group.size
    # A 0-d tensor is the group's ValueError for all_to_all_single.
    _reject(exc, lambda bad: group.all_to_all_single(bad, zeros, zeros), torch.empty(()))


def _tensor_list(value: Any, size: int, name: str) -> list[torch.Tensor]:
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
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} but {name}[0] has {tuple(tensors[0].shape)}; "
                "only dim 0 may differ"
            )
    return tensors


def _check_tensor(value: Any, name: str) -> None:
    if not torch.is_tensor(value):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_output(output: Any, like: torch.Tensor, name: str, *, same_shape: bool = False) -> None:
    """Check that ``output`` can receive data shaped like ``like`` (all of it, or beyond dim 0)."""
    _check_tensor(output, name)
    if output.dtype != like.dtype:
        raise TypeError(f"{name} is {output.dtype} but the input is {like.dtype}; they must match")
    if same_shape and output.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(output.shape)}, but this rank's result has {tuple(like.shape)}")
    if output.dim() != like.dim() or output.shape[1:] != like.shape[1:]:
        raise ValueError(
            f"{name} has shape {tuple(output.shape)} but the input has {tuple(like.shape)}; only dim 0 may differ"
        )
    if output.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad; pass a fresh tensor (torch.empty) to receive into")


def _split_sizes(splits: Optional[Sequence[int]], rows: int, size: int, name: str) -> list[int]:
    if splits is None or len(splits) == 0:
        if rows % size:
            raise ValueError(f"{name} not given and dim 0 ({rows}) does not divide by the group size ({size})")
        return [rows // size] * size
    try:
        values = [operator.index(v) for v in splits]
    except TypeError:
        raise TypeError(f"{name} must be ints, got {list(splits)!r}") from None
    if len(values) != size or min(values) < 0:
        raise ValueError(f"{name} must be {size} non-negative ints, got {values}")
    if sum(values) != rows:
        raise ValueError(f"{name} {values} sum to {sum(values)}, but dim 0 has {rows} rows")
    return values
