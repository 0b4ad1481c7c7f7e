"""The README's end-to-end example: shard a parameter, run a pointwise op, reshard, gather."""

import sys

import torch

import shardwise
from shardwise import ChunkShardingSpec, shard_parameter

group = shardwise.init()
rank, size = group.rank, group.size

torch.manual_seed(0)  # the same dense model on every rank
model = torch.nn.Linear(4, 3 * size + 1, bias=False)  # uneven rows: the last shard is shorter
dense = model.weight.detach().clone()

rows = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(size)])
shard_parameter(model, "weight", rows)  # rank 0's weight, scattered by rows
w = model.weight  # a ShardedTensor, and still an nn.Parameter
local = list(w.local_tensor().shape)
sys.stdout.write(f"rank {rank} ({group.backend}): {type(w).__name__} {list(w.size())}, local rows {local}\n")

y = torch.relu(w * 2 - 1)  # pointwise ops run on the local shards, with autograd
cols = ChunkShardingSpec(dim=1, placements=[f"rank:{r}/cpu" for r in reversed(range(size))])
y.reshard(cols)  # rows -> columns: an all-to-all, each element sent at most once
sys.stdout.write(f"rank {rank}: after reshard, local columns {list(y.local_tensor().shape)}\n")

full = torch.empty(y.size()) if rank == 0 else None
y.gather(dst=0, out=full)  # the whole tensor on rank 0
if rank == 0:
    assert full is not None and torch.equal(full, torch.relu(dense * 2 - 1))
    sys.stdout.write("rank 0: gathered tensor equals the dense computation\n")
assert torch.equal(y.full_tensor(), torch.relu(dense * 2 - 1))  # ... or on every rank
shardwise.destroy()
