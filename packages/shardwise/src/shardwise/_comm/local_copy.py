"""One copy between ranks on one host: cross-memory attach (``process_vm_readv``).

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
across ranks so all take the same path), ``SHARDWISE_LOCAL_COPY`` is not
``0``, and on each call every rank's tensors are contiguous CPU memory (the
call's first all-gather carries each rank's verdict; any "no" sends every rank
down the backend's own path). Ranks on several hosts always keep the
backend's path. Collectives whose sizes every rank knows and that move less
than :data:`MIN_BYTES` keep it too (two small all-gathers cost more there).

Protocol of one call: one small all-gather of ``[ok, pid, addresses...]``;
each rank reads its pieces from its peers (iovec lists of up to ``IOV_MAX``
entries, partial reads resumed); then one all-gather of each rank's error
number, which is also the barrier that keeps a sender from reusing its buffer
before every peer has read it: a failed read (a peer gone: ``ESRCH``) raises
:class:`~shardwise.errors.PeerLostError` on every rank. Which path a call took
is logged at DEBUG on ``shardwise.local_copy``; :data:`stats` counts the
calls moved here (tests read it).
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import hashlib
import logging
import math
import os
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch

from shardwise._comm.hosts import this_host
from shardwise._vocab.switches import switched_on
from shardwise.errors import PeerLostError

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = [
    "LOCAL_COPY_ENV",
    "MIN_BYTES",
    "MIN_RUN_BYTES",
    "BoxRead",
    "all_gather",
    "all_to_all",
    "box_runs",
    "enabled",
    "gather",
    "probe",
    "read_boxes",
    "run_bytes",
    "scatter",
    "stats",
]

LOCAL_COPY_ENV = "SHARDWISE_LOCAL_COPY"
#: Collectives of known size below this many bytes in all keep the backend's path.
MIN_BYTES = 64 * 1024
#: Most iovecs one ``process_vm_readv`` takes (Linux's ``UIO_MAXIOV``).
_IOV_MAX = 1024
#: A box read whose contiguous runs average fewer bytes than this declines (one iovec per run costs more).
MIN_RUN_BYTES = 256

_log = logging.getLogger("shardwise.comm")

#: Calls moved by cross-memory attach in this process, by collective name.
stats: dict[str, int] = {}


class _State:
    """What this process knows about one group: the agreed verdict, and whether a local copy is under way."""

    __slots__ = ("busy", "exchange", "verdict")

    def __init__(self) -> None:
        self.verdict: Optional[bool] = None
        # The backend's own all-gather of equal int64 rows (``out``, ``inp``); None: ``Group._all_gather``.
        self.exchange: Optional[Exchange] = None
        # Set while this module runs collectives of its own on the group (the
        # verdict's setup, a call's all-gathers): nested primitives take the
        # backend's path. Every rank nests the same way, so all agree.
        self.busy = False


#: A backend's all-gather of one equal-length int64 row per rank: ``exchange(out, inp)``.
Exchange = Callable[[torch.Tensor, torch.Tensor], None]

_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_readv: Optional[Callable[..., int]] = None
#: The probe's answer: None before it ran, "" when the syscall works, else why not.
_probed: Optional[str] = None


def enabled() -> bool:
    """Whether ``SHARDWISE_LOCAL_COPY`` allows cross-memory attach (read on every call)."""
    return switched_on(LOCAL_COPY_ENV)


def _load() -> Callable[..., int]:
    """libc's ``process_vm_readv``, loaded on first use (no import-time side effects)."""
    global _readv
    if _readv is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        _readv = fn
    return _readv


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
                err = _read_runs(os.getpid(), _runs([dst.data_ptr()], [src.data_ptr()], [32]))
                ok = err == 0 and torch.equal(src, dst)
                _probed = "" if ok else f"process_vm_readv failed: {_strerror(err)}"
            except (OSError, AttributeError) as exc:  # no libc, or a libc without the symbol
                _probed = f"process_vm_readv is unavailable: {exc}"
    return _probed or None


def _strerror(err: int) -> str:
    return f"{errno_module.errorcode.get(err, str(err))} ({os.strerror(err)})" if err else "short read"


# -- reading ---------------------------------------------------------------------


def _runs(local: Sequence[int], remote: Sequence[int], nbytes: Sequence[int]) -> torch.Tensor:
    """An ``(n, 3)`` int64 table of (local address, remote address, bytes), dropping empty runs."""
    table = torch.tensor([list(local), list(remote), list(nbytes)], dtype=torch.int64, device="cpu").t()
    return table[table[:, 2] > 0] if table.numel() else table.reshape(0, 3)


def _read_runs(pid: int, runs: torch.Tensor) -> int:
    """Copy every run of ``runs`` from process ``pid``; 0, or the errno of the failed read."""
    fn = _load()
    pos, n = 0, runs.shape[0]
    while pos < n:
        batch = runs[pos : pos + _IOV_MAX]
        local = torch.stack([batch[:, 0], batch[:, 2]], dim=1).contiguous()
        remote = torch.stack([batch[:, 1], batch[:, 2]], dim=1).contiguous()
        want = int(batch[:, 2].sum())
        got = fn(pid, local.data_ptr(), batch.shape[0], remote.data_ptr(), batch.shape[0], 0)
        if got < 0:
            return ctypes.get_errno() or errno_module.EIO
        if got < want:
            if got == 0:
                return errno_module.EFAULT
            # A partial read stops between or inside runs: resume from the first byte not read.
            ends = batch[:, 2].cumsum(0)
            k = int(torch.searchsorted(ends, torch.tensor(got, device="cpu"), right=True))
            done = got - (int(ends[k - 1]) if k else 0)
            rest = runs[pos + k :].clone()
            rest[0, 0] += done
            rest[0, 1] += done
            rest[0, 2] -= done
            runs, pos, n = rest, 0, rest.shape[0]
            continue
        pos += _IOV_MAX
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


def _all_gather_ints(group: Group, row: Sequence[int]) -> list[list[int]]:
    """Every rank's ``row`` (all the same length), through the backend's own all-gather."""
    mine = torch.tensor(list(row), dtype=torch.int64, device="cpu")
    out = torch.empty(len(row) * group.size, dtype=torch.int64, device="cpu")
    exchange = _state(group).exchange
    if exchange is not None:
        exchange(out, mine)
    else:
        group._all_gather(out, mine, [len(row)] * group.size)
    return out.view(group.size, len(row)).tolist()


def _usable(group: Group, exchange: Optional[Exchange]) -> Optional[_State]:
    """The group's state when cross-memory attach may be tried now (same on every rank), else None."""
    if not getattr(group, "_local_copy", False) or group.size < 2:
        return None
    state = _state(group)
    if state.busy:
        return None
    if exchange is not None:
        state.exchange = exchange
    if state.verdict is None:
        state.busy = True
        try:
            state.verdict = _agree_verdict(group)
        finally:
            state.busy = False
    return state if state.verdict else None


def _host_key() -> int:
    """This process's host (name and boot id, as :meth:`Group.hosts` compares them) as one int64."""
    digest = hashlib.blake2b("\0".join(this_host()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _agree_verdict(group: Group) -> bool:
    """Collective: whether every rank can read every peer (all on this host, kernel allows it, switch on).

    Only the backend's primitives run here (no public collective: this runs
    inside one, possibly on the group's worker thread).
    """
    hosts = group._hosts
    if hosts is not None:
        one_host = len(hosts) == 1
    else:
        one_host = len({row[0] for row in _all_gather_ints(group, [_host_key()])}) == 1
    if not one_host:
        _log.debug("%r: ranks on several hosts, keeping the backend's path", group)
        return False
    reason = probe() if enabled() else f"{LOCAL_COPY_ENV}=0"
    token = torch.tensor([os.getpid(), group.rank, 0x5A5A5A5A], dtype=torch.int64, device="cpu")
    rows = _all_gather_ints(group, [reason is None, os.getpid(), token.data_ptr()])
    err = 0
    if all(row[0] for row in rows):
        # Read the next rank's token: proves the kernel lets this process read a peer's memory.
        peer = (group.rank + 1) % group.size
        got = torch.zeros(3, dtype=torch.int64, device="cpu")
        err = _read_runs(rows[peer][1], _runs([got.data_ptr()], [rows[peer][2]], [24]))
        if err == 0 and got.tolist() != [rows[peer][1], peer, 0x5A5A5A5A]:
            err = errno_module.EIO
        if err:
            reason = f"reading rank {peer}'s memory failed: {_strerror(err)}"
    verdicts = _all_gather_ints(group, [reason is None and all(row[0] for row in rows)])
    del token
    ok = all(v[0] for v in verdicts)
    _log.debug(
        "%r: cross-memory attach %s%s",
        group,
        "in use" if ok else "not used",
        f" (this rank: {reason})" if reason else "",
    )
    return ok


def _finish(group: Group, name: str, err: int) -> None:
    """Collective end of a call: every rank has read (so buffers may be reused); raise everywhere if one failed."""
    errors = [row[0] for row in _all_gather_ints(group, [err])]
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        where = ", ".join(f"rank {r}: {_strerror(e)}" for r, e in failed)
        raise PeerLostError(
            f"rank {group.rank} of {group.size}: {name} by cross-memory attach failed ({where}). A peer "
            "has probably died; the group cannot be used any more. If the kernel refuses the reads, set "
            f"{LOCAL_COPY_ENV}=0 to use the backend's own transport."
        )
    stats[name] = stats.get(name, 0) + 1
    _log.debug("%r: %s moved by cross-memory attach", group, name)


def _plain(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether every tensor is contiguous, dense CPU memory (None counts as fine)."""
    return all(
        t is None or (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()) for t in tensors
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _start(group: Group, name: str, ok: bool, fields: Sequence[int]) -> Optional[list[list[int]]]:
    """The call's first all-gather of ``[ok, pid, *fields]``; None (every rank) unless every rank is ok."""
    rows = _all_gather_ints(group, [int(ok and enabled()), os.getpid(), *fields])
    if all(row[0] for row in rows):
        return rows
    _log.debug("%r: %s keeps the backend's path (a rank declined)", group, name)
    return None


def _move(
    group: Group,
    name: str,
    ok: bool,
    fields: Sequence[int],
    reads: Callable[[list[list[int]]], list[tuple[int, torch.Tensor]]],
    exchange: Optional[Exchange],
) -> bool:
    """Run one call: agree, let ``reads`` list (pid, runs) per peer from the gathered rows, read, finish."""
    state = _usable(group, exchange)
    if state is None:
        return False
    state.busy = True
    try:
        rows = _start(group, name, ok, fields)
        if rows is None:
            return False
        err = 0
        for pid, runs in reads(rows):
            err = err or _read_runs(pid, runs)
        _finish(group, name, err)
        return True
    finally:
        state.busy = False


def _addr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None and t.numel() else 0


def _offsets(counts: Sequence[int], item: int) -> list[int]:
    return [sum(counts[:r]) * item for r in range(len(counts))]


def all_to_all(
    group: Group,
    out: torch.Tensor,
    out_counts: Sequence[int],
    inp: torch.Tensor,
    in_counts: Sequence[int],
    *,
    exchange: Optional[Exchange] = None,
) -> bool:
    """``Group._all_to_all`` by cross-memory attach; False (on every rank) to take the backend's path.

    ``exchange``: the backend's own all-gather of equal int64 rows (``exchange(out, inp)``) for
    the few integers the ranks swap (default: ``group._all_gather``); the same for every function here.
    """
    item = inp.element_size()
    ok = _plain(out, inp) and out.dtype == inp.dtype and not _overlap(out, inp)
    send_at = _offsets(in_counts, item)
    recv_at = _offsets(out_counts, item)

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        me = group.rank
        own = out.view(-1)[recv_at[me] // item : recv_at[me] // item + out_counts[me]]
        own.copy_(inp.view(-1)[send_at[me] // item : send_at[me] // item + in_counts[me]])
        base = _addr(out)
        return [
            (rows[s][1], _runs([base + recv_at[s]], [rows[s][2] + rows[s][3 + me]], [out_counts[s] * item]))
            for s in range(group.size)
            if s != me and out_counts[s]
        ]

    return _move(group, "all_to_all", ok, [_addr(inp), *send_at], reads, exchange)


def scatter(
    group: Group,
    out: torch.Tensor,
    inp: Optional[torch.Tensor],
    counts: Sequence[int],
    src: int,
    *,
    exchange: Optional[Exchange] = None,
) -> bool:
    """``Group._scatter`` by cross-memory attach; False (on every rank) to take the backend's path."""
    item = out.element_size()
    if sum(counts) * item < MIN_BYTES:
        return False
    at = _offsets(counts, item)
    ok = _plain(out, inp) and (inp is None or (inp.dtype == out.dtype and not _overlap(out, inp)))

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        me = group.rank
        if me == src:
            assert inp is not None
            out.view(-1).copy_(inp.view(-1)[at[me] // item : at[me] // item + counts[me]])
            return []
        return [(rows[src][1], _runs([_addr(out)], [rows[src][2] + at[me]], [counts[me] * item]))]

    return _move(group, "scatter", ok, [_addr(inp)], reads, exchange)


def gather(
    group: Group,
    out: Optional[torch.Tensor],
    counts: Sequence[int],
    inp: torch.Tensor,
    dst: int,
    *,
    exchange: Optional[Exchange] = None,
) -> bool:
    """``Group._gather`` by cross-memory attach; False (on every rank) to take the backend's path."""
    item = inp.element_size()
    if sum(counts) * item < MIN_BYTES:
        return False
    at = _offsets(counts, item)
    ok = _plain(out, inp) and (out is None or (inp.dtype == out.dtype and not _overlap(out, inp)))

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        if group.rank != dst:
            return []
        assert out is not None
        out.view(-1)[at[dst] // item : at[dst] // item + counts[dst]].copy_(inp.view(-1))
        base = _addr(out)
        return [
            (rows[s][1], _runs([base + at[s]], [rows[s][2]], [counts[s] * item])) for s in range(group.size) if s != dst
        ]

    return _move(group, "gather", ok, [_addr(inp)], reads, exchange)


def all_gather(
    group: Group, out: torch.Tensor, inp: torch.Tensor, counts: Sequence[int], *, exchange: Optional[Exchange] = None
) -> bool:
    """``Group._all_gather`` by cross-memory attach; False (on every rank) to take the backend's path."""
    item = inp.element_size()
    if sum(counts) * item < MIN_BYTES:
        return False
    at = _offsets(counts, item)
    me = group.rank
    # ``inp`` may be this rank's slot of ``out`` already (FSDP-style); any other overlap declines.
    in_slot = inp.numel() > 0 and inp.data_ptr() == _addr(out) + at[me]
    ok = _plain(out, inp) and inp.dtype == out.dtype and (in_slot or not _overlap(out, inp))

    def reads(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        if not in_slot:
            out.view(-1)[at[me] // item : at[me] // item + counts[me]].copy_(inp.view(-1))
        base = _addr(out)
        return [
            (rows[s][1], _runs([base + at[s]], [rows[s][2]], [counts[s] * item])) for s in range(group.size) if s != me
        ]

    return _move(group, "all_gather", ok, [_addr(inp)], reads, exchange)


# -- boxes: a layout change straight from source shards into target shards ------------------------------


@dataclass(frozen=True)
class BoxRead:
    """One box this rank reads from a peer's source shard straight into its own target.

    Attributes:
        peer: Group rank holding the source shard.
        shard: Index of the source shard (into the addresses the peers publish).
        shape: Shape of that source shard (contiguous, row-major).
        start: Start of the box inside the source shard.
        sizes: Size of the box.
        target: This rank's target tensor (contiguous, same dtype as the source).
        target_start: Start of the box inside ``target``.
    """

    peer: int
    shard: int
    shape: tuple[int, ...]
    start: tuple[int, ...]
    sizes: tuple[int, ...]
    target: torch.Tensor
    target_start: tuple[int, ...]


def _run_dim(shape: Sequence[int], sizes: Sequence[int]) -> int:
    """First dim from which the box covers the rest of ``shape`` contiguously (its runs span dims ``k..``)."""
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    return k


def _run_starts(shape: Sequence[int], start: Sequence[int], sizes: Sequence[int], k: int) -> torch.Tensor:
    """Element offsets of the box's runs (each spanning dims ``k..``), in row-major order."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    offs = torch.tensor([sum(start[d] * strides[d] for d in range(k, len(shape)))], dtype=torch.int64, device="cpu")
    for d in range(k):
        offs = (
            offs[:, None] + (start[d] + torch.arange(sizes[d], dtype=torch.int64, device="cpu")) * strides[d]
        ).reshape(-1)
    return offs


def run_bytes(shape: Sequence[int], target_shape: Sequence[int], sizes: Sequence[int], item: int) -> int:
    """Bytes of each contiguous run when a box of ``sizes`` is read from ``shape`` into ``target_shape``."""
    k = max(_run_dim(shape, sizes), _run_dim(target_shape, sizes))
    return math.prod(sizes[k:]) * item


def box_runs(box: BoxRead, base: int) -> torch.Tensor:
    """The (local address, remote address, bytes) runs that copy ``box`` from a shard at ``base``."""
    item = box.target.element_size()
    tshape = tuple(box.target.shape)
    if not box.sizes or math.prod(box.sizes) == 0:
        return torch.zeros(0, 3, dtype=torch.int64, device="cpu")
    k = max(_run_dim(box.shape, box.sizes), _run_dim(tshape, box.sizes))
    run = math.prod(box.sizes[k:]) * item
    remote = _run_starts(box.shape, box.start, box.sizes, k) * item + base
    local = _run_starts(tshape, box.target_start, box.sizes, k) * item + box.target.data_ptr()
    return torch.stack([local, remote, torch.full_like(local, run)], dim=1)


def read_boxes(
    group: Group, ok: bool, published: Mapping[int, torch.Tensor], n_shards: int, reads: Callable[[], Sequence[BoxRead]]
) -> bool:
    """Collective: every rank reads its boxes straight from its peers' source shards; False to decline (every rank).

    Args:
        group: The group.
        ok: This rank's verdict: its published shards and targets are
            contiguous CPU memory of the wire dtype, and its runs are not too small.
        published: This rank's source shards that peers read, by index.
        n_shards: Number of source shards in all (the published table's length).
        reads: Called once every rank agreed: the boxes this rank reads
            (it may allocate targets then).
    """
    fields = [0] * n_shards
    for j, t in published.items():
        fields[j] = _addr(t)

    def runs(rows: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        per_peer: dict[int, list[torch.Tensor]] = {}
        for b in reads():
            per_peer.setdefault(b.peer, []).append(box_runs(b, rows[b.peer][2 + b.shard]))
        return [(rows[p][1], torch.cat(parts)) for p, parts in per_peer.items()]

    return _move(group, "boxes", ok, fields, runs, None)
