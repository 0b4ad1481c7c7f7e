"""The core's built-in launchers, registered through ``shardwise_launchers``.

Each detector reads only the environment mapping it is given. MPI process
managers outrank Slurm because ``mpiexec`` inside an allocation starts its
proxies with ``srun``, so the Slurm variables there describe proxies, not
ranks; torchrun outranks everything because it may itself run under
``srun`` or ``mpiexec``.
"""

from __future__ import annotations

import re
import zlib
from typing import Iterable, Mapping, Optional

from shardwise._registry.records import LaunchInfo, Launcher
from shardwise.errors import LaunchError
from shardwise.hookspecs import hookimpl

__all__ = ["detect_launch", "first_slurm_host", "slurm_port"]

_RENDEZVOUS_HINT = (
    "set MASTER_ADDR (the host of rank 0, reachable from every rank) and "
    "MASTER_PORT (a free TCP port on it) to the same values on every rank"
)
#: The other way out under an MPI launcher: its own backend, which needs no address. Where it is
#: installed (most likely, under mpiexec) the user only has to choose it.
_MPI_INSTEAD = (
    "or use the mpi backend (`shardwise.init(\"mpi\")`, or SHARDWISE_BACKEND=mpi; where `shardwise info` "
    "does not list it, `pip install shardwise-mpi[mpich]`)"
)

# Slurm reports the batch and extern steps with these ids; a shell in them
# has SLURM_PROCID=0 but is not one rank of a multi-rank launch.
_NON_SRUN_STEPS = frozenset({"batch", "extern", "interactive", "4294967294", "4294967295", "4294967293"})


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{launcher}: {name}={raw!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], launcher: str, *names: str) -> Optional[int]:
    for name in names:
        if env.get(name, "") != "":
            return _int(env, name, launcher)
    return None


def _master(env: Mapping[str, str], launcher: str) -> tuple[Optional[str], Optional[int]]:
    addr = env.get("MASTER_ADDR") or None
    port = _opt_int(env, launcher, "MASTER_PORT")
    return addr, port


def _detect_torchrun(env: Mapping[str, str]) -> Optional[LaunchInfo]:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    name = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
    addr, port = _master(env, name)
    return LaunchInfo(
        launcher=name,
        family=name,
        rank=_int(env, "RANK", name),
        world_size=_int(env, "WORLD_SIZE", name),
        local_rank=_opt_int(env, name, "LOCAL_RANK") or 0,
        local_world_size=_opt_int(env, name, "LOCAL_WORLD_SIZE"),
        master_addr=addr,
        master_port=port,
        rendezvous_hint=_RENDEZVOUS_HINT,
    )


def _detect_openmpi(env: Mapping[str, str]) -> Optional[LaunchInfo]:
    if "OMPI_COMM_WORLD_RANK" not in env or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    addr, port = _master(env, "openmpi")
    return LaunchInfo(
        launcher="openmpi",
        family="mpi",
        rank=_int(env, "OMPI_COMM_WORLD_RANK", "openmpi"),
        world_size=_int(env, "OMPI_COMM_WORLD_SIZE", "openmpi"),
        local_rank=_opt_int(env, "openmpi", "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
        local_world_size=_opt_int(env, "openmpi", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        master_addr=addr,
        master_port=port,
        rendezvous_hint=_RENDEZVOUS_HINT
        + " (e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`), "
        + _MPI_INSTEAD,
    )


def _detect_pmi(env: Mapping[str, str]) -> Optional[LaunchInfo]:
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    name = "intel-mpi" if any(key.startswith("I_MPI_") for key in env) else "mpich"
    addr, port = _master(env, name)
    return LaunchInfo(
        launcher=name,
        family="mpi",
        rank=_int(env, "PMI_RANK", name),
        world_size=_int(env, "PMI_SIZE", name),
        local_rank=_opt_int(env, name, "MPI_LOCALRANKID", "SLURM_LOCALID") or 0,
        local_world_size=_opt_int(env, name, "MPI_LOCALNRANKS"),
        master_addr=addr,
        master_port=port,
        rendezvous_hint=_RENDEZVOUS_HINT
        + " (e.g. `mpiexec -genv MASTER_ADDR $(hostname) -genv MASTER_PORT 29500 ...`), "
        + _MPI_INSTEAD,
    )


def _detect_slurm(env: Mapping[str, str]) -> Optional[LaunchInfo]:
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if step in _NON_SRUN_STEPS:
        return None
    addr, port = _master(env, "slurm")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if addr is None and nodelist:
        addr = first_slurm_host(nodelist)
    if port is None and "SLURM_JOB_ID" in env:
        port = slurm_port(env["SLURM_JOB_ID"], step)
    mpi_type = env.get("SLURM_MPI_TYPE", "none")
    wired_for_mpi = mpi_type not in ("", "none") or "PMIX_RANK" in env
    return LaunchInfo(
        launcher="slurm",
        family="mpi" if wired_for_mpi else "slurm",
        rank=_int(env, "SLURM_PROCID", "slurm"),
        world_size=_int(env, "SLURM_STEP_NUM_TASKS", "slurm"),
        local_rank=_opt_int(env, "slurm", "SLURM_LOCALID") or 0,
        local_world_size=None,
        master_addr=addr,
        master_port=port,
        rendezvous_hint=_RENDEZVOUS_HINT,
    )


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list, without expanding the whole list.

    ``"gpu[007-010,12],cpu1"`` gives ``"gpu007"``; each bracket takes the
    first value of its first range, keeping zero padding.

    Raises:
        LaunchError: the list is empty or its brackets do not balance.
    """
    depth, first = 0, nodelist
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                break
        elif char == "," and depth == 0:
            first = nodelist[:i]
            break
    first = first.strip()
    if depth != 0 or not first:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}")

    def _first_of(match: re.Match[str]) -> str:
        return match.group(1).split(",")[0].split("-")[0]

    host = re.sub(r"\[([^\]]*)\]", _first_of, first)
    if "[" in host or "]" in host or not host:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}")
    return host


def slurm_port(job_id: str, step: str = "") -> int:
    """A rendezvous port every task of one Slurm step derives alike.

    Spread over 15000-34999 by job and step so that concurrent steps on a
    node rarely collide; set ``MASTER_PORT`` to choose one yourself.
    """
    return 15000 + zlib.crc32(f"{job_id}.{step}".encode()) % 20000


def _detect_single(env: Mapping[str, str]) -> Optional[LaunchInfo]:
    return LaunchInfo(launcher="single", family="single", rank=0, world_size=1)


def detect_launch(launchers: Iterable[Launcher], env: Mapping[str, str]) -> LaunchInfo:
    """The first launcher (in the given order) that recognises ``env``.

    Raises:
        LaunchError: no launcher matched, or the matching one found
            malformed variables.
    """
    for launcher in launchers:
        try:
            info = launcher.detect(env)
        except ValueError as exc:
            # LaunchInfo rejects inconsistent values (RANK=5 with WORLD_SIZE=2) with a
            # ValueError; to callers that is a malformed environment like any other.
            raise LaunchError(f"{exc} (from the {launcher.name} launcher's environment variables)") from exc
        if info is not None:
            return info
    raise LaunchError("no launcher recognised this environment")


@hookimpl
def shardwise_launchers() -> Iterable[Launcher]:
    yield Launcher(
        "torchrun", _detect_torchrun, priority=100,
        description="torchrun / torch.distributed.run, or RANK and WORLD_SIZE set by hand",
    )
    yield Launcher(
        "openmpi", _detect_openmpi, priority=60,
        description="Open MPI mpirun/mpiexec (OMPI_COMM_WORLD_*)",
    )
    yield Launcher(
        "mpich", _detect_pmi, priority=50,
        description="MPICH/Hydra and Intel MPI mpiexec, srun --mpi=pmi2 (PMI_RANK, PMI_SIZE)",
    )
    yield Launcher(
        "slurm", _detect_slurm, priority=20,
        description="srun job steps (SLURM_PROCID, SLURM_STEP_NUM_TASKS)",
    )
    yield Launcher(
        "single", _detect_single, priority=-1000,
        description="a plain process: rank 0 of 1",
    )
