"""Asynchronous collectives: the :class:`Work` handle and the worker thread that makes progress.

``Group.all_reduce(t, async_op=True)`` (and every other public collective)
checks its arguments and agrees with its peers in the caller's thread, as a
blocking call does, so bad input raises at the call on every rank. Only the
data movement is deferred: it is queued on the group's one worker thread,
which runs queued collectives in the order they were issued, and the call
returns a :class:`Work` at once. The worker makes progress whether or not
anyone polls (as torch's ``ProcessGroupMPI`` does with its own thread), so
compute issued after the collective overlaps with it.

Calls reach the wire strictly in issue order on every rank: before any
handshake or blocking collective the caller waits for the queue to drain
(:meth:`Worker.drain`), holding the group's call lock (``Group._calling``),
which callers on other threads wait for. So at most one thread of a process
talks on a group at a time, and the backends need no locking of their own.

Tensors handed to an asynchronous collective must not be read or modified
until :meth:`Work.wait` returns (as with torch's ``async_op=True``).

CUDA: the current stream is a per-thread setting, so the worker runs each
collective on the stream that was current in the caller when it issued it
(its kernels queue behind the caller's earlier work on that stream), and
:meth:`Work.wait` makes the waiting thread's current stream wait for an
event recorded after it — torch's ``Work.wait`` semantics.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import threading
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

import torch

__all__ = ["Work", "Worker", "chain", "finish_all"]

T = TypeVar("T")
U = TypeVar("U")

# The package logger: the worker threads are no component of their own (see shardwise._vocab.logs).
logger = logging.getLogger("shardwise.comm")


class Work(Generic[T]):
    """Handle of a collective issued with ``async_op=True``.

    Its data movement runs on the group's worker thread; :meth:`wait`
    returns what the blocking call would have returned. Do not read or
    modify the tensors passed to the collective (or ``out=``) until then.

    Example::

        work = group.all_to_all_single(tokens, out_splits, in_splits, async_op=True)
        hidden = model.dense(local)        # overlaps with the exchange
        received = work.wait()
    """

    def __init__(self, name: str, where: str, device: Optional[torch.device] = None) -> None:
        self._name = name
        self._where = where
        self._device = device
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._event: Optional[torch.cuda.Event] = None

    @property
    def name(self) -> str:
        """The collective (``"all_reduce"``)."""
        return self._name

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done.is_set() else "pending"
        return f"<Work {self._name} {state} ({self._where})>"

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> T:
        """Wait for the collective to finish and return its result.

        Args:
            timeout: Seconds to wait at most (None: as long as it takes;
                the group's own timeout still ends a collective whose peers
                are gone).

        Returns:
            Exactly what the blocking call returns; the same object on every call.

        Raises:
            TimeoutError: it did not finish within ``timeout`` (it keeps
                running; wait again).
            ValueError: ``timeout`` is negative.
            Exception: what the collective raised (on every call of ``wait``).
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"wait(timeout={timeout!r}): the timeout is in seconds, 0 or more (None: no limit)")
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"{self._where}: asynchronous {self._name} did not finish within {timeout:g} s. It keeps "
                "running: call wait() again, or check that every rank issues the same collectives in the "
                "same order (a peer that has not called it yet holds it up)."
            )
        if self._error is not None:
            raise self._error
        if self._event is not None and self._device is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return self._value  # type: ignore[no-any-return]

    def result(self) -> T:
        """Alias of :meth:`wait` without a timeout."""
        return self.wait()

    def exception(self) -> Optional[BaseException]:
        """What the collective raised, or None (also while it is still running); never blocks."""
        return self._error if self._done.is_set() else None

    def _finish(self, value: Any, error: Optional[BaseException], event: Optional[torch.cuda.Event]) -> None:
        self._value, self._error, self._event = value, error, event
        self._done.set()


class _Then(Work[U], Generic[T, U]):
    """``then(inner.wait())``, run once, in the thread that first waits."""

    def __init__(self, inner: Work[T], then: Callable[[T], U]) -> None:
        super().__init__(inner._name, inner._where, inner._device)
        self._inner = inner
        self._then: Optional[Callable[[T], U]] = then
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def wait(self, timeout: Optional[float] = None) -> U:
        value = self._inner.wait(timeout)
        with self._lock:
            then, self._then = self._then, None
            if then is not None:
                try:
                    self._finish(then(value), None, None)
                except BaseException as exc:
                    self._finish(None, exc, None)
                    raise
        return super().wait()

    def exception(self) -> Optional[BaseException]:
        return self._inner.exception() or super().exception()


def chain(work: Work[T], then: Callable[[T], U]) -> Work[U]:
    """A :class:`Work` whose ``wait()`` returns ``then(work.wait())`` (``then`` runs once, in the waiting thread)."""
    return _Then(work, then)


# What one queued collective needs: its handle, its data movement, and the caller's
# label context, grad and inference modes and CUDA stream (all per thread).
_Job = tuple[Work[Any], Callable[[], Any], contextvars.Context, tuple[bool, bool], Optional[torch.cuda.Stream]]


class Worker:
    """One group's worker thread: runs queued collectives one at a time, in issue order.

    The thread starts on the first :meth:`submit` (never at import or
    when a group is made) and is a daemon, so a process that forgets to
    destroy its group still exits.

    Args:
        name: The thread's name (``"shardwise-gloo-rank1-collectives"``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._busy = 0  # queued plus running
        self._thread: Optional[threading.Thread] = None
        self._closed: Optional[str] = None

    def submit(self, work: Work[T], move: Callable[[], T], device: Optional[torch.device]) -> Work[T]:
        """Queue ``move`` (the data movement of ``work``'s collective) and return ``work``.

        Raises:
            RuntimeError: the group was destroyed.
        """
        stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        with self._cond:
            if self._closed is not None:
                raise RuntimeError(f"cannot issue asynchronous {work.name}: {self._closed}")
            # The caller's context carries the call's label, which the backend's error messages use.
            # Grad and inference mode are per thread: the move runs under the caller's, as a blocking call would.
            modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            self._queue.append((work, move, contextvars.copy_context(), modes, stream))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
                _started.add(self)
                logger.debug("started %s", self._name)
            self._cond.notify_all()
        return work

    def on_worker(self) -> bool:
        """Whether the calling thread is this worker."""
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Block until every queued collective has finished (at once if none; never on the worker itself)."""
        if self._busy == 0 or self.on_worker():
            return
        with self._cond:
            while self._busy:
                self._cond.wait()

    def close(self, reason: str, *, drain: bool) -> None:
        """Stop the worker; later :meth:`submit` calls raise with ``reason``.

        Args:
            reason: Why (``"the group was destroyed"``), for the errors.
            drain: Let every queued collective finish first (a collective
                destroy, whose peers complete them too); otherwise those not
                started fail with ``reason`` and a running one is left to end
                on its own (its peers may be gone).
        """
        if self._closed is not None:
            return
        if drain:
            self.drain()
        with self._cond:
            if self._closed is not None:
                return
            self._closed = reason
            _started.discard(self)
            dropped = list(self._queue)  # not started; a running one is no longer queued
            self._queue.clear()
            self._busy -= len(dropped)
            self._cond.notify_all()
            thread = self._thread
            # Nothing running: the worker has at most its last job's references to drop (tensors, whose
            # deallocation releases the GIL) before it sees the close and returns. Join it either way, so
            # that never happens during interpreter finalization, where a daemon thread retaking the GIL
            # is ended by pthread_exit, and inside torch's tensor dealloc that aborts the process
            # ("terminate called without an active exception").
            idle = self._busy == 0
        for work, *_ in dropped:
            work._finish(None, RuntimeError(f"{work._where}: asynchronous {work.name} never ran: {reason}"), None)
        if dropped:
            logger.warning("%s: %d queued collective(s) dropped: %s", self._name, len(dropped), reason)
        if (drain or idle) and thread is not None and not self.on_worker():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self._closed is None:
                    self._cond.wait()
                if not self._queue:
                    logger.debug("stopped %s", self._name)
                    return
                work, move, context, (grad, inference), stream = self._queue.popleft()
            value: Any = None
            error: Optional[BaseException] = None
            event: Optional[torch.cuda.Event] = None
            try:
                with torch.set_grad_enabled(grad), torch.inference_mode(inference):
                    if stream is None:
                        value = context.run(move)
                    else:
                        with torch.cuda.stream(stream):
                            value = context.run(move)
                        event = torch.cuda.Event()
                        event.record(stream)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the work
                error = exc
            with self._cond:
                # Finished before it stops counting: a drain that sees nothing busy sees it done.
                work._finish(value, error, event)
                self._busy -= 1
                self._cond.notify_all()
            del work, move, context, value, error


#: Every worker whose thread started and that is not closed yet: what :func:`finish_all` finishes.
_started: weakref.WeakSet[Worker] = weakref.WeakSet()


def finish_all(reason: str) -> None:
    """Let every started worker finish its queued collectives, then stop and join it (a process's normal end).

    The default group's worker is finished by its own teardown; this also
    reaches the sub-groups' workers, whose groups are otherwise closed by
    their finalizers, which drop what is queued: a sub-group's collectives
    still queued at exit would then run on the ranks whose workers had
    started them and not on the others.

    Args:
        reason: Why, for later :meth:`Worker.submit` calls.
    """
    for worker in list(_started):
        worker.close(reason, drain=True)
