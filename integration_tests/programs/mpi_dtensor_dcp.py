"""torch-native code over MPI: init_process_group("mpi4py") with no rendezvous variables, DTensor, checkpoint.

Also shardwise tensors over that torch group: ``dcp.save`` of a ShardedTensor
sharded by rows, ``dcp.load`` into one sharded by columns.
"""

import sys

import shardwise_mpi
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardwise
from shardwise import ChunkShardingSpec
from shardwise.torch_group import wrap_process_group

shardwise_mpi.register_torch_backend()  # importing registers nothing: ask for "mpi4py"
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

group = wrap_process_group(dist.group.WORLD)  # a shardwise Group over the "mpi4py" torch process group
places = [f"rank:{r}/cpu" for r in range(size)]
st = shardwise.shard_tensor(full, ChunkShardingSpec(dim=0, placements=places), src_rank=0, process_group=group)
dcp.save({"st": st}, checkpoint_id=path + "-sharded")
cols = ChunkShardingSpec(dim=1, placements=list(reversed(places)))
loaded = shardwise.shard_tensor(torch.zeros(5, 6), cols, src_rank=0, process_group=group)
dcp.load({"st": loaded}, checkpoint_id=path + "-sharded")
assert torch.equal(loaded.full_tensor(), full)
print(f"rank {rank} of {size} OK", flush=True)
dist.destroy_process_group()
