"""mpi4py loads an MPI library that can talk to the launcher (``shardwise_mpi._libmpi``).

The decision is tested with a fake library probe (every combination of
launcher and default library, without needing both MPIs installed); the
real probe against MPICH from PyPI; and, where Debian's Open MPI is
installed, a real ``mpirun`` job (tox env ``integration-openmpi`` runs the
whole mpi suite that way).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from shardwise_mpi import _libmpi
from shardwise_mpi._libmpi import LIBMPI_ENV, MPICH, OPEN_MPI, launcher_abi, library_abi, match_launcher

from shardwise.errors import LaunchError
from shardwise.testing import launcher_free_env

OMPI_ENV = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
HYDRA_ENV = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "9"}


def _fake(libraries: dict[str, str]):  # type: ignore[no-untyped-def]
    """A probe that knows exactly ``libraries`` (path or name -> ABI)."""

    def probe(path: str) -> Optional[str]:
        return libraries.get(path)

    return probe


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """mpi4py's default search list, pinned to two names the fake probe can answer for."""
    order = ["/venv/lib/libmpi.so", "libmpi.so", "libmpi.so.12", "libmpi.so.40"]
    monkeypatch.setattr(_libmpi, "default_candidates", lambda: iter(order))
    monkeypatch.setattr(_libmpi, "_launcher_prefixes", lambda environ, abi: iter([Path("/opt/ompi")]))
    return order


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (OMPI_ENV, (OPEN_MPI, "OMPI_COMM_WORLD_SIZE")),
        (HYDRA_ENV, (MPICH, "PMI_RANK")),
        ({"PMI_FD": "3"}, (MPICH, "PMI_FD")),
        ({"PMIX_RANK": "0"}, None),  # PMIx alone: either kind may be built for it
        ({}, None),
    ],
)
def test_the_launcher_says_which_mpi_it_speaks(environ: dict[str, str], expected: object) -> None:
    assert launcher_abi(environ) == expected


def test_open_mpi_launcher_with_mpich_default_chooses_open_mpi(
    defaults: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Path, "exists", lambda self: str(self) == "/opt/ompi/lib/libmpi.so.40")
    environ = dict(OMPI_ENV)
    probe = _fake({"/venv/lib/libmpi.so": MPICH, "/opt/ompi/lib/libmpi.so.40": OPEN_MPI, "libmpi.so.40": OPEN_MPI})
    choice = match_launcher(environ, probe)
    # The library installed with the launcher wins over the linker's.
    assert environ[LIBMPI_ENV] == "/opt/ompi/lib/libmpi.so.40" == choice.library
    assert choice.launcher_abi == OPEN_MPI
    assert "OMPI_COMM_WORLD_SIZE" in choice.reason and "/venv/lib/libmpi.so" in choice.reason


def test_hydra_launcher_with_open_mpi_default_chooses_mpich(defaults: list[str]) -> None:
    environ = dict(HYDRA_ENV)
    choice = match_launcher(environ, _fake({"libmpi.so": OPEN_MPI, "libmpi.so.12": MPICH}))
    assert environ[LIBMPI_ENV] == "libmpi.so.12" == choice.library


def test_matching_default_is_left_alone(defaults: list[str]) -> None:
    environ = dict(HYDRA_ENV)
    choice = match_launcher(environ, _fake({"/venv/lib/libmpi.so": MPICH, "libmpi.so.40": OPEN_MPI}))
    assert LIBMPI_ENV not in environ and choice.library is None
    assert "is MPICH's" in choice.reason


@pytest.mark.parametrize("variable", [LIBMPI_ENV, "MPI4PY_MPIABI"])
def test_the_users_choice_is_kept(defaults: list[str], variable: str) -> None:
    environ = {**OMPI_ENV, variable: "/my/libmpi.so"}
    choice = match_launcher(environ, _fake({"/venv/lib/libmpi.so": MPICH}))
    assert environ[variable] == "/my/libmpi.so" and choice.library is None
    assert variable in choice.reason


def test_no_launcher_keeps_the_default(defaults: list[str]) -> None:
    environ: dict[str, str] = {}
    assert match_launcher(environ, _fake({"/venv/lib/libmpi.so": MPICH})).library is None
    assert environ == {}


def test_no_library_of_the_launchers_kind_raises_naming_the_fix(defaults: list[str]) -> None:
    environ = dict(OMPI_ENV)
    with pytest.raises(LaunchError) as info:
        match_launcher(environ, _fake({"/venv/lib/libmpi.so": MPICH}))
    message = str(info.value)
    for part in (
        "Open MPI's launcher (OMPI_COMM_WORLD_SIZE is set)",
        "MPICH's library /venv/lib/libmpi.so",
        "libmpi.so.40",
        "MPI_Init would abort",
        f"{LIBMPI_ENV}=/path/to/libmpi.so.40",
        "mpiexec beside this Python",
    ):
        assert part in message
    assert LIBMPI_ENV not in environ


def test_is_available_reports_the_missing_library(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise_mpi import plugin

    if "mpi4py.MPI" in sys.modules:
        pytest.skip("mpi4py.MPI is already imported in this process: the library is chosen")

    def no_library() -> None:
        raise LaunchError("no Open MPI library was found")

    monkeypatch.setattr(plugin, "ensure_matching_library", no_library)
    availability = plugin.is_available()
    assert not availability.available and "no Open MPI library" in availability.reason


def test_real_probe_tells_mpich_from_a_non_library(tmp_path: Path) -> None:
    venv_lib = Path(sys.exec_prefix) / "lib"
    mpich = next((venv_lib / name for name in ("libmpi.so.12", "libmpi.so") if (venv_lib / name).exists()), None)
    if mpich is None:
        pytest.skip(f"no MPICH library in {venv_lib} (shardwise-mpi[mpich] installs one)")
    assert library_abi(str(mpich)) == MPICH
    (tmp_path / "libnot.so").write_bytes(b"not a library")
    assert library_abi(str(tmp_path / "libnot.so")) is None
    assert library_abi("libc.so.6") is None  # a library, but not MPI


OPEN_MPI_RUN = shutil.which("mpirun.openmpi")


def _open_mpi_env() -> dict[str, str]:
    """This environment for an ``mpirun.openmpi`` job: as root, oversubscribed, no library chosen by hand."""
    env = launcher_free_env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    for name in (LIBMPI_ENV, "MPI4PY_MPIABI"):
        env.pop(name, None)
    return env


@pytest.mark.skipif(OPEN_MPI_RUN is None, reason="Debian's Open MPI (mpirun.openmpi) is not installed")
def test_open_mpi_mpirun_runs_backend_mpi_with_mpich_from_pypi_installed(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text(
        "import os, sys, shardwise, torch\n"
        "g = shardwise.init()\n"
        "t = torch.tensor([float(g.rank + 1)])\n"
        "g.all_reduce(t)\n"
        # One write per line (PYTHONUNBUFFERED makes print write the newline apart, and lines merge).
        "sys.stdout.write(f'rank {g.rank}/{g.size} {g.backend} {t.item()} {os.environ[\"MPI4PY_LIBMPI\"]}\\n')\n"
        "sys.stdout.flush()\n"
        "shardwise.destroy()\n"
    )
    env = _open_mpi_env()
    assert OPEN_MPI_RUN is not None
    proc = subprocess.run(
        [OPEN_MPI_RUN, "-n", "2", sys.executable, str(program)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split()[:4] for line in lines] == [["rank", "0/2", "mpi", "3.0"], ["rank", "1/2", "mpi", "3.0"]], (
        proc.stdout + proc.stderr
    )
    assert all(library_abi(line.split()[4]) == OPEN_MPI for line in lines)


def _can_hide_files() -> bool:
    """Whether this process may bind-mount over a file in a private mount namespace (root, `unshare` present)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(OPEN_MPI_RUN is None, reason="Debian's Open MPI (mpirun.openmpi) is not installed")
@pytest.mark.skipif(not _can_hide_files(), reason="needs root and unshare -m to hide Open MPI's library")
def test_open_mpi_launch_without_its_library_names_the_fix(tmp_path: Path) -> None:
    # Open MPI's libmpi hidden (an empty file bound over it, in a mount namespace of this job only):
    # the user sees why backend mpi was passed over, and backend="mpi" fails before MPI_Init, on every rank.
    libmpi = Path("/usr/lib") / (getattr(sys.implementation, "_multiarch", "") or "") / "libmpi.so.40"
    if not libmpi.exists():
        pytest.skip(f"Open MPI's library is not at {libmpi}")
    program = tmp_path / "prog.py"
    program.write_text(
        "import shardwise\n"
        "try:\n"
        "    shardwise.init(backend='mpi')\n"
        "except Exception as exc:\n"
        "    import sys\n"
        "    sys.stdout.write(f'RAISED {type(exc).__name__}: {exc}\\n')\n"
        "    sys.stdout.flush()\n"
    )
    env = _open_mpi_env()
    script = f"mount --bind /dev/null {libmpi.resolve()} && exec {OPEN_MPI_RUN} -n 2 {sys.executable} {program}"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    raised = [line for line in proc.stdout.splitlines() if line.startswith("RAISED ")]
    assert len(raised) == 2, proc.stdout + proc.stderr
    for line in raised:
        assert line.startswith("RAISED BackendUnavailableError: backend 'mpi' is installed but cannot run here"), line
        assert "Open MPI's launcher (OMPI_COMM_WORLD_SIZE is set)" in line and "MPI4PY_LIBMPI=" in line, line
