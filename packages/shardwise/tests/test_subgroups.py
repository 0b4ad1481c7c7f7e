"""Sub-groups made by ``Group.new_group``: overlapping members, nested groups, their timeout.

torch names a process group that only its members make
(``use_local_synchronization``) after its ranks and how many process groups the
calling rank already holds; a rank in more subgroups than its peers then
waited for them under another name until the timeout. These tests pin what
shardwise does instead.
"""

from __future__ import annotations

import torch

import shardwise

from rank_helpers import TEST_BACKEND, outcome
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


def nested_mismatch() -> dict[str, tuple[str, str]]:
    g = shardwise.get_default_group()
    parent = g.new_group([0, 1, 2])  # of 4: its later subgroups are made by their members only
    seen: dict[str, tuple[str, str]] = {}
    if parent is None:
        return seen
    only_first = parent.new_group([0])  # parent rank 0 now holds one process group more than rank 1
    assert (only_first is not None) == (parent.rank == 0)
    seen["uneven"] = outcome(lambda: parent.new_group([0, 1]))
    # Members holding the same number still get a working group.
    last = parent.new_group([1, 2])
    seen["even"] = ("ok", "") if last is None else ("ok", str(_sum_of_ones(last)))
    parent.barrier()
    return seen


def test_nested_subgroups_fail_together_where_torch_would_wait() -> None:
    results = _run(nested_mismatch, 4)
    assert results[3] == {}
    for rank in range(3):
        kind, message = results[rank]["uneven"]
        if TEST_BACKEND == "test-gloo":
            counts = message.split("by rank of this group: ")[1].split("}")[0]
            assert kind == "ValueError" and "hold different numbers" in message, (rank, kind, message)
            held = dict(item.split(": ") for item in counts.strip("{").split(", "))
            assert int(held["0"]) == int(held["1"]) + 1, message
        else:  # MPI splits its own communicators, whatever torch holds
            assert kind == "ok", (rank, kind, message)
    assert [results[r]["even"] for r in range(3)] == [("ok", ""), ("ok", "2.0"), ("ok", "2.0")]
