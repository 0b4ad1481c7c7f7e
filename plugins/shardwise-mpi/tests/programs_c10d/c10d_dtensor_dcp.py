"""Run under ``mpiexec -n N`` with a shared directory as argv[1]: DTensor and DCP over backend "mpi4py".

Importing ``shardwise_mpi`` registers nothing; after the documented
``shardwise_mpi.register_torch_backend()``, ``init_process_group("mpi4py")`` must
work (no rendezvous variables). Prints ``OK <rank> <checks>`` at the end.
"""

from __future__ import annotations

import os
import sys

import shardwise_mpi
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def main(ckpt_dir: str) -> None:
    assert "MPI4PY" not in dist.Backend._plugins, "import shardwise_mpi must not register backend mpi4py"
    shardwise_mpi.register_torch_backend()
    assert "MPI4PY" in dist.Backend._plugins, "register_torch_backend() must register backend mpi4py"
    dist.init_process_group("mpi4py")
    rank, n = dist.get_rank(), dist.get_world_size()
    checks = []
    mesh = init_device_mesh("cpu", (n,))
    assert mesh.get_group().getBackendName() == "mpi4py"

    # distribute_tensor broadcasts from rank 0: other ranks pass garbage.
    full = torch.arange(6.0 * n * 5).view(6 * n, 5) if rank == 0 else torch.zeros(6 * n, 5)
    expected = torch.arange(6.0 * n * 5).view(6 * n, 5)
    d = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(d.to_local(), expected.chunk(n, 0)[rank]), d.to_local()
    checks.append("distribute_tensor Shard(0)")
    assert torch.equal(d.full_tensor(), expected)
    checks.append("full_tensor")
    r = d.redistribute(mesh, [Replicate()])
    assert torch.equal(r.to_local(), expected)
    checks.append("redistribute Replicate")
    s1 = d.redistribute(mesh, [Shard(1)])  # all-to-all
    assert torch.equal(s1.to_local(), expected.chunk(n, 1)[rank]), s1.to_local()
    assert torch.equal(s1.full_tensor(), expected)
    checks.append("redistribute Shard(1)")
    back = r.redistribute(mesh, [Shard(0)])
    assert torch.equal(back.to_local(), expected.chunk(n, 0)[rank])
    checks.append("redistribute Replicate->Shard(0)")
    # an op with a partial result: sum over the sharded dim reduces across ranks
    total = d.sum()
    assert torch.equal(total.full_tensor(), expected.sum()), total
    checks.append("sum (Partial -> all_reduce)")
    # uneven shards: 7 rows over n ranks
    u = distribute_tensor(torch.arange(14.0).view(7, 2), mesh, [Shard(0)])
    assert torch.equal(u.full_tensor(), torch.arange(14.0).view(7, 2))
    assert torch.equal(u.redistribute(mesh, [Shard(1)]).full_tensor(), torch.arange(14.0).view(7, 2))
    checks.append("uneven Shard(0)")
    # autograd through redistribute
    x = distribute_tensor(expected.clone(), mesh, [Shard(0)]).requires_grad_()
    (x.redistribute(mesh, [Replicate()]) * 2).sum().backward()
    assert isinstance(x.grad, DTensor) and torch.equal(x.grad.full_tensor(), torch.full_like(expected, 2.0))
    checks.append("backward through redistribute")

    # DCP: save a sharded and a replicated DTensor plus a plain tensor, load into fresh ones.
    state = {
        "w": distribute_tensor(expected.clone(), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.arange(5.0), mesh, [Replicate()]),
        "step": torch.tensor(7),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(ckpt_dir))
    dist.barrier()
    loaded = {
        "w": distribute_tensor(torch.zeros_like(expected), mesh, [Shard(1)]),  # another layout
        "b": distribute_tensor(torch.zeros(5), mesh, [Replicate()]),
        "step": torch.tensor(0),
    }
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(ckpt_dir))
    assert torch.equal(loaded["w"].full_tensor(), expected), loaded["w"].full_tensor()
    assert torch.equal(loaded["w"].to_local(), expected.chunk(n, 1)[rank])
    assert torch.equal(loaded["b"].to_local(), torch.arange(5.0))
    assert int(loaded["step"]) == 7
    checks.append("dcp save/load")

    # torch's own ShardedTensor over "mpi4py": its gather allocates on the
    # device it thinks the backend prefers, which must be the CPU on a host
    # without CUDA (registering "cuda" unconditionally sent it to CUDA).
    from torch.distributed._shard import sharded_tensor as torch_st
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(n)])
    tst = torch_st.zeros(spec, 2 * n + 1, 3)
    for shard in tst.local_shards():
        shard.tensor.fill_(rank + 1)
    gathered = torch.empty(2 * n + 1, 3) if rank == 0 else None
    tst.gather(dst=0, out=gathered)
    if gathered is not None:
        rows = [len(c) for c in torch.arange(2 * n + 1).chunk(n)]
        want = torch.cat([torch.full((k, 3), float(r + 1)) for r, k in enumerate(rows)])
        assert torch.equal(gathered, want), gathered
    checks.append("torch ShardedTensor gather")

    dist.destroy_process_group()
    print(f"OK {rank} {len(checks)}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
