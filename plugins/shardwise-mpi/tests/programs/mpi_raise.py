"""Run under ``mpiexec -n N``: rank 1 raises while the others wait in a collective.

The abort hook must end the whole job (non-zero exit) instead of leaving
the waiting ranks hung.
"""

from __future__ import annotations

import sys
import time

import torch

import shardwise


def main() -> None:
    group = shardwise.init()
    assert group.backend == "mpi", group
    group.barrier()
    if group.rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    group.all_reduce(torch.ones(1))  # never completes: rank 1 is gone
    time.sleep(60)
    print(f"RANK {group.rank} SHOULD NOT GET HERE", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
