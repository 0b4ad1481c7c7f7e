"""``MpiGroup``: a shardwise :class:`~shardwise.Group` over an mpi4py communicator.

The primitives delegate to :mod:`shardwise_mpi._collectives` (shared with the
torch.distributed backend); uneven sizes go straight to MPI's v-variants
(Allgatherv, Reduce_scatter, Gatherv, Scatterv; a pairwise Sendrecv
exchange for all-to-all) with no padding. Agreements are the base class's
JSON over all-gather: no rank ever unpickles what a peer sent (mpi4py's
lowercase object methods are not used).

The group also offers the base class's *direct paths*
(``_direct_all_reduce`` ...): once a public collective has checked its
arguments (and, when verifying, agreed on them), the common case —
contiguous CPU tensors of a dtype MPI reduces natively, consecutive
``reduce_scatter`` inputs, ``out=`` buffers — hands the caller's memory to
MPI with a few attribute checks instead of the base class's general
plumbing (which costs tens of microseconds a call, as much as moving a
megabyte). Anything else declines and takes the general path; results are
identical either way.
"""

from __future__ import annotations

import math
from array import array
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise.sdk import (
    DEFAULT_TIMEOUT,
    REDUCE_OPS,
    Group,
    empty_like,
    local_all_gather,
    local_all_to_all,
    local_broadcast,
    local_gather,
    local_scatter,
)
from shardwise_mpi import _collectives as C
from shardwise_mpi._watchdog import SHARDWISE_NAMES, Watchdog

# After _collectives, which has chosen the MPI library that mpi4py loads.
from mpi4py import MPI  # noqa: E402  # isort: skip

# The core hands the direct paths a reduce op already normalised to one of
# the SDK's names; those MPI reduces natively. Should the vocabulary grow,
# only the ops listed here take the direct path.
_DIRECT_OPS = frozenset(REDUCE_OPS) & {"sum", "avg", "min", "max", "product"}
# Dtypes whose MPI datatype reduces natively and whose every op above is
# defined (complex and bool have op restrictions, half types are upcast).
_DIRECT_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
)


def _plain(t: torch.Tensor) -> bool:
    """A tensor MPI can read or write in place: contiguous, dense, on the CPU, no lazy conj/neg bit."""
    return (
        (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def _reducible(op: str, dtype: torch.dtype) -> bool:
    """Whether the direct path may reduce ``dtype`` with ``op`` (already checked as defined for it)."""
    return op in _DIRECT_OPS and dtype in _DIRECT_DTYPES


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
        torch_default_group: torch.distributed's default process group if
            it was made for this group (``create_group``): :meth:`destroy`
            destroys it too.
        watchdog: The watchdog's ``backend`` and ``how_to_set`` (how its
            messages name the backend and where the timeout is set), for a
            group that serves another API (the ``"mpi4py"`` torch backend's
            one-copy broadcasts); default: this backend's, set by ``shardwise.init``.
    """

    #: Ranks on one host move data by cross-memory attach (``shardwise.sdk.local_all_to_all`` ...):
    #: one copy from the sender's memory, where MPI's shared-memory transport makes two.
    _local_copy = True

    def __init__(
        self,
        comm: Any,
        *,
        device: Optional[torch.device] = None,
        owns_comm: bool = True,
        verify: Optional[bool] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        torch_default_group: Optional[dist.ProcessGroup] = None,
        watchdog: tuple[str, str] = SHARDWISE_NAMES,
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
        self._torch_default_group = torch_default_group
        self._timeout = timeout
        backend, how_to_set = watchdog
        where = lambda: f"rank {self.rank} of {self.size}"  # noqa: E731 - read when a message is written
        self._watch = Watchdog(timeout, where, backend=backend, how_to_set=how_to_set)
        #: The primitive whose one-copy path is running (see _by_one_copy), else None.
        self._rounds_of: Optional[str] = None

    def _by_one_copy(self, primitive: str, move: Callable[..., bool], *args: Any) -> bool:
        """``move(self, *args)``, a ``shardwise.sdk.local_*`` function, with its rounds named after ``primitive``.

        The one-copy path swaps addresses and closing codes in all-gathers of
        a few integers (:meth:`_all_gather_ints`). A rank blocked in one
        because a peer stopped answering should hear about the call it made
        ("broadcast"), not about an all-gather it never called.

        Returns:
            What ``move`` returns: True if the data moved by one copy.
        """
        outer, self._rounds_of = self._rounds_of, primitive
        try:
            return move(self, *args)
        finally:
            self._rounds_of = outer

    # -- direct paths (arguments already checked and agreed); see the module docstring --
    def _direct_broadcast(self, tensor: torch.Tensor, src: int) -> bool:
        if not _plain(tensor):
            return False
        if C.one_copy_broadcast(self.size) and self._by_one_copy("broadcast", local_broadcast, tensor, src):
            return True
        with self._watch(self._describe("broadcast")):
            C.bcast(self.comm, tensor, src)
        return True

    def _direct_all_reduce(self, tensor: torch.Tensor, op: str) -> bool:
        if not (_plain(tensor) and _reducible(op, tensor.dtype)):
            return False
        with self._watch(self._describe("all_reduce")):
            C.allreduce(self.comm, tensor, op)
        return True

    def _direct_all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> bool:
        if not (_plain(tensor) and _plain(out)):
            return False
        if self._by_one_copy("all_gather", local_all_gather, out, tensor, [tensor.numel()] * self.size):
            return True
        with self._watch(self._describe("all_gather")):
            C.allgatherv(self.comm, out, tensor, [tensor.numel()] * self.size)
        return True

    def _direct_reduce_scatter(
        self, inputs: Sequence[torch.Tensor], joined: Optional[torch.Tensor], op: str, out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        mine = inputs[self.rank]
        if joined is None or not (_plain(joined) and _reducible(op, mine.dtype)):
            return None
        if out is None:
            out = empty_like(mine)
        elif not _plain(out):
            return None
        with self._watch(self._describe("reduce_scatter")):
            return C.reduce_scatter(self.comm, out, joined, [t.numel() for t in inputs], op)

    def _direct_all_to_all_single(
        self, tensor: torch.Tensor, outs: Sequence[int], ins: Sequence[int], out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        if not _plain(tensor) or (out is not None and not _plain(out)):
            return None
        trailing = tuple(tensor.shape[1:])
        result = out if out is not None else empty_like(tensor, (sum(outs), *trailing))
        per_row = math.prod(trailing)
        out_counts, in_counts = [o * per_row for o in outs], [i * per_row for i in ins]
        if self._by_one_copy("all_to_all", local_all_to_all, result.view(-1), out_counts, tensor.view(-1), in_counts):
            return result
        with self._watch(self._describe("all_to_all")):
            C.alltoallv(self.comm, result, out_counts, tensor, in_counts)
        return result

    def _all_gather_ints(self, out: array, inp: array) -> None:
        """Agreements' rows and the one-copy path's integers: MPI's all-gather on the arrays, no tensor."""
        with self._watch(self._describe(self._rounds_of or "all_gather")):
            self.comm.Allgather(inp, out)

    # -- primitives ------------------------------------------------------------
    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return C.reduction_dtype(dtype)

    def _barrier(self) -> None:
        with self._watch(self._describe("barrier")):
            C.barrier(self.comm)

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        if C.one_copy_broadcast(self.size) and self._by_one_copy("broadcast", local_broadcast, buf, src):
            return
        with self._watch(self._describe("broadcast")):
            C.bcast(self.comm, buf, src)

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        with self._watch(self._describe("all_reduce")):
            C.allreduce(self.comm, buf, op)

    # The data-moving primitives offer their buffers to the one-copy path first (outside the
    # watchdog: it runs primitives of its own, each watched).
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        if self._by_one_copy("all_gather", local_all_gather, out, inp, counts):
            return
        with self._watch(self._describe("all_gather")):
            C.allgatherv(self.comm, out, inp, counts)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        with self._watch(self._describe("reduce_scatter")):
            C.reduce_scatter(self.comm, out, inp, counts, op)

    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        if self._by_one_copy("all_to_all", local_all_to_all, out, out_counts, inp, in_counts):
            return
        with self._watch(self._describe("all_to_all")):
            C.alltoallv(self.comm, out, out_counts, inp, in_counts)

    def _gather(self, out: Optional[torch.Tensor], counts: Sequence[int], inp: torch.Tensor, dst: int) -> None:
        if self._by_one_copy("gather", local_gather, out, counts, inp, dst):
            return
        with self._watch(self._describe("gather")):
            C.gatherv(self.comm, out, inp, counts, dst)

    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        if self._by_one_copy("scatter", local_scatter, out, inp, counts, src):
            return
        with self._watch(self._describe("scatter")):
            C.scatterv(self.comm, out, inp, counts, src)

    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        # Split is collective over this group, which new_group already is;
        # non-members pass MPI.UNDEFINED and get COMM_NULL back.
        member = self.rank in ranks
        with self._watch(self._describe("new_group")):
            sub = self.comm.Split(0 if member else MPI.UNDEFINED, self.rank)
        if not member:
            return None
        return MpiGroup(sub, device=self._device, owns_comm=True, verify=self.verify, timeout=self._timeout)

    def _check_async(self) -> None:
        """Refuse ``async_op=True`` unless MPI was initialised with ``MPI_THREAD_MULTIPLE``.

        An asynchronous collective runs on the group's worker thread. One
        group's calls never overlap (the core queues them), which alone would
        need only ``MPI_THREAD_SERIALIZED``; but the main thread may meanwhile
        call MPI on another group (and the watchdog may call ``MPI_Abort``),
        so MPI must allow concurrent calls. ``shardwise.init`` asks for
        ``MULTIPLE``; a lower level means the program initialised MPI itself.
        """
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
            raise RuntimeError(
                f"rank {self.rank} of {self.size}: async_op=True on the mpi backend runs collectives on a "
                f"worker thread, which needs MPI initialised with MPI_THREAD_MULTIPLE, but MPI provides "
                f"MPI_THREAD_{names.get(provided, provided)}. Initialise MPI with "
                "MPI.Init_thread(MPI.THREAD_MULTIPLE) (or let shardwise.init do it; mpi4py.rc.thread_level = "
                '"multiple"), use an MPI library built with thread support, or call the collective without async_op.'
            )

    def destroy(self) -> None:
        """Free the communicator (if this group made it); the group is unusable afterwards.

        Also destroys torch.distributed's default process group if it was
        made with this group and is still the default (not if the user
        already destroyed or replaced it).
        """
        self._watch.close()
        torch_group, self._torch_default_group = self._torch_default_group, None
        if torch_group is not None and dist.is_initialized() and dist.group.WORLD is torch_group:
            dist.destroy_process_group()
        if self._owns_comm and self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self._owns_comm = False
