"""Requests out, answers back, in two rounds, between ranks on one host.

Why: a column-wise lookup is an all-gather of every rank's ids, local work,
and an all-to-all of the answers. Each of those collectives by one copy
(:mod:`shardwise._comm.local_collectives`) takes two rounds of the backend
(addresses, then "done"), and the lookup's agreement one more: five rounds,
where torch's ``_shard`` takes two. On gloo a round costs 0.3 to 7 ms
(benchmarks/gloo_rounds.py), more than the bytes. Here the addresses ride on
the caller's agreement, answers are written straight into the asker's
buffer (``process_vm_writev``), and one closing round tells every rank that
its buffer is complete and its request no longer read: two rounds in all.

Protocol:

1. Before its agreement, every rank makes a :class:`RoundTrip` with its
   request (a flat tensor the peers read) and its answer box (a flat tensor
   the peers write into; block ``s`` at ``sum(recv[:s])`` comes from rank
   ``s``) and puts :attr:`RoundTrip.fields` in what it agrees on.
2. After the agreement, :meth:`RoundTrip.bind` with every rank's fields:
   True on every rank when all can take this path, else False on every rank
   (the caller then uses its collectives).
3. :meth:`RoundTrip.gather`: every rank's request, read into one buffer.
4. :meth:`RoundTrip.answer`: this rank's block for each rank written into
   that rank's box, then the closing round; returns the box, differentiable
   with respect to the blocks (backward: an all-to-all the other way).

Between 2 and 4 the caller may run other collectives on the group. The
request and box stay referenced by the group until a closing round passes,
so a rank that raised in between leaves no peer writing into freed memory.
When a rank's own work raises after the caller's last collective before 4
(a pooling that runs out of memory), it calls :meth:`RoundTrip.abandon`
and re-raises: abandon runs the closing round with a code, so its peers
raise :class:`~shardwise.errors.PeerError` from :meth:`RoundTrip.answer`
instead of waiting for it there.
"""

from __future__ import annotations

import contextlib
import os
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Sequence, cast

import torch

from shardwise._comm import cross_memory, local_copy
from shardwise._comm.autograd_functions import _AllToAllSingle
from shardwise.errors import CollectiveMismatchError, PeerError, PeerLostError

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = ["RoundTrip", "pinned_count"]

# Fields: ok, pid, request address, request elements, request dtype, box address, box dtype, then recv.
_HEAD = 7
#: Closing-round code of a rank whose blocks did not fit the receivers' published counts or dtypes.
_MISMATCH = -1

# The buffers each communicator's peers may still read or write, kept until their closing round passes.
_pinned: weakref.WeakKeyDictionary[Any, list[tuple[torch.Tensor, torch.Tensor]]] = weakref.WeakKeyDictionary()


def _dtype_code(dtype: torch.dtype) -> int:
    """The same integer for a dtype in every process (``str(dtype)`` hashed)."""
    return zlib.crc32(str(dtype).encode())


class RoundTrip:
    """One rank's side of a request/answer exchange by cross-memory attach (see the module docstring).

    Args:
        group: The group; every rank makes its RoundTrip at the same point.
        request: This rank's request, flat (any length; the peers read it).
        box: This rank's answer buffer, flat; ``recv[s]`` elements from rank ``s``, in rank order.
        recv: Elements this rank expects from each rank.

    Example:
        >>> trip = RoundTrip(group, ids, box, recv)
        >>> rows = group.agree(lambda: trip.fields, op="lookup", gather=True)
        >>> if trip.bind(rows):
        ...     everyone = trip.gather(out)          # every rank's ids, rank order
        ...     result = trip.answer(blocks, sent)   # my box, filled by every rank
    """

    def __init__(self, group: Group, request: torch.Tensor, box: torch.Tensor, recv: Sequence[int]) -> None:
        self.group = group
        self.request, self.box, self.recv = request, box, list(recv)
        # Queued asynchronous collectives go first (one may be settling the verdict); then, on every
        # rank alike, the group's first use agrees on the verdict collectively.
        group._settle()
        usable = local_copy.usable(group)
        ok = (
            usable
            and local_copy.enabled()
            and len(self.recv) == group.size
            and local_copy.copyable(request)
            and local_copy.copyable(box)
            and sum(self.recv) == box.numel()
        )
        self.fields: list[int] = [0] * (_HEAD + group.size)
        if ok:
            self.fields = [
                1,
                os.getpid(),
                _addr(request),
                request.numel(),
                _dtype_code(request.dtype),
                _addr(box),
                _dtype_code(box.dtype),
                *self.recv,
            ]
        self._rows: list[list[int]] = []
        self._bound = False
        self._open = False  # bound, and its closing round not run yet
        self._err = 0

    def bind(self, rows: Sequence[Sequence[int]]) -> bool:
        """Take every rank's :attr:`fields` (from the caller's agreement); whether this path is taken.

        The same answer on every rank: True only when every rank offered it.
        """
        self._rows = [list(r) for r in rows]
        width = _HEAD + self.group.size
        if len(self._rows) != self.group.size or not all(len(r) == width and r[0] == 1 for r in self._rows):
            return False
        _pinned.setdefault(self.group._communicator(), []).append((self.request, self.box))
        self._bound = self._open = True
        return True

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` returned True (this call takes the two-round path)."""
        return self._bound

    @property
    def counts(self) -> list[int]:
        """Elements of every rank's request (after :meth:`bind`)."""
        return [r[3] for r in self._rows]

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Every rank's request, in rank order, read into ``out`` (``sum(counts)`` elements, this dtype).

        Raises:
            ValueError: ``out`` does not fit (on this rank, before any copy).
            CollectiveMismatchError, PeerLostError: a read failed or did not
                fit. This rank then runs the closing round at once, so that
                it never works on a request it did not get; its peers raise
                the same from :meth:`answer`.
        """
        self._check_bound("gather")
        me = self.group.rank
        if out.numel() != sum(self.counts) or out.dtype != self.request.dtype or not local_copy.copyable(out):
            raise ValueError(
                f"RoundTrip.gather: out must be {sum(self.counts)} contiguous CPU elements of {self.request.dtype}"
            )
        item = out.element_size()
        at = 0
        for s, row in enumerate(self._rows):
            n = row[3]
            if s == me:
                out[at : at + n].copy_(self.request.view(-1))
            elif n and not self._err:
                if row[4] != _dtype_code(out.dtype):
                    self._err = _MISMATCH
                else:
                    runs = cross_memory.runs([out.data_ptr() + at * item], [row[2]], [n * item])
                    self._err = cross_memory.read_runs(row[1], runs)
            at += n
        if self._err:
            self._close()  # raises, on this rank now and on the peers at their closing round
        return out

    def answer(self, blocks: torch.Tensor, sent: Sequence[int]) -> torch.Tensor:
        """Write ``blocks`` (``sent[r]`` elements for rank r, in rank order) into the peers' boxes; the closing round.

        Returns:
            This rank's box, filled; its gradient flows back to ``blocks``
            by an all-to-all (the backward of ``all_to_all_single``).

        Raises:
            CollectiveMismatchError: (every rank) a rank's blocks do not fit
                what their receivers expect.
            PeerLostError: (every rank) a copy failed, a peer probably died.
        """
        self._check_bound("answer")
        me, group = self.group.rank, self.group
        flat = blocks.detach().reshape(-1).contiguous()
        item, code = flat.element_size(), _dtype_code(flat.dtype)
        sent = list(sent)
        if len(sent) != group.size or sum(sent) != flat.numel() or flat.device.type != "cpu":
            self._err = self._err or _MISMATCH
            sent = [0] * group.size  # nothing is written; the closing round raises on every rank
        at = 0
        writes = []
        for r, n in enumerate(sent):
            row = self._rows[r]
            if row[_HEAD + me] != n or (n and row[6] != code):
                self._err = self._err or _MISMATCH
            elif r == me:
                start = sum(self.recv[:me])
                self.box[start : start + n].copy_(flat[at : at + n])
            elif n:
                offset = sum(row[_HEAD : _HEAD + me]) * item
                writes.append((row[1], cross_memory.runs([flat.data_ptr() + at * item], [row[5] + offset], [n * item])))
            at += n
        if not self._err:
            for pid, runs in writes:
                self._err = cross_memory.write_runs(pid, runs)
                if self._err:
                    break
        self._close()
        rows = (self.recv, sent)
        return cast(torch.Tensor, _AllToAllSingle.apply(group, [self.box], [self.box], rows, blocks.reshape(-1)))

    def abandon(self) -> None:
        """Run the closing round for a rank whose own work raised between :meth:`bind` and :meth:`answer`.

        Call it from the handler of that error, then re-raise the error.
        The peers, in :meth:`answer`, then raise
        :class:`~shardwise.errors.PeerError` naming this rank, instead of
        waiting for it in their closing round; the group stays usable. Call
        it only after the last collective the caller runs between
        :meth:`bind` and :meth:`answer` (a peer may be waiting in that
        collective otherwise). Does nothing when the round trip is not
        bound or its closing round has run (:meth:`gather` or
        :meth:`answer` raised from it).

        Example:
            >>> try:
            ...     blocks = pool(everyone)           # this rank's own work, no collective
            ...     result = trip.answer(blocks, sent)
            ... except Exception:
            ...     trip.abandon()
            ...     raise
        """
        if not self._open:
            return
        self._err = local_copy.RAISED
        # The caller re-raises its own error; what the closing round says about the peers adds nothing to it.
        with contextlib.suppress(PeerError, PeerLostError, CollectiveMismatchError):
            self._close()

    def _check_bound(self, step: str) -> None:
        if not self._bound:
            raise RuntimeError(f"RoundTrip.{step} before bind() returned True: take the collectives' path instead")

    def _close(self) -> None:
        """The closing round: every rank's box is complete and no request is read any more; errors raised alike."""
        group = self.group
        self._open = False
        codes = [row[0] for row in local_copy.all_gather_ints(group, [self._err])]
        held = _pinned.get(group._communicator(), [])
        held[:] = [pair for pair in held if pair[0] is not self.request or pair[1] is not self.box]
        mismatched = [r for r, c in enumerate(codes) if c == _MISMATCH]
        if mismatched:
            raise CollectiveMismatchError(
                f"rank {group.rank} of {group.size}: in a request/answer exchange, what ranks {mismatched} read or "
                "wrote did not fit what the other ranks published (element counts or dtypes); no rank's result is "
                "valid"
            )
        local_copy._settled(group, "round_trip", codes)


def _addr(t: torch.Tensor) -> int:
    return t.data_ptr() if t.numel() else 0


def pinned_count() -> int:
    """How many exchanges' buffers are held for peers that may still copy (tests)."""
    return sum(len(held) for held in _pinned.values())
