"""Helpers for testing code that runs on several ranks.

``run_ranks(fn, world_size, backend="gloo")`` starts ``world_size`` new
processes (forked from one that has imported torch and shardwise already,
so a rank starts in milliseconds; ``SHARDWISE_TESTING_FORK=0`` starts each
as a new interpreter), initialises shardwise in each, runs ``fn`` and returns every
rank's result — or raises :class:`RankError` with every rank's traceback
(and a stack dump of ranks that hung) once a rank fails or the timeout
passes. It never hangs the test suite. ``isolated_plugins()`` gives a test
a plugin manager of its own.
"""

from __future__ import annotations

from shardwise.testing._harness import (
    RankError,
    current_rank_dir,
    find_mpiexec,
    launcher_free_env,
    mpiexec_kind,
    run_ranks,
)
from shardwise.testing._isolation import isolated_plugins

__all__ = [
    "RankError",
    "current_rank_dir",
    "find_mpiexec",
    "isolated_plugins",
    "launcher_free_env",
    "mpiexec_kind",
    "run_ranks",
]
