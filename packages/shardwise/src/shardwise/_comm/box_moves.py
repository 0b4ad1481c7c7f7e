"""A layout change between ranks on one host: each box copied once, by whichever of its two ends has the time.

Why: a layout change (``reshard``, ``shard_tensor``, ``gather``) whose ranks
share a host moves every box that changes rank with one cross-memory-attach
copy (:mod:`shardwise._comm.local_copy`), straight from the sender's source
shard into the receiver's target shard. Either end can make that copy: the
receiver reads the sender's memory (``process_vm_readv``), or the sender
writes the receiver's (``process_vm_writev``). If receivers only read, a
scatter's root copies its own piece and then idles while the others read
theirs, and a gather's root makes every copy while the others wait. So each
box is cut between its two ends along dim 0: the sender writes its first rows,
the receiver reads the rest, in proportions that even out the ranks' work.

The cost model, in bytes of a local ``memcpy``: the kernel pins the remote
pages of a copy iovec by iovec and page by page, so

* a byte costs what the ranks have measured (:mod:`shardwise._comm.copy_rates`:
  every rank times its large copies by kind and publishes its readings in
  the call's first all-gather) when the remote memory is a huge-page buffer
  of shardwise's own cache (:func:`shardwise._comm.buffers.on_huge_pages`,
  1 until measured) and when it is in 4 KiB pages (a user's tensor;
  :data:`SMALL_PAGE_COST` until measured: 1.4-1.8 was measured on one
  2-core machine, and the best fixed cut on another implied 2.2);
* each remote iovec costs :data:`IOVEC_COST` more (runs that continue one
  another on a side are one iovec there), so a box whose rows are strided in
  the source and back to back in the target is cheaper written than read.

The rule, computed alike by both ends of a box from what every rank
publishes in the call's one all-gather (so that they agree without a message
about the box itself, and without a round of their own):

* each box is first given to the end whose far side takes fewer iovecs (its
  receiver on a tie; :func:`read_by_default`);
* every rank publishes its share of the work, by kind and by far-side shard
  (:func:`shares`), beside its shards' page sizes and its copy readings, so
  every rank can price every rank's work alike (:func:`loads`);
* when a box's default end has more work than the other end (local copies
  included), a fraction ``(W_busy - W_other) / (shed_busy + take_other)`` of
  the box's rows moves to the other end (:func:`pushed_rows`), where ``shed``
  is what the busy end's boxes of that kind cost it and ``take`` what they
  would cost the other ends. Between two ranks that evens their work; for a
  star (a scatter's root, a gather's root) it does so for any number of
  ranks; an even reshard keeps the default.

Protocol: the call's first all-gather (:func:`shardwise._comm.local_copy.transfer`)
carries every rank's shard addresses, page sizes and shares; then each rank
copies its local pieces, reads and writes its share, and the closing
all-gather (errors and barrier) ends the call: two rounds, as a plain read
takes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Optional, Sequence

import torch

from shardwise._comm import buffers, copy_rates, local_copy

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = [
    "IOVEC_COST",
    "MIN_RUN_BYTES",
    "SMALL_PAGE_COST",
    "BoxMove",
    "box_runs",
    "Loads",
    "loads",
    "move_boxes",
    "pushed_rows",
    "read_by_default",
    "remote_runs",
    "run_bytes",
    "shares",
]

#: A layout change whose contiguous runs average fewer bytes than this declines (one iovec per run costs more).
MIN_RUN_BYTES = 256
#: Relative cost of a byte copied from or into a peer's 4 KiB pages (1: a local copy) until the ranks have timed some.
SMALL_PAGE_COST = 2
#: Cost of each iovec on the remote side, in bytes of a local copy: the kernel pins a remote iovec's pages on
#: its own (about 0.8 us each on the development machine, the time to copy 8 KiB).
IOVEC_COST = 8 << 10


@dataclass(frozen=True)
class BoxMove:
    """One box that moves from a source shard on one rank to a target shard on another.

    Both ends describe it alike (from their plans), and both compute the
    same cut of it (:func:`pushed_rows`).

    Attributes:
        src_rank: Group rank holding the source shard.
        dst_rank: Group rank holding the target shard.
        src: Index of the source shard (into the published source addresses).
        src_shape: Shape of that source shard (contiguous, row-major).
        src_start: Start of the box inside the source shard.
        dst: Index of the target shard (into the published target addresses).
        dst_shape: Shape of that target shard (contiguous, row-major).
        dst_start: Start of the box inside the target shard.
        sizes: Size of the box.
    """

    src_rank: int
    dst_rank: int
    src: int
    src_shape: tuple[int, ...]
    src_start: tuple[int, ...]
    dst: int
    dst_shape: tuple[int, ...]
    dst_start: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def rows(self, begin: int, end: int) -> BoxMove:
        """The part of the box made of its dim-0 rows ``[begin, end)``."""
        return BoxMove(
            self.src_rank,
            self.dst_rank,
            self.src,
            self.src_shape,
            (self.src_start[0] + begin, *self.src_start[1:]),
            self.dst,
            self.dst_shape,
            (self.dst_start[0] + begin, *self.dst_start[1:]),
            (end - begin, *self.sizes[1:]),
        )


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


#: Boxes of at most this many runs list them in plain integers (:func:`box_runs`).
_FEW_RUNS = 16


def _few_run_starts(shape: Sequence[int], start: Sequence[int], sizes: Sequence[int], k: int) -> list[int]:
    """:func:`_run_starts` in plain integers, for a box of a few runs."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    offsets = [sum(start[d] * strides[d] for d in range(k, len(shape)))]
    for d in range(k):
        offsets = [o + (start[d] + i) * strides[d] for o in offsets for i in range(sizes[d])]
    return offsets


def run_bytes(shape: Sequence[int], target_shape: Sequence[int], sizes: Sequence[int], item: int) -> int:
    """Bytes of each contiguous run when a box of ``sizes`` is copied from ``shape`` into ``target_shape``."""
    k = max(_run_dim(shape, sizes), _run_dim(target_shape, sizes))
    return math.prod(sizes[k:]) * item


def box_runs(box: BoxMove, item: int, src_base: int, dst_base: int) -> torch.Tensor:
    """The ``(target address, source address, bytes)`` runs that copy ``box`` between shards at those bases."""
    if not box.sizes or box.numel == 0:
        return torch.zeros(0, 3, dtype=torch.int64, device="cpu")
    k = max(_run_dim(box.src_shape, box.sizes), _run_dim(box.dst_shape, box.sizes))
    run = math.prod(box.sizes[k:]) * item
    if math.prod(box.sizes[:k]) <= _FEW_RUNS:
        # A scatter's or gather's box is one run: plain integers and one tensor, not a dozen tensor ops
        # (0.1-0.2 ms while the peers' copies fill the memory bus).
        pairs = zip(
            _few_run_starts(box.dst_shape, box.dst_start, box.sizes, k),
            _few_run_starts(box.src_shape, box.src_start, box.sizes, k),
            strict=True,
        )
        rows = [[dst_at * item + dst_base, src_at * item + src_base, run] for dst_at, src_at in pairs]
        return torch.tensor(rows, dtype=torch.int64, device="cpu")
    src = _run_starts(box.src_shape, box.src_start, box.sizes, k) * item + src_base
    dst = _run_starts(box.dst_shape, box.dst_start, box.sizes, k) * item + dst_base
    return torch.stack([dst, src, torch.full_like(dst, run)], dim=1)


def remote_runs(box: BoxMove, pushed: bool) -> int:
    """How many iovecs the remote side of ``box`` takes: its source's when read, its target's when written.

    Runs that continue one another on a side merge into one iovec there
    (:func:`shardwise._comm.cross_memory._stream`), so a side's count is the
    number of its row-major stretches the box covers.
    """
    shape = box.dst_shape if pushed else box.src_shape
    return math.prod(box.sizes[: _run_dim(shape, box.sizes)]) if box.sizes else 0


def read_by_default(box: BoxMove) -> bool:
    """Whether ``box`` is first given to its receiver (read), rather than its sender (written).

    The end whose far side takes fewer iovecs (a tie goes to the receiver).
    Page sizes do not enter: the ranks must agree on this before they know
    each other's memory.
    """
    return remote_runs(box, False) <= remote_runs(box, True)


#: Scalars at the head of a rank's published shares: its local copy bytes, then the far-side iovecs of each
#: kind of work (see :func:`shares`); then byte vectors by far-side shard.
_LOCAL, _IOV_READ_SHED, _IOV_READ_TAKE, _IOV_WRITE_SHED, _IOV_WRITE_TAKE = range(5)
_SCALARS = 5


def shares(boxes: Sequence[BoxMove], me: int, local_bytes: int, item: int, n_src: int, n_dst: int) -> list[int]:
    """What this rank publishes about its work, before anyone knows the others' memory (:func:`loads` prices it).

    Four kinds of work, by the box's default end (:func:`read_by_default`):
    reads this rank does by default (it could hand them over: *read shed*),
    writes its receivers would hand it (*read take*), writes it does by
    default (*write shed*), reads its senders would hand it (*write take*).
    Each is published as its far-side iovecs and its bytes by the far-side
    shard (a source shard for reads, a target shard for writes), whose page
    size its owner publishes beside.

    Returns:
        ``[local, 4 iovec counts, read shed and write take bytes by source
        shard, read take and write shed bytes by target shard]``.
    """
    head = [local_bytes, 0, 0, 0, 0]
    read_shed, write_take = [0] * n_src, [0] * n_src
    read_take, write_shed = [0] * n_dst, [0] * n_dst
    # By (read by default, this rank is the sender): where the box's iovecs and bytes count. This rank would
    # copy the box by writing exactly when it is the sender, so its far side is then the target shard.
    kinds = {
        (True, False): (_IOV_READ_SHED, read_shed),
        (True, True): (_IOV_READ_TAKE, read_take),
        (False, True): (_IOV_WRITE_SHED, write_shed),
        (False, False): (_IOV_WRITE_TAKE, write_take),
    }
    for b in boxes:
        sender = b.src_rank == me
        slot, by_shard = kinds[(read_by_default(b), sender)]
        head[slot] += remote_runs(b, pushed=sender)
        by_shard[b.dst if sender else b.src] += b.numel * item
    return head + read_shed + write_take + read_take + write_shed


class Loads(NamedTuple):
    """One rank's work priced (in 1/``copy_rates.SCALE`` bytes of a local copy), from its :func:`shares` and page sizes.

    Attributes:
        work: Local copies plus every box it copies by default.
        read_shed: The reads it does by default.
        read_take: The writes its receivers would hand it.
        write_shed: The writes it does by default.
        write_take: The reads its senders would hand it.
    """

    work: int
    read_shed: int
    read_take: int
    write_shed: int
    write_take: int


def loads(
    rows: Sequence[Sequence[int]],
    src_huge: Sequence[int],
    dst_huge: Sequence[int],
    prices: Optional[tuple[int, int]] = None,
) -> list[Loads]:
    """Every rank's :class:`Loads` from the published :func:`shares` (one row per rank) and page sizes.

    Plain integers: the table is a few dozen numbers a rank, where each
    tensor op would cost more than the whole sum (this runs inside every
    one-copy call, on every rank).

    Args:
        rows: One row per rank, as :func:`shares` returns it.
        src_huge: Whether each source shard is on huge pages (0/1, by shard index).
        dst_huge: The same for each target shard.
        prices: A far-side byte's price in 4 KiB pages and in huge pages, in
            1/:data:`~shardwise._comm.copy_rates.SCALE` of a local byte
            (:func:`shardwise._comm.copy_rates.prices`); None: the defaults,
            :data:`SMALL_PAGE_COST` and 1. The loads come out in the same unit.
    """
    scale = copy_rates.SCALE
    small, huge_price = prices if prices is not None else (SMALL_PAGE_COST * scale, scale)
    n_src, n_dst = len(src_huge), len(dst_huge)
    src_price = [huge_price if huge else small for huge in src_huge]
    dst_price = [huge_price if huge else small for huge in dst_huge]
    iovec = IOVEC_COST * scale

    def priced(row: Sequence[int], at: int, price: Sequence[int], iov: int) -> int:
        return sum(n * p for n, p in zip(row[at : at + len(price)], price, strict=True)) + row[iov] * iovec

    table = []
    for row in rows:
        at = _SCALARS
        read_shed = priced(row, at, src_price, _IOV_READ_SHED)
        write_take = priced(row, at + n_src, src_price, _IOV_WRITE_TAKE)
        read_take = priced(row, at + 2 * n_src, dst_price, _IOV_READ_TAKE)
        write_shed = priced(row, at + 2 * n_src + n_dst, dst_price, _IOV_WRITE_SHED)
        table.append(Loads(row[_LOCAL] * scale + read_shed + write_shed, read_shed, read_take, write_shed, write_take))
    return table


def pushed_rows(box: BoxMove, everyone: Sequence[Loads]) -> int:
    """How many of ``box``'s first dim-0 rows its sender writes (its receiver reads the rest).

    Both ends compute it alike, in integers, from the box and every rank's
    :func:`loads`: the box's default end hands the other a share of its rows
    when it has more work, the share that would even the two.
    """
    if not box.sizes:
        return 0
    s, r = everyone[box.src_rank], everyone[box.dst_rank]
    n = box.sizes[0]
    if read_by_default(box):
        return _share(n, r.work - s.work, r.read_shed + s.read_take)
    return n - _share(n, s.work - r.work, s.write_shed + r.write_take)


def _share(n: int, spare: int, room: int) -> int:
    """``n`` times ``spare / room`` clamped to ``[0, n]``, rounded to the nearest integer."""
    if spare <= 0 or room <= 0:
        return 0
    return min(n, (n * spare * 2 + room) // (2 * room))


def move_boxes(
    group: Group,
    ok: bool,
    sources: Mapping[int, torch.Tensor],
    targets: Mapping[int, torch.Tensor],
    shard_counts: tuple[int, int],
    boxes: Sequence[BoxMove],
    item: int,
    local: tuple[int, int],
    meanwhile: Callable[[], None],
) -> bool:
    """Collective: every box of ``boxes`` copied once, read by its receiver or written by its sender; False to decline.

    Args:
        group: The group (every rank on this host; else every rank declines).
        ok: This rank's verdict: its sources and targets are contiguous CPU
            memory of one dtype, and its runs are not too small.
        sources: This rank's source shards that peers read from, by index.
        targets: This rank's target shards that peers write into, by index.
        shard_counts: Number of source and of target shards in all (the
            length of the published address tables).
        boxes: This rank's incoming and outgoing boxes (``dst_rank`` or
            ``src_rank`` is this rank).
        item: Bytes per element of every shard.
        local: Bytes this rank copies locally (its pieces that stay), and
            the contiguous runs they make (the copies are timed for
            :mod:`~shardwise._comm.copy_rates` when the runs are long).
        meanwhile: This rank's local copies: run once every rank has agreed,
            while the peers copy (never when the ranks decline).

    Returns:
        Whether the boxes moved (the same on every rank).

    Raises:
        PeerLostError: on every rank, when a copy failed on any.
    """
    n_src, n_dst = shard_counts
    me = group.rank
    local_bytes, local_runs = local
    fields = [0] * (2 * (n_src + n_dst))
    for j, t in sources.items():
        fields[j], fields[n_src + n_dst + j] = t.data_ptr(), int(buffers.on_huge_pages(t))
    for j, t in targets.items():
        fields[n_src + j], fields[2 * n_src + n_dst + j] = t.data_ptr(), int(buffers.on_huge_pages(t))
    # The shares and the copy rates ride on the call's first all-gather: one round fewer, which gloo's
    # latency makes worth it.
    fields += shares(boxes, me, local_bytes, item, n_src, n_dst)
    fields += copy_rates.published()
    n_shares = len(fields) - 2 * (n_src + n_dst) - copy_rates.KINDS

    def copies(rows: list[list[int]]) -> list[local_copy.Copy]:
        # Each rank filled only its own shards' entries (zeros elsewhere): a column's sum is its owner's value.
        table = [row[2:] for row in rows]
        summed = [sum(column) for column in zip(*(row[: 2 * (n_src + n_dst)] for row in table), strict=True)]
        addr_src, addr_dst = summed[:n_src], summed[n_src : n_src + n_dst]
        huge = summed[n_src + n_dst :]
        at = 2 * (n_src + n_dst)
        priced = copy_rates.prices([row[at + n_shares :] for row in table], SMALL_PAGE_COST)
        everyone = loads([row[at : at + n_shares] for row in table], huge[:n_src], huge[n_src:], priced)
        # By (peer, write, far side on huge pages): the runs, their bytes, and how many there are. Listed
        # before the local copies: after a copy of tens of MiB the caches are cold, and the same Python
        # takes four times as long (0.2 ms on a scatter's root).
        per_peer: dict[tuple[int, bool, bool], tuple[list[torch.Tensor], list[int]]] = {}
        for b in boxes:
            cut = pushed_rows(b, everyone)
            incoming = b.dst_rank == me
            part = b.rows(cut, b.sizes[0]) if incoming else b.rows(0, cut)
            if not part.numel:
                continue
            runs = box_runs(part, item, addr_src[b.src], addr_dst[b.dst])
            far_huge = bool(huge[b.src] if incoming else huge[n_src + b.dst])
            peer = b.src_rank if incoming else b.dst_rank
            parts, counts = per_peer.setdefault((peer, not incoming, far_huge), ([], [0, 0]))
            # Rows are (local, remote, bytes): a write's local side is the source.
            parts.append(runs if incoming else runs[:, [1, 0, 2]])
            counts[0] += part.numel * item
            counts[1] += remote_runs(part, not incoming)
        listed = [
            local_copy.Copy(
                rows[peer][1],
                parts[0] if len(parts) == 1 else torch.cat(parts),
                write,
                _observed(copy_rates.FAR_HUGE if far_huge else copy_rates.FAR_SMALL, *counts),
            )
            for (peer, write, far_huge), (parts, counts) in per_peer.items()
        ]
        started = time.perf_counter()
        meanwhile()
        if local_runs and local_bytes // local_runs >= copy_rates.MIN_OBSERVED_BYTES:
            copy_rates.observe(copy_rates.LOCAL, local_bytes, time.perf_counter() - started)
        return listed

    return local_copy.transfer(group, "boxes", ok, fields, copies)


def _observed(kind: int, nbytes: int, iovecs: int) -> Optional[tuple[int, int]]:
    """``(kind, nbytes)`` when a copy of ``nbytes`` in ``iovecs`` far-side runs is long enough to time, else None."""
    return (kind, nbytes) if iovecs and nbytes // iovecs >= copy_rates.MIN_OBSERVED_BYTES else None
