"""Rendezvous of the ``"mpi4py"`` torch backend: rank, world size and a shared store through MPI.

Split out of :mod:`shardwise_mpi._c10d` (whose docstring describes the
backend as a whole, this rendezvous included): ``init_method="mpi4py://"``,
and torch's ``env://`` handler wrapped so that it falls back to MPI when
``MASTER_ADDR``/``MASTER_PORT`` are missing in a process an MPI launcher
started. Nothing here imports mpi4py before it is called.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist

from shardwise_mpi._libmpi import ensure_matching_library

__all__ = ["mpi", "mpi_rendezvous_handler", "mpi_store", "under_mpi_launcher", "wrap_env_handler"]

# Variables MPI launchers set in every process they start: Hydra/PMI (MPICH,
# Intel MPI, MVAPICH), PMIx (Open MPI 5, srun --mpi=pmix), Open MPI's own.
_LAUNCHER_VARS = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "MPI_LOCALNRANKS",
)
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")

_ADDRESS_BYTES = 1024


def mpi() -> Any:
    """``mpi4py.MPI``, imported on first use; the error says how to install it."""
    # Before mpi4py loads an MPI library: one that can talk to the launcher (raises LaunchError if none).
    ensure_matching_library()
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            'torch.distributed backend "mpi4py" needs mpi4py and an MPI library: '
            "pip install 'shardwise-mpi[mpich]' (or mpi4py against your system MPI)"
        ) from exc
    return MPI


def under_mpi_launcher() -> bool:
    """Whether an MPI launcher (mpiexec, mpirun, srun --mpi) started this process."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def mpi_store(timeout: timedelta) -> tuple[Any, int, int]:
    """A TCPStore hosted by MPI rank 0 on a free port, found by every rank through MPI.

    Raises:
        RuntimeError: rank 0 could not open the store (raised on every rank,
            so none waits for an address that never comes), or this rank
            could not connect to it within ``timeout``.
    """
    MPI = mpi()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    store = None
    failure: Optional[Exception] = None
    # Fixed-size bytes, not mpi4py's pickling bcast: no rank unpickles a peer's data.
    # All zeros means rank 0 has no store: every rank then raises instead of waiting.
    buf = bytearray(_ADDRESS_BYTES)
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        try:
            store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
            text = json.dumps([host, store.port]).encode()
            if len(text) > _ADDRESS_BYTES:
                raise RuntimeError(f"host name {host!r} is too long for the mpi4py rendezvous; set MASTER_ADDR")
            buf[: len(text)] = text
        except (RuntimeError, OSError) as exc:
            failure = exc
    world.Bcast([buf, MPI.BYTE], root=0)
    if failure is not None:
        raise failure
    if not any(buf):
        raise RuntimeError(
            "rank 0 could not open the TCP store of the mpi4py rendezvous (its own error says why); "
            "set MASTER_ADDR to an address of rank 0's host that every rank can reach"
        )
    if rank != 0:
        host, port = json.loads(bytes(buf).rstrip(b"\0").decode())
        store = dist.TCPStore(host, int(port), size, False, timeout=timeout)
    return store, rank, size


def mpi_rendezvous_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Iterator[Any]:
    """``init_method="mpi4py://"``: rank and world size from ``MPI.COMM_WORLD``."""
    yield mpi_store(timeout)
    raise RuntimeError("mpi4py:// rendezvous cannot re-rendezvous")


def wrap_env_handler(original: Any) -> Any:
    def handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Iterator[Any]:
        missing = [v for v in _RENDEZVOUS_VARS if not os.environ.get(v)]
        if missing and under_mpi_launcher():
            return mpi_rendezvous_handler(url, timeout=timeout, **kwargs)
        result: Iterator[Any] = original(url, timeout=timeout, **kwargs)
        return result

    handler._shardwise_mpi = True  # type: ignore[attr-defined]
    handler.__wrapped__ = original  # type: ignore[attr-defined]  # what it falls back to, for inspection
    return handler
