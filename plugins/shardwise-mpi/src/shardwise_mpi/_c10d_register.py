"""Registering the ``"mpi4py"`` torch backend, and its creator: which communicator, and which group class.

Split from :mod:`shardwise_mpi._c10d` (whose docstring describes the backend)
so that the group classes, :class:`~shardwise_mpi._c10d.MpiProcessGroup` and
its ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` form
:class:`~shardwise_mpi._c10d_detail.CheckedMpiProcessGroup`, sit below the
creator that picks between them.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import torch
import torch.distributed as dist

from shardwise_mpi._c10d import BACKEND_NAME, MpiProcessGroup
from shardwise_mpi._c10d_detail import CheckedMpiProcessGroup
from shardwise_mpi._c10d_rendezvous import mpi as _mpi
from shardwise_mpi._c10d_rendezvous import mpi_rendezvous_handler as _mpi_rendezvous_handler
from shardwise_mpi._c10d_rendezvous import wrap_env_handler as _wrap_env_handler

__all__ = ["register"]

_registered = False
# Two threads registering at once must not both wrap torch's env:// handler.
_register_lock = threading.Lock()

#: MPI_COMM_WORLD's rank of each torch global rank, from the last default group made on this backend (empty
#: before: torch ranks are taken to be MPI's).
_world_rank_of: list[int] = []


def _create(backend_opts: Any, pg_options: Any = None) -> MpiProcessGroup:
    """The ``register_backend`` creator (extended API): a group over a fresh communicator."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    ranks = list(backend_opts.global_ranks_in_group)
    rank, size = int(backend_opts.group_rank), int(backend_opts.group_size)
    if not ranks:
        # Default group: every process calls this. Split (not Dup) orders the
        # communicator by torch's rank, whatever rendezvous assigned it.
        if size != world.Get_size():
            raise RuntimeError(
                f'torch.distributed backend "mpi4py": world_size={size} but MPI started '
                f"{world.Get_size()} processes; launch with mpiexec -n {size} or drop world_size"
            )
        comm = world.Split(0, rank)
        # Where each torch rank runs in MPI_COMM_WORLD (rendezvous may number the processes otherwise than
        # MPI): sub-groups name torch ranks.
        _world_rank_of[:] = [0] * size
        for world_rank, torch_rank in enumerate(world.allgather(rank)):
            _world_rank_of[torch_rank] = world_rank
    else:
        # Sub-group: torch calls the creator on members only, so the
        # collective must be over the members (MPI_Comm_create_group).
        members = [_world_rank_of[r] if r < len(_world_rank_of) else r for r in ranks]
        comm = world.Create_group(world.Get_group().Incl(members))
    if comm == MPI.COMM_NULL or comm.Get_rank() != rank:
        raise RuntimeError(
            f'torch.distributed backend "mpi4py": this process (MPI rank {world.Get_rank()}) is torch group rank '
            f"{rank} of {ranks}, but its MPI communicator does not say so: torch's ranks differ from MPI's, and the "
            'default process group is not on "mpi4py" (which maps them); initialise the default group with '
            '"mpi4py", or let the rendezvous number the processes as MPI does'
        )
    # torch wraps its own backends' groups in a fingerprint check under DETAIL, but not a Python group.
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    kind = CheckedMpiProcessGroup if detail else MpiProcessGroup
    return kind(comm, str(backend_opts.group_id), timeout=getattr(backend_opts, "timeout", None))


def register() -> None:
    """Register backend ``"mpi4py"`` and the MPI rendezvous with torch.distributed.

    Idempotent and thread-safe; imports no MPI. Afterwards
    ``torch.distributed.init_process_group("mpi4py")`` works under
    ``mpiexec``/``mpirun``/``srun`` with no rendezvous variables. Changes three
    torch globals, which is why nothing calls it on import: the backend
    ``"mpi4py"``, the rendezvous scheme ``mpi4py://``, and torch's ``env://``
    handler, wrapped so that it falls back to MPI when ``MASTER_ADDR``/
    ``MASTER_PORT`` are missing in a process an MPI launcher started.

    Example::

        import shardwise_mpi, torch.distributed as dist
        shardwise_mpi.register_torch_backend()
        dist.init_process_group("mpi4py")
    """
    global _registered
    if _registered or not dist.is_available():
        return
    with _register_lock:
        if _registered:
            return
        # ``torch.distributed.rendezvous`` is also a function: import the module by name.
        rdzv = importlib.import_module("torch.distributed.rendezvous")

        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            # Claim CUDA only where there is one: code that asks the backend for its
            # preferred device (torch's ShardedTensor.gather, for one) takes any
            # non-CPU device registered and would fail on a CPU-only host.
            devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
        handlers = rdzv._rendezvous_handlers
        if "mpi4py" not in handlers:
            rdzv.register_rendezvous_handler("mpi4py", _mpi_rendezvous_handler)
        env = handlers.get("env")
        if env is not None and not getattr(env, "_shardwise_mpi", False):
            handlers["env"] = _wrap_env_handler(env)
        _registered = True
