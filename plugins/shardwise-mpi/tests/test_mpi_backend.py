"""shardwise-mpi: real ``mpiexec`` jobs (collective battery, abort on error) and in-process availability checks."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import shardwise_mpi.plugin as plugin
from mpi_launch import MPIEXEC, needs_mpiexec
from mpi_launch import run as _run
from mpi_launch import show as _show

PROGRAMS = Path(__file__).parent / "programs"


@needs_mpiexec
@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_battery_under_mpiexec(world_size: int) -> None:
    proc = _run([str(MPIEXEC), "-n", str(world_size), sys.executable, str(PROGRAMS / "mpi_battery.py")], 120)
    assert proc.returncode == 0, _show(proc)
    for r in range(world_size):
        assert f"RANK {r} OF {world_size} OK" in proc.stdout, _show(proc)


@needs_mpiexec
def test_raising_rank_aborts_the_whole_job() -> None:
    start = time.monotonic()
    proc = _run([str(MPIEXEC), "-n", "2", sys.executable, str(PROGRAMS / "mpi_raise.py")], 60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, _show(proc)
    assert elapsed < 30, f"the job took {elapsed:.0f}s to end\n{_show(proc)}"
    output = proc.stdout + proc.stderr
    assert "Traceback (most recent call last)" in output and "RuntimeError: rank 1 failed on purpose" in output, _show(
        proc
    )
    assert "shardwise: rank 1 raised RuntimeError; calling MPI_Abort" in output, _show(proc)
    assert "SHOULD NOT GET HERE" not in output, _show(proc)


def test_singleton_world_without_mpiexec() -> None:
    proc = _run([sys.executable, str(PROGRAMS / "mpi_singleton.py")], 60)
    assert proc.returncode == 0, _show(proc)
    assert "SINGLETON OK" in proc.stdout, _show(proc)


def test_is_available_with_mpi4py_installed() -> None:
    availability = plugin.is_available()
    assert availability, availability.reason


def test_is_available_names_the_install_command_without_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import mpi4py` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    availability = plugin.is_available()
    assert not availability
    assert "mpi4py is not installed" in availability.reason
    assert "pip install shardwise-mpi[mpich]" in availability.reason


def test_is_available_reports_a_missing_libmpi(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mpi4py._mpiabi")
    if sys.modules.get("mpi4py.MPI") is not None:
        pytest.skip("mpi4py.MPI is already loaded in this process")
    monkeypatch.setenv("MPI4PY_LIBMPI", "/nonexistent/libmpi.so")
    from mpi4py import _mpiabi

    monkeypatch.setattr(_mpiabi, "LIBMPI", None, raising=False)
    monkeypatch.setattr(_mpiabi, "MPIABI", None, raising=False)
    monkeypatch.delattr(_mpiabi._get_mpiabi, "mpiabi", raising=False)  # mpi4py caches the first lookup
    availability = plugin.is_available()
    assert not availability
    assert "cannot load an MPI library" in availability.reason and "/nonexistent/libmpi.so" in availability.reason
    assert "pip install shardwise-mpi[mpich]" in availability.reason


def test_backend_registration() -> None:
    (backend,) = list(plugin.shardwise_backends())
    assert backend.name == "mpi" and backend.distribution == "shardwise-mpi"
    assert backend.preferred_under == ("mpi",)
    # Outside an MPI launch gloo (priority 0) stays the automatic choice.
    assert backend.priority < 0


def test_importing_the_plugin_does_not_load_mpi() -> None:
    code = "import sys, shardwise, shardwise_mpi.plugin; assert 'mpi4py' not in sys.modules, sorted(sys.modules)"
    proc = _run([sys.executable, "-c", code], 60)
    assert proc.returncode == 0, _show(proc)


@needs_mpiexec
def test_cuda_tensors_under_mpiexec() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA-aware and host-staged paths need one")
    proc = _run([str(MPIEXEC), "-n", "2", sys.executable, str(PROGRAMS / "mpi_cuda.py")], 120)
    assert proc.returncode == 0, _show(proc)
    for r in range(2):
        assert f"RANK {r} CUDA OK" in proc.stdout, _show(proc)
