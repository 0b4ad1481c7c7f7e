"""``F.embedding_bag`` and ``nn.EmbeddingBag`` on chunk-sharded weights, against the dense op, on real ranks.

As in test_embedding.py: each rank passes its own bags (1-D ids with offsets,
``include_last_offset`` both ways, or 2-D ids; empty bags; its own number of
bags), every rank checks its output, the weight after the call and its local
shards' gradients against the dense op run over every rank's bags. One launch
per world size runs every case; a hypothesis test draws random bags on 2 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
    gen,
    loss_weights,
    max_norm_for,
    run,
    shard_dense,
    sharded_twins,
    step_dense_twin,
    weighted_loss,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_embedding import layouts
from torch import nn

import shardwise
from shardwise.errors import CollectiveMismatchError

WORLD_SIZES = [1, 2, 3, 4]


@dataclass(frozen=True)
class BagOpt:
    """One way of calling F.embedding_bag.

    Attributes:
        mode: ``"sum"``, ``"mean"`` or ``"max"``.
        form: ``"offsets"`` (1-D ids and offsets), ``"last"`` (the same with
            ``include_last_offset=True``) or ``"2d"`` (2-D ids, no offsets).
        psw: per_sample_weights: ``"none"``, ``"all"`` (every rank), ``"rank0"``
            (rank 0 only) or ``"grad"`` (every rank, requiring grad: their
            gradients are checked too).
        padding_idx: Passed as is; the row is put into every rank's ids.
        norm_type: When set, ``max_norm`` (about the median row norm) with this norm type.
        scale_grad: ``scale_grad_by_freq=True`` (frequencies over every rank's bags).
        id_dtype: dtype of the ids.
        offset_dtype: dtype of the offsets (default: the ids' dtype).
        dtype: dtype of the weight.
        empty_rank: rank 0 has no ids at all (two empty bags).
        grad: ``"backward"`` or ``"no_grad"``.
        positional: Pass every option positionally, as nn.EmbeddingBag does.
    """

    mode: str = "mean"
    form: str = "offsets"
    psw: str = "none"
    padding_idx: Optional[int] = None
    norm_type: Optional[float] = None
    scale_grad: bool = False
    id_dtype: torch.dtype = torch.int64
    offset_dtype: Optional[torch.dtype] = None
    dtype: torch.dtype = DT
    empty_rank: bool = False
    grad: str = "backward"
    positional: bool = False


OPTIONS: dict[str, BagOpt] = {
    "sum": BagOpt(mode="sum"),
    "mean": BagOpt(mode="mean"),
    "max": BagOpt(mode="max"),
    "sum_last": BagOpt(mode="sum", form="last"),
    "mean_last": BagOpt(form="last"),
    "max_last": BagOpt(mode="max", form="last"),
    "sum_2d": BagOpt(mode="sum", form="2d"),
    "mean_2d": BagOpt(form="2d"),
    "max_2d": BagOpt(mode="max", form="2d"),
    "psw": BagOpt(mode="sum", psw="all"),
    "psw_last": BagOpt(mode="sum", psw="all", form="last"),
    "psw_2d": BagOpt(mode="sum", psw="all", form="2d"),
    "psw_rank0_only": BagOpt(mode="sum", psw="rank0"),
    "psw_grad": BagOpt(mode="sum", psw="grad"),
    "padding_sum": BagOpt(mode="sum", padding_idx=1),
    "padding_mean_neg": BagOpt(padding_idx=-1),
    "padding_max": BagOpt(mode="max", padding_idx=0),
    "padding_mean_2d": BagOpt(form="2d", padding_idx=2),
    "padding_psw_last": BagOpt(mode="sum", psw="all", padding_idx=1, form="last"),
    "max_norm_2_mean": BagOpt(norm_type=2.0),
    "max_norm_1_sum": BagOpt(mode="sum", norm_type=1.0),
    "max_norm_inf_max": BagOpt(mode="max", norm_type=math.inf),
    "max_norm_padding_2d": BagOpt(form="2d", norm_type=2.0, padding_idx=1),
    "scale_grad_sum": BagOpt(mode="sum", scale_grad=True),
    "scale_grad_mean_last": BagOpt(form="last", scale_grad=True),
    "scale_grad_2d": BagOpt(mode="sum", form="2d", scale_grad=True),
    "scale_grad_psw_padding": BagOpt(mode="sum", psw="all", scale_grad=True, padding_idx=1),
    "int32": BagOpt(id_dtype=torch.int32),
    "ids32_offsets64": BagOpt(mode="sum", id_dtype=torch.int32, offset_dtype=torch.int64),
    "ids64_offsets32": BagOpt(mode="max", offset_dtype=torch.int32, form="last"),
    "int32_2d": BagOpt(form="2d", id_dtype=torch.int32),
    "float32": BagOpt(mode="sum", dtype=torch.float32),
    "empty_rank": BagOpt(empty_rank=True),
    "empty_rank_max_last": BagOpt(mode="max", empty_rank=True, form="last"),
    "no_grad": BagOpt(grad="no_grad"),
    "positional": BagOpt(mode="sum", psw="all", padding_idx=1, norm_type=2.0, form="last", positional=True),
}

#: nn.EmbeddingBag cases (options as a :class:`BagOpt`), trained with SGD for a few steps.
MODULES: dict[str, BagOpt] = {
    "module_sum_psw": BagOpt(mode="sum", psw="all"),
    "module_mean_padding_max_norm_last": BagOpt(padding_idx=1, norm_type=2.0, form="last"),
    "module_max_2d": BagOpt(mode="max", form="2d"),
    "module_mean_scale_grad": BagOpt(scale_grad=True),
}

SGD_STEPS = 3
LR = 0.5


#: On 3 and 4 ranks only "row" and "col" get every case; the other layouts these (launch time is
#: dominated by the cases' collectives, and 2 ranks already run everything on every layout).
CORE = [
    "sum", "mean_last", "max_2d", "psw", "psw_grad", "padding_mean_neg", "padding_max", "max_norm_1_sum",
    "max_norm_inf_max", "scale_grad_mean_last", "ids32_offsets64", "empty_rank_max_last",
    "module_sum_psw", "module_mean_padding_max_norm_last", "module_max_2d",
]


def names_for(w: int, layout: str) -> list[str]:
    """The option and module names run on ``layout`` with ``w`` ranks."""
    every = [*OPTIONS, *MODULES]
    return every if w <= 2 or layout in ("row", "col") else [name for name in every if name in CORE]


def case_names(w: int) -> list[str]:
    """Every case the battery runs on ``w`` ranks: ``layout/name``."""
    return [f"{layout}/{name}" for layout in layouts(w) for name in names_for(w, layout)]


# -- inside the ranks -------------------------------------------------------------------------------


@dataclass
class Bags:
    """One rank's input to F.embedding_bag.

    Attributes:
        ids: 1-D or 2-D ids.
        offsets: The offsets passed (None for 2-D ids).
        psw: per_sample_weights passed, or None.
        starts: Start of each bag in the flattened ids (for the global reference).
    """

    ids: torch.Tensor
    offsets: Optional[torch.Tensor]
    psw: Optional[torch.Tensor]
    starts: torch.Tensor

    @property
    def num_bags(self) -> int:
        """How many bags (rows of the output)."""
        return int(self.starts.numel())


def make_bags(num: int, opt: BagOpt, rank: int, *key: Any, sizes: Optional[list[int]] = None) -> Bags:
    """Rank ``rank``'s bags for case ``key``: 2 to 4 bags, some of them empty, padding rows among the ids."""
    g = gen("bags", *key, rank)
    if opt.form == "2d":
        rows, cols = 2 + rank % 2, 2 + rank % 2
        ids = torch.randint(0, num, (rows, cols), generator=g)
        starts = torch.arange(0, rows * cols, cols)
    else:
        if sizes is None:
            n_bags = 2 + rank % 3
            sizes = torch.randint(0, 4, (n_bags,), generator=g).tolist()
            sizes[1] = 0  # an empty bag in the middle
            if rank % 2:
                sizes[-1] = 0  # and an empty last bag
            if sum(sizes) == 0:
                sizes[0] = 2
            if opt.empty_rank and rank == 0:
                sizes = [0] * n_bags
        total = sum(sizes)
        ids = torch.randint(0, num, (total,), generator=g)
        starts = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
    flat = ids.view(-1)
    if flat.numel() > 1:
        flat[-1] = 2 % num  # a row every rank looks up
    if opt.padding_idx is not None:
        flat[::3] = opt.padding_idx % num
    offsets: Optional[torch.Tensor] = None
    if opt.form != "2d":
        offsets = starts.clone()
        if opt.form == "last":
            offsets = torch.cat([offsets, torch.tensor([flat.numel()])])
        offsets = offsets.to(opt.offset_dtype or opt.id_dtype)
    psw: Optional[torch.Tensor] = None
    if opt.psw in ("all", "grad") or (opt.psw == "rank0" and rank == 0):
        psw = (torch.rand(ids.shape, generator=g, dtype=torch.float64) + 0.5).to(opt.dtype)
    return Bags(ids.to(opt.id_dtype), offsets, psw, starts)


def _kwargs(opt: BagOpt, dense: torch.Tensor) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "mode": opt.mode,
        "padding_idx": opt.padding_idx,
        "scale_grad_by_freq": opt.scale_grad,
        "include_last_offset": opt.form == "last",
    }
    if opt.norm_type is not None:
        kw.update(max_norm=max_norm_for(dense, opt.norm_type), norm_type=opt.norm_type)
    return kw


def _call(bags: Bags, weight: Any, opt: BagOpt, kw: dict[str, Any], psw: Optional[torch.Tensor]) -> Any:
    if opt.positional:
        return F.embedding_bag(
            bags.ids, weight, bags.offsets, kw.get("max_norm"), kw.get("norm_type", 2), kw["scale_grad_by_freq"],
            kw["mode"], False, psw, kw["include_last_offset"], kw["padding_idx"],
        )  # fmt: skip
    return F.embedding_bag(bags.ids, weight, bags.offsets, per_sample_weights=psw, **kw)


def bags_with_global_frequencies(
    all_bags: list[Bags], weight: torch.Tensor, psws: list[Optional[torch.Tensor]], kw: dict[str, Any]
) -> list[torch.Tensor]:
    """Every rank's bags (sum or mean) with ``scale_grad_by_freq`` over all of them, built on F.embedding.

    torch 2.13's CPU ``embedding_bag`` backward divides by the wrong count when
    indices occur with different frequencies (with torch 2.13.0+cpu, ids
    ``[1, 1, 3]`` give row 3 the gradient 0.5, not 1), so the reference looks
    the ids up with ``F.embedding(..., scale_grad_by_freq=True)``, whose
    scaling is right, and sums (or averages) the rows into bags itself,
    leaving out ``padding_idx`` entries as embedding_bag does.
    """
    assert kw["mode"] in ("sum", "mean")
    flat = torch.cat([b.ids.reshape(-1) for b in all_bags])
    padding_idx = kw.get("padding_idx")
    max_norm, norm_type = kw.get("max_norm"), kw.get("norm_type", 2.0)
    rows = F.embedding(flat, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq=True)
    bag_of, first = [], 0
    for b in all_bags:
        positions = torch.arange(b.ids.numel())
        bag_of.append(torch.bucketize(positions, b.starts, right=True) - 1 + first)
        first += b.num_bags
    index = torch.cat(bag_of)
    keep = torch.ones(flat.numel(), dtype=weight.dtype)
    if padding_idx is not None:
        keep = (flat.long() != padding_idx % weight.shape[0]).to(weight.dtype)
    scale = keep if psws[0] is None else keep * torch.cat([p.reshape(-1) for p in psws if p is not None])
    out = torch.zeros(first, weight.shape[1], dtype=weight.dtype).index_add(0, index, rows * scale.unsqueeze(1))
    if kw["mode"] == "mean":
        count = torch.zeros(first, dtype=weight.dtype).index_add(0, index, keep)
        out = out / count.clamp(min=1).unsqueeze(1)
    # The forward agrees with embedding_bag's (only its backward is wrong).
    offsets = torch.cat([b.starts + s for b, s in zip(all_bags, torch.tensor([0] + [b.ids.numel() for b in all_bags]).cumsum(0), strict=False)])
    psw = None if psws[0] is None else torch.cat([p.detach().reshape(-1) for p in psws if p is not None])
    dense_op = F.embedding_bag(flat, weight.detach(), offsets, mode=kw["mode"], per_sample_weights=psw, padding_idx=padding_idx)
    torch.testing.assert_close(out.detach(), dense_op)
    return list(out.split([b.num_bags for b in all_bags]))


def dense_reference(
    dense: torch.Tensor,
    all_bags: list[Bags],
    grads: list[torch.Tensor],
    opt: BagOpt,
    kw: dict[str, Any],
) -> tuple[list[torch.Tensor], torch.Tensor, Optional[torch.Tensor], list[Optional[torch.Tensor]]]:
    """The dense op over every rank's bags: (outputs, weight after, weight grad, per_sample_weights grads).

    Ranks' calls run in rank order on one weight (``max_norm`` renorms it as it
    goes); with ``scale_grad_by_freq`` all bags go into one call (flattened, with
    shifted offsets), so frequencies are global.
    """
    backward = opt.grad == "backward"
    ref = dense.clone().requires_grad_(backward)
    psws = [None if b.psw is None else b.psw.clone().requires_grad_(opt.psw == "grad") for b in all_bags]
    with torch.set_grad_enabled(backward):
        if opt.scale_grad:
            outs = bags_with_global_frequencies(all_bags, ref, psws, kw)
        else:
            outs = [
                F.embedding_bag(b.ids, ref, b.offsets, per_sample_weights=p, **kw)
                for b, p in zip(all_bags, psws, strict=True)
            ]
        if backward:
            loss = sum((o * g).sum() for o, g in zip(outs, grads, strict=True))
            assert isinstance(loss, torch.Tensor)
            loss.backward()
    return outs, ref.detach(), ref.grad, [None if p is None else p.grad for p in psws]


def check_bag_call(
    ck: Checks,
    dense: torch.Tensor,
    spec: Any,
    all_bags: list[Bags],
    opt: BagOpt,
    rank: int,
    key: tuple[Any, ...],
) -> None:
    """Shard ``dense``, call F.embedding_bag with this rank's bags, backward; compare with the dense op."""
    dim = dense.shape[1]
    kw = _kwargs(opt, dense)
    grads = [loss_weights((b.num_bags, dim), *key, r, dtype=opt.dtype) for r, b in enumerate(all_bags)]
    mine = all_bags[rank]
    psw = None if mine.psw is None else mine.psw.clone().requires_grad_(opt.psw == "grad")

    weight = shard_dense(dense, spec)
    with torch.set_grad_enabled(opt.grad == "backward"):
        out = _call(mine, weight, opt, kw, psw)
    if opt.grad == "backward":
        weighted_loss(ck, out, grads[rank]).backward()

    ref_outs, ref_weight, ref_grad, ref_psw_grads = dense_reference(dense, all_bags, grads, opt, kw)
    ck.output(out, ref_outs[rank])
    ck.true(getattr(out, "requires_grad", None) == (opt.grad == "backward"), "output requires_grad is wrong")
    ck.shards(weight, ref_weight, "weight after the call")
    if opt.grad == "backward":
        ck.grads(weight, ref_grad)
    if opt.psw == "grad":
        expected = ref_psw_grads[rank]
        assert psw is not None and expected is not None
        ck.close(psw.grad, expected, "per_sample_weights grad")


def functional_case(w: int, rank: int, layout: str, name: str) -> None:
    """F.embedding_bag on this layout with option ``name``."""
    num, dim, spec = layouts(w)[layout]
    opt = OPTIONS[name]
    key = (layout, name)
    dense = dense_weight(num, dim, *key, dtype=opt.dtype)
    all_bags = [make_bags(num, opt, r, *key) for r in range(w)]
    ck = Checks(f"{layout}/{name}")
    if opt.psw != "rank0":
        check_bag_call(ck, dense, spec, all_bags, opt, rank, key)
        ck.done()
        return
    # per_sample_weights on some ranks only: the brief leaves open whether that is
    # each rank's own input (then the result is the dense one) or an option the
    # ranks must agree on (then CollectiveMismatchError) -- but every rank must
    # see the same outcome.
    mismatch = False
    try:
        check_bag_call(ck, dense, spec, all_bags, opt, rank, key)
    except CollectiveMismatchError:
        mismatch = True
    seen = shardwise.get_default_group().exchange(mismatch)
    ck.true(seen == [mismatch] * w, f"CollectiveMismatchError on some ranks only: {seen}")
    ck.done()


def module_case(w: int, rank: int, layout: str, name: str) -> None:
    """nn.EmbeddingBag with a sharded weight, trained for a few SGD steps, against a dense twin."""
    num, dim, spec = layouts(w)[layout]
    opt = MODULES[name]
    key = (layout, name)
    dense = dense_weight(num, dim, *key)
    kw = _kwargs(opt, dense)
    ck = Checks(f"{layout}/{name}")
    emb, ref, weight = sharded_twins(nn.EmbeddingBag, num, dim, kw, dense, spec, ck)
    local = [s.tensor for s in weight.local_shards()]
    optim = torch.optim.SGD(local, lr=LR) if local else None
    ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(SGD_STEPS):
        all_bags = [make_bags(num, opt, r, *key, step) for r in range(w)]
        grads = [loss_weights((b.num_bags, dim), *key, step, r) for r, b in enumerate(all_bags)]
        mine = all_bags[rank]
        out = emb(mine.ids, mine.offsets, mine.psw)
        weighted_loss(ck, out, grads[rank]).backward()
        if optim is not None:
            optim.step()
            optim.zero_grad()
        if opt.scale_grad:
            ref_kw = {"mode": ref.mode, "padding_idx": ref.padding_idx, "max_norm": ref.max_norm, "norm_type": ref.norm_type}
            ref_outs = bags_with_global_frequencies(all_bags, ref.weight, [b.psw for b in all_bags], ref_kw)
        else:
            ref_outs = [ref(b.ids, b.offsets, b.psw) for b in all_bags]
        step_dense_twin(ck, step, rank, out, weight, ref_outs, grads, ref.weight, ref_optim)
    ck.done()


def bag_battery(results_dir: str = "", only: tuple[str, ...] = ()) -> dict[str, str]:
    """Every case of :func:`case_names` on this rank: case -> "ok" or the failure."""
    group = shardwise.get_default_group()
    w, rank = group.size, group.rank
    cases = battery_of(list(layouts(w)), lambda layout: names_for(w, layout), OPTIONS, functional_case,
                       module_case, w, rank)
    assert list(cases) == case_names(w)
    return battery(cases, results_dir, only)


def random_case(seed: int) -> dict[str, str]:
    """Bags and ids drawn from ``seed`` (the same draw on every rank) on a random layout of 2 ranks."""
    g = torch.Generator().manual_seed(seed)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (), generator=g))

    group = shardwise.get_default_group()
    w, rank = group.size, group.rank
    num, dim = 1 + pick(12), 1 + pick(6)
    shard_dim = pick(2)
    placements = [r for r in torch.randperm(w, generator=g).tolist()][: 1 + pick(w)]
    spec = chunk_spec(shard_dim, placements)
    mode = ["sum", "mean", "max"][pick(3)]
    opt = BagOpt(
        mode=mode,
        form=["offsets", "last", "2d"][pick(3)],
        psw="all" if mode == "sum" and pick(2) else "none",
        padding_idx=pick(2 * num) - num if pick(3) == 0 else None,
        norm_type=[1.0, 2.0, math.inf][pick(3)] if pick(3) == 0 else None,
        scale_grad=mode != "max" and pick(3) == 0,
        id_dtype=[torch.int64, torch.int32][pick(2)],
        offset_dtype=[torch.int64, torch.int32][pick(2)],
    )
    sizes = [[pick(6) for _ in range(1 + pick(4))] for _ in range(w)]
    key = ("random", seed)
    dense = dense_weight(num, dim, *key)
    bags = [make_bags(num, opt, r, *key, sizes=sizes[r]) for r in range(w)]

    def bag_case() -> None:
        ck = Checks(f"seed {seed}: {num}x{dim} dim {shard_dim} on {placements}, {opt}, sizes {sizes}")
        check_bag_call(ck, dense, spec, bags, opt, rank, key)
        ck.done()

    return battery({"bags": bag_case})


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "case"),
    [(w, case) for w in WORLD_SIZES for case in case_names(w)],
    ids=[f"w{w}-{case}" for w in WORLD_SIZES for case in case_names(w)],
)
def test_embedding_bag_matches_dense(world_size: int, case: str) -> None:
    assert_case(battery_results(bag_battery, world_size, case_names(world_size)), case)


@settings(
    max_examples=4,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: every example is a launch
    suppress_health_check=list(HealthCheck),
    database=None,
)
@given(seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_random_bags_match_dense(seed: int) -> None:
    assert_case(run(random_case, 2, seed), "bags")


def test_bag_generator_makes_what_the_cases_claim() -> None:
    """Empty bags, padding rows and the offsets' forms (checked locally, no ranks)."""
    opt = BagOpt(form="last", padding_idx=-1, id_dtype=torch.int32, offset_dtype=torch.int64)
    bags = make_bags(5, opt, 1, "probe")
    assert bags.offsets is not None and bags.offsets.dtype == torch.int64 and bags.ids.dtype == torch.int32
    assert int(bags.offsets[-1]) == bags.ids.numel() and bags.num_bags == bags.offsets.numel() - 1
    assert (bags.offsets[1:] == bags.offsets[:-1]).any()  # an empty bag
    assert (bags.ids == 4).any()
    two_d = make_bags(5, BagOpt(form="2d", psw="all"), 2, "probe")
    assert two_d.offsets is None and two_d.psw is not None and two_d.psw.shape == two_d.ids.shape
