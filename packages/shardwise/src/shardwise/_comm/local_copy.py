"""One copy between ranks on one host: cross-memory attach (``process_vm_readv``, ``process_vm_writev``).

Why: between processes on one machine, MPI and gloo move a message with two
copies (sender into a shared segment or socket, segment into the receiver),
and a layout change packs and unpacks around them. Linux's cross-memory
attach lets a process read another's memory directly, so a receiver can
copy its bytes straight from the sender's buffer (or shard) into its own
destination: one copy, no intermediate buffer, no extra memory. Only a few
integers travel over the group's own collective (each rank's pid and buffer
addresses), so the same mechanism serves every backend whose ranks are
processes on this host (gloo and mpi alike), with no transport of our own.
MPI-3 shared-memory windows were the alternative; they need the data to live
in a window allocated up front (so a copy into it), and exist only for MPI.

When it applies: the group's backend offers it (``Group._local_copy``), every
rank of the group is on this host (:meth:`Group.hosts`), the kernel lets this
process read its peers (checked once per process by
:func:`shardwise._comm.cross_memory.probe`, then once per group with a tiny
read among the ranks, since seccomp or Yama's ``ptrace_scope`` may forbid it,
and agreed across ranks so all take the same path; under ``ptrace_scope`` 1
the ranks declare their launcher their tracer and try again,
:mod:`shardwise._comm.ptracer`), ``SHARDWISE_LOCAL_COPY`` is not ``0``, and on
each call every rank's tensors are contiguous CPU memory (the call's first
all-gather carries each rank's verdict; any "no" sends every rank down the
backend's own path). Ranks on several hosts always keep the backend's path.
The users: the group's collectives (:mod:`shardwise._comm.local_collectives`)
and layout changes (:mod:`shardwise._comm.box_moves`).

Protocol of one call (:func:`transfer`): one small all-gather of ``[ok, pid,
addresses...]``; each rank reads its pieces from its peers (the
collectives), or reads some and writes others into its peers' memory (layout
changes, :mod:`shardwise._comm.box_moves`), through the system calls of
:mod:`shardwise._comm.cross_memory`; then one all-gather of each rank's error
number, which is also the barrier that keeps a sender from reusing its buffer
(and a receiver from using its result) before every peer is done: a failed
copy (a peer gone: ``ESRCH``) raises :class:`~shardwise.errors.PeerLostError`
on every rank. Which path a call took
is logged at DEBUG on ``shardwise.local_copy``; :data:`stats` counts the
calls moved here (tests read it).
"""

from __future__ import annotations

import contextlib
import errno as errno_module
import hashlib
import logging
import os
import time
import weakref
from array import array
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import torch

from shardwise._comm import copy_rates, cross_memory, ptracer
from shardwise._comm.agreement import mark_known_to_peers
from shardwise._comm.hosts import this_host
from shardwise._vocab.switches import switched_on
from shardwise.errors import PeerError, PeerLostError

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = [
    "LOCAL_COPY_ENV",
    "RAISED",
    "Copy",
    "all_gather_ints",
    "copyable",
    "enabled",
    "stats",
    "transfer",
    "usable",
]

LOCAL_COPY_ENV = "SHARDWISE_LOCAL_COPY"

_log = logging.getLogger("shardwise.comm")

#: The last word of the token a rank reads from its peer to prove the kernel allows it.
_TOKEN = 0x5A5A5A5A

#: Calls moved by cross-memory attach in this process, by collective name.
stats: dict[str, int] = {}


class _State:
    """What this process knows about one group: the agreed verdict, and whether a local copy is under way."""

    __slots__ = ("busy", "verdict")

    def __init__(self) -> None:
        self.verdict: Optional[bool] = None
        # Set while this module runs collectives of its own on the group (the
        # verdict's setup, a call's all-gathers): nested primitives take the
        # backend's path. Every rank nests the same way, so all agree.
        self.busy = False


_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def copyable(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a peer may copy each tensor's values as its bytes: contiguous, dense CPU memory (None is fine).

    A conjugate or negative view is not: its memory holds the values before
    the flag, which a copy of the memory would drop.
    """
    return all(
        t is None
        or (
            t.device.type == "cpu"
            and t.layout == torch.strided
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
        )
        for t in tensors
    )


def enabled() -> bool:
    """Whether ``SHARDWISE_LOCAL_COPY`` allows cross-memory attach (read on every call)."""
    return switched_on(LOCAL_COPY_ENV)


#: The closing-round code of a rank whose own work raised during the copies or a round trip (not an error number).
RAISED = -2

#: What a failed copy's error number says happened (the message's cause; others: a peer probably died).
_CAUSES = {
    errno_module.ESRCH: "The peer process is gone: it has probably died",
    errno_module.EPERM: "The kernel refused to copy between the processes (ptrace access rules, such as Yama's "
    "ptrace_scope, or ranks running as different users)",
    errno_module.EFAULT: "An address was not mapped, or not writable, in one of the processes: a buffer freed, "
    "resized or read-only while the call ran",
}


# -- agreement -------------------------------------------------------------------


def _state(group: Group) -> _State:
    # Keyed by the communicator, not the Group object: several wrappers of one torch process group can
    # exist over time (a wrapper collected on one rank is made anew, while a peer's survives in a
    # reference cycle), and the verdict must be the same on every rank.
    key = group._communicator()
    state = _states.get(key)
    if state is None:
        state = _states[key] = _State()
    return state


def all_gather_ints(group: Group, row: Sequence[int]) -> list[list[int]]:
    """Every rank's ``row`` (all the same length), through the backend's ``Group._all_gather_ints``.

    Plain ``array`` buffers, no tensors: this runs twice in every call, the
    second time right after the copies, when the caches are cold and each
    tensor op costs tens of microseconds.
    """
    n = len(row)
    out = array("q", bytes(8 * n * group.size))
    group._all_gather_ints(out, array("q", row))
    return [out[r * n : (r + 1) * n].tolist() for r in range(group.size)]


def _usable(group: Group) -> Optional[_State]:
    """The group's state when cross-memory attach may be tried now (same on every rank), else None."""
    if not getattr(group, "_local_copy", False) or group.size < 2:
        return None
    state = _state(group)
    if state.busy:
        return None
    if state.verdict is None:
        state.busy = True
        try:
            state.verdict = _agree_verdict(group)
        finally:
            state.busy = False
    return state if state.verdict else None


def usable(group: Group) -> bool:
    """Whether a call on ``group`` may try cross-memory attach now; the same answer on every rank.

    Collective the first time on a group (the ranks agree on the verdict);
    a call may still decline afterwards (a rank's tensors do not fit).
    """
    return _usable(group) is not None


def _host_key() -> int:
    """This process's host (name and boot id, as :meth:`Group.hosts` compares them) as one int64."""
    digest = hashlib.blake2b("\0".join(this_host()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _agree_verdict(group: Group) -> bool:
    """Collective: whether every rank can read every peer (all on this host, kernel allows it, switch on).

    Only the backend's primitives run here (no public collective: this runs
    inside one, possibly on the group's worker thread).
    """
    # Always its own round, never a wrapper's cached hosts(): the verdict is kept per communicator, and a rank
    # whose wrapper was collected and made anew would skip a round its peers run.
    one_host = len({row[0] for row in all_gather_ints(group, [_host_key()])}) == 1
    if not one_host:
        _log.debug("%r: ranks on several hosts, keeping the backend's path", group)
        return False
    reason = cross_memory.probe() if enabled() else f"{LOCAL_COPY_ENV}=0"
    scope = ptracer.yama_scope()
    # Under Yama's scope 1 each rank publishes its parent and whether its PID namespace is a container's.
    yama = reason is None and scope == 1 and ptracer.proc_is_own()
    chain = ptracer.ancestry() if yama else []
    token = torch.tensor([os.getpid(), group.rank, _TOKEN], dtype=torch.int64, device="cpu")
    padded = chain + [0] * (ptracer.ANCESTRY_DEPTH - len(chain))
    own_init = yama and ptracer.in_child_pid_namespace()
    rows = all_gather_ints(group, [reason is None, os.getpid(), token.data_ptr(), scope, own_init, *padded])
    err = 0
    if all(row[0] for row in rows):
        err, reason = _read_token(group, rows)
    verdicts = all_gather_ints(group, [reason is None and all(row[0] for row in rows), err])
    ok = all(v[0] for v in verdicts)
    if not ok and _yama_may_allow(rows, verdicts):
        ok, reason = _with_declared_tracer(group, rows, chain)
    del token
    _log.debug(
        "%r: cross-memory attach %s%s",
        group,
        "in use" if ok else "not used",
        f" (this rank: {reason})" if reason else "",
    )
    return ok


def _read_token(group: Group, rows: Sequence[Sequence[int]]) -> tuple[int, Optional[str]]:
    """Read the next rank's token: proves the kernel lets this process read a peer's memory (error, why not)."""
    peer = (group.rank + 1) % group.size
    got = torch.zeros(3, dtype=torch.int64, device="cpu")
    err = cross_memory.read_runs(rows[peer][1], cross_memory.runs([got.data_ptr()], [rows[peer][2]], [24]))
    if err == 0 and got.tolist() != [rows[peer][1], peer, _TOKEN]:
        err = errno_module.EIO
    return err, (f"reading rank {peer}'s memory failed: {cross_memory.strerror(err)}" if err else None)


def _yama_may_allow(rows: Sequence[Sequence[int]], verdicts: Sequence[Sequence[int]]) -> bool:
    """Whether Yama's ptrace_scope 1 alone refused the reads, which a declared tracer lifts (same on every rank)."""
    errors = [v[1] for v in verdicts]
    return (
        all(row[0] and row[3] == 1 for row in rows)
        and all(e in (0, errno_module.EPERM) for e in errors)
        and errno_module.EPERM in errors
    )


def _with_declared_tracer(group: Group, rows: Sequence[Sequence[int]], chain: list[int]) -> tuple[bool, Optional[str]]:
    """Collective: every rank declares the ranks' launcher its tracer, then the reads are tried again.

    Returns:
        Whether every rank now reads its peer, and this rank's reason if not.
        A declaration that did not help is taken back.
    """
    ancestor = ptracer.nearest_common_ancestor([row[5:] for row in rows], init_allowed=all(row[4] for row in rows))
    if ancestor is None:
        why: Optional[str] = (
            "Yama's ptrace_scope is 1 and no one process (other than init) is the parent of every rank, "
            "so there is no launcher to declare their tracer"
        )
        done = ptracer.Declared(why, None, None)
    else:
        done = ptracer.declare(ancestor, chain)
        why = done.why
    declared = all_gather_ints(group, [why is None])  # also: nobody reads before every rank has declared
    if not all(row[0] for row in declared):
        ptracer.undeclare(done.before, done.after)
        return False, why or "a peer could not declare its tracer"
    _, why = _read_token(group, rows)
    ok = all(row[0] for row in all_gather_ints(group, [why is None]))
    if not ok:
        ptracer.undeclare(done.before, done.after)
    return ok, why


def _finish(group: Group, name: str, err: int) -> None:
    """Collective end of a call: every rank has read (so buffers may be reused); raise everywhere if one failed."""
    _settled(group, name, [row[0] for row in all_gather_ints(group, [err])])


def _settled(group: Group, name: str, errors: Sequence[int]) -> None:
    """Every rank's error number of a finished call (the same list on each): raise if any failed, else count it."""
    raised = [r for r, e in enumerate(errors) if e == RAISED]
    failed = [(r, e) for r, e in enumerate(errors) if e and e != RAISED]
    if raised and not failed:
        # Every rank got through the closing round: the group is still in step, only this call failed.
        raise PeerError(
            f"rank {group.rank} of {group.size}: {name} by cross-memory attach: rank(s) {raised} raised an error "
            "of their own during the copies (they raise it); no rank's result of this call is valid"
        )
    if failed:
        where = ", ".join(f"rank {r}: {cross_memory.strerror(e)}" for r, e in failed)
        cause = _CAUSES.get(failed[0][1], "A peer has probably died")
        if any(e == errno_module.ESRCH for _, e in failed):
            after = "the group cannot be used any more"
        else:
            # Every rank answered this closing round, so none is lost and the group is still in step.
            after = "no rank's result of this call is valid, but every rank reached its end, so the group still works"
        raise PeerLostError(
            f"rank {group.rank} of {group.size}: {name} by cross-memory attach failed ({where}). {cause}; {after}. "
            f"If the kernel refuses the copies, set {LOCAL_COPY_ENV}=0 to use the backend's own transport."
        )
    stats[name] = stats.get(name, 0) + 1
    _log.debug("%r: %s moved by cross-memory attach", group, name)


def _start(group: Group, name: str, ok: bool, fields: Sequence[int]) -> Optional[list[list[int]]]:
    """The call's first all-gather of ``[ok, pid, *fields]``; None (every rank) unless every rank is ok."""
    rows = all_gather_ints(group, [int(ok and enabled()), os.getpid(), *fields])
    if all(row[0] for row in rows):
        return rows
    _log.debug("%r: %s keeps the backend's path (a rank declined)", group, name)
    return None


class Copy(NamedTuple):
    """One rank's copies with one peer in a call: ``runs`` of ``(local address, remote address, bytes)``.

    Attributes:
        pid: The peer's process id (from the call's first all-gather).
        runs: The runs, in order.
        write: False: read the peer's memory into ours; True: write ours into the peer's.
        observe: The :mod:`~shardwise._comm.copy_rates` kind the copy is timed
            as and its bytes, or None (not timed).
    """

    pid: int
    runs: torch.Tensor
    write: bool
    observe: Optional[tuple[int, int]] = None


def transfer(
    group: Group,
    name: str,
    ok: bool,
    fields: Sequence[int],
    copies: Callable[[list[list[int]]], Sequence[Copy]],
) -> bool:
    """Collective: run one call by cross-memory attach; False (on every rank) to take the backend's path.

    Agrees (the first all-gather of ``[ok, pid, *fields]``), lets ``copies``
    list this rank's copies from the gathered rows (and make its local
    copies; it must not communicate), makes them, and finishes (the
    all-gather of errors that is also the barrier).

    Raises:
        PeerLostError: on every rank, when a copy failed on any.
        PeerError: a peer's ``copies`` raised (a local copy out of
            memory); that rank raises its own error, after the closing
            round, instead of leaving its peers in that round.
    """
    state = _usable(group)
    if state is None:
        return False
    state.busy = True
    try:
        rows = _start(group, name, ok, fields)
        if rows is None:
            return False
        err = 0
        try:
            for copy in copies(rows):
                started = time.perf_counter()
                err = err or (cross_memory.write_runs if copy.write else cross_memory.read_runs)(copy.pid, copy.runs)
                if copy.observe is not None and not err:
                    copy_rates.observe(*copy.observe, time.perf_counter() - started)
        except Exception as exc:
            # Into the closing round with a code, so the peers raise too; then this rank's own error
            # (also when that round fails: a peer lost too).
            with contextlib.suppress(PeerLostError):
                all_gather_ints(group, [RAISED])
            mark_known_to_peers(exc)  # the ranks are still in step
            raise
        _finish(group, name, err)
        return True
    finally:
        state.busy = False
