"""Registers backend ``"mpi"`` through the ``shardwise_backends`` hook.

Importing this module imports neither mpi4py nor libmpi and changes no torch
global: ``shardwise info`` and backend selection must not initialise MPI or
touch torch.distributed. Both happen only in :func:`create_group`, once the
backend has been chosen (``shardwise.init()`` under ``mpiexec``).

:func:`create_group` also brings up torch.distributed's default process
group over the same ``MPI.COMM_WORLD``, with the torch backend ``"mpi4py"``,
as the gloo backend does with gloo: after ``shardwise.init()`` alone,
torch-native code (DTensor, ``init_device_mesh``, FSDP, distributed
checkpoint) runs over MPI. It costs a few milliseconds once (rank 0 opens a
``TCPStore`` on a free port and sends its address over MPI; torch's
``new_group`` and any other torch backend need that shared store). It is
skipped, and torch.distributed left alone, when torch.distributed is already
initialised (the user's own group is kept) or when
``SHARDWISE_MPI_TORCH_DIST=0`` (a cluster where ranks cannot reach rank 0
over TCP, or a job that initialises torch.distributed itself afterwards,
for example with nccl).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from array import array
from datetime import timedelta
from types import TracebackType
from typing import Any, Iterable, Optional

import torch.distributed as dist

from shardwise import Availability, Backend, Group, LaunchInfo, hookimpl
from shardwise.errors import LaunchError
from shardwise_mpi._c10d import BACKEND_NAME
from shardwise_mpi._c10d_register import register
from shardwise_mpi._c10d_rendezvous import mpi_store as _mpi_store
from shardwise_mpi._libmpi import ensure_matching_library
from shardwise_mpi._watchdog import FORWARD_GRACE

__all__ = ["TORCH_DIST_ENV", "create_group", "install_abort_hook", "is_available", "shardwise_backends"]

_INSTALL = "`pip install shardwise-mpi[mpich]` (MPICH and mpiexec from PyPI) or install a system MPI"

#: ``SHARDWISE_MPI_TORCH_DIST=0`` keeps :func:`create_group` from initialising torch.distributed.
TORCH_DIST_ENV = "SHARDWISE_MPI_TORCH_DIST"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")

_log = logging.getLogger("shardwise.session")


def is_available() -> Availability:
    """Whether mpi4py imports and finds an MPI library (without initialising MPI)."""
    if sys.modules.get("mpi4py.MPI") is not None:
        return Availability(True)
    try:
        # Before mpi4py looks for a library (it keeps the first one it finds).
        ensure_matching_library()
    except LaunchError as exc:
        return Availability(False, str(exc))
    # mpi4py is an optional dependency probed here, not imported with the module (see the module docstring).
    try:
        import mpi4py
    except ImportError:
        return Availability(False, f"mpi4py is not installed; {_INSTALL}")
    try:
        # Locates and dlopens libmpi the way `import mpi4py.MPI` would,
        # without MPI_Init (importing mpi4py.MPI initialises MPI).
        from mpi4py import _mpiabi

        _mpiabi._get_mpiabi()  # type: ignore[attr-defined]
    except ImportError:
        pass  # an mpi4py built against one MPI links it directly
    except Exception as exc:  # noqa: BLE001 - any failure to load libmpi means "unavailable"
        detail = " ".join(str(exc).split())
        return Availability(False, f"mpi4py {mpi4py.__version__} cannot load an MPI library ({detail}); {_INSTALL}")
    return Availability(True)


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank end the whole MPI job.

    Without it, the raising rank exits while its peers wait forever in
    their next collective. The hook prints the traceback (through the
    previous hook), flushes, and calls ``MPI.COMM_WORLD.Abort(1)``: the
    launcher then kills every rank and exits non-zero.
    """
    # Imported on use: importing mpi4py.MPI initialises MPI.
    from mpi4py import MPI

    previous = sys.excepthook
    if getattr(previous, "_shardwise_mpi_abort", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            previous(kind, value, tb)
            rank = MPI.COMM_WORLD.Get_rank()
            # Our own line, because MPICH's "application called MPI_Abort" can be
            # lost when the process manager kills the job first.
            print(
                f"shardwise: rank {rank} raised {kind.__name__}; calling MPI_Abort so that the other "
                "ranks do not wait for it forever",
                file=sys.stderr,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            # MPI_Abort kills the job at once; give the process manager a moment
            # to forward the traceback's last lines (they were lost without it).
            time.sleep(FORWARD_GRACE)
        finally:
            MPI.COMM_WORLD.Abort(1)

    hook._shardwise_mpi_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def create_group(launch: LaunchInfo, timeout: timedelta) -> Group:
    """Initialise MPI (if needed) and return a group over a duplicate of ``COMM_WORLD``.

    No rendezvous address is needed: the MPI process manager connects the
    ranks. A process started without a launcher is a world of one (MPI
    singleton init). A rank that raises ends the job (see
    :func:`install_abort_hook`); a collective blocked longer than
    ``timeout`` (a peer died and the launcher did not end the job) prints
    which rank and collective and aborts the job (see
    :class:`~shardwise_mpi._watchdog.Watchdog`).

    Unless ``SHARDWISE_MPI_TORCH_DIST=0``, or torch.distributed is already
    initialised, it also initialises torch.distributed's default process
    group with the backend ``"mpi4py"`` over the same processes and
    ``timeout`` (see the module docstring); the group's ``destroy`` tears
    it down again.

    Before MPI starts, :func:`~shardwise_mpi._libmpi.match_launcher` makes
    mpi4py load a library of the kind the launcher speaks (Open MPI's under
    Open MPI's ``mpirun``, MPICH's under Hydra's ``mpiexec``).

    Raises:
        LaunchError: no MPI library of the launcher's kind was found (before
            ``MPI_Init``, which would abort), or MPI's world disagrees with what the launcher said
            (for example ``backend="mpi"`` under torchrun, where every
            process is its own MPI world), or torch.distributed could not
            be initialised (on every rank; the message says why).
    """
    # Before MPI_Init: the library must be one that can talk to the launcher.
    ensure_matching_library()
    # Imported on use: MPI starts here, when the backend has been chosen, not when the plugin loads.
    import mpi4py

    # MPI_Init_thread(MPI_THREAD_MULTIPLE) on import, unless already done.
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    world = MPI.COMM_WORLD
    if world.Get_size() != launch.world_size or world.Get_rank() != launch.rank:
        raise LaunchError(
            f"MPI says this process is rank {world.Get_rank()} of {world.Get_size()}, but the "
            f"{launch.launcher} launch says rank {launch.rank} of {launch.world_size}; start the job "
            "with mpiexec/mpirun/srun --mpi to use the mpi backend, or choose another backend"
        )
    # Imports mpi4py.MPI: only once MPI is initialised with the thread level above.
    from shardwise_mpi._group import MpiGroup

    torch_group = _init_torch_default_group(MPI, world, timeout)
    if world.Get_size() > 1:
        # After torch's init_process_group, which puts a hook in front of sys.excepthook that
        # buffers the traceback to prefix "[rankN]" and prints it only when the hook it wraps
        # returns: wrapped by it, MPI_Abort would end the process with the traceback unprinted.
        install_abort_hook()
    try:
        # A duplicate keeps shardwise's messages apart from the user's own MPI calls on COMM_WORLD.
        return MpiGroup(world.Dup(), owns_comm=True, timeout=timeout, torch_default_group=torch_group)
    except BaseException:
        if torch_group is not None:
            dist.destroy_process_group()
        raise


def _torch_dist_setting() -> Optional[bool]:
    """``SHARDWISE_MPI_TORCH_DIST`` as a bool (unset: on); None when the value is not one it understands."""
    raw = os.environ.get(TORCH_DIST_ENV, "").strip().lower()
    if raw in _OFF:
        return False
    return True if raw in _ON else None


def _init_torch_default_group(mpi: Any, world: Any, timeout: timedelta) -> Optional[dist.ProcessGroup]:
    """Initialise torch.distributed's default group with backend ``"mpi4py"`` over ``world``, unless told not to.

    Every rank decides the same way: the setting of ``SHARDWISE_MPI_TORCH_DIST``
    and whether torch.distributed is already initialised are exchanged over
    ``world`` first (one small all-gather), and so is the outcome of the
    rendezvous, so a rank that fails makes every rank raise instead of
    leaving its peers waiting in torch's first collective.

    Args:
        mpi: The ``mpi4py.MPI`` module (imported by :func:`create_group` once MPI is initialised).
        world: ``MPI.COMM_WORLD``.
        timeout: The rendezvous's and the torch group's timeout (``shardwise.init``'s).

    Returns:
        The default process group made here (the :class:`MpiGroup` destroys
        it), or None when torch.distributed was left alone.

    Raises:
        LaunchError: the ranks disagree (the variable differs, or
            torch.distributed is initialised on some ranks only), the
            variable's value is not understood, or the rendezvous failed
            on some rank.
    """
    if not dist.is_available():  # a torch built without distributed support: nothing to initialise
        return None
    size = world.Get_size()
    setting = _torch_dist_setting()
    mine = array("i", [-1 if setting is None else int(setting), int(dist.is_initialized())])
    table = array("i", [0]) * (2 * size)
    world.Allgather([mine, mpi.INT], [table, mpi.INT])
    settings, initialised = table[0::2], table[1::2]
    if -1 in settings:
        bad = [r for r, s in enumerate(settings) if s == -1]
        raise LaunchError(
            f"{TORCH_DIST_ENV} must be 1 (the default: shardwise.init() initialises torch.distributed over MPI) "
            f"or 0 (leave torch.distributed alone), but ranks {bad} of {size} have another value (this rank: "
            f"{os.environ.get(TORCH_DIST_ENV)!r}); set it to 1 or 0 on every rank"
        )
    if len(set(settings)) > 1 or len(set(initialised)) > 1:
        raise LaunchError(
            f"the ranks disagree on torch.distributed: {TORCH_DIST_ENV} reads {list(settings)} and "
            f"torch.distributed is initialised on ranks {[r for r, i in enumerate(initialised) if i]} "
            f"of {size}; set {TORCH_DIST_ENV} the same way on every rank, and initialise torch.distributed "
            "on every rank or on none before shardwise.init()"
        )
    if not settings[0]:
        _log.debug("torch.distributed left alone (%s=0)", TORCH_DIST_ENV)
        return None
    if initialised[0]:
        _log.debug("torch.distributed is already initialised (backend %s): left as it is", dist.get_backend())
        return None
    register()
    store: Optional[dist.Store] = None
    failure: Optional[Exception] = None
    try:
        # One rank needs no rendezvous (as the gloo backend does with its world of one).
        store = dist.HashStore() if size == 1 else _mpi_store(timeout)[0]
    except (RuntimeError, OSError) as exc:
        failure = exc
    failed = array("i", [0]) * size
    world.Allgather([array("i", [int(failure is not None)]), mpi.INT], [failed, mpi.INT])
    if any(failed):
        detail = " ".join(str(failure).split()) if failure is not None else "this rank's own part succeeded"
        raise LaunchError(
            f"shardwise.init() could not initialise torch.distributed over MPI: the rendezvous failed on ranks "
            f"{[r for r, f in enumerate(failed) if f]} ({detail}). Set MASTER_ADDR to an address of rank 0's "
            f"host that every rank can reach, or {TORCH_DIST_ENV}=0 if this job runs no torch-native code "
            "(DTensor, FSDP, distributed checkpoint) over MPI"
        ) from failure
    dist.init_process_group(BACKEND_NAME, store=store, rank=world.Get_rank(), world_size=size, timeout=timeout)
    _log.debug("torch.distributed's default process group initialised over MPI (backend %r)", BACKEND_NAME)
    return dist.group.WORLD


@hookimpl
def shardwise_backends() -> Iterable[Backend]:
    yield Backend(
        name="mpi",
        is_available=is_available,
        create_group=create_group,
        devices=("cpu", "cuda"),
        distribution="shardwise-mpi",
        priority=-10,
        preferred_under=("mpi",),
        description="MPI through mpi4py: mpiexec/mpirun/srun launches, CPU (and CUDA-aware) tensors",
    )
