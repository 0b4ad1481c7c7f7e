"""What one round of gloo costs, by how the ranks swap small rows (part of ``make bench``).

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/gloo_rounds.py

shardwise swaps a few integers per call (agreements, the addresses of a
one-copy move, its closing error codes); on gloo the time of those rounds,
not their bytes, is what a small call costs. This times, over one torch
gloo process group, each rank's row of 8 B to 1 MiB swapped with every rank:

* ``all_gather_into_tensor``: gloo passes the rows round a ring, one hop
  after another (``W - 1`` hops);
* ``all_to_all_single`` of the row repeated ``W`` times: each rank sends
  each peer its row at once;
* ``shardwise`` (``TorchGroup._all_gather``): what shardwise does, the
  all-to-all up to 256 KiB a rank and gloo's all-gather above (and, from
  64 KiB in all, one copy between ranks on one host, which this script turns
  off with ``SHARDWISE_LOCAL_COPY=0`` to time the backend's own path).

Each cell is the slowest rank's median of 40 calls after 10 warm-up, the
methods interleaved.

A second table times one 8 B round as it happens inside a call: right
after a barrier, and right after every rank has pooled bags for about as
long as the column-wise ``embedding_bag`` row of ``bench.py`` does (the same
kernel on a table of the same size), over gloo and over MPI (``Allgather``,
the ``mpi`` backend's round). It gives the median, the 90th percentile and
the share of rounds over 2 ms: a gloo round hands the call to gloo's worker
and I/O threads and back, and how long those wake-ups take depends on what
the cores were just doing; MPI's waits spin. Rank 0 writes ``gloo-rounds-<W>ranks.md`` under
``--out`` (default ``benchmarks/results``) and prints it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

os.environ["SHARDWISE_LOCAL_COPY"] = "0"  # the backend's own rounds; read when the group first moves data
os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"  # this script makes torch.distributed's gloo group itself

import shardwise_mpi  # noqa: E402 - after the switches above
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _timing import library_line, mpi, publish, script_args  # noqa: E402

import shardwise  # noqa: E402
from shardwise.torch_group import TorchGroup, wrap_process_group  # noqa: E402

SIZES = (8, 1 << 10, 64 << 10, 256 << 10, 1 << 20)
WARMUP, REPEATS = 10, 40
METHODS = ("all_gather_into_tensor", "all_to_all_single", "shardwise")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def _time_rows(comm: Any, group: TorchGroup, nbytes: int) -> dict[str, float]:
    """Per method, the slowest rank's median ms to swap each rank's ``nbytes`` row with every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    row = torch.full((nbytes // 8,), rank, dtype=torch.int64)
    out = torch.empty(size * row.numel(), dtype=torch.int64)
    counts = [row.numel()] * size
    calls: dict[str, Callable[[], object]] = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, row),
        "all_to_all_single": lambda: dist.all_to_all_single(out, row.repeat(size)),
        "shardwise": lambda: group._all_gather(out, row, counts),
    }
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for i in range(WARMUP + REPEATS):
        for name in METHODS:
            comm.Barrier()
            start = time.perf_counter()
            calls[name]()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    expected = torch.arange(size, dtype=torch.int64).repeat_interleave(row.numel())
    assert torch.equal(out, expected), "the rows arrived wrong"
    return {name: comm.allreduce(statistics.median(ts), op=mpi().MAX) * 1e3 for name, ts in times.items()}


def _time_after_work(comm: Any, rounds: int) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Per (what came before, backend): median ms, 90th percentile ms and share over 2 ms of one 8 B round."""
    rank, size = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(rank)
    vocab, bags, bag = 200_000, 4096 * size, 32  # bench.py's column-wise bags: every rank's, over 128 / W columns
    table = torch.randn(vocab, max(1, 128 // size), generator=gen)
    ids = torch.randint(0, vocab, (bags * bag,), generator=gen)
    offsets = torch.arange(0, bags * bag, bag)
    row, out = torch.zeros(1, dtype=torch.int64), torch.empty(size, dtype=torch.int64)
    rounds_by: dict[str, Callable[[], object]] = {
        "gloo": lambda: dist.all_to_all_single(out, row.repeat(size)),
        "mpi": lambda: comm.Allgather(row.numpy(), out.numpy()),
    }
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(WARMUP + rounds):
        for before in ("a barrier", "pooling"):
            for name, fn in rounds_by.items():
                comm.Barrier()
                if before == "pooling":
                    torch.nn.functional.embedding_bag(ids, table, offsets, mode="sum")
                start = time.perf_counter()
                fn()
                if i >= WARMUP:
                    times.setdefault((before, name), []).append(time.perf_counter() - start)
    stats = {}
    for key, ts in times.items():
        ts.sort()
        stats[key] = (
            comm.allreduce(statistics.median(ts), op=mpi().MAX) * 1e3,
            comm.allreduce(ts[int(len(ts) * 0.9)], op=mpi().MAX) * 1e3,
            comm.allreduce(sum(t > 2e-3 for t in ts) / len(ts), op=mpi().MAX),
        )
    return stats


def main() -> int:
    global WARMUP, REPEATS
    args = script_args(__doc__)
    sizes: tuple[int, ...] = SIZES
    if args.smoke:
        sizes, WARMUP, REPEATS = (8, 64 << 10), 1, 3
    shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("gloo")  # rendezvous through MPI: no MASTER_ADDR needed
    world = dist.group.WORLD
    assert world is not None
    group = wrap_process_group(world)
    lines = []
    for nbytes in sizes:
        ms = _time_rows(comm, group, nbytes)
        best = min(ms["all_gather_into_tensor"], ms["all_to_all_single"])
        lines.append(
            f"| {_size(nbytes)} | {ms['all_gather_into_tensor']:.2f} | {ms['all_to_all_single']:.2f} "
            f"| {ms['shardwise']:.2f} | {ms['shardwise'] / best:.2f} |"
        )
    after = _time_after_work(comm, REPEATS)
    if rank == 0:
        after_lines = [
            f"| {before} | {name} | {med:.2f} | {p90:.2f} | {over:.0%} |"
            for (before, name), (med, p90, over) in after.items()
        ]
        text = (
            f"{size} ranks of one gloo process group on one host, CPU; slowest rank's median of {REPEATS} calls; "
            f"{library_line()}\n\n"
            "| row per rank | all_gather_into_tensor ms | all_to_all_single ms | shardwise ms | shardwise / best |\n"
            "|---|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n\n"
            f"One 8 B round inside a call ({REPEATS} rounds each, interleaved; the slowest rank's figures): "
            "after a barrier, or after every rank pooled bench.py's column-wise bags (F.embedding_bag)\n\n"
            "| round after | backend | median ms | 90th percentile ms | rounds over 2 ms |\n"
            "|---|---|---:|---:|---:|\n" + "\n".join(after_lines) + "\n"
        )
        publish(args.out, f"gloo-rounds-{size}ranks.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
