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
from shardwise_embedding import _colwise

import shardwise
from shardwise import ShardedTensor
from shardwise._comm import local_copy, round_trip
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


def _one_rank_raises_while_pooling(faulty: int) -> dict[str, Any]:
    g = shardwise.get_default_group()
    dense = dense_weight(V, D, 3)
    weight = shardwise.shard_tensor(dense.clone(), _columns(g.size), process_group=g)
    ids = random_ids(V, (11, 4), 3, g.rank)
    out: dict[str, Any] = {}
    for name, target, op in (
        ("bag", "pool_rows", lambda: F.embedding_bag(ids, weight, mode="sum")),
        ("lookup", "take_rows", lambda: F.embedding(ids, weight)),
    ):
        real = getattr(_colwise, target)

        def fail(*args: Any, real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            if g.rank == faulty:
                raise MemoryError(f"no room to pool on rank {faulty}")
            return real(*args, **kwargs)

        setattr(_colwise, target, fail)
        try:
            op()
            out[name] = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - every rank's error is the finding
            out[name] = (type(exc).__name__, str(exc))
        finally:
            setattr(_colwise, target, real)
        out[f"{name} pinned"] = round_trip.pinned_count()
        # The group is still in step: the same call now succeeds on every rank, by the same path.
        before = local_copy.stats.get("round_trip", 0)
        out[f"{name} after"] = torch.equal(op(), F.embedding_bag(ids, dense, mode="sum") if name == "bag"
                                           else F.embedding(ids, dense))  # fmt: skip
        out[f"{name} trips after"] = local_copy.stats.get("round_trip", 0) - before
    return out


@pytest.mark.parametrize(("world_size", "faulty"), [(2, 0), (3, 2)])
def test_a_rank_that_raises_before_answering_raises_its_error_and_its_peers_peer_error(
    world_size: int, faulty: int
) -> None:
    # A rank whose own work raised after the round trip was bound used to leave its peers in the closing
    # round until the timeout; it now closes the round trip before raising.
    for rank, res in enumerate(run(_one_rank_raises_while_pooling, world_size, faulty)):
        for name in ("bag", "lookup"):
            kind, message = res[name]
            if rank == faulty:
                assert (kind, message) == ("MemoryError", f"no room to pool on rank {faulty}"), res
            else:
                assert kind == "PeerError" and f"rank(s) [{faulty}] raised an error of their own" in message, res
            assert res[f"{name} pinned"] == 0, res
            assert res[f"{name} after"] is True and res[f"{name} trips after"] == 1, res
