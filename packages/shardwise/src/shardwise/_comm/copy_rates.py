"""What a one-copy layout change's copies have cost here, and the prices :mod:`~shardwise._comm.box_moves` cuts by.

Why: a box moving between two ranks on one host is cut between them
(:func:`shardwise._comm.box_moves.pushed_rows`) in proportion to what each
end's work costs, and that price varies by machine and load. In a real call
(both ranks copying at once) a byte from or into a peer's 4 KiB pages (a
user's tensor) cost 1.4-1.8x a local ``memcpy``'s on one 2-core machine,
where the best fixed split on another implied 2.2x (the kernel pins remote
memory page by page, and the pinning's share depends on the memory's
speed); the fixed price of 2 made a 64 MiB scatter 8% slower than the best
price on the first. So every rank times the large contiguous copies it
makes, by kind, and keeps the median of its last few readings; the medians
ride on the call's first all-gather, and every rank derives the same prices
from the same published rows.

Three kinds: a local copy, a cross-memory copy whose far side is a peer's
4 KiB pages, and one whose far side is a peer's huge-page buffer. Only copies
of at least :data:`MIN_OBSERVED_BYTES` in runs of at least that much are
timed: smaller ones measure the call's fixed costs, and strided ones the
per-iovec cost the model prices apart (``box_moves.IOVEC_COST``). Until a
kind has been timed on some rank, its price is the model's default
(``box_moves.SMALL_PAGE_COST``, 1 for huge pages).
"""

from __future__ import annotations

import collections
import statistics
from typing import Sequence

__all__ = [
    "FAR_HUGE",
    "FAR_SMALL",
    "KINDS",
    "LOCAL",
    "MIN_OBSERVED_BYTES",
    "SCALE",
    "forget",
    "observe",
    "prices",
    "published",
]

#: The kinds of copy timed: local, a peer's 4 KiB pages on the far side, a peer's huge pages on the far side.
LOCAL, FAR_SMALL, FAR_HUGE = range(3)
KINDS = 3
#: Prices are in 1/SCALE of a local copy's byte (integers, so that every rank computes the same cut).
SCALE = 16
#: Smallest copy (and contiguous run) timed.
MIN_OBSERVED_BYTES = 1 << 20
#: Observations kept by kind: a price is the median of the last few (a first copy into fresh memory, which
#: faults its pages in, runs ten times slower and must not weigh on the next calls).
_KEPT = 8
#: Prices are clamped to this range (in local bytes): one odd reading must not hand a rank all of a box.
_LOWEST, _HIGHEST = 0.5, 4.0

#: The last picoseconds-per-byte readings, by kind.
_readings: list[collections.deque[float]] = [collections.deque(maxlen=_KEPT) for _ in range(KINDS)]


def observe(kind: int, nbytes: int, seconds: float) -> None:
    """Record that a copy of ``kind`` moved ``nbytes`` in ``seconds`` (ignored below :data:`MIN_OBSERVED_BYTES`)."""
    if nbytes >= MIN_OBSERVED_BYTES and seconds > 0:
        _readings[kind].append(seconds * 1e12 / nbytes)


def forget() -> None:
    """Drop every observation (tests; the prices go back to the defaults)."""
    for readings in _readings:
        readings.clear()


def published() -> list[int]:
    """This rank's readings, as the integers it publishes (median picoseconds per byte by kind; 0: not timed)."""
    return [round(statistics.median(readings)) if readings else 0 for readings in _readings]


def prices(rows: Sequence[Sequence[int]], small_default: int) -> tuple[int, int]:
    """The prices of a far-side 4 KiB-page byte and of a far-side huge-page byte, in 1/:data:`SCALE` local bytes.

    Every rank computes the same prices from the same rows (one
    :func:`published` row per rank): each kind's average over the ranks
    that timed it, relative to the local copies' average.

    Args:
        rows: Every rank's :func:`published` values.
        small_default: The 4 KiB-page price (in local bytes) until both a
            local copy and such a copy have been timed.
    """

    def mean(kind: int) -> float:
        seen = [row[kind] for row in rows if row[kind] > 0]
        return sum(seen) / len(seen) if seen else 0.0

    local = mean(LOCAL)

    def price(kind: int, default: float) -> int:
        far = mean(kind)
        ratio = far / local if far and local else default
        return round(SCALE * min(max(ratio, _LOWEST), _HIGHEST))

    return price(FAR_SMALL, small_default), price(FAR_HUGE, 1.0)
