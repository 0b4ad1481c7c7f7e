"""README example: an nn.EmbeddingBag sharded row-wise, trained for a few steps.

    torchrun --standalone --nproc-per-node 2 embedding_bag_train.py
    mpiexec -n 2 python embedding_bag_train.py

Each rank trains on its own batches; the table's rows are split between the
ranks. At the end every rank checks its rows against a dense table trained
on all ranks' batches.
"""

import torch
import torch.nn as nn

import shardwise
from shardwise import ChunkShardingSpec, shard_parameter
from shardwise.sharded_optim import ShardedOptimizer


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s ids at ``step``: 8 bags of 4 ids from a 1000-row vocabulary."""
    return torch.randint(0, 1000, (8, 4), generator=torch.Generator().manual_seed(100 * step + rank))


group = shardwise.init()
torch.manual_seed(0)  # the same initial table on every rank
bag = nn.EmbeddingBag(1000, 16, mode="sum")
dense = nn.EmbeddingBag(1000, 16, mode="sum")
dense.load_state_dict(bag.state_dict())

spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(group.size)])
shard_parameter(bag, "weight", spec)  # each rank now holds 1000 / world rows
opt = ShardedOptimizer(dict(bag.named_parameters()), torch.optim.SGD, lr=0.5)

for step in range(3):
    loss = bag(batch(group.rank, step)).pow(2).mean()
    opt.zero_grad()
    loss.backward()  # every rank calls backward: gradients travel back to the rows' owners
    opt.step()
    print(f"rank {group.rank} step {step}: loss {loss.item():.4f}")

# The same training on one dense table: the sum of every rank's loss.
dense_opt = torch.optim.SGD(dense.parameters(), lr=0.5)
for step in range(3):
    dense_opt.zero_grad()
    sum(dense(batch(r, step)).pow(2).mean() for r in range(group.size)).backward()
    dense_opt.step()
shard = bag.weight.local_shards()[0]
start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
assert torch.allclose(shard.tensor, dense.weight[start : start + rows], atol=1e-6)
print(f"rank {group.rank}: rows {start}..{start + rows - 1} match dense training")
shardwise.destroy()
