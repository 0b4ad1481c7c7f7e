"""The row-sparse optimizers against torch's dense optimizers, on real ranks, and through a resharded checkpoint.

Single process: each optimizer equals its dense counterpart (torch's Adagrad
and SparseAdam, or a reference written here for SGD and row-wise Adagrad) over
random tables, touched ids with duplicates and several steps, with sparse and
dense gradients; a step on a 10^6-row table touching 10^3 rows allocates
nothing table-sized and leaves untouched rows and their state as they were.

Ranks (one launch per world size, every case its own pytest test): row-wise
Adagrad on tables cut into column blocks equals the dense row-wise reference
(peers keep bit-identical accumulators, also when they touch different rows
or one has no gradient), and state saved under one plan loads under another.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from emb_helpers import Checks, assert_case, battery, battery_results, gen
from hypothesis import given, settings
from hypothesis import strategies as st
from shardwise_embedding._blocks import LocalBlock, block_of, register_block
from shardwise_embedding._plan_data import TablePlan, make_blocks
from shardwise_embedding._sparse_optim import (
    RowSparseAdagrad,
    RowSparseAdam,
    RowSparseSGD,
    RowWiseAdagrad,
    touched_rows,
)
from torch import nn
from torch.profiler import ProfilerActivity, profile

import shardwise
import shardwise.checkpoint

DT = torch.float64
LR, EPS, INIT, LR_DECAY, WD = 0.1, 1e-10, 0.1, 0.05, 0.01


def sparse_grad(ids: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """An uncoalesced COO gradient: every entry split in two halves (duplicates that sum exactly)."""
    ids2 = torch.cat([ids, ids])
    return torch.sparse_coo_tensor(ids2[None], torch.cat([values / 2, values / 2]), shape, check_invariants=True)


def rowwise_reference(w: torch.Tensor, acc: torch.Tensor, g: torch.Tensor, lr: float = LR, eps: float = EPS) -> None:
    """Dense row-wise Adagrad (FBGEMM's), in place: the mean of g^2 over the whole row."""
    acc += (g * g).mean(dim=1)
    w -= lr * g / (acc.sqrt() + eps)[:, None]


# -- one process ------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 10),
    cols=st.integers(1, 4),
    batches=st.lists(st.lists(st.integers(0, 9), max_size=8), min_size=1, max_size=4),
    dense_grads=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_optimizers_equal_dense_references(
    rows: int, cols: int, batches: list[list[int]], dense_grads: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(rows, cols, generator=g, dtype=DT)
    grads = []
    for batch in batches:
        ids = torch.tensor([i % rows for i in batch], dtype=torch.long)
        grads.append(sparse_grad(ids, torch.randn(len(batch), cols, generator=g, dtype=DT), (rows, cols)))
    ours = {name: nn.Parameter(start.clone()) for name in ("sgd", "adagrad", "adam", "rowwise")}
    opts = {
        "sgd": RowSparseSGD([ours["sgd"]], lr=LR, weight_decay=WD),
        "adagrad": RowSparseAdagrad([ours["adagrad"]], LR, LR_DECAY, EPS, INIT),
        "adam": RowSparseAdam([ours["adam"]], lr=LR, betas=(0.8, 0.9), eps=1e-8),
        "rowwise": RowWiseAdagrad([ours["rowwise"]], lr=LR, eps=EPS, initial_accumulator_value=INIT),
    }
    ref_adagrad, ref_adam = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    torch_adagrad = torch.optim.Adagrad([ref_adagrad], LR, LR_DECAY, 0, INIT, EPS, foreach=False)
    torch_adam = torch.optim.SparseAdam([ref_adam], lr=LR, betas=(0.8, 0.9), eps=1e-8)
    ref_sgd, ref_rw, ref_acc = start.clone(), start.clone(), torch.full((rows,), INIT, dtype=DT)
    for grad in grads:
        dense = grad.to_dense()
        for name, p in ours.items():
            p.grad = dense.clone() if dense_grads else grad.clone()
            opts[name].step()
        ref_adagrad.grad, ref_adam.grad = dense, grad
        torch_adagrad.step()
        torch_adam.step()
        touched = grad.coalesce().indices()[0]
        ref_sgd[touched] -= LR * (dense[touched] + WD * ref_sgd[touched])
        rowwise_reference(ref_rw, ref_acc, dense)
    torch.testing.assert_close(ours["sgd"].detach(), ref_sgd)
    torch.testing.assert_close(ours["adagrad"].detach(), ref_adagrad.detach())
    torch.testing.assert_close(opts["adagrad"].state[ours["adagrad"]]["sum"], torch_adagrad.state[ref_adagrad]["sum"])
    torch.testing.assert_close(ours["adam"].detach(), ref_adam.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opts["adam"].state[ours["adam"]][key], torch_adam.state[ref_adam][key])
    assert float(opts["adam"].state[ours["adam"]]["step"]) == torch_adam.state[ref_adam]["step"] == len(grads)
    torch.testing.assert_close(ours["rowwise"].detach(), ref_rw)
    torch.testing.assert_close(opts["rowwise"].state[ours["rowwise"]]["sum"], ref_acc)


def test_param_groups_and_torch_state_dict_round_trip() -> None:
    a, b = nn.Parameter(torch.ones(4, 2, dtype=DT)), nn.Parameter(torch.ones(3, 2, dtype=DT))
    opt = RowSparseAdagrad([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.5)
    for p in (a, b):
        p.grad = sparse_grad(torch.tensor([1]), torch.ones(1, 2, dtype=DT), tuple(p.shape))  # type: ignore[arg-type]
    opt.step()
    assert a[1, 0].item() == pytest.approx(0.5) and b[1, 0].item() == pytest.approx(0.0, abs=1e-8)
    assert torch.equal(a[0], torch.ones(2, dtype=DT))
    twin = RowSparseAdagrad([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.5)
    twin.load_state_dict(opt.state_dict())
    torch.testing.assert_close(twin.state[b]["sum"], opt.state[b]["sum"])


def test_touched_rows_of_every_gradient_layout() -> None:
    dense = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    for grad in (dense, dense.to_sparse(), dense.to_sparse(sparse_dim=1)):
        rows, values = touched_rows(grad)
        assert rows.tolist() == [0, 2]
        torch.testing.assert_close(values, dense[[0, 2]])
    rows, values = touched_rows(sparse_grad(torch.tensor([3, 3, 1]), torch.ones(3, 2), (5, 2)))
    assert rows.tolist() == [1, 3] and values.tolist() == [[1.0, 1.0], [2.0, 2.0]]
    with pytest.raises(ValueError, match="learning rate|lr"):
        RowSparseSGD([nn.Parameter(torch.ones(2, 2))], lr=-1.0)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "rowwise"])
def test_a_step_on_a_huge_table_costs_the_touched_rows(name: str) -> None:
    num, dim, touched = 10**6, 4, 10**3
    p = nn.Parameter(torch.randn(num, dim, generator=gen("huge")))
    opt = {
        "sgd": lambda: RowSparseSGD([p], lr=0.1, weight_decay=0.01),
        "adagrad": lambda: RowSparseAdagrad([p], initial_accumulator_value=0.5),
        "adam": lambda: RowSparseAdam([p]),
        "rowwise": lambda: RowWiseAdagrad([p], initial_accumulator_value=0.5),
    }[name]()
    before = p.detach().clone()
    ids = torch.randint(0, num, (touched,), generator=gen("huge ids"))
    for step in range(2):
        p.grad = sparse_grad(ids, torch.randn(touched, dim, generator=gen("huge grad", step)), (num, dim))
        if step == 0:
            opt.step()  # creates the state: table-sized, once
            continue
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.step()
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < p.numel() * p.element_size() // 100, f"a step allocated {largest} bytes at once"
    untouched = torch.ones(num, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(p.detach()[untouched], before[untouched])
    assert not torch.equal(p.detach()[ids], before[ids])
    initial = {"sum": 0.5, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for key, value in opt.state[p].items():
        if key != "step":
            assert bool((value[untouched] == initial[key]).all()), key
            assert not bool((value[ids] == initial[key]).any()), key


# -- ranks ------------------------------------------------------------------------------------------------------

WORLD_SIZES = [2, 3]
#: (optimizer, layout of the table when saved, when loaded): row-wise blocks, column-wise blocks (row-wise
#: Adagrad's peers swap sums), table-wise on the last rank (the others hold none of it).
CHECKPOINTS = (
    ("adagrad", "row", "col"),
    ("adam", "col", "last"),
    ("adam", "last", "row"),
    ("rowwise", "row", "col"),
    ("rowwise", "col", "last"),
    ("rowwise", "last", "col"),
)


def make_optimizer(kind: str, params: list[nn.Parameter]) -> Any:
    """A fresh optimizer of ``kind`` (the settings every rank and the dense reference use)."""
    if kind == "adagrad":
        return RowSparseAdagrad(params, LR, LR_DECAY, EPS, INIT)
    if kind == "adam":
        return RowSparseAdam(params, lr=LR, betas=(0.8, 0.9))
    return RowWiseAdagrad(params, lr=LR, eps=EPS, initial_accumulator_value=INIT)


def plan_of(name: str, layout: str, num: int, dim: int, w: int) -> TablePlan:
    """Table ``name`` laid out ``layout``: row / col (over every rank), col01 (ranks 0, 1), last (table-wise), dp."""
    sharding, ranks = {
        "row": ("row_wise", list(range(w))),
        "col": ("column_wise", list(range(w))),
        "col01": ("column_wise", [0, 1]),
        "last": ("table_wise", [w - 1]),
        "dp": ("data_parallel", list(range(w))),
    }[layout]
    return TablePlan(name, sharding, tuple(ranks), num, dim, make_blocks(sharding, num, dim, ranks))


def local_param(plan: TablePlan, group: shardwise.Group, dense: torch.Tensor) -> nn.Parameter:
    """This rank's block of ``dense`` as a registered parameter (empty on a rank without a block)."""
    block = LocalBlock(plan, group, plan.block_of(group.rank))
    (r0, r1), (c0, c1) = block.rows, block.cols
    p = nn.Parameter(dense[r0:r1, c0:c1].clone())
    register_block(p, block)
    return p


def block_grad(p: nn.Parameter, full: torch.Tensor, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """``p``'s gradient from the dense gradient ``full`` touching ``ids``: sparse, or dense for a dp table."""
    block = block_of(p)
    assert block is not None
    if block.replicated:
        return full.clone()
    if block.block is None:
        return None
    (r0, r1), (c0, c1) = block.rows, block.cols
    mine = ids[(ids >= r0) & (ids < r1)]
    return sparse_grad(mine - r0, full[mine, c0:c1], (r1 - r0, c1 - c0))


def step_grads(name: str, num: int, dim: int, step: int, cuts: list[tuple[int, int]]) -> tuple[Any, ...]:
    """The dense gradient of ``name`` at ``step`` and the rows each column cut sees (they differ)."""
    full = torch.zeros(num, dim, dtype=DT)
    seen = []
    for c0, c1 in cuts:
        count = int(torch.randint(0, num + 1, (1,), generator=gen("count", name, step, c0)))
        ids = torch.randperm(num, generator=gen("touch", name, step, c0))[:count]
        full[ids, c0:c1] = torch.randn(len(ids), c1 - c0, generator=gen("g", name, step, c0), dtype=DT)
        seen.append(ids)
    return full, seen


def case_rowwise_peers(group: shardwise.Group) -> None:
    """Row-wise Adagrad over column-split, row-wise, table-wise and dp tables, against the dense reference."""
    w, rank = group.size, group.rank
    layouts = {"cw": "col", "rw": "row", "tw": "last", "dp": "dp"} | ({"cw01": "col01"} if w > 2 else {})
    shapes = {"cw": (9, 7), "rw": (8, 3), "tw": (5, 4), "dp": (4, 3), "cw01": (6, 5)}
    plans = {n: plan_of(n, lay, *shapes[n], w) for n, lay in layouts.items()}
    dense = {n: torch.randn(*shapes[n], generator=gen("w", n), dtype=DT) for n in plans}
    params = {n: local_param(plans[n], group, dense[n]) for n in plans}
    opt = RowWiseAdagrad(list(params.values()), lr=LR, eps=EPS, initial_accumulator_value=INIT)
    accs = {n: torch.full((shapes[n][0],), INIT, dtype=DT) for n in plans}
    for step in range(3):
        for n, p in params.items():
            cuts = plans[n].column_cuts or [(0, shapes[n][1])]
            full, seen = step_grads(n, *shapes[n], step, cuts)
            block = block_of(p)
            assert block is not None
            if n == "cw" and step == 1:
                # The last rank has no gradient at this step: its peers' rows still count in its accumulator.
                full[:, cuts[-1][0] : cuts[-1][1]] = 0
            if n == "cw" and step == 1 and rank == w - 1:
                p.grad = None
            elif block.block is not None and len(cuts) > 1:
                p.grad = block_grad(p, full, seen[cuts.index(block.cols)])
            else:
                p.grad = block_grad(p, full, torch.unique(torch.cat(seen)))
            rowwise_reference(dense[n], accs[n], full)
        opt.step()
    gathered = group.all_gather(opt.state[params["cw"]]["sum"].clone())
    ck = Checks(f"rank {rank}")
    ck.true(all(torch.equal(a, gathered[0]) for a in gathered), "column peers' accumulators differ")
    for n, p in params.items():
        block = block_of(p)
        assert block is not None
        (r0, r1), (c0, c1) = block.rows, block.cols
        ck.close(p.detach(), dense[n][r0:r1, c0:c1], f"{n} weight")
        if block.block is not None or block.replicated:  # a rank without a block never needed state
            ck.close(opt.state[p]["sum"], accs[n][r0:r1], f"{n} accumulator")
    ck.done()


def run_steps(kind: str, layout: str, group: shardwise.Group, steps: range, start: dict[str, torch.Tensor]) -> Any:
    """Tables "a" (``layout``) and "b" (dp) from ``start`` on this rank, stepped ``steps``; (opt, params)."""
    w = group.size
    plans = {"a": plan_of("a", layout, 7, 5, w), "b": plan_of("b", "dp", 4, 3, w)}
    params = {n: local_param(plans[n], group, start[n]) for n in plans}
    opt = make_optimizer(kind, list(params.values()))
    for step in steps:
        for n, p in params.items():
            full, (ids,) = step_grads(n, *start[n].shape, step, [(0, start[n].shape[1])])
            p.grad = block_grad(p, full, ids)
        opt.step()
    return opt, params


def case_checkpoint(group: shardwise.Group, results_dir: str, kind: str, saved: str, loaded: str) -> None:
    """State saved with table "a" laid out ``saved`` loads with it laid out ``loaded``, then steps on alike."""
    start = {"a": torch.randn(7, 5, generator=gen("a"), dtype=DT), "b": torch.randn(4, 3, generator=gen("b"), dtype=DT)}
    dense = {n: nn.Parameter(t.clone()) for n, t in start.items()}
    ref = make_optimizer(kind, list(dense.values()))
    for step in range(4):  # the dense reference: unregistered parameters, whole-table gradients
        for n, p in dense.items():
            full, (ids,) = step_grads(n, *start[n].shape, step, [(0, start[n].shape[1])])
            p.grad = sparse_grad(ids, full[ids], tuple(full.shape))  # type: ignore[arg-type]
        ref.step()
        if step == 2:
            after3 = {n: p.detach().clone() for n, p in dense.items()}
            ref_state = {n: {k: v.clone() for k, v in ref.state[p].items()} for n, p in dense.items()}
    path = str(Path(results_dir, f"ckpt-{kind}-{saved}-{loaded}"))
    opt, _ = run_steps(kind, saved, group, range(3), start)
    shardwise.checkpoint.save({"optim": opt.sharded_state_dict()}, path)
    fresh, params = run_steps(kind, loaded, group, range(0), after3)
    target = fresh.sharded_state_dict()
    shardwise.checkpoint.load({"optim": target}, path)
    fresh.load_sharded_state_dict(target)
    ck = Checks(f"{kind} {saved} -> {loaded}")
    for n, p in params.items():
        block = block_of(p)
        assert block is not None
        (r0, r1), (c0, c1) = block.rows, block.cols
        for key, value in fresh.state[p].items():
            if block.block is None and not block.replicated:
                continue  # a rank without a block of the table: its state is empty, its step unused
            want = ref_state[n][key]
            want = want if key == "step" else want[r0:r1, c0:c1] if want.dim() == 2 else want[r0:r1]
            ck.close(value, want.to(value.dtype), f"loaded {n}.{key}")
    for n, p in params.items():  # one more step from the loaded state matches the reference's fourth
        full, (ids,) = step_grads(n, *start[n].shape, 3, [(0, start[n].shape[1])])
        p.grad = block_grad(p, full, ids)
    fresh.step()
    for n, p in params.items():
        block = block_of(p)
        assert block is not None
        (r0, r1), (c0, c1) = block.rows, block.cols
        ck.close(p.detach(), dense[n].detach()[r0:r1, c0:c1], f"{n} weight after a step from the loaded state")
    ck.done()


def case_names(w: int) -> list[str]:
    """Every case the battery runs on ``w`` ranks."""
    return ["rowwise_peers"] + [f"ckpt/{kind}/{a}->{b}" for kind, a, b in CHECKPOINTS]


def optim_battery(results_dir: str, only: tuple[str, ...]) -> dict[str, str]:
    """The rank function: every case, in order."""
    group = shardwise.get_default_group()
    cases: dict[str, Callable[[], None]] = {"rowwise_peers": functools.partial(case_rowwise_peers, group)}
    for kind, a, b in CHECKPOINTS:
        cases[f"ckpt/{kind}/{a}->{b}"] = functools.partial(case_checkpoint, group, results_dir, kind, a, b)
    return battery(cases, results_dir, only)


@pytest.mark.parametrize(
    ("world_size", "case"), [(w, c) for w in WORLD_SIZES for c in case_names(w)], ids=lambda x: str(x)
)
def test_on_ranks(world_size: int, case: str) -> None:
    assert_case(battery_results(optim_battery, world_size, case_names(world_size)), case)
