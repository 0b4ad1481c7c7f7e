"""How the plugin's tests start MPI jobs: which ``mpiexec``, and with what environment.

``MPIEXEC`` is :func:`shardwise.testing.find_mpiexec`'s: ``$SHARDWISE_MPIEXEC``
(tox env ``integration-openmpi`` sets Debian's Open MPI ``mpirun.openmpi``),
else the one ``shardwise-mpi[mpich]`` installs beside this Python. The jobs
get this process's environment without any launcher's or rendezvous
variables, so a program started by hand is a world of one; Open MPI's
settings (``OMPI_MCA_*``, ``OMPI_ALLOW_RUN_AS_ROOT*``) are kept.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shardwise import testing
from shardwise.testing import find_mpiexec, mpiexec_kind

try:
    MPIEXEC = Path(find_mpiexec())
except FileNotFoundError:
    MPIEXEC = Path("mpiexec-not-found")
#: ``"openmpi"`` or ``"mpich"``: where the two launchers' options differ.
KIND = mpiexec_kind(str(MPIEXEC)) if MPIEXEC.exists() else "unknown"

needs_mpiexec = pytest.mark.skipif(
    not MPIEXEC.exists(), reason="no mpiexec (none beside this Python; install shardwise-mpi[mpich])"
)
needs_hydra = pytest.mark.skipif(
    KIND != "mpich", reason=f"uses Hydra's (MPICH's) mpiexec options; {MPIEXEC} is {KIND}'s"
)

def launcher_free_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables (Open MPI's settings kept), plus ``extra``."""
    env = {k: v for k, v in testing.launcher_free_env().items() if not k.startswith("TORCH_DIST")}
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # torch 2.13 deprecation noise in the logs
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in :func:`launcher_free_env`; a timeout fails the test with all the output so far."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=launcher_free_env(**extra), check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout}s\n--- stdout ---\n{out}\n--- stderr ---\n{err}")


def show(proc: subprocess.CompletedProcess[str]) -> str:
    """A job's exit status and every rank's output, for an assertion message."""
    return (
        f"exit {proc.returncode}\n--- stdout (all ranks) ---\n{proc.stdout}\n--- stderr (all ranks) ---\n{proc.stderr}"
    )
