"""Sharded embeddings over a subgroup: placements name global ranks, lookups route within the group.

On 3 ranks with ``pg = new_group([1, 2])``, a weight placed on ``rank:2`` then
``rank:1`` (global ranks, as in torch) must look up the right rows and
columns: each member's result and gradient equal the dense op's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from emb_helpers import TEST_BACKEND, run

import shardwise
from shardwise.sharding_spec import ChunkShardingSpec

pytestmark = pytest.mark.skipif(TEST_BACKEND == "mpi", reason="needs torch process groups (new_group)")


def _subgroup_lookups() -> dict[str, Any]:
    me = dist.get_rank()
    pg = dist.new_group([1, 2])
    if me not in (1, 2):
        return {}
    torch.manual_seed(0)
    dense = torch.randn(7, 4, dtype=torch.float64)
    ids = torch.tensor([[0, 6, 3], [5, 1, 1]]) if me == 1 else torch.tensor([[2, 4, 6], [0, 3, 5]])
    offsets = torch.tensor([0, 2, 5])
    flat = torch.tensor([0, 6, 3, 5, 1, 1, 2, 4])
    out: dict[str, Any] = {}
    for name, dim in (("rowwise", 0), ("colwise", 1)):
        spec = ChunkShardingSpec(dim, ["rank:2/cpu", "rank:1/cpu"])
        weight = shardwise.shard_tensor(dense.clone(), spec, src_rank=0, process_group=pg)
        for shard in weight.local_shards():
            shard.tensor.requires_grad_()
        looked_up = F.embedding(ids, weight)
        bagged = F.embedding_bag(flat, weight, offsets, mode="sum")
        (looked_up.sum() + bagged.sum()).backward()
        reference = dense.clone().requires_grad_()
        expected = F.embedding(ids, reference)
        expected_bag = F.embedding_bag(flat, reference, offsets, mode="sum")
        # Every member's ids reach the reference gradient: sum both members' lookups.
        other = torch.tensor([[2, 4, 6], [0, 3, 5]]) if me == 1 else torch.tensor([[0, 6, 3], [5, 1, 1]])
        (expected.sum() + F.embedding(other, reference).sum() + 2 * expected_bag.sum()).backward()
        assert reference.grad is not None
        grads = []
        for shard in weight.local_shards():
            o, n = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            assert shard.tensor.grad is not None
            grads.append(torch.allclose(shard.tensor.grad, reference.grad[o[0] : o[0] + n[0], o[1] : o[1] + n[1]]))
        out[name] = {
            "lookup": torch.allclose(looked_up, expected),
            "bag": torch.allclose(bagged, expected_bag),
            "grad": grads,
            "local": [str(s.metadata.placement) for s in weight.local_shards()],
        }
    return out


def test_lookups_follow_global_rank_placements_in_a_subgroup() -> None:
    results = run(_subgroup_lookups, 3)
    assert results[0] == {}
    for me in (1, 2):
        for name in ("rowwise", "colwise"):
            seen = results[me][name]
            assert seen == {"lookup": True, "bag": True, "grad": [True], "local": [f"rank:{me}/cpu"]}, (me, name)
