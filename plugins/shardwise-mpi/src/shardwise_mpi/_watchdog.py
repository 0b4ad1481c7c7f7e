"""Enforces the group's timeout on blocking MPI calls.

MPI has no timeout and no way to cancel a blocked call: when a peer dies
and the launcher does not kill the job (``srun`` without
``--kill-on-bad-exit``, ``mpiexec -disable-auto-cleanup``, a peer that left
with ``sys.exit``), the survivors would spin in their collective until the
job's wall-clock limit. A :class:`Watchdog` is armed around every call an
``MpiGroup`` makes; a daemon thread (started on first use) notices a call
that has blocked longer than the timeout, prints which rank, which
collective and how long, and calls ``MPI_Abort`` so the launcher ends the
whole job with a non-zero status. If even ``MPI_Abort`` does not return
within :data:`ABORT_GRACE` seconds the process ends itself with
:data:`EXIT_CODE`.

Arming costs two attribute writes, so the fast paths keep their speed
(mpi4py releases the GIL inside MPI calls, which lets the thread run).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from types import TracebackType
from typing import Any, Callable, Optional

from shardwise.errors import PeerLostError

__all__ = ["ABORT_GRACE", "EXIT_CODE", "FORWARD_GRACE", "SHARDWISE_NAMES", "Watchdog"]

#: Exit status of a process whose collective timed out (as ``timeout(1)``).
EXIT_CODE = 124
#: Seconds ``MPI_Abort`` gets before the process ends itself.
ABORT_GRACE = 5.0
#: Seconds between printing why a rank aborts and calling ``MPI_Abort`` (the launcher forwards stderr).
FORWARD_GRACE = 1.0


def _abort(code: int) -> None:
    """``MPI.COMM_WORLD.Abort(code)`` (the caller has armed the ``os._exit`` fallback)."""
    # Heavy optional import: importing mpi4py.MPI initialises MPI, which this
    # module must not do when imported (its tests, a process that never runs MPI).
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # pragma: no cover - Abort does not return


# MPI error classes that mean the caller's arguments were wrong, not that the transport failed:
# those stay MPI's own exception (a size bug must not read as a dead job).
_ARGUMENT_ERRORS = (
    "ERR_ARG", "ERR_BUFFER", "ERR_COUNT", "ERR_TYPE", "ERR_TAG", "ERR_COMM", "ERR_RANK", "ERR_ROOT",
    "ERR_OP", "ERR_TRUNCATE", "ERR_DIMS", "ERR_TOPOLOGY",
)


def _transport_failure(error: BaseException) -> bool:
    """Whether an mpi4py exception reports a failed peer or transport rather than a bad argument."""
    try:
        # Heavy optional import (it initialises MPI); see _abort. Only reached
        # with an mpi4py exception in hand, when MPI is loaded already.
        from mpi4py import MPI

        kind = error.Get_error_class()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not an MPI.Exception after all
        return False
    return kind not in {getattr(MPI, name) for name in _ARGUMENT_ERRORS if hasattr(MPI, name)}


def _watch(ref: weakref.ReferenceType[Watchdog], closed: threading.Event) -> None:
    """The watchdog thread: look every interval until the watchdog fires, is closed, or is gone."""
    while True:
        dog = ref()
        if dog is None:
            return
        interval = dog._interval()
        del dog  # no strong reference while sleeping
        if closed.wait(interval):
            return
        dog = ref()
        if dog is None or dog._check():
            return
        del dog


#: How the messages name the backend and where its timeout is set, for shardwise's own mpi groups.
SHARDWISE_NAMES = ("the mpi backend", "shardwise.init(timeout=...) or SHARDWISE_TIMEOUT")


class Watchdog:
    """Ends the job when one blocking MPI call outlasts ``timeout``.

    Use it as ``with watchdog("all_reduce"): <blocking MPI call>``. Calls do
    not nest: one group runs one collective at a time. A transport error MPI
    raises inside the block (``mpi4py.MPI.Exception`` of a class other than
    the argument errors: truncation, bad count, rank, type ...) leaves it as
    :class:`shardwise.errors.PeerLostError` naming the rank and collective.
    Call :meth:`close` when the group is destroyed.

    Args:
        timeout: How long one call may block; None or non-positive
            disables the watchdog.
        where: Describes this process for the message (``"rank 1 of 3"``).
        on_expiry: What to do after printing the message (default: abort
            the MPI job with :data:`EXIT_CODE`); tests pass their own.
        backend: How the messages name the backend.
        how_to_set: How the messages say the timeout is set.
    """

    def __init__(
        self,
        timeout: Optional[timedelta],
        where: Callable[[], str],
        on_expiry: Optional[Callable[[int], None]] = None,
        *,
        backend: str = SHARDWISE_NAMES[0],
        how_to_set: str = SHARDWISE_NAMES[1],
    ) -> None:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        self.timeout: Optional[float] = seconds if seconds > 0 else None
        self._where = where
        self._backend = backend
        self._how_to_set = how_to_set
        self._on_expiry = on_expiry or _abort
        self._op: Optional[str] = None
        self._op_next = ""
        self._since = 0.0
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def __call__(self, op: str) -> Watchdog:
        self._op_next = op
        return self

    def __enter__(self) -> None:
        if self.timeout is None:
            return
        if self._thread is None:
            self._start()
        self._since = time.monotonic()
        self._op = self._op_next

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        value: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        op, self._op = self._op_next, None
        if value is not None and type(value).__module__.startswith("mpi4py") and _transport_failure(value):
            # MPI reported the failure itself (a peer's connection reset).
            raise PeerLostError(
                f"{self._where()}: {op} on {self._backend} failed: {value}. A peer has probably died or "
                "stopped calling collectives; see the other ranks' logs. The group cannot be used any more."
            ) from value

    def close(self) -> None:
        """Stop the thread (the group is being destroyed); later calls are no longer watched."""
        self.timeout = None
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed.is_set():
                # The thread holds only a weak reference, so a group nobody uses any more
                # (and its watchdog) can be collected even if destroy() was never called.
                thread = threading.Thread(
                    target=_watch, args=(weakref.ref(self), self._closed), name="shardwise-mpi-watchdog", daemon=True
                )
                thread.start()
                self._thread = thread

    def _check(self) -> bool:
        """One look at the running call; True once the watchdog has fired (the thread then ends)."""
        timeout = self.timeout
        if timeout is None:
            return True
        op, since = self._op, self._since
        if op is None or time.monotonic() - since <= timeout:
            return False
        if self._op is not op or self._since != since:
            return False  # the call finished (and maybe another began) while we looked
        self._expire(op, time.monotonic() - since)
        return True

    def _interval(self) -> float:
        # Check often enough that a timeout fires within ~10% of its value.
        return min(1.0, max(0.05, (self.timeout or 10.0) / 10))

    def _expire(self, op: str, waited: float) -> None:
        if self._on_expiry is _abort:
            # Armed before anything that could block (a flush on a full pipe), so the process ends regardless.
            threading.Timer(ABORT_GRACE, os._exit, args=(EXIT_CODE,)).start()
        message = (
            f"shardwise: {self._where()}: {op} on {self._backend} has waited {waited:.1f} s for its "
            f"peers, longer than the group's timeout ({self.timeout:g} s, set by {self._how_to_set}). "
            "A peer has died or stopped calling collectives; MPI cannot cancel a "
            f"blocked call, so this rank aborts the job (exit status {EXIT_CODE}).\n"
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a broken stream must not stop the abort
                pass
        try:
            os.write(2, message.encode())
        except OSError:
            pass
        if self._on_expiry is _abort:
            # stderr reaches the user through the launcher's forwarder (Hydra's proxy,
            # orted, slurmstepd); MPI_Abort makes the launcher kill the job at once, and
            # on a loaded host the forwarder can die holding the message unread.
            time.sleep(FORWARD_GRACE)
        self._on_expiry(EXIT_CODE)

    def state(self) -> dict[str, Any]:
        """What the watchdog is watching now (for tests and debugging)."""
        return {"op": self._op, "timeout": self.timeout, "running": self._thread is not None}
