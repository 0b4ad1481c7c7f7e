"""The core's sharded ops on real ranks: pointwise, tensor methods, comparisons, errors.

Inputs are built from slices of a dense tensor that every rank makes from
the same seed; each rank checks its own shards against the dense result
(values, dtype, gradients), so no gather is needed.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import shardwise
import shardwise.sharded_tensor as sharded
from shardwise._vocab.metadata import ShardMetadata, TensorProperties
from shardwise.errors import OpNotFoundError
from shardwise.sharded_tensor import Shard, ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

from rank_helpers import run as _run

Op = Callable[..., Any]



# -- helpers used inside the ranks ------------------------------------------------------------------


def _box(md: ShardMetadata) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(md.shard_offsets, md.shard_sizes, strict=True))


def make(dense: torch.Tensor, spec: ShardingSpec, requires_grad: bool = False) -> ShardedTensor:
    """A ShardedTensor holding ``dense`` (the same on every rank) sharded by ``spec``."""
    group = shardwise.get_default_group()
    props = TensorProperties(dtype=dense.dtype, requires_grad=requires_grad)
    md = spec.build_metadata(dense.shape, props)
    local = [
        Shard(dense[_box(m)].clone().requires_grad_(requires_grad), m)
        for m in md.shards_metadata
        if m.rank == group.rank
    ]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, sharding_spec=spec)


def check(st: Any, dense: torch.Tensor, what: str, exact: bool = True) -> None:
    """``st`` is a ShardedTensor equal to ``dense`` on this rank's shards, with matching metadata."""
    assert isinstance(st, ShardedTensor), (what, type(st))
    props = st.metadata().tensor_properties
    assert st.size() == dense.shape and props.dtype == dense.dtype == st.dtype, (what, st.size(), props, dense.dtype)
    for shard in st.local_shards():
        assert shard.tensor.dtype == dense.dtype and shard.tensor.requires_grad == props.requires_grad, what
        expected = dense[_box(shard.metadata)]
        if exact:
            assert torch.equal(shard.tensor, expected), (what, shard.tensor, expected)
        else:
            torch.testing.assert_close(shard.tensor, expected, msg=what)


def _grid(size: tuple[int, int], w: int) -> EnumerableShardingSpec:
    """A 2 x 2 uneven grid; with few ranks some hold two blocks."""
    r, c = size[0] // 3, size[1] // 2 + 1
    boxes = [
        ([0, 0], [r, c]),
        ([0, c], [r, size[1] - c]),
        ([r, 0], [size[0] - r, c]),
        ([r, c], [size[0] - r, size[1] - c]),
    ]
    return EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{(i + 1) % w}/cpu") for i, (o, s) in enumerate(boxes)])


def layouts(w: int) -> dict[str, tuple[tuple[int, int], ShardingSpec]]:
    """Chunk dim 0 and dim 1, uneven with empty pieces and permuted placements, an Enumerable grid."""
    ranks = [f"rank:{r}/cpu" for r in range(w)]
    permuted = [f"rank:{(2 + i) % w}/cpu" for i in range(w)]
    return {
        "rows": ((7, 5), ChunkShardingSpec(0, ranks)),
        "cols": ((4, 9), ChunkShardingSpec(1, ranks)),
        "uneven_empty_permuted": ((w, 6), ChunkShardingSpec(0, permuted + permuted[:2])),
        "grid": ((7, 6), _grid((7, 6), w)),
    }


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return "none", ""


# -- pointwise ----------------------------------------------------------------------------------------

# f(x, y) on ShardedTensors and on dense tensors alike; every result is floating (gradients are checked)
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda x, y: x + y,
    "radd": lambda x, y: 2 + x,
    "add_alpha": lambda x, y: torch.add(x, y, alpha=2),
    "add_0d": lambda x, y: x + torch.tensor(1.5, dtype=torch.float64),
    "sub": lambda x, y: x - y,
    "rsub": lambda x, y: 1 - x,
    "sub_alpha": lambda x, y: x.sub(y, alpha=0.5),
    "mul": lambda x, y: x * y,
    "rmul": lambda x, y: 3 * x,
    "mul_0d": lambda x, y: torch.tensor(-2.0) * x,
    "div": lambda x, y: x / y,
    "rdiv": lambda x, y: 2 / y,
    "div_floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
    "div_trunc": lambda x, y: x.div(y, rounding_mode="trunc"),
    "neg": lambda x, y: -x,
    "abs": lambda x, y: abs(x),
    "relu": lambda x, y: torch.relu(x),
    "F.relu": lambda x, y: F.relu(x),
    "Tensor.relu": lambda x, y: x.relu(),
    "sigmoid": lambda x, y: torch.sigmoid(x),
    "tanh": lambda x, y: x.tanh(),
    "pow": lambda x, y: x**2,
    "rpow": lambda x, y: 2**x,
    "pow_tensors": lambda x, y: torch.pow(y, x),
    "pow_fn": lambda x, y: torch.pow(x, 3),
    "clamp": lambda x, y: x.clamp(-0.5, 0.5),
    "where": lambda x, y: torch.where(x > 0, x, y),
    "chain": lambda x, y: ((x * 2 + 1).sigmoid() - y / 3).tanh(),
    "maximum": lambda x, y: torch.maximum(x, y),
    "exp_log_sqrt": lambda x, y: x.exp() + torch.log(y) + y.sqrt(),
    "activations": lambda x, y: F.silu(x) + F.gelu(x) + F.leaky_relu(x, 0.1) + F.elu(x) + F.relu6(x) + F.hardtanh(x),
}
COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "eq": lambda x, y: x == y,
    "eq_self": lambda x, y: x == x,
    "ne": lambda x, y: x != 0.5,
    "lt": lambda x, y: x < y,
    "le": lambda x, y: x <= 0,
    "gt": lambda x, y: x > y,
    "ge": lambda x, y: torch.ge(x, y),
    "rlt": lambda x, y: 0 < x,
    "or": lambda x, y: (x < 0) | (x > 0.5),
}


def _inplace_sequence(x: Any, y: Any) -> list[Any]:
    """In-place ops and operators; returns what each call returned (must be ``x`` itself)."""
    returned = [x.add_(1), x.sub_(y), x.mul_(2), x.div_(y), x.pow_(2), x.neg_(), x.abs_(), x.clamp_(0.1, 5)]
    x += 1
    x -= 0.5
    x *= y
    x /= 4
    x **= 0.5
    returned += [torch.relu_(x.sub_(1)), F.relu(x, inplace=True), x.sigmoid_(), x.tanh_(), x.relu_()]
    returned += [F.leaky_relu(x.sub_(0.5), 0.1, inplace=True), F.hardtanh(x, -0.1, 0.1, True), F.silu(x, inplace=True)]
    return returned


def pointwise_battery() -> dict[str, Any]:
    group = shardwise.get_default_group()
    w = group.size
    torch.manual_seed(0)
    seen: dict[str, Any] = {}
    for name, (size, spec) in layouts(w).items():
        dx = torch.randn(size, dtype=torch.float64)
        dy = torch.rand(size, dtype=torch.float64) + 0.5
        x, y = make(dx, spec, requires_grad=True), make(dy, spec, requires_grad=True)
        for op_name, f in BINARY.items():
            what = f"{name}/{op_name}"
            out = f(x, y)
            gx, gy = dx.clone().requires_grad_(), dy.clone().requires_grad_()
            expected = f(gx, gy)
            check(out, expected.detach(), what, exact=False)
            assert out.requires_grad and out.sharding_spec() == spec, what
            # backward on the local shards fills the inputs' shards' grads, as the dense op does
            expected.sum().backward()
            for s in x.local_shards() + y.local_shards():
                s.tensor.grad = None
            loss = sum((s.tensor.sum() for s in out.local_shards()), torch.zeros((), dtype=torch.float64))
            if out.local_shards():
                loss.backward()
            for st, dense in ((x, gx), (y, gy)):
                for s in st.local_shards():
                    want = (
                        dense.grad[_box(s.metadata)] if dense.grad is not None else torch.zeros(s.metadata.shard_sizes)
                    )
                    got = s.tensor.grad if s.tensor.grad is not None else torch.zeros_like(want)
                    torch.testing.assert_close(got, want.to(got.dtype), msg=what)
        for op_name, f in COMPARE.items():
            out = f(x, y)
            check(out, f(dx, dy), f"{name}/{op_name}")
            assert out.dtype == torch.bool and not out.requires_grad
        # gradients flow through in-place ops on results of other ops
        z = x * 1
        z.mul_(y).sigmoid_()
        gx, gy = dx.clone().requires_grad_(), dy.clone().requires_grad_()
        (gx * 1).mul_(gy).sigmoid_().sum().backward()
        for s in x.local_shards() + y.local_shards():
            s.tensor.grad = None
        if z.local_shards():
            sum(s.tensor.sum() for s in z.local_shards()).backward()  # type: ignore[union-attr]
        for st, dense in ((x, gx), (y, gy)):
            for s in st.local_shards():
                torch.testing.assert_close(s.tensor.grad, dense.grad[_box(s.metadata)], msg=f"{name}/in-place grad")
        # no grad: results do not require grad
        with torch.no_grad():
            assert not (x * 2).requires_grad
        # in place, on a copy that does not require grad; every call returns the tensor itself
        a, da = make(dx, spec), dx.clone()
        returned = _inplace_sequence(a, y.detach())
        _inplace_sequence(da, dy)
        assert all(r is a for r in returned), name
        check(a, da, f"{name}/in-place", exact=False)
        # an in-place op with an operand that requires grad makes the result require grad
        b = make(dx, spec)
        assert b.mul_(y) is b and b.requires_grad and b.metadata().tensor_properties.requires_grad
        check(b, dx * dy, f"{name}/mul_ grad", exact=False)
        # type promotion: the result's metadata carries the new dtype
        di = torch.arange(math.prod(size)).reshape(size) - 3
        i = make(di, spec)
        check(i * 2, di * 2, f"{name}/int*int")
        check(i + 1.5, di + 1.5, f"{name}/int+float")
        check(i / 2, di / 2, f"{name}/int/int")
        check(i + torch.tensor(2.5), di + torch.tensor(2.5), f"{name}/int+0-d float")
        check(i + x.detach(), di + dx, f"{name}/int+float64 st")
        check(make(dx.float(), spec) + torch.tensor(1.0, dtype=torch.float64), dx.float() + 1.0, f"{name}/f32+0-d f64")
        check(i // 2, di // 2, f"{name}/floordiv")
        check(i % 3, di % 3, f"{name}/mod")
        seen[f"{name}/int_add_float_"] = _error(lambda i=i: i.add_(1.5))
    # errors: the same on every rank, including ranks holding no shard
    (size, spec), (size2, spec2) = layouts(w)["rows"], layouts(w)["grid"]
    x, other = make(torch.ones(size), spec), make(torch.ones(size2), spec2)
    grid_as_rows = make(
        torch.ones(size), EnumerableShardingSpec(spec.build_metadata(size, TensorProperties()).shards_metadata)
    )
    seen["same_boxes_other_spec"] = type(x + grid_as_rows).__name__
    seen["layout"] = _error(lambda: x + other)
    seen["layout_inplace"] = _error(lambda: x.mul_(other))
    seen["plain"] = _error(lambda: torch.add(x, torch.ones(size)))
    seen["plain_operator"] = _error(lambda: x + torch.ones(size))
    seen["matmul"] = _error(lambda: torch.matmul(x, x))
    seen["sum"] = _error(lambda: x.sum())
    seen["where_1"] = _error(lambda: torch.where(x > 0))
    return seen


def _expect(outcome: tuple[str, str], kind: str, *fragments: str) -> None:
    assert outcome[0] == kind and all(f in outcome[1] for f in fragments), (outcome, kind, fragments)


def _check_pointwise(world_size: int, seen: dict[str, Any]) -> None:
    for name in layouts(world_size):
        _expect(seen[f"{name}/int_add_float_"], "RuntimeError", "can't be cast")
    assert seen["same_boxes_other_spec"] == "ShardedTensor"
    for case in ("layout", "layout_inplace"):
        _expect(seen[case], "ValueError", "different layouts", "ChunkShardingSpec", "EnumerableShardingSpec", "reshard")
    # A TypeError and an OpNotFoundError (a RuntimeError, as torch raises).
    _expect(seen["plain"], "UnsupportedOperandError", "Shard it first", "not supported for ShardedTensor!")
    # Python turns a TypeError from a binary operator into its own message
    _expect(seen["plain_operator"], "TypeError")
    _expect(seen["matmul"], "OpNotFoundError", "no sharded implementation of torch.matmul for ChunkShardingSpec")
    _expect(seen["sum"], "OpNotFoundError", "torch.Tensor.sum for ChunkShardingSpec")
    _expect(seen["where_1"], "TypeError", "torch.where(condition)")
    assert issubclass(OpNotFoundError, NotImplementedError)


# -- tensor methods, creation, comparisons -------------------------------------------------------------


def _same_storage(a: ShardedTensor, b: ShardedTensor) -> bool:
    """Whether the non-empty local shards share memory (empty shards have no storage to compare)."""
    pairs = zip(a.local_shards(), b.local_shards(), strict=True)
    return all(s.tensor.data_ptr() == t.tensor.data_ptr() for s, t in pairs if s.tensor.numel())


def _tensor_checks(name: str, size: tuple[int, int], spec: ShardingSpec, seen: dict[str, Any]) -> None:
    group = shardwise.get_default_group()
    dx = torch.randn(size)
    x = make(dx, spec, requires_grad=True)
    mine = any(s.tensor.numel() for s in x.local_shards())
    # detach / data / clone / contiguous
    d = x.detach()
    check(d, dx, "detach")
    assert not d.requires_grad and _same_storage(d, x) and torch.detach(x).size() == x.size()
    assert _same_storage(x.data, x) and not x.data.requires_grad
    c = x.clone()
    check(c, dx, "clone")
    assert all(s.tensor.grad_fn is not None for s in c.local_shards()) and (not mine or not _same_storage(c, x))
    assert torch.clone(x, memory_format=torch.contiguous_format).requires_grad
    with torch.no_grad():
        assert not x.clone().requires_grad
    assert x.contiguous() is x
    seen[f"{name}/clone_channels_last"] = _error(lambda: x.clone(memory_format=torch.channels_last))
    # requires_grad_ and the setter
    d.requires_grad_()
    assert d.requires_grad and all(s.tensor.requires_grad and s.tensor.is_leaf for s in d.local_shards())
    d.requires_grad = False
    assert not d.requires_grad and not any(s.tensor.requires_grad for s in d.local_shards())
    seen[f"{name}/int_requires_grad"] = _error(lambda: make(torch.ones(size, dtype=torch.int64), spec).requires_grad_())
    # to / conversions
    assert x.to(torch.float32) is x and x.to("cpu") is x and x.cpu() is x and x.float() is x
    for conv, dtype in ((x.double(), torch.float64), (x.half(), torch.float16), (x.bfloat16(), torch.bfloat16)):
        check(conv, dx.to(dtype), f"to {dtype}")
    for conv, dtype in ((x.int(), torch.int32), (x.long(), torch.int64), (x.to(torch.bool), torch.bool)):
        check(conv, dx.to(dtype), f"to {dtype}")
    other = make(torch.zeros(size, dtype=torch.int16), spec)
    check(x.to(other), dx.to(torch.int16), "to(other)")
    check(x.type_as(other), dx.to(torch.int16), "type_as")
    check(x.to(dtype=torch.float64, device="cpu", non_blocking=True), dx.double(), "to kwargs")
    copied = x.to(torch.float32, False, True)
    assert copied is not x and (not mine or not _same_storage(copied, x)) and x.to(torch.float32, copy=True) is not x
    assert torch.zeros(3).type_as(x).dtype == torch.float32
    # gradient through a conversion
    y = x.double() * 3
    for s in x.local_shards():
        s.tensor.grad = None
    if y.local_shards():
        sum(s.tensor.sum() for s in y.local_shards()).backward()  # type: ignore[union-attr]
    assert all(torch.equal(s.tensor.grad, torch.full(s.metadata.shard_sizes, 3.0)) for s in x.local_shards())
    # copy_: same layout, devices may differ; the whole tensor; a 0-d tensor; different layout -> ValueError
    t = make(torch.zeros(size), spec)
    assert t.copy_(x.detach().double()) is t
    check(t, dx, "copy_ st")
    check(t.copy_(dx * 2), dx * 2, "copy_ whole")
    check(t.copy_(torch.tensor(5.0)), torch.full(size, 5.0), "copy_ 0-d")
    check(t.copy_(torch.arange(float(size[1]))), torch.arange(float(size[1])).expand(size), "copy_ broadcast")
    seen[f"{name}/copy_bad_size"] = _error(lambda: t.copy_(torch.ones(size[0] + 1, size[1])))
    with torch.no_grad():
        leaf = make(torch.zeros(size), spec, requires_grad=True)
        check(leaf.copy_(dx), dx, "copy_ under no_grad")
    # *_like: same layout, new data
    for like, expected in (
        (torch.zeros_like(x), torch.zeros(size)),
        (torch.ones_like(x, dtype=torch.int64), torch.ones(size, dtype=torch.int64)),
        (torch.full_like(x, 7.5), torch.full(size, 7.5)),
        (torch.full_like(x, fill_value=2, dtype=torch.int32), torch.full(size, 2, dtype=torch.int32)),
        (torch.zeros_like(x, requires_grad=True), torch.zeros(size)),
    ):
        check(like, expected, "like")
        assert like.sharding_spec() == spec
    e = torch.empty_like(x, dtype=torch.float64)
    assert e.dtype == torch.float64 and e.size() == x.size() and not e.requires_grad
    assert [s.metadata for s in e.local_shards()] == [s.metadata for s in x.local_shards()]
    r = torch.rand_like(x)
    assert all(bool(((s.tensor >= 0) & (s.tensor < 1)).all()) for s in r.local_shards())
    seen[f"{name}/like_channels_last"] = _error(lambda: torch.zeros_like(x, memory_format=torch.channels_last))
    seen[f"{name}/rand_int"] = _error(lambda: torch.rand_like(make(torch.ones(size, dtype=torch.int64), spec)))
    seen[f"{name}/normal_bad_std"] = _error(lambda: torch.nn.init.normal_(x.detach(), std=-1.0))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(torch.rand_like(x, generator=g1), torch.rand_like(x, generator=g2))
    # nn.Parameter, modules, deepcopy
    p = torch.nn.Parameter(make(dx, spec))
    assert type(p) is ShardedTensor and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert all(s.tensor.requires_grad and s.tensor.is_leaf for s in p.local_shards())
    assert not torch.nn.Parameter(make(dx, spec), requires_grad=False).requires_grad
    module = torch.nn.Module()
    module.register_parameter("weight", p)
    assert dict(module.named_parameters())["weight"] is p
    out = (p * 2).sigmoid()
    if out.local_shards():
        sum(s.tensor.sum() for s in out.local_shards()).backward()  # type: ignore[union-attr]
    dense = dx.clone().requires_grad_()
    (dense * 2).sigmoid().sum().backward()
    for s in p.local_shards():
        torch.testing.assert_close(s.tensor.grad, dense.grad[_box(s.metadata)])
    clone_module = copy.deepcopy(module)
    q = clone_module.weight
    assert type(q) is ShardedTensor and isinstance(q, torch.nn.Parameter) and q.requires_grad and q is not p
    check(q, dx, "deepcopy")
    assert not mine or not _same_storage(p, q)
    for s, t in zip(p.local_shards(), q.local_shards(), strict=True):
        assert t.tensor.is_leaf and torch.equal(t.tensor.grad, s.tensor.grad) and t.tensor.grad is not s.tensor.grad
    # new_tensor (used by torch.nn.init.trunc_normal_) gives a plain tensor
    n = x.new_tensor([1, 2], device="cpu")
    assert type(n) is torch.Tensor and n.dtype == torch.float32 and n.tolist() == [1.0, 2.0]
    # equal / allclose / any / all: one global answer; differences on a single rank count everywhere
    same = make(dx, spec)
    assert torch.equal(x, same) and x.equal(same) and torch.allclose(x, same) and torch.equal(x, dx)
    bumped = make(dx, spec)
    holder = next(md.rank for md in spec.build_metadata(size, TensorProperties()).shards_metadata if md.numel())
    if group.rank == holder:
        shard = next(s for s in bumped.local_shards() if s.metadata.numel())
        shard.tensor.view(-1)[0] += 1e-6
    assert not torch.equal(x, bumped) and torch.allclose(x, bumped) and bumped.allclose(x, rtol=0, atol=1e-5)
    assert not torch.allclose(x, bumped, rtol=0, atol=0)
    assert not torch.equal(x, x.double()) and not torch.equal(x, torch.zeros(3))
    assert (bumped != x).any().item() and not (bumped != x).all().item() and (x == x).all().item()
    assert torch.any(x > 100).item() is False and type(torch.all(x == x)) is torch.Tensor
    nan = make(torch.full(size, float("nan")), spec)
    assert not torch.allclose(nan, nan) and torch.allclose(nan, nan, equal_nan=True)
    seen[f"{name}/any_dim"] = _error(lambda: x.any(dim=0))


def tensor_battery() -> dict[str, Any]:
    torch.manual_seed(1)
    w = shardwise.get_default_group().size
    seen: dict[str, Any] = {}
    all_layouts = layouts(w)
    for name, (size, spec) in all_layouts.items():
        _tensor_checks(name, size, spec, seen)
    # different layouts: copy_ is a ValueError, equal/allclose are False, on every rank
    size, rows = all_layouts["rows"]
    cols = ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(w)] * 2)
    a, b = make(torch.ones(size), rows), make(torch.ones(size), cols)
    seen["copy_layout"] = _error(lambda: a.copy_(b))
    seen["equal_layout"] = (torch.equal(a, b), torch.allclose(a, b))
    # a spec only creation on another layout: the same whole tensor compares equal only within a layout
    seen["zeros_eq"] = torch.equal(sharded.zeros(rows, *size), torch.zeros_like(a))
    # every rank drew from the default generator alike, failed fills included
    seen["generator_after"] = torch.rand(2).tolist()
    return seen


def _check_tensor(world_size: int, seen: dict[str, Any]) -> None:
    for name in layouts(world_size):
        _expect(seen[f"{name}/clone_channels_last"], "ValueError", "memory_format")
        _expect(seen[f"{name}/like_channels_last"], "ValueError", "memory_format")
        _expect(seen[f"{name}/int_requires_grad"], "RuntimeError", "floating point")
        _expect(seen[f"{name}/copy_bad_size"], "ValueError", "does not broadcast")
        _expect(seen[f"{name}/any_dim"], "TypeError", "whole-tensor")
        _expect(seen[f"{name}/rand_int"], "NotImplementedError", "not implemented for 'Long'")
        _expect(seen[f"{name}/normal_bad_std"], "RuntimeError", "std >= 0.0")
    _expect(seen["copy_layout"], "ValueError", "different layouts", "size [7, 5] sharded by ChunkShardingSpec")
    assert seen["equal_layout"] == (False, False)
    assert seen["zeros_eq"] is True


def battery() -> tuple[dict[str, Any], dict[str, Any]]:
    return pointwise_battery(), tensor_battery()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_ops(world_size: int) -> None:
    results = _run(battery, world_size)
    for outcome in results:
        assert outcome == results[0], "every rank must see the same outcomes and errors"
    _check_pointwise(world_size, results[0][0])
    _check_tensor(world_size, results[0][1])


def divergent_comparisons() -> dict[str, Any]:
    """equal/allclose where only the last rank's operand differs or fails; then a collective in step."""
    group = shardwise.get_default_group()
    last = group.rank == group.size - 1
    size = [5, 3]
    spec = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(group.size)])
    x = make(torch.ones(size), spec)
    other = make(torch.ones(size), ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(group.size)]))
    seen: dict[str, Any] = {
        # The last rank knows "False" without looking at a shard; it must still join the vote.
        "shape": torch.equal(x, torch.ones(3) if last else torch.ones(size)),
        "layout": torch.allclose(x, other if last else make(torch.ones(size), spec)),
        # Fails in the comparison itself on the last rank (a meta tensor has no data to compare with).
        "meta": _error(lambda: torch.equal(x, torch.ones(size, device="meta" if last else "cpu"))),
    }
    seen["after"] = group.all_reduce(torch.ones(1)).item()  # the ranks are still in step
    return seen


def test_a_comparison_that_one_rank_decides_alone_still_answers_on_every_rank() -> None:
    results = _run(divergent_comparisons, 3)
    for rank, seen in enumerate(results):
        assert seen["shape"] is False and seen["layout"] is False, seen
        assert seen["after"] == 3.0, seen
        if rank == 2:
            assert seen["meta"][0] == "NotImplementedError" and "meta" in seen["meta"][1], seen
        else:
            assert seen["meta"][0] == "PeerError", seen
            assert "equal: rank 2 (NotImplementedError) rejected its arguments" in seen["meta"][1], seen


def cuda_moves() -> list[str]:
    """to/cuda/cpu move every shard and placement; values and grad flags survive the trip."""
    spec = ChunkShardingSpec(1, ["rank:0/cpu", "rank:0/cpu", "rank:0/cpu"])
    dense = torch.randn(4, 7)
    x = make(dense, spec, requires_grad=True)
    on_gpu = x.cuda()
    assert all(s.tensor.is_cuda for s in on_gpu.local_shards()) and on_gpu.requires_grad
    assert [str(p.device()) for p in on_gpu.sharding_spec().placements] == ["cuda"] * 3  # type: ignore[attr-defined]
    assert x.to("cuda").device.type == "cuda" and x.to(torch.device("cuda"), torch.float64).dtype == torch.float64
    assert on_gpu.cuda() is on_gpu and torch.equal(on_gpu.cpu(), x) and on_gpu.cpu().device.type == "cpu"
    assert torch.equal(torch.ones_like(x, device="cuda").cpu(), torch.ones_like(x))
    back = (on_gpu * 2).cpu()
    check(back, dense * 2, "cuda round trip")
    return [str(s.tensor.device) for s in on_gpu.local_shards()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moves() -> None:
    (devices,) = _run(cuda_moves, 1)
    assert devices and all(d.startswith("cuda") for d in devices)
