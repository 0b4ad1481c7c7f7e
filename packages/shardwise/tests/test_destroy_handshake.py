"""``destroy`` meets every rank's in a handshake: a peer still in another collective raises at once.

A program whose ranks took different branches (one rank ends and destroys
the group, another still calls a collective) waited before until the group's
timeout, each rank's error naming only its own call ("barrier" from the
teardown). Where a backend's destroy waits for its peers anyway (gloo and
nccl), both now raise ``CollectiveMismatchError`` naming what each rank
called, when verifying; without verification they still wait (nothing else
can tell). The mpi backend's destroy returns at once, as before.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

import shardwise
from shardwise import ChunkShardingSpec, shard_tensor
from shardwise._comm.agreement import Call
from shardwise.errors import CollectiveMismatchError

from rank_helpers import TEST_BACKEND, ScriptedPeer, outcome
from rank_helpers import run as _run


def one_rank_destroys_while_another_gathers() -> dict[str, object]:
    g = shardwise.get_default_group()
    seen: dict[str, object] = {}
    for peer_call in ("all_reduce", "full_tensor"):
        sub = g.new_group(list(range(g.size)))
        assert sub is not None
        st = shard_tensor(torch.arange(8.0).reshape(4, 2), ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]),
                          process_group=sub)
        calls = {"all_reduce": functools.partial(sub.all_reduce, torch.ones(2)), "full_tensor": st.full_tensor}
        started = time.monotonic()
        seen[peer_call] = outcome(calls[peer_call] if g.rank == 0 else sub.destroy)
        seen[f"{peer_call} seconds"] = time.monotonic() - started
        sub.destroy_local()  # the failed destroy left it whole on rank 1
        g.barrier()
    ok = g.new_group(list(range(g.size)))
    assert ok is not None
    ok.all_reduce(torch.ones(1))
    seen["every rank destroys"] = outcome(ok.destroy)
    return seen


@pytest.mark.skipif(TEST_BACKEND == "mpi", reason="the mpi backend's destroy waits for no one (next test)")
def test_a_rank_that_destroys_meets_a_peer_still_in_a_collective() -> None:
    results = _run(one_rank_destroys_while_another_gathers, 2)
    for rank, seen in enumerate(results):
        assert seen["every rank destroys"] == ("ok", ""), seen
        for peer_call, primitive in (("all_reduce", "all_reduce"), ("full_tensor", "exchange")):
            kind, message = seen[peer_call]  # type: ignore[misc]
            assert kind == "CollectiveMismatchError", (rank, peer_call, kind, message)
            assert f"(rank 0: {primitive}, rank 1: destroy)" in message, message
            # The rank in full_tensor hears of it under its own call; the group's timeout is minutes away.
            assert message.startswith("full_tensor: ") == (rank == 0 and peer_call == "full_tensor"), message
            assert seen[f"{peer_call} seconds"] < 30, seen  # type: ignore[operator]


def one_rank_destroys_while_another_works() -> float:
    g = shardwise.get_default_group()
    sub = g.new_group(list(range(g.size)))
    assert sub is not None
    sub.all_reduce(torch.ones(1))
    if g.rank == 0:
        time.sleep(2.0)  # work outside any collective before destroying
    started = time.monotonic()
    sub.destroy()
    took = time.monotonic() - started
    g.barrier()
    return took


@pytest.mark.skipif(TEST_BACKEND != "mpi", reason="over gloo destroy waits for every rank (a barrier)")
def test_the_mpi_backends_destroy_still_waits_for_no_one() -> None:
    _, took = _run(one_rank_destroys_while_another_works, 2)
    assert took < 1.0, took


def test_destroy_meets_the_peers_destroy_then_tears_down() -> None:
    group = ScriptedPeer(Call("destroy"))
    group.destroy()
    assert (group.rounds, group.destroyed) == (1, True)


def test_destroy_beside_a_peers_collective_raises_and_leaves_the_group_whole() -> None:
    group = ScriptedPeer(Call("all_reduce", dtype=torch.float32, shape=(2,), reduce_op="sum"))
    with pytest.raises(CollectiveMismatchError, match=r"\(rank 0: destroy, rank 1: all_reduce\)"):
        group.destroy()
    assert not group.destroyed
    group.destroy_local()
    assert group.destroyed and group.rounds == 1  # destroy_local talked to no one


def test_destroy_local_never_talks_to_peers_even_through_destroy() -> None:
    # The default destroy_local calls destroy (a backend without its own, as the mpi one): no handshake there,
    # or the exit handler of a rank that ends first would wait for its peers.
    group = ScriptedPeer(Call("all_reduce"))
    group.destroy_local()
    assert (group.rounds, group.destroyed) == (0, True)


def test_without_verification_destroy_has_no_handshake() -> None:
    group = ScriptedPeer(Call("all_reduce"), verify=False)
    group.destroy()
    assert (group.rounds, group.destroyed) == (0, True)


def test_a_backend_whose_destroy_waits_for_no_one_has_no_handshake() -> None:
    group = ScriptedPeer(Call("all_reduce"), waits=False)
    group.destroy()
    assert (group.rounds, group.destroyed) == (0, True)
