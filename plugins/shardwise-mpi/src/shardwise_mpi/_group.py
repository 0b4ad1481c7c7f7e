"""``MpiGroup``: a shardwise :class:`~shardwise.Group` over an mpi4py communicator.

The primitives delegate to :mod:`shardwise_mpi._collectives` (shared with the
torch.distributed backend); uneven sizes go straight to MPI's v-variants
(Allgatherv, Reduce_scatter, Alltoallv, Gatherv, Scatterv) with no padding.
``exchange`` is the base class's JSON over all-gather: no rank ever
unpickles what a peer sent (mpi4py's lowercase object methods are not used).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from mpi4py import MPI

from shardwise import Group
from shardwise_mpi import _collectives as C

__all__ = ["MpiGroup"]


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
    """

    def __init__(
        self,
        comm: Any,
        *,
        device: Optional[torch.device] = None,
        owns_comm: bool = True,
        verify: Optional[bool] = None,
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
        )
        self.comm = comm
        self._owns_comm = owns_comm

    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return C.reduction_dtype(dtype)

    def _barrier(self) -> None:
        C.barrier(self.comm)

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        C.bcast(self.comm, buf, src)

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        C.allreduce(self.comm, buf, op)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        C.allgatherv(self.comm, out, inp, counts)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        C.reduce_scatter(self.comm, out, inp, counts, op)

    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        C.alltoallv(self.comm, out, out_counts, inp, in_counts)

    def _gather(self, out: Optional[torch.Tensor], counts: Sequence[int], inp: torch.Tensor, dst: int) -> None:
        C.gatherv(self.comm, out, inp, counts, dst)

    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        C.scatterv(self.comm, out, inp, counts, src)

    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        # Split is collective over this group, which new_group already is;
        # non-members pass MPI.UNDEFINED and get COMM_NULL back.
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else MPI.UNDEFINED, self.rank)
        if not member:
            return None
        return MpiGroup(sub, device=self._device, owns_comm=True, verify=self.verify)

    def destroy(self) -> None:
        """Free the communicator (if this group made it); the group is unusable afterwards."""
        if self._owns_comm and self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self._owns_comm = False
