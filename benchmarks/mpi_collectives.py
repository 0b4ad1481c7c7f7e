"""Group collectives over MPI against raw mpi4py (and shardwise over gloo), side by side in one run.

    make bench-mpi          # = .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_collectives.py

Every rank holds 1, 16 and 64 MiB of float32 per collective. Every
implementation works on the same preallocated buffers (the Group calls get
them through ``out=``), so the columns differ only in the code between the
caller and MPI. The shardwise columns are timed twice: with
``verify=False`` (no cross-rank handshake; the production setting) and with
the default ``verify=True`` (one extra small all-gather per call that makes a
mismatched call raise on every rank instead of hanging). Each cell is the
median of the timed calls after warm-up ones, with a barrier before each
call; the order of the implementations rotates between calls so that none
always runs right after another's traffic. Rank 0 writes a markdown table to
benchmarks/results/mpi_collectives.md and prints it.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import shardwise_mpi
import torch
import torch.distributed as dist
from _timing import library_line, mpi, publish, script_args, time_all, with_verify

import shardwise
from shardwise.torch_group import wrap_process_group

WARMUP = 3
REPEATS = {1: 61, 16: 21, 64: 9}
SIZES_MIB = (1, 16, 64)
COLUMNS = ("raw", "mpi", "mpi+verify", "gloo", "gloo+verify")






def cases(n: int, size: int, rank: int) -> dict[str, dict[str, Callable[[Any], Callable[[], Any]]]]:
    """collective -> {"raw": make(comm), "group": make(group)}; each make returns the call to time."""
    MPI = mpi()
    chunk = n // size
    t = torch.full((n,), float(rank + 1))
    pieces = list(t.split(chunk))
    gathered = torch.empty(n * size)
    scattered = torch.empty(chunk)
    exchanged = torch.empty(n)
    a, g, s, x = t.numpy(), gathered.numpy(), scattered.numpy(), exchanged.numpy()
    return {
        "all_reduce": {
            "raw": lambda comm: lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
            "group": lambda grp: lambda: grp.all_reduce(t),
        },
        "all_gather": {
            "raw": lambda comm: lambda: comm.Allgather(a, g),
            "group": lambda grp: lambda: grp.all_gather(t, out=gathered),
        },
        "reduce_scatter": {
            "raw": lambda comm: lambda: comm.Reduce_scatter_block(a, s, op=MPI.SUM),
            "group": lambda grp: lambda: grp.reduce_scatter(pieces, op="sum", out=scattered),
        },
        "all_to_all": {
            "raw": lambda comm: lambda: comm.Alltoall(a, x),
            "group": lambda grp: lambda: grp.all_to_all_single(t, out=exchanged),
        },
        "broadcast": {
            "raw": lambda comm: lambda: comm.Bcast(a, root=0),
            "group": lambda grp: lambda: grp.broadcast(t, src=0),
        },
    }


def main() -> int:
    global REPEATS, SIZES_MIB, WARMUP
    args = script_args(__doc__)
    if args.smoke:
        WARMUP, REPEATS, SIZES_MIB = 1, {1: 2}, (1,)
    # This script makes torch.distributed's default group itself (gloo, below), so the mpi
    # backend must leave torch.distributed alone (by default it brings up "mpi4py" there).
    os.environ["SHARDWISE_MPI_TORCH_DIST"] = "0"
    mpi_group = shardwise.init("mpi")
    comm = mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # Makes env:// fall back to MPI under mpiexec: gloo then needs no MASTER_ADDR.
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("gloo")  # rendezvous through MPI: no MASTER_ADDR needed
    gloo = wrap_process_group(dist.group.WORLD)
    groups = {"mpi": mpi_group, "gloo": gloo}
    rows = []
    for mib in SIZES_MIB:
        n = mib * 2**20 // 4 // size * size
        for name, impls in cases(n, size, rank).items():
            calls = {"raw": impls["raw"](comm)}
            for label, grp in groups.items():
                calls[label] = with_verify(grp, False, impls["group"](grp))
                calls[label + "+verify"] = with_verify(grp, True, impls["group"](grp))
            rows.append((name, mib, time_all(comm, calls, REPEATS[mib], WARMUP)))
    if rank == 0:
        text = table(rows, size)
        publish(args.out, "mpi_collectives.md", text)
    dist.destroy_process_group()
    shardwise.destroy()
    return 0




def table(rows: list[tuple[str, int, dict[str, float]]], size: int) -> str:
    lines = [
        f"{size} ranks, float32, per-rank buffer size; median of {'/'.join(map(str, REPEATS.values()))} calls "
        f"({'/'.join(map(str, SIZES_MIB))} MiB) after {WARMUP} warm-up, slowest rank's median; {library_line()}.",
        "Ratios are to raw mpi4py on the same buffers. `verify` = the default cross-rank handshake.",
        "",
        "| collective | MiB | raw mpi4py ms | shardwise mpi ms | ratio | mpi+verify ms | ratio "
        "| shardwise gloo ms | ratio | gloo+verify ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, mib, t in rows:
        cells = [f"{t['raw'] * 1e3:.2f}"]
        for col in COLUMNS[1:]:
            cells += [f"{t[col] * 1e3:.2f}", f"{t[col] / t['raw']:.2f}"]
        lines.append(f"| {name} | {mib} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
