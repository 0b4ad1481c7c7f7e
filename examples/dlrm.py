"""Train a DLRM-style click model on Criteo-like data, its 26 tables sharded by the planner's plan.

The model (``_dlrm_model.py``): 13 dense features through a bottom MLP; 26
categorical features, each a bag of 1 to 3 ids pooled from its own table (the
Criteo Kaggle dataset's vocabulary sizes, capped at 10^6 rows: 3 to 10^6
rows, 5.6 million in all); the dot product of every pair of the 27 vectors;
a top MLP to one click logit. The data (``_dlrm_data.py``): synthetic clicks
from a hidden logistic model, ids following a power law.

The tables live in one ``EmbeddingBagCollection``. ``EmbeddingShardingPlanner``
decides where each goes for this number of ranks, within a memory budget of
190 MiB per rank (small ones replicated, large ones whole on one rank, one
split by rows where nothing else fits ...), rank 0 prints the plan's
explanation, and ``shard_collection`` cuts the collection accordingly: each
step then moves every rank's ids to the tables' owners in one all-to-all and
the pooled vectors back in one more, whatever the number of tables. The
tables are stepped by a row-sparse optimizer (``RowWiseAdagrad``: an update
costs the rows a batch touched, not the table), the MLPs, replicated on every
rank, by ``torch.optim.Adagrad`` after their gradients are summed over the
ranks.

At the end rank 0 replays the whole training in one process, without
sharding (the dense collection's tables, a plain row-wise Adagrad, the same
batches from the same initial weights), and checks every step's loss and the
final weights against it. ``--checkpoint`` saves the tables, both optimizers'
state and the step; ``--resume`` continues on any number of ranks under a
plan made anew for them, and the replay then covers both runs.

    .venv/bin/mpiexec -n 2 .venv/bin/python examples/dlrm.py --checkpoint build/demo/dlrm-ckpt
    .venv/bin/mpiexec -n 3 .venv/bin/python examples/dlrm.py --resume build/demo/dlrm-ckpt
    .venv/bin/torchrun --standalone --nproc-per-node 3 examples/dlrm.py --backend gloo --resume build/demo/dlrm-ckpt

Exit status: 0 when the sharded run matches the replay, 1 when not, 2 for a
bad command line or checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Iterable, NoReturn, Optional, Sequence, Union

import torch
from _dlrm_data import ClickLog, criteo_tables, feature_names
from _dlrm_model import (
    DLRM,
    ReferenceRowWiseAdagrad,
    UnshardedTables,
    batch_loss,
    build_collection,
    build_model,
    mlp_optimizer_state,
    sum_dense_grads,
)
from _progress import progress
from _recsys_report import curve_summary
from _training import Reference, RunHistory, dense_replay, rank_rows
from shardwise_embedding import (
    EmbeddingBagConfig,
    EmbeddingShardingPlan,
    EmbeddingShardingPlanner,
    KeyedJaggedTensor,
    PlanError,
    RowSparseAdagrad,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseDistPipeline,
    shard_collection,
)

import shardwise
import shardwise.checkpoint

#: Steps in the moving average of the progress bar and the summary.
WINDOW = 20
#: Largest relative difference allowed between a step's sharded and replayed loss. The two add the
#: same float32 numbers in other orders (about 1e-7 apart at first, carried along by training); a
#: real error in the sharded maths moves the loss by far more.
LOSS_TOLERANCE = 1e-4
#: Largest difference allowed between a final sharded and replayed weight.
WEIGHT_TOLERANCE = 1e-3
#: The optimizers the tables may use (``--table-optimizer``), by the planner's name for their state.
TABLE_OPTIMIZERS = ("rowwise_adagrad", "adagrad")


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one variant of the demo.

    Attributes:
        name: ``"full"`` or ``"tiny"``; a checkpoint resumes only into the same.
        max_rows: Tables have Criteo's vocabulary sizes, capped at this.
        dim: Embedding width of every table (and the bottom MLP's output).
        bottom: Hidden widths of the bottom MLP.
        top: Hidden widths of the top MLP.
        steps: Default number of steps per run.
        batch: Default global batch size.
        memory_budget_mib: The planner's limit on what one rank may hold of
            the tables and their optimizer state (None: no limit).
        table_lr: The tables' learning rate.
        mlp_lr: The MLPs' learning rate.
        eps: Both optimizers' epsilon.
    """

    name: str
    max_rows: int
    dim: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]
    steps: int
    batch: int
    memory_budget_mib: Optional[int] = None
    table_lr: float = 0.05
    mlp_lr: float = 0.02
    # Far above torch's 1e-10. Adagrad divides by sqrt(sum of squared gradients) + eps, so with a
    # negligible eps an entry's first update is a whole learning rate whatever the size of its
    # gradient: an entry whose gradient is within rounding of zero would jump one way or the other as
    # rounding decides, and no two summation orders (sharded and replayed) would agree for long.
    eps: float = 1e-5


#: The tables take 340 MiB (361 MiB with RowWiseAdagrad's state). The budget is as if each rank had 190 MiB
#: for them: on 2 ranks whole tables cannot be shared out within it, and the planner splits one 10^6-row
#: table by rows; on 3 ranks every table fits whole somewhere.
FULL = Config(
    name="full",
    max_rows=1_000_000,
    dim=16,
    bottom=(64, 32),
    top=(64, 32),
    steps=100,
    batch=2048,
    memory_budget_mib=190,
)
TINY = Config(name="tiny", max_rows=1_000, dim=8, bottom=(16,), top=(16,), steps=10, batch=64)


@dataclasses.dataclass
class History(RunHistory):
    """A run's :class:`RunHistory` and the tables' optimizer, which a resumed run keeps.

    Attributes:
        table_optimizer: One of :data:`TABLE_OPTIMIZERS`.
    """

    table_optimizer: str


def say(text: str) -> None:
    """Print ``text`` in one write: under a launcher, two ranks' lines would otherwise interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, help=f"steps to train in this run (default {FULL.steps}, tiny {TINY.steps})"
    )
    parser.add_argument(
        "--batch",
        type=int,
        help=f"global batch size, split over the ranks (default {FULL.batch}, "
        f"tiny {TINY.batch}; a resumed run keeps the checkpoint's)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="seed of the initial weights and the data (default 0; a resumed run keeps the checkpoint's)",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="save the model, both optimizers and the step here at the end (a directory every rank can reach)",
    )
    parser.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from this checkpoint, on any number of ranks, under a plan made for them",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "mpi", "nccl"),
        help="collective backend (default: shardwise "
        "picks from the launcher: mpi under mpiexec, nccl with CUDA, else gloo)",
    )
    parser.add_argument(
        "--table-optimizer",
        choices=TABLE_OPTIMIZERS,
        help="the tables' optimizer: RowWiseAdagrad "
        "(one accumulator per row; the default) or RowSparseAdagrad (torch's Adagrad on the "
        "touched rows); a resumed run keeps the checkpoint's",
    )
    parser.add_argument(
        "--memory-budget-mib",
        type=int,
        metavar="MIB",
        help=f"the planner's limit on one rank's tables and optimizer state (default {FULL.memory_budget_mib}, tiny: "
        "none; 0: none)",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="train through SparseDistPipeline: the next batch's ids travel, and its data is made on a thread, "
        "while this batch computes (same losses; faster only where a core would otherwise wait, see "
        "docs/performance.md)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tables of at most 1000 rows, 10 steps of 64 samples: a smoke test of seconds",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "memory_budget_mib"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "memory_budget_mib" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def use_cores_fairly(group: shardwise.Group) -> None:
    """Give each rank its share of this host's cores for torch's intra-op threads.

    Under ``mpiexec`` every rank would otherwise start one thread per core,
    and ranks sharing a host would fight over the cores. A thread count the
    user or ``torchrun`` chose (``OMP_NUM_THREADS``) is kept.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // len(group.local_ranks())))


def refuse(group: shardwise.Group, message: str) -> NoReturn:
    """Exit with status 2 and ``message`` (printed once, by rank 0).

    Call it on every rank, for a reason every rank sees alike: then all of
    them stop here and none is left waiting in a collective for the others.
    """
    if group.rank == 0:
        sys.stderr.write(f"dlrm.py: error: {message}\n")
    shardwise.destroy()
    raise SystemExit(2)


def read_history(path: str, args: argparse.Namespace, config: Config, group: shardwise.Group) -> History:
    """The history saved with the checkpoint at ``path``, checked against the command line (on every rank alike)."""
    saved: dict[str, Any] = {"step": 0, "history": ""}
    shardwise.checkpoint.load(saved, path)
    history = History(**json.loads(saved["history"]))
    if history.config != config.name:
        refuse(group, f"{path} holds the {history.config} model: resume it {'without' if args.tiny else 'with'} --tiny")
    for name in ("seed", "batch", "table_optimizer"):
        given = getattr(args, name)
        if given is not None and given != getattr(history, name):
            refuse(
                group,
                f"{path} was trained with --{name.replace('_', '-')} {getattr(history, name)}, not "
                f"{given}; the resumed run must continue the same training",
            )
    if saved["step"] != len(history.losses):
        refuse(group, f"{path} is inconsistent: step {saved['step']} but {len(history.losses)} losses")
    return history


def make_plan(ebc: Any, group: shardwise.Group, history: History, budget_mib: Optional[int]) -> EmbeddingShardingPlan:
    """The planner's plan for this group: every rank makes the same one from the same arguments.

    The planner is told what it cannot know from the tables: each rank's
    share of the batch, the mean bag size (1 to 3 ids: 2), the optimizer's
    state, how many ranks share a host, and the memory budget (None or 0:
    none).

    Raises:
        PlanError: the tables do not fit the budget (on every rank alike).
    """
    hosts = group.hosts()
    per_host = {len(h.ranks) for h in hosts}
    planner = EmbeddingShardingPlanner(
        group.size,
        ranks_per_host=per_host.pop() if len(hosts) > 1 and len(per_host) == 1 else None,
        memory_budget_bytes=budget_mib << 20 if budget_mib else None,
        batch_size=max(1, history.batch // group.size),
        default_pooling_factor=2.0,
        optimizer_state=history.table_optimizer,
    )
    return planner.plan(ebc)


def table_optimizer(name: str, params: Any, config: Config) -> Union[RowWiseAdagrad, RowSparseAdagrad]:
    """The sharded tables' row-sparse optimizer."""
    if name == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=config.table_lr, eps=config.eps)
    return RowSparseAdagrad(params, lr=config.table_lr, eps=config.eps)


def checkpoint_state(model: DLRM, tables_opt: Any, mlp_opt: torch.optim.Optimizer, history: History) -> dict[str, Any]:
    """Everything a resumed run needs, as ``shardwise.checkpoint.save`` takes it (and ``load`` fills it).

    The tables appear as ShardedTensors of the whole table (plain tensors for
    replicated ones), and so does the row-sparse optimizer's state: a run
    under another plan loads its own blocks of both, whatever the old
    plan's were. The MLPs and their optimizer's state are the same on every
    rank and saved once.
    """
    return {
        "model": model.state_dict(),
        "optim": tables_opt.sharded_state_dict(),
        "mlp_optim": mlp_optimizer_state(mlp_opt, model),
        "step": len(history.losses),
        "history": json.dumps(dataclasses.asdict(history)),
    }


def train(
    model: DLRM,
    optimizers: Sequence[Any],
    data: ClickLog,
    group: shardwise.Group,
    history: History,
    steps: int,
    label: str,
    pipeline: bool = False,
) -> tuple[float, list[float]]:
    """Train ``steps`` steps after those in ``history``, appending their losses.

    With ``pipeline`` the steps run through :class:`SparseDistPipeline`: the
    next batch is made on a background thread and its ids travel to the
    tables' owners while this batch computes; the losses are the same.

    Every rank runs the same collectives in the same order (the
    collection's exchanges and their backward, the row-wise optimizer's, one
    all-reduce of the MLPs' gradients), so no rank waits for another forever.

    Returns:
        The seconds taken, and this rank's mean bytes ``[sent, received]``
        per step in the collection's two exchanges.
    """
    batch, rank, world = history.batch, group.rank, group.size
    rows = rank_rows(batch, rank, world)
    keys = feature_names()
    assert isinstance(model.embeddings, ShardedEmbeddingBagCollection)
    moved = [0.0, 0.0]
    start = len(history.losses)
    bar = progress(
        steps * batch,
        f"steps {start}..{start + steps - 1} on {label}",
        "sample",
        unit_scale=True,
        disable=rank != 0,
        dynamic_ncols=True,
    )
    began = time.perf_counter()
    batches: Iterable[tuple[int, Any, KeyedJaggedTensor]] = (
        (step, local, local.features(keys))
        for step in range(start, start + steps)
        for local in [data.global_batch(step, batch)[rows]]
    )
    if pipeline:
        batches = SparseDistPipeline(model.embeddings, batches, features=lambda b: b[2])
    for step, local, features in batches:
        loss = batch_loss(model(local.dense, features), local.labels, batch)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()  # collective: the pooled vectors' gradients travel back to the tables' owners
        history.losses.append(sum_dense_grads(model, loss, group))
        for opt in optimizers:
            opt.step()
        sent, received = model.embeddings.last_exchange_bytes
        moved[0] += sent / steps
        moved[1] += received / steps
        if step == start and start > 0 and rank == 0:
            before = history.losses[-WINDOW - 1 : -1]
            bar.write(
                f"first resumed step {step}: loss {history.losses[-1]:.4f}; before the checkpoint: step "
                f"{step - 1} {history.losses[-2]:.4f}, mean of the last {len(before)} steps "
                f"{sum(before) / len(before):.4f}"
            )
        recent = history.losses[-WINDOW:]
        bar.set_postfix_str(f"loss={sum(recent) / len(recent):.4f}", refresh=False)
        bar.update(batch)
    bar.close()
    return time.perf_counter() - began, moved


def whole_weights(model: DLRM, group: shardwise.Group) -> tuple[dict[str, torch.Tensor], bool]:
    """The model's weights on rank 0 (tables gathered whole), and whether every rank's MLPs are rank 0's.

    Returns:
        ``(weights, replicas_agree)``: the weights by state-dict name (an
        empty dict on the other ranks), and whether the replicated MLPs are
        bit-for-bit the same on every rank, as summing their gradients
        should keep them.
    """
    weights: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, shardwise.ShardedTensor):
            out = torch.empty(value.size(), dtype=value.dtype) if group.rank == 0 else None
            value.gather(dst=0, out=out)  # collective: every rank sends its blocks
            if out is not None:
                weights[name] = out
        elif group.rank == 0:
            weights[name] = value.detach().clone()
    mlp = torch.cat([p.detach().reshape(-1) for p in model.dense_parameters()])
    # One all-reduce gives the elementwise max and (negated) min over the ranks: equal everywhere iff identical.
    extremes = group.all_reduce(torch.cat([mlp, -mlp]), op="max")
    return weights, torch.equal(extremes[: mlp.numel()], -extremes[mlp.numel() :])


def replay(tables: Sequence[EmbeddingBagConfig], config: Config, history: History) -> Reference:
    """Train the same model on one process, unsharded, for every step so far, from step 0.

    The same initial weights (the same seeded construction), the same global
    batches, the loss as the mean over each global batch, and the same
    maths in the optimizers: row-wise Adagrad written out plainly
    (:class:`ReferenceRowWiseAdagrad`), or ``torch.optim.Adagrad`` itself for
    ``--table-optimizer adagrad``; ``torch.optim.Adagrad`` for the MLPs.
    """
    ebc = build_collection(tables, history.seed)
    model = build_model(UnshardedTables(ebc), tables, config.bottom, config.top, history.seed)
    table_params = list(ebc.parameters())
    tables_opt: Any
    if history.table_optimizer == "rowwise_adagrad":
        tables_opt = ReferenceRowWiseAdagrad(table_params, lr=config.table_lr, eps=config.eps)
    else:
        tables_opt = torch.optim.Adagrad(table_params, lr=config.table_lr, eps=config.eps)
    mlp_opt = torch.optim.Adagrad(model.dense_parameters(), lr=config.mlp_lr, eps=config.eps)
    data = ClickLog(tables, history.seed)
    keys = feature_names()
    return dense_replay(
        model,
        [tables_opt, mlp_opt],
        lambda step: data.global_batch(step, history.batch),
        lambda samples: model(samples.dense, samples.features(keys)),
        steps=len(history.losses),
        batch=history.batch,
        desc="dense replay",
    )


def compare(
    losses: Sequence[float], weights: dict[str, torch.Tensor], reference: Reference, replicas_agree: bool, ranks: int
) -> tuple[bool, str]:
    """Whether the sharded run did the replay's maths: every step's loss and the final weights.

    Returns:
        ``(match, report)``.
    """
    relative = [abs(a - b) / abs(b) for a, b in zip(losses, reference.losses, strict=True)]
    worst_step = max(range(len(relative)), key=relative.__getitem__)
    weight_diff = {name: float((weights[name] - ref).abs().max()) for name, ref in reference.weights.items()}
    worst = max(weight_diff, key=weight_diff.__getitem__)
    tables = [d for name, d in weight_diff.items() if name.startswith("embeddings.")]
    match = replicas_agree and relative[worst_step] <= LOSS_TOLERANCE and weight_diff[worst] <= WEIGHT_TOLERANCE
    report = "\n".join(
        [
            f"dense replay (1 process, unsharded tables, steps 0..{len(losses) - 1}):",
            f"  final loss: sharded {losses[-1]:.6f}, replay {reference.losses[-1]:.6f}",
            f"  max relative loss difference over all {len(losses)} steps: {relative[worst_step]:.2e} at step "
            f"{worst_step} (tolerance {LOSS_TOLERANCE:g})",
            f"  max |weight difference|: {weight_diff[worst]:.2e} in {worst} (tolerance {WEIGHT_TOLERANCE:g}); "
            f"over the {len(tables)} tables {max(tables):.2e}",
            f"  the MLPs are {'identical' if replicas_agree else 'NOT identical'} on all {ranks} ranks",
            f"dense replay: {'MATCH' if match else 'MISMATCH'}",
        ]
    )
    return match, report


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; returns the exit status (0: the sharded run matches the one-process replay)."""
    args = parse_args(argv)
    config = TINY if args.tiny else FULL
    group = shardwise.init(args.backend)
    use_cores_fairly(group)
    rank, world = group.rank, group.size
    label = f"{world} rank{'s' if world > 1 else ''} ({group.backend})"
    if args.resume:
        history = read_history(args.resume, args, config, group)
    else:
        history = History(
            config=config.name,
            seed=0 if args.seed is None else args.seed,
            batch=config.batch if args.batch is None else args.batch,
            table_optimizer=args.table_optimizer or TABLE_OPTIMIZERS[0],
            losses=[],
            runs=[],
        )
    steps = config.steps if args.steps is None else args.steps
    start = len(history.losses)
    history.runs.append([start, label])

    # Every rank builds the same dense collection and the same plan; each then keeps its own blocks.
    tables = criteo_tables(config.max_rows, config.dim)
    ebc = build_collection(tables, history.seed)
    try:
        budget = config.memory_budget_mib if args.memory_budget_mib is None else args.memory_budget_mib
        plan = make_plan(ebc, group, history, budget)
    except PlanError as exc:  # every rank plans alike, so every rank stops here
        refuse(group, f"no plan: {exc}")
    if rank == 0:
        say(plan.explain())
    sharded = shard_collection(ebc, plan, group)
    del ebc  # each rank keeps only its blocks (and the replicated tables)
    model = build_model(sharded, tables, config.bottom, config.top, history.seed)
    tables_opt = table_optimizer(history.table_optimizer, sharded.parameters(), config)
    mlp_opt = torch.optim.Adagrad(model.dense_parameters(), lr=config.mlp_lr, eps=config.eps)

    if args.resume:
        state = checkpoint_state(model, tables_opt, mlp_opt, history)
        del state["history"], state["step"]
        shardwise.checkpoint.load(state, args.resume)  # each rank reads the pieces of its new blocks
        model.load_state_dict(state["model"])
        tables_opt.load_sharded_state_dict(state["optim"])
        if rank == 0:
            say(
                f"resumed {args.resume} at step {start} ({history.runs[-2][1]} trained steps up to {start - 1}) "
                f"on {label}, under a new plan"
            )

    data = ClickLog(tables, history.seed)
    seconds, moved = train(model, (tables_opt, mlp_opt), data, group, history, steps, label, args.pipeline)
    per_rank = group.exchange(moved)
    if rank == 0:
        say(
            f"trained steps {start}..{start + steps - 1} on {label} in {seconds:.1f} s: "
            f"{steps * history.batch / seconds:,.0f} samples/s"
        )
        say(
            "exchanged per step (one all-to-all of ids, one of pooled vectors): "
            + "; ".join(
                f"rank {r} sent {s / 2**20:.2f} MiB, received {v / 2**20:.2f} MiB" for r, (s, v) in enumerate(per_rank)
            )
        )
    weights, replicas_agree = whole_weights(model, group)
    if args.checkpoint:
        shardwise.checkpoint.save(checkpoint_state(model, tables_opt, mlp_opt, history), args.checkpoint)
        if rank == 0:
            say(f"saved {args.checkpoint} at step {len(history.losses)}")
    shardwise.destroy()
    if rank != 0:
        return 0

    # The other ranks are done; rank 0 alone replays the training without sharding, from step 0.
    reference = replay(tables, config, history)
    say(curve_summary(history.losses, reference, history.run_of_each_step(), WINDOW))
    match, report = compare(history.losses, weights, reference, replicas_agree, world)
    say(report)
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
