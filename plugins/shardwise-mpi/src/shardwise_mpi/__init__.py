"""shardwise backend ``"mpi"``: collectives over MPI through mpi4py.

Importing this package changes no global state: the plugin manager imports it
to find backend ``"mpi"`` (``shardwise info`` and every run that builds the
plugin manager do), so it registers nothing with torch and imports no MPI.

The torch.distributed backend ``"mpi4py"`` (torch-native code such as DTensor,
FSDP2 and DCP over MPI) is registered when asked, with
:func:`register_torch_backend`::

    # mpiexec -n 2 python train.py
    import shardwise_mpi, torch.distributed as dist
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py")      # no MASTER_ADDR/RANK needed
"""

from __future__ import annotations

from shardwise_mpi._c10d_register import register as _register_c10d

__version__ = "0.1.0"

__all__ = ["__version__", "register_torch_backend"]


def register_torch_backend() -> None:
    """Make ``torch.distributed.init_process_group("mpi4py")`` available in this process.

    Registers the torch.distributed backend ``"mpi4py"`` (c10d collectives
    over mpi4py), the rendezvous scheme ``init_method="mpi4py://"``, and wraps
    torch's ``env://`` handler so that, in a process started by an MPI
    launcher (``mpiexec``/``mpirun``/``srun``) without ``MASTER_ADDR``/
    ``MASTER_PORT``, rank and world size come from ``MPI.COMM_WORLD`` (any
    torch backend, gloo included, can then rendezvous with no variables set).
    With those variables set, torch's handler runs unchanged.

    Idempotent and thread-safe. Imports neither mpi4py nor MPI: MPI starts
    when the first ``"mpi4py"`` group (or an MPI rendezvous) is created.

    ``shardwise.init()`` on backend ``"mpi"`` calls it and initialises
    torch.distributed's default group on ``"mpi4py"`` itself, unless
    ``SHARDWISE_MPI_TORCH_DIST=0`` or torch.distributed is initialised
    already. Call it yourself before ``init_process_group`` in torch-native
    code that does not call ``shardwise.init()``.

    Example::

        import shardwise_mpi
        import torch
        import torch.distributed as dist

        shardwise_mpi.register_torch_backend()
        dist.init_process_group("mpi4py")
        dist.all_reduce(torch.ones(3))
    """
    _register_c10d()
