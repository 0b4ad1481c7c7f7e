"""``MpiGroup``: a shardwise :class:`~shardwise.Group` over an mpi4py communicator.

The primitives delegate to :mod:`shardwise_mpi._collectives` (shared with the
torch.distributed backend); uneven sizes go straight to MPI's v-variants
(Allgatherv, Reduce_scatter, Gatherv, Scatterv; a pairwise Sendrecv
exchange for all-to-all) with no padding.
``exchange`` is the base class's JSON over all-gather: no rank ever
unpickles what a peer sent (mpi4py's lowercase object methods are not used).

With ``verify=False`` the collectives whose sizes every rank knows take a
direct path for the common case — contiguous CPU tensors of a dtype MPI
reduces natively, a reduce op plainly defined on it, consecutive
``reduce_scatter`` inputs, ``out=`` buffers — handing the caller's memory to
MPI with a few attribute checks instead of the base class's general
plumbing (which costs tens of microseconds a call, as much as moving a
megabyte). Anything outside that case goes through the base class, which
validates it and raises the usual errors; results are identical either way.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
from mpi4py import MPI

from shardwise import Group

from shardwise._comm import buffers as _memory
from shardwise._comm.default_group import DEFAULT_TIMEOUT
from shardwise_mpi import _collectives as C
from shardwise_mpi._watchdog import Watchdog

# Ops the direct path takes, by name or torch ReduceOp name; anything else
# (bitwise ops, aliases, unknown names) takes the validated path.
_DIRECT_OPS = frozenset({"sum", "avg", "min", "max", "product"})
# Dtypes whose MPI datatype reduces natively and whose every op above is
# defined (complex and bool have op restrictions, half types are upcast).
_DIRECT_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
)


def _plain(t: Any) -> bool:
    """A tensor MPI can read or write in place: contiguous, dense, on the CPU, no lazy conj/neg bit."""
    return (
        (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def _op_name(op: Any, dtype: torch.dtype) -> Optional[str]:
    """``op``'s name when the direct path may reduce ``dtype`` with it, else None."""
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if not isinstance(name, str):
        name = str(op).rsplit(".", 1)[-1]
    name = name.lower()
    if name not in _DIRECT_OPS or dtype not in _DIRECT_DTYPES:
        return None
    if name == "avg" and not dtype.is_floating_point:
        return None
    return name


def _splits(given: Optional[Sequence[int]], rows: int, size: int) -> Optional[list[int]]:
    """Per-rank row counts: ``given`` if valid, an equal split when None; None when invalid."""
    if given is None:
        return None if rows % size else [rows // size] * size
    values = list(given)
    if len(values) != size or any(type(v) is not int or v < 0 for v in values) or sum(values) != rows:
        return None
    return values

__all__ = ["MpiGroup"]


def _world_ranks(comm: Any) -> Optional[list[int]]:
    """Each rank of ``comm`` as a rank of ``MPI.COMM_WORLD`` (placements name world ranks); None for the world."""
    size = comm.Get_size()
    if size == MPI.COMM_WORLD.Get_size() and MPI.Comm.Compare(comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
        return None
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(size)), world)]
    finally:
        group.Free()
        world.Free()


class MpiGroup(Group):
    """A group whose collectives run over an MPI communicator.

    Args:
        comm: The ``mpi4py.MPI.Intracomm`` (one per group; use a duplicate
            so the group's messages cannot match the user's own MPI calls).
        device: Device collectives run on natively (default CPU). CUDA
            tensors are handled either way: passed to a CUDA-aware MPI, or
            staged through host memory.
        owns_comm: Free ``comm`` in :meth:`destroy`.
        verify: See :class:`~shardwise.Group`.
        timeout: How long one collective may block before this rank
            reports it and aborts the job (MPI cannot cancel a blocked
            call; see :mod:`shardwise_mpi._watchdog`). Default 5 minutes;
            None disables it.
    """

    def __init__(
        self,
        comm: Any,
        *,
        device: Optional[torch.device] = None,
        owns_comm: bool = True,
        verify: Optional[bool] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
    ) -> None:
        # _collectives stages CUDA tensors itself (or hands them to a
        # CUDA-aware MPI), so the base class need not stage them.
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        super().__init__(
            backend="mpi",
            rank=comm.Get_rank(),
            size=comm.Get_size(),
            device=torch.device("cpu") if device is None else torch.device(device),
            devices=devices,
            verify=verify,
            ranks=_world_ranks(comm),
        )
        self.comm = comm
        self._owns_comm = owns_comm
        self._timeout = timeout
        self._watch = Watchdog(timeout, lambda: f"rank {self.rank} of {self.size}")

    # -- direct paths (verify=False, plain tensors); see the module docstring --
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.verify or not _plain(tensor) or type(src) is not int or not 0 <= src < self.size:
            return super().broadcast(tensor, src)
        with self._watch("broadcast"):
            return C.bcast(self.comm, tensor, src)

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        name = None if self.verify or not _plain(tensor) else _op_name(op, tensor.dtype)
        if name is None:
            return super().all_reduce(tensor, op)
        with self._watch("all_reduce"):
            return C.allreduce(self.comm, tensor, name)

    def all_gather(self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        if (
            self.verify
            or out is None
            or not (_plain(tensor) and _plain(out))
            or out.dtype != tensor.dtype
            or tuple(out.shape) != ((self.size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (self.size,))
        ):
            return super().all_gather(tensor, out=out)
        with self._watch("all_gather"):
            C.allgatherv(self.comm, out, tensor, [tensor.numel()] * self.size)
        return list(out.unbind(0)) if tensor.dim() == 0 else list(out.chunk(self.size))

    def reduce_scatter(
        self, inputs: Sequence[torch.Tensor], op: Any = "sum", *, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        direct = not self.verify and isinstance(inputs, (list, tuple)) and len(inputs) == self.size
        if direct:
            mine = inputs[self.rank]
            joined = self._consecutive(inputs) if all(_plain(t) for t in inputs) else None
            name = _op_name(op, mine.dtype) if joined is not None else None
            if out is None and name is not None:
                out = _memory.empty_like(mine)
            if (name is not None and joined is not None and out is not None and _plain(out)
                    and out.dtype == mine.dtype and out.shape == mine.shape):
                with self._watch("reduce_scatter"):
                    return C.reduce_scatter(self.comm, out, joined, [t.numel() for t in inputs], name)
        return super().reduce_scatter(inputs, op, out=out)

    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if not self.verify and _plain(tensor) and tensor.dim() > 0 and (out is None or _plain(out)):
            trailing = tuple(tensor.shape[1:])
            ins = _splits(input_split_sizes, tensor.shape[0], self.size)
            outs: Optional[list[int]] = None
            if out is not None and out.dim() > 0 and out.dtype == tensor.dtype and tuple(out.shape[1:]) == trailing:
                outs = _splits(output_split_sizes, out.shape[0], self.size)
            elif out is None and output_split_sizes is not None:
                outs = _splits(output_split_sizes, sum(output_split_sizes), self.size)
            if ins is not None and outs is not None:
                result = out if out is not None else _memory.empty_like(tensor, (sum(outs), *trailing))
                per_row = math.prod(trailing)
                with self._watch("all_to_all"):
                    C.alltoallv(self.comm, result, [o * per_row for o in outs], tensor, [i * per_row for i in ins])
                return result
        return super().all_to_all_single(tensor, output_split_sizes, input_split_sizes, out=out)

    # -- primitives ------------------------------------------------------------
    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return C.reduction_dtype(dtype)

    def _barrier(self) -> None:
        with self._watch("barrier"):
            C.barrier(self.comm)

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        with self._watch("broadcast"):
            C.bcast(self.comm, buf, src)

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        with self._watch("all_reduce"):
            C.allreduce(self.comm, buf, op)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        with self._watch(self._describe("all_gather")):
            C.allgatherv(self.comm, out, inp, counts)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        with self._watch("reduce_scatter"):
            C.reduce_scatter(self.comm, out, inp, counts, op)

    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        with self._watch("all_to_all"):
            C.alltoallv(self.comm, out, out_counts, inp, in_counts)

    def _gather(self, out: Optional[torch.Tensor], counts: Sequence[int], inp: torch.Tensor, dst: int) -> None:
        with self._watch("gather"):
            C.gatherv(self.comm, out, inp, counts, dst)

    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        with self._watch("scatter"):
            C.scatterv(self.comm, out, inp, counts, src)

    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        # Split is collective over this group, which new_group already is;
        # non-members pass MPI.UNDEFINED and get COMM_NULL back.
        member = self.rank in ranks
        with self._watch("new_group"):
            sub = self.comm.Split(0 if member else MPI.UNDEFINED, self.rank)
        if not member:
            return None
        return MpiGroup(sub, device=self._device, owns_comm=True, verify=self.verify, timeout=self._timeout)

    def destroy(self) -> None:
        """Free the communicator (if this group made it); the group is unusable afterwards."""
        self._watch.close()
        if self._owns_comm and self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self._owns_comm = False
