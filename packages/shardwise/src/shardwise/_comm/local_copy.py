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
process read its peers (checked once per group with a tiny read among the
ranks, since seccomp or Yama's ``ptrace_scope`` may forbid it, and agreed
across ranks so all take the same path; under ``ptrace_scope`` 1 the ranks
declare their launcher their tracer and try again, :mod:`shardwise._comm.ptracer`), ``SHARDWISE_LOCAL_COPY`` is not
``0``, and on each call every rank's tensors are contiguous CPU memory (the
call's first all-gather carries each rank's verdict; any "no" sends every rank
down the backend's own path). Ranks on several hosts always keep the
backend's path. The users: the group's collectives
(:mod:`shardwise._comm.local_collectives`) and layout changes
(:mod:`shardwise._comm.box_moves`).

Protocol of one call (:func:`transfer`): one small all-gather of ``[ok, pid,
addresses...]``; each rank reads its pieces from its peers (the
collectives), or reads some and writes others into its peers' memory (layout
changes, :mod:`shardwise._comm.box_moves`), by iovec lists of up to
``IOV_MAX`` entries a side, runs that continue one another merged into one
iovec, partial copies resumed; then one all-gather of each rank's error
number, which is also the barrier that keeps a sender from reusing its buffer
(and a receiver from using its result) before every peer is done: a failed
copy (a peer gone: ``ESRCH``) raises :class:`~shardwise.errors.PeerLostError`
on every rank. Which path a call took
is logged at DEBUG on ``shardwise.local_copy``; :data:`stats` counts the
calls moved here (tests read it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_module
import hashlib
import logging
import os
import sys
import time
import weakref
from array import array
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence, cast

import torch

from shardwise._comm import copy_rates, ptracer
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
    "probe",
    "runs",
    "stats",
    "transfer",
    "usable",
]

LOCAL_COPY_ENV = "SHARDWISE_LOCAL_COPY"
#: Most iovecs one ``process_vm_readv`` takes (Linux's ``UIO_MAXIOV``).
_IOV_MAX = 1024

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
_readv: Optional[Callable[..., int]] = None
_writev: Optional[Callable[..., int]] = None
#: The probe's answer: None before it ran, "" when the syscall works, else why not.
_probed: Optional[str] = None


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


def _syscall(name: str) -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return cast(Callable[..., int], fn)


def _load() -> Callable[..., int]:
    """libc's ``process_vm_readv``, loaded on first use (no import-time side effects)."""
    global _readv
    if _readv is None:
        _readv = _syscall("process_vm_readv")
    return _readv


def _load_writev() -> Callable[..., int]:
    """libc's ``process_vm_writev``, loaded on first use."""
    global _writev
    if _writev is None:
        _writev = _syscall("process_vm_writev")
    return _writev


def probe() -> Optional[str]:
    """Why this process cannot use ``process_vm_readv`` (None: it can), found once by reading its own memory.

    Reading a peer may still be refused (Yama's ``ptrace_scope``); the
    per-group check reads from the peers themselves.
    """
    global _probed
    if _probed is None:
        if not sys.platform.startswith("linux"):
            _probed = f"cross-memory attach is Linux only (this is {sys.platform})"
        else:
            try:
                src, dst = (
                    torch.arange(4, dtype=torch.int64, device="cpu"),
                    torch.zeros(4, dtype=torch.int64, device="cpu"),
                )
                err = _read_runs(os.getpid(), runs([dst.data_ptr()], [src.data_ptr()], [32]))
                ok = err == 0 and torch.equal(src, dst)
                _probed = "" if ok else f"process_vm_readv failed: {_strerror(err)}"
                if ok:
                    # Layout changes also write into peers (box_moves): a seccomp filter may allow one call only.
                    back = torch.zeros(4, dtype=torch.int64, device="cpu")
                    err = _write_runs(os.getpid(), runs([src.data_ptr()], [back.data_ptr()], [32]))
                    ok = err == 0 and torch.equal(src, back)
                    _probed = "" if ok else f"process_vm_writev failed: {_strerror(err)}"
            except (OSError, AttributeError) as exc:  # no libc, or a libc without the symbol
                _probed = f"process_vm_readv is unavailable: {exc}"
    return _probed or None


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


def _strerror(err: int) -> str:
    return f"{errno_module.errorcode.get(err, str(err))} ({os.strerror(err)})" if err else "short read"


# -- reading ---------------------------------------------------------------------


def runs(local: Sequence[int], remote: Sequence[int], nbytes: Sequence[int]) -> torch.Tensor:
    """An ``(n, 3)`` int64 table of (local address, remote address, bytes), dropping empty runs."""
    table = torch.tensor([list(local), list(remote), list(nbytes)], dtype=torch.int64, device="cpu").t()
    return table[table[:, 2] > 0] if table.numel() else table.reshape(0, 3)


def _segments(addr: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
    """``(addr, nbytes)`` runs as an ``(m, 2)`` iovec table, runs that continue one another merged."""
    if addr.shape[0] > 1:
        starts = addr[1:] != addr[:-1] + nbytes[:-1]
        # Small tables are the common case, and each tensor op costs microseconds: merge only when some run
        # continues the one before.
        if not bool(starts.all()):
            starts = torch.cat([torch.ones(1, dtype=torch.bool, device="cpu"), starts])
            which = starts.cumsum(0) - 1
            lengths = torch.zeros(int(which[-1]) + 1, dtype=torch.int64, device="cpu").index_add_(0, which, nbytes)
            return torch.stack([addr[starts], lengths], dim=1)
    return torch.stack([addr, nbytes], dim=1)


def _window(segs: torch.Tensor, ends: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """The iovecs of ``segs`` (cumulative byte ``ends``) that cover stream bytes ``[begin, end)``, trimmed to them."""
    first = int(torch.searchsorted(ends, begin, right=True))
    last = int(torch.searchsorted(ends, end, right=False))
    out = segs[first : last + 1].clone()
    skip = begin - (int(ends[first - 1]) if first else 0)
    out[0, 0] += skip
    out[0, 1] -= skip
    out[-1, 1] -= int(ends[last]) - end
    return out


def _read_runs(pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` from process ``pid``'s memory into ours; 0, or the errno of the failed read.

    ``runs`` holds ``(local address, remote address, bytes)`` rows (see :func:`_stream`).
    """
    return _stream(_load(), pid, runs)


def _write_runs(pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` from our memory into process ``pid``'s; 0, or the errno of the failed write.

    ``runs`` holds ``(local address, remote address, bytes)`` rows: the local side is the source here.
    """
    return _stream(_load_writev(), pid, runs)


def _stream(fn: Callable[..., int], pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` between this process and ``pid`` with ``fn`` (readv or writev); 0, or an errno.

    Runs that continue one another on one side become one iovec there
    (the other side may stay split): the kernel pins remote memory iovec by
    iovec, and a box whose rows are back to back in the peer's shard but
    strided in ours (or the reverse) reads about twice as fast so. Both
    sides are one stream of bytes, cut into calls of at most ``_IOV_MAX``
    iovecs a side; a partial read resumes at the first byte not read.
    """
    total = int(runs[:, 2].sum()) if runs.shape[0] else 0
    if total == 0:
        return 0
    local, remote = _segments(runs[:, 0], runs[:, 2]), _segments(runs[:, 1], runs[:, 2])
    done = 0
    if local.shape[0] <= _IOV_MAX and remote.shape[0] <= _IOV_MAX:
        # Both sides fit one call (the common case): no windows to cut. A partial copy resumes below.
        done = fn(pid, local.data_ptr(), local.shape[0], remote.data_ptr(), remote.shape[0], 0)
        if done <= 0:
            return (ctypes.get_errno() or errno_module.EIO) if done < 0 else errno_module.EFAULT
        if done == total:
            return 0
    local_ends, remote_ends = local[:, 1].cumsum(0), remote[:, 1].cumsum(0)
    while done < total:
        # The call stops where either side runs out of iovecs.
        first_l = int(torch.searchsorted(local_ends, done, right=True))
        first_r = int(torch.searchsorted(remote_ends, done, right=True))
        end = min(
            int(local_ends[min(first_l + _IOV_MAX, local.shape[0]) - 1]),
            int(remote_ends[min(first_r + _IOV_MAX, remote.shape[0]) - 1]),
        )
        lv, rv = _window(local, local_ends, done, end), _window(remote, remote_ends, done, end)
        got = fn(pid, lv.data_ptr(), lv.shape[0], rv.data_ptr(), rv.shape[0], 0)
        if got < 0:
            return ctypes.get_errno() or errno_module.EIO
        if got == 0:
            return errno_module.EFAULT
        done += got
    return 0


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
    reason = probe() if enabled() else f"{LOCAL_COPY_ENV}=0"
    scope = ptracer.yama_scope()
    chain = ptracer.ancestry() if reason is None and scope == 1 else []
    token = torch.tensor([os.getpid(), group.rank, _TOKEN], dtype=torch.int64, device="cpu")
    padded = chain + [0] * (ptracer.ANCESTRY_DEPTH - len(chain))
    rows = all_gather_ints(group, [reason is None, os.getpid(), token.data_ptr(), scope, *padded])
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
    err = _read_runs(rows[peer][1], runs([got.data_ptr()], [rows[peer][2]], [24]))
    if err == 0 and got.tolist() != [rows[peer][1], peer, _TOKEN]:
        err = errno_module.EIO
    return err, (f"reading rank {peer}'s memory failed: {_strerror(err)}" if err else None)


def _yama_may_allow(rows: Sequence[Sequence[int]], verdicts: Sequence[Sequence[int]]) -> bool:
    """Whether Yama's ptrace_scope 1 alone refused the reads, which a declared tracer lifts (same on every rank)."""
    errors = [v[1] for v in verdicts]
    return (
        all(row[0] and row[3] == 1 for row in rows)
        and all(e in (0, errno_module.EPERM) for e in errors)
        and errno_module.EPERM in errors
    )


def _with_declared_tracer(group: Group, rows: Sequence[Sequence[int]], chain: list[int]) -> tuple[bool, Optional[str]]:
    """Collective: every rank declares the ranks' nearest common ancestor its tracer, then the reads are tried again.

    Returns:
        Whether every rank now reads its peer, and this rank's reason if not.
        A declaration that did not help is taken back.
    """
    ancestor = ptracer.nearest_common_ancestor([row[4:] for row in rows])
    previous = ptracer.declared()
    if ancestor is None:
        why: Optional[str] = "Yama's ptrace_scope is 1 and the ranks share no ancestor process but init"
    else:
        why = ptracer.declare(ancestor, chain)
    declared = all_gather_ints(group, [why is None])  # also: nobody reads before every rank has declared
    if not all(row[0] for row in declared):
        ptracer.undeclare(previous)
        return False, why or "a peer could not declare its tracer"
    _, why = _read_token(group, rows)
    ok = all(row[0] for row in all_gather_ints(group, [why is None]))
    if not ok:
        ptracer.undeclare(previous)
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
        where = ", ".join(f"rank {r}: {_strerror(e)}" for r, e in failed)
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
                err = err or (_write_runs if copy.write else _read_runs)(copy.pid, copy.runs)
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
