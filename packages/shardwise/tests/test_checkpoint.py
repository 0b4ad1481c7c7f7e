"""``shardwise.checkpoint``: DCP-format checkpoints over any Group, saved atomically, errors on every rank."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import shardwise
import shardwise.checkpoint as ckpt
from shardwise._vocab import dcp_codec as codec
from shardwise.sharding_spec import ChunkShardingSpec

from rank_helpers import outcome
from rank_helpers import run as _run
from rank_helpers import sharded_from_dense as _sharded

WEIGHT = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4) / 3


def _state(w: int, spec_dim: int, scale: float = 1.0, empty: bool = False) -> dict[str, Any]:
    places = [f"rank:{r}/cpu" for r in range(w)]
    weight = torch.zeros_like(WEIGHT) if empty else WEIGHT * scale
    return {
        "model": {"weight": _sharded(weight, ChunkShardingSpec(spec_dim, places)),
                  "bias": torch.zeros(4) if empty else torch.full((4,), scale)},
        "step": 0 if empty else int(10 * scale),
        "note": "" if empty else f"scale {scale}",
    }


def _matches(state: dict[str, Any], scale: float) -> bool:
    return (
        torch.equal(state["model"]["weight"].full_tensor(), WEIGHT * scale)
        and torch.equal(state["model"]["bias"], torch.full((4,), scale))
        and state["step"] == int(10 * scale)
        and state["note"] == f"scale {scale}"
    )


def save_rank(path: str, scale: float) -> list[str]:
    ckpt.save(_state(shardwise.get_default_group().size, 0, scale), path)
    return sorted(os.listdir(Path(path).parent))


def load_rank(path: str, scale: float) -> bool:
    state = _state(shardwise.get_default_group().size, 1, empty=True)
    ckpt.load(state, path)
    return _matches(state, scale)


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 3), (3, 2)])
def test_save_on_n_ranks_load_on_m_into_another_spec(tmp_path: Path, save_world: int, load_world: int) -> None:
    path = str(tmp_path / "ckpt")
    assert _run(save_rank, save_world, path, 1.0) == [["ckpt"]] * save_world  # no staging directory left
    assert _run(load_rank, load_world, path, 1.0) == [True] * load_world


def test_a_new_save_replaces_the_old_one(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 2, path, 1.0)
    assert _run(save_rank, 2, path, 2.0) == [["ckpt"], ["ckpt"]]
    assert _run(load_rank, 2, path, 2.0) == [True, True]


def failing_save_rank(path: str) -> tuple[str, str]:
    from torch.distributed.checkpoint import FileSystemWriter

    group = shardwise.get_default_group()
    if group.rank == 1:
        def broken(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("disk full (simulated)")

        FileSystemWriter.write_data = broken  # type: ignore[method-assign]
    return outcome(lambda: ckpt.save(_state(group.size, 0, 5.0), path))


def test_a_failed_save_raises_everywhere_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 2, path, 1.0)
    (kind0, msg0), (kind1, msg1) = _run(failing_save_rank, 2, path)
    assert (kind1, msg1) == ("OSError", "disk full (simulated)")
    assert kind0 == "PeerError" and "rank 1" in msg0 and "disk full" in msg0 and "writing" in msg0
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the staging directory was removed
    assert _run(load_rank, 2, path, 1.0) == [True, True]


def killed_save_rank(path: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        real(self, plan, planner).wait()
        os._exit(3)  # killed after writing its data, before any metadata

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    ckpt.save(_state(shardwise.get_default_group().size, 0, 4.0), path)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 1, path, 1.0)
    with pytest.raises(Exception, match="exit|code|died|3"):
        _run(killed_save_rank, 1, path)
    leftovers = [p for p in os.listdir(tmp_path) if p != "ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.saving-")
    assert _run(load_rank, 2, path, 1.0) == [True, True]
    # The next save that completes clears what the killed one left.
    _run(save_rank, 2, path, 2.0)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert _run(load_rank, 1, path, 2.0) == [True]


def test_an_interrupted_replacement_loads_the_old_copy(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _run(save_rank, 2, str(path), 3.0)
    os.replace(path, tmp_path / f".ckpt.old-{'0123' * 8}")  # as if killed between the two renames
    assert _run(load_rank, 2, str(path), 3.0) == [True, True]


def missing_rank(path: str) -> tuple[str, str]:
    return outcome(lambda: ckpt.load(_state(shardwise.get_default_group().size, 0, empty=True), path))


def test_load_from_nothing(tmp_path: Path) -> None:
    for kind, message in _run(missing_rank, 2, str(tmp_path / "absent")):
        assert kind == "FileNotFoundError" and "absent" in message


def wrong_size_rank(path: str) -> tuple[str, str]:
    w = shardwise.get_default_group().size
    state = {"model": {"weight": _sharded(torch.zeros(10, 4), ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(w)]))}}
    return outcome(lambda: ckpt.load(state, path))


def test_load_into_another_global_size_names_the_key_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 2, path, 1.0)
    for kind, message in _run(wrong_size_rank, 2, path):
        assert kind == "ValueError"
        assert "model.weight" in message and "[9, 4]" in message and "[10, 4]" in message


def missing_key_rank(path: str) -> tuple[str, str]:
    state = _state(shardwise.get_default_group().size, 0, empty=True)
    state["model"]["scale"] = torch.zeros(2)  # not in the checkpoint
    return outcome(lambda: ckpt.load(state, path))


def test_load_of_a_key_the_checkpoint_lacks_names_it_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 2, path, 1.0)
    for kind, message in _run(missing_key_rank, 2, path):
        # A ValueError as load() documents (DCP raises RuntimeError), listing what the checkpoint holds.
        assert kind == "ValueError", (kind, message)
        assert "it has no 'model.scale' (it holds 'model.bias', 'model.weight', 'note', 'step')" in message


def test_plans_and_results_travel_as_json() -> None:
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    plan = SavePlan(
        items=[
            WriteItem(MetadataIndex("a.w", torch.Size([2, 0]), 1), WriteItemType.SHARD,
                      tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 5])),
                                                  props, torch.Size([4, 5]))),
            WriteItem(MetadataIndex("step"), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(12)),
        ],
        storage_data=_StoragePrefix("__1_"),
        planner_data={"a.w": ("a", "w"), "step": ("step",)},
    )
    wire = json.loads(json.dumps(codec.encode_plan(plan)))
    assert codec.decode_plan(wire) == plan
    results = [WriteResult(MetadataIndex("a.w", torch.Size([2, 0])), 40, _StorageInfo("__1_0.distcp", 8, 40, ["x"]))]
    assert codec.decode_results(json.loads(json.dumps(codec.encode_results(results)))) == results


def test_a_peer_cannot_name_arbitrary_types() -> None:
    plan = SavePlan(items=[WriteItem(MetadataIndex("w", torch.Size([0])), WriteItemType.SHARD,
                                     tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([1])),
                                                                 TensorProperties(dtype=torch.float32), torch.Size([1])))])
    wire = codec.encode_plan(plan)
    wire["items"][0]["tensor"]["dtype"] = "os.system"
    with pytest.raises(ValueError, match="unknown dtype 'os.system'"):
        codec.decode_plan(wire)
    wire = codec.encode_plan(plan)
    wire["items"][0]["type"] = "EXEC"
    with pytest.raises(ValueError, match="unknown write item type 'EXEC'"):
        codec.decode_plan(wire)


def _grads(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(9, 4, generator=gen), torch.randn(4, generator=gen)


def _train(weight: Any, bias: torch.Tensor, opt: Any, steps: range) -> None:
    from rank_helpers import box

    for step in steps:
        gw, gb = _grads(step)
        if isinstance(weight, torch.Tensor) and not hasattr(weight, "local_shards"):
            weight.grad = gw.clone()
        else:
            for shard in weight.local_shards():
                shard.tensor.grad = box(gw, shard.metadata).clone()
        bias.grad = gb.clone()
        opt.step()


def optimizer_save_rank(path: str, optimizer: str) -> None:
    from shardwise.sharded_optim import ShardedOptimizer

    w = shardwise.get_default_group().size
    weight = _sharded(WEIGHT, ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(w)]), requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    opt = ShardedOptimizer({"weight": weight, "bias": bias}, OPTIMIZERS[optimizer], lr=0.1)
    _train(weight, bias, opt, range(2))
    ckpt.save({"model": {"weight": weight, "bias": bias}, "optim": ckpt.optimizer_state(opt)}, path)


def optimizer_load_rank(path: str, optimizer: str) -> list[str]:
    from shardwise.sharded_optim import ShardedOptimizer

    w = shardwise.get_default_group().size
    places = [f"rank:{r}/cpu" for r in reversed(range(w))]
    weight = _sharded(torch.zeros_like(WEIGHT), ChunkShardingSpec(1, places), requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    opt = ShardedOptimizer({"weight": weight, "bias": bias}, OPTIMIZERS[optimizer], lr=0.1)
    ckpt.load({"model": {"weight": weight, "bias": bias}}, path)
    ckpt.load_optimizer(opt, path, key="optim")
    _train(weight, bias, opt, range(2, 4))
    # The same optimizer on the dense tensors, four steps without a checkpoint.
    dense_w, dense_b = WEIGHT.clone().requires_grad_(), torch.zeros(4, requires_grad=True)
    _train(dense_w, dense_b, OPTIMIZERS[optimizer]([dense_w, dense_b], lr=0.1), range(4))
    problems = []
    if not torch.allclose(weight.full_tensor(), dense_w.detach(), rtol=1e-6, atol=1e-7):
        problems.append("weight differs from dense training")
    if not torch.allclose(bias.detach(), dense_b.detach(), rtol=1e-6, atol=1e-7):
        problems.append("bias differs from dense training")
    return problems


OPTIMIZERS = {"adam": torch.optim.Adam, "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_state_reshards_with_the_parameters(tmp_path: Path, optimizer: str) -> None:
    """Save after two steps on 2 ranks (rows), resume on 3 ranks (columns): the run continues as dense training."""
    path = str(tmp_path / "ckpt")
    _run(optimizer_save_rank, 2, path, optimizer)
    assert _run(optimizer_load_rank, 3, path, optimizer) == [[], [], []]


def one_holder_save_rank(path: str) -> list[list[str]]:
    """The whole weight on rank 0 (rank 1 holds none of it) and a tensor learning rate."""
    from shardwise.sharded_optim import ShardedOptimizer
    from shardwise.sharding_spec import EnumerableShardingSpec, ShardMetadata

    weight = _sharded(WEIGHT, EnumerableShardingSpec([ShardMetadata([0, 0], [9, 4], "rank:0/cpu")]),
                      requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    opt = ShardedOptimizer({"weight": weight, "bias": bias}, OPTIMIZERS["sgd-momentum"], lr=torch.tensor(0.1))
    _train(weight, bias, opt, range(2))
    state = ckpt.optimizer_state(opt)
    ckpt.save({"model": {"weight": weight, "bias": bias}, "optim": state}, path)
    return [group["params"] for group in state["param_groups"]]


def test_param_groups_name_the_parameters_a_rank_holds_no_shard_of(tmp_path: Path) -> None:
    """Every rank lists every parameter (DCP keeps one rank's copy), and a tensor lr loads back."""
    path = str(tmp_path / "ckpt")
    assert _run(one_holder_save_rank, 2, path) == [[["weight", "bias"]]] * 2
    assert _run(optimizer_load_rank, 3, path, "sgd-momentum") == [[], [], []]


def no_optimizer_rank(path: str) -> tuple[str, str]:
    from shardwise.sharded_optim import ShardedOptimizer

    bias = torch.zeros(4, requires_grad=True)
    opt = ShardedOptimizer({"bias": bias}, torch.optim.SGD, lr=0.1)
    return outcome(lambda: ckpt.load_optimizer(opt, path, key="optim"))


def test_load_optimizer_without_optimizer_state(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _run(save_rank, 2, path, 1.0)
    for kind, message in _run(no_optimizer_rank, 2, path):
        assert kind == "KeyError" and "no optimizer state under 'optim'" in message


class _Touch:
    """A pickle that, when loaded without restriction, creates the file ``path`` (a stand-in for any code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def crafted_checkpoint_rank(path: str, marker: str, what: str) -> tuple[str, str]:
    import pickle

    group = shardwise.get_default_group()
    w = _sharded(torch.arange(12.0).reshape(4, 3), ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(group.size)]))
    if what == "metadata":
        ckpt.save({"w": w, "step": 3}, path)
        group.barrier()
        if group.rank == 0:
            Path(path, ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    else:  # a value whose pickle runs code when loaded
        ckpt.save({"w": w, "step": _Touch(marker)}, path)
    group.barrier()
    return outcome(lambda: ckpt.load({"w": w, "step": 0}, path))


@pytest.mark.parametrize("what", ["metadata", "value"])
def test_a_checkpoint_that_would_run_code_is_refused_on_every_rank(tmp_path: Path, what: str) -> None:
    marker = tmp_path / "ran"
    for kind, message in _run(crafted_checkpoint_rank, 2, str(tmp_path / "ckpt"), str(marker), what):
        assert kind in ("UnsafeCheckpointError", "PeerError"), (kind, message)
        if kind == "UnsafeCheckpointError":
            assert ("pathlib.Path.touch" in message or "'step'" in message) and "run code" in message, message
    assert not marker.exists()  # nothing was called


def crafted_exchange_rank(marker: str) -> tuple[str, str]:
    import pickle

    from shardwise._vocab import wire as _wire

    group = shardwise.get_default_group()
    if group.rank == 1:
        # This rank runs other code: it puts a pickle where the JSON belongs.
        _wire.encode_json = lambda obj: pickle.dumps(_Touch(marker))  # type: ignore[assignment]
    return outcome(lambda: group.exchange({"rank": group.rank}))


def test_exchange_rejects_a_pickle_from_a_peer_unread() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp, "ran")
        results = _run(crafted_exchange_rank, 2, str(marker))
        assert not marker.exists()
    for kind, message in results:
        assert kind == "ValueError" and "rank 1 sent" in message and "never unpickles" in message, message


def test_leftovers_are_matched_by_exact_name_never_another_checkpoints(tmp_path: Path) -> None:
    from shardwise._modules.checkpoint import _siblings

    token = "ab" * 16
    mine = [f".ckpt[1].saving-{token}", f".ckpt[1].old-{token}"]
    others = [f".ckpt1.saving-{token}", f".ckpt[1]2.saving-{token}", f".ckpt[1].saving-{token}x", ".ckpt[1].old-123"]
    for name in mine + others:
        (tmp_path / name).mkdir()
    found = sorted(p.name for p in _siblings(tmp_path / "ckpt[1]", "saving") + _siblings(tmp_path / "ckpt[1]", "old"))
    assert found == sorted(mine)


def edge_cases_rank(root: str) -> dict[str, Any]:
    """Each case a reviewer broke: a tensor of no element, a torch 2.3 save, the dtype's kind, paths per rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _version

    group = shardwise.get_default_group()
    w, r = group.size, group.rank
    places = [f"rank:{k}/cpu" for k in range(w)]
    seen: dict[str, Any] = {}
    # A ShardedTensor of no element is in the checkpoint (it was left out), for shardwise and for dcp.load.
    ckpt.save({"empty": _sharded(torch.zeros(0, 4), ChunkShardingSpec(0, places)), "x": torch.ones(2)}, f"{root}/zero")
    target = {"empty": _sharded(torch.zeros(0, 4), ChunkShardingSpec(1, places)), "x": torch.zeros(2)}
    seen["zero"] = outcome(lambda: ckpt.load(target, f"{root}/zero"))
    seen["zero_dcp"] = outcome(lambda: dcp.load({"empty": target["empty"], "x": torch.zeros(2)},
                                                checkpoint_id=f"{root}/zero"))
    # Saved with torch 2.3's flattening (a dict of plain values is one entry): loads as with dcp.load.
    if r == 0:
        _version._derived_version = "2_3"
        try:
            dcp.save({"w": torch.arange(4.0), "extra": {"epoch": 3, "tag": "x"}}, checkpoint_id=f"{root}/v23",
                     no_dist=True)
        finally:
            _version._derived_version = None
    group.barrier()
    old = {"w": torch.zeros(4), "extra": {"epoch": 0, "tag": ""}}
    seen["v23"] = (outcome(lambda: ckpt.load(old, f"{root}/v23")), old["w"].tolist(), old["extra"])
    # Another kind of number is refused on every rank before any value is read; a narrower float is not.
    ckpt.save({"w": WEIGHT + 0.5}, f"{root}/kinds")
    seen["to_int"] = outcome(lambda: ckpt.load({"w": torch.zeros(9, 4, dtype=torch.int64)}, f"{root}/kinds"))
    half = {"w": torch.zeros(9, 4, dtype=torch.bfloat16)}
    seen["to_bf16"] = (outcome(lambda: ckpt.load(half, f"{root}/kinds")), torch.equal(half["w"], (WEIGHT + 0.5).bfloat16()))
    # Each rank given its own path: refused on every rank, nothing left behind.
    seen["paths"] = outcome(lambda: ckpt.save({"x": torch.ones(2)}, f"{root}/per_rank{r}"))
    # Loading two different checkpoints on two ranks: refused on every rank.
    ckpt.save({"x": torch.ones(2)}, f"{root}/first")
    ckpt.save({"x": torch.ones(2)}, f"{root}/second")
    seen["two_checkpoints"] = outcome(lambda: ckpt.load({"x": torch.zeros(2)}, f"{root}/{'first' if r == 0 else 'second'}"))
    # A save over a plain file replaces it and leaves no copy of it beside the checkpoint.
    if r == 0:
        Path(root, "was_a_file").write_text("old")
    group.barrier()
    ckpt.save({"x": torch.ones(2)}, f"{root}/was_a_file")
    seen["listing"] = sorted(os.listdir(root))
    return seen


def test_checkpoint_edge_cases_a_review_found(tmp_path: Path) -> None:
    for r, seen in enumerate(_run(edge_cases_rank, 2, str(tmp_path))):
        assert seen["zero"] == ("ok", "") and seen["zero_dcp"] == ("ok", ""), seen
        assert seen["v23"] == (("ok", ""), [0.0, 1.0, 2.0, 3.0], {"epoch": 3, "tag": "x"}), seen
        assert seen["to_int"][0] == "ValueError", seen
        assert "'w' was saved as torch.float32 and cannot be loaded into a torch.int64 tensor" in seen["to_int"][1]
        assert seen["to_bf16"] == (("ok", ""), True), seen
        if r == 1:
            assert seen["paths"][0] == "ValueError", seen
            assert "rank 1 does not see the directory rank 0 is saving into" in seen["paths"][1], seen
        else:
            assert seen["paths"][0] == "PeerError", seen
        assert seen["two_checkpoints"][0] == "ValueError", seen
        assert "ranks are loading different checkpoints" in seen["two_checkpoints"][1], seen
        assert seen["listing"] == ["first", "kinds", "second", "v23", "was_a_file", "zero"], seen


def test_metadata_pickled_by_python_3_13_names_its_paths_in_pathlib_local() -> None:
    import io
    import pathlib
    import pickle

    from shardwise._modules.safe_load import load_metadata

    data = pickle.dumps(pathlib.PurePosixPath("/ckpt/c"), protocol=4)
    moved = data.replace(b"\x8c\x07pathlib", b"\x8c\x0epathlib._local")
    assert moved != data
    assert load_metadata(io.BytesIO(moved), "test") == pathlib.PurePosixPath("/ckpt/c")
