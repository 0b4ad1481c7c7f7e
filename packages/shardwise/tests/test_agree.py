"""``Group.agree``, the one agreement primitive, and what is built on it (all_gather_json, exchange, reject)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

import shardwise
from shardwise._comm.agreement import AGREED_ERRORS, CallLabel, inline_capacity, labelled, peer_error
from shardwise._tensor.scatter import _local_payload
from shardwise._vocab import wire as _wire
from shardwise.errors import PeerError
from shardwise.sdk import AGREED_ERRORS as SDK_AGREED_ERRORS

from rank_helpers import outcome
from rank_helpers import run as _run


def _raise(error: Exception) -> Any:
    raise error


def agree_battery() -> dict[str, Any]:
    g = shardwise.get_default_group()
    r = g.rank
    seen: dict[str, Any] = {}
    # No failure: each rank gets its own value back, or everyone's with gather=True.
    seen["own"] = g.agree(lambda: r * 10, op="my_op")
    seen["none"] = g.agree(lambda: None, op="my_op")
    seen["gathered"] = g.agree(lambda: {"rank": r, "t": (r, "x")}, op="my_op", gather=True)
    # A value too big for the handshake row takes a second all-gather; mixed sizes too.
    seen["big"] = g.agree(lambda: "y" * (5000 if r == 1 else 3), op="my_op", gather=True)
    seen["json"] = g.all_gather_json([r, None, 1.5])
    seen["alias"] = g.exchange([r]) == g.all_gather_json([r])
    # Every agreed kind: the rank at fault keeps its exception, the others raise one PeerError.
    for kind in (*AGREED_ERRORS, RuntimeError, OSError):
        seen[kind.__name__] = outcome(
            lambda kind=kind: g.agree(  # type: ignore[misc]
                lambda: _raise(kind(f"bad {kind.__name__} here")) if r == 1 else 1, op="my_op"
            )
        )
    # Two ranks at fault: both named, in one sentence.
    seen["two"] = outcome(
        lambda: g.agree(lambda: _raise(ValueError("mine")) if r in (0, 1) else 1, op="two_op", gather=True)
    )
    # Not JSON-safe: a TypeError on that rank.
    seen["not_json"] = outcome(lambda: g.agree(lambda: object() if r == 0 else 1, op="my_op", gather=True))
    # A rank that rejects meets peers in a plain agreement or a collective.
    seen["reject"] = outcome(
        lambda: g.reject(KeyError("no such key"), op="my_op") if r == 1 else g.agree(lambda: 1, op="my_op")
    )
    # The group stays in step, with and without per-collective verification.
    g.verify = False
    seen["unverified"] = outcome(lambda: g.agree(lambda: _raise(IndexError("i")) if r == 1 else 1, op="x"))
    g.verify = True
    seen["after"] = float(g.all_reduce(torch.ones(1)).item())
    return seen


def test_agree_on_ranks() -> None:
    results = _run(agree_battery, 3)
    for r, seen in enumerate(results):
        assert seen["own"] == r * 10 and seen["none"] is None
        assert seen["gathered"] == [{"rank": s, "t": [s, "x"]} for s in range(3)]
        assert seen["big"] == ["yyy", "y" * 5000, "yyy"]
        assert seen["json"] == [[s, None, 1.5] for s in range(3)]
        assert seen["alias"] is True
        for kind in (*AGREED_ERRORS, RuntimeError, OSError):
            name, message = seen[kind.__name__]
            if r == 1:
                assert name == kind.__name__ and f"bad {kind.__name__} here" in message, (kind, name, message)
            else:
                assert name == "PeerError", (kind, name, message)
                assert message.startswith(f"my_op: rank 1 ({kind.__name__}) rejected its arguments"), message
                assert f"bad {kind.__name__} here" in message, message
        if r in (0, 1):
            assert seen["two"] == ("ValueError", "mine")
        else:
            assert seen["two"][0] == "PeerError"
            assert seen["two"][1].startswith("two_op: rank 0 (ValueError), rank 1 (ValueError) rejected their"), seen
        assert seen["not_json"][0] == ("TypeError" if r == 0 else "PeerError"), seen["not_json"]
        assert seen["reject"][0] == ("KeyError" if r == 1 else "PeerError"), seen["reject"]
        assert seen["unverified"][0] == ("IndexError" if r == 1 else "PeerError"), seen["unverified"]
        assert seen["after"] == 3.0


def _counted(g: Any, name: str, fn: Callable[[], Any]) -> int:
    """How many times ``fn`` calls ``g``'s method ``name``."""
    made = [0]
    inner = getattr(g, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        made[0] += 1
        return inner(*args, **kwargs)

    setattr(g, name, counted)
    try:
        fn()
    finally:
        delattr(g, name)
    return made[0]


def rounds_battery() -> dict[str, Any]:
    g = shardwise.get_default_group()
    room = inline_capacity(g.size)
    ranks = [f"rank:{r}/cpu" for r in range(g.size)]
    whole = torch.ones(8, 6, 4, requires_grad=True)
    spec = shardwise.ChunkShardingSpec(dim=2, placements=ranks)
    holder: list[Any] = []

    def agreed(fn: Callable[[], Any]) -> int:
        # A payload too big for the handshake row travels in a second all-gather (Group._gather_bytes).
        return _counted(g, "_gather_bytes", fn)

    return {
        "room": room,
        # A JSON string is its text and two quotes.
        "fits": _counted(g, "_all_gather", lambda: g.agree(lambda: "x" * (room - 2), op="o", gather=True)),
        "over": _counted(g, "_all_gather", lambda: g.agree(lambda: "x" * (room - 1), op="o", gather=True)),
        "payload": len(_wire.encode_json(_local_payload(whole, spec, 0, g) | {"devices_checked": True})),
        # What the data-movement calls agree on (a spec and the tensor's properties) fits in the row.
        "shard_tensor": agreed(lambda: holder.append(shardwise.shard_tensor(whole, spec))),
        "reshard": agreed(lambda: holder[0].reshard(shardwise.ChunkShardingSpec(dim=0, placements=ranks))),
        "gather": agreed(lambda: holder[0].gather(dst=0, out=torch.empty(8, 6, 4) if g.rank == 0 else None)),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_the_data_movement_agreements_take_one_collective(world: int) -> None:
    # The spec and tensor properties shard_tensor agrees on (about 300 bytes) used to exceed a small group's row
    # (160 bytes at 2 ranks) and take a second all-gather; every row now has room for 512 bytes.
    for seen in _run(rounds_battery, world):
        assert seen["room"] >= 512 and seen["payload"] <= seen["room"], seen
        assert seen["fits"] == 1 and seen["over"] == 2, seen
        assert seen["shard_tensor"] == seen["reshard"] == seen["gather"] == 0, seen


def test_one_table_and_one_wording() -> None:
    assert SDK_AGREED_ERRORS is AGREED_ERRORS
    assert {TypeError, ValueError, IndexError, KeyError, NotImplementedError} <= set(AGREED_ERRORS)
    error = peer_error("op", [(1, "ValueError", "bad")])
    assert isinstance(error, PeerError)
    assert str(error) == (
        "op: rank 1 (ValueError) rejected its arguments, so no data was sent (rank 1: bad); "
        "see that rank's traceback for the cause"
    )


def test_reject_refuses_other_kinds_locally() -> None:
    # Refused before anything is sent: a group with no backend is enough.
    with pytest.raises(TypeError, match=r"reject\(\) takes a TypeError, .* got RuntimeError"):
        _bare().reject(RuntimeError("x"))


def _bare() -> shardwise.Group:
    return _GroupForLabels(backend="none", rank=0, size=1, device=torch.device("cpu"))


def test_call_labels_are_immutable_nested_and_per_thread() -> None:
    group, other = _bare(), _bare()
    assert group._describe("all_gather") == "all_gather"
    with labelled(CallLabel(group, "shard_tensor")):
        assert group._describe("all_gather") == "shard_tensor"
        assert other._describe("all_gather") == "all_gather"  # another group's primitive is not labelled
        with labelled(CallLabel(group, "shard_tensor", agreeing=True)):
            assert group._describe("all_gather") == "shard_tensor (agreeing on its arguments)"
            seen: list[str] = []
            thread = threading.Thread(target=lambda: seen.append(group._describe("all_gather")))
            thread.start()
            thread.join()
            assert seen == ["all_gather"]  # a thread does not see this thread's label
        assert group._describe("all_gather") == "shard_tensor"
    assert group._describe("all_gather") == "all_gather"
    label = CallLabel(group, "x")
    with pytest.raises(AttributeError):
        label.call = "y"  # type: ignore[misc]


class _GroupForLabels(shardwise.Group):
    """A group with no backend, for the label test (only ``_describe`` is called)."""

    def _barrier(self) -> None:
        raise NotImplementedError

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def _all_reduce(self, buf: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: Any) -> None:
        raise NotImplementedError

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: Any, op: str) -> None:
        raise NotImplementedError

    def _all_to_all(self, out: torch.Tensor, out_counts: Any, inp: torch.Tensor, in_counts: Any) -> None:
        raise NotImplementedError

    def _new_group(self, ranks: Any) -> Any:
        raise NotImplementedError


def gather_and_scatter_json() -> dict[str, Any]:
    g = shardwise.get_default_group()
    r = g.rank
    seen: dict[str, Any] = {}
    seen["gathered"] = g.gather_json({"rank": r, "big": "z" * (6000 if r == 1 else 0)}, dst=1)
    seen["empty"] = g.gather_json("", dst=0)
    seen["scattered"] = g.scatter_json([{"to": k, "t": (k, "x")} for k in range(g.size)] if r == 2 else None, src=2)
    seen["short"] = outcome(lambda: g.scatter_json([1] if r == 0 else None, src=0, op="my_op"))
    seen["unsafe"] = outcome(lambda: g.gather_json(object() if r == 1 else 1, dst=0, op="my_op"))
    seen["after"] = g.gather_json(r, dst=0)
    return seen


def test_gather_json_and_scatter_json_reach_only_their_rank() -> None:
    for r, seen in enumerate(_run(gather_and_scatter_json, 3)):
        expected = [{"rank": k, "big": "z" * (6000 if k == 1 else 0)} for k in range(3)]
        assert seen["gathered"] == (expected if r == 1 else None), seen
        assert seen["empty"] == (["", "", ""] if r == 0 else None)
        assert seen["scattered"] == {"to": r, "t": [r, "x"]}
        assert seen["short"][0] == ("ValueError" if r == 0 else "PeerError"), seen
        assert "must pass one object per rank (3), got 1 object(s)" in seen["short"][1] or r != 0
        assert seen["unsafe"][0] == ("TypeError" if r == 1 else "PeerError"), seen
        assert seen["after"] == ([0, 1, 2] if r == 0 else None)
