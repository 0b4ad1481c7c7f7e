"""The shardwise plugin contract: every hook a plugin may implement.

This is the one module plugin authors read. A plugin is any module or object
with functions named like the hooks below, decorated with
:data:`shardwise.hookimpl`. Plugins are found through the ``shardwise``
entry-point group::

    # pyproject.toml of your distribution
    [project.entry-points.shardwise]
    mybackend = "my_package.plugin"

Registration hooks take no arguments and return (or ``yield``) frozen
records from :mod:`shardwise._registry.records` (re-exported by :mod:`shardwise`).
The core collects them from every plugin, rejects wrong types and
duplicates (naming both plugins), and sorts them; callers then use the
accessors in :mod:`shardwise._registry.access`, never ``pm.hook`` directly.

Hooks are called lazily: the first time something asks for a backend, an op,
a launcher or a command, not at import time. They may be called again after
:func:`shardwise._registry.access.reset` (tests do this), so they must not have side
effects.
"""

from __future__ import annotations

from typing import Iterable

import pluggy

from shardwise._registry.records import Backend, CliCommand, Launcher, ShardedOp

PROJECT_NAME = "shardwise"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "shardwise_backends",
    "shardwise_cli_commands",
    "shardwise_launchers",
    "shardwise_sharded_ops",
]


@hookspec
def shardwise_backends() -> Iterable[Backend]:
    """Declare the collective backends this plugin provides.

    Called once per plugin manager, by the registry, the first time a
    backend is looked up (``shardwise.init``, ``shardwise info``,
    :func:`shardwise._registry.access.get_backend`). The records of all plugins are
    merged; two plugins declaring the same backend ``name`` is an error
    naming both.

    Returns:
        An iterable of :class:`~shardwise.Backend` records (a generator is
        fine). Creating a record must be cheap: import heavy libraries
        (mpi4py, CUDA) inside ``is_available`` and ``create_group``, not at
        module top level.

    Example::

        from shardwise import Availability, Backend, hookimpl

        def _create(launch, timeout):
            from my_package._group import MyGroup   # heavy import here
            return MyGroup(launch, timeout)

        @hookimpl
        def shardwise_backends():
            yield Backend(
                name="mybackend",
                is_available=lambda: Availability(True),
                create_group=_create,
                devices=("cpu",),
                distribution="my-package",
            )
    """


@hookspec
def shardwise_sharded_ops() -> Iterable[ShardedOp]:
    """Declare implementations of torch ops for sharded tensors.

    Called once per plugin manager, by the registry, the first time an op
    is looked up (``ShardedTensor.__torch_function__``,
    :func:`shardwise._registry.access.find_op`, ``shardwise info``). Two plugins
    declaring the same ``(op, spec)`` pair is an error naming both, unless
    exactly one record sets ``override=True`` (user code taking the op
    over; ``custom_sharded_op_impl`` does this). Lookups walk the spec's
    MRO, so the core's generic ops, declared for ``ShardingSpec``, serve
    every spec a plugin does not handle more specifically.

    Returns:
        An iterable of :class:`~shardwise.ShardedOp` records.

    Example::

        import torch.nn.functional as F
        from shardwise import ShardedOp, hookimpl
        from shardwise.sharding_spec import ChunkShardingSpec

        def _embedding(types, args, kwargs, process_group):
            ...

        @hookimpl
        def shardwise_sharded_ops():
            yield ShardedOp(op=F.embedding, spec=ChunkShardingSpec, impl=_embedding)
    """


@hookspec
def shardwise_launchers() -> Iterable[Launcher]:
    """Declare launchers that ``shardwise.init`` can recognise.

    Called once per plugin manager, the first time ``shardwise.init`` reads
    the environment (or ``shardwise info`` lists launchers). The core's own
    launchers (torchrun, MPICH/Hydra, Intel MPI, Open MPI, Slurm) are
    declared through this same hook. Launchers are tried from the highest
    ``priority`` down and the first whose ``detect`` returns a
    :class:`~shardwise.LaunchInfo` wins; duplicate names are an error.

    Returns:
        An iterable of :class:`~shardwise.Launcher` records.

    Example::

        from shardwise import LaunchInfo, Launcher, hookimpl

        def _detect(env):
            if "PBS_TASKNUM" not in env:
                return None
            return LaunchInfo(
                launcher="pbs", family="pbs",
                rank=int(env["PBS_TASKNUM"]) - 1, world_size=int(env["PBS_NP"]),
            )

        @hookimpl
        def shardwise_launchers():
            yield Launcher(name="pbs", detect=_detect, priority=5)
    """


@hookspec
def shardwise_cli_commands() -> Iterable[CliCommand]:
    """Declare subcommands of the ``shardwise`` command line.

    Called once per plugin manager, by ``shardwise`` itself (the console
    script and ``python -m shardwise``), and only when the command line
    needs them: when it names a command that is not built in (``info`` is),
    or when it prints the help that lists the commands. ``shardwise
    --version`` and ``shardwise info`` never call it. Two plugins declaring
    the same command ``name`` is an error naming both; so is a name of a
    built-in command.

    Returns:
        An iterable of :class:`~shardwise.CliCommand` records. Creating one
        must be cheap: import what the command needs inside ``run``, or in
        the hook itself, not at the plugin module's top level.

    Example::

        from shardwise import CliCommand, hookimpl

        def _add_arguments(parser):
            parser.add_argument("path", help="the file to check")

        def _run(args):
            from my_package._check import check   # imported when the command runs
            return check(args.path)               # the exit status

        @hookimpl
        def shardwise_cli_commands():
            yield CliCommand(name="check", help="check a file", add_arguments=_add_arguments, run=_run)
    """
