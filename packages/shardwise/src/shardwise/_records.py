"""Frozen records that plugins yield from the registration hooks.

Every record is immutable and compares by value, so the registry can sort
them, detect duplicates and show them in ``shardwise info`` without caring
which plugin made them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

if TYPE_CHECKING:
    from shardwise._group import Group

__all__ = ["Availability", "Backend", "LaunchInfo", "Launcher", "ShardedOp"]


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
            raise ValueError(
                f"{self.launcher}: rank {self.rank} is outside [0, {self.world_size})"
            )
        if self.local_rank < 0:
            raise ValueError(f"{self.launcher}: local rank must be >= 0, got {self.local_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"{self.launcher}: master port {self.master_port} is not a TCP port")


@dataclass(frozen=True)
class Launcher:
    """A way processes can be started, recognised from their environment.

    Attributes:
        name: Unique launcher name (``"openmpi"``).
        detect: ``detect(environ) -> LaunchInfo | None``; returns None when
            the environment was not made by this launcher. It must only read
            the mapping it is given (no I/O, no imports of heavy libraries).
        priority: Launchers are tried from the highest priority down; the
            first match wins. torchrun outranks MPI launchers (a torchrun
            started inside ``srun`` is still torchrun), MPI launchers
            outrank plain Slurm.
        description: One line shown by ``shardwise info``.
    """

    name: str
    detect: Callable[[Mapping[str, str]], Optional[LaunchInfo]]
    priority: int = 0
    description: str = ""


@dataclass(frozen=True)
class Backend:
    """A collective backend: how to make a :class:`~shardwise.Group`.

    Attributes:
        name: Backend name users pass to ``shardwise.init(backend=...)``.
        is_available: Returns an :class:`Availability`; must be cheap and
            must not initialise communication (it is called by
            ``shardwise info`` and by automatic backend selection).
        create_group: ``create_group(launch, timeout) -> Group``; called on
            every rank by ``shardwise.init`` to make the default group.
        devices: Device types whose tensors the backend moves natively
            (``("cpu",)``, ``("cuda",)``); tensors on other devices are
            staged through the group's own device.
        distribution: The pip distribution that provides it, named in
            error messages.
        priority: Rank among available backends for automatic selection
            outside the launcher families listed in ``preferred_under``.
        preferred_under: Launcher families (see :class:`LaunchInfo`) under
            which this backend is chosen first when available (the MPI
            backend lists ``("mpi",)``).
        description: One line shown by ``shardwise info``.
    """

    name: str
    is_available: Callable[[], Availability]
    create_group: Callable[[LaunchInfo, timedelta], Group]
    devices: tuple[str, ...] = ("cpu",)
    distribution: str = ""
    priority: int = 0
    preferred_under: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class ShardedOp:
    """An implementation of a torch op for tensors sharded with a spec.

    Attributes:
        op: The torch callable being implemented
            (``torch.nn.functional.embedding``).
        spec: The sharding-spec class the implementation handles; lookups
            walk the spec's MRO, so an impl for a base class serves
            subclasses unless a more specific one is registered.
        impl: ``impl(types, args, kwargs, process_group) -> Any``, called by
            ``ShardedTensor.__torch_function__`` in place of ``op``.
        description: One line shown by ``shardwise info``.
        override: Replace another plugin's implementation of the same op
            and spec instead of conflicting with it, and win over
            non-override implementations for more specific specs too. Set by
            ``custom_sharded_op_impl`` / ``custom_sharding_spec_op`` so
            user code can deliberately take over an op; two overrides of
            the same op and spec still conflict.
    """

    op: Callable[..., Any]
    spec: type
    impl: Callable[..., Any]
    description: str = ""
    override: bool = False

    @property
    def op_name(self) -> str:
        """Qualified name of ``op`` (``torch.nn.functional.embedding``)."""
        return qualified_name(self.op)


def qualified_name(obj: Any) -> str:
    """``module.name`` of a function or class, for messages and sorting.

    Prefers the public name a module exposes the object under, so
    ``torch.add`` reads as such rather than as its C binding's qualname.
    """
    if getattr(obj, "__objclass__", None) is torch._C.TensorBase:
        return f"torch.Tensor.{obj.__name__}"
    descriptor = getattr(obj, "__self__", None)
    if descriptor is not None and getattr(descriptor, "__objclass__", None) is torch._C.TensorBase:
        # An attribute getter/setter: torch.Tensor.shape.__get__
        return f"torch.Tensor.{descriptor.__name__}.{obj.__name__}"
    if getattr(obj, "__module__", None) == "torch._tensor" and getattr(obj, "__qualname__", "").startswith("Tensor."):
        return f"torch.{obj.__qualname__}"
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__name__", None)
    if module and name and getattr(sys.modules.get(module), name, None) is obj:
        return f"{module}.{name}"
    qualname = getattr(obj, "__qualname__", None) or name or repr(obj)
    return f"{module}.{qualname}" if module else qualname
