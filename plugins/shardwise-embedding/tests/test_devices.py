"""Where the sharded ops put their tensors, and the world-size-1 path, checked on a CPU.

A tensor the ops make without naming its device lands on the CPU, which on a
GPU run meets CUDA ids or shards in the next op ("expected all tensors to be
on the same device"). No GPU is needed to catch that: inside
``torch.device("meta")`` every factory call without a device makes a meta
tensor, which has no data, so the op fails at once (or computes nothing
right). The ops are called directly (``sharded_embedding``), because a call
through ``F.embedding`` reaches ``ShardedTensor.__torch_function__`` with the
device mode switched off. On a GPU machine, ``integration_tests/gpu`` runs
the same ops on CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from emb_helpers import DT, chunk_spec, dense_slice, dense_weight, loss_weights, random_ids, run, shard_dense
from shardwise_embedding._ops import sharded_embedding, sharded_embedding_bag

import shardwise

#: (name, op, sharding dim, keyword options, 1-D ids with these offsets instead of 2-D ids).
CASES: list[tuple[str, str, int, dict[str, Any], bool]] = []
for _dim in (0, 1):
    _side = "row" if _dim == 0 else "col"
    CASES += [
        (f"{_side}-embedding", "embedding", _dim, {}, False),
        (f"{_side}-embedding-padding-max_norm", "embedding", _dim, {"padding_idx": 3, "max_norm": 1.0}, False),
        (f"{_side}-embedding-scale_grad", "embedding", _dim, {"scale_grad_by_freq": True}, False),
        (f"{_side}-bag-sum-weights", "embedding_bag", _dim, {"mode": "sum", "per_sample_weights": True}, False),
        (f"{_side}-bag-sum-scale_grad", "embedding_bag", _dim, {"mode": "sum", "scale_grad_by_freq": True}, False),
        (f"{_side}-bag-max", "embedding_bag", _dim, {"mode": "max"}, False),
    ]
    CASES += [
        (f"{_side}-bag-{mode}-offsets-padding-max_norm", "embedding_bag", _dim,
         {"mode": mode, "padding_idx": 2, "max_norm": 1.0}, True)
        for mode in ("sum", "mean", "max")
    ]

#: Table sizes: one smaller than the batch (ids are deduplicated with a mask), one larger (with a sort).
ROWS = (40, 5000)
OFFSETS = [0, 3, 3, 10]


def _call(op: str, dim: int, options: dict[str, Any], offsets: bool, st: Any, rank: int, rows: int,
          key: str) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Rank ``rank``'s arguments of case ``key`` (the same wherever they are made)."""
    ids = random_ids(rows, (6, 4), key, rank)
    kwargs = {k: v for k, v in options.items() if k != "per_sample_weights"}
    if options.get("per_sample_weights"):
        kwargs["per_sample_weights"] = loss_weights((6, 4), key, "psw", rank)
    if offsets:
        return (ids.reshape(-1), st), {**kwargs, "offsets": torch.tensor(OFFSETS)}
    return (ids, st), kwargs


def meta_default_battery() -> list[str]:
    """Every case's general (multi-rank) path under a meta default device; what went wrong, per case."""
    group = shardwise.get_default_group()
    problems = []
    for rows in ROWS:
        for name, op, dim, options, offsets in CASES:
            key = f"{name}-{rows}"
            dense = dense_weight(rows, 8, key)
            st = shard_dense(dense, chunk_spec(dim, range(group.size)))
            (ids, _), kwargs = _call(op, dim, options, offsets, st, group.rank, rows, key)
            sharded_op = sharded_embedding if op == "embedding" else sharded_embedding_bag
            dense_op = getattr(F, op)
            try:
                with torch.device("meta"):
                    assert torch.zeros(1).device.type == "meta"  # the mode is on where the op runs
                    out = sharded_op((ids, st), dict(kwargs), None)
                    out.pow(2).sum().backward()
            except Exception as exc:  # noqa: BLE001 - recorded; the ranks fail in step, so the next case runs
                problems.append(f"{key}: {type(exc).__name__}: {exc}")
                continue
            # The same calls on the dense weight: every rank's batch, one loss.
            ref = dense.clone().requires_grad_()
            total = torch.zeros((), dtype=DT)
            for r in range(group.size):
                (their_ids, _), their_kwargs = _call(op, dim, options, offsets, st, r, rows, key)
                their_out = dense_op(their_ids, ref, **their_kwargs)
                total = total + their_out.pow(2).sum()
                if r == group.rank and not torch.allclose(out, their_out):
                    problems.append(f"{key}: the output differs from the dense op's")
            if options.get("scale_grad_by_freq"):
                # Frequencies count every rank's ids (and torch's own bag op miscounts them): the
                # batteries of test_embedding*.py check those gradients; here they only had to run.
                continue
            total.backward()
            assert ref.grad is not None
            for shard in st.local_shards():
                grad = shard.tensor.grad
                if grad is None or not torch.allclose(grad, dense_slice(ref.grad, shard.metadata)):
                    problems.append(f"{key}: the gradient of the shard at {shard.metadata.shard_offsets} differs")
    return problems


def test_general_path_names_the_device_of_every_tensor() -> None:
    results = run(meta_default_battery, 2)
    assert results == [[], []], "\n".join(p for rank in results for p in rank)


class _NoCollectives(RuntimeError):
    pass


def world_of_one() -> dict[str, Any]:
    """At world size 1 the ops run the dense computation on the one local tensor, with no collective."""
    group = shardwise.get_default_group()
    called: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        called.append("collective")
        raise _NoCollectives("a collective ran at world size 1")

    results: dict[str, Any] = {}
    dense = dense_weight(30, 5, "alone")
    ids = random_ids(30, (7, 3), "alone")
    grad = loss_weights((7, 3, 5), "alone")
    bag_grad = loss_weights((7, 5), "alone-bag")
    for dim in (0, 1):
        st = shard_dense(dense, chunk_spec(dim, [0]))
        (shard,) = [s.tensor for s in st.local_shards()]
        for name in ("_all_gather", "_all_to_all", "_reduce_scatter", "_all_reduce", "_broadcast"):
            setattr(group, name, refuse)
        try:
            out = F.embedding(ids, st, padding_idx=2)
            out.backward(grad)
            bag = F.embedding_bag(ids, st, mode="mean")
            bag.backward(bag_grad)
        finally:
            for name in ("_all_gather", "_all_to_all", "_reduce_scatter", "_all_reduce", "_broadcast"):
                delattr(group, name)
        ref = dense.clone().requires_grad_()
        F.embedding(ids, ref, padding_idx=2).backward(grad)
        F.embedding_bag(ids, ref, mode="mean").backward(bag_grad)
        results[f"dim {dim}"] = (
            torch.equal(out, F.embedding(ids, dense, padding_idx=2))
            and torch.allclose(bag, F.embedding_bag(ids, dense, mode="mean"))
            and shard.grad is not None and ref.grad is not None and torch.allclose(shard.grad, ref.grad)
        )
    # Out-of-range ids are still an IndexError (not a kernel's out-of-bounds read or device assert).
    with pytest.raises(IndexError, match="id 30 in input is out of range for an embedding of 30 rows"):
        F.embedding(torch.tensor([1, 30]), st)
    results["collectives"] = called
    return results


def test_world_size_one_runs_the_dense_op_without_collectives() -> None:
    (result,) = run(world_of_one, 1)
    assert result == {"dim 0": True, "dim 1": True, "collectives": []}
