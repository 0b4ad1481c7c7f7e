"""``Group``: the one interface between the core and a collective backend.

A backend implements a handful of *primitives* over flat, contiguous
tensors whose sizes every rank already knows (``_all_gather``,
``_all_to_all`` ...). ``Group`` turns them into the public collectives: it
validates arguments (:mod:`shardwise._comm.checks`), agrees on shapes and
dtypes across ranks, stages tensors the backend cannot move natively, and
restores shapes and dtypes on the way out.

Agreement happens in a *handshake* (:mod:`shardwise._comm.agreement`):
before the data moves, every rank all-gathers one small int64 row
describing its call and whether its own arguments were valid, so every rank
reaches the same verdict — all proceed, or all raise: the rank with a bad
argument raises the real error and its peers raise :class:`PeerError`
naming it, instead of one rank raising while the others wait forever.
Uneven collectives need the sizes anyway, so for them the handshake is
free; for the rest it can be turned off with ``verify=False`` (or
``SHARDWISE_VERIFY_COLLECTIVES=0``) at the cost of that protection.
:meth:`Group.agree` offers the same agreement to any code.

A backend may also offer a *direct path* for a validated call
(``_direct_all_reduce`` ...): the public collective hands it the checked
arguments after the handshake, and the backend moves the caller's memory
itself or returns None/False to take the general path. Backends never
override a public collective.

Every public collective takes ``async_op=True`` and then returns a
:class:`~shardwise._comm.work.Work`: the checks and the handshake still run
in the caller's thread (bad input raises at the call, on every rank), and
only the data movement runs on the group's worker thread.

One thread at a time talks on a group: each public collective (and
:meth:`Group.unverified` block) holds the group's call lock from its checks
to the end of its data movement (a blocking call) or to its queueing (an
asynchronous one). Two threads of a rank that call collectives on one group
take turns instead of interleaving their handshakes and data on the wire;
the order in which they take turns is theirs, and every rank must still
issue the same collectives in the same order. A call built of several
(``shard_tensor``, a reshard) is several turns: threads that share a group
should not run such calls at once (a group per thread).
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import functools
import threading
import weakref
from array import array
from typing import (
    Any,
    Callable,
    Iterator,
    Literal,
    NoReturn,
    Optional,
    ParamSpec,
    Sequence,
    TypeVar,
    Union,
    overload,
)

import torch

from shardwise._comm import buffers
from shardwise._comm.agreement import (
    AGREED_ERRORS,
    NOT_AGREED,
    Call,
    CallLabel,
    Rows,
    check_all_to_all_rows,
    check_same,
    check_tensor_rows,
    current_label,
    failed_call,
    inline_capacity,
    known_to_peers,
    labelled,
    log_rejections,
    raise_verdict,
)
from shardwise._comm.checks import (
    all_to_all_single_call,
    check_list,
    check_output,
    check_root,
    check_tensor,
    consecutive,
    gathered_shape,
    global_ranks,
    prod,
    rows_of,
    split_out,
    write_back,
)
from shardwise._comm.hosts import this_host
from shardwise._comm.work import Work, Worker
from shardwise._vocab import wire as _wire
from shardwise._vocab.launch import Host, group_by_host
from shardwise._vocab.switches import switched_on
from shardwise.errors import LaunchError, PeerLostError

__all__ = ["VERIFY_ENV", "Group"]

VERIFY_ENV = "SHARDWISE_VERIFY_COLLECTIVES"
T = TypeVar("T")
P = ParamSpec("P")


def _one_call_at_a_time(method: Callable[P, T]) -> Callable[P, T]:
    """A public collective that holds its group's call lock (see :meth:`Group._calling`)."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        group = args[0]
        assert isinstance(group, Group)
        with group._calling():
            return method(*args, **kwargs)

    return run


def _stopping_async(method: Callable[[Group], None], *, drain: bool) -> Callable[[Group], None]:
    """``method`` (a backend's destroy or destroy_local), after stopping the group's worker thread.

    Before a backend's ``destroy`` (``drain``), every rank's destroy first meets
    in a handshake (see :meth:`Group._agree_to_end`).
    """

    @functools.wraps(method)
    def run(self: Group) -> None:
        if drain and not self._ending_locally and self._out_of_step is not None:
            # Its peers are still inside the collective that failed here: a closing handshake or barrier
            # would be read as that collective's data. Release this rank's side without talking.
            self.destroy_local()
            return
        if drain and not self._ending_locally:
            # destroy is a collective: after another thread's call on the group, not in the middle of it.
            with self._calling(check=False):
                self._stop_async(drain=True)
                self._agree_to_end()
                method(self)
            self._destroyed = True
            return
        self._stop_async(drain=drain)
        if drain:
            method(self)  # the destroy a destroy_local runs: it talks to no one
            self._destroyed = True
            return
        # A backend's destroy_local may call its destroy (the default does): that one must not talk to peers.
        # Nor does it wait for the call lock: a thread blocked in a collective must not keep the exit handler.
        self._ending_locally = True
        try:
            method(self)
        finally:
            self._ending_locally = False
            self._destroyed = True

    run._stops_async = True  # type: ignore[attr-defined]
    return run



def _byte_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a 1-D uint8 tensor (a copy: ``frombuffer`` needs a writable buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

class Group(abc.ABC):
    """A set of ranks that run collectives together.

    Public collectives are blocking (or, with ``async_op=True``, return a
    :class:`~shardwise._comm.work.Work` to wait on) and must be called by
    every rank of the group in the same order. Tensors may be on any device and of any
    layout: non-contiguous inputs are made contiguous, tensors that require
    grad are detached (use :mod:`shardwise._comm.autograd` for autograd), and
    tensors on a device the backend does not handle are staged through
    :attr:`device`. Results are new tensors unless the method says it works
    in place.

    Args:
        backend: Backend name (``"gloo"``).
        rank: This process's rank in the group.
        size: Number of ranks in the group.
        device: The device collectives run on natively.
        devices: Device types the backend moves without staging.
        verify: Run the handshake on every collective (default: True, or
            ``SHARDWISE_VERIFY_COLLECTIVES``).
        ranks: The global rank (rank in the world group) of each rank of
            this group, in group-rank order; None when they are the same
            numbers (the world group itself). Placements name global
            ranks; a group made by :meth:`new_group` learns them from its
            parent when its backend does not set them.
    """

    #: False only for the stand-in a rank outside a subgroup gets (see ``NonMemberGroup``).
    is_member: bool = True
    #: Runs the data movement of asynchronous collectives; made on the first one.
    _worker: Optional[Worker] = None
    #: True while destroy_local runs: a destroy it calls skips the closing handshake.
    _ending_locally: bool = False
    #: Set once destroy or destroy_local has released the backend's resources.
    _destroyed: bool = False
    #: The error that broke step with the peers: a collective's data movement failed on this rank alone.
    _out_of_step: Optional[str] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A backend's destroy/destroy_local release what the worker may still be
        # using (connections, communicators): its queued collectives are finished
        # (destroy, which every rank calls) or abandoned (destroy_local) first.
        for name, drain in (("destroy", True), ("destroy_local", False)):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_stops_async", False):
                setattr(cls, name, _stopping_async(method, drain=drain))

    def __init__(
        self,
        *,
        backend: str,
        rank: int,
        size: int,
        device: torch.device,
        devices: Sequence[str] = ("cpu",),
        verify: Optional[bool] = None,
        ranks: Optional[Sequence[int]] = None,
    ) -> None:
        if self.is_member and (size < 1 or not 0 <= rank < size):
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self._backend = backend
        self._rank = rank
        self._size = size
        self._set_global_ranks(ranks)
        self._device = torch.device(device)
        self._devices = frozenset(devices)
        if verify is None:
            verify = switched_on(VERIFY_ENV)
        self.verify = verify
        self._hosts: Optional[tuple[Host, ...]] = None
        self._call_lock = threading.RLock()

    # -- identity ------------------------------------------------------------
    @property
    def backend(self) -> str:
        """Name of the backend that moves this group's data."""
        return self._backend

    @property
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < size``."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return self._size

    @property
    def device(self) -> torch.device:
        """Device whose tensors the backend moves natively."""
        return self._device

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global rank of each rank of this group, in group-rank order.

        Placements (``rank:R/DEVICE``) name global ranks (ranks in the
        default, world group), as in torch (``get_process_group_ranks``).
        """
        return tuple(range(self._size)) if self._global_ranks is None else self._global_ranks

    def global_to_group(self) -> Optional[dict[int, int]]:
        """Group rank by global rank; None when they are the same numbers (the world group, or its first ranks).

        For code that translates many placement ranks at once; None lets it
        skip the translation.
        """
        return None if self._rank_of is None else dict(self._rank_of)

    @property
    def global_rank(self) -> int:
        """This process's global rank (its rank in the default, world group)."""
        return self._rank if self._global_ranks is None else self._global_ranks[self._rank]

    def group_rank(self, global_rank: int) -> int:
        """The rank in this group of the process whose global rank is ``global_rank``.

        Raises:
            ValueError: that process is not a member of this group (the
                message carries torch's wording for the same error).
        """
        if self._rank_of is None:
            if isinstance(global_rank, int) and 0 <= global_rank < self._size:
                return global_rank
        elif global_rank in self._rank_of:
            return self._rank_of[global_rank]
        raise ValueError(
            f"global rank {global_rank} is not a member of this group ({self.describe_members()}): "
            f"Global rank {global_rank} does not exist in input process group: {list(self.ranks)}"
        )

    def hosts(self) -> tuple[Host, ...]:
        """The hosts this group's ranks run on, each with the group ranks there.

        Collective the first time: every rank of the group must call it (one
        small all-gather of each rank's host name and boot id); the answer is
        kept, so later calls are local. Ranks share a host when both match,
        so containers on one machine that have host names of their own count
        as separate hosts, as they do for shared memory.

        Returns:
            One :class:`Host` per host, in the order of its lowest rank.
        """
        if self._hosts is None:
            self._hosts = group_by_host(self.all_gather_json(this_host(), op="hosts"))
        return self._hosts

    def local_ranks(self) -> tuple[int, ...]:
        """The group ranks on this rank's host, this rank included, ascending.

        Collective the first time, as :meth:`hosts` is. Under torchrun,
        ``LOCAL_RANK`` of a rank of the world group is its index here and
        ``LOCAL_WORLD_SIZE`` the length; ranks that share a host can share
        memory.
        """
        return next(host.ranks for host in self.hosts() if self.rank in host.ranks)

    def describe_members(self) -> str:
        """``"0..3"``, or ``"global ranks [1, 2]"`` for a subgroup, for error messages."""
        if self._global_ranks is None:
            return f"0..{self._size - 1}"
        return f"global ranks {list(self._global_ranks)}; placements name global ranks, as in torch"

    def _set_global_ranks(self, ranks: Optional[Sequence[int]]) -> None:
        """Record the members' global ranks (see ``ranks`` in the class docstring)."""
        self._global_ranks = global_ranks(ranks, self._size)
        self._rank_of = None if self._global_ranks is None else {g: r for r, g in enumerate(self._global_ranks)}

    def __repr__(self) -> str:
        name = type(self).__name__
        ranks = "" if self._global_ranks is None else f" ranks={list(self._global_ranks)}"
        return f"<{name} backend={self.backend!r} rank={self.rank} size={self.size}{ranks} device={self.device}>"

    # -- primitives a backend implements -------------------------------------
    @abc.abstractmethod
    def _barrier(self) -> None:
        """Block until every rank has called it."""

    @abc.abstractmethod
    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        """Overwrite ``buf`` on every rank with ``src``'s ``buf``."""

    @abc.abstractmethod
    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        """Reduce ``buf`` in place with ``op`` (sum, min, max or product)."""

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int]) -> None:
        """Fill ``out`` with every rank's ``inp`` in rank order; ``counts[r]`` is rank r's length."""

    @abc.abstractmethod
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """Reduce ``inp`` (the concatenation of per-rank chunks of ``counts``) and keep this rank's chunk in ``out``."""

    @abc.abstractmethod
    def _all_to_all(
        self, out: torch.Tensor, out_counts: Sequence[int], inp: torch.Tensor, in_counts: Sequence[int]
    ) -> None:
        """Send ``in_counts[r]`` elements of ``inp`` to rank r; receive ``out_counts[r]`` from it."""

    @abc.abstractmethod
    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        """A group of ``ranks`` (sorted ranks of this group); None on non-members."""

    def _gather(self, out: Optional[torch.Tensor], counts: Sequence[int], inp: torch.Tensor, dst: int) -> None:
        """Concatenate every rank's ``inp`` into ``out`` on ``dst`` (default: an all-to-all with one receiver)."""
        in_counts = [0] * self.size
        in_counts[dst] = inp.numel()
        out_counts = list(counts) if self.rank == dst else [0] * self.size
        self._all_to_all(out if out is not None else inp.new_empty(0), out_counts, inp, in_counts)

    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        """Send chunk r of ``inp`` (lengths ``counts``) from ``src`` to rank r (default: all-to-all, one sender)."""
        in_counts = list(counts) if self.rank == src else [0] * self.size
        out_counts = [0] * self.size
        out_counts[src] = out.numel()
        self._all_to_all(out, out_counts, inp if inp is not None else out.new_empty(0), in_counts)

    def _all_gather_ints(self, out: array, inp: array) -> None:
        """Fill ``out`` (``array("q")``, ``size`` times ``inp``'s length) with every rank's ``inp`` in rank order.

        Called by the one-copy path (:mod:`shardwise._comm.local_copy`) for the
        few integers its ranks swap, twice per call: addresses and verdicts
        before the copies, error numbers after them (the call's barrier).
        Every agreement's handshake row travels here too (:meth:`agree`).
        Default: :meth:`_all_gather` on tensors viewing the arrays (on the
        group's device, through a copy, when that is not the CPU). A backend
        may override it with a leaner path; shardwise-mpi hands the arrays to
        ``MPI_Allgather`` directly, which right after a copy of tens of MiB
        (cold caches) takes 60 us where the tensor path takes 200.
        """
        counts = [len(inp)] * self.size
        if self._device.type == "cpu":
            self._all_gather(torch.frombuffer(out, dtype=torch.int64), torch.frombuffer(inp, dtype=torch.int64), counts)
            return
        table = torch.empty(len(out), dtype=torch.int64, device=self._device)
        self._all_gather(table, torch.tensor(inp.tolist(), dtype=torch.int64, device=self._device), counts)
        out[:] = array("q", table.tolist())

    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Dtype the backend reduces ``dtype`` values in (override to upcast).

        Raises:
            TypeError: the backend cannot reduce this dtype at all.
        """
        return dtype

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

    def _destroy_waits(self) -> bool:
        """Whether this backend's :meth:`destroy` waits for every rank (a barrier); default: it does not."""
        return False

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

    # -- direct paths a backend may offer --------------------------------------
    # Each gets a call whose arguments are checked and (when verifying) agreed
    # on every rank; it moves the caller's memory itself and returns the
    # result, or returns None/False (having moved nothing) to take the general
    # path. Both paths must give identical results.
    def _direct_broadcast(self, tensor: torch.Tensor, src: int) -> bool:
        """Broadcast into ``tensor`` in place; False to decline."""
        return False

    def _direct_all_reduce(self, tensor: torch.Tensor, op: str) -> bool:
        """Reduce ``tensor`` in place with ``op`` (a ``REDUCE_OPS`` name defined for its dtype); False to decline."""
        return False

    def _direct_all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> bool:
        """Gather every rank's equally sized ``tensor`` into ``out``; False to decline."""
        return False

    def _direct_reduce_scatter(
        self, inputs: Sequence[torch.Tensor], joined: Optional[torch.Tensor], op: str, out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Reduce-scatter ``inputs`` (``joined``: one flat view of them when they lie back to back); None to decline."""
        return None

    def _direct_all_to_all_single(
        self, tensor: torch.Tensor, outs: Sequence[int], ins: Sequence[int], out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Send ``ins[r]`` rows to rank r, receive ``outs[r]`` rows from it (into ``out`` if given); None to decline."""
        return None

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
    def _communicator(self) -> object:
        """The object whose lifetime is this group's communication channel (state about it is keyed by it).

        The group itself, unless it wraps a channel that other wrapper
        objects may share (a torch process group).
        """
        return self

    def _describe(self, primitive: str) -> str:
        """What a backend's error message should call the running ``primitive`` (the user's call, if labelled)."""
        label = current_label(self)
        return primitive if label is None else label.describe()

    def _wire_device(self, tensor: torch.Tensor) -> Optional[torch.device]:
        return None if tensor.device.type in self._devices else self._device

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

    @overload
    def agree(self, check: Callable[[], T], *, op: str, gather: Literal[False] = False) -> T: ...

    @overload
    def agree(self, check: Callable[[], Any], *, op: str, gather: Literal[True]) -> list[Any]: ...

    @_one_call_at_a_time
    def agree(self, check: Callable[[], Any], *, op: str, gather: bool = False) -> Any:
        """Run ``check()`` on this rank, then fail together or go on together.

        Every rank of the group must call it at the same point. The ranks
        exchange one handshake row each, carrying whether their ``check``
        raised: if any did, every rank raises — the rank at fault its own
        exception, unchanged, and every other rank :class:`PeerError`
        naming the failed ranks, their error kinds (see
        :data:`~shardwise.sdk.AGREED_ERRORS`) and ``op`` — and no data moves.
        This runs whether or not the group verifies collectives.

        Args:
            check: This rank's local validation; returns a value (None is fine).
            op: The API call this agreement belongs to, named in the peers'
                :class:`PeerError` (``"shard_tensor"``).
            gather: Also all-gather every rank's value, encoded as strict
                JSON (never pickled); small values travel in the handshake
                row itself, so this usually costs no extra collective.

        Returns:
            ``check()``'s value, or with ``gather=True`` every rank's value
            in rank order (tuples come back as lists).

        Raises:
            TypeError: with ``gather=True``, the value is not JSON-safe (on
                this rank; the peers raise PeerError).
            PeerError: another rank's ``check`` failed.
            CollectiveMismatchError: ranks called different collectives.
        """
        held: list[Any] = []

        def prepare() -> Call:
            held.append(check())
            if not gather:
                return Call("agree")
            data = _wire.encode_json(held[0])
            held.append(data)
            fits = len(data) <= inline_capacity(self.size)
            return Call("exchange", count=len(data), inline=data if fits else b"")

        _, rows = self._handshake(prepare, required=True, label=op)
        if not gather:
            return held[0]
        assert rows is not None
        counts = [rows.count(r) for r in range(self.size)]
        if max(counts) <= inline_capacity(self.size):
            parts = [rows.inline(r) for r in range(self.size)]
        else:
            parts = self._gather_bytes(held[1], counts, op)
        return [_wire.decode_json(part, f"rank {r}") for r, part in enumerate(parts)]

    def _gather_bytes(self, data: bytes, counts: Sequence[int], op: str) -> list[bytes]:
        """Every rank's ``data`` (``counts[r]`` bytes from rank r, already agreed)."""
        inp = _byte_tensor(data)
        out = torch.empty(sum(counts), dtype=torch.uint8, device=self._device)
        with labelled(CallLabel(self, op)):
            self._all_gather(out, inp.to(self._device), counts)
        host = out.cpu()
        joined = ctypes.string_at(host.data_ptr(), host.numel()) if host.numel() else b""
        offsets = [sum(counts[:r]) for r in range(self.size + 1)]
        return [joined[offsets[r] : offsets[r + 1]] for r in range(self.size)]

    def all_gather_json(self, obj: Any, *, op: Optional[str] = None) -> list[Any]:
        """All-gather a small JSON-safe object from every rank (metadata, not tensor data).

        The object is encoded as strict JSON (never pickled), so a peer
        cannot make this rank run code; tuples come back as lists. This is
        :meth:`agree` with ``gather=True`` and nothing to check.

        Args:
            obj: What this rank contributes.
            op: The API call this belongs to (``"shard_tensor"``), named in
                the :class:`PeerError` raised here when a peer rejects its
                part (:meth:`reject`); default the method's own name.

        Returns:
            ``[obj_of_rank_0, obj_of_rank_1, ...]``.

        Raises:
            TypeError: ``obj`` is not JSON-safe (on this rank; the others
                raise :class:`PeerError`, and nothing is sent).
        """
        return self.agree(lambda: obj, op=op or "all_gather_json", gather=True)

    def gather_json(self, obj: Any, dst: int = 0, *, op: Optional[str] = None) -> Optional[list[Any]]:
        """Gather a JSON-safe object from every rank on ``dst`` only (a save's plans, not tensor data).

        As :meth:`all_gather_json`, but only ``dst`` receives: what a
        coordinator collects from every rank (DCP's plans) costs each other
        rank its own part, not the whole group's. One agreement, then one
        :meth:`gather` of the encoded bytes.

        Args:
            obj: What this rank contributes.
            dst: The receiving rank.
            op: The API call this belongs to, named in the peers' :class:`PeerError`.

        Returns:
            On ``dst``, ``[obj_of_rank_0, obj_of_rank_1, ...]``; None elsewhere.

        Raises:
            TypeError: ``obj`` is not JSON-safe (on this rank; the others
                raise :class:`PeerError`, and nothing is sent).
        """
        data: bytes = self.agree(lambda: _wire.encode_json(obj), op=op or "gather_json")
        parts = self.gather(_byte_tensor(data), dst)
        if parts is None:
            return None
        return [_wire.decode_json(part.cpu().numpy().tobytes(), f"rank {r}") for r, part in enumerate(parts)]

    def scatter_json(self, objs: Optional[Sequence[Any]], src: int = 0, *, op: Optional[str] = None) -> Any:
        """Send ``objs[r]`` (JSON-safe) from ``src`` to rank r: a coordinator's answer to each rank.

        Args:
            objs: On ``src``, one object per rank; ignored elsewhere (pass None).
            src: The sending rank.
            op: The API call this belongs to, named in the peers' :class:`PeerError`.

        Returns:
            This rank's object.

        Raises:
            ValueError: ``src`` passed other than one object per rank (on
                ``src``; the others raise :class:`PeerError`).
            TypeError: an object is not JSON-safe (on ``src``; likewise).
        """

        def encode() -> Optional[list[bytes]]:
            if self.rank != src:
                return None
            if objs is None or len(objs) != self.size:
                got = "None" if objs is None else f"{len(objs)} object(s)"
                raise ValueError(f"scatter_json: rank {src} must pass one object per rank ({self.size}), got {got}")
            return [_wire.encode_json(obj) for obj in objs]

        encoded = self.agree(encode, op=op or "scatter_json")
        piece = self.scatter(None if encoded is None else [_byte_tensor(data) for data in encoded], src)
        return _wire.decode_json(piece.cpu().numpy().tobytes(), f"rank {src}")

    def exchange(self, obj: Any, *, op: Optional[str] = None) -> list[Any]:
        """Alias of :meth:`all_gather_json` (the name ``DESIGN.md`` uses): a JSON all-gather, not a data exchange."""
        return self.all_gather_json(obj, op=op or "exchange")

    def reject(self, error: Exception, *, op: Optional[str] = None) -> NoReturn:
        """Fail this rank's part of the collective (or agreement) its peers are entering.

        For code that validated its own arguments before calling a
        collective: instead of raising alone (and leaving the peers waiting
        in the collective), the rank joins the handshake with a failure, so
        every peer raises :class:`PeerError` naming this rank, and this rank
        raises ``error``. No data moves. Same as :meth:`agree` with a
        ``check`` that raises ``error``.

        Args:
            error: An instance of one of :data:`~shardwise.sdk.AGREED_ERRORS`.
            op: The API call being rejected; see :meth:`agree`.

        Raises:
            Exception: The given ``error``, on this rank (always).
        """
        if not isinstance(error, AGREED_ERRORS):
            kinds = ", ".join(kind.__name__ for kind in AGREED_ERRORS[:-1]) + f" or {AGREED_ERRORS[-1].__name__}"
            raise TypeError(f"reject() takes a {kinds}, got {type(error).__name__}")

        def check() -> None:
            raise error

        self.agree(check, op=op or "reject")
        raise AssertionError("unreachable: the agreement re-raises the rejected error")

    # -- public collectives --------------------------------------------------
    # Each checks and agrees in the caller's thread, then hands its data
    # movement (``move``) to _issue: run now, or queued on the worker with
    # async_op=True (see shardwise._comm.work).
    @overload
    def barrier(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def barrier(self, *, async_op: Literal[True]) -> Work[None]: ...

    @_one_call_at_a_time
    def barrier(self, *, async_op: bool = False) -> Optional[Work[None]]:
        """Block until every rank of the group has reached it.

        Args:
            async_op: Return a :class:`Work` at once instead of blocking
                (when verifying, the handshake is the barrier: every rank
                has reached it when the call returns, and the Work completes
                as soon as the worker thread runs its empty step).
        """
        if self.verify:
            self._handshake(lambda: Call(op="barrier"), async_op=async_op)
            return self._issue("barrier", lambda: None, async_op)
        return self._issue("barrier", self._barrier, async_op)

    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: Literal[True]) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place.

        Args:
            tensor: Its dtype and shape must agree on all ranks.
            src: The sending rank.
            async_op: Return a :class:`Work` whose ``wait()`` returns the
                result, instead of the result (every collective takes it).

        Returns:
            ``tensor`` itself.
        """

        def prepare() -> Call:
            check_root(src, self.size, "src")
            check_tensor(tensor, "tensor")
            return Call("broadcast", tensor.dtype, tuple(tensor.shape), root=src, count=tensor.numel())

        _, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.count, what="number of elements")

        def move() -> torch.Tensor:
            if self._direct_broadcast(tensor, src):
                return tensor
            wire = _wire.to_bytes(tensor, self._wire_device(tensor))
            self._broadcast(wire, src)
            write_back(tensor, _wire.from_bytes(wire, tensor.dtype, tuple(tensor.shape)))
            return tensor

        return self._issue("broadcast", move, async_op)

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", *, async_op: Literal[False] = False
    ) -> torch.Tensor: ...

    @overload
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum", *, async_op: Literal[True]) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = "sum", *, async_op: bool = False
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Reduce ``tensor`` across ranks in place.

        Args:
            tensor: Same dtype and shape on every rank.
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"product"``
                (or the matching ``torch.distributed.ReduceOp``). Bool
                tensors: sum/max are "or", min/product are "and".
            async_op: See :meth:`broadcast`.

        Returns:
            ``tensor`` itself, holding the result.

        Raises:
            TypeError: ``op`` is undefined for the dtype (avg of ints).
        """

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            name = _wire.normalize_reduce_op(op)
            _wire.check_reducible(tensor.dtype, name)
            self._reduction_dtype(_wire.wire_dtype(tensor.dtype))
            return Call("all_reduce", tensor.dtype, tuple(tensor.shape), reduce_op=name, count=tensor.numel())

        call, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.count, what="number of elements")

        def move() -> torch.Tensor:
            if self._direct_all_reduce(tensor, call.reduce_op):
                return tensor
            wire = _wire.to_wire(tensor, self._wire_device(tensor))
            op_name, kind = self._wire_reduction(tensor.dtype, call.reduce_op)
            buf = wire.to(kind)
            self._all_reduce(buf, op_name)
            self._finish_reduction(buf, call.reduce_op, wire)
            write_back(tensor, _wire.from_wire(wire, tensor.dtype, tuple(tensor.shape)))
            return tensor

        return self._issue("all_reduce", move, async_op)

    def _wire_reduction(self, dtype: torch.dtype, op: str) -> tuple[str, torch.dtype]:
        """The op the backend runs for ``op`` on ``dtype``, and the dtype it runs in."""
        wire_op = _wire.check_reducible(dtype, op)
        return ("sum" if wire_op == "avg" else wire_op), self._reduction_dtype(_wire.wire_dtype(dtype))

    def _finish_reduction(self, buf: torch.Tensor, op: str, out: torch.Tensor) -> None:
        """Scale an average and cast ``buf`` back into ``out`` (a no-op when they alias)."""
        if op == "avg":
            buf.div_(self.size)
        if buf.data_ptr() != out.data_ptr():
            out.copy_(buf)

    @overload
    def all_gather(
        self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None, async_op: Literal[False] = False
    ) -> list[torch.Tensor]: ...

    @overload
    def all_gather(
        self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None, async_op: Literal[True]
    ) -> Work[list[torch.Tensor]]: ...

    @_one_call_at_a_time
    def all_gather(
        self, tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None, async_op: bool = False
    ) -> Union[list[torch.Tensor], Work[list[torch.Tensor]]]:
        """Every rank's ``tensor``, in rank order, on every rank.

        Sizes along dim 0 may differ between ranks; dtype and the other
        dims must agree.

        Args:
            tensor: This rank's contribution.
            out: Optional preallocated result of shape
                ``(size * rows, *tensor.shape[1:])`` (``(size,)`` for a 0-d
                ``tensor``) and ``tensor``'s dtype, as in
                ``torch.distributed.all_gather_into_tensor``: every rank then
                sends the same number of rows, no sizes need to be agreed
                (so with ``verify=False`` no handshake runs), and a caller
                that gathers repeatedly reuses one buffer.
            async_op: See :meth:`broadcast`.

        Returns:
            One tensor per rank (views into one buffer, ``out`` when given),
            on ``tensor``'s device (``out``'s when given).
        """
        if out is not None:
            return self._issue("all_gather", self._all_gather_into(tensor, out, async_op), async_op)

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            return Call("all_gather", tensor.dtype, tuple(tensor.shape), count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        check_tensor_rows(rows)
        dims = [rows.count(r) for r in range(self.size)]

        def move() -> list[torch.Tensor]:
            shape = tuple(tensor.shape)
            wire = _wire.to_bytes(tensor, self._wire_device(tensor))
            per_row = tensor.dtype.itemsize * prod(shape[1:])
            counts = [d * per_row for d in dims]
            gathered = buffers.empty_like(wire, (sum(counts),))
            self._all_gather(gathered, wire, counts)
            return split_out(gathered, counts, dims, shape, tensor.dtype, tensor.device)

        return self._issue("all_gather", move, async_op)

    def _all_gather_into(
        self, tensor: torch.Tensor, out: torch.Tensor, async_op: bool
    ) -> Callable[[], list[torch.Tensor]]:
        """Check and agree on an all-gather into ``out``; the data movement that follows."""

        def prepare() -> Call:
            check_tensor(tensor, "tensor")
            check_output(out, tensor.dtype, gathered_shape(tuple(tensor.shape), self.size), "out")
            return Call("all_gather", tensor.dtype, tuple(tensor.shape), count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.count, what="number of rows (all_gather with out= needs equal sizes)")

        def move() -> list[torch.Tensor]:
            if not self._direct_all_gather(tensor, out):
                wire = _wire.to_bytes(tensor, self._wire_device(tensor))
                target = _wire.to_bytes(out, self._wire_device(out))
                self._all_gather(target, wire, [wire.numel()] * self.size)
                write_back(out, _wire.from_bytes(target, out.dtype, tuple(out.shape)))
            return list(out.unbind(0)) if tensor.dim() == 0 else list(out.chunk(self.size))

        return move

    @overload
    def reduce_scatter(
        self,
        inputs: Sequence[torch.Tensor],
        op: Any = "sum",
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def reduce_scatter(
        self,
        inputs: Sequence[torch.Tensor],
        op: Any = "sum",
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[True],
    ) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def reduce_scatter(
        self,
        inputs: Sequence[torch.Tensor],
        op: Any = "sum",
        *,
        out: Optional[torch.Tensor] = None,
        async_op: bool = False,
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Reduce ``inputs[r]`` across ranks and return the result to rank r.

        Args:
            inputs: One tensor per rank; ``inputs[r]`` must have the same
                shape on every rank (sizes may differ between r's). When they
                are consecutive pieces of one contiguous tensor (``t.split``,
                ``t.chunk``) they are sent from it without being copied.
            op: As for :meth:`all_reduce`.
            out: Optional tensor of ``inputs[self.rank]``'s shape and dtype
                to write the result into.
            async_op: See :meth:`broadcast`.

        Returns:
            The reduced ``inputs[self.rank]`` (``out`` when given), on its device.
        """

        def prepare() -> Call:
            shape = check_list(inputs, self.size, "inputs")
            name = _wire.normalize_reduce_op(op)
            _wire.check_reducible(inputs[0].dtype, name)
            self._reduction_dtype(_wire.wire_dtype(inputs[0].dtype))
            if out is not None:
                check_output(out, inputs[0].dtype, tuple(inputs[self.rank].shape), "out")
            sizes = [rows_of(tuple(t.shape)) for t in inputs]
            return Call("reduce_scatter", inputs[0].dtype, shape, reduce_op=name, splits_a=sizes)

        call, rows = self._handshake(prepare, async_op=async_op)
        if rows is not None:
            check_tensor_rows(rows)
            check_same(rows, rows.splits_a, what="size of each rank's chunk")
        return self._issue("reduce_scatter", lambda: self._move_reduce_scatter(inputs, call.reduce_op, out), async_op)

    def _move_reduce_scatter(
        self, inputs: Sequence[torch.Tensor], reduce_op: str, out: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The data movement of :meth:`reduce_scatter` (arguments checked and agreed)."""
        joined = consecutive(inputs)
        direct = self._direct_reduce_scatter(inputs, joined, reduce_op, out)
        if direct is not None:
            return direct
        dtype, device = inputs[0].dtype, inputs[0].device
        shape_r = tuple(inputs[self.rank].shape)
        op_name, kind = self._wire_reduction(dtype, reduce_op)
        if joined is not None and self._wire_device(joined) is None:
            inp = _wire.to_wire(joined, None).to(kind)
            counts = [t.numel() * (2 if dtype.is_complex else 1) for t in inputs]
        else:
            flat = [_wire.to_wire(t, self._wire_device(t)) for t in inputs]
            counts = [t.numel() for t in flat]
            inp = torch.cat(flat).to(kind)
        wire_out = None if out is None else _wire.to_wire(out, self._wire_device(out))
        if wire_out is not None and wire_out.dtype == kind:
            buf = wire_out
        else:
            buf = buffers.empty_like(inp, (counts[self.rank],))
        self._reduce_scatter(buf, inp, counts, op_name)
        if wire_out is None:
            wire = _wire.wire_dtype(dtype)
            wire_out = buf if buf.dtype == wire else torch.empty_like(buf, dtype=wire)
        self._finish_reduction(buf, reduce_op, wire_out)
        if out is None:
            return _wire.from_wire(wire_out, dtype, shape_r).to(device)
        write_back(out, _wire.from_wire(wire_out, dtype, shape_r))
        return out

    @overload
    def all_to_all(self, inputs: Sequence[torch.Tensor], *, async_op: Literal[False] = False) -> list[torch.Tensor]: ...

    @overload
    def all_to_all(self, inputs: Sequence[torch.Tensor], *, async_op: Literal[True]) -> Work[list[torch.Tensor]]: ...

    @_one_call_at_a_time
    def all_to_all(
        self, inputs: Sequence[torch.Tensor], *, async_op: bool = False
    ) -> Union[list[torch.Tensor], Work[list[torch.Tensor]]]:
        """Send ``inputs[r]`` to rank r; return what each rank sent here.

        Sizes along dim 0 may differ per destination; dtype and the other
        dims must agree everywhere.

        Args:
            inputs: One tensor per rank.
            async_op: See :meth:`broadcast`.

        Returns:
            ``out[r]`` is what rank r sent to this rank (views into one buffer).
        """

        def prepare() -> Call:
            shape = check_list(inputs, self.size, "inputs")
            sizes = [rows_of(tuple(t.shape)) for t in inputs]
            return Call("all_to_all", inputs[0].dtype, shape, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        check_tensor_rows(rows)
        recv_dims = [rows.splits_a(r)[self.rank] for r in range(self.size)]

        def move() -> list[torch.Tensor]:
            dtype, device, shape = inputs[0].dtype, inputs[0].device, tuple(inputs[0].shape)
            flat = [_wire.to_bytes(t, self._wire_device(t)) for t in inputs]
            inp = torch.cat(flat)
            per_row = dtype.itemsize * prod(shape[1:])
            out_counts = [d * per_row for d in recv_dims]
            received = buffers.empty_like(inp, (sum(out_counts),))
            self._all_to_all(received, out_counts, inp, [t.numel() for t in flat])
            return split_out(received, out_counts, recv_dims, shape, dtype, device)

        return self._issue("all_to_all", move, async_op)

    @overload
    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
        async_op: Literal[True],
    ) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        out: Optional[torch.Tensor] = None,
        async_op: bool = False,
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Split ``tensor`` along dim 0, send piece r to rank r, concatenate what arrives.

        Args:
            tensor: At least 1-D; other dims and dtype agree on all ranks.
            output_split_sizes: Rows to receive from each rank; derived from
                the senders when None (and checked against them when given),
                or an equal split of ``out`` when ``out`` is given.
            input_split_sizes: Rows to send to each rank; an equal split
                when None (dim 0 must then divide by the group size).
            out: Optional preallocated result (``tensor``'s dtype and
                trailing dims). With ``out`` or both split sizes every rank
                knows the sizes, so with ``verify=False`` no handshake runs.
            async_op: See :meth:`broadcast`.

        Returns:
            The received rows: ``out`` when given, else a new tensor of
            ``sum(output_split_sizes)`` rows.
        """
        need = not output_split_sizes and out is None
        call, rows = self._handshake(
            lambda: all_to_all_single_call(tensor, output_split_sizes, input_split_sizes, out, self.size),
            required=need,
            async_op=async_op,
        )
        ins = list(call.splits_a)
        if rows is not None:
            check_tensor_rows(rows)
            check_all_to_all_rows(rows)
            outs = [rows.splits_a(r)[self.rank] for r in range(self.size)]
        else:
            outs = list(call.splits_b)

        def move() -> torch.Tensor:
            # In place (``out`` is ``tensor``, or overlaps it): rows would arrive over rows not yet sent, which
            # torch's gloo and MPI leave undefined. Send from a copy.
            sent = tensor.clone() if out is not None and _wire.shares_memory(tensor, out) else tensor
            direct = self._direct_all_to_all_single(sent, outs, ins, out)
            if direct is not None:
                return direct
            shape = tuple(sent.shape)
            per_row = sent.dtype.itemsize * prod(shape[1:])
            wire = _wire.to_bytes(sent, self._wire_device(sent))
            if out is None:
                target = buffers.empty_like(wire, (sum(outs) * per_row,))
            else:
                target = _wire.to_bytes(out, self._wire_device(out))
            self._all_to_all(target, [o * per_row for o in outs], wire, [i * per_row for i in ins])
            if out is None:
                return _wire.from_bytes(target, tensor.dtype, (sum(outs), *shape[1:])).to(tensor.device)
            write_back(out, _wire.from_bytes(target, out.dtype, tuple(out.shape)))
            return out

        return self._issue("all_to_all_single", move, async_op)

    @overload
    def scatter(
        self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0, *, async_op: Literal[False] = False
    ) -> torch.Tensor: ...

    @overload
    def scatter(
        self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0, *, async_op: Literal[True]
    ) -> Work[torch.Tensor]: ...

    @_one_call_at_a_time
    def scatter(
        self, tensors: Optional[Sequence[torch.Tensor]], src: int = 0, *, async_op: bool = False
    ) -> Union[torch.Tensor, Work[torch.Tensor]]:
        """Send ``tensors[r]`` from ``src`` to rank r.

        Args:
            tensors: On ``src``, one tensor per rank (dim 0 may differ);
                ignored elsewhere (pass None).
            src: The sending rank.
            async_op: See :meth:`broadcast`.

        Returns:
            This rank's piece, on :attr:`device` (on ``src``: on the
            device of ``tensors[src]``).
        """

        def prepare() -> Call:
            check_root(src, self.size, "src")
            if self.rank != src:
                return Call("scatter", root=src)
            if tensors is None:
                raise ValueError(f"scatter: rank {src} is the source and must pass one tensor per rank, got None")
            shape = check_list(tensors, self.size, "tensors")
            sizes = [rows_of(tuple(t.shape)) for t in tensors]
            return Call("scatter", tensors[0].dtype, shape, root=src, splits_a=sizes)

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        dtype = rows.dtype(src)
        assert dtype is not None
        ndim, trailing, splits = rows.ndim(src), rows.trailing(src), rows.splits_a(src)

        def move() -> torch.Tensor:
            my_rows = splits[self.rank]
            per_row = dtype.itemsize * prod(trailing)
            out_shape = (my_rows, *trailing) if ndim > 0 else ()
            if self.rank == src:
                assert tensors is not None
                flat = [_wire.to_bytes(t, self._wire_device(t)) for t in tensors]
                inp: Optional[torch.Tensor] = torch.cat(flat)
                device = tensors[src].device
                piece = buffers.empty_like(flat[0], (my_rows * per_row,))
            else:
                inp, device = None, self._device
                piece = buffers.empty((my_rows * per_row,), torch.uint8, self._device)
            self._scatter(piece, inp, [n * per_row for n in splits], src)
            return _wire.from_bytes(piece, dtype, out_shape).to(device)

        return self._issue("scatter", move, async_op)

    @overload
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, async_op: Literal[False] = False
    ) -> Optional[list[torch.Tensor]]: ...

    @overload
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, async_op: Literal[True]
    ) -> Work[Optional[list[torch.Tensor]]]: ...

    @_one_call_at_a_time
    def gather(
        self, tensor: torch.Tensor, dst: int = 0, *, async_op: bool = False
    ) -> Union[Optional[list[torch.Tensor]], Work[Optional[list[torch.Tensor]]]]:
        """Collect every rank's ``tensor`` on ``dst``.

        Sizes along dim 0 may differ; dtype and other dims must agree.

        Args:
            tensor: This rank's contribution.
            dst: The receiving rank.
            async_op: See :meth:`broadcast`.

        Returns:
            On ``dst``, one tensor per rank (views into one buffer); None elsewhere.
        """

        def prepare() -> Call:
            check_root(dst, self.size, "dst")
            check_tensor(tensor, "tensor")
            return Call("gather", tensor.dtype, tuple(tensor.shape), root=dst, count=rows_of(tuple(tensor.shape)))

        _, rows = self._handshake(prepare, required=True, async_op=async_op)
        assert rows is not None
        check_tensor_rows(rows)
        dims = [rows.count(r) for r in range(self.size)]

        def move() -> Optional[list[torch.Tensor]]:
            shape = tuple(tensor.shape)
            per_row = tensor.dtype.itemsize * prod(shape[1:])
            counts = [d * per_row for d in dims]
            wire = _wire.to_bytes(tensor, self._wire_device(tensor))
            gathered = buffers.empty_like(wire, (sum(counts),)) if self.rank == dst else None
            self._gather(gathered, counts, wire, dst)
            if gathered is None:
                return None
            return split_out(gathered, counts, dims, shape, tensor.dtype, tensor.device)

        return self._issue("gather", move, async_op)

    @_one_call_at_a_time
    def new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        """A sub-group of ``ranks`` (ranks of this group), made collectively.

        Every rank of this group must call it with the same ``ranks``.

        Returns:
            The sub-group on its members (its ranks renumbered 0..n-1 in
            ``ranks`` order sorted), None on the other ranks.
        """

        def prepare() -> Call:
            members = list(ranks)
            if not members or len(set(members)) != len(members):
                raise ValueError(f"new_group: ranks must be distinct and non-empty, got {members!r}")
            for r in members:
                check_root(r, self.size, "rank")
            return Call("new_group", splits_a=[1 if r in members else 0 for r in range(self.size)])

        call, rows = self._handshake(prepare)
        if rows is not None:
            # Compare the member lists, not the 0/1 masks that carry them (which read like rank lists).
            check_same(
                rows, lambda r: [m for m, flag in enumerate(rows.splits_a(r)) if flag], what="members of the new group"
            )
        members = [r for r, flag in enumerate(call.splits_a) if flag]
        # Making the sub-group communicates on this group (MPI_Comm_split): after its queued collectives,
        # also when the handshake above did not run (verify off).
        self._settle()
        sub = self._new_group(members)
        if sub is not None and sub._global_ranks is None:
            # The backend numbered the sub-group only within itself; its members' global ranks follow from ours.
            sub._set_global_ranks([self.ranks[m] for m in members])
        return sub
