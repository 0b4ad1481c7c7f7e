"""Behaviour torch 2.13's ``torch.distributed._shard`` has and code written for it relies on (issue 15).

- ``Module.to()``/``cpu()``/``double()`` on a module holding a sharded parameter;
- ``init_from_local_shards(shards, None, None)`` works the global size out;
- ``_init_from_local_shards_and_global_metadata`` with no process group at all;
- ``shard_tensor`` calls a user spec's own ``shard()``;
- the custom-op decorators check the decorated function's signature;
- the exception types and the wording torch's own tests match on.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise._tensor.custom_ops import shardwise_sharded_ops
from shardwise.errors import (
    GroupMismatchError,
    InvalidArgumentError,
    LocalShardsMismatchError,
    OpNotFoundError,
    ShardwiseError,
    UnsupportedOperandError,
)
from shardwise.sharded_tensor import (
    Shard,
    ShardMetadata,
    ShardedTensor,
    ShardedTensorBase,
    ShardedTensorMetadata,
    TensorProperties,
    custom_sharded_op_impl,
    init_from_local_shards,
    ones,
)
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, custom_sharding_spec_op

from rank_helpers import outcome, run

# -- Module.to() / cpu() ----------------------------------------------------------------------


def module_conversions() -> dict[str, Any]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 6)
    full = m.weight.detach().clone()
    shardwise.shard_parameter(m, "weight", ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
    param = m.weight
    (shard,) = param.local_shards()
    leaf = shard.tensor
    optimizer = torch.optim.SGD([leaf], lr=0.5)
    out: dict[str, Any] = {}
    m.cpu()
    m.to("cpu")
    out["cpu_keeps_everything"] = m.weight is param and param.local_tensor() is leaf and param.dtype == torch.float32
    m.double()
    out["double"] = (
        m.weight is param,
        param.dtype,
        param.local_tensor() is leaf,
        leaf.dtype,
        leaf.is_leaf and leaf.requires_grad and param.requires_grad,
        param.metadata().tensor_properties.dtype,
    )
    out["values_kept"] = torch.equal(
        leaf, full[3 * param.process_group.rank : 3 * param.process_group.rank + 3].double()
    )
    # The optimizer still holds the parameter's leaf: a step changes what the module holds.
    leaf.grad = torch.ones_like(leaf)
    optimizer.step()
    out["step_reaches_module"] = torch.equal(m.weight.local_tensor(), leaf) and not torch.equal(
        leaf, full[3 * param.process_group.rank : 3 * param.process_group.rank + 3].double()
    )
    m.to(torch.float32)
    out["back_to_float"] = (m.weight.dtype, m.weight.local_tensor().dtype, m.weight is param)
    out["assign_plain"] = outcome(lambda: setattr(param, "data", torch.zeros(6, 4)))
    # torch's future behaviour swaps tensors instead of assigning .data.
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.double()
        out["swap"] = (type(m.weight).__name__, m.weight.dtype, m.weight.local_tensor().dtype)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    return out


def test_module_to_and_cpu_with_a_sharded_parameter() -> None:
    for out in run(module_conversions, 2):
        assert out["cpu_keeps_everything"]
        assert out["double"] == (True, torch.float64, True, torch.float64, True, torch.float64)
        assert out["values_kept"] and out["step_reaches_module"]
        assert out["back_to_float"] == (torch.float32, torch.float32, True)
        assert out["assign_plain"][0] == "TypeError" and "must be set to a ShardedTensor" in out["assign_plain"][1]
        assert out["swap"] == ("ShardedTensor", torch.float64, torch.float64)


# -- init_from_local_shards with None in the size --------------------------------------------------


def stacked_sizes() -> dict[str, Any]:
    r = shardwise.get_default_group().rank
    out: dict[str, Any] = {}
    for rows in (3, 0):
        md = ShardMetadata([0, 0], [rows, 2], f"rank:{r}/cpu")
        st = init_from_local_shards([Shard(torch.full((rows, 2), float(r)), md)], None, None)
        out[rows] = (list(st.size()), st.local_shards()[0].metadata.shard_offsets, len(st.metadata().shards_metadata))
    # torch's "non-rw" case: the passed offsets are ignored, shards stacked along dim 0 in rank order.
    md = ShardMetadata([0, 5 * r], [5, 5], f"rank:{r}/cpu")
    st = init_from_local_shards([Shard(torch.zeros(5, 5), md)], None, 5)
    out["non_rw"] = (list(st.size()), st.local_shards()[0].metadata.shard_offsets)
    two = [Shard(torch.zeros(1, 2), ShardMetadata([i, 0], [1, 2], f"rank:{r}/cpu")) for i in range(2)]
    out["two_on_rank0"] = outcome(lambda: init_from_local_shards(two if r == 0 else two[:1], None, 2))
    return out


def test_init_from_local_shards_works_out_the_size() -> None:
    for r, out in enumerate(run(stacked_sizes, 2)):
        assert out[3] == ([6, 2], [3 * r, 0], 2)
        assert out[0] == ([0, 2], [0, 0], 2)
        assert out["non_rw"] == ([10, 5], [5 * r, 0])
        kind, message = out["two_on_rank0"]
        assert kind == ("ValueError" if r == 0 else "PeerError"), out["two_on_rank0"]
        assert "exactly one" in message or "rank 0" in message


# -- no process group at all ---------------------------------------------------------------------


def _metadata_4x2() -> ShardedTensorMetadata:
    return ShardedTensorMetadata(
        shards_metadata=[ShardMetadata([0, 0], [2, 2], "rank:0/cpu"), ShardMetadata([2, 0], [2, 2], "rank:1/cpu")],
        size=torch.Size([4, 2]),
    )


def test_building_from_metadata_without_any_process_group() -> None:
    # torch's TestCreateTensorNoProcessGroupMode: this test process never initialises a group.
    assert not shardwise.is_initialized() and not dist.is_initialized()
    md = _metadata_4x2()
    shards = [Shard(torch.zeros(m.shard_sizes), m) for m in md.shards_metadata]
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(local_shards=shards, sharded_tensor_metadata=md)
    assert isinstance(st, ShardedTensor) and st.size() == torch.Size([4, 2]) and st.process_group is None
    assert [s.tensor for s in st.local_shards()] == [s.tensor for s in shards] and st.device == torch.device("cpu")
    # Views of one tensor (not contiguous along dim 1 here) are accepted, as torch does.
    src = torch.randn(4, 4)[:, :2]
    views = [
        Shard(src[o[0] : o[0] + n[0], :], m) for m in md.shards_metadata for o, n in [(m.shard_offsets, m.shard_sizes)]
    ]
    assert not views[0].tensor.is_contiguous()
    ShardedTensor._init_from_local_shards_and_global_metadata(views, md)
    with pytest.raises(LocalShardsMismatchError, match="not in the global metadata"):
        ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(torch.zeros(1, 2), ShardMetadata([0, 0], [1, 2], "rank:0/cpu"))], md
        )
    with pytest.raises(ValueError, match="does not match tensor volume"):
        ShardedTensor._init_from_local_shards_and_global_metadata(
            shards[:1], ShardedTensorMetadata(md.shards_metadata[:1], torch.Size([4, 2]))
        )


# -- a custom spec's own shard() ---------------------------------------------------------------------

_CALLS: list[tuple[int, Any]] = []


class RecordingSpec(ChunkShardingSpec):
    """A chunk spec whose shard() records the call, then shards as the base class does."""

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group: Any = None) -> ShardedTensor:
        _CALLS.append((src_rank, process_group))
        return super().shard(tensor, src_rank=src_rank, process_group=process_group)


class NotYetSpec(ChunkShardingSpec):
    """torch's GridShardingSpec test: a spec whose shard() is not implemented."""

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group: Any = None) -> ShardedTensor:
        raise NotImplementedError("NotYetSpec.shard not implemented yet!")


def custom_spec_shard() -> dict[str, Any]:
    _CALLS.clear()
    spec = RecordingSpec(0, ["rank:1/cpu", "rank:0/cpu"])
    full = torch.arange(12.0).reshape(4, 3)
    st = shardwise.shard_tensor(full, spec, src_rank=1)
    m = torch.nn.Linear(3, 4)
    shardwise.shard_parameter(m, "weight", spec)
    return {
        "calls": [src for src, _ in _CALLS],
        "local": st.local_tensor().tolist(),
        "param_sharded": isinstance(m.weight, ShardedTensor),
        "not_yet": outcome(lambda: shardwise.shard_tensor(full, NotYetSpec(0, ["rank:0/cpu", "rank:1/cpu"]))),
    }


def test_shard_tensor_calls_a_specs_own_shard() -> None:
    for r, out in enumerate(run(custom_spec_shard, 2)):
        assert out["calls"] == [1, 0]  # shard_tensor's src_rank, then shard_parameter's default
        assert out["local"] == torch.arange(12.0).reshape(4, 3)[2 * (1 - r) : 2 * (1 - r) + 2].tolist()
        assert out["param_sharded"]
        assert out["not_yet"][0] == "NotImplementedError" and "not implemented" in out["not_yet"][1]


# -- custom op signatures ----------------------------------------------------------------------------


def test_custom_op_decorators_check_the_signature() -> None:
    before = len(shardwise_sharded_ops())
    with pytest.raises(TypeError, match="expects signature"):

        @custom_sharded_op_impl(torch.nn.functional.linear)
        def my_op1(types: Any, args: Any, kwargs: Any, process_group: Any, random_param: Any) -> None: ...

    with pytest.raises(TypeError, match=re.escape("received signature: (types:")):

        @custom_sharded_op_impl(torch.nn.functional.linear)
        def my_op2(types: Any) -> None: ...

    with pytest.raises(TypeError, match="expects signature"):
        custom_sharding_spec_op(ChunkShardingSpec, torch.nn.functional.linear)(lambda types, args: None)
    assert len(shardwise_sharded_ops()) == before


# -- exception types and torch's wording --------------------------------------------------------------


def test_spec_and_metadata_errors_match_torch() -> None:
    with pytest.raises(ValueError, match="needs to be an integer") as info:
        ChunkShardingSpec(None, ["rank:0/cpu"])  # type: ignore[arg-type]
    assert isinstance(info.value, (TypeError, InvalidArgumentError))
    cases: list[tuple[type[Exception], str, Any]] = [
        (ValueError, "same number of elements", lambda: ShardMetadata([0, 0], [1], "rank:0/cpu")),
        (ValueError, "shard_offsets should be >=0", lambda: ShardMetadata([-1, 0], [1, 1], "rank:0/cpu")),
        (ValueError, "shard_sizes should be >= 0", lambda: ShardMetadata([0, 0], [-1, 1], "rank:0/cpu")),
        (ValueError, "Empty shard list provided", lambda: EnumerableShardingSpec([])),
        (
            ValueError,
            "Found inconsistent ranks for shards",
            lambda: EnumerableShardingSpec(
                [ShardMetadata([0, 0], [1, 1], "rank:0/cpu"), ShardMetadata([0], [1], "rank:0/cpu")]
            ),
        ),
        (
            ValueError,
            "Shards.*overlap",
            lambda: EnumerableShardingSpec(
                [ShardMetadata([0, 0], [3, 3], "rank:0/cpu"), ShardMetadata([2, 0], [3, 3], "rank:0/cpu")]
            ),
        ),
        (ValueError, "Invalid sharding dim", lambda: ChunkShardingSpec(2, ["rank:0/cpu"]).build_metadata([10, 20])),
        (
            ValueError,
            "Shard tensor size does not match with metadata.shard_lengths",
            lambda: Shard(torch.zeros(2, 3), ShardMetadata([0, 0], [5, 5], "rank:0/cpu")),
        ),
        (
            ValueError,
            "Local shard tensor device does not match with local Shard's placement",
            lambda: Shard(torch.zeros(5, 5, device="meta"), ShardMetadata([0, 0], [5, 5], "rank:0/cpu")),
        ),
    ]
    for kind, pattern, call in cases:
        with pytest.raises(kind, match=pattern):
            call()


def errors_across_ranks() -> dict[str, Any]:
    g = shardwise.get_default_group()
    r = g.rank
    spec = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    out: dict[str, Any] = {}
    st = ones(spec, 4, 2)
    other_group = ones(spec, 4, 2, process_group=g.new_group([0, 1]))
    for name, op in (("equal", torch.equal), ("allclose", torch.allclose)):
        try:
            op(st, other_group)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects the error
            out[name] = (isinstance(exc, RuntimeError), isinstance(exc, GroupMismatchError), str(exc))
    try:
        torch.add(st, torch.empty(4, 2))
        out["add"] = None
    except Exception as exc:  # noqa: BLE001
        out["add"] = [isinstance(exc, k) for k in (RuntimeError, OpNotFoundError, TypeError, UnsupportedOperandError)]
        out["add_message"] = str(exc)
    md = spec.build_metadata([4, 2], TensorProperties())
    mine = [m for m in md.shards_metadata if m.rank == r]
    for name, local in (("none", []), ("twice", [Shard(torch.ones(2, 2), mine[0])] * 2)):
        try:
            ShardedTensor._init_from_local_shards_and_global_metadata(local, md)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = (isinstance(exc, RuntimeError), isinstance(exc, ValueError), str(exc))
    wrong_dtype = [Shard(torch.ones(2, 2, dtype=torch.int32), mine[0])]
    out["dtype"] = outcome(lambda: ShardedTensor._init_from_local_shards_and_global_metadata(wrong_dtype, md))
    # Cross-rank disagreements, raised on every rank.
    size = [4, 2] if r == 0 else [4, 3]
    own = ShardMetadata([2 * r, 0], [2, 2], f"rank:{r}/cpu")
    out["global_size"] = outcome(lambda: init_from_local_shards([Shard(torch.ones(2, 2), own)], size))
    dtype = torch.int32 if r == 0 else torch.float32
    out["cross_dtype"] = outcome(lambda: init_from_local_shards([Shard(torch.ones(2, 2, dtype=dtype), own)], [4, 2]))
    out["no_shards"] = outcome(lambda: init_from_local_shards([], [4, 2]))
    out["size_index"] = outcome(lambda: st.size(2))
    out["local_tensor"] = outcome(
        lambda: ones(ChunkShardingSpec(0, ["rank:0/cpu"] * 2 + ["rank:1/cpu"] * 2), 4, 2).local_tensor()
    )
    return out


def test_errors_across_ranks_match_torch() -> None:
    for out in run(errors_across_ranks, 2):
        for name in ("equal", "allclose"):
            assert out[name] is not None and out[name][:2] == (True, True), out[name]
            assert "All distributed tensors should use the same ProcessGroup" in out[name][2]
        assert out["add"] == [True, True, True, True]
        assert re.search(r".*not supported for ShardedTensor!$", out["add_message"]), out["add_message"]
        for name in ("none", "twice"):
            assert out[name] is not None and out[name][:2] == (True, True)
            assert "does not match number of local shards metadata" in out[name][2]
        # The message names the shard this rank should pass, never the one it passed as "missing".
        assert "passed 2 local shard(s), but the global metadata places 1" in out["twice"][2]
        assert (
            out["dtype"][0] == "ValueError"
            and "Local shards' tensor dtype property is incompatible with" in out["dtype"][1]
        )
        assert "ShardedTensor global_size property does not match from different ranks!" in out["global_size"][1]
        assert "ShardedTensor dtype property does not match from different ranks!" in out["cross_dtype"][1]
        assert "have no local shards on all ranks" in out["no_shards"][1]
        assert out["size_index"][0] == "IndexError" and "Dimension out of range" in out["size_index"][1]
        assert (
            out["local_tensor"][0] == "NotImplementedError"
            and "Only single local shard is supported." in out["local_tensor"][1]
        )


def test_invalid_placement_devices_are_runtime_errors() -> None:
    for bad in ("rank:0/cuda:foo", "rank:0/cpu2", "rank:0/foo"):
        with pytest.raises(RuntimeError, match="Invalid device string|Expected one of") as info:
            ChunkShardingSpec(0, [bad])
        assert isinstance(info.value, (ShardwiseError, ValueError))


def test_error_classes_keep_old_except_clauses() -> None:
    assert issubclass(UnsupportedOperandError, TypeError) and issubclass(UnsupportedOperandError, RuntimeError)
    assert issubclass(InvalidArgumentError, TypeError) and issubclass(InvalidArgumentError, ValueError)
    assert issubclass(LocalShardsMismatchError, ValueError) and issubclass(LocalShardsMismatchError, RuntimeError)
    assert issubclass(GroupMismatchError, RuntimeError) and issubclass(GroupMismatchError, ShardwiseError)


def test_spec_inference_takes_torchs_offsets_for_empty_chunks() -> None:
    # torch places an empty trailing chunk at split * index (here 6, past the end of 5 rows).
    from shardwise.sharding_spec import infer_sharding_spec

    placements = ["rank:1/cpu", "rank:0/cpu", "rank:3/cpu", "rank:2/cpu"]
    sizes = [2, 2, 1, 0]
    shards = [ShardMetadata([2 * i, 0], [n, 16], p) for i, (n, p) in enumerate(zip(sizes, placements, strict=True))]
    spec = infer_sharding_spec(shards)
    assert isinstance(spec, ChunkShardingSpec) and spec.dim == 0
    assert [str(p) for p in spec.placements] == placements
