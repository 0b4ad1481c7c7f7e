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
methods interleaved. Rank 0 writes ``gloo-rounds-<W>ranks.md`` under
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
    if rank == 0:
        text = (
            f"{size} ranks of one gloo process group on one host, CPU; slowest rank's median of {REPEATS} calls; "
            f"{library_line()}\n\n"
            "| row per rank | all_gather_into_tensor ms | all_to_all_single ms | shardwise ms | shardwise / best |\n"
            "|---|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n"
        )
        publish(args.out, f"gloo-rounds-{size}ranks.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
