"""``shardwise.init`` / ``destroy``: joining the job the launcher started (session layer).

The default group they make and clear lives one layer down, in
:mod:`shardwise._comm.default_group`, where the tensor and module layers
resolve ``process_group=`` arguments.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Mapping, Optional, Union

from shardwise._comm.default_group import (
    DEFAULT_TIMEOUT,
    clear_default_group,
    current_default_group,
    get_default_group,
    is_initialized,
    resolve_group,
    set_default_group,
)
from shardwise._comm.group import Group
from shardwise._registry import access as plugins
from shardwise._registry.records import Backend, LaunchInfo
from shardwise._session.launchers import detect_launch
from shardwise._tensor.loading import register_safe_globals
from shardwise.errors import BackendNotFoundError, BackendUnavailableError, LaunchError

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "destroy",
    "detect",
    "get_default_group",
    "init",
    "is_initialized",
    "resolve_group",
    "select_backend",
]

BACKEND_ENV = "SHARDWISE_BACKEND"
TIMEOUT_ENV = "SHARDWISE_TIMEOUT"
# Serialises init/destroy: init creates the group before it can be published.
_lock = threading.Lock()


def detect(environ: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """What the launcher says about this process (no communication).

    Args:
        environ: Environment to read; defaults to ``os.environ``.

    Raises:
        LaunchError: the launcher's variables are malformed.
    """
    env = os.environ if environ is None else environ
    return detect_launch(plugins.list_launchers(), env)


def select_backend(launch: LaunchInfo) -> Backend:
    """The backend ``init`` picks when none is named.

    The first available backend that lists ``launch.family`` in its
    ``preferred_under`` (``mpi`` under an MPI launcher) wins; otherwise the
    available backend with the highest ``priority`` (nccl when CUDA is
    usable, else gloo). Ties go to the alphabetically first name.

    Raises:
        BackendNotFoundError: no installed backend is available; the
            message gives each one's reason.
    """
    backends = plugins.list_backends()
    usable = []
    reasons = []
    for backend in backends:
        availability = plugins.availability(backend)
        if availability:
            usable.append(backend)
        else:
            reasons.append(f"{backend.name}: {availability.reason}")
    if not usable:
        detail = "; ".join(reasons) if reasons else "no backend plugin is installed"
        raise BackendNotFoundError(
            f"no usable shardwise backend ({detail}). `pip install shardwise-gloo` for CPU collectives."
        )
    return max(usable, key=lambda b: (launch.family in b.preferred_under, b.priority))


def _timeout(value: Union[None, float, timedelta], env: Mapping[str, str]) -> timedelta:
    if value is None:
        raw = env.get(TIMEOUT_ENV)
        if not raw:
            return DEFAULT_TIMEOUT
        try:
            value = float(raw)
        except ValueError:
            raise LaunchError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not isinstance(value, timedelta):
        value = timedelta(seconds=float(value))
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value.total_seconds():g} s")
    return value


def init(
    backend: Optional[str] = None,
    timeout: Union[None, float, timedelta] = None,
    *,
    environ: Optional[Mapping[str, str]] = None,
) -> Group:
    """Join the job the launcher started and make the default group.

    Reads the launcher's environment (torchrun, MPICH/Hydra, Intel MPI,
    Open MPI, ``srun``; a plain process is rank 0 of 1), picks a backend,
    and creates the group every shardwise call uses when given no
    ``process_group``.

    Args:
        backend: Backend name. When None: ``SHARDWISE_BACKEND`` if set,
            else ``mpi`` under an MPI launcher when installed, ``nccl`` when
            CUDA is usable, else ``gloo`` (see :func:`select_backend`).
        timeout: Seconds (or a ``timedelta``) a rendezvous or collective may
            wait for a peer; default ``SHARDWISE_TIMEOUT`` or 5 minutes.
        environ: Environment to read instead of ``os.environ``.

    Returns:
        The default group.

    Raises:
        LaunchError: ``init`` was already called without ``destroy``, or the
            launcher's environment is incomplete (the message names the
            variables to set).
        BackendNotFoundError: the backend is not installed (the message
            says which distribution to install).
        BackendUnavailableError: it is installed but cannot run here.
        ValueError: ``timeout`` is zero or negative.
    """
    env = os.environ if environ is None else environ
    with _lock:
        current = current_default_group()
        if current is not None:
            raise LaunchError(
                f"shardwise.init() was already called (backend {current.backend!r}, rank "
                f"{current.rank} of {current.size}); call shardwise.destroy() before initialising again"
            )
        launch = detect(env)
        name = backend or env.get(BACKEND_ENV) or None
        record = plugins.get_backend(name) if name else select_backend(launch)
        availability = plugins.availability(record)
        if not availability:
            raise BackendUnavailableError(
                f"backend {record.name!r} is installed but cannot run here: {availability.reason}"
            )
        group = record.create_group(launch, _timeout(timeout, env))
        if not isinstance(group, Group):
            raise BackendUnavailableError(
                f"backend {record.name!r} returned {type(group).__name__} from create_group, not a shardwise Group"
            )
        if (group.rank, group.size) != (launch.rank, launch.world_size):
            group.destroy()
            raise LaunchError(
                f"backend {record.name!r} made rank {group.rank} of {group.size}, but the "
                f"{launch.launcher} launcher says rank {launch.rank} of {launch.world_size}"
            )
        set_default_group(group)
        # So a ShardedTensor saved by torch.save loads with torch.load's default
        # weights_only=True in a fresh process; the state it pickles is plain data.
        register_safe_globals()
        return group


def destroy() -> None:
    """Tear down the default group made by :func:`init` (no-op if none).

    Call it on every rank after the last collective: it waits until all
    ranks arrive, so no rank closes connections a peer is still using.
    """
    with _lock:
        group = clear_default_group()
    if group is not None:
        group.destroy()
