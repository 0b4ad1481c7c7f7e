"""Sub-groups made by ``Group.new_group``: overlapping members, nested groups, their timeout.

torch names a process group that only its members make
(``use_local_synchronization``) after its ranks and how many process groups the
calling rank already holds; a rank in more subgroups than its peers then
waited for them under another name until the timeout. These tests pin what
shardwise does instead: every process makes a subgroup of the default group,
and the members of a smaller group's subgroup first even out their counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise

from rank_helpers import TEST_BACKEND
from rank_helpers import run as _run


def _sum_of_ones(group: shardwise.Group) -> float:
    return float(group.all_reduce(torch.ones(1)).item())


def overlapping() -> list[float]:
    g = shardwise.get_default_group()
    sums = []
    # Rank 1 is in both of the first two; rank 0 is in the first and third only.
    for members in ([0, 1], [1, 2], [0, 2], [0, 1, 2]):
        sub = g.new_group(members)
        assert (sub is not None) == (g.rank in members), (members, g.rank)
        if sub is not None:
            sums.append(_sum_of_ones(sub))
    g.barrier()
    return sums


def test_overlapping_subgroups_each_work() -> None:
    # Before: torch's new_group waited under different names on ranks 1 and 2 (a hang until the timeout).
    assert _run(overlapping, 3) == [[2.0, 2.0, 3.0], [2.0, 2.0, 3.0], [2.0, 2.0, 3.0]]


def subgroup_timeouts() -> list[object]:
    g = shardwise.get_default_group()
    sub = g.new_group([0, 1])
    assert sub is not None
    nested = sub.new_group([1])
    if g.rank != 1 or TEST_BACKEND != "test-gloo":
        return []
    return [x._collective_timeout() for x in (g, sub, nested)]  # type: ignore[attr-defined]


def test_subgroups_keep_the_timeout_of_init() -> None:
    results = _run(subgroup_timeouts, 2)
    if TEST_BACKEND != "test-gloo":
        assert results == [[], []]  # the timeout read here is a torch process group's
        return
    parent, sub, nested = results[1]
    # torch would have given both its default of 30 minutes.
    assert parent is not None and parent.total_seconds() < 1800
    assert sub == parent and nested == parent


def _torch_groups_held(group: shardwise.Group) -> list[int]:
    """How many torch process groups each rank of ``group`` holds (what torch names a local group after)."""
    held = torch.tensor([float(len(dist.distributed_c10d._world.pg_names))])
    return [int(t.item()) for t in group.all_gather(held)]


def nested_uneven() -> dict[str, object]:
    g = shardwise.get_default_group()
    parent = g.new_group([0, 1, 2])  # of 4: its later subgroups are made by their members only
    seen: dict[str, object] = {}
    if parent is None:
        return seen
    for attempt in range(2):
        only_first = parent.new_group([0])  # parent rank 0 now holds one process group more than rank 1
        assert (only_first is not None) == (parent.rank == 0)
        seen[f"held {attempt}"] = _torch_groups_held(parent)
        pair = parent.new_group([0, 1])
        assert (pair is not None) == (parent.rank in (0, 1))
        if pair is not None:
            seen[f"uneven {attempt}"] = _sum_of_ones(pair)
    last = parent.new_group([1, 2])  # members holding the same number, as before
    if last is not None:
        seen["even"] = _sum_of_ones(last)
    parent.barrier()
    return seen


def test_nested_subgroups_work_whatever_their_members_hold() -> None:
    # Before: the members of [0, 1] named it differently and waited for each other until the
    # timeout (then: a ValueError on every rank naming the counts).
    results = _run(nested_uneven, 4)
    assert results[3] == {}
    for rank in range(3):
        expected = {"uneven 0": 2.0, "uneven 1": 2.0} if rank < 2 else {}
        if rank > 0:
            expected["even"] = 2.0
        assert {k: v for k, v in results[rank].items() if not k.startswith("held")} == expected, results[rank]
    if TEST_BACKEND == "test-gloo":  # over MPI, subgroups split communicators: torch holds nothing new
        for attempt in range(2):
            held = results[0][f"held {attempt}"]
            assert isinstance(held, list) and held[0] > held[1], held  # the case torch names apart
