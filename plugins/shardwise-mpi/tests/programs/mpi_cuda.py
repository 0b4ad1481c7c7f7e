"""Run under ``mpiexec -n N`` on a CUDA machine: CUDA tensors through MPI (CUDA-aware or staged via host)."""

from __future__ import annotations

import torch
from shardwise_mpi import _collectives as C

import shardwise


def main() -> None:
    group = shardwise.init()
    comm, r, w = group.comm, group.rank, group.size
    dev = torch.device("cuda", r % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    t = torch.full((5,), float(r + 1), device=dev, dtype=torch.bfloat16)
    C.allreduce(comm, t, "sum")
    assert t.device == dev and torch.equal(t.cpu(), torch.full((5,), float(sum(range(1, w + 1))), dtype=torch.bfloat16))
    out = torch.empty(sum(range(w)), device=dev)
    C.allgatherv(comm, out, torch.full((r,), float(r), device=dev).t(), list(range(w)))
    assert torch.equal(out.cpu(), torch.cat([torch.full((s,), float(s)) for s in range(w)]))
    got = group.all_gather(torch.arange(6.0, device=dev).reshape(2, 3).t() + r)
    assert all(
        g.device == dev and torch.equal(g.cpu(), torch.arange(6.0).reshape(2, 3).t() + s) for s, g in enumerate(got)
    )
    print(f"RANK {r} CUDA OK aware={C.cuda_aware()}", flush=True)
    shardwise.destroy()


if __name__ == "__main__":
    main()
