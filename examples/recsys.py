"""Train a small recommendation model whose embedding tables are sharded with shardwise.

Two categorical features (a bag of recently viewed items, a bag of context
ids) are pooled by ``nn.EmbeddingBag`` tables: the item table is sharded by
rows, the context table by columns. A replicated MLP turns the pooled
embeddings into a click logit. ``ShardedOptimizer`` (Adagrad) steps each
rank's shards and its copy of the MLP, on synthetic clicks with a hidden
signal. At the end rank 0 replays the training in one process with plain
dense tables, checks that the sharded run did the same maths, and draws
the loss curve of both as a PNG (``--plot``; needs matplotlib).

    .venv/bin/mpiexec -n 2 .venv/bin/python examples/recsys.py --checkpoint /tmp/recsys-ckpt
    .venv/bin/mpiexec -n 3 .venv/bin/python examples/recsys.py --resume /tmp/recsys-ckpt
    .venv/bin/torchrun --standalone --nproc-per-node 3 examples/recsys.py --backend gloo --resume /tmp/recsys-ckpt

Exit status: 0 when the sharded run matches the dense reference, 1 when not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

import torch
from _progress import progress
from _recsys_data import ClickData
from _recsys_model import RecModel, Table, batch_loss, build_model, shard_tables, sync_dense_grads
from _recsys_plot import save_loss_picture
from _recsys_report import compare, curve_summary, dense_reference
from _training import RunHistory, rank_rows

import shardwise
import shardwise.checkpoint
from shardwise.sharded_optim import ShardedOptimizer, named_params_with_sharded_tensor

#: Steps in the moving average shown on the progress bar and in the summary.
WINDOW = 20
#: Where the loss picture goes when a run neither saves nor resumes a checkpoint (beside the checkpoint of
#: ``make demo-recsys``).
PICTURE_DIR = Path(__file__).resolve().parents[1] / "build" / "demo"


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one variant of the demo.

    Attributes:
        name: ``"full"`` or ``"tiny"``; a checkpoint resumes only into the same.
        tables: The features and their tables.
        hidden: The MLP's hidden widths.
        steps: Default number of steps per run.
        batch: Default global batch size.
        lr: Adagrad's learning rate.
        eps: Adagrad's epsilon.
    """

    name: str
    tables: tuple[Table, ...]
    hidden: tuple[int, ...]
    steps: int
    batch: int
    lr: float = 0.1
    # Far above torch's 1e-10. Adagrad divides by sqrt(sum of squared
    # gradients) + eps, so with a negligible eps an entry's first update is
    # a whole learning rate whatever the size of its gradient: an entry whose
    # gradient is nearly zero jumps one way or the other as rounding decides,
    # and no two summation orders (sharded and dense) would agree for long.
    # Learning is as fast: the gradients that matter are far above 1e-5.
    eps: float = 1e-5


FULL = Config(
    name="full",
    tables=(
        # Long-tailed and tall: split by rows, each id is fetched from the one rank that owns it.
        Table("history", rows=200_000, dim=32, bag=16, shard_dim=0),
        # Fewer but wider rows: split by columns, every rank serves a slice of each row.
        Table("context", rows=50_000, dim=64, bag=8, shard_dim=1),
    ),
    hidden=(64, 32),
    steps=300,
    batch=4096,
)
TINY = Config(
    name="tiny",
    tables=(
        Table("history", rows=2_000, dim=8, bag=4, shard_dim=0),
        Table("context", rows=500, dim=12, bag=3, shard_dim=1),
    ),
    hidden=(16,),
    steps=12,
    batch=96,
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help=f"steps to train in this run (default {FULL.steps}, tiny "
                        f"{TINY.steps})")
    parser.add_argument("--batch", type=int, help=f"global batch size, split over the ranks (default "
                        f"{FULL.batch}, tiny {TINY.batch}; a resumed run keeps the checkpoint's)")
    parser.add_argument("--seed", type=int, help="seed of the initial weights and of the data (default 0; a "
                        "resumed run keeps the checkpoint's)")
    parser.add_argument("--checkpoint", metavar="PATH", help="save the model, the optimizer and the step here at "
                        "the end (a directory every rank can reach)")
    parser.add_argument("--resume", metavar="PATH", help="continue from this checkpoint, on any number of ranks")
    parser.add_argument("--backend", choices=("gloo", "mpi", "nccl"), help="collective backend (default: "
                        "shardwise picks from the launcher: mpi under mpiexec, nccl with CUDA, else gloo)")
    parser.add_argument("--tiny", action="store_true", help="small tables and few steps: a smoke test of seconds")
    parser.add_argument("--plot", metavar="PNG", type=Path, help="where to draw the loss curve, sharded against "
                        "dense, of every step so far (default: beside the checkpoint saved or resumed, named "
                        "after its steps: PATH-loss-steps-0-299.png; without one, under build/demo)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    return args


def use_cores_fairly(group: shardwise.Group) -> None:
    """Give each rank its share of this host's cores for torch's intra-op threads.

    Under ``mpiexec`` every rank would otherwise start one thread per core,
    and ranks sharing a host would fight over the cores. A thread count the
    user or ``torchrun`` chose (``OMP_NUM_THREADS``) is kept.
    """
    hosts = group.exchange(socket.gethostname())
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // hosts.count(hosts[group.rank])))


def refuse(group: shardwise.Group, message: str) -> NoReturn:
    """Exit with status 2 and ``message`` (printed once, by rank 0).

    Call it on every rank, for a reason every rank sees alike: then all of
    them stop here and none is left waiting in a collective for the others.
    """
    if group.rank == 0:
        print(f"recsys.py: error: {message}", file=sys.stderr, flush=True)
    shardwise.destroy()
    raise SystemExit(2)


def read_history(path: str, args: argparse.Namespace, config: Config, group: shardwise.Group) -> RunHistory:
    """The history saved with the checkpoint at ``path``, checked against the command line.

    Every rank reads the same checkpoint, so every rank makes the same
    decision here.
    """
    saved: dict[str, Any] = {"step": 0, "history": ""}
    shardwise.checkpoint.load(saved, path)
    history = RunHistory(**json.loads(saved["history"]))
    if history.config != config.name:
        refuse(group, f"{path} holds the {history.config} model: resume it {'without' if args.tiny else 'with'} "
               "--tiny")
    for name in ("seed", "batch"):
        given = getattr(args, name)
        if given is not None and given != getattr(history, name):
            refuse(group, f"{path} was trained with --{name} {getattr(history, name)}, not {given}; the resumed "
                   "run must see the same batches to continue the same training")
    if saved["step"] != len(history.losses):
        refuse(group, f"{path} is inconsistent: step {saved['step']} but {len(history.losses)} losses")
    return history


def picture_path(args: argparse.Namespace, steps_done: int) -> Path:
    """Where to draw the loss curve of steps ``0..steps_done - 1``: ``--plot``, else beside the checkpoint.

    Every run draws all the steps so far (a resumed run's checkpoint holds
    the earlier losses), so the resumed run's picture shows both runs, each
    in its colour. Naming the file after its steps keeps the first run's
    picture beside it instead of overwriting it.
    """
    if args.plot is not None:
        return Path(args.plot)
    suffix = f"-loss-steps-0-{steps_done - 1}.png"
    checkpoint = args.checkpoint or args.resume
    if checkpoint:
        where = Path(checkpoint)
        return where.parent / f"{where.name}{suffix}"
    return PICTURE_DIR / f"recsys{suffix}"


def train(
    model: RecModel,
    optimizer: ShardedOptimizer,
    data: ClickData,
    group: shardwise.Group,
    history: RunHistory,
    steps: int,
    label: str,
) -> float:
    """Train ``steps`` steps after the ones in ``history``, appending their losses; returns the seconds taken.

    Every rank runs the same collectives in the same order (the sharded
    lookups, their backward, one all-reduce), so no rank can be left
    waiting for another.
    """
    batch, rank, world = history.batch, group.rank, group.size
    rows = rank_rows(batch, rank, world)
    start = len(history.losses)
    bar = progress(steps * batch, f"steps {start}..{start + steps - 1} on {label}", "sample", unit_scale=True,
                   disable=rank != 0, dynamic_ncols=True)
    began = time.perf_counter()
    for step in range(start, start + steps):
        local = data.global_batch(step, batch)[rows].to(group.device)
        loss = batch_loss(model(local.ids), local.labels, batch)
        optimizer.zero_grad()
        loss.backward()  # collective: the tables' gradients travel to the ranks that own the rows/columns
        history.losses.append(sync_dense_grads(model, loss, group))
        optimizer.step()
        if step == start and start > 0 and rank == 0:
            before = history.losses[-WINDOW - 1 : -1]
            bar.write(f"first resumed step {step}: loss {history.losses[-1]:.4f}; before the checkpoint: step "
                      f"{step - 1} {history.losses[-2]:.4f}, mean of the last {len(before)} steps "
                      f"{sum(before) / len(before):.4f}")
        recent = history.losses[-WINDOW:]
        bar.set_postfix_str(f"loss={sum(recent) / len(recent):.4f}", refresh=False)
        bar.update(batch)
    bar.close()
    return time.perf_counter() - began


def whole_weights(model: RecModel, group: shardwise.Group) -> tuple[dict[str, torch.Tensor], bool]:
    """The model's weights on rank 0, and whether every rank's MLP is bit-for-bit rank 0's.

    Returns:
        ``(weights, replicas_agree)``: the weights by state-dict name with
        the sharded tables gathered whole (an empty dict on the other
        ranks), and whether the replicated MLP is the same on every rank, as
        summing its gradients over the ranks should keep it.
    """
    weights: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, shardwise.ShardedTensor):
            out = torch.empty(value.size(), dtype=value.dtype, device=group.device) if group.rank == 0 else None
            value.gather(dst=0, out=out)  # collective: every rank sends its shard
            if out is not None:
                weights[name] = out.cpu()
        elif group.rank == 0:
            weights[name] = value.detach().cpu()
    mlp = torch.cat([p.detach().reshape(-1) for p in model.mlp.parameters()])
    # One all-reduce gives the elementwise max and (negated) min over the ranks: equal everywhere iff identical.
    extremes = group.all_reduce(torch.cat([mlp, -mlp]), op="max")
    highest, lowest = extremes[: mlp.numel()], -extremes[mlp.numel() :]
    return weights, torch.equal(highest, lowest)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; returns the exit status (0: the sharded run matches dense training)."""
    args = parse_args(argv)
    config = TINY if args.tiny else FULL
    group = shardwise.init(args.backend)
    use_cores_fairly(group)
    rank, world = group.rank, group.size
    label = f"{world} rank{'s' if world > 1 else ''} ({group.backend})"
    if args.resume:
        history = read_history(args.resume, args, config, group)
    else:
        seed = 0 if args.seed is None else args.seed
        history = RunHistory(config.name, seed, config.batch if args.batch is None else args.batch, [], [])
    steps = config.steps if args.steps is None else args.steps
    start = len(history.losses)
    history.runs.append([start, label])

    # Every rank builds the same dense model; sharding then hands each rank its slice of rank 0's tables.
    model = build_model(config.tables, config.hidden, history.seed, group.device)
    shard_tables(model, config.tables, group)
    optimizer = ShardedOptimizer(dict(named_params_with_sharded_tensor(model)), torch.optim.Adagrad, lr=config.lr,
                                 eps=config.eps)
    if args.resume:
        state = {"model": model.state_dict()}
        shardwise.checkpoint.load(state, args.resume)  # each rank reads the pieces of its own shards
        model.load_state_dict(state["model"])
        shardwise.checkpoint.load_optimizer(optimizer, args.resume, key="optim")
        if rank == 0:
            print(f"resumed {args.resume} at step {start} ({history.runs[-2][1]} trained steps up to "
                  f"{start - 1}) on {label}", flush=True)

    seconds = train(model, optimizer, ClickData(config.tables, history.seed), group, history, steps, label)
    if rank == 0:
        print(f"trained steps {start}..{start + steps - 1} on {label} in {seconds:.1f} s: "
              f"{steps * history.batch / seconds:,.0f} samples/s", flush=True)
    weights, replicas_agree = whole_weights(model, group)
    if args.checkpoint:
        shardwise.checkpoint.save(
            {
                "model": model.state_dict(),
                "optim": shardwise.checkpoint.optimizer_state(optimizer),
                "step": len(history.losses),
                "history": json.dumps(dataclasses.asdict(history)),
            },
            args.checkpoint,
        )
        if rank == 0:
            print(f"saved {args.checkpoint} at step {len(history.losses)}", flush=True)
    shardwise.destroy()
    if rank != 0:
        return 0

    # The other ranks are done; rank 0 alone replays the training densely, from step 0.
    reference = dense_reference(config.tables, config.hidden, seed=history.seed, batch=history.batch,
                                steps=len(history.losses), lr=config.lr, eps=config.eps, show=True)
    print(curve_summary(history.losses, reference, history.run_of_each_step(), WINDOW))
    picture = picture_path(args, len(history.losses))
    if save_loss_picture(picture, history.losses, reference, history.runs, WINDOW):
        print(f"loss curve picture (sharded against dense, steps 0..{len(history.losses) - 1}): {picture}")
    else:
        print("loss curve picture: not drawn, matplotlib is not installed (`make install` installs it, or "
              "`.venv/bin/python -m pip install matplotlib`); the demo needs it for nothing else")
    match, report = compare(history.losses, weights, reference, replicas_agree, world)
    print(report, flush=True)
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
