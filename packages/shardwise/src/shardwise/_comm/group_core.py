"""The bottom of :class:`~shardwise._comm.group.Group`: identity, membership and the primitives a backend implements.

``Group`` is one class for everyone who imports it (from :mod:`shardwise._comm.group`), but its code is spread over a
chain of private base classes, each in a module of its own and each built on the one below it::

    group_core < group_calls < group_agreement < group_collectives < group_exchanges < group (Group)

so that no module grows past a few hundred lines and mypy sees every method a layer calls. This module holds what
needs no communication of its own: the group's rank, size, device and members (their global ranks), the primitives
a backend implements (abstract, or with a default built on the others), the direct paths a backend may offer, and
the declarations of the state that every layer above reads. The design (the handshake, one thread at a time) is
described in :mod:`shardwise._comm.group`.
"""

from __future__ import annotations

import abc
import threading
from array import array
from typing import Optional, Sequence

import torch

from shardwise._comm.agreement import current_label
from shardwise._comm.checks import global_ranks
from shardwise._comm.work import Worker
from shardwise._vocab.launch import Host


class GroupCore(abc.ABC):
    """Identity, membership and primitives of a :class:`~shardwise._comm.group.Group` (its lowest base class)."""

    # The state the layers read, declared here for mypy: the class attributes' values (and what each means) are
    # on Group, and Group.__init__ sets the instance attributes.
    is_member: bool
    _worker: Optional[Worker]
    _ending_locally: bool
    _destroyed: bool
    _out_of_step: Optional[str]
    _backend: str
    _rank: int
    _size: int
    _global_ranks: Optional[tuple[int, ...]]
    _rank_of: Optional[dict[int, int]]
    _device: torch.device
    _devices: frozenset[str]
    verify: bool
    _hosts: Optional[tuple[Host, ...]]
    _call_lock: threading.RLock

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

    def _destroy_waits(self) -> bool:
        """Whether this backend's :meth:`destroy` waits for every rank (a barrier); default: it does not."""
        return False

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

    # -- channel, labels and wire devices ---------------------------------------
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
