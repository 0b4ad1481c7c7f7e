"""The ``shardwise.plan`` debug log's one line about a transfer plan: :func:`describe` and its wording helpers.

:mod:`shardwise._layout.redistribute` logs each plan it executes at DEBUG
(``SHARDWISE_LOGS=plan=debug``), and only builds the line when that level
is on. Turning a :class:`~shardwise._layout.plan_records.TransferPlan` into
words (pieces, bytes per peer, views or buffers, rounds) reads the plan and
nothing else, so it lives here, apart from the code that moves the data.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardwise._layout.plan_records import TransferPlan

__all__ = ["describe"]


# -- the debug log -------------------------------------------------------------


def _bytes(n: int) -> str:
    """``n`` bytes for people: ``"64 B"``, ``"1.5 KiB"``, ``"3.0 MiB"``, ``"2.0 GiB"``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _per_peer(counts: Sequence[int], itemsize: int) -> str:
    """``" {peer: bytes, ...}"`` for the peers with a non-zero count, or ``""``."""
    shown = ", ".join(f"{r}: {_bytes(n * itemsize)}" for r, n in enumerate(counts) if n)
    return f" {{{shown}}}" if shown else ""


def _pieces(n: int, nbytes: int = 0) -> str:
    """``"nothing"``, ``"1 piece"``, ``"3 pieces (96 B)"`` (bytes shown when ``nbytes`` is not 0)."""
    if n == 0:
        return "nothing"
    return (f"{n} piece" if n == 1 else f"{n} pieces") + (f" ({_bytes(nbytes)})" if nbytes else "")


def _how(pl: TransferPlan) -> tuple[str, str]:
    """How a one-round plan sends and receives: from/into a view, or through a buffer."""
    if pl.send_view is not None:
        sends = f"from a view of source shard {pl.send_view.shard}"
    else:
        sends = "packed into a send buffer"
    if pl.recv_whole is not None:
        receives = f"into a buffer that becomes target shard {pl.recv_whole}"
    elif pl.recv_view is not None:
        receives = f"into a view of target shard {pl.recv_view.shard}"
    else:
        receives = "into a receive buffer, then unpacked"
    return sends, receives


def describe(pl: TransferPlan, wire_dtype: torch.dtype, parts: Sequence[TransferPlan] = ()) -> str:
    """One line saying what ``pl`` moves and how: the ``shardwise.plan`` debug log's record of it.

    Args:
        pl: This rank's plan.
        wire_dtype: The dtype the data moves in (bytes are counted in it).
        parts: The plans of its rounds when it moves in parts
            (:func:`~shardwise._layout.plan_rounds.slab_plans`); empty: one round.

    Returns:
        For example ``rank 0 of 2, [8, 8] float32: keeps 1 piece (64 B); sends 1 piece {1: 64 B}
        packed into a send buffer; receives 1 piece {1: 64 B} into a view of target shard 0; 1 round,
        64 B of buffers``.
    """
    size = wire_dtype.itemsize
    rounds = tuple(parts) or (pl,)
    dtype = str(wire_dtype).replace("torch.", "")
    local = _pieces(len(pl.local), sum(p.numel for p in pl.local) * size)
    head = f"rank {pl.rank} of {pl.world_size}, {list(pl.size)} {dtype}: keeps {local}"
    if not pl.needs_wire:
        return f"{head}; no rank sends anything, so no collective"
    sent, received = sum(map(len, pl.send)), sum(map(len, pl.recv))
    sends = f"sends {_pieces(sent)}{_per_peer(pl.send_counts, size)}"
    receives = f"receives {_pieces(received)}{_per_peer(pl.recv_counts, size)}"
    peak = _bytes(max(part.buffer_numel for part in rounds) * size)
    if len(rounds) == 1:
        how_sent, how_received = _how(pl)
        sends += f" {how_sent}" if sent else ""
        receives += f" {how_received}" if received else ""
        return f"{head}; {sends}; {receives}; 1 round, {peak} of buffers"
    from_view = sum(part.send_view is not None for part in rounds)
    into_view = sum(part.recv_view is not None for part in rounds)
    cut = rounds[0].cut or "slabs"
    return (
        f"{head}; {sends}; {receives}; {len(rounds)} rounds ({cut}), at most {peak} of buffers in each; "
        f"sent from a view in {from_view} and received into one in {into_view} of them"
    )
