"""torch-native code over MPI: init_process_group("mpi4py") with no rendezvous variables, DTensor, checkpoint."""

import sys

import shardwise_mpi  # noqa: F401  (registers the "mpi4py" torch backend)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

dist.init_process_group("mpi4py")
rank, size = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (size,))
full = torch.arange(5.0 * 6).reshape(5, 6)  # 5 rows: uneven over 2 or 3 ranks
dt = distribute_tensor(full, mesh, [Shard(0)])
assert torch.equal(dt.full_tensor(), full)
assert torch.equal(dt.redistribute(mesh, [Shard(1)]).full_tensor(), full)
assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full)

path = sys.argv[1]
dcp.save({"w": dt}, checkpoint_id=path)
target = distribute_tensor(torch.zeros(5, 6), mesh, [Shard(1)])  # load into another layout
state = {"w": target}
dcp.load(state, checkpoint_id=path)
assert torch.equal(state["w"].full_tensor(), full)
print(f"rank {rank} of {size} OK", flush=True)
dist.destroy_process_group()
