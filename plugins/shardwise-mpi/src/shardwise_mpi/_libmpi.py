"""Which MPI library mpi4py loads: one that can talk to the launcher that started this process.

mpi4py's wheels carry one extension per MPI ABI (MPICH's and Open MPI's) and
dlopen the first ``libmpi`` they find, the virtual environment's first: with
``shardwise-mpi[mpich]`` installed that is MPICH's, whichever ``mpirun``
started the process. MPICH's library cannot join a job that Open MPI's
``mpirun`` started (it aborts in ``MPI_Init`` with "Runtime environment uses
unsupported PMI version PMIx"), nor Open MPI's a job of Hydra's ``mpiexec``
(each rank becomes a world of one). So before mpi4py picks a library,
:func:`match_launcher` reads which MPI the launcher speaks, and where mpi4py's
default library is of the other kind, points mpi4py (``MPI4PY_LIBMPI``, its
documented switch) at a library of the launcher's kind: the one installed
with the launcher itself first, then one on the system's library path. Where
there is none it raises before ``MPI_Init``, naming the fix.

A user's own ``MPI4PY_LIBMPI`` or ``MPI4PY_MPIABI`` is always kept.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, MutableMapping, Optional

from shardwise.errors import LaunchError

__all__ = ["LIBMPI_ENV", "LibmpiChoice", "ensure_matching_library", "launcher_abi", "library_abi", "match_launcher"]

#: mpi4py's variables for choosing the library (a path list) and the ABI; a user's value is kept.
LIBMPI_ENV = "MPI4PY_LIBMPI"
MPIABI_ENV = "MPI4PY_MPIABI"

OPEN_MPI = "openmpi"
MPICH = "mpich"
_NAMES = {OPEN_MPI: "Open MPI", MPICH: "MPICH"}

#: Each ABI's library file names, in the order mpi4py tries them after plain ``libmpi.so``.
_SONAMES = {OPEN_MPI: ("libmpi.so.40",), MPICH: ("libmpi.so.12", "libmpich.so.12")}

#: Variables that say which MPI the launcher speaks, checked in this order.
#: Open MPI's launchers (mpirun, orterun, prterun) set OMPI_COMM_WORLD_*; Hydra
#: (MPICH's and Intel MPI's mpiexec) and ``srun --mpi=pmi2`` give PMI-1/PMI-2
#: (PMI_RANK, PMI_FD or PMI_PORT), which MPICH's library speaks and Open MPI's does not.
#: PMIx alone (``srun --mpi=pmix``) says nothing: both kinds can be built for it.
_LAUNCHER_MARKS = (
    ("OMPI_COMM_WORLD_SIZE", OPEN_MPI),
    ("OMPI_COMM_WORLD_RANK", OPEN_MPI),
    ("PMI_RANK", MPICH),
    ("PMI_FD", MPICH),
    ("PMI_PORT", MPICH),
)

_log = logging.getLogger("shardwise.session")

Probe = Callable[[str], Optional[str]]


@dataclass(frozen=True)
class LibmpiChoice:
    """What :func:`match_launcher` decided, for the log and the tests.

    Attributes:
        launcher_abi: the MPI kind the launcher speaks (``"openmpi"``,
            ``"mpich"``), or None where nothing says.
        library: the library set in ``MPI4PY_LIBMPI``, or None where
            mpi4py's own choice was kept.
        reason: one sentence saying why.
    """

    launcher_abi: Optional[str]
    library: Optional[str]
    reason: str


def launcher_abi(environ: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """The MPI kind (``"openmpi"`` or ``"mpich"``) the launcher speaks and the variable that says so; None if none."""
    for name, abi in _LAUNCHER_MARKS:
        if name in environ:
            return abi, name
    return None


def library_abi(path: str) -> Optional[str]:
    """The ABI of the MPI library ``path`` (a file, or a name for the dynamic linker); None if it is not one.

    dlopen with RTLD_LOCAL, as mpi4py does: the library's symbols do not
    reach the rest of the process, and opening it does not initialise MPI.
    """
    try:
        lib = ctypes.CDLL(path, os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError:
        return None
    if not hasattr(lib, "MPI_Get_version"):
        return None
    # Open MPI's predefined handles are exported objects; mpi4py tells the two ABIs apart the same way.
    return OPEN_MPI if hasattr(lib, "ompi_mpi_comm_self") else MPICH


def _prefixes() -> list[Path]:
    """The prefixes whose ``lib`` mpi4py searches first, in its order: this environment, user base, Python's own."""
    found = []
    if sys.exec_prefix != sys.base_exec_prefix:
        found.append(Path(sys.exec_prefix))
    site = sys.modules.get("site")
    user_base = getattr(site, "USER_BASE", None)
    if site is not None and getattr(site, "ENABLE_USER_SITE", False) and user_base:
        found.append(Path(user_base))
    if site is not None and sys.base_exec_prefix in getattr(site, "PREFIXES", ()) and sys.base_exec_prefix != "/usr":
        found.append(Path(sys.base_exec_prefix))
    return found


def default_candidates() -> Iterator[str]:
    """The libraries mpi4py would try, in order, when ``MPI4PY_LIBMPI`` is unset."""
    for prefix in _prefixes():
        for name in ("libmpi.so", *_SONAMES[MPICH][:1], *_SONAMES[OPEN_MPI]):
            path = prefix / "lib" / name
            if path.exists():
                yield str(path)
    yield from ("libmpi.so", _SONAMES[MPICH][0], _SONAMES[OPEN_MPI][0])


def _launcher_prefixes(environ: Mapping[str, str], abi: str) -> Iterator[Path]:
    """Where the launching MPI is installed: the parent process's program, ``OPAL_PREFIX``, the launcher on PATH."""
    try:
        # The rank's parent is the launcher or its daemon (mpirun/orted, hydra_pmi_proxy).
        yield Path(os.readlink(f"/proc/{os.getppid()}/exe")).resolve().parent.parent
    except OSError:
        pass
    if abi == OPEN_MPI and environ.get("OPAL_PREFIX"):
        yield Path(environ["OPAL_PREFIX"])
    programs = ("mpirun", "orterun", "prterun") if abi == OPEN_MPI else ("mpiexec.hydra", "mpiexec")
    for program in programs:
        where = shutil.which(program, path=environ.get("PATH"))
        if where:
            yield Path(where).resolve().parent.parent


def _libdirs(prefix: Path) -> Iterator[Path]:
    yield prefix / "lib"
    yield prefix / "lib64"
    multiarch = getattr(sys.implementation, "_multiarch", None)
    if multiarch:
        yield prefix / "lib" / multiarch  # Debian and Ubuntu: /usr/lib/x86_64-linux-gnu


def launcher_candidates(environ: Mapping[str, str], abi: str) -> Iterator[str]:
    """Libraries of kind ``abi``: those installed beside the launcher first, then the dynamic linker's."""
    seen: set[str] = set()
    for prefix in _launcher_prefixes(environ, abi):
        for libdir in _libdirs(prefix):
            for name in _SONAMES[abi]:
                path = libdir / name
                if path.exists() and str(path) not in seen:
                    seen.add(str(path))
                    yield str(path)
    yield from _SONAMES[abi]


def _first(candidates: Iterable[str], probe: Probe, want: Optional[str] = None) -> Optional[tuple[str, str]]:
    """The first candidate that is an MPI library (of ABI ``want``, if given), with its ABI."""
    for candidate in candidates:
        abi = probe(candidate)
        if abi is not None and (want is None or abi == want):
            return candidate, abi
    return None


def match_launcher(environ: MutableMapping[str, str], probe: Probe = library_abi) -> LibmpiChoice:
    """Point mpi4py at an MPI library that can talk to this process's launcher; call before importing ``mpi4py.MPI``.

    Sets ``environ["MPI4PY_LIBMPI"]`` where mpi4py's default library is of
    the other kind than the launcher speaks; changes nothing otherwise.

    Args:
        environ: the process environment (``os.environ``); read, and written
            where a library is chosen.
        probe: the ABI of a library path (:func:`library_abi`); tests pass
            a fake.

    Returns:
        What was decided and why.

    Raises:
        LaunchError: the launcher speaks one kind of MPI, mpi4py would load
            the other, and no library of the launcher's kind was found;
            ``MPI_Init`` would abort. The message names the fix.
    """
    user = next((name for name in (LIBMPI_ENV, MPIABI_ENV) if environ.get(name)), None)
    if user is not None:
        return LibmpiChoice(None, None, f"{user}={environ[user]} is set: mpi4py's library is the user's choice")
    spoken = launcher_abi(environ)
    if spoken is None:
        return LibmpiChoice(None, None, "no MPI launcher variable is set: mpi4py's default library is kept")
    abi, mark = spoken
    default = _first(default_candidates(), probe)
    if default is not None and default[1] == abi:
        return LibmpiChoice(abi, None, f"{mark} is set and mpi4py's default library {default[0]} is {_NAMES[abi]}'s")
    found = _first(launcher_candidates(environ, abi), probe, want=abi)
    if found is None:
        loads = f"{_NAMES[default[1]]}'s library {default[0]}" if default else "no MPI library"
        raise LaunchError(
            f"this process was started by {_NAMES[abi]}'s launcher ({mark} is set), but mpi4py would load "
            f"{loads}, and no {_NAMES[abi]} library ({' or '.join(_SONAMES[abi])}) was found beside the "
            f"launcher or on the library path, so MPI_Init would abort. Install {_NAMES[abi]}'s library, or "
            f"set {LIBMPI_ENV}=/path/to/{_SONAMES[abi][0]}, or launch with the mpiexec of the MPI that "
            "mpi4py loads (with shardwise-mpi[mpich]: the mpiexec beside this Python)"
        )
    environ[LIBMPI_ENV] = found[0]
    was = f"{_NAMES[default[1]]}'s {default[0]}" if default else "none"
    choice = LibmpiChoice(
        abi, found[0], f"{mark} is set, so {_NAMES[abi]}'s library {found[0]} (mpi4py's default: {was})"
    )
    _log.info("mpi: %s", choice.reason)
    return choice


def ensure_matching_library() -> None:
    """:func:`match_launcher` on ``os.environ``, unless ``mpi4py.MPI`` (and so its library) is already loaded.

    Every module of this plugin that imports ``mpi4py.MPI`` calls it first.

    Raises:
        LaunchError: as :func:`match_launcher`.
    """
    if sys.modules.get("mpi4py.MPI") is None:
        match_launcher(os.environ)
