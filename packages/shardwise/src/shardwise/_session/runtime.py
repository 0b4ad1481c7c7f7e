"""``shardwise.init`` / ``destroy``: joining the job the launcher started (session layer).

The default group they make and clear lives one layer down, in
:mod:`shardwise._comm.default_group`, where the tensor and module layers
resolve ``process_group=`` arguments.

A program need not call ``destroy``: ``init`` registers an exit handler
that releases the default group while the interpreter is still whole (left
to interpreter finalization, gloo's worker threads abort the process), and
without waiting for peers that may be dead or busy. Under torchrun, ``init``
also records an uncaught exception in torchrun's error file, as torch's
``@record`` does.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import traceback
from datetime import timedelta
from types import TracebackType
from typing import Any, Mapping, Optional, Sequence, Union

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
from shardwise._comm.work import finish_all
from shardwise._registry import access as plugins
from shardwise._registry.records import Backend, LaunchInfo
from shardwise._session.launchers import detect_launch
from shardwise._tensor.loading import register_safe_globals
from shardwise._vocab.logs import configure_logging
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
    "launch_info",
    "resolve_group",
    "select_backend",
]

BACKEND_ENV = "SHARDWISE_BACKEND"
TIMEOUT_ENV = "SHARDWISE_TIMEOUT"
#: Set by torchrun for each worker: where to write the worker's uncaught exception.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# Serialises init/destroy: init creates the group before it can be published.
_lock = threading.Lock()
_log = logging.getLogger("shardwise.session")
# The process whose init registered the exit handler: a forked child inherits
# the handler but not the right to tear down its parent's connections.
_owner_pid: Optional[int] = None
_error_hook_installed = False


def detect(environ: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """What the launcher says about this process (no communication).

    Args:
        environ: Environment to read; defaults to ``os.environ``.

    Raises:
        LaunchError: the launcher's variables are malformed.
    """
    env = os.environ if environ is None else environ
    return detect_launch(plugins.list_launchers(), env)


def launch_info(environ: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """What the launcher told this process, as :func:`init` reads it: rank, world size, local rank, rendezvous.

    Reads only the environment (no communication), so it works before
    :func:`init` and without it. ``local_rank`` is the rank among the
    processes on this host (the device a CUDA backend binds is
    ``cuda:<local_rank>``); which ranks share a host is
    :meth:`Group.local_ranks`.

    Args:
        environ: Environment to read; defaults to ``os.environ``.

    Raises:
        LaunchError: the launcher's variables are malformed.
    """
    return detect(environ)


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
    return _choose(launch)[0]


def _choose(launch: LaunchInfo) -> tuple[Backend, str]:
    """:func:`select_backend`'s choice and, for the log, why: what was available and what was not."""
    usable: list[Backend] = []
    reasons: list[str] = []
    passed_over: list[str] = []
    for backend in plugins.list_backends():
        availability = plugins.availability(backend)
        if availability:
            usable.append(backend)
        else:
            reasons.append(f"{backend.name}: {availability.reason}")
            if launch.family in backend.preferred_under:
                passed_over.append(f"backend {backend.name!r} cannot run here: {availability.reason}")
    if not usable:
        detail = "; ".join(reasons) if reasons else "no backend plugin is installed"
        raise BackendNotFoundError(
            f"no usable shardwise backend ({detail}). `pip install shardwise-gloo` for CPU collectives."
        )
    chosen = max(usable, key=lambda b: (launch.family in b.preferred_under, b.priority))
    if passed_over and launch.family not in chosen.preferred_under:
        # Said where the user sees it: the fallback's own error (gloo under mpirun
        # wants MASTER_ADDR) would otherwise hide why the launcher's backend was not used.
        _log.warning(
            "shardwise: the %s launcher's own backend was passed over, so %r is used instead: %s",
            launch.launcher, chosen.name, "; ".join(passed_over),
        )  # fmt: skip
    if launch.family in chosen.preferred_under:
        rule = f"it is preferred under launcher family {launch.family!r}"
    else:
        rule = (
            f"no available backend is preferred under launcher family {launch.family!r}, "
            "and it has the highest priority"
        )
    return chosen, f"{rule}; {_survey(usable, reasons)}"


def _survey(usable: Sequence[Backend], reasons: Sequence[str]) -> str:
    available = ", ".join(f"{b.name} (priority {b.priority})" for b in usable) or "none"
    return f"available backends: {available}; unavailable: {'; '.join(reasons) or 'none'}"


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
    ``process_group``. The group is released at interpreter exit unless
    :func:`destroy` released it before. Under torchrun
    (``TORCHELASTIC_ERROR_FILE`` set), the first call also puts a hook in
    front of ``sys.excepthook`` that writes an uncaught exception to
    torchrun's error file, as torch's ``@record`` decorator does.

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
    _record_errors_for_torchrun(env)
    with _lock:
        current = current_default_group()
        if current is not None:
            raise LaunchError(
                f"shardwise.init() was already called (backend {current.backend!r}, rank "
                f"{current.rank} of {current.size}); call shardwise.destroy() before initialising again"
            )
        launch = detect(env)
        # SHARDWISE_LOGS from this environ, and the launcher's rank on every line.
        configure_logging(env, rank=launch.rank)
        name = backend or env.get(BACKEND_ENV) or None
        if name:
            record = plugins.get_backend(name)
            source = "named by init(backend=...)" if backend else f"named by {BACKEND_ENV}={name}"
            why = f"{source}; automatic choice skipped"
        else:
            record, rule = _choose(launch)
            why = f"{BACKEND_ENV} unset and no backend= given, so chosen automatically: {rule}"
        _log.debug(
            "backend %s chosen: %s (launcher %s, family %s, rank %d of %d)",
            record.name, why, launch.launcher, launch.family, launch.rank, launch.world_size,
        )  # fmt: skip
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
            group.destroy_local()
            raise LaunchError(
                f"backend {record.name!r} made rank {group.rank} of {group.size}, but the "
                f"{launch.launcher} launcher says rank {launch.rank} of {launch.world_size}"
            )
        set_default_group(group)
        _watch_exit()
        # So a ShardedTensor saved by torch.save loads with torch.load's default
        # weights_only=True in a fresh process; the state it pickles is plain data.
        register_safe_globals()
        return group


def destroy() -> None:
    """Tear down the default group made by :func:`init` (no-op if none).

    Call it on every rank after the last collective: it waits until all
    ranks arrive, so no rank closes connections a peer is still using. A
    program need not call it before it ends: at exit the group is released
    without waiting for anyone (see the module docstring). Call it to end
    the group earlier, or before :func:`init` again.

    Raises:
        PeerLostError: a peer died or did not arrive within the timeout;
            this rank's resources are released all the same.
        CollectiveMismatchError: when verifying, a peer called another
            collective instead (it raises too, at once); this rank's
            resources are released all the same.
    """
    global _owner_pid
    with _lock:
        group = clear_default_group()
        atexit.unregister(_at_exit)
        _owner_pid = None
    if group is None:
        return
    _log.debug("destroy: tearing down the %s group (rank %d of %d)", group.backend, group.rank, group.size)
    try:
        group.destroy()
    except BaseException:
        # The group is forgotten either way: release what this rank holds.
        group.destroy_local()
        raise


def _watch_exit() -> None:
    """Have the default group torn down at interpreter exit (until :func:`destroy` does it)."""
    global _owner_pid
    _owner_pid = os.getpid()
    # Registered anew on every init (destroy unregisters it): atexit runs last
    # what registered first, so exit handlers registered after init (which may
    # still use the group) run before this one.
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    """The exit handler: release the default group while the interpreter is whole, without waiting for peers.

    Left to interpreter finalization, a gloo process group's worker threads
    may still be handing back finished collectives when Python stops
    threads from taking the GIL, and the process aborts ("terminate called
    without an active exception", SIGABRT). Releasing the group earlier
    joins those threads. It does not wait for the other ranks, as
    :func:`destroy` does: an exit that is not the job's normal end (an
    uncaught exception, Ctrl-C, ``sys.exit(1)``, a ``return`` after
    catching an error) cannot be told apart from one that is, and there the
    peers may be dead or blocked in another collective; waiting for them
    would hang until the timeout and hide the failure from the launcher.
    """
    with _lock:
        if _owner_pid != os.getpid():
            return
        group = clear_default_group()
    if group is None:
        return
    _log.debug(
        "exit without shardwise.destroy(): releasing the %s group of rank %d without waiting for the other ranks",
        group.backend, group.rank,
    )  # fmt: skip
    dying = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    if not dying:
        _finish_queued_quietly(group)
    _clear_failure_frames()
    _release_quietly(group)


def _finish_queued_quietly(group: Group) -> None:
    """On a normal end, let the asynchronous collectives still queued or running finish, as torch's groups do.

    Every rank issued them, so every rank completes them; dropping them
    instead would drop different ones on different ranks (a rank whose
    worker had started one, a peer whose worker had not), leaving a
    collective with half its ranks and a crash when the group is released
    under it. A peer that never comes ends the wait at the backend's
    timeout. The worker thread is then joined: a daemon thread still
    freeing a finished collective's tensors when the interpreter finalizes
    aborts the process ("terminate called without an active exception").
    Not done for a rank dying of an uncaught exception, which must exit at
    once. The sub-groups' workers are finished too (after the default
    group's), which their finalizers would not do.
    """
    for finish in (lambda: group._stop_async(drain=True), lambda: finish_all("the process is ending")):
        try:
            finish()
        except Exception as exc:  # noqa: BLE001 - the process is ending; the release below still runs
            _log.warning("shardwise: finishing queued collectives at exit failed: %s: %s", type(exc).__name__, exc)


def _clear_failure_frames() -> None:
    """Clear the local variables of the frames of the exception the program dies of, if any.

    Python keeps that exception (``sys.last_value``, ``sys.last_exc``,
    ``sys.last_traceback``) until the end, and with it every frame it
    passed through. When it interrupted a collective (Ctrl-C), those frames
    hold the torch process group and the collective's pending work, which
    would keep gloo's threads running into interpreter finalization. The
    traceback was printed already; its file and line numbers stay.
    """
    seen: set[int] = set()
    pending: list[Optional[BaseException]] = [getattr(sys, "last_exc", None), getattr(sys, "last_value", None)]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]
    last = getattr(sys, "last_traceback", None)
    if last is not None:
        traceback.clear_frames(last)


def _release_quietly(group: Group) -> None:
    """``group.destroy_local()``, logging instead of raising: at exit nobody could catch it."""
    try:
        group.destroy_local()
    except Exception as exc:  # noqa: BLE001 - the process is ending; a traceback here would bury the real one
        _log.warning("shardwise: releasing the %s group at exit failed: %s: %s", group.backend, type(exc).__name__, exc)


def _record_errors_for_torchrun(env: Mapping[str, str]) -> None:
    """Under torchrun, write an uncaught exception to torchrun's error file, as torch's ``@record`` does.

    torchrun names a file per worker in ``TORCHELASTIC_ERROR_FILE``; what a
    worker writes there replaces ``error_file: <N/A>`` and the bare exit code
    in torchrun's failure summary with the exception and its traceback.
    Installs a ``sys.excepthook`` (once per process) that records, then
    calls the hook it replaced.
    """
    global _error_hook_installed
    if _error_hook_installed or not env.get(ERROR_FILE_ENV):
        return
    # torch's elastic error handling (some 15 modules) is needed only under torchrun, which sets the variable.
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        # As @record: Exceptions, not KeyboardInterrupt or SystemExit.
        if isinstance(value, Exception):
            try:
                _record(handler, value, tb)
            except Exception as exc:  # noqa: BLE001 - the program's own traceback must still be printed
                _log.warning("shardwise: could not write torchrun's error file: %s: %s", type(exc).__name__, exc)
        previous(kind, value, tb)

    sys.excepthook = hook
    _error_hook_installed = True


def _record(handler: Any, value: BaseException, tb: Optional[TracebackType]) -> None:
    """``handler.record_exception(value)`` with ``value`` as the exception being handled.

    The handler formats the traceback of the exception being handled
    (``traceback.format_exc``), as inside ``@record``'s ``except`` clause; an
    exception hook has none, so re-raise ``value`` and record it there. The
    file appears whole: written under another name, then renamed.
    """
    # The handler writes the file where TORCHELASTIC_ERROR_FILE says, in place. torchrun, ending the
    # other workers once one died, reads every worker's file and can meet it created but still
    # empty; its failure summary then breaks off with a JSONDecodeError. So the handler writes
    # beside it, and the finished file is renamed into place.
    target = os.environ.get(ERROR_FILE_ENV)
    partial = f"{target}.writing-{os.getpid()}" if target else None
    saved = value.__traceback__
    try:
        if partial is not None:
            os.environ[ERROR_FILE_ENV] = partial
        raise value
    except BaseException:
        # The traceback the program raised with, not this frame on top of it.
        value.__traceback__ = tb
        handler.record_exception(value)
    finally:
        value.__traceback__ = saved
        if target is not None:
            os.environ[ERROR_FILE_ENV] = target
    if partial is not None and target is not None and os.path.exists(partial):
        os.replace(partial, target)
