"""Agreement any code can ask a :class:`~shardwise._comm.group.Group` for: ``agree``, JSON all-gathers, ``reject``.

The third of ``Group``'s private base classes (the chain is described in :mod:`shardwise._comm.group_core`).
These methods move no tensor data: they run the handshake of :mod:`shardwise._comm.group_calls` for code of their
own (``agree``), carry small JSON values in it or right after it (``all_gather_json``, ``exchange``), fail a
rank's part on purpose (``reject``), or learn which ranks share a host (``hosts``, an ``all_gather_json``). The
JSON methods that send to or from one rank (``gather_json``, ``scatter_json``) sit with ``gather`` and ``scatter``
in :mod:`shardwise._comm.group_exchanges`, which they call.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Literal, NoReturn, Optional, Sequence, TypeVar, overload

import torch

from shardwise._comm.agreement import AGREED_ERRORS, Call, CallLabel, inline_capacity, labelled
from shardwise._comm.group_calls import GroupCalls, _one_call_at_a_time
from shardwise._comm.hosts import this_host
from shardwise._vocab import wire as _wire
from shardwise._vocab.launch import Host, group_by_host

T = TypeVar("T")


def _byte_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a 1-D uint8 tensor (a copy: ``frombuffer`` needs a writable buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class GroupAgreement(GroupCalls):
    """``agree``, its JSON helpers and ``reject``, and ``hosts``, of a :class:`~shardwise._comm.group.Group`."""

    # -- hosts (collective the first time: one all_gather_json) -------------------
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

    # -- agreement -----------------------------------------------------------
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
