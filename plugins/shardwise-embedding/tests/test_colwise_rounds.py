"""Column-wise lookups on one host take two rounds of the backend (``shardwise.sdk.RoundTrip``).

The agreement carries the addresses, every owner reads the ids straight from
the askers and writes its answers straight into their buffers, and one
closing round ends the call: two all-gathers of the backend per forward,
where an all-gather of ids and an all-to-all of answers by one copy took
five. Outputs and gradients equal those of a group that keeps the backend's
collectives (``SHARDWISE_LOCAL_COPY=0``), including a rank with no bags,
uneven column shards and a rank holding two of them.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from emb_helpers import dense_weight, random_ids, run

import shardwise
from shardwise import ShardedTensor
from shardwise._comm import local_copy
from shardwise._comm.group import Group
from shardwise.sharding_spec import ChunkShardingSpec

D = 20
V = 300


def _columns(w: int) -> ChunkShardingSpec:
    """Column chunks of uneven widths, rank 0 holding two of them."""
    return ChunkShardingSpec(dim=1, placements=[f"rank:{r % w}/cpu" for r in range(w + 1)])


def _count_rounds(g: Group, call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result and how many all-gathers of the backend it ran."""
    real = g._all_gather
    calls = []

    def counted(*args: Any) -> None:
        calls.append(1)
        real(*args)

    g._all_gather = counted  # type: ignore[method-assign]
    try:
        return call(), len(calls)
    finally:
        del g._all_gather


def _lookups(g: Group, seed: int) -> dict[str, Any]:
    dense = dense_weight(V, D, seed)
    weight = shardwise.shard_tensor(dense.clone().requires_grad_(True), _columns(g.size), process_group=g)
    assert isinstance(weight, ShardedTensor)
    n = 0 if g.rank == 1 else 37 + g.rank  # rank 1 has no bags
    ids = random_ids(V, (n, 6), seed, g.rank)
    out: dict[str, Any] = {}
    for name, op in (
        ("bag", lambda: F.embedding_bag(ids, weight, mode="sum")),
        ("lookup", lambda: F.embedding(ids, weight)),
    ):
        before = local_copy.stats.get("round_trip", 0)
        result, rounds = _count_rounds(g, op)
        out[f"{name} rounds"] = rounds
        out[f"{name} trips"] = local_copy.stats.get("round_trip", 0) - before
        (result * torch.arange(result.numel(), dtype=result.dtype).view(result.shape)).sum().backward()
        out[name] = result.detach()
    out["grad"] = torch.cat([s.tensor.grad.reshape(-1) for s in weight.local_shards()])
    return out


def _with_and_without(seed: int) -> dict[str, Any]:
    g = shardwise.get_default_group()
    os.environ[local_copy.LOCAL_COPY_ENV] = "0"
    try:
        off = g.new_group(list(range(g.size)))
        assert off is not None
        off.all_gather(torch.zeros(1 << 16))  # settles its verdict with the switch off
    finally:
        del os.environ[local_copy.LOCAL_COPY_ENV]
    on = _lookups(g, seed)
    plain = _lookups(off, seed)
    same = {k: torch.equal(on[k], plain[k]) for k in ("bag", "lookup", "grad")}
    return {
        "same": same,
        **{k: v for k, v in on.items() if "rounds" in k or "trips" in k},
        "plain trips": plain["bag trips"] + plain["lookup trips"],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_column_wise_lookups_take_two_rounds_and_equal_the_collectives_path(world_size: int) -> None:
    for res in run(_with_and_without, world_size, 7):
        assert res["same"] == {"bag": True, "lookup": True, "grad": True}, res
        assert res["bag trips"] == 1 and res["lookup trips"] == 1, res
        assert res["bag rounds"] == 2 and res["lookup rounds"] == 2, res
        assert res["plain trips"] == 0, res
