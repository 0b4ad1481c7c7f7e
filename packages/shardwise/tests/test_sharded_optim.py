"""ShardedOptimizer and named_params_with_sharded_tensor on real ranks (test-gloo backend)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._shard.sharded_optim import ShardedOptimizer as TorchShardedOptimizer

import shardwise
import shardwise.nn.functional as swf
from shardwise._vocab.metadata import ShardMetadata
from shardwise.sharded_optim import ShardedOptimizer, named_params_with_sharded_tensor
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

from rank_helpers import run as _run
from rank_helpers import sharded_from_dense


def _sharded(full: torch.Tensor, spec: ShardingSpec, requires_grad: bool = True) -> ShardedTensor:
    return sharded_from_dense(full, spec, requires_grad=requires_grad)


def _rows(st: ShardedTensor) -> tuple[int, int]:
    md = st.local_shards()[0].metadata
    return md.shard_offsets[0], md.shard_offsets[0] + md.shard_sizes[0]


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=gen, dtype=torch.float64), torch.randn(4, 7, generator=gen, dtype=torch.float64)


def _sharded_forward(weight: ShardedTensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``X @ W.T + b`` for the batch ``X`` of all ranks, W row-sharded.

    Every rank multiplies the whole batch by its rows of W; an autograd
    all_gather assembles the output columns, and each rank keeps the rows
    of its own batch. The weight's gradient is then summed over the ranks'
    losses by all_gather's backward.
    """
    group = shardwise.get_default_group()
    batch = torch.cat(group.all_gather(x))
    pieces = swf.all_gather((batch @ weight.local_tensor().t()).t().contiguous())
    order = sorted(weight.metadata().shards_metadata, key=lambda m: m.shard_offsets[0])
    out = torch.cat([pieces[m.rank] for m in order if m.rank is not None]).t() + bias
    return out[group.rank * len(x) : (group.rank + 1) * len(x)]


def _sharded_steps(weight: ShardedTensor, bias: torch.Tensor, opt: Any, steps: range) -> None:
    """Data parallel over ranks (each its own batch) with the weight sharded by rows."""
    group = shardwise.get_default_group()
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step, group.rank)
        ((_sharded_forward(weight, bias, x) - y) ** 2).sum().backward()
        assert bias.grad is not None
        group.all_reduce(bias.grad)  # data parallel for the dense bias
        opt.step()


def _dense_steps(weight: torch.Tensor, bias: torch.Tensor, opt: Any, steps: range, world: int) -> None:
    for step in steps:
        opt.zero_grad()
        loss = sum(((x @ weight.t() + bias - y) ** 2).sum() for x, y in (_batch(step, r) for r in range(world)))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        opt.step()


def _initial() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)


def _model(spec: ShardingSpec) -> tuple[ShardedTensor, torch.Tensor]:
    w, b = _initial()
    return _sharded(w, spec), b.clone().requires_grad_(True)


def _plain(value: Any) -> bool:
    """Whether a state dict holds only JSON-like data and plain tensors."""
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str)) or type(value) is torch.Tensor


def optimizer_battery() -> str:
    group = shardwise.get_default_group()
    r, w = group.rank, group.size
    placements = [f"rank:{(i + 2) % w}/cpu" for i in range(w)]  # permuted: rank:2, rank:0, rank:1
    spec = ChunkShardingSpec(0, placements)

    # -- SGD over sharded + dense params == dense SGD on the whole batch.
    weight, bias = _model(spec)
    opt = ShardedOptimizer({"weight": weight, "bias": bias}, torch.optim.SGD, lr=0.01, momentum=0.9, weight_decay=0.1)
    assert opt.param_groups[0]["params"] == [weight.local_tensor(), bias]
    _sharded_steps(weight, bias, opt, range(5))
    dense_w, dense_b = (t.clone().requires_grad_(True) for t in _initial())
    dense_opt = torch.optim.SGD([dense_w, dense_b], lr=0.01, momentum=0.9, weight_decay=0.1)
    _dense_steps(dense_w, dense_b, dense_opt, range(5), w)
    lo, hi = _rows(weight)
    assert not torch.equal(weight.local_tensor(), _initial()[0][lo:hi])  # it did train
    torch.testing.assert_close(weight.local_tensor(), dense_w[lo:hi], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias, dense_b, rtol=1e-12, atol=1e-12)

    # -- zero_grad: to None by default, to zeros on request.
    _sharded_steps(weight, bias, opt, range(5, 6))
    opt.zero_grad(set_to_none=False)
    grad = weight.local_tensor().grad
    assert grad is not None and torch.equal(grad, torch.zeros_like(grad))
    opt.zero_grad()
    assert weight.local_tensor().grad is None and bias.grad is None

    # -- Adam checkpoint: 3 steps, save, fresh model + optimizer, load, 3 more == 6 uninterrupted, bit for bit.
    ref_w, ref_b = _model(spec)
    ref_opt = ShardedOptimizer({"weight": ref_w, "bias": ref_b}, torch.optim.Adam, lr=0.05, betas=(0.8, 0.9))
    _sharded_steps(ref_w, ref_b, ref_opt, range(6))

    w1, b1 = _model(spec)
    opt1 = ShardedOptimizer({"weight": w1, "bias": b1}, torch.optim.Adam, lr=0.05, betas=(0.8, 0.9))
    _sharded_steps(w1, b1, opt1, range(3))
    sd = opt1.state_dict()
    key = f"weight[{lo}:{hi}, 0:5]"
    assert set(sd["state"]) == {key, "bias"}, sd["state"].keys()
    assert sd["param_groups"][0]["params"] == [key, "bias"]
    assert sd["params"][key] == {"param": "weight", "offsets": [lo, 0], "sizes": [hi - lo, 5], "size": [7, 5]}
    assert sd["params"]["bias"] == {"param": "bias", "size": [7]}
    json.dumps({k: v for k, v in sd.items() if k != "state"})
    assert _plain(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True: the state dict is plain data

    w2, b2 = _model(spec)
    with torch.no_grad():
        w2.local_tensor().copy_(w1.local_tensor())
        b2.copy_(b1)
    opt2 = ShardedOptimizer({"weight": w2, "bias": b2}, torch.optim.Adam, lr=0.123)
    opt2.load_state_dict(loaded)
    assert opt2.param_groups[0]["lr"] == 0.05 and opt2.param_groups[0]["betas"] == (0.8, 0.9)
    _sharded_steps(w2, b2, opt2, range(3, 6))
    assert torch.equal(w2.local_tensor(), ref_w.local_tensor())
    assert torch.equal(b2, ref_b)
    ref_state = ref_opt.state_dict()["state"]
    for k in (key, "bias"):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state_dict()["state"][k][name], ref_state[k][name]), (k, name)

    # -- add_param_group: a mapping, a list (unnamed), (name, tensor) pairs; state dict round trip.
    extra = _sharded(torch.arange(12.0, dtype=torch.float64).reshape(6, 2), ChunkShardingSpec(1, placements))
    dense = torch.ones(3, dtype=torch.float64, requires_grad=True)
    pair = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt2.add_param_group({"params": {"extra": extra}, "lr": 0.5})
    opt2.add_param_group({"params": [dense, ("pair", pair)]})
    assert len(opt2.param_groups) == 3 and opt2.param_groups[1]["lr"] == 0.5
    assert opt2.named_params["extra"] is extra and opt2.named_params["pair"] is pair
    for t in [s.tensor for s in extra.local_shards()] + [dense, pair]:
        t.grad = torch.ones_like(t)
    opt2.step()
    sd2 = opt2.state_dict()
    extra_keys = [f"extra[0:6, {s.metadata.shard_offsets[1]}:{s.metadata.ends()[1]}]" for s in extra.local_shards()]
    assert sd2["param_groups"][1]["params"] == extra_keys
    assert sd2["param_groups"][2]["params"] == ["param_groups[2][0]", "pair"]
    opt2.load_state_dict(sd2)
    assert opt2.state_dict()["param_groups"] == sd2["param_groups"]
    with pytest.raises(ValueError, match="state-dict key 'pair'"):
        opt2.add_param_group({"params": {"pair": torch.zeros(1, requires_grad=True)}})
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt2.add_param_group({"params": {"again": dense}})
    assert len(opt2.param_groups) == 3 and "again" not in opt2.named_params
    with pytest.raises(TypeError, match="'params' entry"):
        opt2.add_param_group([dense])  # type: ignore[arg-type]

    # -- load_state_dict refuses another layout or other groups, naming the keys.
    other_layout = ShardedOptimizer(
        {"weight": _sharded(_initial()[0], ChunkShardingSpec(0, placements[::-1])), "bias": bias}, torch.optim.Adam
    )
    refused = other_layout.state_dict()["param_groups"][0]["params"] != sd["param_groups"][0]["params"]
    if refused:
        with pytest.raises(ValueError, match=r"group 0: missing \['weight\[.*unexpected \['weight\["):
            other_layout.load_state_dict(sd)
    else:
        other_layout.load_state_dict(sd)  # this rank holds the same rows under both layouts
    with pytest.raises(ValueError, match="1 parameter group"):
        opt2.load_state_dict(sd)
    with pytest.raises(KeyError, match="'param_groups'"):
        opt2.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match="state for unknown keys"):
        opt1.load_state_dict({**sd, "state": {**sd["state"], "nope": {}}})
    with pytest.raises(TypeError, match="must be a Tensor or ShardedTensor"):
        ShardedOptimizer({"x": 3}, torch.optim.SGD, lr=0.1)  # type: ignore[dict-item]

    # -- several local shards on one rank: one key per shard.
    owners = [0, 1 % w, 0, 2 % w]  # rank 0 holds two shards
    rows = [ShardMetadata([2 * i, 0], [2, 3], f"rank:{owner}/cpu") for i, owner in enumerate(owners)]
    multi = _sharded(torch.arange(24.0).reshape(8, 3), EnumerableShardingSpec(rows))
    opt3 = ShardedOptimizer({"m": multi}, torch.optim.SGD, lr=1.0)
    for s in multi.local_shards():
        s.tensor.grad = torch.ones_like(s.tensor)
    opt3.step()
    mine = [m for m in rows if m.rank == r]
    assert opt3.state_dict()["param_groups"][0]["params"] == [
        f"m[{m.shard_offsets[0]}:{m.ends()[0]}, 0:3]" for m in mine
    ]
    for s in multi.local_shards():
        expected = torch.arange(24.0).reshape(8, 3)[s.metadata.shard_offsets[0] : s.metadata.ends()[0]] - 1
        assert torch.equal(s.tensor.detach(), expected)

    # -- torch 2.13's ShardedOptimizer raises where this one works.
    with pytest.raises(NotImplementedError):
        TorchShardedOptimizer({"b": torch.zeros(1, requires_grad=True)}, torch.optim.SGD, lr=0.1).state_dict()

    # -- named_params_with_sharded_tensor: ShardedTensor attributes, then parameters.
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
    model[1].table = _sharded(torch.zeros(4, 2), spec, requires_grad=False)
    names = [name for name, _ in named_params_with_sharded_tensor(model)]
    assert names == ["1.table", "0.weight", "0.bias", "1.0.weight", "1.0.bias"], names
    assert [n for n, _ in named_params_with_sharded_tensor(model, prefix="m", recurse=False)] == []
    assert [n for n, _ in named_params_with_sharded_tensor(model[1], prefix="m")] == [
        "m.table",
        "m.0.weight",
        "m.0.bias",
    ]
    return "refused" if refused else "accepted"


@pytest.mark.parametrize(("world_size", "expected"), [(1, ["accepted"]), (3, ["accepted", "refused", "refused"])])
def test_sharded_optimizer(world_size: int, expected: list[str]) -> None:
    # With 3 ranks, reversed placements move rows on ranks 1 and 2 only.
    assert _run(optimizer_battery, world_size) == expected
