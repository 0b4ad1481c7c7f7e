"""Tests for :mod:`shardwise.nn.functional` on real gloo ranks.

Every rank builds its inputs from a seed keyed by (test, rank, peer), so each
rank can also build every other rank's inputs and compute the expected values
densely. Losses weight each rank's outputs differently, so a gradient summed
over the wrong ranks (or not summed) shows up. Each test is one ``run_ranks``
call per world size (process start-up dominates the run time).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.testing import assert_close

import shardwise
import shardwise.nn.functional as F
from shardwise.errors import CollectiveMismatchError, PeerError

from rank_helpers import HAS_TORCH_PG
from rank_helpers import run as _run

WORLD_SIZES = [2, 3]
# A torch ProcessGroup argument only exists where the backend is torch-based.
GROUP_KINDS = ["None", "Group", "ProcessGroup"] if HAS_TORCH_PG else ["None", "Group"]
DT = torch.float64


def _data(*key: int, shape: tuple[int, ...]) -> torch.Tensor:
    seed = 0
    for k in key:
        seed = seed * 131 + k + 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _group(kind: str) -> Any:
    if kind == "None":
        return None
    if kind == "Group":
        return shardwise.get_default_group()
    return dist.group.WORLD


def _a2a_rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst``: uneven, some zero."""
    return (src + 2 * dst + 1) % 4


# -- forward and backward ---------------------------------------------------------


def _check_all_gather(group: Any, rank: int, world: int) -> None:
    rows = [1, 3, 0][:world]
    x = _data(1, rank, shape=(rows[rank], 2)).requires_grad_()
    outs = F.all_gather(x, group=group)
    assert len(outs) == world
    for s in range(world):
        assert_close(outs[s], _data(1, s, shape=(rows[s], 2)))
    outs[rank].mul_(1.0)  # outputs are separate tensors, changeable in place
    loss = sum((outs[s] * _data(2, rank, s, shape=(rows[s], 2))).sum() for s in range(world))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    assert_close(x.grad, sum(_data(2, q, rank, shape=(rows[rank], 2)) for q in range(world)))

    # Second order: loss = sum_s w(rank, s) * y_s**2 on every rank.
    x = _data(1, rank, shape=(rows[rank], 2)).requires_grad_()
    outs = F.all_gather(x, group=group)
    loss = sum((outs[s] ** 2 * _data(2, rank, s, shape=(rows[s], 2))).sum() for s in range(world))
    weight = sum(_data(2, q, rank, shape=(rows[rank], 2)) for q in range(world))
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    assert_close(gx, 2 * x.detach() * weight)
    gx.sum().backward()
    assert_close(x.grad, 2 * weight)


def _check_all_to_all(group: Any, rank: int, world: int, *, views: bool) -> None:
    inputs = [_data(3, rank, s, shape=(_a2a_rows(rank, s), 2)).requires_grad_() for s in range(world)]
    recv = [_a2a_rows(s, rank) for s in range(world)]
    if views:  # the common pattern: receive into slices of one buffer
        outputs = list(torch.empty(sum(recv), 2, dtype=DT).split(recv))
    else:
        outputs = [torch.empty(n, 2, dtype=DT) for n in recv]
    res = F.all_to_all(outputs, inputs, group=group)
    assert len(res) == world and all(r is o for r, o in zip(res, outputs, strict=True))
    for s in range(world):
        assert_close(res[s], _data(3, s, rank, shape=(recv[s], 2)))
    loss = sum((res[s] * _data(4, rank, s, shape=(recv[s], 2))).sum() for s in range(world))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    for s in range(world):
        # What rank s received from this rank, it weighted with w(s, rank).
        assert_close(inputs[s].grad, _data(4, s, rank, shape=(_a2a_rows(rank, s), 2)))


def _check_all_to_all_single(group: Any, rank: int, world: int) -> None:
    send = [_a2a_rows(rank, s) for s in range(world)]
    recv = [_a2a_rows(s, rank) for s in range(world)]
    x = torch.cat([_data(5, rank, s, shape=(send[s], 2)) for s in range(world)]).requires_grad_()
    out = torch.empty(sum(recv), 2, dtype=DT)
    res = F.all_to_all_single(out, x, recv, send, group=group)
    assert res is out
    assert_close(res, torch.cat([_data(5, s, rank, shape=(recv[s], 2)) for s in range(world)]))
    (res * _data(6, rank, shape=(sum(recv), 2))).sum().backward()
    expected = []
    for s in range(world):
        # Rank s's output stacks what ranks 0..world-1 sent it, in rank order.
        s_recv = [_a2a_rows(q, s) for q in range(world)]
        offset = sum(s_recv[:rank])
        expected.append(_data(6, s, shape=(sum(s_recv), 2))[offset:offset + send[s]])
    assert_close(x.grad, torch.cat(expected))

    # No split sizes: even splits of both tensors, as in torch.
    x = _data(7, rank, shape=(2 * world, 3)).requires_grad_()
    res = F.all_to_all_single(torch.empty(2 * world, 3, dtype=DT), x, group=group)
    assert_close(res, torch.cat([_data(7, s, shape=(2 * world, 3))[2 * rank:2 * rank + 2] for s in range(world)]))
    (res * (rank + 1)).sum().backward()
    assert_close(x.grad, torch.arange(1, world + 1, dtype=DT).repeat_interleave(2)[:, None].expand(-1, 3))


def _all_reduce_input(kind: str, r: int) -> torch.Tensor:
    if kind == "extremum":
        # Ties: position 0 on every rank, 3 (and 4 for two ranks) on two ranks.
        values = [5.0, r, -r, 1.0 if r < 2 else 0.0, 0.0 if r < 2 else 1.0]
    elif kind == "product":
        # Zeros: one rank at position 1, two ranks at 2 (every rank with two ranks).
        values = [r + 1.5, 0.0 if r == 0 else r + 1.0, 0.0 if r < 2 else 3.0, -(r + 0.5), 2.0]
    else:
        values = _data(10, r, shape=(5,)).tolist()
    return torch.cat([torch.tensor(values, dtype=DT), _data(11, r, shape=(1,))])


_ALL_REDUCE_CASES: list[tuple[Any, str, Callable[[torch.Tensor], torch.Tensor]]] = [
    (ReduceOp.SUM, "plain", lambda t: t.sum(0)),
    ("avg", "plain", lambda t: t.mean(0)),
    (ReduceOp.MAX, "extremum", lambda t: t.amax(0)),
    ("min", "extremum", lambda t: t.amin(0)),
    (ReduceOp.PRODUCT, "product", lambda t: t.prod(0)),
]


def _check_all_reduce(group: Any, rank: int, world: int) -> None:
    for op, kind, dense in _ALL_REDUCE_CASES:
        x = _all_reduce_input(kind, rank).requires_grad_()
        before = x.detach().clone()
        y = F.all_reduce(x, op=op, group=group)
        assert_close(x.detach(), before, msg=f"{op}: input changed")
        assert y.data_ptr() != x.data_ptr()
        # With y + y**2, dL/dy is nonzero where y == 0 too, so the second
        # derivatives at the product's zeros count.
        gx = torch.autograd.grad(((y + y**2) * _data(12, rank, shape=(6,))).sum(), x, create_graph=True)[0]
        (gx * _data(13, rank, shape=(6,))).sum().backward()

        # The same problem on one process, with every rank's data stacked.
        full = torch.stack([_all_reduce_input(kind, r) for r in range(world)]).requires_grad_()
        y_full = dense(full)
        assert_close(y, y_full, msg=f"{op}: value")
        loss = sum(((y_full + y_full**2) * _data(12, q, shape=(6,))).sum() for q in range(world))
        assert isinstance(loss, torch.Tensor)
        g_full = torch.autograd.grad(loss, full, create_graph=True)[0]
        assert_close(gx, g_full[rank], msg=f"{op}: gradient")
        (g_full * torch.stack([_data(13, r, shape=(6,)) for r in range(world)])).sum().backward()
        assert full.grad is not None
        assert_close(x.grad, full.grad[rank], msg=f"{op}: second derivative")

    ints = F.all_reduce(torch.tensor([rank, -rank]), op="max", group=group)
    assert ints.tolist() == [world - 1, 0]


def _check_reduce_scatter(group: Any, rank: int, world: int) -> None:
    chunks = [2, 1, 0][:world]
    for op, scale in (("sum", 1.0), (ReduceOp.AVG, 1.0 / world)):
        inputs = [_data(8, rank, s, shape=(chunks[s], 2)).requires_grad_() for s in range(world)]
        out = torch.empty(chunks[rank], 2, dtype=DT)
        res = F.reduce_scatter(out, inputs, op=op, group=group)
        assert res is out
        assert_close(res, scale * sum(_data(8, q, rank, shape=(chunks[rank], 2)) for q in range(world)))
        (res * _data(9, rank, shape=(chunks[rank], 2))).sum().backward()
        for s in range(world):
            assert_close(inputs[s].grad, scale * _data(9, s, shape=(chunks[s], 2)), msg=f"{op}: grad {s}")
    plain = [_data(8, rank, s, shape=(chunks[s], 2)) for s in range(world)]
    res = F.reduce_scatter(torch.empty(chunks[rank], 2, dtype=DT), plain, op="max", group=group)
    assert_close(res, torch.stack([_data(8, q, rank, shape=(chunks[rank], 2)) for q in range(world)]).amax(0))


def _rank_collectives() -> list[str]:
    group = shardwise.get_default_group()
    rank, world = group.rank, group.size
    done = []
    for kind in GROUP_KINDS:
        g = _group(kind)
        _check_all_gather(g, rank, world)
        _check_all_to_all(g, rank, world, views=kind == "Group")
        _check_all_to_all_single(g, rank, world)
        _check_all_reduce(g, rank, world)
        _check_reduce_scatter(g, rank, world)
        done.append(kind)
    return done


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_values_and_gradients(world_size: int) -> None:
    assert _run(_rank_collectives, world_size) == [GROUP_KINDS] * world_size


# -- bad arguments ----------------------------------------------------------------


def _in_sync(group: Any) -> None:
    """A collective after the errors still works: no rank was left behind."""
    total = F.all_reduce(torch.ones(1), group=group)
    assert total.item() == shardwise.get_default_group().size


def _rank_bad_arguments() -> str:
    group = shardwise.get_default_group()
    rank, world = group.rank, group.size
    grad_in = [torch.ones(2, requires_grad=True) for _ in range(world)]
    outs = [torch.empty(2) for _ in range(world)]
    with pytest.raises(ValueError, match=r"output_tensor_list must hold one tensor per rank"):
        F.all_to_all(outs[:-1], grad_in)
    with pytest.raises(ValueError, match=r"input_tensor_list must hold one tensor per rank"):
        F.all_to_all(outs, [*grad_in, torch.ones(2)])
    with pytest.raises(TypeError, match=r"output_tensor_list\[0\] is torch.float64 but the input is torch.float32"):
        F.all_to_all([t.double() for t in outs], grad_in)
    with pytest.raises(TypeError, match=r"input_tensor_list must be a list"):
        F.all_to_all(outs, torch.ones(world, 2))
    with pytest.raises(TypeError, match=r"output is torch.int64 but the input is torch.float32"):
        F.all_to_all_single(torch.empty(world, dtype=torch.int64), torch.ones(world))
    with pytest.raises(ValueError, match=r"output_split_sizes .* sum to"):
        F.all_to_all_single(torch.empty(world + 1), torch.ones(world), [1] * world, [1] * world)
    with pytest.raises(ValueError, match=r"input_split_sizes not given and dim 0 \(1\) does not divide"):
        F.all_to_all_single(torch.empty(world), torch.ones(1))
    with pytest.raises(ValueError, match=r"output requires grad"):
        F.all_to_all_single(torch.empty(world, requires_grad=True), torch.ones(world))
    with pytest.raises(ValueError, match=r"input_list must hold one tensor per rank"):
        F.reduce_scatter(torch.empty(2), grad_in[:-1])
    with pytest.raises(TypeError, match=r"output is torch.float64 but the input is torch.float32"):
        F.reduce_scatter(torch.empty(2, dtype=torch.float64), grad_in)
    with pytest.raises(ValueError, match=r"output has shape \(3,\), but this rank's result has \(2,\)"):
        F.reduce_scatter(torch.empty(3), grad_in)
    with pytest.raises(ValueError, match=r"reduce_scatter with op 'max' has no gradient"):
        F.reduce_scatter(torch.empty(2), grad_in, op=ReduceOp.MAX)
    with pytest.raises(ValueError, match=r"unsupported reduce op"):
        F.reduce_scatter(torch.empty(2), grad_in, op="median")
    with pytest.raises(ValueError, match=r"unsupported reduce op"):
        F.all_reduce(torch.ones(2), op="median")
    with pytest.raises(TypeError, match=r"avg of torch.int64"):
        F.all_reduce(torch.ones(2, dtype=torch.int64), op="avg")
    with pytest.raises(TypeError, match=r"process_group must be"):
        F.all_gather(torch.ones(2), group="world")
    _in_sync(None)

    # One rank at fault: it raises the real error, its peers PeerError.
    bad = world - 1

    def peer_error(exc: type[Exception]) -> Any:
        if rank == bad:
            return pytest.raises(exc)
        return pytest.raises(PeerError, match=rf"rank {bad} \({exc.__name__}\) rejected its arguments")

    with peer_error(ValueError):
        F.all_to_all(outs[:-1] if rank == bad else outs, grad_in)
    with peer_error(TypeError):
        F.all_to_all_single(torch.empty(world, dtype=torch.int64 if rank == bad else torch.float32), torch.ones(world))
    with peer_error(ValueError):
        F.reduce_scatter(torch.empty(3 if rank == bad else 2), grad_in)
    with peer_error(ValueError):
        F.reduce_scatter(torch.empty(2), grad_in, op="max" if rank == bad else "sum")
    # Sizes fine locally but not what the senders send: every rank raises.
    wrong = [torch.empty(3 if (rank, s) == (0, 1) else 2) for s in range(world)]
    with pytest.raises(CollectiveMismatchError, match=r"rank 0 expects to receive"):
        F.all_to_all(wrong, grad_in)
    _in_sync(dist.group.WORLD if HAS_TORCH_PG else None)
    return "ok"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_arguments_raise_on_every_rank(world_size: int) -> None:
    assert _run(_rank_bad_arguments, world_size) == ["ok"] * world_size


def test_module_surface() -> None:
    import shardwise.nn

    assert shardwise.nn.functional is F
    assert set(F.__all__) == {"all_gather", "all_reduce", "all_to_all", "all_to_all_single", "reduce_scatter"}
    import torch.distributed.nn.functional as torch_functional

    for name in F.__all__:
        ours = inspect.signature(getattr(F, name)).parameters
        theirs = list(inspect.signature(getattr(torch_functional, name)).parameters)
        # torch's parameters, plus a keyword-only async_op (torch has it on its plain collectives only).
        assert list(ours) == [*theirs, "async_op"], name
        assert ours["async_op"].kind is inspect.Parameter.KEYWORD_ONLY and ours["async_op"].default is False
