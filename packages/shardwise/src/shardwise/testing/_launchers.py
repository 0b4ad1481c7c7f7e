"""Finding an MPI launcher, telling which MPI it is, and an environment free of any launcher's variables.

The helpers :mod:`shardwise.testing` offers tests that start jobs themselves
(under ``mpiexec``, ``torchrun``, or none): :func:`find_mpiexec` (also what
:func:`~shardwise.testing.run_ranks` launches with ``launcher="mpiexec"``),
:func:`mpiexec_kind` and :func:`launcher_free_env`. They need nothing of the
harness (:mod:`shardwise.testing._harness`, the parent side of ``run_ranks``),
which imports them from here: kept apart to keep each module short.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional

__all__ = ["find_mpiexec", "launcher_free_env", "mpiexec_kind"]


def find_mpiexec() -> str:
    """The ``mpiexec`` to launch with: ``$SHARDWISE_MPIEXEC``, the one beside this Python, else PATH's.

    Raises:
        FileNotFoundError: none is found (``pip install shardwise-mpi[mpich]``
            installs one into the environment).
    """
    explicit = os.environ.get("SHARDWISE_MPIEXEC")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError(
            "no mpiexec found (looked at $SHARDWISE_MPIEXEC, beside the Python executable and on PATH); "
            "`pip install shardwise-mpi[mpich]` installs one"
        )
    return found


#: Variables a surrounding launcher (or a developer's shell) may have set; they
#: would change what a launched job's ranks think their job is.
_LAUNCH_VARS = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
     "MPI_LOCALNRANKS", "MPI_LOCALRANKID"}
)  # fmt: skip
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_", "I_MPI_", "SHARDWISE_")
#: Launcher *settings*, kept: Open MPI's MCA parameters and its permission to run as root.
_SETTING_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")


def launcher_free_env(environ: Optional[Mapping[str, str]] = None, **extra: str) -> dict[str, str]:
    """``environ`` (default ``os.environ``) without any launcher's or rendezvous variables, plus ``extra``.

    A job a test starts (under ``mpiexec``, ``torchrun``, or none: a world of
    one) then sees only what its own launcher sets, even where the test itself
    runs inside a launched job. ``SHARDWISE_*`` goes too; Open MPI's settings
    (``OMPI_MCA_*``, ``OMPI_ALLOW_RUN_AS_ROOT*``) stay.
    """
    source = os.environ if environ is None else environ
    env = {
        name: value
        for name, value in source.items()
        if name.startswith(_SETTING_PREFIXES) or (name not in _LAUNCH_VARS and not name.startswith(_LAUNCH_PREFIXES))
    }
    env.update(extra)
    return env


@functools.cache
def mpiexec_kind(mpiexec: Optional[str] = None) -> str:
    """Which MPI an ``mpiexec`` belongs to: ``"openmpi"``, ``"mpich"`` (Hydra, also Intel MPI's), else ``"unknown"``.

    Tests need it where the two launchers' options differ (per-rank
    environment variables, several programs in one job).

    Args:
        mpiexec: the launcher's path; default :func:`find_mpiexec`'s.
    """
    path = mpiexec or find_mpiexec()
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    said = proc.stdout + proc.stderr
    if "Open MPI" in said or "OpenRTE" in said or "PRRTE" in said:
        return "openmpi"
    if "HYDRA" in said or "Intel(R) MPI" in said:
        return "mpich"
    return "unknown"
