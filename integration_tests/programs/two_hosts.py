"""A job whose ranks span hosts: node-local facts, a reshard of every layout pair, a checkpoint in a shared directory.

    two_hosts.py work CKPT_DIR     # any launcher, ranks on several hosts
    two_hosts.py loop              # all_reduce until killed (a host is made to vanish meanwhile)

``work`` prints, per rank, one line of node-local facts and checks them:
the launcher's local rank and local world size against the ranks
``Group.local_ranks()`` finds on this host (the device a CUDA backend would
bind is ``cuda:<local rank>``). Then a tensor is scattered in each of six
layouts (row and column chunks, a chunk list with more pieces than columns,
a grid, ranks of one host only, one rank) and resharded into each of the
six, and every shard checked against the dense tensor. Last, the ranks
save a row-sharded model to CKPT_DIR (which every host must see) and load
it back into columns placed in reverse, so each rank reads rows other
hosts wrote.
"""

from __future__ import annotations

import itertools
import math
import socket
import sys
import time

import torch

import shardwise
import shardwise.checkpoint
from shardwise import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata, ShardingSpec, shard_parameter


def say(line: str) -> None:
    """One line in one write: lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def node_local_facts(group: shardwise.Group) -> None:
    launch = shardwise.launch_info()
    hosts = group.hosts()
    local = group.local_ranks()
    say(
        f"rank {group.rank} on {socket.gethostname()}: local rank {launch.local_rank} of "
        f"{launch.local_world_size}, ranks on this host {list(local)}, hosts "
        + ", ".join(f"{h.name}={list(h.ranks)}" for h in hosts)
        + f"; a CUDA backend would bind cuda:{launch.local_rank}"
    )
    assert local[launch.local_rank] == group.rank, (local, launch)
    assert launch.local_world_size in (None, len(local)), (local, launch)
    assert all(h.name != socket.gethostname() or h.ranks == local for h in hosts), hosts


def layouts(world: int, size: list[int]) -> dict[str, ShardingSpec]:
    ranks = list(range(world))
    place = [f"rank:{r}/cpu" for r in ranks]
    half = [size[0] // 2, size[1] // 2]
    grid = [
        ShardMetadata([r0, c0], [r1 - r0, c1 - c0], place[(k + 1) % world])
        for k, ((r0, r1), (c0, c1)) in enumerate(
            itertools.product([(0, half[0]), (half[0], size[0])], [(0, half[1]), (half[1], size[1])])
        )
    ]
    return {
        "rows": ChunkShardingSpec(0, place),
        "columns reversed": ChunkShardingSpec(1, place[::-1]),
        "columns, more pieces than columns": ChunkShardingSpec(1, [place[-1], *place, *place]),
        "grid": EnumerableShardingSpec(grid),
        "first host only": ChunkShardingSpec(0, place[: max(1, world // 2)]),
        "one rank": EnumerableShardingSpec([ShardMetadata([0, 0], size, place[-1])]),
    }


def check(st: shardwise.ShardedTensor, dense: torch.Tensor, where: str) -> None:
    for shard in st.local_shards():
        piece, md = dense, shard.metadata
        for dim, (offset, length) in enumerate(zip(md.shard_offsets, md.shard_sizes, strict=True)):
            piece = piece.narrow(dim, offset, length)
        assert torch.equal(shard.tensor, piece), (where, shard.metadata)


def every_reshard(group: shardwise.Group) -> int:
    size = [9, 10]
    dense = torch.arange(math.prod(size), dtype=torch.float64).view(size)
    specs = layouts(group.size, size)
    pairs = 0
    for (a, src), (b, dst) in itertools.product(specs.items(), repeat=2):
        st = shardwise.shard_tensor(dense, src, src_rank=0)
        check(st, dense, f"scatter into {a}")
        st.reshard(dst)
        check(st, dense, f"{a} -> {b}")
        assert torch.equal(st.full_tensor(), dense), f"{a} -> {b}"
        pairs += 1
    return pairs


def shared_checkpoint(group: shardwise.Group, path: str) -> None:
    places = [f"rank:{r}/cpu" for r in range(group.size)]
    torch.manual_seed(0)
    saved = torch.nn.Linear(6, 4 * group.size + 1)
    truth = saved.weight.detach().clone()
    shard_parameter(saved, "weight", ChunkShardingSpec(0, places))
    shardwise.checkpoint.save({"model": saved.state_dict()}, path)
    fresh = torch.nn.Linear(6, 4 * group.size + 1)
    shard_parameter(fresh, "weight", ChunkShardingSpec(1, places[::-1]))
    state = {"model": fresh.state_dict()}
    shardwise.checkpoint.load(state, path)
    assert torch.equal(fresh.weight.full_tensor(), truth)
    say(f"rank {group.rank}: checkpoint in {path} saved by rows and loaded into reversed columns")


def loop(group: shardwise.Group) -> None:
    """all_reduce forever: the job ends when a host is lost (or the test's timeout kills it)."""
    buf = torch.ones(1 << 16)
    announce_at, announced = time.monotonic() + 0.5, False
    try:
        while True:
            group.all_reduce(buf)
            if not announced and time.monotonic() > announce_at:
                say(f"rank {group.rank} on {socket.gethostname()}: in the loop")
                announced = True
    except Exception as exc:
        say(f"rank {group.rank} on {socket.gethostname()}: FAILED after losing a host: {type(exc).__name__}: {exc}")
        raise


def main() -> None:
    group = shardwise.init()
    if sys.argv[1] == "loop":
        loop(group)
        return
    node_local_facts(group)
    pairs = every_reshard(group)
    say(f"rank {group.rank} ({group.backend}): {pairs} reshards between every pair of 6 layouts match the dense tensor")
    shared_checkpoint(group, sys.argv[2])
    shardwise.destroy()


if __name__ == "__main__":
    main()
