"""What rank 0 of ``recsys.py`` prints at the end: the loss curve and the check against dense training.

The check replays the whole training, every step from 0, in one process
with plain ``nn.EmbeddingBag`` tables and ``torch.optim.Adagrad``, on the
same global batches from the same initial weights. Sharding moves data
between ranks but must not change the maths, so the sharded run's losses
and final weights have to equal the replay's up to float rounding (sums
taken in another order).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from _recsys_data import ClickData
from _recsys_model import Table, build_model
from _training import Reference, dense_replay

__all__ = [
    "LOSS_TOLERANCE",
    "WEIGHT_TOLERANCE",
    "Reference",
    "blind_loss",
    "compare",
    "curve_summary",
    "dense_reference",
    "effective_window",
]

#: Largest difference allowed between a step's sharded and dense loss. The
#: runs differ only in the order float32 sums are taken (about 1e-7 in a
#: loss), which training then carries along; a real error in the sharded
#: maths moves the loss by far more.
LOSS_TOLERANCE = 1e-5
#: Largest difference allowed between a final sharded and dense weight.
WEIGHT_TOLERANCE = 1e-4


def dense_reference(
    tables: Sequence[Table],
    hidden: Sequence[int],
    *,
    seed: int,
    batch: int,
    steps: int,
    lr: float,
    eps: float,
    show: bool,
) -> Reference:
    """Train the unsharded model on one process for ``steps`` steps from step 0.

    Args:
        tables: The model's features and tables.
        hidden: The MLP's hidden widths.
        seed: Seed of the initial weights and of the data.
        batch: Global batch size.
        steps: Steps to train.
        lr: Adagrad's learning rate.
        eps: Adagrad's epsilon.
        show: Show progress (a bar on a terminal, a few plain lines in a log).
    """
    model = build_model(tables, hidden, seed, torch.device("cpu"))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=lr, eps=eps)
    data = ClickData(tables, seed)
    return dense_replay(
        model,
        [optimizer],
        lambda step: data.global_batch(step, batch),
        lambda samples: model(samples.ids),
        steps=steps,
        batch=batch,
        desc="dense reference",
        show=show,
    )


def effective_window(steps: int, window: int) -> int:
    """The moving average's window for a curve of ``steps`` steps: ``window``, but at most half the curve."""
    return max(1, min(window, steps // 2 or 1))


def blind_loss(click_rate: float) -> float:
    """The loss of always predicting the overall click rate: what a model that learned nothing about the ids gets."""
    return -(click_rate * math.log(click_rate) + (1 - click_rate) * math.log(1 - click_rate))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def curve_summary(
    losses: Sequence[float], reference: Reference, ranks_of_step: Sequence[str], window: int, rows: int = 8
) -> str:
    """A table of the loss at a few steps, with moving averages, and first-versus-last averages.

    Args:
        losses: The sharded run's loss at every step from 0 (the resumed
            run's checkpoint supplies the earlier ones).
        reference: The dense replay (for its losses and the hidden model's).
        ranks_of_step: For each step, which run trained it (``"2 ranks (mpi)"``).
        window: Steps in each moving average.
        rows: About how many steps to show.
    """
    n = len(losses)
    window = effective_window(n, window)
    shown = sorted({round(i * (n - 1) / (rows - 1)) for i in range(rows)} | _resume_steps(ranks_of_step))
    lines = [
        "loss curve (binary cross-entropy, mean over the global batch). avg: mean of the last "
        f"{window} steps; dense: the reference",
        "replay below; hidden: avg of the hidden model that labelled the data (the best achievable)",
        f"  {'step':>6}  {'loss':>7}  {'avg':>7}  {'dense':>7}  {'hidden':>7}  trained by",
    ]
    for step in shown:
        recent = slice(max(0, step + 1 - window), step + 1)
        lines.append(
            f"  {step:>6}  {losses[step]:>7.4f}  {_mean(losses[recent]):>7.4f}  {reference.losses[step]:>7.4f}"
            f"  {_mean(reference.true_losses[recent]):>7.4f}  {ranks_of_step[step]}"
        )
    first, last = _mean(losses[:window]), _mean(losses[-window:])
    best = _mean(reference.true_losses[-window:])
    rate = reference.click_rate
    blind = blind_loss(rate)
    lines += [
        f"mean loss of the first {window} steps {first:.4f} -> of the last {window} steps {last:.4f}",
        f"  (on those last samples the hidden model scores {best:.4f}; predicting the overall click rate, "
        f"{rate:.2f}, for every sample scores {blind:.4f})",
    ]
    return "\n".join(lines)


def _resume_steps(ranks_of_step: Sequence[str]) -> set[int]:
    """Steps where another run took over, so the table shows where the curve was resumed."""
    return {s for s in range(1, len(ranks_of_step)) if ranks_of_step[s] != ranks_of_step[s - 1]}


def compare(
    losses: Sequence[float],
    weights: Mapping[str, torch.Tensor],
    reference: Reference,
    replicas_agree: bool,
    ranks: int,
) -> tuple[bool, str]:
    """Whether the sharded run did the dense maths: its losses and final weights against the replay's.

    Args:
        losses: The sharded run's loss at every step from 0.
        weights: The sharded run's final weights (tables gathered whole).
        reference: The dense replay of the same steps.
        replicas_agree: Whether every rank ended with the same MLP.
        ranks: How many ranks ran the sharded run (for the report).

    Returns:
        ``(match, report)``.
    """
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True))
    weight_diff = {name: float((weights[name] - ref).abs().max()) for name, ref in reference.weights.items()}
    worst = max(weight_diff, key=weight_diff.__getitem__)
    match = replicas_agree and loss_diff <= LOSS_TOLERANCE and weight_diff[worst] <= WEIGHT_TOLERANCE
    report = "\n".join(
        [
            f"dense reference (1 process, plain nn.EmbeddingBag, steps 0..{len(losses) - 1}):",
            f"  final loss: sharded {losses[-1]:.6f}, dense {reference.losses[-1]:.6f}",
            f"  max |loss difference| over all {len(losses)} steps: {loss_diff:.2e} (tolerance {LOSS_TOLERANCE:g})",
            f"  max |weight difference|: {weight_diff[worst]:.2e} in {worst} (tolerance {WEIGHT_TOLERANCE:g})",
            f"  the MLP is {'identical' if replicas_agree else 'NOT identical'} on all {ranks} ranks",
            f"dense reference: {'MATCH' if match else 'MISMATCH'}",
        ]
    )
    return match, report
