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

The class is split over private base classes, one module each, each built
on the one below: :mod:`~shardwise._comm.group_core` (identity, membership,
the primitives and direct paths), :mod:`~shardwise._comm.group_calls` (the
call lock, the handshake, asynchronous steps, ``destroy``),
:mod:`~shardwise._comm.group_agreement` (``agree``, the JSON all-gather,
``reject``, ``hosts``), :mod:`~shardwise._comm.group_collectives`
(``barrier``, ``broadcast``, ``all_reduce``, ``all_gather``,
``reduce_scatter``) and :mod:`~shardwise._comm.group_exchanges`
(``all_to_all``, ``scatter``, ``gather`` and their JSON forms). ``Group``
itself, here, adds its constructor, the wrapping of a backend's
``destroy``/``destroy_local`` and ``new_group``: it is the class every
backend subclasses and everyone imports.
"""

from __future__ import annotations

import abc
import functools
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from shardwise._comm.agreement import Call, check_same
from shardwise._comm.checks import check_root
from shardwise._comm.group_calls import _one_call_at_a_time
from shardwise._comm.group_exchanges import GroupExchanges
from shardwise._comm.work import Worker
from shardwise._vocab.launch import Host
from shardwise._vocab.switches import switched_on

__all__ = ["VERIFY_ENV", "Group"]

VERIFY_ENV = "SHARDWISE_VERIFY_COLLECTIVES"


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


class Group(GroupExchanges):
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

    # -- the primitive that makes a sub-group (it returns a Group) ----------------
    @abc.abstractmethod
    def _new_group(self, ranks: Sequence[int]) -> Optional[Group]:
        """A group of ``ranks`` (sorted ranks of this group); None on non-members."""

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
