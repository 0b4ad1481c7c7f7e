"""``F.embedding`` and ``nn.Embedding`` on chunk-sharded weights, against the dense op, on real ranks.

Each rank looks up its own ids (its own shape) in a weight sharded row-wise
or column-wise (even, uneven, with empty shards, permuted placements, fewer
placements than ranks) and compares, by itself, its output, the weight after
the call (``max_norm`` renorms in place) and its local shards' gradients with
the dense op run over every rank's batch. All cases of one world size run in
one launch (:func:`embedding_battery`); each case is still its own pytest test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from emb_helpers import (
    DT,
    Checks,
    assert_case,
    battery,
    battery_of,
    battery_results,
    chunk_spec,
    dense_weight,
    loss_weights,
    max_norm_for,
    random_ids,
    shard_dense,
    sharded_twins,
    step_dense_twin,
    weighted_loss,
)
from torch import nn

import shardwise
from shardwise.sharded_optim import ShardedOptimizer
from shardwise.sharding_spec import ChunkShardingSpec

WORLD_SIZES = [1, 2, 3, 4]

#: Shape of rank r's ids: ``SHAPES[r % 4]`` (ranks differ, some ids are 2-D and 3-D).
SHAPES = [(6,), (2, 3), (3, 1, 2), (5,)]

Layout = tuple[int, int, ChunkShardingSpec]


def layouts(w: int) -> dict[str, Layout]:
    """Name -> (num_embeddings V, embedding_dim D, spec) of the weights tried on ``w`` ranks."""
    ranks = list(range(w))
    out = {
        # V=7 is uneven over 2, 3 and 4 ranks (4+3, 3+3+1, 2+2+2+1).
        "row": (7, 5, chunk_spec(0, ranks)),
        "col": (6, 7, chunk_spec(1, ranks)),
    }
    if w > 1:
        out["row_perm"] = (10, 4, chunk_spec(0, list(reversed(ranks))))
        out["col_perm"] = (5, 9, chunk_spec(1, [(r + 1) % w for r in ranks]))
        # Fewer placements than ranks: the last rank (row_few) or rank 0 (col_few) holds nothing.
        out["row_few"] = (7, 3, chunk_spec(0, list(reversed(ranks[:-1]))))
        out["col_few"] = (4, 5, chunk_spec(1, [(r + 1) % w for r in ranks[:-1]]))
        # D = w - 1 columns over w placements: the last shard is empty.
        out["col_empty"] = (5, w - 1, chunk_spec(1, ranks))
    if w > 2:
        # V = 2 (w - 1) rows in chunks of 2: the last shard is empty.
        out["row_empty"] = (2 * (w - 1), 4, chunk_spec(0, ranks))
    return out


@dataclass(frozen=True)
class Opt:
    """One way of calling F.embedding.

    Attributes:
        padding_idx: Passed as is (may be negative); the row is also put into every rank's ids.
        norm_type: When set, ``max_norm`` (about the median row norm) with this norm type.
        scale_grad: ``scale_grad_by_freq=True`` (frequencies over every rank's ids).
        id_dtype: dtype of the ids.
        dtype: dtype of the weight.
        shapes: ``"mixed"`` (:data:`SHAPES`), ``"scalar"`` (rank 0 has 0-d ids) or ``"empty"``
            (rank 0 has ids of shape (0,), rank 1 of shape (2, 0)).
        grad: ``"backward"``, ``"no_grad"`` (forward under torch.no_grad) or ``"frozen"``
            (weight without requires_grad).
        positional: Pass every option positionally, as nn.Embedding does.
        lookups: Lookups (with different ids) whose losses are summed before one backward.
    """

    padding_idx: Optional[int] = None
    norm_type: Optional[float] = None
    scale_grad: bool = False
    id_dtype: torch.dtype = torch.int64
    dtype: torch.dtype = DT
    shapes: str = "mixed"
    grad: str = "backward"
    positional: bool = False
    lookups: int = 1


OPTIONS: dict[str, Opt] = {
    "plain": Opt(),
    "int32": Opt(id_dtype=torch.int32),
    "float32": Opt(dtype=torch.float32),
    "padding": Opt(padding_idx=1),
    "padding_neg": Opt(padding_idx=-2),
    "max_norm_2": Opt(norm_type=2.0),
    "max_norm_1": Opt(norm_type=1.0),
    "max_norm_inf": Opt(norm_type=math.inf),
    "max_norm_padding_int32": Opt(norm_type=2.0, padding_idx=0, id_dtype=torch.int32),
    "scale_grad": Opt(scale_grad=True),
    "scale_grad_padding": Opt(scale_grad=True, padding_idx=-1),
    "scale_grad_int32": Opt(scale_grad=True, id_dtype=torch.int32),
    "positional": Opt(padding_idx=1, norm_type=2.0, positional=True),
    "scalar_ids": Opt(shapes="scalar"),
    "empty_ids": Opt(shapes="empty"),
    "empty_ids_scale_grad_max_norm": Opt(shapes="empty", scale_grad=True, norm_type=1.0),
    "no_grad": Opt(grad="no_grad"),
    "frozen": Opt(grad="frozen", norm_type=2.0),
    "two_lookups": Opt(lookups=2),
    "two_lookups_scale_grad": Opt(lookups=2, scale_grad=True),
}

#: nn.Embedding cases: the module's options (as an :class:`Opt`), trained with SGD for a few steps.
MODULES: dict[str, Opt] = {
    "module": Opt(),
    "module_padding_max_norm": Opt(padding_idx=1, norm_type=2.0),
    "module_scale_grad": Opt(scale_grad=True, padding_idx=-1),
}

SGD_STEPS = 3
LR = 0.5


#: On 3 and 4 ranks only "row" and "col" get every case; the other layouts these (launch time is
#: dominated by the cases' collectives, and 2 ranks already run everything on every layout).
CORE = [
    "plain", "int32", "padding_neg", "max_norm_2", "max_norm_inf", "scale_grad_padding", "empty_ids", "two_lookups",
    "module_padding_max_norm", "module_scale_grad",
]


def names_for(w: int, layout: str) -> list[str]:
    """The option and module names run on ``layout`` with ``w`` ranks."""
    every = [*OPTIONS, *MODULES]
    return every if w <= 2 or layout in ("row", "col") else [name for name in every if name in CORE]


def case_names(w: int) -> list[str]:
    """Every case the battery runs on ``w`` ranks: ``layout/name``."""
    return [f"{layout}/{name}" for layout in layouts(w) for name in names_for(w, layout)]


# -- inside the ranks -------------------------------------------------------------------------------


def _shape(opt: Opt, rank: int) -> tuple[int, ...]:
    if opt.shapes == "scalar" and rank == 0:
        return ()
    if opt.shapes == "empty" and rank in (0, 1):
        return (0,) if rank == 0 else (2, 0)
    return SHAPES[rank % len(SHAPES)]


def make_ids(num: int, opt: Opt, rank: int, *key: Any) -> torch.Tensor:
    """Rank ``rank``'s ids for case ``key``; the padding row, and a row every rank shares, always occur."""
    ids = random_ids(num, _shape(opt, rank), *key, rank, dtype=opt.id_dtype)
    flat = ids.view(-1)
    if flat.numel() > 1:
        flat[-1] = 2 % num  # looked up by every rank: frequencies and renorms cross ranks
    if opt.padding_idx is not None and flat.numel() > 0:
        flat[0] = opt.padding_idx % num
    return ids


def _kwargs(opt: Opt, dense: torch.Tensor) -> dict[str, Any]:
    kw: dict[str, Any] = {"padding_idx": opt.padding_idx, "scale_grad_by_freq": opt.scale_grad}
    if opt.norm_type is not None:
        kw.update(max_norm=max_norm_for(dense, opt.norm_type), norm_type=opt.norm_type)
    return kw


def _call(ids: torch.Tensor, weight: Any, opt: Opt, kw: dict[str, Any]) -> Any:
    if opt.positional:
        norm_type = kw.get("norm_type", 2.0)
        return F.embedding(ids, weight, kw["padding_idx"], kw.get("max_norm"), norm_type, kw["scale_grad_by_freq"], False)
    return F.embedding(ids, weight, **kw)


def dense_reference(
    dense: torch.Tensor, batches: list[list[torch.Tensor]], grads: list[list[torch.Tensor]], opt: Opt, kw: dict[str, Any]
) -> tuple[list[list[torch.Tensor]], torch.Tensor, Optional[torch.Tensor]]:
    """The dense op over every rank's lookups: (outputs per lookup per rank, weight after, weight grad).

    ``batches[k][r]`` are rank r's ids of lookup k. Lookups run in rank order on
    one weight (``max_norm`` renorms it as it goes); with ``scale_grad_by_freq``
    each lookup is one call on all ranks' ids, so frequencies are global.
    """
    ref = dense.clone().requires_grad_(opt.grad == "backward")
    outs: list[list[torch.Tensor]] = []
    with torch.set_grad_enabled(opt.grad == "backward"):
        for ids_per_rank in batches:
            if opt.scale_grad:
                flat = torch.cat([ids.reshape(-1) for ids in ids_per_rank])
                pieces = F.embedding(flat, ref, **kw).split([ids.numel() for ids in ids_per_rank])
                outs.append([p.reshape(*ids.shape, dense.shape[1]) for p, ids in zip(pieces, ids_per_rank, strict=True)])
            else:
                outs.append([F.embedding(ids, ref, **kw) for ids in ids_per_rank])
        if opt.grad == "backward":
            loss = sum(
                (o * g).sum() for per_rank, g_rank in zip(outs, grads, strict=True) for o, g in zip(per_rank, g_rank, strict=True)
            )
            assert isinstance(loss, torch.Tensor)
            loss.backward()
    return outs, ref.detach(), ref.grad


def functional_case(w: int, rank: int, layout: str, name: str) -> None:
    """F.embedding on this layout with option ``name``: outputs, weight after, local gradients."""
    num, dim, spec = layouts(w)[layout]
    opt = OPTIONS[name]
    key = (layout, name)
    dense = dense_weight(num, dim, *key, dtype=opt.dtype)
    kw = _kwargs(opt, dense)
    batches = [[make_ids(num, opt, r, *key, k) for r in range(w)] for k in range(opt.lookups)]
    grads = [[loss_weights((*ids.shape, dim), *key, k, r, dtype=opt.dtype) for r, ids in enumerate(b)] for k, b in enumerate(batches)]

    # Collective part: shard, look up, backward.
    ck = Checks(f"{layout}/{name}")
    weight = shard_dense(dense, spec, requires_grad=opt.grad != "frozen")
    with torch.set_grad_enabled(opt.grad != "no_grad"):
        outs = [_call(b[rank], weight, opt, kw) for b in batches]
    if opt.grad == "backward":
        loss = sum(weighted_loss(ck, out, g[rank]) for out, g in zip(outs, grads, strict=True))
        assert isinstance(loss, torch.Tensor)
        loss.backward()

    # Local checks.
    ref_outs, ref_weight, ref_grad = dense_reference(dense, batches, grads, opt, kw)
    for k, out in enumerate(outs):
        ck.output(out, ref_outs[k][rank], f"lookup {k} output")
        ck.true(getattr(out, "requires_grad", None) == (opt.grad == "backward"), f"lookup {k}: requires_grad is wrong")
    ck.shards(weight, ref_weight, "weight after the call")
    if opt.grad == "backward":
        ck.grads(weight, ref_grad)
    ck.done()


def module_case(w: int, rank: int, layout: str, name: str) -> None:
    """nn.Embedding with a sharded weight, trained for a few SGD steps, against a dense twin."""
    num, dim, spec = layouts(w)[layout]
    opt = MODULES[name]
    key = (layout, name)
    dense = dense_weight(num, dim, *key)
    kw = _kwargs(opt, dense)
    ck = Checks(f"{layout}/{name}")
    emb, ref, weight = sharded_twins(nn.Embedding, num, dim, kw, dense, spec, ck)
    # Ranks that hold no shard have nothing to step.
    optim = ShardedOptimizer({"weight": weight}, torch.optim.SGD, lr=LR) if weight.local_shards() else None
    ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
    batch_opt = replace(opt, padding_idx=emb.padding_idx)
    for step in range(SGD_STEPS):
        ids = [make_ids(num, batch_opt, r, *key, step) for r in range(w)]
        grads = [loss_weights((*i.shape, dim), *key, step, r) for r, i in enumerate(ids)]
        out = emb(ids[rank])
        weighted_loss(ck, out, grads[rank]).backward()
        if optim is not None:
            optim.step()
            optim.zero_grad()
        # The dense twin: every rank's batch, in rank order (or in one call for global frequencies).
        if opt.scale_grad:
            flat = ref(torch.cat([i.reshape(-1) for i in ids])).split([i.numel() for i in ids])
            ref_outs = [p.reshape(*i.shape, dim) for p, i in zip(flat, ids, strict=True)]
        else:
            ref_outs = [ref(i) for i in ids]
        step_dense_twin(ck, step, rank, out, weight, ref_outs, grads, ref.weight, ref_optim)
    ck.done()


def embedding_battery(results_dir: str = "", only: tuple[str, ...] = ()) -> dict[str, str]:
    """Every case of :func:`case_names` on this rank: case -> "ok" or the failure."""
    group = shardwise.get_default_group()
    w, rank = group.size, group.rank
    cases = battery_of(list(layouts(w)), lambda layout: names_for(w, layout), OPTIONS, functional_case,
                       module_case, w, rank)
    assert list(cases) == case_names(w)
    return battery(cases, results_dir, only)


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "case"),
    [(w, case) for w in WORLD_SIZES for case in case_names(w)],
    ids=[f"w{w}-{case}" for w in WORLD_SIZES for case in case_names(w)],
)
def test_embedding_matches_dense(world_size: int, case: str) -> None:
    assert_case(battery_results(embedding_battery, world_size, case_names(world_size)), case)


def test_layouts_cover_uneven_empty_and_permuted_shards() -> None:
    """The layouts really are what the cases claim (checked on the specs, no ranks)."""
    from shardwise.sharded_tensor import TensorProperties

    def sizes(w: int, name: str) -> list[tuple[int, list[int]]]:
        num, dim, spec = layouts(w)[name]
        md = spec.build_metadata(torch.Size([num, dim]), TensorProperties(dtype=DT))
        return [(m.placement.rank(), m.shard_sizes) for m in md.shards_metadata]

    assert [s for _, s in sizes(4, "row")] == [[2, 5], [2, 5], [2, 5], [1, 5]]
    assert [r for r, _ in sizes(2, "row_perm")] == [1, 0]
    assert [r for r, _ in sizes(4, "col_perm")] == [1, 2, 3, 0]
    assert [r for r, _ in sizes(3, "row_few")] == [1, 0]
    assert [s for _, s in sizes(4, "row_empty")][-1][0] == 0
    assert [s for _, s in sizes(2, "col_empty")] == [[5, 1], [5, 0]]
