# torch types ProcessGroup's methods as pybind overloads of its public front end; the
# overrides here take the backend signatures the C++ trampoline calls.
# mypy: disable-error-code="override,assignment"
"""torch.distributed backend ``"mpi4py"``: c10d collectives over mpi4py, in Python.

PyPI's torch wheels are built without ``ProcessGroupMPI``. After
:func:`shardwise_mpi.register_torch_backend` (which calls :func:`register`),
torch-native code runs over MPI from a plain ``pip install``::

    # mpiexec -n 2 python train.py
    import shardwise_mpi, torch.distributed as dist
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py")      # no MASTER_ADDR/RANK needed

Importing ``shardwise_mpi`` (or this module) registers nothing: the plugin
manager imports the package to find backend ``"mpi"``, and ``shardwise info``
or a gloo run must leave torch.distributed's backends and rendezvous
handlers as they were (DESIGN.md §3).

How it plugs into torch 2.13:

* :func:`~shardwise_mpi._c10d_register.register` calls ``torch.distributed.Backend.register_backend`` with
  ``extended_api=True`` (the creator needs ``global_ranks_in_group`` to build a
  sub-communicator for ``new_group``). The creator returns a
  :class:`MpiProcessGroup`, a Python subclass of ``torch.distributed.ProcessGroup``
  whose collectives (called by ``torch.distributed``, the functional
  collectives DTensor uses, and the object collectives) run synchronously and
  return an already-completed ``Work``. Each collective is one call of the
  shared implementation in :mod:`shardwise_mpi._collectives` (the shardwise
  ``MpiGroup`` calls the same functions).
* In-place and aliased buffers, which torch code passes and MPI refuses
  ("Buffers must not be aliased"), are resolved there too: an input that is
  exactly this rank's slot of the output (FSDP2's all-gather) goes as
  ``MPI_IN_PLACE``; any other overlap is read from a copy; views and
  non-contiguous tensors go through staging buffers. The list forms
  (``all_gather``, ``all_to_all``, ``reduce_scatter``) use the lists' own
  memory when they lie back to back in one buffer and stage through one flat
  buffer otherwise; ``scatter`` and ``gather`` send each tensor point to
  point on a duplicate communicator; either way their outputs may alias
  their inputs. Large outputs get transparent huge pages
  (:mod:`shardwise_mpi._c10d_buffers` says why and measures it).
* Rendezvous: ``init_process_group`` without ``store``/``init_method`` goes
  through ``env://``, which needs ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
  ``WORLD_SIZE``. :func:`register` wraps torch's ``env://`` handler: when those
  variables are missing *and* the process was started by an MPI launcher
  (PMI/PMIx/Open MPI variables), rank and world size come from
  ``MPI.COMM_WORLD`` and rank 0 opens a ``TCPStore`` on a free port whose
  address it broadcasts over MPI. That store is an ordinary shared store, so
  ``new_group``, ``TORCH_DIST_INIT_BARRIER`` and even other backends work.
  When the variables are set, torch's handler runs unchanged. The same
  bootstrap is available explicitly as ``init_method="mpi4py://"``.
* Registration imports neither mpi4py nor MPI: both are imported when a
  group (or an MPI rendezvous) is created. It happens only when asked, through
  :func:`register` (public as ``shardwise_mpi.register_torch_backend``);
  shardwise's own backend ``"mpi"`` does not call it, as its groups talk to
  MPI directly and never go through torch.distributed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise.sdk import local_broadcast
from shardwise_mpi._c10d_allreduce import ring_allreduce, takes_ring
from shardwise_mpi._c10d_buffers import gather_list, list_source, list_target, prefer_huge_pages, scatter_list
from shardwise_mpi._c10d_p2p import Outstanding, P2PWork, post_recv, post_send
from shardwise_mpi._c10d_rendezvous import mpi as _mpi
from shardwise_mpi._watchdog import Watchdog

#: How the watchdog's messages name this backend and where its timeout is set.
_WATCHDOG_NAMES = ('torch.distributed backend "mpi4py"', "init_process_group(timeout=...)")

__all__ = ["BACKEND_NAME", "MpiProcessGroup"]

BACKEND_NAME = "mpi4py"


def _collectives() -> Any:
    """:mod:`shardwise_mpi._collectives`, imported when a group is made.

    Imported here rather than at the top because it imports ``mpi4py.MPI``,
    which initialises MPI: registering and rendezvous must not.
    """
    from shardwise_mpi import _collectives

    return _collectives


def _completed(result: Any) -> Any:
    """A ``Work`` that is already done (the collectives run synchronously)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    # Not in torch's stubs; the documented way a Python ProcessGroup returns a Work.
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


def _op(opts: Any) -> tuple[Any, Any]:
    """The op to hand to :mod:`shardwise_mpi._collectives` for ``opts.reduceOp``, and PREMUL_SUM's factor (else None).

    The op is torch's ``RedOpType`` (``ReduceOp`` wraps one): the collectives
    read it with the one reduce-op vocabulary (``shardwise.sdk``), so this
    backend names no ops of its own. PREMUL_SUM (FSDP2 with
    ``set_gradient_divide_factor``) is a sum of the inputs each multiplied by
    the factor (a float or a one-element tensor): the callers scale, then sum.
    """
    op = opts.reduceOp
    kind = getattr(op, "op", op)  # ReduceOp wraps a RedOpType enum
    if kind == dist.ReduceOp.PREMUL_SUM:
        return "sum", op.factor
    return kind, None


def _scaled(t: torch.Tensor, factor: Any, in_place: bool) -> torch.Tensor:
    """``t`` multiplied by PREMUL_SUM's ``factor``: in place (an all-reduce overwrites it anyway) or as a new tensor.

    Raises:
        TypeError: ``t`` is not floating point (PREMUL_SUM is defined for floating point tensors only).
    """
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"PREMUL_SUM needs a floating point tensor, got {t.dtype}; use SUM for integers")
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t.device)
    return t.detach().mul_(factor) if in_place else t.detach() * factor


class MpiProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives run over an MPI communicator.

    Every collective blocks until this rank's part is done and returns a
    completed ``Work`` (``wait()`` returns at once; ``get_future()`` holds the
    output tensors), so ``async_op=True`` is accepted but not overlapped.
    Point-to-point messages (``send``/``recv``, and so ``isend``/``irecv``
    and ``batch_isend_irecv``) are posted without blocking and finished by
    their Work's ``wait()``, as torch's other backends do.

    Args:
        comm: A communicator this group owns (a duplicate/split of the user's,
            so its messages never match the user's own MPI calls).
        group_name: torch's name of the group.
    """

    def __init__(self, comm: Any, group_name: str = "", timeout: Optional[timedelta] = None) -> None:
        # (rank, size): the storeless constructor Python groups use; missing from torch's stubs.
        super().__init__(comm.Get_rank(), comm.Get_size())  # type: ignore[call-arg]
        self.comm = comm
        self._name = group_name
        self._desc = "undefined"
        self._C = _collectives()
        self._side_comm: Any = None  # see _side()
        self._outstanding = Outstanding(_mpi())
        self._one_copy = self._one_copy_group(timeout)
        # MPI cannot cancel a blocked call: past the group's timeout the job is reported and aborted.
        self._watch = Watchdog(
            timeout,
            lambda: f"rank {self.rank()} of {self.size()}",
            backend=_WATCHDOG_NAMES[0],
            how_to_set=_WATCHDOG_NAMES[1],
        )

    # --- identity -------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # The C++ base keeps name and description in its backends, which a Python
    # group has none of: keep them here (torch's trampoline calls these getters).
    def _set_group_name(self, name: str) -> None:
        self._name = str(name)

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = str(desc)

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._desc

    def __repr__(self) -> str:
        return f"MpiProcessGroup(rank={self.rank()}, size={self.size()})"

    def shutdown(self) -> None:
        """Free the group's communicators (``destroy_process_group`` calls this)."""
        self._watch.close()
        self._outstanding.abandon()
        one_copy, self._one_copy = self._one_copy, None
        if one_copy is not None:
            one_copy.destroy()  # its watchdog; the communicator is this group's, freed below
        comm, self.comm = self.comm, None
        side, self._side_comm = self._side_comm, None
        if not _mpi().Is_finalized():
            for c in (side, comm):
                if c is not None:
                    c.Free()

    def _side(self) -> Any:
        """A duplicate of the group's communicator for the point-to-point messages inside collectives.

        Their messages then never match the program's own ``send``/``recv`` on
        the group. Made on first use: every rank of the group is then inside
        the same collective, so the (collective) duplication matches.
        """
        if self._side_comm is None:
            self._side_comm = self.comm.Dup()
        return self._side_comm

    def _one_copy_group(self, timeout: Optional[timedelta]) -> Any:
        """A shardwise ``MpiGroup`` over the group's communicator, through which large broadcasts take one copy.

        ``shardwise.sdk.local_broadcast`` needs a shardwise group (its two
        rounds of integers, and the ranks' one-time agreement that every peer
        is on this host and readable). It owns nothing: its rounds are
        ``MPI_Allgather`` calls on this group's communicator, in order with
        the group's other collectives, which all run synchronously. None
        for groups of fewer ranks than ``one_copy_broadcast`` asks for.
        Made here, not on first use: making it is local (no communication),
        and it then holds the communicator the group was made with.
        """
        if not self._C.one_copy_broadcast(self.comm.Get_size()):
            return None
        # Imported here: shardwise_mpi._group imports mpi4py.MPI (see _collectives()).
        from shardwise_mpi._group import MpiGroup

        # Its watchdog's messages name this API, whose timeout is init_process_group's.
        return MpiGroup(self.comm, owns_comm=False, verify=False, timeout=timeout, watchdog=_WATCHDOG_NAMES)

    # --- collectives ----------------------------------------------------
    def barrier(self, opts: Any = None) -> Any:
        with self._watch("barrier"):
            self._C.barrier(self.comm)
        return _completed(None)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        for t in tensors:
            if self.rank() != opts.rootRank:
                prefer_huge_pages(t)
            # From 3 ranks MPI's tree copies each byte twice per hop; one copy per receiver is faster.
            one_copy = self._one_copy
            if one_copy is not None and one_copy._by_one_copy("broadcast", local_broadcast, t, opts.rootRank):
                continue
            with self._watch("broadcast"):
                self._C.bcast(self.comm, t, opts.rootRank)
        return _completed(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        op, factor = _op(opts)
        for t in tensors:
            if factor is not None:
                _scaled(t, factor, in_place=True)
            self._allreduce_one(t, op)
        return _completed(tensors)

    def _allreduce_one(self, t: torch.Tensor, op: Any) -> None:
        # Large sums take a ring of point-to-point exchanges (faster than MPICH's
        # Allreduce on one host; see _c10d_allreduce), everything else MPI's own.
        name = self._C.normalize_op(op)
        if takes_ring(t, name, self.size()):
            side = self._side()
            with self._watch("all_reduce"):
                ring_allreduce(_mpi(), side, t, name)
            return
        with self._watch("all_reduce"):
            self._C.allreduce(self.comm, t, op)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        # MPI_Reduce would save the non-root ranks a copy; an all-reduce keeps
        # one implementation and torch leaves non-root outputs unspecified.
        op, factor = _op(opts)
        for t in tensors:
            if factor is not None:
                _scaled(t, factor, in_place=True)
            self._allreduce_one(t, op)
        return _completed(tensors)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        prefer_huge_pages(output)
        with self._watch("all_gather"):
            self._C.allgatherv(self.comm, output, inp, [inp.numel()] * self.size())
        return _completed([output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, inp in zip(outputs, inputs, strict=True):
            self._allgather_base(out, inp, opts)
        return _completed(outputs)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for outs, inp in zip(output_lists, inputs, strict=True):
            # Outputs back to back in one buffer (t.split(k)) are gathered into directly.
            flat, finish = list_target(outs, inp.dtype, inp.device)
            with self._watch("all_gather"):
                self._C.allgatherv(self.comm, flat, inp, [o.numel() for o in outs])
            finish()
        return _completed(output_lists)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        # One output list per rank, each holding one tensor per input.
        for i, inp in enumerate(inputs):
            self.allgather([[outs[i] for outs in output_lists]], [inp], opts)
        return _completed(output_lists)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
        op, factor = _op(opts)
        if factor is not None:
            inp = _scaled(inp, factor, in_place=False)  # the caller's input stays as it was
        prefer_huge_pages(output)
        with self._watch("reduce_scatter"):
            self._C.reduce_scatter(self.comm, output, inp, [output.numel()] * self.size(), op)
        return _completed([output])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        for out, inp in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(out, inp, opts)
        return _completed(outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        op, factor = _op(opts)
        for out, ins in zip(outputs, input_lists, strict=True):
            counts = [t.numel() for t in ins]
            # Inputs back to back in one buffer are read where they are (the
            # collective copies an input that overlaps the output).
            flat = list_source(ins) if factor is None else torch.cat([t.reshape(-1) for t in ins])
            if factor is not None:
                _scaled(flat, factor, in_place=True)  # flat is this call's own copy
            with self._watch("reduce_scatter"):
                self._C.reduce_scatter(self.comm, out, flat, counts, op)
        return _completed(outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> Any:
        size = self.size()
        if inp.dim() == 0 or output.dim() == 0:
            raise ValueError("all_to_all_single needs tensors with at least one dimension (splits are rows of dim 0)")
        # Splits are rows of dim 0; empty splits mean equal parts.
        in_row = inp[0].numel() if inp.shape[0] else 0
        out_row = output[0].numel() if output.shape[0] else 0
        in_splits = list(input_split_sizes) or [inp.shape[0] // size] * size
        out_splits = list(output_split_sizes) or [output.shape[0] // size] * size
        out_counts, in_counts = [s * out_row for s in out_splits], [s * in_row for s in in_splits]
        prefer_huge_pages(output)
        # On the side communicator: the exchange is point to point, which must never match the program's own
        # send/recv on the group (a message of the same tag would swap data silently).
        with self._watch("all_to_all"):
            self._C.alltoallv(self._side(), output, out_counts, inp, in_counts)
        return _completed([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        in_counts = [t.numel() for t in inputs]
        out_counts = [t.numel() for t in outputs]
        # Lists back to back in one buffer are used where they are (the collective
        # copies an input that overlaps the output); others are staged.
        flat_in = list_source(inputs)
        flat_out, finish = list_target(outputs, flat_in.dtype, flat_in.device)
        with self._watch("all_to_all"):
            self._C.alltoallv(self._side(), flat_out, out_counts, flat_in, in_counts)
        finish()
        return _completed(outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        # Point to point, each output received where it is: the outputs are
        # usually separate tensors, which one MPI_Gatherv would need staged.
        (inp,) = inputs
        outs = output_lists[0] if self.rank() == opts.rootRank else None
        if outs is not None and len(outs) != self.size():
            raise ValueError(f"gather: the root needs {self.size()} output tensors, got {len(outs)}")
        side = self._side()
        with self._watch("gather"):
            gather_list(_mpi(), side, outs, inp, opts.rootRank, self._C.overlaps, self._C.overlapping)
        return _completed(output_lists)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        # Point to point, each piece sent from where it is (see gather).
        (out,) = outputs
        ins = input_lists[0] if self.rank() == opts.rootRank else None
        if ins is not None and len(ins) != self.size():
            raise ValueError(f"scatter: the root needs {self.size()} input tensors, got {len(ins)}")
        side = self._side()
        with self._watch("scatter"):
            scatter_list(_mpi(), side, out, ins, opts.rootRank, self._C.overlaps)
        return _completed(outputs)

    # torch 2.13's Python front end calls these names on the group; the C++
    # functional collectives (DTensor) call the underscored/base names above.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def _start_coalescing(self, device: Any) -> None:
        # Collectives run as they are issued: nothing to batch.
        return None

    def _end_coalescing(self, device: Any) -> Any:
        return _completed(None)

    # --- point to point ---------------------------------------------------
    # Posted without blocking (torch's isend/irecv return at once; a blocking send of more than MPI's
    # eager size would wait for the receive the peer posts only after its own send): see _c10d_p2p.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        requests, sources, finish = post_send(_mpi(), self.comm, tensors, dst, tag)
        self._outstanding.add(requests, sources)
        return P2PWork(_mpi(), requests, tensors, finish, self._watch, "send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        requests, buffers, finish = post_recv(_mpi(), self.comm, tensors, src, tag)
        self._outstanding.add(requests, buffers)
        return P2PWork(_mpi(), requests, tensors, finish, self._watch, "recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise NotImplementedError(
            'torch.distributed backend "mpi4py" cannot receive from any source (its Work cannot report the '
            "sender); pass src to recv"
        )
