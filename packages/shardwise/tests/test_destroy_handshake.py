"""``destroy`` meets every rank's in a handshake: a peer still in another collective raises at once.

A program whose ranks took different branches (one rank ends and destroys
the group, another still calls a collective) waited before until the group's
timeout, each rank's error naming only its own call ("barrier" from the
teardown). When verifying, both now raise ``CollectiveMismatchError`` naming
what each rank called; without verification they still wait (nothing else
can tell).
"""

from __future__ import annotations

import functools
import time

import torch

import shardwise
from shardwise import ChunkShardingSpec, shard_tensor

from rank_helpers import outcome
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
