"""shardwise backend ``"mpi"``: collectives over MPI through mpi4py."""

from __future__ import annotations

from shardwise_mpi._c10d import register as _register_c10d

__version__ = "0.1.0"

# `import shardwise_mpi` makes torch.distributed.init_process_group("mpi4py")
# available; registering imports neither mpi4py nor libmpi.
_register_c10d()
__all__ = ["__version__"]
