"""The public collectives of a :class:`~shardwise._comm.group.Group` that exchange per-rank pieces.

The fifth of ``Group``'s private base classes (the chain is described in :mod:`shardwise._comm.group_core`):
``all_to_all``, ``all_to_all_single``, ``scatter`` and ``gather``, whose pieces may differ in size per rank, and
the JSON helpers built on the last two (``gather_json``, ``scatter_json``: an agreement, then one of them). Kept
apart from :mod:`shardwise._comm.group_collectives` only to keep each module short.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union, overload

import torch

from shardwise._comm import buffers
from shardwise._comm.agreement import Call, check_all_to_all_rows, check_tensor_rows
from shardwise._comm.checks import (
    all_to_all_single_call,
    check_list,
    check_root,
    check_tensor,
    prod,
    rows_of,
    split_out,
    write_back,
)
from shardwise._comm.group_agreement import _byte_tensor
from shardwise._comm.group_calls import _one_call_at_a_time
from shardwise._comm.group_collectives import GroupCollectives
from shardwise._comm.work import Work
from shardwise._vocab import wire as _wire


class GroupExchanges(GroupCollectives):
    """All-to-all, scatter and gather (and their JSON forms) of a :class:`~shardwise._comm.group.Group`."""

    # -- public collectives, continued (see the comment in shardwise._comm.group_collectives) --
    @overload
    def all_to_all(self, inputs: Sequence[torch.Tensor], *, async_op: Literal[False] = False) -> list[torch.Tensor]: ...

    @overload
    def all_to_all(self, inputs: Sequence[torch.Tensor], *, async_op: Literal[True]) -> Work[list[torch.Tensor]]: ...

    @_one_call_at_a_time
    def all_to_all(
        self, inputs: Sequence[torch.Tensor], *, async_op: bool = False
    ) -> Union[list[torch.Tensor], Work[list[torch.Tensor]]]:
        """Send ``inputs[r]`` to rank r; return what each rank sent here.

        Sizes along dim 0 may differ per destination; dtype and the other
        dims must agree everywhere.

        Args:
            inputs: One tensor per rank.
            async_op: See :meth:`broadcast`.

        Returns:
            ``out[r]`` is what rank r sent to this rank (views into one buffer).
        """

        def prepare() -> Call:
            shape = check_list(inputs, self.size, "inputs")
            sizes = [rows_of(tuple(t.shape)) for t in inputs]
            return Call("all_to_all", inputs[0].dtype, shape, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        check_tensor_rows(rows)
        recv_dims = [rows.splits_a(r)[self.rank] for r in range(self.size)]

        def move() -> list[torch.Tensor]:
            dtype, device, shape = inputs[0].dtype, inputs[0].device, tuple(inputs[0].shape)
            flat = [_wire.to_bytes(t, self._wire_device(t)) for t in inputs]
            inp = torch.cat(flat)
            per_row = dtype.itemsize * prod(shape[1:])
            out_counts = [d * per_row for d in recv_dims]
            received = buffers.empty_like(inp, (sum(out_counts),))
            self._all_to_all(received, out_counts, inp, [t.numel() for t in flat])
            return split_out(received, out_counts, recv_dims, shape, dtype, device)

        return self._issue("all_to_all", move, async_op)

    @overload
    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[True],
    ) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
        async_op: bool = False,
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
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
            async_op: See :meth:`broadcast`.

        Returns:
            The received rows: ``out`` when given, else a new tensor of
            ``sum(output_split_sizes)`` rows.
        """
        need = not output_split_sizes and out is None
        call, rows = self._handshake(
            lambda: all_to_all_single_call(tensor, output_split_sizes, input_split_sizes, out, self.size),
            required=need,
            async_op=async_op,
        )
        ins = list(call.splits_a)
        if rows is not None:
            check_tensor_rows(rows)
            check_all_to_all_rows(rows)
            outs = [rows.splits_a(r)[self.rank] for r in range(self.size)]
        else:
            outs = list(call.splits_b)

        def move() -> torch.Tensor:
            # In place (``out`` is ``tensor``, or overlaps it): rows would arrive over rows not yet sent, which
            # torch's gloo and MPI leave undefined. Send from a copy.
            sent = tensor.clone() if out is not None and _wire.shares_memory(tensor, out) else tensor
            direct = self._direct_all_to_all_single(sent, outs, ins, out)
            if direct is not None:
                return direct
            shape = tuple(sent.shape)
            per_row = sent.dtype.itemsize * prod(shape[1:])
            wire = _wire.to_bytes(sent, self._wire_device(sent))
            if out is None:
                target = buffers.empty_like(wire, (sum(outs) * per_row,))
            else:
                target = _wire.to_bytes(out, self._wire_device(out))
            self._all_to_all(target, [o * per_row for o in outs], wire, [i * per_row for i in ins])
            if out is None:
                return _wire.from_bytes(target, tensor.dtype, (sum(outs), *shape[1:])).to(tensor.device)
            write_back(out, _wire.from_bytes(target, out.dtype, tuple(out.shape)))
            return out

        return self._issue("all_to_all_single", move, async_op)

    @overload
    def scatter(
        self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0, *, async_op: Literal[False] = False
    ) -> torch.Tensor: ...

    @overload
    def scatter(
        self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0, *, async_op: Literal[True]
    ) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def scatter(
        self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0, *, async_op: bool = False
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Send ``tensors[r]`` from ``src`` to rank r.

        Args:
            tensors: On ``src``, one tensor per rank (dim 0 may differ);
                ignored elsewhere (pass None).
            src: The sending rank.
            async_op: See :meth:`broadcast`.

        Returns:
            This rank's piece, on :attr:`device` (on ``src``: on the
            device of ``tensors[src]``).
        """

        def prepare() -> Call:
            check_root(src, self.size, "src")
            if self.rank != src:
                return Call("scatter", root=src)
            if tensors is None:
                raise ValueError(f"scatter: rank {src} is the source and must pass one tensor per rank, got None")
            shape = check_list(tensors, self.size, "tensors")
            sizes = [rows_of(tuple(t.shape)) for t in tensors]
            return Call("scatter", tensors[0].dtype, shape, root=src, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        dtype = rows.dtype(src)
        assert dtype is not None
        ndim, trailing, splits = rows.ndim(src), rows.trailing(src), rows.splits_a(src)

        def move() -> torch.Tensor:
            my_rows = splits[self.rank]
            per_row = dtype.itemsize * prod(trailing)
            out_shape = (my_rows, *trailing) if ndim > 0 else ()
            if self.rank == src:
                assert tensors is not None
                flat = [_wire.to_bytes(t, self._wire_device(t)) for t in tensors]
                inp: Optional[torch.Tensor] = torch.cat(flat)
                device = tensors[src].device
                piece = buffers.empty_like(flat[0], (my_rows * per_row,))
            else:
                inp, device = None, self._device
                piece = buffers.empty((my_rows * per_row,), torch.uint8, self._device)
            self._scatter(piece, inp, [n * per_row for n in splits], src)
            return _wire.from_bytes(piece, dtype, out_shape).to(device)

        return self._issue("scatter", move, async_op)

    @overload
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, async_op: Literal[False] = False
    ) -> Optional[list[torch.Tensor]]: ...

    @overload
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, async_op: Literal[True]
    ) -> Work[Optional[list[torch.Tensor]]]: ...

    @_one_call_at_a_time
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, async_op: bool = False
    ) -> Union[Optional[list[torch.Tensor]], Work[Optional[list[torch.Tensor]]]]:
        """Collect every rank's ``tensor`` on ``dst``.

        Sizes along dim 0 may differ; dtype and other dims must agree.

        Args:
            tensor: This rank's contribution.
            dst: The receiving rank.
            async_op: See :meth:`broadcast`.

        Returns:
            On ``dst``, one tensor per rank (views into one buffer); None elsewhere.
        """

        def prepare() -> Call:
            check_root(dst, self.size, "dst")
            check_tensor(tensor, "tensor")
            return Call("gather", tensor.dtype, tuple(tensor.shape), root=dst, count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        check_tensor_rows(rows)
        dims = [rows.count(r) for r in range(self.size)]

        def move() -> Optional[list[torch.Tensor]]:
            shape = tuple(tensor.shape)
            per_row = tensor.dtype.itemsize * prod(shape[1:])
            counts = [d * per_row for d in dims]
            wire = _wire.to_bytes(tensor, self._wire_device(tensor))
            gathered = buffers.empty_like(wire, (sum(counts),)) if self.rank == dst else None
            self._gather(gathered, counts, wire, dst)
            if gathered is None:
                return None
            return split_out(gathered, counts, dims, shape, tensor.dtype, tensor.device)

        return self._issue("gather", move, async_op)

    # -- JSON to one rank, or from one rank (an agreement, then gather or scatter) --
    def gather_json(self, obj: Any, dst: int = 0, *, op: Optional[str] = None) -> Optional[list[Any]]:
        """Gather a JSON-safe object from every rank on ``dst`` only (a save's plans, not tensor data).

        As :meth:`all_gather_json`, but only ``dst`` receives: what a
        coordinator collects from every rank (DCP's plans) costs each other
        rank its own part, not the whole group's. One agreement, then one
        :meth:`gather` of the encoded bytes.

        Args:
            obj: What this rank contributes.
            dst: The receiving rank.
            op: The API call this belongs to, named in the peers' :class:`PeerError`.

        Returns:
            On ``dst``, ``[obj_of_rank_0, obj_of_rank_1, ...]``; None elsewhere.

        Raises:
            TypeError: ``obj`` is not JSON-safe (on this rank; the others
                raise :class:`PeerError`, and nothing is sent).
        """
        data: bytes = self.agree(lambda: _wire.encode_json(obj), op=op or "gather_json")
        parts = self.gather(_byte_tensor(data), dst)
        if parts is None:
            return None
        return [_wire.decode_json(part.cpu().numpy().tobytes(), f"rank {r}") for r, part in enumerate(parts)]

    def scatter_json(self, objs: Optional[Sequence[Any]], src: int = 0, *, op: Optional[str] = None) -> Any:
        """Send ``objs[r]`` (JSON-safe) from ``src`` to rank r: a coordinator's answer to each rank.

        Args:
            objs: On ``src``, one object per rank; ignored elsewhere (pass None).
            src: The sending rank.
            op: The API call this belongs to, named in the peers' :class:`PeerError`.

        Returns:
            This rank's object.

        Raises:
            ValueError: ``src`` passed other than one object per rank (on
                ``src``; the others raise :class:`PeerError`).
            TypeError: an object is not JSON-safe (on ``src``; likewise).
        """

        def encode() -> Optional[list[bytes]]:
            if self.rank != src:
                return None
            if objs is None or len(objs) != self.size:
                got = "None" if objs is None else f"{len(objs)} object(s)"
                raise ValueError(f"scatter_json: rank {src} must pass one object per rank ({self.size}), got {got}")
            return [_wire.encode_json(obj) for obj in objs]

        encoded = self.agree(encode, op=op or "scatter_json")
        piece = self.scatter(None if encoded is None else [_byte_tensor(data) for data in encoded], src)
        return _wire.decode_json(piece.cpu().numpy().tobytes(), f"rank {src}")
