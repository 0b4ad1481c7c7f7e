"""shard_parameter, shard_module, sharding plans, Sharder, module state dicts (test-gloo backend)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.distributed._shard import sharding_plan as torch_plan
from torch.distributed._shard.api import _collect_local_shard as torch_collect_local_shard
from torch.distributed._shard.api import _shard_tensor as torch_shard_tensor
from torch.distributed._shard.api import shard_module as torch_shard_module
from torch.distributed._shard.sharder import Sharder as TorchSharder
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunk

import shardwise
from shardwise import shard_module, shard_parameter
from shardwise._vocab.metadata import TensorProperties
from shardwise.sharded_tensor import Shard, ShardedTensor, pre_load_state_dict_hook, state_dict_hook
from shardwise.sharder import Sharder
from shardwise.sharding_plan import ShardingPlan, ShardingPlanner
from shardwise.sharding_spec import ChunkShardingSpec, ShardingSpec

from rank_helpers import check_errors
from rank_helpers import run as _run


def _attempt(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test inspects which error each rank saw
        return type(exc).__name__, str(exc)
    return "none", ""


def _slice(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    md = shard.metadata
    return full[tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes, strict=True))]


def _sharded(full: torch.Tensor, spec: ShardingSpec) -> ShardedTensor:
    """``full`` cut by ``spec`` from this rank's own slices (no communication)."""
    rank = shardwise.get_default_group().rank
    md = spec.build_metadata(full.size(), TensorProperties(dtype=full.dtype))
    shards = [Shard(torch.zeros(m.shard_sizes), m) for m in md.shards_metadata if m.rank == rank]
    for shard in shards:
        shard.tensor.copy_(_slice(full, shard))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, sharding_spec=spec)


def _placements(w: int) -> list[str]:
    return [f"rank:{(i + 2) % w}/cpu" for i in range(w)]  # permuted: rank:2, rank:0, rank:1


def _check_matches(st: Any, full: torch.Tensor) -> None:
    assert type(st) is ShardedTensor and st.size() == full.size()
    for shard in st.local_shards():
        assert torch.equal(shard.tensor.detach(), _slice(full, shard)), (shard.metadata, full)


class _Maker(nn.Module):
    """Returns its input as a ShardedTensor cut by ``spec`` (no communication)."""

    def __init__(self, spec: ShardingSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, x: torch.Tensor) -> ShardedTensor:
        return _sharded(x, self.spec)


class _TorchMaker(nn.Module):
    """torch 2.13's counterpart of _Maker: a torch ShardedTensor from ``_shard_tensor``."""

    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, x: torch.Tensor) -> Any:
        return torch_shard_tensor(x, self.spec)


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> Any:
        return self.inner(x)


class _WrapSharder(Sharder):
    """Replaces the submodule by a wrapper around it."""

    def shard(self, module: nn.Module) -> nn.Module:
        return _Wrapped(module)


class _Net(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 6)
        self.fc10 = nn.Linear(6, 5)
        self.block = nn.Sequential(nn.Linear(5, 4), _Maker(ChunkShardingSpec(0, _placements(w))))
        self.maker = _Maker(ChunkShardingSpec(0, _placements(w)))
        self.plain = nn.Identity()


def modules_battery() -> str:
    group = shardwise.get_default_group()
    r, w = group.rank, group.size
    placements = _placements(w)
    rows, cols = ChunkShardingSpec(0, placements), ChunkShardingSpec(1, placements)

    # -- shard_parameter: src_rank 1's values, requires_grad kept, still a parameter.
    torch.manual_seed(100 + r)  # every rank starts from different values
    lin = nn.Linear(7, 5)
    lin.bias.requires_grad_(r != 1)  # src_rank's requires_grad wins
    truth_w = group.broadcast(lin.weight.detach().clone(), src=1)
    truth_b = group.broadcast(lin.bias.detach().clone(), src=1)
    shard_parameter(lin, "weight", rows, src_rank=1)
    shard_parameter(lin, "bias", rows, src_rank=1)
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.requires_grad and not lin.bias.requires_grad
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    assert all(s.tensor.requires_grad and s.tensor.is_leaf for s in lin.weight.local_shards())
    _check_matches(lin.weight, truth_w)
    _check_matches(lin.bias, truth_b)
    assert torch.equal(lin.weight.full_tensor(), truth_w)

    # -- state_dict: ShardedTensors under the dense keys; load_state_dict copies into the shards.
    sd = lin.state_dict()
    assert list(sd) == ["weight", "bias"] and all(type(v) is ShardedTensor for v in sd.values())
    _check_matches(sd["weight"], truth_w)
    other = nn.Linear(7, 5)
    shard_parameter(other, "weight", rows)
    shard_parameter(other, "bias", rows)
    other.load_state_dict(sd)
    _check_matches(other.weight, truth_w)
    _check_matches(other.bias, truth_b)
    assert other.weight.requires_grad
    # A dense state dict loads too: each rank copies its slices.
    dense = nn.Linear(7, 5)
    other.load_state_dict(dense.state_dict())
    _check_matches(other.weight, dense.weight.detach())
    _check_matches(other.bias, dense.bias.detach())

    # -- ShardedTensor attributes (not parameters) through the state dict hooks; strict loading works.
    holder = nn.Sequential(nn.Module())
    holder[0].table = _sharded(torch.arange(12.0).reshape(6, 2), rows)
    holder._register_state_dict_hook(state_dict_hook)
    holder.register_load_state_dict_pre_hook(pre_load_state_dict_hook)
    sd = holder.state_dict()
    assert list(sd) == ["0.table"] and sd["0.table"] is holder[0].table
    fresh = nn.Sequential(nn.Module())
    fresh[0].table = _sharded(torch.zeros(6, 2), rows)
    fresh.register_load_state_dict_pre_hook(pre_load_state_dict_hook)
    fresh.load_state_dict(sd, strict=True)
    assert fresh[0].table is holder[0].table

    # -- shard_module: parameters, Sharders replacing submodules, output hooks.
    torch.manual_seed(5)  # the same module everywhere
    net = _Net(w)
    fc1_w, fc10_w = net.fc1.weight.detach().clone(), net.fc10.weight.detach().clone()
    original = net.block[0]
    plan = ShardingPlan(
        plan={"fc1.weight": rows, "fc10.weight": cols, "block.0": _WrapSharder()},
        output_plan={"maker": cols, "block.0.inner": rows},
        return_local_tensor=["maker", "block.1"],
    )
    shard_module(net, plan)
    _check_matches(net.fc1.weight, fc1_w)
    _check_matches(net.fc10.weight, fc10_w)  # "fc10" is not inside "fc1" (torch 2.13 says it is)
    assert isinstance(net.block[0], _Wrapped) and net.block[0].inner is original
    # torch 2.13 shards the same parameters into the same shards.
    if torch.distributed.is_initialized():  # torch 2.13 needs a torch process group (not on mpi)
        torch.manual_seed(5)
        theirs = _Net(w)
        torch_plan_ = torch_plan.ShardingPlan(
            plan={"fc1.weight": TorchChunk(0, list(placements)), "fc10.weight": TorchChunk(1, list(placements))}
        )
        torch_shard_module(theirs, torch_plan_)
        for name in ("fc1", "fc10"):
            mine, their = getattr(net, name).weight.local_shards(), getattr(theirs, name).weight.local_shards()
            assert [(s.metadata.shard_offsets, s.metadata.shard_sizes, str(s.metadata.placement)) for s in mine] == [
                (s.metadata.shard_offsets, s.metadata.shard_sizes, str(s.metadata.placement)) for s in their
            ]
            assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(mine, their, strict=True))
    assert not hasattr(net.block, "mod_name")  # torch 2.13's literal attribute
    x = torch.arange(30.0).reshape(5, 6)
    local = net.maker(x)  # chunked by rows, resharded by columns, then this rank's columns
    assert type(local) is torch.Tensor and local.shape == (5, 2)
    col0 = 2 * placements.index(f"rank:{r}/cpu")
    assert torch.equal(local, x[:, col0 : col0 + 2])
    # Squeezed only when every shard has size 1 along the sharded dim: the same shape on every rank.
    row = net.block[1](torch.arange(3.0 * w).reshape(w, 3))
    assert row.shape == (3,) and torch.equal(
        row, torch.arange(3.0 * w).reshape(w, 3)[placements.index(f"rank:{r}/cpu")]
    )
    uneven = net.block[1](torch.arange(10.0).reshape(5, 2))  # 2, 2, 1 rows
    assert uneven.dim() == 2 and uneven.shape[1] == 2
    # torch 2.13 agrees on the even case, and squeezes only the 1-row rank's tensor in the uneven one.
    if torch.distributed.is_initialized():  # torch 2.13 needs a torch process group (not on mpi)
        torch_maker = torch_collect_local_shard(_TorchMaker(TorchChunk(0, list(placements))))
        assert torch.equal(torch_maker(torch.arange(3.0 * w).reshape(w, 3)), row)
        theirs_uneven = torch_maker(torch.arange(10.0).reshape(5, 2))
        assert torch.equal(theirs_uneven.reshape(-1), uneven.reshape(-1))
        assert theirs_uneven.dim() == (1 if len(uneven) == 1 else 2)
    with pytest.raises(TypeError, match="returned a Tensor, not a ShardedTensor"):
        net.block[0](torch.ones(2, 5))  # output_plan on a module that returns a dense tensor

    # -- the root module ("") in output_plan and return_local_tensor.
    root = _Maker(rows)
    shard_module(root, ShardingPlan(plan={}, output_plan={"": cols}, return_local_tensor=[""]))
    assert torch.equal(root(x), x[:, col0 : col0 + 2])
    return "ok"


def test_modules() -> None:
    assert _run(modules_battery, 3) == ["ok"] * 3


class _NotModuleSharder(Sharder):
    def shard(self, module: nn.Module) -> nn.Module:
        return "not a module"  # type: ignore[return-value]


def modules_bad_inputs() -> dict[str, tuple[str, str]]:
    group = shardwise.get_default_group()
    r, w = group.rank, group.size
    spec = ChunkShardingSpec(0, [f"rank:{i}/cpu" for i in range(w)])
    torch.manual_seed(0)
    net = _Net(w)
    net.foo = 3
    net.fc1.register_buffer("buf", torch.zeros(2))
    if r == 0:
        net.fc10.weight = nn.Parameter(torch.randn(6, 5).t())  # non-contiguous on rank 0 only
    lin = nn.Linear(2, 2)
    lin._parameters["weight"] = _sharded(torch.zeros(2, 2), spec)
    sharder = _WrapSharder()

    def plan(entries: dict[str, Any], **kw: Any) -> ShardingPlan:
        return ShardingPlan(plan=entries, **kw)

    seen = {
        "missing_one": _attempt(lambda: shard_parameter(net.fc1, "weight" if r == 0 else "wieght", spec)),
        "missing_all": _attempt(lambda: shard_parameter(net, "nothing", spec)),
        "not_tensor": _attempt(lambda: shard_parameter(net, "foo", spec)),
        "noncontig": _attempt(lambda: shard_parameter(net.fc10, "weight", spec)),
        "buffer": _attempt(lambda: shard_parameter(net.fc1, "buf", spec)),
        "bad_spec": _attempt(lambda: shard_parameter(net.fc1, "weight", "rows")),  # type: ignore[arg-type]
        "already": _attempt(lambda: shard_parameter(lin, "weight", spec)),
        "conflict": _attempt(
            lambda: shard_module(
                net, plan({"block": sharder, "block.0.weight": spec, "block.1": sharder, "fc1.weight": spec})
            )
        ),
        "unknown": _attempt(
            lambda: shard_module(
                net,
                plan(
                    {"nope.weight": spec, "fc1.wieght": spec, "ghost": sharder},
                    output_plan={"phantom": spec},
                    return_local_tensor=["fc1", "spectre"],
                ),
            )
        ),
        "unknown_one": _attempt(lambda: shard_module(net, plan({"fc1.weight" if r == 0 else "fc2.weight": spec}))),
        "empty_sharder": _attempt(lambda: shard_module(net, plan({"": sharder}))),
        "bad_entry": _attempt(lambda: shard_module(net, plan({"fc1.weight": "rows"}))),
        "bad_output": _attempt(lambda: shard_module(net, plan({}, output_plan={"fc1": "rows"}))),
        "bad_rlt": _attempt(lambda: shard_module(net, plan({}, return_local_tensor="fc1"))),
        "not_plan": _attempt(lambda: shard_module(net, {"fc1.weight": spec})),  # type: ignore[arg-type]
        "plan_mismatch": _attempt(
            lambda: shard_module(net, plan({"fc1.weight": spec if r == 0 else ChunkShardingSpec(1, spec.placements)}))
        ),
        "src_mismatch": _attempt(lambda: shard_module(net, plan({"fc1.weight": spec}), src_rank=r)),
        "noncontig_plan": _attempt(lambda: shard_module(net, plan({"fc10.weight": spec}))),
    }
    # Nothing above sharded anything.
    assert all(type(p) is nn.Parameter for p in net.parameters()), [type(p) for p in net.parameters()]
    seen["not_module"] = _attempt(lambda: shard_module(net, plan({"plain": _NotModuleSharder()})))
    seen["after"] = ("ok", str(group.all_reduce(torch.ones(1)).item()))
    return seen


# case -> (error type, fragment of the message), the same on every rank
EXPECTED_ALL = {
    "missing_all": ("AttributeError", "_Net has no attribute `nothing`"),
    "not_tensor": ("ValueError", "Expected _Net.foo to be a Tensor, but found int"),
    "buffer": ("KeyError", "Linear.buf is a buffer or plain tensor attribute, not a parameter"),
    "bad_spec": ("TypeError", "shard_parameter('weight'): expected a ShardingSpec, got str"),
    "already": ("ValueError", "Linear.weight is already a ShardedTensor; use its reshard(spec)"),
    "conflict": (
        "RuntimeError",
        "parameter entry 'block.0.weight' lies inside submodule 'block' of Sharder entry 'block'; "
        "Sharder entry 'block.1' lies inside submodule 'block' of Sharder entry 'block'",
    ),
    "unknown": (
        "AttributeError",
        "'nope.weight' (no submodule 'nope'), 'fc1.wieght' (Linear has no attribute `wieght`), "
        "'ghost' (no such submodule), output_plan 'phantom' (no such submodule), "
        "return_local_tensor 'spectre' (no such submodule)",
    ),
    "empty_sharder": ("KeyError", "Module path must not be empty for custom sharder!"),
    "bad_entry": ("TypeError", "Only `ShardingSpec` and `Sharder` are supported to shard 'fc1.weight', got str"),
    "bad_output": ("TypeError", "Only `ShardingSpec` is supported as output_plan for 'fc1', got str"),
    "bad_rlt": ("TypeError", "return_local_tensor must be a list of module paths, got 'fc1'"),
    "not_plan": ("TypeError", "shard_module expects a ShardingPlan, got dict"),
    "plan_mismatch": (
        "ValueError",
        "ranks passed different plan to shard_module (rank 0: [['fc1.weight', {'type': 'chunk', 'dim': 0",
    ),
    "src_mismatch": ("ValueError", "ranks passed different src_rank to shard_module (rank 0: 0; rank 1: 1)"),
    "not_module": ("TypeError", "_NotModuleSharder.shard() for 'plain' returned a str"),
}
# case -> (rank at fault, its error type, fragment); the other ranks raise PeerError naming it
EXPECTED_ONE = {
    "missing_one": (1, "AttributeError", "Linear has no attribute `wieght`"),
    "noncontig": (0, "ValueError", "param: weight is not a contiguous Tensor"),
    "unknown_one": (1, "AttributeError", "'fc2.weight' (no submodule 'fc2')"),
    "noncontig_plan": (0, "ValueError", "ShardingPlan entry 'fc10.weight': param: weight is not a contiguous Tensor"),
}


def test_bad_input_raises_on_every_rank() -> None:
    results = _run(modules_bad_inputs, 2)
    check_errors(results, EXPECTED_ALL, EXPECTED_ONE, peer_says="rank {culprit} ({kind}) rejected its arguments")
    for rank, seen in enumerate(results):
        # Peers quote the culprit's message too.
        for case, (_, _, fragment) in EXPECTED_ONE.items():
            assert fragment in seen[case][1], (rank, case, seen[case])
        assert seen["after"] == ("ok", "2.0")


def test_plan_classes_follow_torch() -> None:
    assert [f.name for f in dataclasses.fields(ShardingPlan)] == [
        f.name for f in dataclasses.fields(torch_plan.ShardingPlan)
    ]
    plan = ShardingPlan(plan={})
    assert plan.output_plan is None and plan.return_local_tensor is None
    for abc, method in ((Sharder, "shard"), (ShardingPlanner, "build_plan")):
        with pytest.raises(TypeError, match="abstract"):
            abc()  # type: ignore[abstract]
        assert method in abc.__abstractmethods__

    class Planner(ShardingPlanner):
        def build_plan(self, module: nn.Module) -> ShardingPlan:
            return ShardingPlan(
                plan={f"{name}.weight": ChunkShardingSpec(0, ["rank:0/cpu"]) for name, _ in module.named_children()}
            )

    assert list(Planner().build_plan(nn.Sequential(nn.Linear(1, 1))).plan) == ["0.weight"]


class _TorchWrap(TorchSharder):
    def shard(self, module: nn.Module) -> nn.Module:
        return _Wrapped(module)


def test_torch_differences() -> None:
    """The two torch 2.13 bugs shardwise fixes, shown on torch itself (no communication happens)."""
    torch_spec = TorchChunk(0, ["rank:0/cpu"])
    net = nn.Module()
    net.fc1, net.fc10 = nn.Linear(1, 1), nn.Linear(1, 1)
    # String prefix: "fc10.weight" counts as inside a Sharder for "fc1".
    with pytest.raises(RuntimeError, match="already a Sharder entry for module fc1"):
        torch_shard_module(net, torch_plan.ShardingPlan(plan={"fc10.weight": torch_spec, "fc1": _TorchWrap()}))
    # The Sharder's module lands on an attribute named "mod_name"; the original stays.
    block = nn.Sequential(nn.Linear(1, 1))
    outer = nn.Sequential(block)
    torch_shard_module(outer, torch_plan.ShardingPlan(plan={"0.0": _TorchWrap()}))
    assert isinstance(block.mod_name, _Wrapped) and type(block[0]) is nn.Linear
