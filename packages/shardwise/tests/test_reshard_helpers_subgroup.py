"""torch 2.13's reshard and metadata helpers on a subgroup: placements name global ranks.

On 3 ranks with ``dist.new_group([1, 2])``, torch's ``reshuffle_local_shard``
and ``reshard_local_shard`` mix the group's numbering with the placements'
(they index a list of the group's size by a placement's global rank, and
take this rank's group rank for a global one), so both raise IndexError;
shardwise's move each chunk to the global rank its placement names and
index the returned metadata by group rank. On ``new_group([0, 1])``, where
the two numberings coincide, both give the same result. The metadata
helpers (``build_metadata_from_local_shards``, ``build_global_metadata``)
check placements against the group's global ranks, as torch's do.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from shardwise.sharded_tensor import Shard, ShardMetadata
from shardwise.sharded_tensor import reshard as sw_reshard
from shardwise.sharded_tensor import utils as sw_utils
from shardwise.sharding_spec import ChunkShardingSpec

from rank_helpers import HAS_TORCH_PG, outcome, run

pytestmark = pytest.mark.skipif(not HAS_TORCH_PG, reason="needs torch process groups (new_group) next to the backend")

DENSE = torch.arange(48.0).view(6, 8)


def _places(ranks: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in ranks]


def _box(md: Any) -> torch.Tensor:
    (r0, c0), (nr, nc) = md.shard_offsets, md.shard_sizes
    return DENSE[r0 : r0 + nr, c0 : c0 + nc]


def _result(fn: Callable[[], Any]) -> Any:
    """The new local shard (offsets, sizes, placement, holds DENSE's values there) and every shard's placement."""
    try:
        (shard,), metas = fn()
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        return type(exc).__name__, str(exc)
    md = shard.metadata
    return (md.shard_offsets, md.shard_sizes, str(md.placement), torch.equal(shard.tensor, _box(md)),
            [str(m.placement) for m in metas])


def _reshard_helpers(pg: Any, ranks: list[int]) -> dict[str, Any]:
    import torch.distributed._shard.sharded_tensor.reshard as torch_reshard
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchSpec

    me = dist.get_rank()
    # This rank's rows of DENSE under a dim-0 chunk spec placed on ranks[0], ranks[1].
    local = DENSE[3 * ranks.index(me) : 3 * ranks.index(me) + 3].clone()
    out = {}
    for fn, dim in (("reshuffle_local_shard", 0), ("reshard_local_shard", 1)):
        # Same dim, placements swapped (reshuffle), or the other dim (reshard).
        old, new = ChunkShardingSpec(0, _places(ranks)), ChunkShardingSpec(dim, _places(ranks[::-1]))
        out[fn] = _result(partial(getattr(sw_reshard, fn), local, DENSE.shape, old, new, pg))
        old, new = TorchSpec(0, _places(ranks)), TorchSpec(dim, _places(ranks[::-1]))
        out[f"torch_{fn}"] = _result(partial(getattr(torch_reshard, fn), local, DENSE.shape, old, new, pg))
    return out


def _describe(md: Any) -> list[tuple[list[int], list[int], str]]:
    return [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in md.shards_metadata]


def _metadata_helpers(pg: Any) -> dict[str, Any]:
    import torch.distributed._shard.sharded_tensor.utils as torch_utils
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as TorchShard

    me = dist.get_rank()
    rows = 3 * max(me - 1, 0)  # global ranks 1 and 2 hold rows 0..3 and 3..6
    boxes = {"mine": (f"rank:{me}/cpu", [rows, 0]), "rank0": ("rank:0/cpu", [0, 0])}
    out: dict[str, Any] = {}
    for case, (placement, offsets) in boxes.items():
        tensor = torch.ones(3, 8)
        ours = [Shard(tensor, ShardMetadata(offsets, [3, 8], placement))]
        theirs = [TorchShard(tensor, TorchShardMetadata(offsets, [3, 8], placement))]

        out[case] = outcome(partial(sw_utils.build_metadata_from_local_shards, ours, DENSE.shape, me, pg))
        out[f"torch_{case}"] = outcome(partial(torch_utils.build_metadata_from_local_shards, theirs, DENSE.shape, me, pg))
        if case == "mine" and me in (1, 2):
            local = sw_utils.build_metadata_from_local_shards(ours, DENSE.shape, me, pg)
            gathered: list[Any] = [None, None]
            dist.all_gather_object(gathered, local, group=pg)
            merged = sw_utils.build_global_metadata(gathered)
            their_local = torch_utils.build_metadata_from_local_shards(theirs, DENSE.shape, me, pg)
            their_gathered: list[Any] = [None, None]
            dist.all_gather_object(their_gathered, their_local, group=pg)
            out["global"] = _describe(merged)
            out["torch_global"] = _describe(torch_utils.build_global_metadata(their_gathered))
    return out


def _on_subgroups() -> dict[str, Any]:
    warnings.simplefilter("ignore")  # torch's deprecation warnings
    me = dist.get_rank()
    groups = {"12": ([1, 2], dist.new_group([1, 2])), "01": ([0, 1], dist.new_group([0, 1]))}
    seen: dict[str, Any] = {}
    for name, (ranks, pg) in groups.items():
        if me in ranks:
            seen[name] = _reshard_helpers(pg, ranks)
        else:
            # Outside the group: refused here, before any collective (no member waits for this rank).
            old, new = ChunkShardingSpec(0, _places(ranks)), ChunkShardingSpec(0, _places(ranks[::-1]))
            seen[name] = outcome(partial(sw_reshard.reshuffle_local_shard, DENSE[:3], DENSE.shape, old, new, pg))
    seen["metadata"] = _metadata_helpers(groups["12"][1])
    return seen


def test_reshard_and_metadata_helpers_on_a_subgroup() -> None:
    results = run(_on_subgroups, 3)
    rows = {1: [3, 0], 2: [0, 0]}  # reshuffled: global rank 2 now holds rows 0..3, rank 1 rows 3..6
    cols = {1: [0, 4], 2: [0, 0]}  # by columns: global rank 2 holds columns 0..4, rank 1 columns 4..8
    for me in (1, 2):
        sub = results[me]["12"]
        assert sub["reshuffle_local_shard"] == (rows[me], [3, 8], f"rank:{me}/cpu", True, _places([1, 2]))
        assert sub["reshard_local_shard"] == (cols[me], [6, 4], f"rank:{me}/cpu", True, _places([1, 2]))
        # torch indexes a 2-entry list by global rank 2.
        assert sub["torch_reshuffle_local_shard"] == ("IndexError", "list assignment index out of range")
        assert sub["torch_reshard_local_shard"] == ("IndexError", "list assignment index out of range")
    for me in (0, 1):
        # Where group ranks and global ranks coincide, shardwise's results are torch's.
        same = results[me]["01"]
        assert same["reshuffle_local_shard"] == same["torch_reshuffle_local_shard"]
        assert same["reshard_local_shard"] == same["torch_reshard_local_shard"]
        assert same["reshuffle_local_shard"][3] and same["reshard_local_shard"][3]
    for me, name in ((0, "12"), (2, "01")):
        kind, message = results[me][name]
        assert kind == "ValueError" and "not a member of the process group" in message, (me, message)
        assert "reshuffle_local_shard" in message, message
    for me, seen in enumerate(results):
        md = seen["metadata"]
        # Placements are checked against the group's global ranks, as in torch (not on a non-member).
        assert md["mine"] == md["torch_mine"] == ("ok", "") and md["rank0"][0] == md["torch_rank0"][0]
        if me in (1, 2):
            assert md["rank0"][0] == "ValueError"
            assert "Global rank 0 does not exist in input process group: [1, 2]" in md["rank0"][1]
            assert md["global"] == md["torch_global"] == [([0, 0], [3, 8], "rank:1/cpu"), ([3, 0], [3, 8], "rank:2/cpu")]
        else:
            assert md["rank0"] == ("ok", "")
