"""Registers backend ``"mpi"`` through the ``shardwise_backends`` hook.

Importing this module imports neither mpi4py nor libmpi: ``shardwise info``
and backend selection must not initialise MPI. MPI is initialised only in
:func:`create_group`, when the backend has been chosen. Nothing here
registers the torch.distributed backend ``"mpi4py"`` either, not even
:func:`create_group`: a shardwise ``"mpi"`` group calls MPI directly and
never goes through torch.distributed, so choosing it must leave torch's
backends and rendezvous handlers alone. Torch-native code in the same job
calls :func:`shardwise_mpi.register_torch_backend` first.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from types import TracebackType
from typing import Iterable, Optional

from shardwise import Availability, Backend, Group, LaunchInfo, hookimpl
from shardwise.errors import LaunchError
from shardwise_mpi._watchdog import FORWARD_GRACE

__all__ = ["create_group", "install_abort_hook", "is_available", "shardwise_backends"]

_INSTALL = "`pip install shardwise-mpi[mpich]` (MPICH and mpiexec from PyPI) or install a system MPI"


def is_available() -> Availability:
    """Whether mpi4py imports and finds an MPI library (without initialising MPI)."""
    if sys.modules.get("mpi4py.MPI") is not None:
        return Availability(True)
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

    Raises:
        LaunchError: MPI's world disagrees with what the launcher said
            (for example ``backend="mpi"`` under torchrun, where every
            process is its own MPI world).
    """
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
    if world.Get_size() > 1:
        install_abort_hook()
    # Imports mpi4py.MPI: only once MPI is initialised with the thread level above.
    from shardwise_mpi._group import MpiGroup

    # A duplicate keeps shardwise's messages apart from the user's own MPI calls on COMM_WORLD.
    return MpiGroup(world.Dup(), owns_comm=True, timeout=timeout)


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
