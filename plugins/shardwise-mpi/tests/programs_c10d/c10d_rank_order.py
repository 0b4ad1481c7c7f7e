"""Run under ``mpiexec -n N`` with a port: torch ranks numbered in the reverse of MPI's, then sub-groups.

env:// rendezvous gives process ``i`` of MPI torch rank ``N-1-i``; the
default group follows torch's numbering, and a sub-group named by torch
ranks must hold those processes (not MPI's ranks of the same numbers).
Prints ``OK <rank> <checks>`` at the end.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def _launcher(*names: str) -> int:
    """The first of ``names`` the MPI launcher set (Hydra's PMI_*, Open MPI's OMPI_COMM_WORLD_*)."""
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError(f"run under mpiexec or mpirun: none of {names} is set")


def main() -> None:
    # Which process this is in MPI's numbering, from the launcher: importing mpi4py.MPI here would load a
    # library before shardwise_mpi picks the one of the launcher's kind.
    mpi_rank = _launcher("PMI_RANK", "OMPI_COMM_WORLD_RANK")
    n = _launcher("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], WORLD_SIZE=str(n), RANK=str(n - 1 - mpi_rank))
    import shardwise_mpi
    import torch
    import torch.distributed as dist

    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    assert rank == n - 1 - mpi_rank, (rank, mpi_rank)
    checks = []
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == n * (n - 1) / 2, t
    checks.append("world")
    for members in ([0, 1], [n - 1, 0], list(range(n))):
        sub = dist.new_group(sorted(set(members)))
        if rank in members:
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=sub)
            assert t.item() == sum(m + 1 for m in set(members)), (members, t)
            got = [torch.empty(1) for _ in set(members)]
            dist.all_gather(got, torch.tensor([float(rank)]), group=sub)
            assert [g.item() for g in got] == [float(m) for m in sorted(set(members))], (members, got)
            checks.append(f"sub-group {members}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK {rank} {len(checks)}", flush=True)


if __name__ == "__main__":
    main()
