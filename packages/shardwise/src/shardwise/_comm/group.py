"""``Group``: the one interface between the core and a collective backend.

A backend implements a handful of primitives over flat, contiguous tensors
whose sizes every rank already knows (``_all_gather``, ``_all_to_all`` ...;
declared with the handshake in :mod:`shardwise._comm.group_base`). ``Group``
turns them into the public collectives: it validates arguments, agrees on
shapes and dtypes across ranks, stages tensors the backend cannot move
natively, and restores shapes and dtypes on the way out.

Agreement happens in a *handshake*: before the data moves, every rank
all-gathers one small int64 row describing its call (which collective, the
dtype, the trailing shape, the per-rank sizes, and whether its own
arguments were valid). Every rank sees the same rows, so every rank reaches
the same verdict: either all proceed, or all raise — a rank with a bad
argument raises the real error and its peers raise :class:`PeerError`
naming it, instead of one rank raising while the others wait forever.
Uneven collectives need the sizes anyway, so for them the handshake is
free; for the rest it can be turned off with ``verify=False`` (or
``SHARDWISE_VERIFY_COLLECTIVES=0``) at the cost of that protection.
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn, Optional, Sequence

import torch

from shardwise._comm import buffers as _memory

from shardwise._vocab import wire as _wire
from shardwise._comm.group_base import VERIFY_ENV, GroupBase, _global_ranks
from shardwise._comm.agreement import (
    STATUS_ERRORS,
    Call,
    check_list,
    check_output,
    check_splits,
    check_tensor,
    consecutive,
    gathered_shape,
    prod,
    rows_of,
    split_out,
    write_back,
)
from shardwise.errors import CollectiveMismatchError

__all__ = ["Group", "VERIFY_ENV"]


class Group(GroupBase):
    """A set of ranks that run collectives together.

    Public collectives are blocking and must be called by every rank of
    the group in the same order. Tensors may be on any device and of any
    layout: non-contiguous inputs are made contiguous, tensors that require
    grad are detached (use :mod:`shardwise._comm.autograd` for autograd), and
    tensors on a device the backend does not handle are staged through
    :attr:`device`. Results are new tensors unless the method says it works
    in place.

    Args:
        backend: Backend name (``"gloo"``).
        rank: This process's rank in the group.
        size: Number of ranks in the group.
        device: The device collectives run on natively.
        devices: Device types the backend moves without staging.
        verify: Run the handshake on every collective (default: True, or
            ``SHARDWISE_VERIFY_COLLECTIVES``).
        ranks: The global rank (rank in the world group) of each rank of
            this group, in group-rank order; None when they are the same
            numbers (the world group itself). Placements name global
            ranks; a group made by :meth:`new_group` learns them from its
            parent when its backend does not set them.
    """

    # -- public collectives --------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank of the group has reached it."""
        if self.verify:
            self._handshake(lambda: Call(op="barrier"))
        else:
            self._barrier()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place.

        Returns:
            ``tensor`` itself. Its dtype and shape must agree on all ranks.
        """

        def prepare() -> Call:
            self._check_root(src, "src")
            check_tensor(tensor, "tensor")
            return Call("broadcast", tensor.dtype, tuple(tensor.shape), root=src, count=tensor.numel())

        _, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.count, what="number of elements")
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        self._broadcast(wire, src)
        write_back(tensor, _wire.from_bytes(wire, tensor.dtype, tuple(tensor.shape)))
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """Reduce ``tensor`` across ranks in place.

        Args:
            tensor: Same dtype and shape on every rank.
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"product"``
                (or the matching ``torch.distributed.ReduceOp``). Bool
                tensors: sum/max are "or", min/product are "and".

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

        call, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.count, what="number of elements")
        wire = _wire.to_wire(tensor, self._wire_device(tensor))
        op_name, kind = self._wire_reduction(tensor.dtype, call.reduce_op)
        buf = wire.to(kind)
        self._all_reduce(buf, op_name)
        self._finish_reduction(buf, call.reduce_op, wire)
        write_back(tensor, _wire.from_wire(wire, tensor.dtype, tuple(tensor.shape)))
        return tensor

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

    def all_gather(self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
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

        Returns:
            One tensor per rank (views into one buffer, ``out`` when given),
            on ``tensor``'s device (``out``'s when given).
        """
        if out is not None:
            return self._all_gather_into(tensor, out)

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            return Call("all_gather", tensor.dtype, tuple(tensor.shape), count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        self._check_tensor_rows(rows)
        dims = [rows.count(r) for r in range(self.size)]
        shape = tuple(tensor.shape)
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        per_row = tensor.dtype.itemsize * prod(shape[1:])
        counts = [d * per_row for d in dims]
        out = _memory.empty_like(wire, (sum(counts),))
        self._all_gather(out, wire, counts)
        return split_out(out, counts, dims, shape, tensor.dtype, tensor.device)

    def _all_gather_into(self, tensor: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            check_output(out, tensor.dtype, gathered_shape(tuple(tensor.shape), self.size), "out")
            return Call("all_gather", tensor.dtype, tuple(tensor.shape), count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.count, what="number of rows (all_gather with out= needs equal sizes)")
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        target = _wire.to_bytes(out, self._wire_device(out))
        self._all_gather(target, wire, [wire.numel()] * self.size)
        write_back(out, _wire.from_bytes(target, out.dtype, tuple(out.shape)))
        return list(out.unbind(0)) if tensor.dim() == 0 else list(out.chunk(self.size))

    def reduce_scatter(
        self, inputs: Sequence[torch.Tensor], op: Any = "sum", *, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Reduce ``inputs[r]`` across ranks and return the result to rank r.

        Args:
            inputs: One tensor per rank; ``inputs[r]`` must have the same
                shape on every rank (sizes may differ between r's). When they
                are consecutive pieces of one contiguous tensor (``t.split``,
                ``t.chunk``) they are sent from it without being copied.
            op: As for :meth:`all_reduce`.
            out: Optional tensor of ``inputs[self.rank]``'s shape and dtype
                to write the result into.

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

        call, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.splits_a, what="size of each rank's chunk")
        dtype, device = inputs[0].dtype, inputs[0].device
        shape_r = tuple(inputs[self.rank].shape)
        op_name, kind = self._wire_reduction(dtype, call.reduce_op)
        joined = consecutive(inputs)
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
            buf = _memory.empty_like(inp, (counts[self.rank],))
        self._reduce_scatter(buf, inp, counts, op_name)
        if wire_out is None:
            wire = _wire.wire_dtype(dtype)
            wire_out = buf if buf.dtype == wire else torch.empty_like(buf, dtype=wire)
        self._finish_reduction(buf, call.reduce_op, wire_out)
        if out is None:
            return _wire.from_wire(wire_out, dtype, shape_r).to(device)
        write_back(out, _wire.from_wire(wire_out, dtype, shape_r))
        return out

    def all_to_all(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``inputs[r]`` to rank r; return what each rank sent here.

        Sizes along dim 0 may differ per destination; dtype and the other
        dims must agree everywhere.

        Returns:
            ``out[r]`` is what rank r sent to this rank (views into one buffer).
        """

        def prepare() -> Call:
            shape = check_list(inputs, self.size, "inputs")
            sizes = [rows_of(tuple(t.shape)) for t in inputs]
            return Call("all_to_all", inputs[0].dtype, shape, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        self._check_tensor_rows(rows)
        dtype, device, shape = inputs[0].dtype, inputs[0].device, tuple(inputs[0].shape)
        recv_dims = [rows.splits_a(r)[self.rank] for r in range(self.size)]
        flat = [_wire.to_bytes(t, self._wire_device(t)) for t in inputs]
        inp = torch.cat(flat)
        per_row = dtype.itemsize * prod(shape[1:])
        out_counts = [d * per_row for d in recv_dims]
        out = _memory.empty_like(inp, (sum(out_counts),))
        self._all_to_all(out, out_counts, inp, [t.numel() for t in flat])
        return split_out(out, out_counts, recv_dims, shape, dtype, device)

    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Split ``tensor`` along dim 0, send piece r to rank r, concatenate what arrives.

        Args:
            tensor: At least 1-D; other dims and dtype agree on all ranks.
            output_split_sizes: Rows to receive from each rank; derived from
                the senders when None (and checked against them when given),
                or an equal split of ``out`` when ``out`` is given.
            input_split_sizes: Rows to send to each rank; an equal split
                when None (dim 0 must then divide by the group size).
            out: Optional preallocated result (``tensor``'s dtype and
                trailing dims). With ``out`` or both split sizes every rank
                knows the sizes, so with ``verify=False`` no handshake runs.

        Returns:
            The received rows: ``out`` when given, else a new tensor of
            ``sum(output_split_sizes)`` rows.
        """

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            if tensor.dim() == 0:
                raise ValueError("all_to_all_single needs a tensor with at least one dimension")
            rows_in = tensor.shape[0]
            ins = check_splits(input_split_sizes, rows_in, self.size, "input_split_sizes")
            outs = list(output_split_sizes) if output_split_sizes is not None else []
            if out is not None:
                if out.dim() == 0:
                    raise ValueError("all_to_all_single: out needs at least one dimension")
                check_output(out, tensor.dtype, (out.shape[0], *tensor.shape[1:]), "out")
                outs = check_splits(output_split_sizes, out.shape[0], self.size, "output_split_sizes")
            elif output_split_sizes is not None:
                check_splits(outs, sum(outs), self.size, "output_split_sizes")
            return Call("all_to_all", tensor.dtype, tuple(tensor.shape), count=int(bool(outs) or out is not None),
                        splits_a=ins, splits_b=outs)

        need = output_split_sizes is None and out is None
        call, rows = self._handshake(prepare, required=need)
        ins = list(call.splits_a)
        if rows is not None:
            self._check_tensor_rows(rows)
            outs = [rows.splits_a(r)[self.rank] for r in range(self.size)]
            for r in range(self.size):
                expected = [rows.splits_a(s)[r] for s in range(self.size)]
                if rows.count(r) and rows.splits_b(r) != expected:
                    raise CollectiveMismatchError(
                        f"all_to_all_single: rank {r} expects to receive {rows.splits_b(r)} rows "
                        f"but the ranks send it {expected}"
                    )
        else:
            outs = list(call.splits_b)
        shape = tuple(tensor.shape)
        per_row = tensor.dtype.itemsize * prod(shape[1:])
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        if out is None:
            target = _memory.empty_like(wire, (sum(outs) * per_row,))
        else:
            target = _wire.to_bytes(out, self._wire_device(out))
        self._all_to_all(target, [o * per_row for o in outs], wire, [i * per_row for i in ins])
        if out is None:
            return _wire.from_bytes(target, tensor.dtype, (sum(outs), *shape[1:])).to(tensor.device)
        write_back(out, _wire.from_bytes(target, out.dtype, tuple(out.shape)))
        return out

    def scatter(self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0) -> torch.Tensor:
        """Send ``tensors[r]`` from ``src`` to rank r.

        Args:
            tensors: On ``src``, one tensor per rank (dim 0 may differ);
                ignored elsewhere (pass None).
            src: The sending rank.

        Returns:
            This rank's piece, on :attr:`device` (on ``src``: on the
            device of ``tensors[src]``).
        """

        def prepare() -> Call:
            self._check_root(src, "src")
            if self.rank != src:
                return Call("scatter", root=src)
            if tensors is None:
                raise ValueError(f"scatter: rank {src} is the source and must pass one tensor per rank, got None")
            shape = check_list(tensors, self.size, "tensors")
            sizes = [rows_of(tuple(t.shape)) for t in tensors]
            return Call("scatter", tensors[0].dtype, shape, root=src, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        dtype = rows.dtype(src)
        assert dtype is not None
        ndim, trailing = rows.ndim(src), rows.trailing(src)
        my_rows = rows.splits_a(src)[self.rank]
        per_row = dtype.itemsize * prod(trailing)
        out_shape = (my_rows, *trailing) if ndim > 0 else ()
        if self.rank == src:
            assert tensors is not None
            flat = [_wire.to_bytes(t, self._wire_device(t)) for t in tensors]
            inp: Optional[torch.Tensor] = torch.cat(flat)
            device = tensors[src].device
            out = _memory.empty_like(flat[0], (my_rows * per_row,))
        else:
            inp, device = None, self._device
            out = _memory.empty((my_rows * per_row,), torch.uint8, self._device)
        counts = [n * per_row for n in rows.splits_a(src)]
        self._scatter(out, inp, counts, src)
        return _wire.from_bytes(out, dtype, out_shape).to(device)

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Collect every rank's ``tensor`` on ``dst``.

        Sizes along dim 0 may differ; dtype and other dims must agree.

        Returns:
            On ``dst``, one tensor per rank (views into one buffer); None elsewhere.
        """

        def prepare() -> Call:
            self._check_root(dst, "dst")
            check_tensor(tensor, "tensor")
            return Call("gather", tensor.dtype, tuple(tensor.shape), root=dst, count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        self._check_tensor_rows(rows)
        shape = tuple(tensor.shape)
        per_row = tensor.dtype.itemsize * prod(shape[1:])
        dims = [rows.count(r) for r in range(self.size)]
        counts = [d * per_row for d in dims]
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        out = _memory.empty_like(wire, (sum(counts),)) if self.rank == dst else None
        self._gather(out, counts, wire, dst)
        if out is None:
            return None
        return split_out(out, counts, dims, shape, tensor.dtype, tensor.device)

    def exchange(self, obj: Any, *, op: Optional[str] = None) -> list[Any]:
        """All-gather a small JSON-safe object from every rank.

        The object is encoded as strict JSON (never pickled), so a peer
        cannot make this rank run code; tuples come back as lists.

        Args:
            obj: What this rank contributes.
            op: The API call this exchange belongs to (``"shard_tensor"``),
                named in the :class:`PeerError` raised here when a peer
                rejects its part (:meth:`reject`); default ``"exchange"``.

        Returns:
            ``[obj_of_rank_0, obj_of_rank_1, ...]``.

        Raises:
            TypeError: ``obj`` is not JSON-safe (on this rank; the others
                raise :class:`PeerError`, and nothing is sent).
        """
        payload: list[bytes] = []

        def prepare() -> Call:
            payload.append(_wire.encode_json(obj))
            return Call("exchange", count=len(payload[0]))

        _, rows = self._handshake(prepare, required=True, label=op)
        assert rows is not None
        counts = [rows.count(r) for r in range(self.size)]
        raw = bytearray(payload[0])
        inp = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(counts), dtype=torch.uint8, device=self._device)
        self._moving = op
        try:
            self._all_gather(out, inp.to(self._device), counts)
        finally:
            self._moving = None
        host = out.cpu()
        data = ctypes.string_at(host.data_ptr(), host.numel()) if host.numel() else b""
        results, offset = [], 0
        for r, n in enumerate(counts):
            results.append(_wire.decode_json(data[offset:offset + n], f"rank {r}"))
            offset += n
        return results

    def reject(self, error: Exception, *, op: Optional[str] = None) -> NoReturn:
        """Fail this rank's part of the collective its peers are entering.

        For code that validates its own arguments before calling a
        collective: instead of raising alone (and leaving the peers waiting
        in the collective), the rank joins the handshake with a failure, so
        every peer raises :class:`PeerError` naming this rank, and this rank
        raises ``error``. No data moves.

        Args:
            error: A ``TypeError``, ``ValueError`` or ``IndexError``.
            op: The API call being rejected; see :meth:`exchange`.

        Raises:
            The given ``error`` on this rank (always).
        """
        if not isinstance(error, STATUS_ERRORS):
            raise TypeError(f"reject() takes a TypeError, ValueError or IndexError, got {type(error).__name__}")

        def prepare() -> Call:
            raise error

        self._handshake(prepare, required=True, label=op)
        raise AssertionError("unreachable: the handshake re-raises the rejected error")

    def new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        """A sub-group of ``ranks`` (ranks of this group), made collectively.

        Every rank of this group must call it with the same ``ranks``.

        Returns:
            The sub-group on its members (its ranks renumbered 0..n-1 in
            ``ranks`` order sorted), None on the other ranks.
        """

        def prepare() -> Call:
            members = list(ranks)
            if not members or len(set(members)) != len(members):
                raise ValueError(f"new_group: ranks must be distinct and non-empty, got {members!r}")
            for r in members:
                self._check_root(r, "rank")
            mask = [1 if r in members else 0 for r in range(self.size)]
            return Call("new_group", splits_a=mask)

        call, rows = self._handshake(prepare)
        if rows is not None:
            # Compare the member lists, not the 0/1 masks that carry them (which read like rank lists).
            self._check_same(rows, lambda r: [m for m, flag in enumerate(rows.splits_a(r)) if flag],
                             what="members of the new group")
        members = [r for r, flag in enumerate(call.splits_a) if flag]
        sub = self._new_group(members)
        if sub is not None and sub._global_ranks is None:
            # The backend numbered the sub-group only within itself; its members' global ranks follow from ours.
            sub._set_global_ranks([self.ranks[m] for m in members])
        return sub

    def _set_global_ranks(self, ranks: Sequence[int]) -> None:
        """Record the members' global ranks after construction (see ``ranks`` in the class docstring)."""
        self._global_ranks = _global_ranks(ranks, self._size)
        self._rank_of = None if self._global_ranks is None else {g: r for r, g in enumerate(self._global_ranks)}

