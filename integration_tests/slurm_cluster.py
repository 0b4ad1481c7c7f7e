"""A one-node Slurm cluster for the tests: Debian's slurm-wlm (slurmctld + slurmd) with munge.

:func:`start` writes a minimal ``slurm.conf`` into a directory of its own
(no cgroups: ``proctrack/linuxproc``, ``task/none``; one node, this host,
declaring 4 CPUs whatever it has, so that 3- and 4-task steps run on a small
machine; free TCP ports for both daemons), starts munged if it is not
running, then both daemons, and waits until ``sinfo`` shows the node idle.
:meth:`SlurmCluster.stop` shuts them down again (and munged, if it started
it). Jobs find the cluster through ``SLURM_CONF`` in :meth:`SlurmCluster.env`.

Needs root (slurmd starts every task as the submitting user, and this
cluster's SlurmUser is root) and the packages ``slurm-wlm`` and ``munge``
(``make system-deps``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from shardwise.testing import launcher_free_env

#: The programs the cluster needs; :func:`missing` names those not installed.
PROGRAMS = ("slurmctld", "slurmd", "munged", "munge", "srun", "sbatch", "sinfo", "scontrol", "scancel")
#: CPUs the node declares (``SlurmdParameters=config_overrides`` lets it declare more than it has).
CPUS = 4
#: Seconds to wait for the node to come up idle.
START_TIMEOUT = 60.0

_MUNGE_RUN = Path("/run/munge")


def _find(name: str) -> Optional[str]:
    """``name`` on PATH, or in /usr/sbin and /sbin (the daemons live there, off many users' PATH)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing() -> list[str]:
    """The cluster's programs that are not installed."""
    return [name for name in PROGRAMS if _find(name) is None]


def _which(name: str) -> str:
    found = _find(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed (Debian packages slurm-wlm and munge; `make system-deps`)")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _munge_works() -> bool:
    try:
        encoded = subprocess.run([_which("munge"), "-n"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return encoded.returncode == 0


@dataclass
class SlurmCluster:
    """A running one-node cluster; :meth:`env` is what a job's ``srun``/``sbatch`` needs."""

    root: Path
    conf: Path
    node: str
    started_munged: bool
    #: The daemons' process ids, read from their pid files once they are up (the files go at shutdown).
    pids: list[int] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment without launcher variables, with ``SLURM_CONF`` and ``extra``."""
        env = launcher_free_env(SLURM_CONF=str(self.conf), **extra)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin"])
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def logs(self) -> str:
        """The daemons' log files, for an assertion message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            parts.append(f"--- {name} ---\n{text[-4000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, shut both daemons down, and stop munged if :func:`start` started it."""
        env = self.env()
        # SIGKILL, not scancel's SIGTERM: a task hung in MPI would keep its step, and so slurmd, alive.
        scancel = [_which("scancel"), "--full", "--signal=KILL", "--user", "root"]
        subprocess.run(scancel, env=env, capture_output=True, timeout=30, check=False)
        subprocess.run([_which("scontrol"), "shutdown"], env=env, capture_output=True, timeout=30, check=False)
        for pid in self.pids:
            _wait_gone(pid)
        if self.started_munged:
            munged = _read_pid(_MUNGE_RUN / "munged.pid")
            if munged is not None:
                try:
                    os.kill(munged, 15)
                except ProcessLookupError:
                    return
                _wait_gone(munged)


def _read_pid(pidfile: Path) -> Optional[int]:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _wait_gone(pid: int, timeout: float = 15.0) -> None:
    """Wait until process ``pid`` has exited; SIGKILL it after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _start_munged() -> bool:
    """Start munged (as the ``munge`` user) unless one answers already; whether this call started it."""
    if _munge_works():
        return False
    _MUNGE_RUN.mkdir(parents=True, exist_ok=True)
    shutil.chown(_MUNGE_RUN, "munge", "munge")
    subprocess.run([_which("runuser"), "-u", "munge", "--", _which("munged")], check=True, timeout=30)
    deadline = time.monotonic() + 15
    while not _munge_works():
        if time.monotonic() > deadline:
            raise RuntimeError("munged started but `munge -n` still fails after 15 s")
        time.sleep(0.2)
    return True


def start(root: Path) -> SlurmCluster:
    """Write a configuration under ``root``, start munged and both daemons, wait for the node to be idle.

    Raises:
        FileNotFoundError: a program is missing (the message names the packages).
        RuntimeError: the node did not come up idle within :data:`START_TIMEOUT`;
            the message holds the daemons' logs.
    """
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=shardwise-tests",
                f"SlurmctldHost={node}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                # No cgroups in a container: track processes by parent, bind nothing.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                # Job ids restart at 1 with each new cluster. MPICH names its shared-memory segment after the
                # PMI job id, and a segment left behind by a killed job of an earlier cluster with the same id
                # corrupts the next one ("Invalid GenQ flag"): start where no earlier cluster has been.
                f"FirstJobId={1 + int(time.time()) % 50_000_000}",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                f"NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
                f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
                "",
            ]
        )
    )
    started_munged = _start_munged()
    cluster = SlurmCluster(root=root, conf=conf, node=node, started_munged=started_munged)
    env = cluster.env()
    subprocess.run([_which("slurmctld"), "-c", "-f", str(conf)], env=env, check=True, timeout=30)
    subprocess.run([_which("slurmd"), "-f", str(conf)], env=env, check=True, timeout=30)
    deadline = time.monotonic() + START_TIMEOUT
    state: Optional[str] = None
    while time.monotonic() < deadline:
        shown = subprocess.run(
            [_which("sinfo"), "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, check=False
        )
        state = shown.stdout.strip()
        if state == "idle":
            found = (_read_pid(root / name) for name in ("slurmctld.pid", "slurmd.pid"))
            cluster.pids = [pid for pid in found if pid is not None]
            return cluster
        time.sleep(0.5)
    logs = cluster.logs()
    found = (_read_pid(root / name) for name in ("slurmctld.pid", "slurmd.pid"))
    cluster.pids = [pid for pid in found if pid is not None]
    cluster.stop()
    raise RuntimeError(f"the Slurm node is {state!r}, not idle, after {START_TIMEOUT:g} s\n{logs}")
