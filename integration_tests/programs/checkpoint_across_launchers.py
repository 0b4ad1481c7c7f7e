"""Save a checkpoint under one launcher and backend, load it under another into a different spec.

    mpiexec -n 2 python checkpoint_across_launchers.py save PATH        # backend mpi
    torchrun --nproc-per-node 3 checkpoint_across_launchers.py load PATH  # backend gloo

``save`` shards a model's weight by rows and saves it with
``shardwise.checkpoint`` (DCP format, over whatever backend the launcher
picked). ``load`` shards a fresh model by columns over another number of
ranks and loads the checkpoint twice: with ``shardwise.checkpoint.load`` and
with torch's own ``dcp.load`` (whose collectives run on the torch gloo group).
"""

import sys

import torch
import torch.distributed.checkpoint as dcp

import shardwise
import shardwise.checkpoint
from shardwise import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata, shard_parameter

mode, path = sys.argv[1], sys.argv[2]
group = shardwise.init()
rank, size = group.rank, group.size
places = [f"rank:{r}/cpu" for r in range(size)]

torch.manual_seed(0)
saved = torch.nn.Linear(6, 11)  # 11 rows: uneven over 2 or 3 ranks
truth = {name: p.detach().clone() for name, p in saved.named_parameters()}

if mode == "save":
    shard_parameter(saved, "weight", ChunkShardingSpec(dim=0, placements=places))
    shardwise.checkpoint.save({"model": saved.state_dict(), "step": 42}, path)
    print(f"rank {rank} of {size} ({group.backend}) saved", flush=True)
else:
    fresh = torch.nn.Linear(6, 11)
    with torch.no_grad():
        fresh.weight.zero_()
        fresh.bias.zero_()
    shard_parameter(fresh, "weight", ChunkShardingSpec(dim=1, placements=list(reversed(places))))
    state = {"model": fresh.state_dict(), "step": 0}
    shardwise.checkpoint.load(state, path)
    assert state["step"] == 42, state["step"]
    assert torch.equal(fresh.weight.full_tensor(), truth["weight"])
    assert torch.equal(fresh.bias.detach(), truth["bias"])
    # torch's own loader, into a grid of boxes this time.
    grid = EnumerableShardingSpec(
        [ShardMetadata([r0, 0], [n, 6], places[i % size]) for i, (r0, n) in enumerate([(0, 4), (4, 4), (8, 3)])]
    )
    target = shardwise.shard_tensor(torch.zeros(11, 6), grid, src_rank=0)
    dcp.load({"model.weight": target}, checkpoint_id=path)
    assert torch.equal(target.full_tensor(), truth["weight"])
    print(f"rank {rank} of {size} ({group.backend}) loaded a {list(target.size())} weight saved elsewhere", flush=True)
shardwise.destroy()
