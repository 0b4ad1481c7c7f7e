"""``GroupBase``: what every :class:`~shardwise.Group` shares below its public collectives.

A backend implements a handful of primitives over flat, contiguous tensors
whose sizes every rank already knows (``_all_gather``, ``_all_to_all`` ...);
this class declares them and runs the *handshake* through them: before the
data of a public collective moves, every rank all-gathers one small int64
row describing its call (which collective, the dtype, the trailing shape,
the per-rank sizes, and whether its own arguments were valid). Every rank
sees the same rows, so every rank reaches the same verdict: either all
proceed, or all raise — a rank with a bad argument raises the real error and
its peers raise :class:`PeerError` naming it, instead of one rank raising
while the others wait forever.
"""

from __future__ import annotations

import abc
import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch

from shardwise._comm.agreement import STATUS_ERRORS, Call, Rows, consecutive, show
from shardwise.errors import CollectiveMismatchError, PeerError

if TYPE_CHECKING:
    from shardwise._comm.group import Group

__all__ = ["VERIFY_ENV", "GroupBase"]

VERIFY_ENV = "SHARDWISE_VERIFY_COLLECTIVES"


def _global_ranks(ranks: Optional[Sequence[int]], size: int) -> Optional[tuple[int, ...]]:
    """``ranks`` as a tuple, or None when group rank r is global rank r (nothing to translate)."""
    if ranks is None:
        return None
    out = tuple(int(r) for r in ranks)
    if len(out) != size or len(set(out)) != size or any(r < 0 for r in out):
        raise ValueError(f"ranks must list {size} distinct non-negative global ranks, got {list(out)}")
    return None if out == tuple(range(size)) else out


class GroupBase(abc.ABC):
    """Identity, backend primitives and the handshake; see :class:`~shardwise.Group`."""

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
        self._global_ranks = _global_ranks(ranks, size)
        self._rank_of: Optional[dict[int, int]] = (
            None if self._global_ranks is None else {g: r for r, g in enumerate(self._global_ranks)}
        )
        self._backend = backend
        self._rank = rank
        self._size = size
        self._device = torch.device(device)
        self._devices = frozenset(devices)
        if verify is None:
            verify = os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        self.verify = verify
        # The collective whose handshake is running, so a backend's error
        # names what the user called rather than the handshake's all-gather.
        self._agreeing: Optional[str] = None
        # The API call whose data an exchange is moving (shard_tensor, reshard ...).
        self._moving: Optional[str] = None

    def _describe(self, primitive: str) -> str:
        """What a backend's error message should call the running ``primitive``."""
        agreeing = self._agreeing
        if agreeing is not None:
            return f"{agreeing} (agreeing on its arguments)"
        return self._moving or primitive

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

    #: False only for the stand-in a rank outside a subgroup gets (see ``NonMemberGroup``).
    is_member: bool = True

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global rank (rank in the default, world group) of each rank of this group, in group-rank order.

        Placements (``rank:R/DEVICE``) name global ranks, as in torch
        (``torch.distributed.get_process_group_ranks``).
        """
        if self._global_ranks is None:
            return tuple(range(self._size))
        return self._global_ranks

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
        if self._global_ranks is None:
            if isinstance(global_rank, int) and 0 <= global_rank < self._size:
                return global_rank
        else:
            assert self._rank_of is not None
            found = self._rank_of.get(global_rank)
            if found is not None:
                return found
        raise ValueError(
            f"global rank {global_rank} is not a member of this group ({self.describe_members()}): "
            f"Global rank {global_rank} does not exist in input process group: {list(self.ranks)}"
        )

    def describe_members(self) -> str:
        """``"0..3"``, or ``"global ranks [1, 2]"`` for a subgroup, for error messages."""
        if self._global_ranks is None:
            return f"0..{self._size - 1}"
        return f"global ranks {list(self._global_ranks)}; placements name global ranks, as in torch"

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
        """Concatenate every rank's ``inp`` into ``out`` on ``dst``.

        The default is an all-to-all with one receiver.
        """
        in_counts = [0] * self.size
        in_counts[dst] = inp.numel()
        out_counts = list(counts) if self.rank == dst else [0] * self.size
        buf = out if out is not None else inp.new_empty(0)
        self._all_to_all(buf, out_counts, inp, in_counts)

    def _scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], counts: Sequence[int], src: int) -> None:
        """Send chunk r of ``inp`` (lengths ``counts``) from ``src`` to rank r.

        The default is an all-to-all with one sender.
        """
        in_counts = list(counts) if self.rank == src else [0] * self.size
        out_counts = [0] * self.size
        out_counts[src] = out.numel()
        self._all_to_all(out, out_counts, inp if inp is not None else out.new_empty(0), in_counts)

    def _reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Dtype the backend reduces ``dtype`` values in (override to upcast).

        Raises:
            TypeError: the backend cannot reduce this dtype at all.
        """
        return dtype

    def destroy(self) -> None:  # noqa: B027 - backends without resources need not override it
        """Release the backend's resources; the group is unusable afterwards."""

    @contextlib.contextmanager
    def unverified(self) -> Iterator[None]:
        """Run the block's collectives without the per-collective handshake.

        For code that has already agreed with its peers on every size and
        on which collectives follow (one exchange up front, then several
        collectives): checking each again would cost a round trip each.
        Collectives whose sizes only the handshake can tell still run it.
        ``verify`` is restored on leaving the block.

        Example::

            sizes = group.exchange(my_counts)       # one agreement
            with group.unverified():
                out = group.all_to_all_single(data, recv_counts, send_counts)
        """
        saved = self.verify
        self.verify = False
        try:
            yield
        finally:
            self.verify = saved

    #: For backends' fast paths: one flat view of tensors that already lie
    #: back to back in one buffer (``t.split(n)``), or None.
    _consecutive = staticmethod(consecutive)

    # -- handshake -----------------------------------------------------------
    def _wire_device(self, tensor: torch.Tensor) -> Optional[torch.device]:
        return None if tensor.device.type in self._devices else self._device

    def _handshake(
        self, prepare: Callable[[], Call], *, required: bool = False, label: Optional[str] = None
    ) -> tuple[Call, Optional[Rows]]:
        """Validate locally, then (if verifying) agree with every rank.

        ``prepare`` raises TypeError/ValueError/IndexError for bad local
        arguments; with the handshake those are reported to every rank.
        ``label`` names the call in a peer's :class:`PeerError` (default:
        the collective), so an API built on ``exchange`` can say
        "shard_tensor: rank 1 ... rejected" instead of "exchange: ...".
        """
        if not (self.verify or required):
            return prepare(), None
        error: Optional[Exception] = None
        try:
            call = prepare()
            row = call.encode(self.size)
        except STATUS_ERRORS as exc:
            error = exc
            call = Call(op="barrier")
            row = call.encode(self.size)
            row[2] = 1 + next(i for i, kind in enumerate(STATUS_ERRORS) if isinstance(exc, kind))
        width = len(row)
        mine = torch.tensor(row, dtype=torch.int64, device=self._device)
        table = torch.empty(width * self.size, dtype=torch.int64, device=self._device)
        self._agreeing = label or call.op
        try:
            self._all_gather(table, mine, [width] * self.size)
        finally:
            self._agreeing = None
        rows = Rows(table.view(self.size, width).tolist(), self.size)
        failed = [r for r in range(self.size) if rows.table[r][2] != 0]
        if error is not None:
            try:
                raise error
            finally:
                # The traceback references this frame; dropping the local
                # breaks the cycle that would keep the group alive until GC.
                del error
        if failed:
            kinds = {1: "TypeError", 2: "ValueError", 3: "IndexError"}
            desc = ", ".join(f"rank {r} ({kinds.get(rows.table[r][2], 'error')})" for r in failed)
            raise PeerError(
                f"{label or call.op}: {desc} rejected its arguments, so no data was sent; "
                "see that rank's traceback for the cause"
            )
        ops = {rows.op(r) for r in range(self.size)}
        if len(ops) > 1:
            calls = ", ".join(f"rank {r}: {rows.op(r)}" for r in range(self.size))
            raise CollectiveMismatchError(
                f"ranks called different collectives at the same point ({calls}); "
                "every rank must call the same collectives in the same order"
            )
        self._check_same(rows, rows.root, what="root rank")
        self._check_same(rows, rows.reduce_op, what="reduce op")
        return call, rows

    def _check_same(self, rows: Rows, get: Callable[[int], Any], *, what: str) -> None:
        values = {r: get(r) for r in range(self.size)}
        if len(set(map(repr, values.values()))) > 1:
            shown = ", ".join(f"rank {r}: {show(v)}" for r, v in values.items())
            raise CollectiveMismatchError(f"{rows.op(self.rank)}: ranks disagree on the {what} ({shown})")

    def _check_tensor_rows(self, rows: Rows) -> None:
        self._check_same(rows, rows.dtype, what="dtype")
        self._check_same(rows, rows.ndim, what="number of dimensions")
        self._check_same(rows, rows.trailing, what="shape after dim 0")

    def _check_root(self, root: int, name: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"{name}={root!r} is not a rank of this group (size {self.size})")
