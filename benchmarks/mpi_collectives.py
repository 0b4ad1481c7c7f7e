"""Group collectives over MPI against raw mpi4py (and shardwise over gloo), side by side in one run.

    make bench-mpi          # = .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_collectives.py

Every rank holds 1, 16 and 64 MiB of float32 per collective. Each cell is
the median of REPEATS timed calls after WARMUP untimed ones, with a barrier
before each call; rank 0 writes a markdown table to
benchmarks/results/mpi_collectives.md and prints it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import shardwise_mpi  # noqa: F401  (registers the torch backend and its mpiexec rendezvous)
import torch
import torch.distributed as dist

import shardwise
from shardwise.torch_group import wrap_process_group

WARMUP, REPEATS = 2, 7
SIZES_MIB = (1, 16, 64)


def timed(comm: Any, fn: Callable[[], Any]) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(n: int, size: int, rank: int) -> dict[str, dict[str, Callable[[Any], Callable[[], Any]]]]:
    """collective -> {"raw": make(comm), "group": make(group)}; each make returns the call to time."""
    from mpi4py import MPI

    chunk = n // size
    t = torch.full((n,), float(rank + 1))
    out = torch.empty(n * size)
    a = t.numpy()
    o = out.numpy()
    rs_out = torch.empty(chunk)
    return {
        "all_reduce": {
            "raw": lambda comm: lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
            "group": lambda g: lambda: g.all_reduce(t),
        },
        "all_gather": {
            "raw": lambda comm: lambda: comm.Allgather(a, o),
            "group": lambda g: lambda: g.all_gather(t),
        },
        "reduce_scatter": {
            "raw": lambda comm: lambda: comm.Reduce_scatter_block(a, rs_out.numpy(), op=MPI.SUM),
            "group": lambda g: lambda: g.reduce_scatter(list(t.split(chunk)), op="sum"),
        },
        "all_to_all": {
            "raw": lambda comm: lambda: comm.Alltoall(a, np.empty_like(a)),
            "group": lambda g: lambda: g.all_to_all_single(t),
        },
        "broadcast": {
            "raw": lambda comm: lambda: comm.Bcast(a, root=0),
            "group": lambda g: lambda: g.broadcast(t, src=0),
        },
    }


def main() -> int:
    from mpi4py import MPI

    group = shardwise.init("mpi")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("gloo")  # rendezvous through MPI: no MASTER_ADDR needed
    gloo = wrap_process_group(dist.group.WORLD)
    rows = []
    for mib in SIZES_MIB:
        n = mib * 2**20 // 4 // size * size
        for name, impls in cases(n, size, rank).items():
            raw = timed(comm, impls["raw"](comm))
            ours = timed(comm, impls["group"](group))
            theirs = timed(comm, impls["group"](gloo))
            rows.append((name, mib, raw, ours, theirs))
    if rank == 0:
        lines = [
            f"Median of {REPEATS} calls after {WARMUP} warm-up, {size} ranks, float32, per-rank buffer size; "
            f"torch {torch.__version__}, mpi4py {sys.modules['mpi4py'].__version__}, "
            f"{MPI.Get_library_version().splitlines()[0]}.",
            "",
            "| collective | MiB/rank | raw mpi4py (ms) | shardwise mpi (ms) | mpi / raw "
            "| shardwise gloo (ms) | gloo / raw |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, mib, raw, ours, theirs in rows:
            lines.append(
                f"| {name} | {mib} | {raw * 1e3:.2f} | {ours * 1e3:.2f} | {ours / raw:.2f} | "
                f"{theirs * 1e3:.2f} | {theirs / raw:.2f} |"
            )
        text = "\n".join(lines) + "\n"
        out = Path(__file__).parent / "results" / "mpi_collectives.md"
        out.write_text(text)
        print(text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
