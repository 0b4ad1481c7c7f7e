"""Barrier, broadcast, all-reduce, all-gather, reduce-scatter: collectives of :class:`~shardwise._comm.group.Group`.

The fourth of ``Group``'s private base classes (the chain is described in :mod:`shardwise._comm.group_core`):
``barrier``, ``broadcast``, ``all_reduce``, ``all_gather`` and ``reduce_scatter``, with the private helpers of the
reductions and of the gather into a given tensor. Each checks and agrees on its arguments through the handshake of
:mod:`shardwise._comm.group_calls`, then moves data with the backend's primitives (or its direct path). The
collectives of uneven or one-rank exchanges (``all_to_all``, ``scatter``, ``gather`` ...) are in
:mod:`shardwise._comm.group_exchanges`.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Sequence, Union, overload

import torch

from shardwise._comm import buffers
from shardwise._comm.agreement import Call, check_same, check_tensor_rows
from shardwise._comm.checks import (
    check_list,
    check_output,
    check_root,
    check_tensor,
    consecutive,
    gathered_shape,
    prod,
    rows_of,
    split_out,
    write_back,
)
from shardwise._comm.group_agreement import GroupAgreement
from shardwise._comm.group_calls import _one_call_at_a_time
from shardwise._comm.work import Work
from shardwise._vocab import wire as _wire


class GroupCollectives(GroupAgreement):
    """Barrier, broadcast, all-reduce, all-gather and reduce-scatter of a :class:`~shardwise._comm.group.Group`."""

    # -- public collectives --------------------------------------------------
    # Each checks and agrees in the caller's thread, then hands its data
    # movement (``move``) to _issue: run now, or queued on the worker with
    # async_op=True (see shardwise._comm.work).
    @overload
    def barrier(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def barrier(self, *, async_op: Literal[True]) -> Work[None]: ...

    @_one_call_at_a_time
    def barrier(self, *, async_op: bool = False) -> Optional[Work[None]]:
        """Block until every rank of the group has reached it.

        Args:
            async_op: Return a :class:`Work` at once instead of blocking
                (when verifying, the handshake is the barrier: every rank
                has reached it when the call returns, and the Work completes
                as soon as the worker thread runs its empty step).
        """
        if self.verify:
            self._handshake(lambda: Call(op="barrier"), async_op=async_op)
            return self._issue("barrier", lambda: None, async_op)
        return self._issue("barrier", self._barrier, async_op)

    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: Literal[True]) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place.

        Args:
            tensor: Its dtype and shape must agree on all ranks.
            src: The sending rank.
            async_op: Return a :class:`Work` whose ``wait()`` returns the
                result, instead of the result (every collective takes it).

        Returns:
            ``tensor`` itself.
        """

        def prepare() -> Call:
            check_root(src, self.size, "src")
            check_tensor(tensor, "tensor")
            return Call("broadcast", tensor.dtype, tuple(tensor.shape), root=src, count=tensor.numel())

        _, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.count, what="number of elements")

        def move() -> torch.Tensor:
            if self._direct_broadcast(tensor, src):
                return tensor
            wire = _wire.to_bytes(tensor, self._wire_device(tensor))
            self._broadcast(wire, src)
            write_back(tensor, _wire.from_bytes(wire, tensor.dtype, tuple(tensor.shape)))
            return tensor

        return self._issue("broadcast", move, async_op)

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", *, async_op: Literal[False] = False
    ) -> torch.Tensor: ...

    @overload
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum", *, async_op: Literal[True]) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", *, async_op: bool = False
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Reduce ``tensor`` across ranks in place.

        Args:
            tensor: Same dtype and shape on every rank.
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"product"``
                (or the matching ``torch.distributed.ReduceOp``). Bool
                tensors: sum/max are "or", min/product are "and".
            async_op: See :meth:`broadcast`.

        Returns:
            ``tensor`` itself, holding the result.

        Raises:
            TypeError: ``op`` is undefined for the dtype (avg of ints).
        """

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            name = _wire.normalize_reduce_op(op)
            _wire.check_reducible(tensor.dtype, name)
            self._reduction_dtype(_wire.wire_dtype(tensor.dtype))
            return Call("all_reduce", tensor.dtype, tuple(tensor.shape), reduce_op=name, count=tensor.numel())

        call, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.count, what="number of elements")

        def move() -> torch.Tensor:
            if self._direct_all_reduce(tensor, call.reduce_op):
                return tensor
            wire = _wire.to_wire(tensor, self._wire_device(tensor))
            op_name, kind = self._wire_reduction(tensor.dtype, call.reduce_op)
            buf = wire.to(kind)
            self._all_reduce(buf, op_name)
            self._finish_reduction(buf, call.reduce_op, wire)
            write_back(tensor, _wire.from_wire(wire, tensor.dtype, tuple(tensor.shape)))
            return tensor

        return self._issue("all_reduce", move, async_op)

    def _wire_reduction(self, dtype: torch.dtype, op: str) -> tuple[str, torch.dtype]:
        """The op the backend runs for ``op`` on ``dtype``, and the dtype it runs in."""
        wire_op = _wire.check_reducible(dtype, op)
        return ("sum" if wire_op == "avg" else wire_op), self._reduction_dtype(_wire.wire_dtype(dtype))

    def _finish_reduction(self, buf: torch.Tensor, op: str, out: torch.Tensor) -> None:
        """Scale an average and cast ``buf`` back into ``out`` (a no-op when they alias)."""
        if op == "avg":
            buf.div_(self.size)
        if buf.data_ptr() != out.data_ptr():
            out.copy_(buf)

    @overload
    def all_gather(
        self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None, async_op: Literal[False] = False
    ) -> list[torch.Tensor]: ...

    @overload
    def all_gather(
        self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None, async_op: Literal[True]
    ) -> Work[list[torch.Tensor]]: ...

    @_one_call_at_a_time
    def all_gather(
        self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None, async_op: bool = False
    ) -> Union[list[torch.Tensor], Work[list[torch.Tensor]]]:
        """Every rank's ``tensor``, in rank order, on every rank.

        Sizes along dim 0 may differ between ranks; dtype and the other
        dims must agree.

        Args:
            tensor: This rank's contribution.
            out: Optional preallocated result of shape
                ``(size * rows, *tensor.shape[1:])`` (``(size,)`` for a 0-d
                ``tensor``) and ``tensor``'s dtype, as in
                ``torch.distributed.all_gather_into_tensor``: every rank then
                sends the same number of rows, no sizes need to be agreed
                (so with ``verify=False`` no handshake runs), and a caller
                that gathers repeatedly reuses one buffer.
            async_op: See :meth:`broadcast`.

        Returns:
            One tensor per rank (views into one buffer, ``out`` when given),
            on ``tensor``'s device (``out``'s when given).
        """
        if out is not None:
            return self._issue("all_gather", self._all_gather_into(tensor, out, async_op), async_op)

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            return Call("all_gather", tensor.dtype, tuple(tensor.shape), count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        check_tensor_rows(rows)
        dims = [rows.count(r) for r in range(self.size)]

        def move() -> list[torch.Tensor]:
            shape = tuple(tensor.shape)
            wire = _wire.to_bytes(tensor, self._wire_device(tensor))
            per_row = tensor.dtype.itemsize * prod(shape[1:])
            counts = [d * per_row for d in dims]
            gathered = buffers.empty_like(wire, (sum(counts),))
            self._all_gather(gathered, wire, counts)
            return split_out(gathered, counts, dims, shape, tensor.dtype, tensor.device)

        return self._issue("all_gather", move, async_op)

    def _all_gather_into(
        self, tensor: torch.Tensor, out: torch.Tensor, async_op: bool
    ) -> Callable[[], list[torch.Tensor]]:
        """Check and agree on an all-gather into ``out``; the data movement that follows."""

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            check_output(out, tensor.dtype, gathered_shape(tuple(tensor.shape), self.size), "out")
            return Call("all_gather", tensor.dtype, tuple(tensor.shape), count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.count, what="number of rows (all_gather with out= needs equal sizes)")

        def move() -> list[torch.Tensor]:
            if not self._direct_all_gather(tensor, out):
                wire = _wire.to_bytes(tensor, self._wire_device(tensor))
                target = _wire.to_bytes(out, self._wire_device(out))
                self._all_gather(target, wire, [wire.numel()] * self.size)
                write_back(out, _wire.from_bytes(target, out.dtype, tuple(out.shape)))
            return list(out.unbind(0)) if tensor.dim() == 0 else list(out.chunk(self.size))

        return move

    @overload
    def reduce_scatter(
        self,
        inputs: Sequence[torch.Tensor],
        op: Any = "sum",
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def reduce_scatter(
        self,
        inputs: Sequence[torch.Tensor],
        op: Any = "sum",
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[True],
    ) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def reduce_scatter(
        self,
        inputs: Sequence[torch.Tensor],
        op: Any = "sum",
        *,
        out: Optional[torch.Tensor] = None,
        async_op: bool = False,
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Reduce ``inputs[r]`` across ranks and return the result to rank r.

        Args:
            inputs: One tensor per rank; ``inputs[r]`` must have the same
                shape on every rank (sizes may differ between r's). When they
                are consecutive pieces of one contiguous tensor (``t.split``,
                ``t.chunk``) they are sent from it without being copied.
            op: As for :meth:`all_reduce`.
            out: Optional tensor of ``inputs[self.rank]``'s shape and dtype
                to write the result into.
            async_op: See :meth:`broadcast`.

        Returns:
            The reduced ``inputs[self.rank]`` (``out`` when given), on its device.
        """

        def prepare() -> Call:
            shape = check_list(inputs, self.size, "inputs")
            name = _wire.normalize_reduce_op(op)
            _wire.check_reducible(inputs[0].dtype, name)
            self._reduction_dtype(_wire.wire_dtype(inputs[0].dtype))
            if out is not None:
                check_output(out, inputs[0].dtype, tuple(inputs[self.rank].shape), "out")
            sizes = [rows_of(tuple(t.shape)) for t in inputs]
            return Call("reduce_scatter", inputs[0].dtype, shape, reduce_op=name, splits_a=sizes)

        call, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.splits_a, what="size of each rank's chunk")
        return self._issue("reduce_scatter", lambda: self._move_reduce_scatter(inputs, call.reduce_op, out), async_op)

    def _move_reduce_scatter(
        self, inputs: Sequence[torch.Tensor], reduce_op: str, out: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The data movement of :meth:`reduce_scatter` (arguments checked and agreed)."""
        joined = consecutive(inputs)
        direct = self._direct_reduce_scatter(inputs, joined, reduce_op, out)
        if direct is not None:
            return direct
        dtype, device = inputs[0].dtype, inputs[0].device
        shape_r = tuple(inputs[self.rank].shape)
        op_name, kind = self._wire_reduction(dtype, reduce_op)
        if joined is not None and self._wire_device(joined) is None:
            inp = _wire.to_wire(joined, None).to(kind)
            counts = [t.numel() * (2 if dtype.is_complex else 1) for t in inputs]
        else:
            flat = [_wire.to_wire(t, self._wire_device(t)) for t in inputs]
            counts = [t.numel() for t in flat]
            inp = torch.cat(flat).to(kind)
        wire_out = None if out is None else _wire.to_wire(out, self._wire_device(out))
        if wire_out is not None and wire_out.dtype == kind:
            buf = wire_out
        else:
            buf = buffers.empty_like(inp, (counts[self.rank],))
        self._reduce_scatter(buf, inp, counts, op_name)
        if wire_out is None:
            wire = _wire.wire_dtype(dtype)
            wire_out = buf if buf.dtype == wire else torch.empty_like(buf, dtype=wire)
        self._finish_reduction(buf, reduce_op, wire_out)
        if out is None:
            return _wire.from_wire(wire_out, dtype, shape_r).to(device)
        write_back(out, _wire.from_wire(wire_out, dtype, shape_r))
        return out
