"""Programs started by a real ``mpiexec`` (MPICH from PyPI): backend "mpi" and the "mpi4py" torch backend.

Skipped where no mpiexec is installed (tox env ``integration-mpi`` installs
``shardwise-mpi[mpich]``). Every job has a hard timeout after which its whole
process group is killed, and its full output is in the assertion message.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_torchrun_gloo import JOB_TIMEOUT, PROGRAMS, _environment, _run, torchrun

pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
try:
    from shardwise.testing import find_mpiexec

    MPIEXEC = find_mpiexec()
except FileNotFoundError as exc:  # pragma: no cover - depends on the env
    pytest.skip(f"no mpiexec: {exc}", allow_module_level=True)


def run_mpiexec(program: Path, n: int, *args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``program`` on ``n`` ranks under mpiexec (as root where Open MPI needs it), whatever its exit status."""
    env = _environment(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("SHARDWISE_TIMEOUT", None)  # the mpi backend enforces none; leave the program's default
    return _run([MPIEXEC, "-n", str(n), sys.executable, str(program), *args], timeout, env)


def mpiexec(program: Path, n: int, *args: str, timeout: float = JOB_TIMEOUT) -> str:
    """The output of ``program`` on ``n`` ranks under mpiexec, which must exit 0."""
    result = run_mpiexec(program, n, *args, timeout=timeout)
    assert result.returncode == 0, f"mpiexec exited {result.returncode}; output:\n{result.stdout}"
    return result.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_readme_example_picks_mpi_under_mpiexec(n: int) -> None:
    out = mpiexec(PROGRAMS / "sharded_readme.py", n)
    assert f"rank 0 (mpi): ShardedTensor [{3 * n + 1}, 4]" in out, out
    assert "rank 0: gathered tensor equals the dense computation" in out, out


def test_torch_backend_mpi4py_runs_dtensor_and_checkpoint(tmp_path: Path) -> None:
    out = mpiexec(PROGRAMS / "mpi_dtensor_dcp.py", 2, str(tmp_path / "ckpt"))
    assert sorted(re.findall(r"rank (\d) of 2 OK", out)) == ["0", "1"], out


def test_readme_embedding_bag_training_under_mpiexec() -> None:
    out = mpiexec(PROGRAMS / "embedding_bag_train.py", 3)
    for rank, rows in ((0, "0..333"), (1, "334..667"), (2, "668..999")):
        assert f"rank {rank}: rows {rows} match dense training" in out, out


def test_checkpoint_saved_under_mpiexec_loads_under_torchrun_into_another_spec(tmp_path: Path) -> None:
    pytest.importorskip("shardwise_gloo", reason="the torchrun half needs shardwise-gloo")
    path = str(tmp_path / "ckpt")
    out = mpiexec(PROGRAMS / "checkpoint_across_launchers.py", 2, "save", path)
    assert sorted(re.findall(r"rank (\d) of 2 \(mpi\) saved", out)) == ["0", "1"], out
    result = torchrun(PROGRAMS / "checkpoint_across_launchers.py", 3, args=("load", path))
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    found = re.findall(r"rank (\d) of 3 \(gloo\) loaded a \[11, 6\] weight saved elsewhere", result.stdout)
    assert sorted(found) == ["0", "1", "2"], result.stdout
