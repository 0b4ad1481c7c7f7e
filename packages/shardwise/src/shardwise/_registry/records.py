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

from shardwise._vocab.launch import Availability, LaunchInfo

if TYPE_CHECKING:
    import argparse

    from shardwise._comm.group import Group

__all__ = ["Availability", "Backend", "CliCommand", "LaunchInfo", "Launcher", "ShardedOp"]


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


@dataclass(frozen=True)
class CliCommand:
    """A subcommand of the ``shardwise`` command line, contributed by a plugin.

    Attributes:
        name: The command (``"plan"`` for ``shardwise plan``): a lower-case
            word (letters, digits, ``-``, ``_``), not a built-in command.
        help: One line, shown by ``shardwise --help`` and as the command's
            description.
        add_arguments: ``add_arguments(parser)`` declares the command's
            arguments on its own ``argparse`` subparser.
        run: ``run(args) -> int`` runs the command with the parsed arguments
            and returns the exit status. It reports bad input itself (a
            one-line message on stderr and a non-zero status); a
            :class:`~shardwise.errors.ShardwiseError` it lets out becomes
            ``shardwise: error: ...`` and status 1.
        plugin: The plugin that contributed it: set by the core when it
            collects the records (leave it empty).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    plugin: str = ""


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
