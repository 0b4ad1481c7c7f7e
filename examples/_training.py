"""What the two demos' training has in common: ``recsys.py`` and ``dlrm.py`` differ in model, not in method.

Both train a model whose embedding tables are sharded and whose MLPs are
replicated, on synthetic batches that depend only on ``(seed, step)``;
each rank trains on its slice of every global batch (:func:`rank_rows`),
and one all-reduce per step sums the MLPs' gradients and the loss
(:func:`sum_grads_and_loss`). A run's :class:`RunHistory` goes into its
checkpoint, so a resumed run continues the same curve. At the end rank 0
replays the whole training in one process without sharding
(:func:`dense_replay`) and checks the sharded run against that
:class:`Reference`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch
import torch.nn.functional as F
from _progress import progress
from torch import nn

import shardwise

__all__ = [
    "Reference",
    "ReplayBatch",
    "RunHistory",
    "Stepper",
    "dense_replay",
    "rank_rows",
    "stream_generator",
    "sum_grads_and_loss",
]


def stream_generator(seed: int, stream: int) -> torch.Generator:
    """A generator for ``stream`` (-1: the hidden model; ``s >= 0``: step ``s``), independent of the others.

    Args:
        seed: The run's seed (``--seed``).
        stream: Which stream of random numbers: -1 for the hidden model
            that labels the data, ``s`` for step ``s``'s global batch.

    Returns:
        A fresh CPU generator, the same in every process for the same
        ``(seed, stream)``.
    """
    return torch.Generator().manual_seed((seed * 1_000_003 + stream + 1) % (1 << 63))


def rank_rows(batch: int, rank: int, world: int) -> slice:
    """Rows of a ``batch``-sample global batch that ``rank`` of ``world`` trains on.

    Contiguous and balanced like ``torch.tensor_split``: sizes differ by at
    most one, and the slices of all ranks tile the batch in rank order.

    Args:
        batch: Samples in the global batch.
        rank: This rank, ``0 <= rank < world``.
        world: Ranks sharing the batch.

    Returns:
        The slice of the global batch's rows that ``rank`` trains on.
    """
    base, extra = divmod(batch, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def sum_grads_and_loss(params: Sequence[torch.Tensor], loss: torch.Tensor, group: shardwise.Group) -> float:
    """Sum the replicated ``params``' gradients over ``group``; return the global batch's mean loss.

    Every rank holds all of ``params`` but computed their gradients on its
    own samples only; after the sum every rank steps with the full-batch
    gradient, and the replicas stay identical. The loss rides in the same
    buffer, so one all-reduce per step serves both.

    Args:
        params: The replicated parameters (the MLPs'), after ``backward``;
            one without a gradient counts as a zero gradient.
        loss: This rank's share of the global batch's mean loss (the
            demos' ``batch_loss``).
        group: The group the tables are sharded over.

    Returns:
        The mean loss over the global batch (the same on every rank).
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1).to(grads[0].dtype)])
    group.all_reduce(flat)
    for p, piece in zip(params, flat[:-1].split([p.numel() for p in params]), strict=True):
        p.grad = piece.view_as(p)
    return float(flat[-1])


@dataclasses.dataclass
class RunHistory:
    """What a run passes on to the run that resumes it, besides the weights.

    Saved with the checkpoint as JSON (``dataclasses.asdict``) and read back
    as keyword arguments, so a demo may add fields in a subclass.

    Attributes:
        config: Name of the demo's ``Config`` trained.
        seed: Seed of the initial weights and of the data.
        batch: Global batch size.
        losses: The loss of every step so far, from step 0.
        runs: ``[first step, description]`` of every run so far.
    """

    config: str
    seed: int
    batch: int
    losses: list[float]
    runs: list[list[Any]]

    def run_of_each_step(self) -> list[str]:
        """For each step, the description of the run that trained it."""
        labels: list[str] = []
        bounds = [start for start, _ in self.runs[1:]] + [len(self.losses)]
        for (start, label), end in zip(self.runs, bounds, strict=True):
            labels += [label] * (end - start)
        return labels


@dataclasses.dataclass(frozen=True)
class Reference:
    """The dense replay's results.

    Attributes:
        losses: Mean loss of every step, from step 0.
        true_losses: The hidden model's mean loss on every step's batch.
        click_rate: Fraction of clicks over all the batches.
        weights: Final weights by state-dict name.
    """

    losses: list[float]
    true_losses: list[float]
    click_rate: float
    weights: dict[str, torch.Tensor]


class ReplayBatch(Protocol):
    """A global batch as :func:`dense_replay` uses it (both demos' ``Batch``)."""

    @property
    def labels(self) -> torch.Tensor:
        """``[samples]`` float 0 (no click) or 1 (click)."""
        ...

    def true_loss(self) -> float:
        """Mean binary cross-entropy of the hidden model on these samples."""
        ...


class Stepper(Protocol):
    """An optimizer as :func:`dense_replay` uses it: ``torch.optim``'s, or one written out plainly."""

    def zero_grad(self) -> None:
        """Drop the gradients."""
        ...

    def step(self) -> Any:
        """Update the parameters from their gradients."""
        ...


BatchT = TypeVar("BatchT", bound=ReplayBatch)


def dense_replay(
    model: nn.Module,
    optimizers: Sequence[Stepper],
    global_batch: Callable[[int], BatchT],
    logits: Callable[[BatchT], torch.Tensor],
    *,
    steps: int,
    batch: int,
    desc: str,
    show: bool = True,
) -> Reference:
    """Train ``model`` on one process for ``steps`` steps from step 0, on the whole of every global batch.

    Each step's loss is the binary cross-entropy averaged over the global
    batch: what the sharded ranks' losses add up to.

    Args:
        model: The unsharded model, with the same initial weights as the
            sharded run's.
        optimizers: Its optimizers, zeroed and stepped in this order.
        global_batch: Step to that step's whole global batch.
        logits: A batch to the model's click logits for it, one per sample.
        steps: Steps to train.
        batch: Samples in every global batch (for the click rate).
        desc: What the progress display calls the loop.
        show: Show progress (a bar on a terminal, a few plain lines in a log).

    Returns:
        Every step's loss and the hidden model's, the click rate, and the
        final weights.
    """
    losses: list[float] = []
    true_losses: list[float] = []
    clicks = 0.0
    bar = progress(steps, desc, "step", disable=not show, leave=False)
    for step in range(steps):
        samples = global_batch(step)
        loss = F.binary_cross_entropy_with_logits(logits(samples), samples.labels)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses.append(loss.item())
        true_losses.append(samples.true_loss())
        clicks += float(samples.labels.sum())
        bar.update(1)
    bar.close()
    weights = {name: value.detach() for name, value in model.state_dict().items()}
    return Reference(losses, true_losses, clicks / (steps * batch), weights)
