"""How a :class:`~shardwise._comm.group.Group` call runs: the call lock, the handshake, and asynchronous steps.

The second of ``Group``'s private base classes (the chain is described in :mod:`shardwise._comm.group_core`).
Every public collective goes through this machinery: :meth:`GroupCalls._calling` holds the group's call lock
(one thread at a time talks on a group) and refuses a destroyed or out-of-step group, :meth:`GroupCalls._handshake`
checks a call locally and agrees on it with every rank, and :meth:`GroupCalls._issue` runs the data movement now
or queues it on the group's worker thread. ``destroy``, ``destroy_local`` and ``unverified`` are here because they
are built on that machinery. Why calls take turns and what the handshake protects against is explained in
:mod:`shardwise._comm.group`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from array import array
from typing import Callable, Iterator, Optional, ParamSpec, TypeVar, Union

from shardwise._comm.agreement import (
    NOT_AGREED,
    Call,
    CallLabel,
    Rows,
    failed_call,
    known_to_peers,
    labelled,
    log_rejections,
    raise_verdict,
)
from shardwise._comm.group_core import GroupCore
from shardwise._comm.work import Work, Worker
from shardwise.errors import LaunchError, PeerLostError

T = TypeVar("T")
P = ParamSpec("P")


def _one_call_at_a_time(method: Callable[P, T]) -> Callable[P, T]:
    """A public collective that holds its group's call lock (see :meth:`Group._calling`)."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        group = args[0]
        assert isinstance(group, GroupCalls)
        with group._calling():
            return method(*args, **kwargs)

    return run


class GroupCalls(GroupCore):
    """The call lock, the handshake and the asynchronous steps of a :class:`~shardwise._comm.group.Group`."""

    # -- destroy (a backend's override is wrapped by Group.__init_subclass__) ------

    def destroy(self) -> None:
        """Release the backend's resources; the group is unusable afterwards.

        Every rank calls it after its last collective; it may wait for the
        other ranks (a barrier) so none tears down connections a peer still uses.
        Asynchronous collectives still pending finish first. When verifying,
        and where destroy waits for the other ranks, every rank's destroy first
        meets in a handshake (:meth:`_agree_to_end`). A group out of step
        with its peers (a collective's data movement failed on this rank
        alone, see :meth:`_in_step`) is released as :meth:`destroy_local`
        releases it, without talking to them.

        Raises:
            CollectiveMismatchError: when verifying, a peer called another
                collective; the group is left whole (:meth:`destroy_local`
                releases it).
        """
        self._stop_async(drain=True)

    def _agree_to_end(self) -> None:
        """When verifying, meet every rank's ``destroy`` in a handshake, as a collective's arguments are.

        Only where the backend's ``destroy`` waits for its peers anyway
        (:meth:`_destroy_waits`: gloo and nccl, on a group that made its
        process groups). There a rank that destroys the group while a peer
        is still in another collective (the peer's program took another
        branch) would wait in the teardown's barrier, and the peer in its
        collective, until the timeout, each error naming only its own call.
        The handshake meets the peer's: both raise ``CollectiveMismatchError``
        at once, naming what each rank called. A backend whose ``destroy``
        returns at once (mpi) keeps doing so.

        Raises:
            CollectiveMismatchError: a rank called another collective.
            PeerLostError: a peer is gone (as the backend's own barrier would).
        """
        if self.verify and self.is_member and self.size > 1 and self._destroy_waits():
            self._handshake(lambda: Call(op="destroy"))

    def destroy_local(self) -> None:
        """Release this rank's resources without waiting for or talking to the other ranks.

        What a process that ends without :meth:`destroy` gets at exit (see
        :func:`shardwise.init`): its peers may have failed, be blocked in
        another collective, or still be working, so waiting for them could
        hang until the timeout. This rank's own unfinished work may complete
        first. The group is unusable afterwards. The default calls
        :meth:`destroy`; a backend whose :meth:`destroy` communicates (a
        barrier) overrides this. Asynchronous collectives not started yet
        fail (their ``wait()`` raises); a running one is left to end.
        """
        self._stop_async(drain=False)
        self._ending_locally = True  # the destroy below must not meet its peers (see _stopping_async)
        try:
            self.destroy()
        finally:
            self._ending_locally = False

    # -- one thread at a time ----------------------------------------------------
    @contextlib.contextmanager
    def unverified(self) -> Iterator[None]:
        """Run the block's collectives without the per-collective handshake.

        For code that has already agreed with its peers on every size and
        on which collectives follow (one agreement up front, then several
        collectives): checking each again would cost a round trip each.
        Collectives whose sizes only the handshake can tell still run it.
        ``verify`` is restored on leaving the block.

        Example::

            sizes = group.all_gather_json(my_counts)       # one agreement
            with group.unverified():
                out = group.all_to_all_single(data, recv_counts, send_counts)
        """
        # Held for the whole block: another thread's collective must not run meanwhile with verify off.
        with self._calling():
            saved = self.verify
            self.verify = False
            try:
                yield
            finally:
                self.verify = saved

    @contextlib.contextmanager
    def _calling(self, *, check: bool = True) -> Iterator[None]:
        """Hold the group's call lock (re-entrant): one thread at a time issues collectives on the group.

        The group's worker thread never takes it: the thread that holds it
        may be waiting for the worker's queue to drain.

        Raises:
            LaunchError: (``check``) the group was destroyed.
            PeerLostError: (``check``) a collective's data movement failed
                on this rank alone (see :meth:`_in_step`).
        """
        worker = self._worker
        if worker is not None and worker.on_worker():
            yield
            return
        with self._call_lock:
            if check and self._destroyed:
                raise LaunchError(
                    f"rank {self.rank} of {self.size}: this {self.backend} group was destroyed (by "
                    "shardwise.destroy(), destroy() on it, or at interpreter exit) and cannot run collectives; "
                    "call shardwise.init() again for a new default group"
                )
            if check:
                self._raise_if_out_of_step()
            yield

    # -- agreement -----------------------------------------------------------
    def _handshake(
        self,
        prepare: Callable[[], Call],
        *,
        required: bool = False,
        label: Optional[str] = None,
        async_op: bool = False,
    ) -> tuple[Call, Optional[Rows]]:
        """Check locally with ``prepare``, then (if verifying or ``required``) agree with every rank.

        ``label`` names the call in a peer's :class:`PeerError` (default:
        the collective), so an API built on an agreement can say
        "shard_tensor: rank 1 ... rejected" instead of "exchange: ...".
        ``async_op`` adds the backend's :meth:`_check_async` to the checks.
        """
        if async_op:
            prepare = functools.partial(self._async_prepare, prepare)
        if not (self.verify or required):
            return prepare(), None
        # Calls reach the wire in issue order: queued collectives go first.
        self._settle()
        error: Optional[Exception] = None
        try:
            call = prepare()
            row = call.encode(self.size)
        except NOT_AGREED:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised here
            error = exc
            call = failed_call(exc, self.size)
            row = call.encode(self.size)
        name = label or call.op
        width = len(row)
        table = array("q", bytes(8 * width * self.size))
        with labelled(CallLabel(self, name, agreeing=True)):
            self._all_gather_ints(table, array("q", row))
        rows = Rows([table[r * width : (r + 1) * width].tolist() for r in range(self.size)], self.size)
        if error is not None:
            log_rejections(rows, name)  # as the peers do in raise_verdict
            try:
                raise error
            finally:
                # The traceback references this frame; dropping the local
                # breaks the cycle that would keep the group alive until GC.
                del error
        raise_verdict(rows, name)
        return call, rows

    def _async_prepare(self, prepare: Callable[[], Call]) -> Call:
        self._check_async()
        return prepare()

    # -- asynchronous collectives (see shardwise._comm.work) ---------------------
    def _check_async(self) -> None:  # noqa: B027 - most backends can; those that cannot override it
        """Raise if this backend cannot run collectives on a worker thread (default: it can).

        Runs among an ``async_op=True`` collective's argument checks, so a
        rank that cannot raises there and its peers raise :class:`PeerError`.
        """

    def _issue(self, name: str, move: Callable[[], T], async_op: bool) -> Union[T, Work[T]]:
        """Run a checked and agreed collective's data movement now, or queue it and return its :class:`Work`."""
        if not async_op:
            self._settle()
            return self._in_step(name, move)()
        self._check_async()
        worker = self._worker
        if worker is None:
            worker = self._worker = Worker(f"shardwise-{self.backend}-rank{self.global_rank}-collectives")
            # A group dropped without destroy() takes its (idle) thread with it.
            weakref.finalize(self, worker.close, "the group was garbage-collected", drain=False)
        where = f"rank {self.rank} of {self.size} ({self.backend})"
        return worker.submit(Work(name, where, self._device), self._in_step(name, move), self._device)

    def _in_step(self, name: str, move: Callable[[], T]) -> Callable[[], T]:
        """``move``, which marks the group out of step when it raises an error its peers did not hear of.

        Every rank agreed to the call before its data moves, so a rank
        whose data movement fails on its own (out of memory for the
        result, an interrupt) leaves its peers inside the collective: any
        later call of this rank's would be read as that one's data (a false
        "rank 1 rejected its arguments", a gloo abort). From then on every
        call on the group raises :class:`PeerLostError` at once, and
        ``destroy`` releases this rank's side without talking to the peers.
        Errors every rank raises together (shardwise's own, or marked
        :func:`~shardwise._comm.agreement.mark_known_to_peers`) keep the
        ranks in step.
        """

        def run() -> T:
            self._raise_if_out_of_step()  # a queued call after the one that failed must not reach the wire
            try:
                return move()
            except BaseException as exc:
                if not known_to_peers(exc) and self._out_of_step is None:
                    self._out_of_step = f"its {self._describe(name)} failed on this rank ({type(exc).__name__}: {exc})"
                raise

        return run

    def _raise_if_out_of_step(self) -> None:
        if self._out_of_step is not None:
            raise PeerLostError(
                f"rank {self.rank} of {self.size}: this {self.backend} group is out of step with its peers: "
                f"{self._out_of_step} after every rank had agreed to it, so the peers are still inside that "
                "call (they fail at the group's timeout, or sooner when this rank destroys the group or ends). "
                "The group cannot be used any more: end the job, or destroy the group, and restart from a "
                "checkpoint"
            )

    def _settle(self) -> None:
        """Wait until this group's queued asynchronous collectives have finished (at once when none are)."""
        worker = self._worker
        if worker is not None:
            worker.drain()

    def _stop_async(self, *, drain: bool) -> None:
        """Stop the worker thread: after its queued collectives (``drain``) or abandoning those not started."""
        worker = self._worker
        if worker is not None:
            worker.close("the group was destroyed", drain=drain and not worker.on_worker())
