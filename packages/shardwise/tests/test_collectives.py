"""Group collectives on real ranks (torch gloo via the test backend plugin)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import shardwise
import shardwise.nn.functional
from shardwise.errors import CollectiveMismatchError, PeerError

from rank_helpers import check_errors
from rank_helpers import run as _run


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), (actual, expected)


def battery(verify: bool) -> str:
    g = shardwise.get_default_group()
    g.verify = verify
    r, w = g.rank, g.size
    ranks = range(w)

    # all_reduce: every op, several dtypes, in place.
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int16, torch.int32, torch.int64, torch.uint8):
        values = [torch.tensor([s + 1, 2 * s + 1, 3], dtype=dtype) for s in ranks]
        for op, fold in (("sum", torch.add), ("min", torch.minimum), ("max", torch.maximum), ("product", torch.mul)):
            expected = values[0].clone()
            for v in values[1:]:
                expected = fold(expected, v)
            t = values[r].clone()
            assert g.all_reduce(t, op=op) is t
            _equal(t, expected)
    t = torch.full((2,), float(r))
    _equal(g.all_reduce(t, op=torch.distributed.ReduceOp.AVG), torch.full((2,), sum(ranks) / w))
    _equal(g.all_reduce(torch.tensor([r == 0, True, False])), torch.tensor([True, True, False]))
    _equal(g.all_reduce(torch.tensor([r == 0, True]), op="min"), torch.tensor([w == 1, True]))
    _equal(g.all_reduce(torch.tensor([1 + 1j * r], dtype=torch.complex64)), torch.tensor([w + 1j * sum(ranks)], dtype=torch.complex64))

    # broadcast into a non-contiguous (transposed) tensor, from the last rank.
    base = torch.arange(6.0).reshape(2, 3) * (r + 1)
    view = base.t()
    assert not view.is_contiguous()
    g.broadcast(view, src=w - 1)
    _equal(base, torch.arange(6.0).reshape(2, 3) * w)

    # all_gather: uneven, an empty rank, non-contiguous input that requires grad, 0-d.
    mine = torch.arange(3 * r, dtype=torch.float32).reshape(3, r).t() + 100 * r
    assert r < 2 or not mine.is_contiguous()
    gathered = g.all_gather(mine.requires_grad_())
    for s in ranks:
        _equal(gathered[s], torch.arange(3 * s, dtype=torch.float32).reshape(3, s).t() + 100 * s)
    scalars = g.all_gather(torch.tensor(float(r)))
    assert [x.shape for x in scalars] == [torch.Size([])] * w and [x.item() for x in scalars] == list(map(float, ranks))

    # reduce_scatter with uneven chunks: chunk s has s + 1 rows of 2.
    chunks = [torch.full((s + 1, 2), float(r + s)) for s in ranks]
    _equal(g.reduce_scatter(chunks), torch.full((r + 1, 2), float(sum(ranks) + w * r)))
    _equal(g.reduce_scatter(chunks, op="max"), torch.full((r + 1, 2), float(w - 1 + r)))

    # all_to_all: rank r sends (r + s) % 3 rows to rank s (some empty).
    sent = [torch.full(((r + s) % 3, 2), float(10 * r + s), dtype=torch.float64) for s in ranks]
    received = g.all_to_all(sent)
    for s in ranks:
        _equal(received[s], torch.full(((s + r) % 3, 2), float(10 * s + r), dtype=torch.float64))

    # all_to_all_single, equal and uneven, with and without output sizes.
    _equal(g.all_to_all_single(torch.arange(2.0 * w) + 100 * r), torch.cat([torch.arange(2.0 * r, 2.0 * r + 2) + 100 * s for s in ranks]))
    ins = [(r + s) % 3 for s in ranks]
    outs = [(s + r) % 3 for s in ranks]
    data = torch.cat([torch.full((n, 4), float(10 * r + s)) for s, n in enumerate(ins)])
    expected = torch.cat([torch.full((n, 4), float(10 * s + r)) for s, n in enumerate(outs)])
    _equal(g.all_to_all_single(data, input_split_sizes=ins), expected)
    _equal(g.all_to_all_single(data, output_split_sizes=outs, input_split_sizes=ins), expected)

    # scatter from rank 1 % w of transposed uneven pieces; gather to the last rank.
    src = 1 % w
    pieces = [torch.arange(2.0 * (s + 1)).reshape(2, s + 1).t() for s in ranks] if r == src else None
    _equal(g.scatter(pieces, src=src), torch.arange(2.0 * (r + 1)).reshape(2, r + 1).t())
    got = g.gather(torch.full((r, 2), r, dtype=torch.int16), dst=w - 1)
    if r == w - 1:
        assert got is not None
        for s in ranks:
            _equal(got[s], torch.full((s, 2), s, dtype=torch.int16))
    else:
        assert got is None

    # exchange: JSON-safe nested data; tuples come back as lists.
    assert g.exchange({"rank": r, "shape": (r, 2), "name": f"r{r}", "x": [None, True, 1.5]}) == [
        {"rank": s, "shape": [s, 2], "name": f"r{s}", "x": [None, True, 1.5]} for s in ranks
    ]
    assert g.exchange("é" * r) == ["é" * s for s in ranks]

    # sub-groups
    members = [0, w - 1]
    sub = g.new_group(members)
    if r in members:
        assert sub is not None and sub.size == len(set(members)) and sub.rank == sorted(set(members)).index(r)
        _equal(sub.all_reduce(torch.ones(1)), torch.full((1,), float(len(set(members)))))
    else:
        assert sub is None

    # without the handshake the known-size collectives still work
    g.verify = False
    _equal(g.all_reduce(torch.ones(3)), torch.full((3,), float(w)))
    _equal(g.all_to_all_single(data, output_split_sizes=outs, input_split_sizes=ins), expected)
    g.barrier()
    g.verify = True
    g.barrier()
    return "ok"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives(world_size: int, verify: bool) -> None:
    # Without the handshake backends may take direct paths (MPI does): same results.
    assert _run(battery, world_size, verify) == ["ok"] * world_size


_OUT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8, torch.bool, torch.complex64)


def out_battery(verify: bool) -> str:
    """The ``out=`` forms and in-place inputs, for every dtype, contiguous or not."""
    g = shardwise.get_default_group()
    g.verify = verify
    r, w = g.rank, g.size

    def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        base = torch.arange(n, dtype=torch.float64) + 10 * rank + 1
        if dtype == torch.bool:
            return (base.long() % 2 == 1)
        if dtype.is_complex:
            return torch.complex(base, -base).to(dtype)
        return base.to(dtype)

    for dtype in _OUT_DTYPES:
        # all_gather into a contiguous buffer, into a transposed one, and 0-d pieces.
        mine = value(r, 6, dtype).reshape(3, 2)
        out = torch.zeros(3 * w, 2, dtype=dtype)
        pieces = g.all_gather(mine, out=out)
        expected = torch.cat([value(s, 6, dtype).reshape(3, 2) for s in range(w)])
        _equal(out, expected)
        assert len(pieces) == w and all(p.data_ptr() == out[3 * s].data_ptr() for s, p in enumerate(pieces))
        strided = torch.zeros(2, 3 * w, dtype=dtype).t()
        g.all_gather(mine, out=strided)
        _equal(strided.contiguous(), expected)
        scalars = torch.zeros(w, dtype=dtype)
        got = g.all_gather(value(r, 1, dtype)[0], out=scalars)
        assert [x.shape for x in got] == [torch.Size([])] * w
        _equal(scalars, torch.stack([value(s, 1, dtype)[0] for s in range(w)]))

        # all_to_all_single into out, equal split derived from out.
        data = value(r, 4 * w, dtype).reshape(2 * w, 2)
        recv = torch.zeros(2 * w, 2, dtype=dtype)
        assert g.all_to_all_single(data, out=recv) is recv
        _equal(recv, torch.cat([value(s, 4 * w, dtype).reshape(2 * w, 2)[2 * r:2 * r + 2] for s in range(w)]))

        # reduce_scatter from consecutive views of one tensor: read in place, never written.
        if dtype == torch.bool:
            continue
        whole = value(r, 2 * w * (w + 1) // 2, dtype)
        before = whole.clone()
        chunks = list(whole.split([2 * (s + 1) for s in range(w)]))
        total = sum(value(s, whole.numel(), dtype) for s in range(w))
        assert isinstance(total, torch.Tensor)
        mine_total = total.split([2 * (s + 1) for s in range(w)])[r]
        _equal(g.reduce_scatter(chunks), mine_total.to(dtype))
        into = torch.zeros(2 * (r + 1), dtype=dtype)
        assert g.reduce_scatter(chunks, out=into) is into
        _equal(into, mine_total.to(dtype))
        _equal(whole, before)

    # reduce_scatter into a non-contiguous out; avg and max through the direct path.
    whole = torch.arange(4.0 * w).reshape(2 * w, 2) + r
    rows = list(whole.split(2))
    into = torch.zeros(2, 2).t()
    g.reduce_scatter(rows, op="avg", out=into)
    assert not into.is_contiguous()
    _equal(into.contiguous(), torch.arange(4.0 * r, 4.0 * r + 4).reshape(2, 2) + (w - 1) / 2)
    _equal(g.reduce_scatter(rows, op=torch.distributed.ReduceOp.MAX), torch.arange(4.0 * r, 4.0 * r + 4).reshape(2, 2) + w - 1)
    # A one-element tensor with stride 0 (as an expanded gradient is) counts as contiguous but
    # cannot be viewed as bytes directly.
    one = torch.tensor(float(r)).expand(1)
    assert one.stride() == (0,)
    _equal(torch.cat(g.all_gather(one)), torch.arange(float(w)))
    # all_reduce of a tensor carrying the lazy negation bit of a conjugate's imaginary part.
    z = torch.complex(torch.ones(3), torch.full((3,), float(r + 1)))
    neg = z.conj().imag
    assert neg.is_neg()
    _equal(g.all_reduce(neg), torch.full((3,), -float(sum(range(1, w + 1)))))
    g.verify = True
    g.barrier()
    return "ok"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_out_buffers(world_size: int, verify: bool) -> None:
    assert _run(out_battery, world_size, verify) == ["ok"] * world_size


def bad_out() -> dict[str, tuple[str, str]]:
    g = shardwise.get_default_group()
    r, w = g.rank, g.size
    seen = {
        "gather_shape": _attempt(lambda: g.all_gather(torch.ones(2), out=torch.empty(2 * w + (r == 1)))),
        "gather_dtype": _attempt(lambda: g.all_gather(torch.ones(2), out=torch.empty(2 * w, dtype=torch.float64 if r == 0 else torch.float32))),
        "gather_rows": _attempt(lambda: g.all_gather(torch.ones(1 + r), out=torch.empty((1 + r) * w))),
        "rs_shape": _attempt(lambda: g.reduce_scatter([torch.ones(2)] * w, out=torch.empty(3 if r == 1 else 2))),
        "a2a_split": _attempt(lambda: g.all_to_all_single(torch.ones(2 * w), out=torch.empty(2 * w + (r == 0)))),
        "a2a_trailing": _attempt(lambda: g.all_to_all_single(torch.ones(w, 2), out=torch.empty(w, 3 if r == 1 else 2))),
    }
    seen["after"] = ("ok", str(g.all_reduce(torch.ones(1)).item()))
    return seen


def test_bad_out_raises_on_every_rank() -> None:
    results = _run(bad_out, 2)
    check_errors(
        results,
        {"gather_rows": ("CollectiveMismatchError", "ranks disagree on the number of rows (all_gather with out= needs equal sizes)")},
        {
            "gather_shape": (1, "ValueError", "out has shape (5,) but the result has shape (4,)"),
            "gather_dtype": (0, "TypeError", "out is torch.float64 but the result is torch.float32"),
            "rs_shape": (1, "ValueError", "out has shape (3,) but the result has shape (2,)"),
            "a2a_split": (0, "ValueError", "output_split_sizes not given and dim 0 (5) does not divide by the group size (2)"),
            "a2a_trailing": (1, "ValueError", "out has shape (2, 3) but the result has shape (2, 2)"),
        },
    )
    for seen in results:
        assert seen["after"] == ("ok", "2.0")


def _attempt(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test inspects which error each rank saw
        return type(exc).__name__, str(exc)
    return "none", ""


def bad_inputs() -> dict[str, tuple[str, str]]:
    g = shardwise.get_default_group()
    r, w = g.rank, g.size
    seen = {
        "dtype": _attempt(lambda: g.all_reduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.int32))),
        "shape": _attempt(lambda: g.all_reduce(torch.ones(2 + r))),
        "reduce_op": _attempt(lambda: g.all_reduce(torch.ones(2), op="sum" if r == 0 else "max")),
        "order": _attempt(lambda: g.all_reduce(torch.ones(1)) if r == 0 else g.barrier()),
        "exchange": _attempt(lambda: g.exchange({"bad": object()} if r == 1 else {"ok": 1})),
        "json_key": _attempt(lambda: g.exchange({1: "int key"} if r == 1 else {})),
        "avg_int": _attempt(lambda: g.all_reduce(torch.ones(2, dtype=torch.int64), op="avg")),
        "splits": _attempt(
            lambda: g.all_to_all_single(torch.ones(w), output_split_sizes=[2] + [0] * (w - 1) if r == 0 else [1] * w)
        ),
        "src": _attempt(lambda: g.broadcast(torch.ones(1), src=w if r == 0 else 0)),
        "list_dtype": _attempt(
            lambda: g.all_to_all([torch.ones(1, dtype=torch.float64 if (r == 1 and s == 0) else torch.float32) for s in range(w)])
        ),
        "chunks": _attempt(lambda: g.reduce_scatter([torch.ones(1 + (r if s == 0 else 0)) for s in range(w)])),
        "not_tensor": _attempt(lambda: g.all_gather([1, 2] if r == 1 else torch.ones(1))),  # type: ignore[arg-type]
        "wrong_len": _attempt(lambda: g.all_to_all([torch.ones(1)] * (w + (r == 0)))),
        "sparse": _attempt(lambda: g.all_reduce(torch.eye(2).to_sparse() if r == 1 else torch.eye(2))),
        "dtype_unsupported": _attempt(lambda: g.all_gather(torch.ones(1, dtype=torch.float8_e4m3fn if r == 0 else torch.float32))),
    }
    seen["reject"] = _attempt(
        lambda: g.reject(ValueError("my own check failed")) if r == 1 else g.all_to_all_single(torch.ones(w))
    )
    seen["reject_kind"] = _attempt(lambda: g.reject(RuntimeError("x")))  # refused locally, nothing sent
    # An API built on exchange names itself in the peers' PeerError, not "exchange".
    seen["labelled"] = _attempt(
        lambda: g.reject(ValueError("bad spec"), op="my_api") if r == 1 else g.exchange({"ok": 1}, op="my_api")
    )
    # The group is still in step after every failure above.
    seen["after"] = ("ok", str(g.all_reduce(torch.ones(1)).item()))
    return seen


EXPECTED_ALL = {
    "dtype": ("CollectiveMismatchError", "ranks disagree on the dtype (rank 0: float32, rank 1: int32"),
    "shape": ("CollectiveMismatchError", "ranks disagree on the number of elements"),
    # By name: the ops' codes in the handshake (0, 3) mean nothing to the user.
    "reduce_op": ("CollectiveMismatchError", "all_reduce: ranks disagree on the reduce op (rank 0: sum, rank 1: max"),
    "order": ("CollectiveMismatchError", "ranks called different collectives at the same point (rank 0: all_reduce, rank 1: barrier"),
    "avg_int": ("TypeError", "avg of torch.int64 tensors would truncate"),
    "splits": ("CollectiveMismatchError", "rank 0 expects to receive [2, 0"),
    "chunks": ("CollectiveMismatchError", "ranks disagree on the size of each rank's chunk"),
}
# (error on the rank at fault, its message; the others raise PeerError)
EXPECTED_ONE = {
    "exchange": (1, "TypeError", "obj['bad'] is a builtins.object, which is not JSON-safe"),
    "json_key": (1, "TypeError", "obj has key 1 of type int; JSON keys must be str"),
    "src": (0, "ValueError", "src=2 is not a rank of this group"),
    "list_dtype": (1, "TypeError", "inputs[1] is torch.float32 but inputs[0] is torch.float64"),
    "not_tensor": (1, "TypeError", "tensor must be a torch.Tensor, got list"),
    "wrong_len": (0, "ValueError", "inputs must hold one tensor per rank (2), got 3"),
    "sparse": (1, "TypeError", "has layout torch.sparse_coo; collectives take dense"),
    "dtype_unsupported": (0, "TypeError", "collectives cannot send torch.float8_e4m3fn tensors"),
    "reject": (1, "ValueError", "my own check failed"),
}


def test_bad_input_raises_on_every_rank() -> None:
    results = _run(bad_inputs, 2)
    check_errors(results, EXPECTED_ALL, EXPECTED_ONE)
    for seen in results:
        assert seen["reject_kind"] == (
            "TypeError", "reject() takes a TypeError, ValueError, IndexError, KeyError or NotImplementedError, got RuntimeError"
        )
        assert seen["after"] == ("ok", "2.0")
    assert results[1]["labelled"] == ("ValueError", "bad spec")
    assert results[0]["labelled"][0] == "PeerError"
    assert results[0]["labelled"][1].startswith("my_api: rank 1 (ValueError) rejected its arguments"), results[0]


def test_errors_are_both_shardwise_and_builtin() -> None:
    assert issubclass(CollectiveMismatchError, RuntimeError) and issubclass(PeerError, RuntimeError)


def empty_splits(verify: bool) -> list[Any]:
    g = shardwise.get_default_group()
    g.verify = verify
    r, w = g.rank, g.size
    data = torch.arange(4 * w, dtype=torch.float32) + 100 * r
    send = [(s % 2) + 1 for s in range(w)]
    # No output splits and empty output splits (torch's spelling) both mean "learn them from the senders".
    derived = [g.all_to_all_single(data[: sum(send)], splits, send) for splits in (None, [])]
    # No input splits and empty ones both mean an equal split, in Group and in the autograd form alike.
    equal = [g.all_to_all_single(data, None, splits) for splits in (None, [])]
    out = torch.empty(4 * w)
    shardwise.nn.functional.all_to_all_single(out, data, [], [])
    return [derived[0].tolist(), derived[1].tolist(), equal[0].tolist(), equal[1].tolist(), out.tolist()]


@pytest.mark.parametrize("verify", [True, False])
def test_empty_split_sizes_mean_none_everywhere(verify: bool) -> None:
    for seen in _run(empty_splits, 2, verify):
        assert seen[0] == seen[1], seen
        assert seen[2] == seen[3] == seen[4], seen
