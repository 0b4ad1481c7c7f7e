"""``Group``: the one interface between the core and a collective backend.

A backend implements a handful of primitives over flat, contiguous tensors
whose sizes every rank already knows (``_all_gather``, ``_all_to_all`` ...).
This base class turns them into the public collectives: it validates
arguments, agrees on shapes and dtypes across ranks, stages tensors the
backend cannot move natively, and restores shapes and dtypes on the way out.

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

import abc
import ctypes
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from shardwise import _wire
from shardwise.errors import CollectiveMismatchError, PeerError

__all__ = ["Group", "VERIFY_ENV"]

VERIFY_ENV = "SHARDWISE_VERIFY_COLLECTIVES"

_OPS = (
    "barrier", "broadcast", "all_reduce", "all_gather", "reduce_scatter",
    "all_to_all", "scatter", "gather", "exchange", "new_group",
)
_STATUS_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, IndexError)
_HEADER = 8  # op, dtype, status, ndim, root, reduce op, count, reserved
_MAX_DIMS = 16
_NO_TENSOR = -1


@dataclass
class _Call:
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
        row[1] = _wire.dtype_code(self.dtype) if self.dtype is not None else _NO_TENSOR
        row[3] = _NO_TENSOR if self.shape is None else len(self.shape)
        row[4] = self.root
        row[5] = _wire.REDUCE_OPS.index(self.reduce_op) if self.reduce_op else _NO_TENSOR
        row[6] = self.count
        if self.shape is not None:
            if len(self.shape) > _MAX_DIMS + 1:
                raise ValueError(f"collectives take tensors of at most {_MAX_DIMS + 1} dims, got {len(self.shape)}")
            row[_HEADER:_HEADER + len(self.shape) - 1] = list(self.shape[1:])
        base = _HEADER + _MAX_DIMS
        row[base:base + len(self.splits_a)] = list(self.splits_a)
        row[base + size:base + size + len(self.splits_b)] = list(self.splits_b)
        return row


class _Rows:
    """The handshake result: every rank's row, decoded on demand."""

    def __init__(self, table: list[list[int]], size: int) -> None:
        self.table = table
        self.size = size

    def op(self, r: int) -> str:
        code = self.table[r][0]
        return _OPS[code] if 0 <= code < len(_OPS) else f"<unknown op {code}>"

    def dtype(self, r: int) -> Optional[torch.dtype]:
        code = self.table[r][1]
        return None if code == _NO_TENSOR else _wire.DTYPES[code]

    def ndim(self, r: int) -> int:
        return self.table[r][3]

    def trailing(self, r: int) -> tuple[int, ...]:
        ndim = self.ndim(r)
        return tuple(self.table[r][_HEADER:_HEADER + max(ndim - 1, 0)])

    def root(self, r: int) -> int:
        return self.table[r][4]

    def reduce_op(self, r: int) -> int:
        return self.table[r][5]

    def count(self, r: int) -> int:
        return self.table[r][6]

    def splits_a(self, r: int) -> list[int]:
        base = _HEADER + _MAX_DIMS
        return self.table[r][base:base + self.size]

    def splits_b(self, r: int) -> list[int]:
        base = _HEADER + _MAX_DIMS + self.size
        return self.table[r][base:base + self.size]


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _rows_of(shape: tuple[int, ...]) -> int:
    """Length along dim 0, with a 0-d tensor counted as one row."""
    return shape[0] if shape else 1


class Group(abc.ABC):
    """A set of ranks that run collectives together.

    Public collectives are blocking and must be called by every rank of
    the group in the same order. Tensors may be on any device and of any
    layout: non-contiguous inputs are made contiguous, tensors that require
    grad are detached (use :mod:`shardwise.nn.functional` for autograd), and
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
    """

    def __init__(
        self,
        *,
        backend: str,
        rank: int,
        size: int,
        device: torch.device,
        devices: Sequence[str] = ("cpu",),
        verify: Optional[bool] = None,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self._backend = backend
        self._rank = rank
        self._size = size
        self._device = torch.device(device)
        self._devices = frozenset(devices)
        if verify is None:
            verify = os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        self.verify = verify

    # -- identity ------------------------------------------------------------
    @property
    def backend(self) -> str:
        """Name of the backend that moves this group's data."""
        return self._backend

    @property
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < size``."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return self._size

    @property
    def device(self) -> torch.device:
        """Device whose tensors the backend moves natively."""
        return self._device

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend!r} rank={self.rank} size={self.size} device={self.device}>"

    # -- primitives a backend implements -------------------------------------
    @abc.abstractmethod
    def _barrier(self) -> None:
        """Block until every rank has called it."""

    @abc.abstractmethod
    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        """Overwrite ``buf`` on every rank with ``src``'s ``buf``."""

    @abc.abstractmethod
    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        """Reduce ``buf`` in place with ``op`` (sum, min, max or product)."""

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        """Fill ``out`` with every rank's ``inp`` in rank order; ``counts[r]`` is rank r's length."""

    @abc.abstractmethod
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """Reduce ``inp`` (the concatenation of per-rank chunks of ``counts``) and keep this rank's chunk in ``out``."""

    @abc.abstractmethod
    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        """Send ``in_counts[r]`` elements of ``inp`` to rank r; receive ``out_counts[r]`` from it."""

    @abc.abstractmethod
    def _new_group(self, ranks: Sequence[int]) -> Optional["Group"]:
        """A group of ``ranks`` (sorted ranks of this group); None on non-members."""

    def _gather(self, out: Optional[torch.Tensor], counts: Sequence[int], inp: torch.Tensor, dst: int) -> None:
        """Concatenate every rank's ``inp`` into ``out`` on ``dst`` (default: an all-to-all with one receiver)."""
        in_counts = [0] * self.size
        in_counts[dst] = inp.numel()
        out_counts = list(counts) if self.rank == dst else [0] * self.size
        buf = out if out is not None else inp.new_empty(0)
        self._all_to_all(buf, out_counts, inp, in_counts)

    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        """Send chunk r of ``inp`` (lengths ``counts``) from ``src`` to rank r (default: an all-to-all with one sender)."""
        in_counts = list(counts) if self.rank == src else [0] * self.size
        out_counts = [0] * self.size
        out_counts[src] = out.numel()
        self._all_to_all(out, out_counts, inp if inp is not None else out.new_empty(0), in_counts)

    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Dtype the backend reduces ``dtype`` values in (override to upcast).

        Raises:
            TypeError: the backend cannot reduce this dtype at all.
        """
        return dtype

    def destroy(self) -> None:
        """Release the backend's resources; the group is unusable afterwards."""

    # -- handshake -----------------------------------------------------------
    def _wire_device(self, tensor: torch.Tensor) -> Optional[torch.device]:
        return None if tensor.device.type in self._devices else self._device

    def _handshake(self, prepare: Callable[[], _Call], *, required: bool = False) -> tuple[_Call, Optional[_Rows]]:
        """Validate locally, then (if verifying) agree with every rank.

        ``prepare`` raises TypeError/ValueError/IndexError for bad local
        arguments; with the handshake those are reported to every rank.
        """
        if not (self.verify or required):
            return prepare(), None
        error: Optional[Exception] = None
        try:
            call = prepare()
            row = call.encode(self.size)
        except _STATUS_ERRORS as exc:
            error = exc
            call = _Call(op="barrier")
            row = call.encode(self.size)
            row[2] = 1 + next(i for i, kind in enumerate(_STATUS_ERRORS) if isinstance(exc, kind))
        width = len(row)
        mine = torch.tensor(row, dtype=torch.int64, device=self._device)
        table = torch.empty(width * self.size, dtype=torch.int64, device=self._device)
        self._all_gather(table, mine, [width] * self.size)
        rows = _Rows(table.view(self.size, width).tolist(), self.size)
        failed = [r for r in range(self.size) if rows.table[r][2] != 0]
        if error is not None:
            raise error
        if failed:
            kinds = {1: "TypeError", 2: "ValueError", 3: "IndexError"}
            desc = ", ".join(f"rank {r} ({kinds.get(rows.table[r][2], 'error')})" for r in failed)
            raise PeerError(
                f"{call.op}: {desc} rejected its arguments, so no data was sent; "
                "see that rank's traceback for the cause"
            )
        ops = {rows.op(r) for r in range(self.size)}
        if len(ops) > 1:
            calls = ", ".join(f"rank {r}: {rows.op(r)}" for r in range(self.size))
            raise CollectiveMismatchError(
                f"ranks called different collectives at the same point ({calls}); "
                "every rank must call the same collectives in the same order"
            )
        self._check_same(rows, rows.root, what="root rank")
        self._check_same(rows, rows.reduce_op, what="reduce op")
        return call, rows

    def _check_same(self, rows: _Rows, get: Callable[[int], Any], *, what: str) -> None:
        values = {r: get(r) for r in range(self.size)}
        if len(set(map(repr, values.values()))) > 1:
            shown = ", ".join(f"rank {r}: {_show(v)}" for r, v in values.items())
            raise CollectiveMismatchError(f"{rows.op(self.rank)}: ranks disagree on the {what} ({shown})")

    def _check_tensor_rows(self, rows: _Rows) -> None:
        self._check_same(rows, rows.dtype, what="dtype")
        self._check_same(rows, rows.ndim, what="number of dimensions")
        self._check_same(rows, rows.trailing, what="shape after dim 0")

    def _check_root(self, root: int, name: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"{name}={root!r} is not a rank of this group (size {self.size})")

    # -- public collectives --------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank of the group has reached it."""
        if self.verify:
            self._handshake(lambda: _Call(op="barrier"))
        else:
            self._barrier()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place.

        Returns:
            ``tensor`` itself. Its dtype and shape must agree on all ranks.
        """

        def prepare() -> _Call:
            self._check_root(src, "src")
            _check_tensor(tensor, "tensor")
            return _Call("broadcast", tensor.dtype, tuple(tensor.shape), root=src, count=tensor.numel())

        _, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.count, what="number of elements")
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        self._broadcast(wire, src)
        _write_back(tensor, _wire.from_bytes(wire, tensor.dtype, tuple(tensor.shape)))
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

        def prepare() -> _Call:
            _check_tensor(tensor, "tensor")
            name = _wire.normalize_reduce_op(op)
            _wire.check_reducible(tensor.dtype, name)
            self._reduction_dtype(_wire.wire_dtype(tensor.dtype))
            return _Call("all_reduce", tensor.dtype, tuple(tensor.shape), reduce_op=name, count=tensor.numel())

        call, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.count, what="number of elements")
        wire = _wire.to_wire(tensor, self._wire_device(tensor))
        op_name, kind = self._wire_reduction(tensor.dtype, call.reduce_op)
        buf = wire.to(kind)
        self._all_reduce(buf, op_name)
        self._finish_reduction(buf, call.reduce_op, wire)
        _write_back(tensor, _wire.from_wire(wire, tensor.dtype, tuple(tensor.shape)))
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

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order, on every rank.

        Sizes along dim 0 may differ between ranks; dtype and the other
        dims must agree.

        Returns:
            One tensor per rank (views into one buffer), on ``tensor``'s device.
        """

        def prepare() -> _Call:
            _check_tensor(tensor, "tensor")
            return _Call("all_gather", tensor.dtype, tuple(tensor.shape), count=_rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        self._check_tensor_rows(rows)
        dims = [rows.count(r) for r in range(self.size)]
        shape = tuple(tensor.shape)
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        per_row = tensor.dtype.itemsize * _prod(shape[1:])
        counts = [d * per_row for d in dims]
        out = wire.new_empty(sum(counts))
        self._all_gather(out, wire, counts)
        return _split_out(out, counts, dims, shape, tensor.dtype, tensor.device)

    def reduce_scatter(self, inputs: Sequence[torch.Tensor], op: Any = "sum") -> torch.Tensor:
        """Reduce ``inputs[r]`` across ranks and return the result to rank r.

        Args:
            inputs: One tensor per rank; ``inputs[r]`` must have the same
                shape on every rank (sizes may differ between r's).
            op: As for :meth:`all_reduce`.

        Returns:
            The reduced ``inputs[self.rank]``, on its device.
        """

        def prepare() -> _Call:
            shape = _check_list(inputs, self.size, "inputs")
            name = _wire.normalize_reduce_op(op)
            _wire.check_reducible(inputs[0].dtype, name)
            self._reduction_dtype(_wire.wire_dtype(inputs[0].dtype))
            sizes = [_rows_of(tuple(t.shape)) for t in inputs]
            return _Call("reduce_scatter", inputs[0].dtype, shape, reduce_op=name, splits_a=sizes)

        call, rows = self._handshake(prepare)
        if rows is not None:
            self._check_tensor_rows(rows)
            self._check_same(rows, rows.splits_a, what="size of each rank's chunk")
        dtype, device = inputs[0].dtype, inputs[0].device
        shape_r = tuple(inputs[self.rank].shape)
        op_name, kind = self._wire_reduction(dtype, call.reduce_op)
        flat = [_wire.to_wire(t, self._wire_device(t)) for t in inputs]
        counts = [t.numel() for t in flat]
        inp = torch.cat(flat).to(kind)
        buf = inp.new_empty(counts[self.rank])
        self._reduce_scatter(buf, inp, counts, op_name)
        out = buf if buf.dtype == flat[0].dtype else torch.empty_like(buf, dtype=flat[0].dtype)
        self._finish_reduction(buf, call.reduce_op, out)
        return _wire.from_wire(out, dtype, shape_r).to(device)

    def all_to_all(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``inputs[r]`` to rank r; return what each rank sent here.

        Sizes along dim 0 may differ per destination; dtype and the other
        dims must agree everywhere.

        Returns:
            ``out[r]`` is what rank r sent to this rank (views into one buffer).
        """

        def prepare() -> _Call:
            shape = _check_list(inputs, self.size, "inputs", same_shape=False)
            sizes = [_rows_of(tuple(t.shape)) for t in inputs]
            return _Call("all_to_all", inputs[0].dtype, shape, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        self._check_tensor_rows(rows)
        dtype, device, shape = inputs[0].dtype, inputs[0].device, tuple(inputs[0].shape)
        recv_dims = [rows.splits_a(r)[self.rank] for r in range(self.size)]
        flat = [_wire.to_bytes(t, self._wire_device(t)) for t in inputs]
        inp = torch.cat(flat)
        per_row = dtype.itemsize * _prod(shape[1:])
        out_counts = [d * per_row for d in recv_dims]
        out = inp.new_empty(sum(out_counts))
        self._all_to_all(out, out_counts, inp, [t.numel() for t in flat])
        return _split_out(out, out_counts, recv_dims, shape, dtype, device)

    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """Split ``tensor`` along dim 0, send piece r to rank r, concatenate what arrives.

        Args:
            tensor: At least 1-D; other dims and dtype agree on all ranks.
            output_split_sizes: Rows to receive from each rank; derived from
                the senders when None (and checked against them when given).
            input_split_sizes: Rows to send to each rank; an equal split
                when None (dim 0 must then divide by the group size).

        Returns:
            A new tensor of ``sum(output_split_sizes)`` rows.
        """

        def prepare() -> _Call:
            _check_tensor(tensor, "tensor")
            if tensor.dim() == 0:
                raise ValueError("all_to_all_single needs a tensor with at least one dimension")
            rows_in = tensor.shape[0]
            ins = _splits(input_split_sizes, rows_in, self.size, "input_split_sizes")
            outs = list(output_split_sizes) if output_split_sizes is not None else []
            if output_split_sizes is not None:
                _splits(outs, sum(outs), self.size, "output_split_sizes")
            return _Call("all_to_all", tensor.dtype, tuple(tensor.shape), count=int(output_split_sizes is not None),
                         splits_a=ins, splits_b=outs)

        need = not (output_split_sizes is not None and input_split_sizes is not None)
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
        per_row = tensor.dtype.itemsize * _prod(shape[1:])
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        out = wire.new_empty(sum(outs) * per_row)
        self._all_to_all(out, [o * per_row for o in outs], wire, [i * per_row for i in ins])
        return _wire.from_bytes(out, tensor.dtype, (sum(outs), *shape[1:])).to(tensor.device)

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

        def prepare() -> _Call:
            self._check_root(src, "src")
            if self.rank != src:
                return _Call("scatter", root=src)
            if tensors is None:
                raise ValueError(f"scatter: rank {src} is the source and must pass one tensor per rank, got None")
            shape = _check_list(tensors, self.size, "tensors", same_shape=False)
            sizes = [_rows_of(tuple(t.shape)) for t in tensors]
            return _Call("scatter", tensors[0].dtype, shape, root=src, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        dtype = rows.dtype(src)
        assert dtype is not None
        ndim, trailing = rows.ndim(src), rows.trailing(src)
        my_rows = rows.splits_a(src)[self.rank]
        per_row = dtype.itemsize * _prod(trailing)
        out_shape = (my_rows, *trailing) if ndim > 0 else ()
        if self.rank == src:
            assert tensors is not None
            flat = [_wire.to_bytes(t, self._wire_device(t)) for t in tensors]
            inp: Optional[torch.Tensor] = torch.cat(flat)
            device = tensors[src].device
            out = flat[0].new_empty(my_rows * per_row)
        else:
            inp, device = None, self._device
            out = torch.empty(my_rows * per_row, dtype=torch.uint8, device=self._device)
        counts = [n * per_row for n in rows.splits_a(src)]
        self._scatter(out, inp, counts, src)
        return _wire.from_bytes(out, dtype, out_shape).to(device)

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Collect every rank's ``tensor`` on ``dst``.

        Sizes along dim 0 may differ; dtype and other dims must agree.

        Returns:
            On ``dst``, one tensor per rank (views into one buffer); None elsewhere.
        """

        def prepare() -> _Call:
            self._check_root(dst, "dst")
            _check_tensor(tensor, "tensor")
            return _Call("gather", tensor.dtype, tuple(tensor.shape), root=dst, count=_rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        self._check_tensor_rows(rows)
        shape = tuple(tensor.shape)
        per_row = tensor.dtype.itemsize * _prod(shape[1:])
        dims = [rows.count(r) for r in range(self.size)]
        counts = [d * per_row for d in dims]
        wire = _wire.to_bytes(tensor, self._wire_device(tensor))
        out = wire.new_empty(sum(counts)) if self.rank == dst else None
        self._gather(out, counts, wire, dst)
        if out is None:
            return None
        return _split_out(out, counts, dims, shape, tensor.dtype, tensor.device)

    def exchange(self, obj: Any) -> list[Any]:
        """All-gather a small JSON-safe object from every rank.

        The object is encoded as strict JSON (never pickled), so a peer
        cannot make this rank run code; tuples come back as lists.

        Returns:
            ``[obj_of_rank_0, obj_of_rank_1, ...]``.

        Raises:
            TypeError: ``obj`` is not JSON-safe (on this rank; the others
                raise :class:`PeerError`, and nothing is sent).
        """
        payload: list[bytes] = []

        def prepare() -> _Call:
            payload.append(_wire.encode_json(obj))
            return _Call("exchange", count=len(payload[0]))

        _, rows = self._handshake(prepare, required=True)
        assert rows is not None
        counts = [rows.count(r) for r in range(self.size)]
        inp = torch.frombuffer(bytearray(payload[0]), dtype=torch.uint8) if counts[self.rank] else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(counts), dtype=torch.uint8, device=self._device)
        self._all_gather(out, inp.to(self._device), counts)
        host = out.cpu()
        data = ctypes.string_at(host.data_ptr(), host.numel()) if host.numel() else b""
        results, offset = [], 0
        for n in counts:
            results.append(_wire.decode_json(data[offset:offset + n]))
            offset += n
        return results

    def new_group(self, ranks: Sequence[int]) -> Optional["Group"]:
        """A sub-group of ``ranks`` (ranks of this group), made collectively.

        Every rank of this group must call it with the same ``ranks``.

        Returns:
            The sub-group on its members (its ranks renumbered 0..n-1 in
            ``ranks`` order sorted), None on the other ranks.
        """

        def prepare() -> _Call:
            members = list(ranks)
            if not members or len(set(members)) != len(members):
                raise ValueError(f"new_group: ranks must be distinct and non-empty, got {members!r}")
            for r in members:
                self._check_root(r, "rank")
            mask = [1 if r in members else 0 for r in range(self.size)]
            return _Call("new_group", splits_a=mask)

        call, rows = self._handshake(prepare)
        if rows is not None:
            self._check_same(rows, rows.splits_a, what="members of the new group")
        members = [r for r, flag in enumerate(call.splits_a) if flag]
        return self._new_group(members)


def _show(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if value == _NO_TENSOR:
        return "none"
    return str(value)


def _check_tensor(tensor: Any, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    _wire.dtype_code(tensor.dtype)
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"{name} has layout {tensor.layout}; collectives take dense (strided) tensors")


def _check_list(tensors: Any, size: int, name: str, *, same_shape: bool = False) -> tuple[int, ...]:
    """Validate one tensor per rank; returns the first tensor's shape."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list of {size} tensors, got {type(tensors).__name__}")
    if len(tensors) != size:
        raise ValueError(f"{name} must hold one tensor per rank ({size}), got {len(tensors)}")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{name}[{i}]")
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


def _splits(splits: Optional[Sequence[int]], total: int, size: int, name: str) -> list[int]:
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


def _write_back(tensor: torch.Tensor, result: torch.Tensor) -> None:
    """Copy ``result`` into ``tensor`` unless it already lives in ``tensor``'s memory."""
    target = tensor.detach()
    if result.device == target.device and result.untyped_storage().data_ptr() == target.untyped_storage().data_ptr():
        return
    target.copy_(result.to(tensor.device))


def _split_out(
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
    for n, d in zip(counts, dims):
        piece_shape = (d, *shape[1:]) if shape else ()
        pieces.append(_wire.from_bytes(out[offset:offset + n], dtype, piece_shape))
        offset += n
    return pieces
