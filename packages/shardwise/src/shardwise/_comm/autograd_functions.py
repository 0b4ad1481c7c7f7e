"""The ``torch.autograd.Function`` classes behind :mod:`shardwise._comm.autograd`'s collectives.

One class per collective (all-gather, reduce-scatter, all-to-all, its
single-tensor form, all-reduce): its forward runs the collective on a
:class:`~shardwise._comm.group.Group` (or only connects the result of one
issued with ``async_op=True``), its backward is the collective that sends
the gradients back, itself one of these classes so that double backward is
tracked. Here too are the two data movers that forward passes and the
public functions' asynchronous forms share (``_copy``, ``_send_rows``);
:mod:`shardwise._comm.round_trip` reuses ``_AllToAllSingle``.
The public functions, their argument checks and the ``async_op`` plumbing
are in :mod:`shardwise._comm.autograd`, which is what callers import; the
gradient rules are kept apart from them here.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union, overload

import torch
from torch import Tensor
from torch.autograd import Function

from shardwise._comm import buffers
from shardwise._comm.group import Group
from shardwise._comm.work import Work
from shardwise._vocab import wire as _wire

Grads = tuple[Optional[Tensor], ...]
Splits = tuple[list[int], list[int]]  # rows received from, and sent to, each rank
Done = Optional[list[Any]]  # the result of a collective issued with async_op=True, or None to run it now


# -- autograd functions ------------------------------------------------------
# Backward passes call these functions rather than the bare collectives, so
# that double backward (create_graph=True) is tracked too. Caller-supplied
# output tensors travel in a list: autograd then does not take them for
# inputs, and returns the caller's own tensor. ``done`` carries the result of
# the forward collective when it was issued asynchronously (the function then
# only connects it to the graph); backward passes run theirs now (None).


class _AllGather(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, done: Done, tensor: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        pieces = group.all_gather(tensor) if done is None else done[0]
        if ctx.needs_input_grad[2]:
            # Autograd forbids in-place changes to views of one buffer.
            pieces = [p.clone() for p in pieces]
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Grads:
        group: Group = ctx.group
        # Rank r's tensor fills slot r everywhere: it sums that slot's grads.
        out = buffers.empty_like(grads[group.rank])
        return None, None, _ReduceScatter.apply(group, None, [out], "sum", *grads)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, done: Done, box: list[Tensor], op: str, *inputs: Tensor) -> Tensor:
        ctx.group, ctx.op = group, op
        return group.reduce_scatter(list(inputs), op, out=box[0]) if done is None else done[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Grads:
        group: Group = ctx.group
        # Chunk r of every input reaches only rank r's output.
        grads = _AllGather.apply(group, None, grad)
        if ctx.op == "avg":
            grads = tuple(g / group.size for g in grads)
        return (None, None, None, None, *grads)


class _AllToAll(Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, done: Done, outputs: list[Tensor], rows: Splits, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.group, ctx.rows, ctx.in_shapes = group, rows, [t.shape for t in inputs]
        received = _send_rows(group, inputs, rows) if done is None else done[0]
        for out, piece in zip(outputs, received.split(rows[0]), strict=True):
            out.copy_(piece.reshape(out.shape))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Grads:
        # Gradients retrace the data's route back to the senders.
        back = [buffers.empty_like(grads[0], shape) for shape in ctx.in_shapes]
        return (None, None, None, None, *_AllToAll.apply(ctx.group, None, back, ctx.rows[::-1], *grads))


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, done: Done, box: list[Tensor], rows: Splits, tensor: Tensor) -> Tensor:
        ctx.group, ctx.rows, ctx.in_shape = group, rows, tensor.shape
        return group.all_to_all_single(tensor, *rows, out=box[0]) if done is None else done[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Grads:
        back = buffers.empty_like(grad, ctx.in_shape)
        return None, None, None, None, _AllToAllSingle.apply(ctx.group, None, [back], ctx.rows[::-1], grad)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, group: Group, done: Done, op: Any, tensor: Tensor) -> Tensor:
        result = group.all_reduce(_copy(tensor), op) if done is None else done[0]
        ctx.group, ctx.op = group, _wire.normalize_reduce_op(op)
        if ctx.needs_input_grad[3] and ctx.op in ("max", "min"):
            ctx.save_for_backward(tensor.detach() == result)
        elif ctx.needs_input_grad[3] and ctx.op == "product":
            ctx.save_for_backward(tensor)
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Grads:
        group: Group = ctx.group
        op: str = ctx.op
        # Every rank's loss reads the same result y, so dL/dx_r is dy/dx_r
        # times the sum of all ranks' gradients.
        if op == "avg":
            return None, None, None, _AllReduce.apply(group, None, "avg", grad)
        total = _AllReduce.apply(group, None, "sum", grad)
        if op == "sum":
            return None, None, None, total
        (saved,) = ctx.saved_tensors
        if op in ("max", "min"):
            hit = saved.to(grad.dtype)
            # Tied ranks share the gradient, as with torch.amax. Where no
            # rank matches (NaN) the clamp makes the gradient zero, not NaN.
            count = group.all_reduce(hit.clone(), "sum").clamp_(min=1)
            return None, None, None, total * hit / count
        # product: dy/dx_r is the product of the other ranks' values. y / x_r
        # fails where x_r == 0, so build it from the product of the nonzero
        # values and the count of zeros. zero_sum is 0 but carries the zero
        # entries' derivative, which keeps second derivatives exact.
        zero = saved == 0
        zeros = group.all_reduce(zero.to(saved.dtype), "sum")
        nonzero = torch.where(zero, torch.ones_like(saved), saved)
        nonzero_prod = _AllReduce.apply(group, None, "product", nonzero)
        zero_sum = _AllReduce.apply(group, None, "sum", torch.where(zero, saved, torch.zeros_like(saved)))
        when_zero = (zeros == 1) + (zero_sum - saved) * (zeros == 2)
        when_nonzero = ((zeros == 0) + zero_sum * (zeros == 1)) / nonzero
        return None, None, None, total * nonzero_prod * torch.where(zero, when_zero, when_nonzero)


# -- data movers ---------------------------------------------------------------


def _copy(tensor: Any) -> Any:
    """A detached contiguous copy to reduce in place; a non-tensor as is (the group rejects it on every rank)."""
    return tensor.detach().clone(memory_format=torch.contiguous_format) if torch.is_tensor(tensor) else tensor


@overload
def _send_rows(group: Group, inputs: Sequence[Tensor], rows: Splits) -> Tensor: ...


@overload
def _send_rows(group: Group, inputs: Sequence[Tensor], rows: Splits, *, async_op: Literal[True]) -> Work[Tensor]: ...


def _send_rows(
    group: Group, inputs: Sequence[Tensor], rows: Splits, *, async_op: bool = False
) -> Union[Tensor, Work[Tensor]]:
    """All-to-all of ``inputs`` as one tensor of rows: what arrives, in rank order."""
    # One all_to_all_single, unlike Group.all_to_all, makes the group
    # check on every rank that each rank is sent the rows it expects.
    with torch.no_grad():
        joined = torch.cat([_as_rows(t) for t in inputs])
    if async_op:
        return group.all_to_all_single(joined, *rows, async_op=True)
    return group.all_to_all_single(joined, *rows)


def _as_rows(tensor: Tensor) -> Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor
