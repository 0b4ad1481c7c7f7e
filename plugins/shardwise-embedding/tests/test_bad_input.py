"""Bad input to the sharded embedding ops, on 2 real ranks: the right error on every rank, and no hang.

Where the bad input is one rank's own data, only rank 1 gets it: rank 1 must
raise the real error and rank 0 a PeerError naming rank 1. Out-of-range ids
(on rank 1 only) raise IndexError on both ranks. Options every rank must pass
alike (sparse, the weight's spec, the mode) are bad on both ranks, and ranks
passing different options raise CollectiveMismatchError everywhere. After each
case both ranks make a good call, which must still match the dense op: the
group stays usable. Every case runs in one launch (:func:`bad_input_battery`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from emb_helpers import OK, Checks, battery_results, chunk_spec, dense_weight, loss_weights, outcome, shard_dense

import shardwise
from shardwise.errors import PeerError
from shardwise.sharded_tensor import ShardMetadata, ShardedTensor, zeros
from shardwise.sharding_spec import EnumerableShardingSpec

V, D = 6, 4
CULPRIT = 1


@dataclass(frozen=True)
class Weights:
    """The weights the bad calls use (made once, collectively)."""

    row: ShardedTensor
    col: ShardedTensor
    enumerable: ShardedTensor
    dim2: ShardedTensor
    integer_col: ShardedTensor


def make_weights() -> Weights:
    """Row-wise, column-wise, Enumerable-sharded and 3-D chunked-on-dim-2 weights (every rank calls it)."""
    dense = dense_weight(V, D, "bad")
    enumerable = EnumerableShardingSpec(
        [ShardMetadata([0, 0], [3, D], "rank:0/cpu"), ShardMetadata([3, 0], [V - 3, D], "rank:1/cpu")]
    )
    cube = torch.randn(V, D, 2, dtype=torch.float64)
    return Weights(
        row=shard_dense(dense, chunk_spec(0, [0, 1])),
        col=shard_dense(dense, chunk_spec(1, [0, 1])),
        enumerable=shard_dense(dense, enumerable),
        dim2=shard_dense(cube, chunk_spec(2, [0, 1])),
        # Every column on rank 0: rank 1 owns none, so only the pooling owner would meet the dtype.
        integer_col=shard_dense(dense.long(), chunk_spec(1, [0, 0]), requires_grad=False),
    )


def _ids(rank: int) -> torch.Tensor:
    return torch.tensor([[0, 5], [3, 2]]) if rank == 0 else torch.tensor([1, 4, 4])


class _Explodes(torch.Tensor):
    """Ids whose inspection fails with an error no argument check expects."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> _Explodes:
        return torch.Tensor._make_subclass(cls, data)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.dim or getattr(func, "__name__", "") in ("dim", "min", "amin", "aminmax"):
            raise RuntimeError("ids exploded while being checked")
        return super().__torch_function__(func, types, args, kwargs or {})


def _bag(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D ids and offsets, good on both ranks."""
    return (torch.tensor([0, 5, 3, 2]), torch.tensor([0, 2])) if rank == 0 else (torch.tensor([1, 4, 4]), torch.tensor([0, 1]))


Call = Callable[[int, Weights], Any]


@dataclass(frozen=True)
class Case:
    """A bad call and what it must raise.

    Attributes:
        call: ``call(rank, weights)``, made on every rank.
        error: The error type expected (by name; a subclass of it passes).
        words: Fragments the message must contain (any letter case).
        culprit: The only rank with bad input (the others raise PeerError), or
            None when every rank raises ``error``.
    """

    call: Call
    error: str
    words: tuple[str, ...] = ()
    culprit: Optional[int] = CULPRIT


def _on_culprit(bad: Callable[[], Any], good: Callable[[], Any]) -> Call:
    return lambda rank, w: bad() if rank == CULPRIT else good()


def _emb(ids_of: Callable[[int], torch.Tensor], layout: str = "row", **kw: Any) -> Call:
    return lambda rank, w: F.embedding(ids_of(rank), getattr(w, layout), **kw)


def _out_of_range(bad_id: int, layout: str, bag: bool) -> Case:
    def call(rank: int, w: Weights) -> Any:
        weight = getattr(w, layout)
        if bag:
            ids, offsets = _bag(rank)
            if rank == CULPRIT:
                ids = torch.tensor([1, bad_id, 4])
            return F.embedding_bag(ids, weight, offsets, mode="sum")
        ids = torch.tensor([2, bad_id]) if rank == CULPRIT else _ids(rank)
        return F.embedding(ids, weight)

    return Case(call, "IndexError", ("out of range",), culprit=None)


def _bag_call(rank_input: Callable[[int], tuple[Any, ...]], layout: str = "row", **kw: Any) -> Call:
    """``F.embedding_bag(ids, weight, offsets, **kw)`` with ``(ids, offsets[, psw])`` from ``rank_input(rank)``."""

    def call(rank: int, w: Weights) -> Any:
        ids, offsets, *psw = rank_input(rank)
        extra: dict[str, Any] = {"per_sample_weights": psw[0]} if psw else {}
        if kw.get("mode", "") is None:  # the ranks disagree on the mode
            extra["mode"] = "sum" if rank == 0 else "mean"
        return F.embedding_bag(ids, getattr(w, layout), offsets, **{k: v for k, v in kw.items() if v is not None}, **extra)

    return call


def _culprit_input(bad: tuple[Any, ...]) -> Callable[[int], tuple[Any, ...]]:
    return lambda rank: bad if rank == CULPRIT else _bag(rank)


#: What the brief says an unsupported weight's NotImplementedError names.
UNSUPPORTED_SPEC = ("ChunkShardingSpec", "dim 0", "dim 1")

CASES: dict[str, Case] = {
    # -- F.embedding ---------------------------------------------------------------------------
    "emb_float_ids": Case(_emb(lambda r: _ids(r).float() if r == CULPRIT else _ids(r)), "TypeError"),
    "emb_int16_ids": Case(_emb(lambda r: _ids(r).short() if r == CULPRIT else _ids(r)), "TypeError"),
    "emb_float_ids_col": Case(_emb(lambda r: _ids(r).double() if r == CULPRIT else _ids(r), "col"), "TypeError"),
    # Each rank's weight has another number of rows: the owners they route ids to disagree, so
    # without the layout check in the signature row 3 came back as zeros, silently.
    "emb_weight_size_differs": Case(
        lambda rank, w: F.embedding(torch.tensor([3, 2]), zeros(chunk_spec(0, [0, 1]), V + rank, D)),
        "CollectiveMismatchError", ("ranks 0 and 1 called with a different weight (global size or sharding)",),
        culprit=None,
    ),
    "bag_weight_size_differs_col": Case(
        lambda rank, w: F.embedding_bag(_bag(rank)[0], zeros(chunk_spec(1, [0, 1]), V, D + 2 * rank), _bag(rank)[1]),
        "CollectiveMismatchError", ("different weight (global size or sharding)",), culprit=None,
    ),
    # A local failure that is none of the documented argument errors (here torch's own
    # RuntimeError) still reaches the peers instead of leaving them waiting for the timeout.
    "emb_unexpected_error_on_one_rank": Case(
        lambda rank, w: F.embedding(_Explodes(_ids(rank)) if rank == CULPRIT else _ids(rank), w.row),
        "RuntimeError", ("exploded",),
    ),
    "emb_sparse": Case(_emb(_ids, sparse=True), "NotImplementedError", ("sparse",), culprit=None),
    "emb_enumerable_spec": Case(_emb(_ids, "enumerable"), "NotImplementedError", UNSUPPORTED_SPEC, culprit=None),
    "emb_chunk_dim_2": Case(_emb(_ids, "dim2"), "NotImplementedError", UNSUPPORTED_SPEC, culprit=None),
    "emb_id_minus_1_row": _out_of_range(-1, "row", bag=False),
    "emb_id_V_row": _out_of_range(V, "row", bag=False),
    "emb_id_minus_1_col": _out_of_range(-1, "col", bag=False),
    "emb_id_V_col": _out_of_range(V, "col", bag=False),
    "emb_max_norm_differs": Case(
        lambda rank, w: F.embedding(_ids(rank), w.row, max_norm=1.0 if rank == 0 else None),
        "CollectiveMismatchError",
        culprit=None,
    ),
    "emb_scale_grad_differs": Case(
        lambda rank, w: F.embedding(_ids(rank), w.col, scale_grad_by_freq=rank == 0),
        "CollectiveMismatchError",
        culprit=None,
    ),
    # -- F.embedding_bag -----------------------------------------------------------------------
    "bag_float_ids": Case(_bag_call(_culprit_input((torch.tensor([1.0, 4.0]), torch.tensor([0, 1])))), "TypeError"),
    "bag_sparse": Case(_bag_call(_bag, sparse=True), "NotImplementedError", ("sparse",), culprit=None),
    "bag_enumerable_spec": Case(_bag_call(_bag, "enumerable"), "NotImplementedError", UNSUPPORTED_SPEC, culprit=None),
    "bag_chunk_dim_2": Case(_bag_call(_bag, "dim2"), "NotImplementedError", UNSUPPORTED_SPEC, culprit=None),
    "bag_offsets_not_from_0": Case(
        _bag_call(_culprit_input((torch.tensor([1, 4, 4]), torch.tensor([1, 2])))), "ValueError", ("offsets",)
    ),
    "bag_offsets_decreasing": Case(
        _bag_call(_culprit_input((torch.tensor([1, 4, 4]), torch.tensor([0, 2, 1])))), "ValueError", ("offsets",)
    ),
    "bag_offsets_beyond_ids": Case(
        _bag_call(_culprit_input((torch.tensor([1, 4, 4]), torch.tensor([0, 4])))), "ValueError", ("offsets",)
    ),
    "bag_offsets_beyond_ids_col": Case(
        _bag_call(_culprit_input((torch.tensor([1, 4, 4]), torch.tensor([0, 4]))), "col"), "ValueError", ("offsets",)
    ),
    "bag_last_offset_beyond_ids": Case(
        _bag_call(
            lambda r: (torch.tensor([1, 4, 4]), torch.tensor([0, 1, 5] if r == CULPRIT else [0, 1, 3])),
            include_last_offset=True,
        ),
        "ValueError",
        ("offsets",),
    ),
    "bag_psw_with_mean": Case(
        _bag_call(lambda r: (*_bag(r), torch.ones(3, dtype=torch.float64)) if r == CULPRIT else _bag(r), mode="mean"),
        "NotImplementedError",
        ("per_sample_weights",),
    ),
    "bag_psw_wrong_shape": Case(
        _bag_call(lambda r: (*_bag(r), torch.ones(4 if r == 0 else 2, dtype=torch.float64)), mode="sum"),
        "ValueError",
        ("per_sample_weights",),
    ),
    "bag_3d_ids": Case(_bag_call(_culprit_input((torch.zeros(1, 2, 2, dtype=torch.int64), None))), "ValueError"),
    "bag_2d_ids_with_offsets": Case(
        _bag_call(_culprit_input((torch.tensor([[1, 4], [4, 0]]), torch.tensor([0, 1])))), "ValueError", ("offsets",)
    ),
    "bag_1d_ids_without_offsets": Case(
        _bag_call(lambda r: (torch.tensor([1, 4, 4]), None) if r == CULPRIT else (torch.tensor([[0, 5], [3, 2]]), None)),
        "ValueError",
        ("offsets",),
    ),
    "bag_max_with_scale_grad": Case(
        _bag_call(_bag, mode="max", scale_grad_by_freq=True), "ValueError", ("max",), culprit=None
    ),
    "bag_unknown_mode": Case(_bag_call(_bag, mode="median"), "ValueError", ("mode",), culprit=None),
    "bag_integer_weight": Case(
        _bag_call(_bag, "integer_col"), "RuntimeError", ("half, bfloat16, float, double",), culprit=None
    ),
    "bag_modes_differ": Case(
        _bag_call(_bag, mode=None), "CollectiveMismatchError", ("mode",), culprit=None
    ),
    "bag_id_minus_1_row": _out_of_range(-1, "row", bag=True),
    "bag_id_V_row": _out_of_range(V, "row", bag=True),
    "bag_id_minus_1_col": _out_of_range(-1, "col", bag=True),
    "bag_id_V_col": _out_of_range(V, "col", bag=True),
}


# -- inside the ranks -------------------------------------------------------------------------------


def good_calls(rank: int, step: int) -> None:
    """A good F.embedding and F.embedding_bag (forward and backward) on fresh weights match the dense op."""
    ck = Checks(f"good calls after case {step}")
    dense = dense_weight(V, D, "good", step)
    weight = shard_dense(dense, chunk_spec(step % 2, [0, 1]))
    all_ids = [_ids(r) for r in range(2)]
    grads = [loss_weights((*i.shape, D), "good", step, r) for r, i in enumerate(all_ids)]
    out = F.embedding(all_ids[rank], weight)
    (out * grads[rank]).sum().backward()
    ref = dense.clone().requires_grad_()
    sum((F.embedding(i, ref) * g).sum() for i, g in zip(all_ids, grads, strict=True)).backward()  # type: ignore[union-attr]
    ck.output(out, F.embedding(all_ids[rank], dense))
    ck.grads(weight, ref.grad)

    bag_weight = shard_dense(dense, chunk_spec(1 - step % 2, [1, 0]))
    ids, offsets = _bag(rank)
    bag_out = F.embedding_bag(ids, bag_weight, offsets, mode="mean")
    bag_out.sum().backward()
    ref = dense.clone().requires_grad_()
    sum(F.embedding_bag(i, ref, o, mode="mean").sum() for i, o in map(_bag, range(2))).backward()  # type: ignore[union-attr]
    ck.output(bag_out, F.embedding_bag(ids, dense, offsets, mode="mean"))
    ck.grads(bag_weight, ref.grad)
    ck.done()


def error_of(fn: Callable[[], Any]) -> tuple[list[str], str]:
    """The names of the classes (MRO) of the error ``fn`` raised and its message; ``(["ok"], "")`` if none."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test checks every rank's error
        return [cls.__name__ for cls in type(exc).__mro__], str(exc)
    return [OK], ""


def bad_input_battery(results_dir: str = "", only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Case -> (error's class names, message, then the outcome of the good calls that follow it).

    The results so far are saved after each case, as :func:`emb_helpers.battery` does.
    """
    group = shardwise.get_default_group()
    assert group.size == 2
    weights = make_weights()
    results: dict[str, Any] = {}
    for step, (name, case) in enumerate(CASES.items()):
        if only and name not in only:
            continue
        kinds, message = error_of(lambda case=case: case.call(group.rank, weights))  # type: ignore[misc]
        after = outcome(lambda step=step: good_calls(group.rank, step))  # type: ignore[misc]
        results[name] = (kinds, message, *after)
        if results_dir:
            path = Path(results_dir, f"rank{group.rank}.json")
            path.with_suffix(".tmp").write_text(json.dumps(results))
            path.with_suffix(".tmp").replace(path)
    return results


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str) -> None:
    case = CASES[name]
    results = battery_results(bad_input_battery, 2, list(CASES))
    for rank, seen in enumerate(results):
        if isinstance(seen[name], str):  # the run failed in or before this case
            raise AssertionError(f"rank {rank}: {seen[name]}")
        kinds, message, after_kind, after_message = seen[name]
        if case.culprit is None or rank == case.culprit:
            assert case.error in kinds, (rank, kinds[0], message)
            for word in case.words:
                assert word.lower() in message.lower(), (rank, word, message)
        else:
            assert kinds[0] == PeerError.__name__, (rank, kinds[0], message)
            assert f"rank {case.culprit}" in message, (rank, message)
        # The group is still usable: the good calls right after match the dense op.
        assert (after_kind, after_message) == (OK, ""), (rank, after_kind, after_message)

