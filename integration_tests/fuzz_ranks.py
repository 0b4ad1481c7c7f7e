"""Rank functions and shared helpers of ``test_fuzz.py``.

``run_ranks`` starts fresh processes that import the rank function by
module and name; this module is importable there because the ranks copy
the test process's ``sys.path`` (pytest puts ``integration_tests/`` on it).
It imports neither pytest nor hypothesis, so the ranks start quickly.

Every case arrives as JSON-safe data (sizes, dtype names, specs as
``ShardingSpec.to_dict()``), and every input is rebuilt from a seed in the
case, so each rank can compute the dense reference of the whole job by
itself. A case records what happened instead of raising, and ranks
exchange the case index after each one, so one bad case is reported as such
and never leaves the ranks out of step for the next.
"""

from __future__ import annotations

import math
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import shardwise
from shardwise.sharded_tensor import Shard, ShardMetadata, ShardedTensor, TensorProperties, init_from_local_shards
from shardwise.sharded_tensor import empty as sharded_empty
from shardwise.sharding_spec import ShardingSpec, spec_from_dict

__all__ = [
    "DTYPES",
    "OK",
    "box",
    "dense_of",
    "embedding_battery",
    "input_problem",
    "layout_error",
    "reshard_battery",
    "same_bits",
]

OK = "ok"

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bool": torch.bool}

#: Integer views used to compare floats bit for bit (NaN payloads and -0.0 included).
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bool: torch.uint8}


def box(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` at ``offsets`` of ``sizes`` (a new empty tensor for an empty box, which may lie anywhere)."""
    if math.prod(sizes) == 0:
        return t.new_empty(list(sizes))
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(d, o, n)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes."""
    if type(a) is not torch.Tensor or a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = _BITS.get(a.dtype, a.dtype)
    return torch.equal(a.detach().view(bits), b.detach().view(bits))


def dense_of(size: Sequence[int], dtype_name: str, seed: int) -> torch.Tensor:
    """The whole tensor of a case: the same on every rank.

    Floats are random bit patterns for odd seeds (NaNs with payloads,
    infinities, subnormals, -0.0: only a bytewise exact move keeps them) and
    normal numbers for even ones; int64 spans the whole range.
    """
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(seed)
    n = math.prod(size)
    if dtype == torch.bool:
        flat = torch.randint(0, 2, (n,), generator=g).bool()
    elif dtype == torch.int64:
        flat = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    elif seed % 2:
        bits = _BITS[dtype]
        info = torch.iinfo(bits)
        flat = torch.randint(info.min, info.max, (n,), generator=g, dtype=bits).view(dtype)
    else:
        flat = torch.randn((n,), generator=g, dtype=dtype)
    return flat.reshape(list(size))


def _error(exc: BaseException) -> dict[str, Any]:
    """What the test process needs of an exception: its type (and its bases), message and traceback."""
    return {
        "type": type(exc).__name__,
        "is": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc)[:400],
        "traceback": traceback.format_exc(limit=-4),
    }


def layout_error(spec: ShardingSpec, size: Sequence[int], world: int) -> Optional[str]:
    """Why ``spec`` cannot lay out a tensor of ``size`` on ``world`` ranks (None when it can)."""
    try:
        md = spec.build_metadata(list(size), TensorProperties())
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    for s in md.shards_metadata:
        if s.placement is None or s.placement.rank() >= world:
            return f"shard {s.describe()} is outside a group of {world}"
    return None


def _battery(cases: Sequence[dict[str, Any]], run: Callable[[dict[str, Any], Any], dict[str, Any]]) -> list[Any]:
    """Run every case on this rank; after each, check that the ranks are still in step."""
    group = shardwise.get_default_group()
    results: list[Any] = []
    for i, case in enumerate(cases):
        try:
            results.append(run(case, group))
        except Exception as exc:  # noqa: BLE001 - a bug in the case itself; reported per case
            results.append({"crash": _error(exc)})
        seen = group.exchange(i)
        if seen != [i] * group.size:
            results.append({"out_of_step": seen})
            break
    return results


# -- reshard round trips ------------------------------------------------------------------------------


def _check_shards(st: ShardedTensor, dense: torch.Tensor, rank: int, when: str) -> list[str]:
    """This rank's shards hold exactly their boxes of ``dense``, and every non-empty box it owns is there."""
    failures = []
    if type(st) is not ShardedTensor or tuple(st.size()) != tuple(dense.shape) or st.dtype != dense.dtype:
        return [f"{when}: got {type(st).__name__} {tuple(st.size())} {st.dtype}"]
    held = []
    for shard in st.local_shards():
        md = shard.metadata
        held.append((tuple(md.shard_offsets), tuple(md.shard_sizes)))
        if md.rank != rank:
            failures.append(f"{when}: local shard {md.describe()} is placed on another rank")
        elif not same_bits(shard.tensor, box(dense, md.shard_offsets, md.shard_sizes)):
            failures.append(f"{when}: local shard {md.describe()} differs from the dense tensor")
    for md in st.metadata().shards_metadata:
        if md.rank == rank and md.numel() and (tuple(md.shard_offsets), tuple(md.shard_sizes)) not in held:
            failures.append(f"{when}: no local shard for {md.describe()}")
    return failures


def _build(case: dict[str, Any], spec: ShardingSpec, dense: torch.Tensor, group: Any) -> ShardedTensor:
    """A ShardedTensor of ``dense`` laid out by ``spec``, made the way the case says."""
    how, rank, size = case["build"], group.rank, list(dense.shape)
    if how == "shard_tensor":
        src = case["src_rank"]
        # Only src_rank's tensor is read; the others pass a placeholder.
        mine = dense.clone() if rank == src else torch.empty(0, dtype=dense.dtype)
        return shardwise.shard_tensor(mine, spec, src_rank=src)
    if how == "spec.shard":
        return spec.shard(dense.clone(), src_rank=case["src_rank"])
    if how == "empty":
        st = sharded_empty(spec, *size, dtype=dense.dtype)
        for shard in st.local_shards():
            shard.tensor.copy_(box(dense, shard.metadata.shard_offsets, shard.metadata.shard_sizes))
        return st
    md = spec.build_metadata(size, TensorProperties(dtype=dense.dtype))
    local = [
        Shard(
            box(dense, m.shard_offsets, m.shard_sizes).clone(),
            ShardMetadata(m.shard_offsets, m.shard_sizes, m.placement),
        )
        for m in md.shards_metadata
        if m.rank == rank
    ]
    if how == "init_from_local_shards":
        return init_from_local_shards(local, size)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, sharding_spec=spec)


def _reshard_case(case: dict[str, Any], group: Any) -> dict[str, Any]:
    rank = group.rank
    dense = dense_of(case["size"], case["dtype"], case["seed"])
    src, dst = spec_from_dict(case["src"]), spec_from_dict(case["dst"])
    out: dict[str, Any] = {"failures": []}
    failures: list[str] = out["failures"]
    try:
        st = _build(case, src, dense, group)
    except Exception as exc:  # noqa: BLE001 - compared with the expectation by the test
        out["build"] = _error(exc)
        return out
    out["build"] = OK
    failures += _check_shards(st, dense, rank, "after building")
    before = st.sharding_spec()  # init_from_local_shards infers it: not always ``src``
    try:
        st.reshard(dst)
    except Exception as exc:  # noqa: BLE001
        out["reshard"] = _error(exc)
        # A refused reshard leaves the tensor as it was.
        failures += _check_shards(st, dense, rank, "after a refused reshard")
        if st.sharding_spec() != before:
            failures.append("a refused reshard changed the spec")
    else:
        out["reshard"] = OK
        failures += _check_shards(st, dense, rank, "after reshard")
        if st.sharding_spec() != dst:
            failures.append(f"after reshard the spec is {st.sharding_spec()!r}")
        st.reshard(src)
        failures += _check_shards(st, dense, rank, "after resharding back")
    if not same_bits(st.full_tensor(), dense):
        failures.append("full_tensor differs from the dense tensor")
    target = case["gather_dst"]
    into = torch.empty(dense.shape, dtype=dense.dtype) if rank == target else None
    st.gather(target, into)
    if into is not None and not same_bits(into, dense):
        failures.append(f"gather to rank {target} differs from the dense tensor")
    return out


def reshard_battery(cases: list[dict[str, Any]]) -> list[Any]:
    """Every reshard round trip of ``cases`` on this rank; one result per case."""
    return _battery(cases, _reshard_case)


# -- embeddings -----------------------------------------------------------------------------------------

_ID_DTYPES = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32}


def _rank_input(case: dict[str, Any], r: int) -> dict[str, Any]:
    """Rank ``r``'s arguments of the case as tensors (every rank can rebuild every rank's)."""
    spec = case["inputs"][r]
    ids = torch.tensor(spec["ids"], dtype=torch.int64).reshape(spec["shape"]).to(_ID_DTYPES[spec["id_dtype"]])
    kw: dict[str, Any] = {}
    if case["op"] == "embedding_bag":
        if spec["offsets"] is not None:
            kw["offsets"] = torch.tensor(spec["offsets"], dtype=_ID_DTYPES[spec["offsets_dtype"]])
        if spec["psw_shape"] is not None:
            g = torch.Generator().manual_seed(case["seed"] * 31 + r)
            kw["per_sample_weights"] = torch.rand(spec["psw_shape"], generator=g, dtype=torch.float32)
    return {"input": ids, **kw}


def _options(case: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"padding_idx": case["padding_idx"], "max_norm": case["max_norm"]}
    if case["max_norm"] is not None:
        kw["norm_type"] = case["norm_type"]
    if case["op"] == "embedding_bag":
        kw["mode"] = case["mode"]
        kw["include_last_offset"] = case["include_last_offset"]
    kw["scale_grad_by_freq"] = case["scale_grad_by_freq"]
    return kw


def _call(case: dict[str, Any], args: dict[str, Any], weight: torch.Tensor) -> torch.Tensor:
    op = F.embedding if case["op"] == "embedding" else F.embedding_bag
    return op(weight=weight, **args, **_options(case))


class Refused(Exception):
    """A rank's input that the sharded op documents it refuses; the dense op is not called on it."""


def input_problem(case: dict[str, Any], r: int) -> Optional[str]:
    """The documented error rank ``r``'s own input raises (plugins/shardwise-embedding/README.md), or None.

    Checked here instead of asking the dense op: torch 2.13 crashes the
    process on some bad bags (its max kernel, given ids but no bag), and
    accepts others that the sharded op refuses as documented (decreasing
    offsets in max mode; out-of-range ids after the last bag).
    """
    spec = case["inputs"][r]
    shape, ids, offsets = spec["shape"], spec["ids"], spec["offsets"]
    bag = case["op"] == "embedding_bag"
    if bag and len(shape) not in (1, 2):
        return "ValueError"
    if spec["id_dtype"] not in ("int32", "int64"):
        return "TypeError"
    if any(not 0 <= v < case["num"] for v in ids):
        return "IndexError"
    if not bag:
        return None
    if spec["psw_shape"] is not None and case["mode"] != "sum":
        return "NotImplementedError"
    if spec["psw_shape"] is not None and spec["psw_shape"] != shape:
        return "ValueError"
    if offsets is not None and (
        (offsets and offsets[0] != 0)
        or any(b < a for a, b in zip(offsets, offsets[1:], strict=False))
        or (offsets and offsets[-1] > len(ids))
        or (case["include_last_offset"] and not offsets)
    ):
        return "ValueError"
    return None


def _dense_call(case: dict[str, Any], args: dict[str, Any], weight: torch.Tensor) -> torch.Tensor:
    """:func:`_call` on a dense weight, where dense torch's answer is the meaning of the call."""
    ids = args["input"]
    offsets = args.get("offsets")
    if isinstance(offsets, torch.Tensor):
        # Ids after the last bag belong to no bag. torch 2.13 still counts them in the
        # last bag's mean with include_last_offset, and its max kernel crashes on ids
        # given with no bag at all: the reference gets only the ids in bags.
        end = int(offsets[-1]) if case["include_last_offset"] else ids.numel()
        if offsets.numel() <= int(case["include_last_offset"]):
            end = 0
        args = {k: v[:end] if k in ("input", "per_sample_weights") else v for k, v in args.items()}
    if case["op"] == "embedding_bag" and ids.dim() == 2 and ids.shape[1] == 0:
        # torch 2.13 fails on bags of width 0 ("step must be nonzero"); they are
        # empty bags, which it pools (to zeros) when given as offsets.
        flat = {k: v.reshape(-1) if k in ("input", "per_sample_weights") and v.shape == ids.shape else v
                for k, v in args.items()}
        args = {**flat, "offsets": torch.zeros(ids.shape[0] + int(case["include_last_offset"]), dtype=torch.int64)}
    return _call(case, args, weight)


def _weight(case: dict[str, Any]) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"])
    return torch.randn((case["num"], case["dim"]), generator=g, dtype=torch.float32)


def _loss_weights(case: dict[str, Any], r: int, shape: Sequence[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"] * 7 + 1000 + r)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def _dense_outcomes(case: dict[str, Any], world: int) -> tuple[list[Any], torch.Tensor, Optional[torch.Tensor]]:
    """Every rank's dense result (a tensor, or its error), the weight after all calls, and the dense gradient."""
    weight = _weight(case)
    after = weight.clone()
    outcomes: list[Any] = []
    for r in range(world):
        problem = input_problem(case, r)
        if problem is not None:
            outcomes.append(Refused(problem))
            continue
        try:
            # A fresh copy per call: max_norm renorms the looked-up rows in place (idempotently).
            outcomes.append(_dense_call(case, _rank_input(case, r), weight.clone()))
            _dense_call(case, _rank_input(case, r), after)
        except Exception as exc:  # noqa: BLE001 - dense torch raises all sorts (AssertionError, RuntimeError...)
            outcomes.append(exc)
    grad = None
    if case["grad"] and not any(isinstance(o, Exception) for o in outcomes):
        leaf = weight.clone().requires_grad_()
        loss = sum(
            (_dense_call(case, _rank_input(case, r), leaf) * _loss_weights(case, r, o.shape)).sum()
            for r, o in enumerate(outcomes)
        )
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True) if isinstance(loss, torch.Tensor) else (None,)
        if grad is None:
            grad = torch.zeros_like(weight)
    return outcomes, after, grad


def _close(a: Optional[torch.Tensor], b: torch.Tensor, exact: bool) -> Optional[str]:
    if a is None or type(a) is not torch.Tensor:
        return f"got {type(a).__name__}"
    if exact:
        return None if same_bits(a, b) else f"not bitwise equal:\n{a.tolist()}\n{b.tolist()}"
    try:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    except AssertionError as exc:
        return str(exc)
    return None


def _embedding_case(case: dict[str, Any], group: Any) -> dict[str, Any]:
    rank, world = group.rank, group.size
    outcomes, after, grad = _dense_outcomes(case, world)
    out: dict[str, Any] = {
        "dense": [
            OK if isinstance(o, torch.Tensor) else {"type": type(o).__name__, "message": str(o)[:300]}
            for o in outcomes
        ],
        "failures": [],
    }
    failures: list[str] = out["failures"]
    spec = shardwise.ChunkShardingSpec(case["shard_dim"], [f"rank:{r}/cpu" for r in case["placements"]])
    weight = shardwise.shard_tensor(_weight(case).requires_grad_(case["grad"]), spec)
    try:
        result = _call(case, _rank_input(case, rank), weight)
    except Exception as exc:  # noqa: BLE001 - compared with the dense outcome by the test
        out["sharded"] = _error(exc)
        return out
    out["sharded"] = OK
    mine = outcomes[rank]
    if isinstance(mine, torch.Tensor):
        # A row-wise lookup copies rows: bit for bit the dense result (no renorm arithmetic involved).
        exact = case["op"] == "embedding" and case["shard_dim"] == 0 and case["max_norm"] is None
        problem = _close(result, mine, exact)
        if problem:
            failures.append(f"output: {problem}")
    for shard in weight.local_shards():
        md = shard.metadata
        problem = _close(shard.tensor, box(after, md.shard_offsets, md.shard_sizes), exact=case["max_norm"] is None)
        if problem:
            failures.append(f"weight shard {md.describe()} after the call: {problem}")
    if case["grad"] and isinstance(result, torch.Tensor):
        (result * _loss_weights(case, rank, result.shape)).sum().backward()
        for shard in weight.local_shards():
            md = shard.metadata
            expected = box(grad, md.shard_offsets, md.shard_sizes) if grad is not None else None
            if expected is None:
                continue
            got = shard.tensor.grad if shard.tensor.grad is not None else torch.zeros_like(expected)
            problem = _close(got, expected, exact=False)
            if problem:
                failures.append(f"grad of shard {md.describe()}: {problem}")
    return out


def embedding_battery(cases: list[dict[str, Any]]) -> list[Any]:
    """Every embedding case on this rank; one result per case."""
    return _battery(cases, _embedding_case)
