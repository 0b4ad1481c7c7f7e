"""What the data-movement rows' copies cost alone, beside shardwise and raw mpi4py (part of ``make bench``).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/copy_bounds.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/copy_bounds.py

Between ranks on one host, shardwise moves bench.py's scatter, gather and
reshard by cross-memory attach: one copy from the source's memory into the
destination's, plus the local copy of what stays on a rank. This script times
those copies with nothing else: each rank's copy list is built before timing,
and a call is the copies, then one ``Barrier`` (raw MPI's collectives end in
a synchronisation too). No agreement, no planning, no address exchange, no
closing round, no Python bookkeeping. It is what any implementation that makes
these copies costs at the least here, so it bounds shardwise's targets
against the memcpy floor and against raw mpi4py.

* scatter: rank 0 copies its own chunk of the caller's tensor (4 KiB pages,
  as ``torch.randn`` gives) into its new shard (a huge-page buffer, as
  shardwise's are); of every other rank's chunk it writes the first
  fraction ``f`` into that rank's shard, and that rank reads the rest;
* gather: rank 0 copies its own shard into ``out`` (the caller's, 4 KiB
  pages) and reads the first fraction ``f`` of every other rank's shard;
  that rank writes the rest into ``out``;
* reshard (dim 0 <-> 1, alternating): every rank copies the block it keeps
  and moves each other block by the end where the block's rows are strided
  (writing dim 0 -> 1, reading dim 1 -> 0), so the far side is always back
  to back, as ``box_moves`` chooses.

``f`` runs over 0, 1/8, ..., 1 and the best one is reported: the split
shardwise's cost model aims at. The columns: shardwise over MPI (the
library call, as bench.py times it), the copies alone at the best ``f``,
raw mpi4py (bench.py's ``RawMPI``: ``Scatterv``, ``Gatherv``, one
``Alltoallv`` of the crossing bytes already packed), and the ratios. Where
``raw / copies alone`` is under 1.5, no implementation making these copies
can be 1.5x faster than raw MPI here. Every cell is the slowest rank's median
of 9 calls after 2 warm-up, all entries of a row interleaved in a new order
every round. Each copy is checked against the dense tensor before timing.
Rank 0 writes ``copy-bounds-<W>ranks.md`` under ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional

import torch
from _timing import library_line, mpi, publish, script_args, time_all
from bench import SMOKE, RawMPI, Sizes, _size, memcpy_bandwidth, places

import shardwise
from shardwise._comm import buffers, cross_memory

FRACTIONS = tuple(Fraction(k, 8) for k in range(9))
#: The targets' factor (issue: within 1.5x of the memcpy floor, 1.5x faster than raw mpi4py).
TARGET = 1.5
CPU = torch.device("cpu")


class Copies:
    """One entry's copies, listed once: this rank's local copy, then its cross-memory reads and writes."""

    def __init__(self, comm: Any, local: Callable[[], object], moves: list[tuple[int, torch.Tensor, bool]]) -> None:
        self.comm, self.local, self.moves = comm, local, moves

    def __call__(self) -> None:
        self.local()
        for pid, runs, write in self.moves:
            err = (cross_memory.write_runs if write else cross_memory.read_runs)(pid, runs)
            if err:
                raise OSError(err, f"cross-memory copy with pid {pid} failed: {os.strerror(err)}")
        self.comm.Barrier()


def _runs(local: int, remote: int, nbytes: int) -> torch.Tensor:
    return cross_memory.runs([local], [remote], [nbytes])


def _nothing() -> None:
    pass


class Movement:
    """The buffers of one run and the copies of each row (every rank's addresses swapped once, untimed)."""

    def __init__(self, comm: Any, dense: torch.Tensor) -> None:
        self.comm, self.dense = comm, dense
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        side = dense.shape[0]
        self.rows, self.item = side // self.size, dense.element_size()
        self.chunk = self.rows * side * self.item  # bytes of one rank's dim-0 chunk
        mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
        # Shards as shardwise hands them back (touched, on huge pages); out as a caller's (4 KiB pages).
        self.shard = buffers.empty((self.rows, side), dense.dtype, CPU).copy_(dense[mine])
        self.column = buffers.empty((side, self.rows), dense.dtype, CPU).copy_(dense[:, mine])
        self.fresh = buffers.empty((self.rows, side), dense.dtype, CPU).zero_()  # scatter's new shard
        self.out = torch.zeros_like(dense) if self.rank == 0 else None
        self.peers = comm.allgather(
            (
                os.getpid(),
                dense.data_ptr(),
                0 if self.out is None else self.out.data_ptr(),
                self.shard.data_ptr(),
                self.column.data_ptr(),
                self.fresh.data_ptr(),
            )
        )

    def _cut(self, f: Fraction) -> int:
        """Bytes in the first fraction ``f`` of a chunk, in whole elements."""
        return int(self.chunk // self.item * f) * self.item

    def scatter(self, f: Fraction) -> Copies:
        """Rank 0 writes the first ``f`` of every other chunk; each other rank reads the rest of its own."""
        r, chunk, cut = self.rank, self.chunk, self._cut(f)
        if r == 0:
            peers = range(1, self.size)
            moves = [
                (self.peers[p][0], _runs(self.dense.data_ptr() + p * chunk, self.peers[p][5], cut), True)
                for p in peers
                if cut
            ]
            return Copies(self.comm, lambda: self.fresh.copy_(self.dense[: self.rows]), moves)
        pid, dense_at = self.peers[0][:2]
        reads = [(pid, _runs(self.fresh.data_ptr() + cut, dense_at + r * chunk + cut, chunk - cut), False)]
        return Copies(self.comm, _nothing, reads if cut < chunk else [])

    def gather(self, f: Fraction) -> Copies:
        """Rank 0 reads the first ``f`` of every other shard; each other rank writes the rest of its own."""
        r, chunk, cut = self.rank, self.chunk, self._cut(f)
        if r == 0:
            assert self.out is not None
            out = self.out.view(-1)
            moves = [
                (self.peers[p][0], _runs(self.out.data_ptr() + p * chunk, self.peers[p][3], cut), False)
                for p in range(1, self.size)
                if cut
            ]
            return Copies(self.comm, lambda: out[: self.shard.numel()].copy_(self.shard.view(-1)), moves)
        pid, out_at = self.peers[0][0], self.peers[0][2]
        writes = [(pid, _runs(self.shard.data_ptr() + cut, out_at + r * chunk + cut, chunk - cut), True)]
        return Copies(self.comm, _nothing, writes if cut < chunk else [])

    def reshard(self, to_columns: bool) -> Copies:
        """dim 0 -> dim 1 (``to_columns``) by writing, dim 1 -> dim 0 by reading: our side is the strided one.

        The block between rank r's dim-0 chunk and rank p's dim-1 chunk is
        ``rows`` runs of ``rows`` elements, a dim-0 row apart in r's chunk and
        back to back in p's.
        """
        r, rows, item, side = self.rank, self.rows, self.item, self.dense.shape[0]
        at = torch.arange(rows, dtype=torch.int64)
        moves = []
        for p in range(self.size):
            if p != r:
                ours = self.shard.data_ptr() + p * rows * item + at * (side * item)
                theirs = self.peers[p][4] + (r * rows + at) * (rows * item)
                moves.append(
                    (self.peers[p][0], torch.stack([ours, theirs, torch.full_like(at, rows * item)], 1), to_columns)
                )
        mine = slice(r * rows, (r + 1) * rows)
        if to_columns:
            return Copies(self.comm, lambda: self.column[mine].copy_(self.shard[:, mine]), moves)
        return Copies(self.comm, lambda: self.shard[:, mine].copy_(self.column[mine]), moves)

    def problems(self, what: str) -> list[str]:
        """Untimed, after an entry's copies: the rank's destination holds the dense tensor's values."""
        mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
        if what == "scatter":
            ok = torch.equal(self.fresh, self.dense[mine])
            self.fresh.zero_()
        elif what == "gather":
            ok = self.out is None or torch.equal(self.out, self.dense)
            if self.out is not None:
                self.out.zero_()
        elif what == "dim 1":
            ok = torch.equal(self.column, self.dense[:, mine])
        else:
            ok = torch.equal(self.shard, self.dense[mine])
        return [] if ok else [f"rank {self.rank}: the copies alone of the {what} gave other values"]


@dataclass(frozen=True)
class Result:
    """One row's medians (ms): the library call, the copies alone by fraction ``f`` (None: no split), raw MPI."""

    name: str
    library: float
    copies: dict[Optional[Fraction], float]
    raw: float
    floor_bytes: float

    @property
    def best(self) -> tuple[Optional[Fraction], float]:
        """The fastest split of the copies alone, and its time."""
        return min(self.copies.items(), key=lambda item: item[1])


def report(rows: list[Result], bandwidth: float, size: int, sizes: Sizes) -> str:
    """The results file: the table, the copies alone by split, and what they bound."""
    table, splits, bounds = [], [], []
    for row in rows:
        floor = row.floor_bytes / bandwidth * 1e3
        f, alone = row.best
        table.append(
            f"| {row.name} | {row.library:.2f} | {alone:.2f} | {'—' if f is None else f} | {row.raw:.2f} "
            f"| {row.library / floor:.2f} | {alone / floor:.2f} | {row.raw / row.library:.2f} "
            f"| {row.raw / alone:.2f} |"
        )
        if f is not None:
            splits.append(f"| {row.name} | " + " | ".join(f"{ms:.2f}" for ms in row.copies.values()) + " |")
        verdicts = [
            f"{target} (at most {limit:.2f} ms): {'within reach' if alone <= limit else 'out of reach here'}"
            for target, limit in ((f"within {TARGET}x of the floor", floor * TARGET),
                                  (f">= {TARGET}x faster than raw mpi4py", row.raw / TARGET))
        ]  # fmt: skip
        bounds.append(
            f"- {row.name}: the copies alone take {alone:.2f} ms; " + "; ".join(verdicts)
            + f"; shardwise spends {row.library - alone:.2f} ms beyond its copies"
        )  # fmt: skip
    heads = " | ".join(f"f = {f}" for f in FRACTIONS)
    return (
        f"{size} ranks on one host, CPU; slowest rank's median of {sizes.repeats} calls after {sizes.warmup} "
        f"warm-up, all entries of a row interleaved; memcpy bandwidth {bandwidth / 1e9:.2f} GB/s (all ranks "
        f"copying); {library_line()}. See benchmarks/copy_bounds.py.\n\n"
        "| row | shardwise[mpi] ms | copies alone ms | best f | raw mpi4py ms | shardwise x floor "
        "| copies alone x floor | raw / shardwise | raw / copies alone |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(table) + "\n\n"
        "The copies alone (ms) by the fraction f of each other rank's chunk that rank 0 copies:\n\n"
        f"| row | {heads} |\n|---|" + "---:|" * len(FRACTIONS) + "\n" + "\n".join(splits) + "\n\n"
        "What the copies alone bound (a target is out of reach here when the copies alone take longer):\n\n"
        + "\n".join(bounds)
        + "\n"
    )


def _alternating(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """A call that runs ``first`` and ``second`` by turns (a reshard there and back, as bench.py times it)."""
    turn = [0]

    def call() -> None:
        (first, second)[turn[0]]()
        turn[0] ^= 1

    return call


def main(argv: list[str] | None = None) -> int:
    args = script_args(__doc__ or "", argv)
    sizes = SMOKE if args.smoke else Sizes()
    # This script needs no torch.distributed group: the mpi backend must leave it alone.
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    refused = cross_memory.probe()
    if refused is not None:
        if rank == 0:
            print(f"copy_bounds: cross-memory attach is not available here ({refused}); nothing to time")
        shardwise.destroy()
        return 0
    side = sizes.side // size * size  # even chunks: every rank's copies alike
    dense = torch.randn(side, side, generator=torch.Generator().manual_seed(7))
    total = dense.numel() * dense.element_size()
    move, raw = Movement(comm, dense), RawMPI(comm, dense)
    specs = [shardwise.ChunkShardingSpec(dim=d, placements=places(size)) for d in (0, 1)]

    def lib_scatter() -> Any:
        return shardwise.shard_tensor(dense, specs[0], src_rank=0, process_group=group)

    st = lib_scatter()
    out = torch.empty_like(dense) if rank == 0 else None
    dims = [0]

    def lib_reshard() -> None:
        dims[0] ^= 1
        st.reshard(specs[dims[0]])

    rows: list[Result] = []
    problems: list[str] = []
    for name, library, copies, floor_bytes in (
        ("scatter", lib_scatter, {f: move.scatter(f) for f in FRACTIONS}, total * (size - 1) / size),
        ("gather to rank 0", lambda: st.gather(dst=0, out=out), {f: move.gather(f) for f in FRACTIONS},
         total * (size - 1) / size),
        ("reshard dim 0 <-> 1", lib_reshard,
         {None: _alternating(move.reshard(True), move.reshard(False))}, total * (size - 1) / size**2),
    ):  # fmt: skip
        for f, fn in copies.items():
            for what in (name.split()[0],) if f is not None else ("dim 1", "dim 0"):
                comm.Barrier()  # a peer's copies write into our memory: not while we check and clear it
                fn()
                problems += move.problems(what)
        raw_call = {"scatter": raw.scatter, "gather to rank 0": raw.gather}.get(name, raw.reshard)
        calls: dict[str, Callable[[], Any]] = {"library": library, "raw": raw_call}
        calls.update({f"copies {f}": fn for f, fn in copies.items()})
        ms = {k: v * 1e3 for k, v in time_all(comm, calls, sizes.repeats, sizes.warmup).items()}
        by_f = {f: ms[f"copies {f}"] for f in copies}
        rows.append(Result(f"{name} {_size(total)}", ms["library"], by_f, ms["raw"], floor_bytes))
    bandwidth = memcpy_bandwidth(comm, total, sizes.repeats)
    failed = comm.allgather(problems)
    if any(failed):
        raise SystemExit("copy_bounds: " + "; ".join(p for ps in failed for p in ps))
    if rank == 0:
        text = report(rows, bandwidth, size, sizes)
        publish(args.out, f"copy-bounds-{size}ranks.md", text)
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
