"""Run under ``mpiexec -n N``: large broadcasts take one copy per receiver from 3 ranks on, with the same values.

From 3 ranks the "mpi4py" torch backend and shardwise's ``MpiGroup`` offer a
broadcast to ``shardwise.sdk.local_broadcast`` first: each receiver reads the
root's tensor by cross-memory attach. Every case (dtype, size below and
above the threshold, contiguous or strided, each root) runs through
``torch.distributed.broadcast`` and ``Group.broadcast`` and must give the
root's values on every rank; the receivers start from other values. Prints
``OK <rank> <cases> <broadcasts by one copy>``; a failing rank prints its
traceback and aborts the job.
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist
from c10d_fast_paths import values  # this directory is on sys.path: the script's own

import shardwise
from shardwise._comm import local_collectives, local_copy

DTYPES = (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.complex64)


def laid_out(t: torch.Tensor, strided: bool) -> torch.Tensor:
    if not strided:
        return t.clone()
    holder = torch.zeros(2 * t.numel(), dtype=t.dtype)
    holder[::2] = t
    return holder[::2]


def main() -> int:
    g = shardwise.init("mpi")  # also brings up torch.distributed's default group over "mpi4py"
    rank, n = g.rank, g.size
    assert dist.get_backend() == "mpi4py"
    cases = 0
    try:
        for i, dtype in enumerate(DTYPES):
            item = torch.empty(0, dtype=dtype).element_size()
            for numel in (100, local_collectives.MIN_BROADCAST_BYTES // item + 7):
                for strided in (False, True):
                    for root in range(n):
                        seed = 100 * i + 10 * root + int(strided)
                        want = values(seed, numel, dtype)
                        for how in ("torch", "shardwise"):
                            t = laid_out(want if rank == root else torch.zeros_like(want), strided)
                            if how == "torch":
                                dist.broadcast(t, src=root)
                            else:
                                g.broadcast(t, src=root)
                            assert torch.equal(t, want), (how, dtype, numel, strided, root)
                            cases += 1
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        g.comm.Abort(1)
    print(f"OK {rank} {cases} {local_copy.stats.get('broadcast', 0)}", flush=True)
    shardwise.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
