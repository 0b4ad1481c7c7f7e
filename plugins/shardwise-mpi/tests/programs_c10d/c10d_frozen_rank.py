"""Run under ``mpiexec -n 3``: rank 1 freezes (SIGSTOP) while the others are in an all_reduce.

``init_process_group("mpi4py", timeout=4 s)``: a survivor's watchdog must print
which rank, which collective and the timeout, then abort the job (status 124).
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import shardwise_mpi
import torch
import torch.distributed as dist


def main() -> None:
    shardwise_mpi.register_torch_backend()
    dist.init_process_group("mpi4py", timeout=timedelta(seconds=4))
    t = torch.ones(8)
    dist.all_reduce(t)  # the group works ...
    sys.stdout.write(f"rank {dist.get_rank()} ready\n")
    sys.stdout.flush()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # ... then rank 1 stops answering
    dist.all_reduce(t)
    sys.stdout.write(f"rank {dist.get_rank()} finished although rank 1 froze\n")


if __name__ == "__main__":
    main()
