"""``equal``/``allclose``/``any``/``all`` on a rank outside the tensors' group answer locally, as torch 2.13 does.

On 3 ranks with ``pg = dist.new_group([1, 2])``, rank 0 gets torch's
``GroupMember.NON_GROUP_MEMBER`` and tensors with no local shards. torch's
``equal``/``allclose`` return that rank's own answer there (True: nothing to
compare) without a collective; shardwise raised a RuntimeError from the
group stand-in's refused ``all_reduce``. The members still agree on the
global answer among themselves.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise import sharded_tensor
from shardwise.sharding_spec import ChunkShardingSpec

from rank_helpers import HAS_TORCH_PG, run

pytestmark = pytest.mark.skipif(not HAS_TORCH_PG, reason="needs torch process groups (new_group) next to the backend")

ROWS = ChunkShardingSpec(0, ["rank:1/cpu", "rank:2/cpu"])
COLS = ChunkShardingSpec(1, ["rank:1/cpu", "rank:2/cpu"])


def _answer(fn: Any) -> Any:
    """``fn()`` as a bool, or (error type, message) when it raised."""
    try:
        return bool(fn())
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        return type(exc).__name__, str(exc)


def _compare_on_subgroup() -> dict[str, Any]:
    import torch.distributed._shard.sharded_tensor as torch_st
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchSpec

    warnings.simplefilter("ignore")  # torch's deprecation warnings
    pg = dist.new_group([1, 2])
    ones = sharded_tensor.ones(ROWS, 4, 6, process_group=pg)
    also_ones = sharded_tensor.ones(ROWS, 4, 6, process_group=pg)
    zeros = sharded_tensor.zeros(ROWS, 4, 6, process_group=pg)
    by_cols = sharded_tensor.ones(COLS, 4, 6, process_group=pg)
    seen: dict[str, Any] = {
        "shards": len(ones.local_shards()),
        "equal": _answer(lambda: torch.equal(ones, also_ones)),
        "equal_zeros": _answer(lambda: torch.equal(ones, zeros)),
        "method_equal_zeros": _answer(lambda: ones.equal(zeros)),
        "allclose": _answer(lambda: torch.allclose(ones, also_ones)),
        "allclose_zeros": _answer(lambda: torch.allclose(ones, zeros, atol=0.5)),
        "equal_other_layout": _answer(lambda: torch.equal(ones, by_cols)),
        "equal_plain": _answer(lambda: torch.equal(ones, torch.zeros(4, 6))),
        "equal_plain_other_size": _answer(lambda: torch.equal(ones, torch.ones(3, 6))),
        "any_ones": _answer(lambda: torch.any(ones)),
        "all_ones": _answer(lambda: torch.all(ones)),
        "any_zeros": _answer(lambda: torch.any(zeros)),
        "all_zeros": _answer(lambda: zeros.all()),
    }
    if dist.get_rank() == 0:
        # torch's own answers outside the group (on members it needs an accelerator for its flag).
        t_ones = torch_st.ones(TorchSpec(0, ["rank:1/cpu", "rank:2/cpu"]), 4, 6, process_group=pg)
        t_zeros = torch_st.zeros(TorchSpec(0, ["rank:1/cpu", "rank:2/cpu"]), 4, 6, process_group=pg)
        seen["torch_equal_zeros"] = _answer(lambda: torch.equal(t_ones, t_zeros))
        seen["torch_allclose_zeros"] = _answer(lambda: torch.allclose(t_ones, t_zeros))
    # The members are still in step with each other after rank 0 answered alone.
    dist.barrier()
    return seen


def test_ranks_outside_the_group_answer_locally() -> None:
    outside, *members = run(_compare_on_subgroup, 3)
    # Outside: the answer over no shards (True where torch gives True), with no collective;
    # tensors whose layouts or sizes differ are known to differ without one.
    assert outside == {
        "shards": 0,
        "equal": True,
        "equal_zeros": True,
        "method_equal_zeros": True,
        "allclose": True,
        "allclose_zeros": True,
        "equal_other_layout": False,
        "equal_plain": True,
        "equal_plain_other_size": False,
        "any_ones": False,
        "all_ones": True,
        "any_zeros": False,
        "all_zeros": True,
        "torch_equal_zeros": True,
        "torch_allclose_zeros": True,
    }
    # Members: the global answer.
    for member in members:
        assert member == {
            "shards": 1,
            "equal": True,
            "equal_zeros": False,
            "method_equal_zeros": False,
            "allclose": True,
            "allclose_zeros": False,
            "equal_other_layout": False,
            "equal_plain": False,
            "equal_plain_other_size": False,
            "any_ones": True,
            "all_ones": True,
            "any_zeros": False,
            "all_zeros": False,
        }
