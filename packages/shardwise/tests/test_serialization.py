"""torch.save / torch.load of ShardedTensors and load_with_process_group (test-gloo backend)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardwise
from shardwise import load_with_process_group, shard_parameter
from shardwise._vocab.metadata import ShardMetadata
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec
from shardwise.testing import current_rank_dir

from rank_helpers import run as _run
from rank_helpers import sharded_from_dense as _sharded


class _CustomSpec(ChunkShardingSpec):
    """A spec class of the user's own: pickled as an object, not as a dict."""


def _plain(value: Any) -> bool:
    """Whether ``value`` holds only JSON-like data and plain tensors."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str)) or type(value) is torch.Tensor


def _same(a: Any, b: ShardedTensor, group: Any) -> None:
    assert type(a) is ShardedTensor
    assert a.metadata().to_dict() == b.metadata().to_dict()
    assert a.sharding_spec() == b.sharding_spec() and type(a.sharding_spec()) is type(b.sharding_spec())
    assert a.process_group is group
    assert a.size() == b.size() and a.dtype == b.dtype and a.requires_grad == b.requires_grad
    assert [s.metadata for s in a.local_shards()] == [s.metadata for s in b.local_shards()]
    for x, y in zip(a.local_shards(), b.local_shards(), strict=True):
        assert torch.equal(x.tensor, y.tensor) and x.tensor.requires_grad == y.tensor.requires_grad
        # Local shards share the global metadata's objects.
        assert any(x.metadata is m for m in a.metadata().shards_metadata)


def _tensors() -> dict[str, ShardedTensor]:
    group = shardwise.get_default_group()
    w = group.size
    grid = [ShardMetadata([i, j], [2, 2], f"rank:{(i + j // 2) % w}/cpu") for i in (0, 2) for j in (0, 2)]
    return {
        "cols": _sharded(
            torch.arange(15.0).reshape(3, 5), ChunkShardingSpec(1, [f"rank:{w - 1 - i}/cpu" for i in range(w)])
        ),
        "grid": _sharded(torch.arange(16, dtype=torch.float64).reshape(4, 4), EnumerableShardingSpec(grid)),
        "custom": _sharded(
            torch.ones(w + 1, 2), _CustomSpec(0, [f"rank:{i}/cpu" for i in range(w)]), requires_grad=True
        ),
    }


def save_and_load(out_dir: str) -> str:
    group = shardwise.get_default_group()
    r, w = group.rank, group.size
    here = current_rank_dir()
    made = _tensors()
    state = made["cols"].__getstate__()
    assert _plain(state), state
    assert state["process_group"] == {"rank": r, "size": w}

    # -- round trip, weights_only True (built-in specs) and False (any spec), in and out of the context.
    torch.save({"cols": made["cols"], "grid": made["grid"], "dense": torch.ones(2)}, here / f"st{r}.pt")
    torch.save(made, here / f"all{r}.pt")
    for weights_only in (True, False):
        with load_with_process_group(group) as pg:
            assert pg is group
            got = torch.load(here / f"st{r}.pt", weights_only=weights_only)
        _same(got["cols"], made["cols"], group)
        _same(got["grid"], made["grid"], group)
        assert torch.equal(got["dense"], torch.ones(2))
        assert torch.equal(got["grid"].full_tensor(), torch.arange(16, dtype=torch.float64).reshape(4, 4))
    got = torch.load(here / f"all{r}.pt", weights_only=False)  # no context: the default group
    for name in made:
        _same(got[name], made[name], group)
    with pytest.raises(pickle.UnpicklingError, match="_CustomSpec"):
        torch.load(here / f"all{r}.pt")  # a user's spec class must be allowlisted for weights_only=True
    with torch.serialization.safe_globals([_CustomSpec]):
        _same(torch.load(here / f"all{r}.pt")["custom"], made["custom"], group)

    # -- a sharded module's state dict, and a ShardedTensor parameter.
    torch.manual_seed(3)
    lin = nn.Linear(5, 3)
    truth = lin.weight.detach().clone()
    shard_parameter(lin, "weight", ChunkShardingSpec(0, [f"rank:{i}/cpu" for i in range(w)]))
    torch.save(lin.state_dict(), here / f"lin{r}.pt")
    torch.save(lin.weight, here / f"param{r}.pt")
    torch.manual_seed(4)
    fresh = nn.Linear(5, 3)
    shard_parameter(fresh, "weight", ChunkShardingSpec(0, [f"rank:{i}/cpu" for i in range(w)]))
    with load_with_process_group(group):
        fresh.load_state_dict(torch.load(here / f"lin{r}.pt"))
        param = torch.load(here / f"param{r}.pt")
    assert torch.equal(fresh.weight.full_tensor(), truth) and torch.equal(fresh.bias, lin.bias)
    assert type(param) is ShardedTensor and isinstance(param, nn.Parameter) and param.requires_grad
    assert not isinstance(got["grid"], nn.Parameter)
    assert all(s.tensor.requires_grad for s in param.local_shards())
    # The whole module pickles, hooks included: the loaded one still loads a dense state dict.
    torch.save(lin, here / f"module{r}.pt")
    with load_with_process_group(group):
        module = torch.load(here / f"module{r}.pt", weights_only=False)
    _same(module.weight, lin.weight, group)
    assert isinstance(module.weight, nn.Parameter)
    dense = nn.Linear(5, 3)
    module.load_state_dict(dense.state_dict())
    assert torch.equal(module.weight.full_tensor(), dense.weight.detach())

    # -- nesting is an error; the outer block still works and the context is released after.
    with load_with_process_group(group):
        with pytest.raises(RuntimeError, match='already set by previous "load_with_process_group"'):
            with load_with_process_group(None):
                pass
        torch.load(here / f"st{r}.pt")
    with load_with_process_group(None):
        assert torch.load(here / f"st{r}.pt")["cols"].process_group is group
    with pytest.raises(TypeError, match="process_group must be"):
        with load_with_process_group("world"):
            pass

    # -- another rank's file, or another group size: the errors torch gives.
    other = (r + 1) % w
    if w > 1:
        with pytest.raises(RuntimeError, match=f"Local rank at save time was {other}, but at load time was {r}"):
            torch.load(here / f"st{other}.pt")
    sub = group.new_group([0])
    if sub is not None:
        torch.save(_sharded(torch.ones(2), ChunkShardingSpec(0, ["rank:0/cpu"]), group=sub), here / "sub.pt")
        with load_with_process_group(sub):
            assert torch.load(here / "sub.pt").process_group is sub
        if w > 1:
            with pytest.raises(RuntimeError, match="Local world size at save time was 1, but at load time was 2"):
                torch.load(here / "sub.pt")
    with pytest.raises(RuntimeError, match="expected a shardwise state of version 1, found 99"):
        made["cols"].__setstate__({"version": 99})
    _same(made["cols"], _tensors()["cols"], group)  # the failed restore changed nothing

    # Files for the next run (a fresh process that has pickled nothing yet).
    torch.save(made["grid"], Path(out_dir) / f"grid{r}.pt")
    group.barrier()
    return "ok"


def load_fresh(out_dir: str) -> str:
    group = shardwise.get_default_group()
    r = group.rank
    with load_with_process_group(group):  # allowlists ShardedTensor for weights_only=True
        got = torch.load(Path(out_dir) / f"grid{r}.pt")
    _same(got, _tensors()["grid"], group)
    return "ok"


def test_save_and_load(tmp_path: Path) -> None:
    assert _run(save_and_load, 2, str(tmp_path)) == ["ok"] * 2
    assert _run(load_fresh, 2, str(tmp_path)) == ["ok"] * 2


def test_single_rank() -> None:
    assert _run(load_fresh_single, 1) == ["ok"]


def load_fresh_single() -> str:
    group = shardwise.get_default_group()
    path = current_rank_dir() / "one.pt"
    st = _tensors()["grid"]
    torch.save(st, path)
    _same(torch.load(path), st, group)
    return "ok"
