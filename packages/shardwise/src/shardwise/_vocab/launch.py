"""What a launcher tells a process, which ranks share a host, and whether a backend can run here: plain data.

Records the registry's plugin records (:mod:`shardwise._registry.records`)
and the comm layer's torch groups both use, so they sit in the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Availability", "Host", "LaunchInfo", "group_by_host"]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can be used on this machine, and if not, why.

    Attributes:
        available: True when the backend can create groups here.
        reason: Human-readable explanation; required when ``available`` is
            False (``"CUDA is not available: torch 2.13.0+cpu is a CPU build"``).

    The record is truthy exactly when ``available`` is True, so
    ``if backend.is_available():`` reads naturally.
    """

    available: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.available and not self.reason:
            raise ValueError("Availability(available=False) needs a reason saying why")

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process about the job.

    Built by a :class:`Launcher`'s ``detect`` function from the environment.

    Attributes:
        launcher: Name of the launcher that matched (``"torchrun"``,
            ``"mpich"``, ``"openmpi"``, ``"intel-mpi"``, ``"slurm"``,
            ``"single"``).
        family: What kind of launch this is: ``"mpi"`` when the processes
            were started by an MPI process manager (so ``MPI_Init`` works),
            otherwise the launcher's own name. Backends list the families
            under which they are the automatic choice.
        rank: This process's rank in the job, ``0 <= rank < world_size``.
        world_size: Number of processes in the job.
        local_rank: Rank among the processes on this node.
        local_world_size: Processes on this node, or None when unknown.
        master_addr: Rendezvous host for store-based backends, or None.
        master_port: Rendezvous port for store-based backends, or None.
        rendezvous_hint: When ``master_addr``/``master_port`` are None, how
            the user can provide them (used in error messages).
    """

    launcher: str
    family: str
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rendezvous_hint: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"{self.launcher}: world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{self.launcher}: rank {self.rank} is outside [0, {self.world_size})")
        if self.local_rank < 0:
            raise ValueError(f"{self.launcher}: local rank must be >= 0, got {self.local_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"{self.launcher}: master port {self.master_port} is not a TCP port")


@dataclass(frozen=True)
class Host:
    """One host of a group and the group's ranks that run on it (:meth:`Group.hosts`).

    Attributes:
        name: The host's name (``socket.gethostname()`` there).
        ranks: The group ranks on this host, ascending.
    """

    name: str
    ranks: tuple[int, ...]


def group_by_host(identities: Sequence[Sequence[str]]) -> tuple[Host, ...]:
    """The hosts of a group, from each rank's ``(host name, boot id)`` in rank order.

    Ranks share a host when both parts match: the boot id (the kernel's,
    ``/proc/sys/kernel/random/boot_id``) keeps apart two machines that carry
    the same host name, as containers often do; the name keeps apart
    containers on one kernel. Hosts come in the order of their lowest rank.
    """
    ranks: dict[tuple[str, ...], list[int]] = {}
    for rank, identity in enumerate(identities):
        ranks.setdefault(tuple(identity), []).append(rank)
    return tuple(Host(name=key[0], ranks=tuple(members)) for key, members in ranks.items())
