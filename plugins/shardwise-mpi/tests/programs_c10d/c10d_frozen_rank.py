"""Run under ``mpiexec -n 3 ... [all_reduce|broadcast]``: rank 1 freezes (SIGSTOP) while the others are in the collective.

``init_process_group("mpi4py", timeout=4 s)``: a survivor's watchdog must print
which rank, which collective and the timeout, then abort the job (status 124).
``broadcast`` sends 4 MiB, which from 3 ranks goes by one copy per receiver
(through a shardwise group the backend holds, whose watchdog must say the same).
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
    collective = sys.argv[1] if len(sys.argv) > 1 else "all_reduce"
    t = torch.ones(1 << 20 if collective == "broadcast" else 8)
    call = (lambda: dist.broadcast(t, src=0)) if collective == "broadcast" else (lambda: dist.all_reduce(t))
    call()  # the group works ...
    sys.stdout.write(f"rank {dist.get_rank()} ready\n")
    sys.stdout.flush()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # ... then rank 1 stops answering
    call()
    sys.stdout.write(f"rank {dist.get_rank()} finished although rank 1 froze\n")


if __name__ == "__main__":
    main()
