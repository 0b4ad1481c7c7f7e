"""What ``integration_tests/test_fuzz.py`` found in the sharded ``embedding_bag``, on 2 real ranks.

Ids with no bag to go to (1-D ids with empty ``offsets``): row-wise sum/mean
raised a RuntimeError on that rank alone (its peers then waited in the first
collective), and max mode crashed both ranks inside torch's max kernel. No
id belongs to a bag there, so the result is ``(0, embedding_dim)``; the ids
are still range-checked, as the README documents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from emb_helpers import chunk_spec, dense_weight, outcome, run, shard_dense

import shardwise


def ids_without_bags(shard_dim: int) -> dict[str, tuple[str, str]]:
    """Rank 1 passes ids but no bag, in every mode; then an out-of-range id with no bag."""
    rank = shardwise.get_default_group().rank
    dense = dense_weight(4, 3, "no bags")
    weight = shard_dense(dense, chunk_spec(shard_dim, [0, 1]), requires_grad=False)
    none = torch.empty(0, dtype=torch.int64)
    ids = torch.tensor([1, 1, 0]) if rank == 1 else none
    seen = {}
    for mode in ("sum", "mean", "max"):
        out: list[torch.Tensor] = []
        seen[mode] = outcome(lambda mode=mode, out=out: out.append(F.embedding_bag(ids, weight, none, mode=mode)))
        if out and out[0].shape != (0, 3):
            seen[mode] = ("wrong shape", str(tuple(out[0].shape)))
    bad = torch.tensor([9]) if rank == 1 else none
    seen["bad id"] = outcome(lambda: F.embedding_bag(bad, weight, none, mode="max"))
    return seen


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_ids_without_bags_give_no_bags(shard_dim: int) -> None:
    for seen in run(ids_without_bags, 2, shard_dim):
        assert seen["sum"] == seen["mean"] == seen["max"] == ("ok", ""), seen
        assert seen["bad id"][0] in ("BadIds", "IndexError") and "9" in seen["bad id"][1], seen


def alone_matches_the_general_path() -> dict[str, bool]:
    """World size 1 (the dense fast path) on the inputs where raw torch differs from the sharded op."""
    dense = dense_weight(6, 4, "alone")
    weight = shard_dense(dense, chunk_spec(0, [0]), requires_grad=False)
    none = torch.empty(0, dtype=torch.int64)
    seen = {}
    for mode in ("sum", "mean", "max"):
        # No bag: torch's kernel segfaults; the sharded op gives (0, D).
        seen[f"{mode} no bag"] = F.embedding_bag(torch.tensor([1, 2]), weight, none, mode=mode).shape == (0, 4)
        # include_last_offset: ids after the last offset belong to no bag (torch pools them into the last).
        out = F.embedding_bag(torch.tensor([1, 2, 3]), weight, torch.tensor([0, 1]), include_last_offset=True,
                              mode=mode)
        seen[f"{mode} last offset"] = torch.equal(out, F.embedding_bag(torch.tensor([1]), dense, torch.tensor([0]), mode=mode))
        # 2-D input with no columns: empty bags (torch: "step must be nonzero").
        seen[f"{mode} 2x0"] = torch.equal(
            F.embedding_bag(torch.zeros(2, 0, dtype=torch.int64), weight, mode=mode), torch.zeros(2, 4)
        )
    return seen


def test_world_size_1_fast_path_takes_the_same_bags_as_the_general_path() -> None:
    (seen,) = run(alone_matches_the_general_path, 1)
    assert seen and all(seen.values()), seen
