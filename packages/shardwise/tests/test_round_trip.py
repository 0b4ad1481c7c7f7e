"""Requests out, answers back in two rounds (``shardwise._comm.round_trip``, ``shardwise.sdk.RoundTrip``).

Against the collectives it replaces: every rank's request equals an
all-gather's, every box equals an all-to-all's, the gradient equals the
all-to-all's backward; blocks that do not fit what their receivers expect,
and a failed copy (a read or a write), raise on every rank; a group that cannot copy between
its ranks binds on no rank.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
import shardwise.nn.functional as dist_f
from shardwise import sdk
from shardwise._comm import cross_memory, local_copy, round_trip

from rank_helpers import group_without_local_copy, outcome, run


def _request(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) * 10 + rank


def _blocks(rank: int, sent: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(sum(sent), generator=gen, dtype=torch.float64)


def _exchange(g: Any, lengths: list[int], matrix: list[list[int]]) -> dict[str, Any]:
    """One round trip: rank r requests ``lengths[r]`` ids and sends ``matrix[r][s]`` elements to rank s."""
    me = g.rank
    sent = matrix[me]
    recv = [matrix[s][me] for s in range(g.size)]
    trip = sdk.RoundTrip(g, _request(me, lengths[me]), sdk.empty((sum(recv),), torch.float64, "cpu"), recv)
    rows = g.agree(lambda: trip.fields, op="round trip", gather=True)
    if not trip.bind(rows):
        return {"bound": False}
    gathered = trip.gather(torch.empty(sum(lengths), dtype=torch.int64))
    blocks = _blocks(me, sent).requires_grad_(True)
    got = trip.answer(blocks, sent)
    weight = torch.arange(got.numel(), dtype=torch.float64) + me
    (got * weight).sum().backward()
    # The collectives it stands for.
    want_gathered = torch.cat([_request(r, n) for r, n in enumerate(lengths)])
    ref_blocks = _blocks(me, sent).requires_grad_(True)
    want = dist_f.all_to_all_single(torch.empty(sum(recv), dtype=torch.float64), ref_blocks, recv, sent, group=g)
    (want * weight).sum().backward()
    assert blocks.grad is not None and ref_blocks.grad is not None
    return {
        "bound": True,
        "gathered": torch.equal(gathered, want_gathered),
        "box": torch.equal(got.detach(), want.detach()),
        "grad": torch.equal(blocks.grad, ref_blocks.grad),
        "pinned": round_trip.pinned_count(),
    }


def _trips(cases: list[tuple[list[int], list[list[int]]]]) -> list[dict[str, Any]]:
    g = shardwise.get_default_group()
    return [_exchange(g, lengths, matrix) for lengths, matrix in cases]


def _case(world: int) -> st.SearchStrategy[tuple[list[int], list[list[int]]]]:
    sizes = st.integers(0, 3000) | st.just(0)
    return st.tuples(
        st.lists(sizes, min_size=world, max_size=world),
        st.lists(st.lists(sizes, min_size=world, max_size=world), min_size=world, max_size=world),
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(max_examples=1, deadline=None)  # one launch per world size, six drawn exchanges in it
@given(data=st.data())
def test_a_round_trip_equals_an_all_gather_and_an_all_to_all(world_size: int, data: st.DataObject) -> None:
    cases = data.draw(st.lists(_case(world_size), min_size=6, max_size=6))
    for res in run(_trips, world_size, cases):
        for one in res:
            assert one == {"bound": True, "gathered": True, "box": True, "grad": True, "pinned": 0}


def _without_local_copy() -> dict[str, Any]:
    off = group_without_local_copy(shardwise.get_default_group())
    return _exchange(off, [5, 7], [[3, 4], [5, 6]])


def test_a_group_that_cannot_copy_between_its_ranks_binds_on_no_rank() -> None:
    assert run(_without_local_copy, 2) == [{"bound": False}] * 2


def _misfit(kind: str) -> tuple[str, str]:
    g = shardwise.get_default_group()
    matrix = [[2, 3], [4, 5]]
    recv = [[2, 4], [3, 5]][g.rank]
    blocks = _blocks(g.rank, matrix[g.rank])
    if g.rank == 1 and kind == "count":  # one element more than rank 0 expects
        matrix[1][0] += 1
        blocks = _blocks(g.rank, matrix[1])
    if g.rank == 1 and kind == "dtype":  # float32 blocks for float64 boxes
        blocks = blocks.float()
    trip = sdk.RoundTrip(g, _request(g.rank, 3), torch.empty(sum(recv), dtype=torch.float64), recv)
    assert trip.bind(g.agree(lambda: trip.fields, op="round trip", gather=True))
    trip.gather(torch.empty(6, dtype=torch.int64))
    return outcome(lambda: trip.answer(blocks, matrix[g.rank]))


@pytest.mark.parametrize("kind", ["count", "dtype"])
def test_blocks_that_do_not_fit_their_receivers_raise_on_every_rank(kind: str) -> None:
    for err, message in run(_misfit, 2, kind):
        assert err == "CollectiveMismatchError", message
        assert "ranks [1]" in message and "element counts or dtypes" in message


def _write_fails_on_rank_0() -> tuple[str, str]:
    g = shardwise.get_default_group()
    assert local_copy.usable(g)  # the verdict first: its probe writes too
    if g.rank == 0:
        cross_memory.write_runs = lambda pid, runs: errno.ESRCH  # type: ignore[assignment]
    recv = [4, 4]
    trip = sdk.RoundTrip(g, _request(g.rank, 3), torch.empty(8, dtype=torch.float64), recv)
    assert trip.bind(g.agree(lambda: trip.fields, op="round trip", gather=True))
    trip.gather(torch.empty(6, dtype=torch.int64))
    return outcome(lambda: trip.answer(_blocks(g.rank, [4, 4]), [4, 4]))


def test_a_failed_write_raises_on_every_rank() -> None:
    for err, message in run(_write_fails_on_rank_0, 2):
        assert err == "PeerLostError", message
        assert "rank 0: ESRCH" in message and local_copy.LOCAL_COPY_ENV in message
        assert "peer process is gone" in message and "cannot be used any more" in message


def _read_fails_on_rank_0() -> dict[str, Any]:
    g = shardwise.get_default_group()
    assert local_copy.usable(g)
    if g.rank == 0:
        cross_memory.read_runs = lambda pid, runs: errno.EPERM  # type: ignore[assignment]
    recv = [4, 4]
    trip = sdk.RoundTrip(g, _request(g.rank, 3), torch.empty(8, dtype=torch.float64), recv)
    assert trip.bind(g.agree(lambda: trip.fields, op="round trip", gather=True))
    # The reader raises before it hands back ids it did not get; its peer from its answer.
    gathered = outcome(lambda: trip.gather(torch.empty(6, dtype=torch.int64)))
    answered = outcome(lambda: trip.answer(_blocks(g.rank, [4, 4]), [4, 4])) if gathered[0] == "ok" else None
    # Every rank reached the closing round, so the group is still in step.
    after = g.all_reduce(torch.ones(1)).item()
    return {"gathered": gathered, "answered": answered, "pinned": round_trip.pinned_count(), "after": after}


def test_a_failed_read_raises_on_every_rank_before_the_ids_are_used() -> None:
    reader, peer = run(_read_fails_on_rank_0, 2)
    assert reader["gathered"][0] == "PeerLostError" and "rank 0: EPERM" in reader["gathered"][1]
    assert "kernel refused to copy" in reader["gathered"][1]  # the cause its error number says
    assert reader["answered"] is None
    assert peer["gathered"] == ("ok", "")
    assert peer["answered"][0] == "PeerLostError" and "rank 0: EPERM" in peer["answered"][1]
    assert reader["pinned"] == peer["pinned"] == 0
    # A refused copy loses no rank: the message says the group still works, and it does.
    for message in (reader["gathered"][1], peer["answered"][1]):
        assert "the group still works" in message and "cannot be used any more" not in message
    assert reader["after"] == peer["after"] == 2.0


def _bad_box_on_rank_1() -> bool:
    g = shardwise.get_default_group()
    recv = [4, 4]
    box = torch.empty(8 + g.rank, dtype=torch.float64)  # rank 1's does not hold what recv says
    trip = sdk.RoundTrip(g, _request(g.rank, 3), box, recv)
    bound = trip.bind(g.agree(lambda: trip.fields, op="round trip", gather=True))
    # Answering anyway is a local mistake, caught before any copy.
    return bound, outcome(lambda: trip.answer(_blocks(g.rank, [4, 4]), [4, 4]))[0]


def test_a_rank_that_cannot_offer_the_path_makes_no_rank_take_it() -> None:
    assert run(_bad_box_on_rank_1, 2) == [(False, "RuntimeError")] * 2


def _abandoned_by_rank_0() -> dict[str, Any]:
    g = shardwise.get_default_group()
    recv = [4, 4]
    trip = sdk.RoundTrip(g, _request(g.rank, 3), torch.empty(8, dtype=torch.float64), recv)
    assert trip.bind(g.agree(lambda: trip.fields, op="round trip", gather=True))
    trip.gather(torch.empty(6, dtype=torch.int64))

    def work_then_answer() -> torch.Tensor:
        try:
            if g.rank == 0:
                raise MemoryError("no room for the blocks")
            return trip.answer(_blocks(g.rank, [4, 4]), [4, 4])
        except Exception:
            trip.abandon()
            raise

    seen = outcome(work_then_answer)
    trip.abandon()  # closed already: nothing runs, so no rank waits in a round of its own
    unbound = sdk.RoundTrip(g, _request(g.rank, 3), torch.empty(7, dtype=torch.float64), recv)
    unbound.abandon()  # never bound: nothing to close
    # The group is in step: a collective after it meets every rank.
    total = float(g.all_reduce(torch.ones(1)).item())
    return {"seen": seen, "pinned": round_trip.pinned_count(), "after": total}


def test_a_rank_that_abandons_raises_its_error_and_its_peers_peer_error() -> None:
    raiser, peer = run(_abandoned_by_rank_0, 2)
    assert raiser["seen"] == ("MemoryError", "no room for the blocks")
    assert peer["seen"][0] == "PeerError" and "rank(s) [0] raised an error of their own" in peer["seen"][1]
    assert raiser["pinned"] == peer["pinned"] == 0 and raiser["after"] == peer["after"] == 2.0
