"""The agreement every collective starts with: one row per rank, one verdict on all.

Each rank encodes its call into one fixed-width int64 row (:class:`Call`)
and the ranks all-gather the rows; :class:`Rows` decodes the table. The row
width depends only on the group size, so ranks that call different
collectives still exchange rows of the same size and can detect it.

A row carries the rank's *status*: 0, or the kind of error its own check
raised (:data:`AGREED_ERRORS`), with the error's type and message in the
row's spare words. Every rank sees every row, so every rank reaches the same
verdict: the rank at fault raises its own error, the others raise the
:class:`PeerError` that :func:`peer_error` words, and no data moves.

Small JSON payloads (an :meth:`~shardwise.Group.agree` with ``gather=True``)
travel in the same spare words, so agreeing on them costs one collective.

While a backend primitive runs, :class:`CallLabel` (an immutable record in a
context variable, so threads and nested calls each see their own) says
which user call it belongs to, so a transport error names ``shard_tensor``
rather than the all-gather that carried its handshake.

Every disagreement (a rank rejected its arguments, or ranks called different
collectives or passed different roots, reduce ops, dtypes or sizes) is logged
at DEBUG on the ``shardwise.agreement`` logger (``SHARDWISE_LOGS=agreement=debug``)
by every rank, just before it raises; agreeing costs nothing more.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from shardwise._vocab import wire as _wire
from shardwise.errors import CollectiveMismatchError, PeerError, PeerLostError, ShardwiseError

__all__ = [
    "AGREED_ERRORS",
    "NOT_AGREED",
    "Call",
    "CallLabel",
    "Rows",
    "check_same",
    "check_tensor_rows",
    "current_label",
    "failed_call",
    "inline_capacity",
    "known_to_peers",
    "labelled",
    "log_rejections",
    "mark_known_to_peers",
    "peer_error",
    "raise_verdict",
]

_log = logging.getLogger("shardwise.agreement")

#: Set on an exception that a collective's data movement raised on one rank after telling its peers.
_TOLD_PEERS = "_shardwise_told_peers"


def mark_known_to_peers(error: BaseException) -> None:
    """Record that every peer of the failing call has heard of ``error`` (they raise too): the ranks stay in step."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _TOLD_PEERS, True)


def known_to_peers(error: BaseException) -> bool:
    """Whether every rank raised with ``error`` in the same call: shardwise's own errors, or one marked so."""
    return isinstance(error, ShardwiseError) or getattr(error, _TOLD_PEERS, False) is True

_OPS = (
    "barrier", "broadcast", "all_reduce", "all_gather", "reduce_scatter",
    "all_to_all", "scatter", "gather", "exchange", "new_group", "agree", "destroy",
)

#: The error kinds a rank's failed check is reported to its peers as, most
#: specific first (the first one an error is an instance of names it). A
#: rank's error of any other ``Exception`` type is reported too, under its
#: own class name: an agreement exists so that no rank is left waiting.
AGREED_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, IndexError, KeyError, NotImplementedError)
#: Errors a check may raise that are not agreed on but raised at once: the
#: group itself is gone (a collective inside the check lost a peer), so one
#: more collective could only fail again or wait. (A PeerError or
#: CollectiveMismatchError from a nested collective *is* agreed on: every
#: rank then still joins, and each raises its own error.)
NOT_AGREED: tuple[type[Exception], ...] = (PeerLostError,)

_HEADER = 8  # op, dtype, status, ndim, root, reduce op, count, inline bytes
_MAX_DIMS = 16
NO_TENSOR = -1
_OTHER = len(AGREED_ERRORS) + 1  # status of an error of no listed kind


#: The fewest words a row has beyond its header. The agreements of ``shard_tensor`` and ``reshard`` carry a
#: spec and the tensor's properties, 200-300 bytes of JSON, which the dims and splits words of a small group
#: (160 bytes at 2 ranks) cannot hold: they then cost a second collective. 64 words hold them; a larger
#: group's rows are wider than that anyway.
_MIN_BODY = 64


def _body_words(size: int) -> int:
    return max(_MAX_DIMS + 2 * size, _MIN_BODY)


def inline_capacity(size: int) -> int:
    """Bytes a row of a group of ``size`` ranks carries beyond its header (the dims and splits words)."""
    return 8 * _body_words(size)


@dataclass
class Call:
    """One rank's description of its call, as carried by the handshake.

    ``inline`` is up to :func:`inline_capacity` bytes carried in the words
    that tensor collectives use for shapes and splits (the two never meet
    in one row): an agreement's JSON payload, or a failed rank's error.
    """

    op: str
    dtype: Optional[torch.dtype] = None
    shape: Optional[tuple[int, ...]] = None  # None: this rank passes no tensor
    root: int = -1
    reduce_op: str = ""
    count: int = 0
    splits_a: Sequence[int] = ()
    splits_b: Sequence[int] = ()
    status: int = 0
    inline: bytes = b""

    def encode(self, size: int) -> list[int]:
        row = [0] * (_HEADER + _body_words(size))
        row[0] = _OPS.index(self.op)
        row[1] = _wire.dtype_code(self.dtype) if self.dtype is not None else NO_TENSOR
        row[2] = self.status
        row[3] = NO_TENSOR if self.shape is None else len(self.shape)
        row[4] = self.root
        row[5] = _wire.REDUCE_OPS.index(self.reduce_op) if self.reduce_op else NO_TENSOR
        row[6] = self.count
        if self.inline:
            words = (len(self.inline) + 7) // 8
            row[7] = len(self.inline)
            row[_HEADER:_HEADER + words] = struct.unpack(f"<{words}q", self.inline.ljust(8 * words, b"\0"))
            return row
        if self.shape is not None:
            if len(self.shape) > _MAX_DIMS + 1:
                raise ValueError(f"collectives take tensors of at most {_MAX_DIMS + 1} dims, got {len(self.shape)}")
            row[_HEADER:_HEADER + len(self.shape) - 1] = list(self.shape[1:])
        base = _HEADER + _MAX_DIMS
        row[base:base + len(self.splits_a)] = list(self.splits_a)
        row[base + size:base + size + len(self.splits_b)] = list(self.splits_b)
        return row


class Rows:
    """The handshake result: every rank's row, decoded on demand."""

    def __init__(self, table: list[list[int]], size: int) -> None:
        self.table = table
        self.size = size

    def op(self, r: int) -> str:
        code = self.table[r][0]
        return _OPS[code] if 0 <= code < len(_OPS) else f"<unknown op {code}>"

    def dtype(self, r: int) -> Optional[torch.dtype]:
        code = self.table[r][1]
        return None if code == NO_TENSOR else _wire.DTYPES[code]

    def status(self, r: int) -> int:
        return self.table[r][2]

    def ndim(self, r: int) -> int:
        return self.table[r][3]

    def trailing(self, r: int) -> tuple[int, ...]:
        ndim = self.ndim(r)
        return tuple(self.table[r][_HEADER:_HEADER + max(ndim - 1, 0)])

    def root(self, r: int) -> int:
        return self.table[r][4]

    def reduce_op(self, r: int) -> str:
        """Rank r's reduce op by name (``"sum"``), or ``"none"``: error messages show it to users."""
        code = self.table[r][5]
        return _wire.REDUCE_OPS[code] if 0 <= code < len(_wire.REDUCE_OPS) else "none"

    def count(self, r: int) -> int:
        return self.table[r][6]

    def inline(self, r: int) -> bytes:
        """The bytes rank r carried in its row (see :class:`Call`)."""
        length = self.table[r][7]
        words = (length + 7) // 8
        values = self.table[r][_HEADER:_HEADER + words]
        return struct.pack(f"<{words}q", *values)[:length]

    def splits_a(self, r: int) -> list[int]:
        base = _HEADER + _MAX_DIMS
        return self.table[r][base:base + self.size]

    def splits_b(self, r: int) -> list[int]:
        base = _HEADER + _MAX_DIMS + self.size
        return self.table[r][base:base + self.size]


# -- the label backends' errors name ------------------------------------------------
@dataclass(frozen=True)
class CallLabel:
    """Which user call a backend primitive is running for, while it runs.

    Attributes:
        owner: The group the label belongs to (a primitive of another group
            running meanwhile is not labelled by it).
        call: The user's call (``"all_reduce"``, ``"shard_tensor"``).
        agreeing: The primitive carries the call's handshake, not its data.
    """

    owner: object = field(compare=False, repr=False)
    call: str
    agreeing: bool = False

    def describe(self) -> str:
        return f"{self.call} (agreeing on its arguments)" if self.agreeing else self.call


_LABEL: contextvars.ContextVar[Optional[CallLabel]] = contextvars.ContextVar("shardwise_call_label", default=None)


def current_label(owner: object) -> Optional[CallLabel]:
    """The label of the innermost running call of ``owner``, or None."""
    label = _LABEL.get()
    return label if label is not None and label.owner is owner else None


@contextlib.contextmanager
def labelled(label: CallLabel) -> Iterator[None]:
    """Run the block under ``label`` (restored on exit, so calls nest; each thread has its own)."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


# -- failures -----------------------------------------------------------------------
def _kind_status(error: Exception) -> int:
    return 1 + next((i for i, kind in enumerate(AGREED_ERRORS) if isinstance(error, kind)), len(AGREED_ERRORS))


def failed_call(error: Exception, size: int) -> Call:
    """The row of a rank whose check raised ``error``: its kind, and its type and message as far as they fit."""
    status = _kind_status(error)
    name = AGREED_ERRORS[status - 1].__name__ if status != _OTHER else type(error).__name__
    text = f"{name}\n{' '.join(str(error).split())}".encode()
    room = inline_capacity(size)
    if len(text) > room:
        text = text[:room - 3] + b"..."
    return Call(op="barrier", status=status, inline=text)


def peer_error(op: str, failures: Sequence[tuple[int, str, str]]) -> PeerError:
    """The one wording of the error a rank raises when peers rejected their part of ``op``.

    Args:
        op: The call this rank made (``"all_reduce"``, ``"shard_tensor"``).
        failures: ``(rank, error kind, message)`` of each rank at fault.
    """
    kinds = ", ".join(f"rank {r} ({kind})" for r, kind, _ in failures)
    shown = "; ".join(f"rank {r}: {message}" for r, _, message in failures if message)
    detail = f" ({shown})" if shown else ""
    verb = "rejected its arguments" if len(failures) == 1 else "rejected their arguments"
    return PeerError(
        f"{op}: {kinds} {verb}, so no data was sent{detail}; see that rank's traceback for the cause"
    )


def _failures(rows: Rows) -> list[tuple[int, str, str]]:
    """``(rank, error kind, message)`` of each rank whose row reports a failed check."""
    failures = []
    for r in range(rows.size):
        if rows.status(r) != 0:
            name, _, message = rows.inline(r).decode(errors="replace").partition("\n")
            failures.append((r, name or "error", message))
    return failures


def log_rejections(rows: Rows, op: str) -> None:
    """Log at DEBUG which ranks rejected their part of ``op``, and why (the same line on every rank).

    Called by every rank of a failed agreement before it raises: by the
    peers in :func:`raise_verdict`, by the rank at fault before it re-raises
    its own error.
    """
    if _log.isEnabledFor(logging.DEBUG):
        said = "; ".join(f"rank {r} rejected its arguments ({kind}: {message})" for r, kind, message in _failures(rows))
        _log.debug("%s: %s; every rank raises, no data moved", op, said)


def _mismatch(message: str) -> CollectiveMismatchError:
    """The error for ranks whose calls do not match, logged at DEBUG first."""
    _log.debug("%s", message)
    return CollectiveMismatchError(message)


def raise_verdict(rows: Rows, op: str, check_ops: bool = True) -> None:
    """Raise the verdict every rank reaches from the same rows (the caller has raised its own error first).

    Raises:
        PeerError: a rank's check failed.
        CollectiveMismatchError: ranks called different collectives, or
            disagree on the root or the reduce op.
    """
    failures = _failures(rows)
    if failures:
        log_rejections(rows, op)
        raise peer_error(op, failures)
    if not check_ops:
        return
    ops = {rows.op(r) for r in range(rows.size)}
    if len(ops) > 1:
        calls = ", ".join(f"rank {r}: {rows.op(r)}" for r in range(rows.size))
        # The rows name primitives; an API built on one ("full_tensor" on "exchange") is named too.
        within = "" if op in ops else f"{op}: "
        raise _mismatch(
            f"{within}ranks called different collectives at the same point ({calls}); "
            "every rank must call the same collectives in the same order"
        )
    check_same(rows, rows.root, what="root rank")
    check_same(rows, rows.reduce_op, what="reduce op")


def show(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if value == NO_TENSOR:
        return "none"
    return str(value)


def check_same(rows: Rows, get: Callable[[int], Any], *, what: str) -> None:
    """Raise CollectiveMismatchError (on every rank) unless ``get(r)`` is the same for every rank."""
    values = {r: get(r) for r in range(rows.size)}
    if len(set(map(repr, values.values()))) > 1:
        shown = ", ".join(f"rank {r}: {show(v)}" for r, v in values.items())
        raise _mismatch(f"{rows.op(0)}: ranks disagree on the {what} ({shown})")


def check_tensor_rows(rows: Rows) -> None:
    check_same(rows, rows.dtype, what="dtype")
    check_same(rows, rows.ndim, what="number of dimensions")
    check_same(rows, rows.trailing, what="shape after dim 0")


def check_all_to_all_rows(rows: Rows) -> None:
    """Raise unless each rank that said what it expects to receive is sent exactly that."""
    for r in range(rows.size):
        expected = [rows.splits_a(s)[r] for s in range(rows.size)]
        if rows.count(r) and rows.splits_b(r) != expected:
            raise _mismatch(
                f"all_to_all_single: rank {r} expects to receive {rows.splits_b(r)} rows "
                f"but the ranks send it {expected}"
            )
