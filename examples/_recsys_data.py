"""Synthetic click data for ``recsys.py``, reproducible from the seed and step alone.

A hidden logistic model gives every id of every feature a weight; a
sample's click probability is ``sigmoid(bias + sum over features of the
mean weight of its ids)``, so there is a real signal for the model to learn
and a best achievable loss (the hidden model's own) to compare with. Ids
follow a power law, as item popularity does: a few ids are frequent, most
are rare.

Step ``s``'s global batch depends only on ``(seed, s)``. Each rank cuts its
slice out of it, so the samples a step trains on (and hence the maths) do
not depend on the number of ranks: a run resumed on another world size and
the single-process dense reference see exactly the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from _recsys_model import Table
from _training import rank_rows, stream_generator

__all__ = ["Batch", "ClickData"]

#: Exponent of the id distribution: ``rank = vocab * u ** SKEW`` for uniform
#: ``u``, so the top 1% of ids get about a fifth of all draws.
SKEW = 3.0
#: Standard deviation of the hidden per-id weights: large enough that the
#: mean over a bag still moves the click probability a lot.
SIGNAL = 3.0
#: Hidden bias: about one sample in three is a click.
BIAS = -0.75


@dataclass(frozen=True)
class Batch:
    """Samples of one step (the global batch, or one rank's slice of it).

    Attributes:
        ids: Feature name to a ``[samples, bag]`` int64 tensor of ids.
        labels: ``[samples]`` float tensor of 0 (no click) and 1 (click).
        true_logits: ``[samples]`` logits of the hidden model (only to
            report the best achievable loss; never trained on).
    """

    ids: dict[str, torch.Tensor]
    labels: torch.Tensor
    true_logits: torch.Tensor

    def __getitem__(self, rows: slice) -> Batch:
        return Batch({k: v[rows] for k, v in self.ids.items()}, self.labels[rows], self.true_logits[rows])

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        ids = {k: v.to(device) for k, v in self.ids.items()}
        return Batch(ids, self.labels.to(device), self.true_logits.to(device))

    def true_loss(self) -> float:
        """Mean binary cross-entropy of the hidden model on these samples: the loss to hope for."""
        return float(F.binary_cross_entropy_with_logits(self.true_logits, self.labels))


class ClickData:
    """Click samples over ``tables``' features, drawn from a hidden logistic model fixed by ``seed``.

    Args:
        tables: The features (their names, vocabulary sizes and bag sizes).
        seed: Fixes the hidden model and every batch.
    """

    def __init__(self, tables: Sequence[Table], seed: int) -> None:
        self.tables = tuple(tables)
        self.seed = seed
        g = stream_generator(seed, -1)
        # A fixed shuffle of each vocabulary, so that the popular ids are spread
        # over the whole table (and over every rank's rows) instead of all
        # being the first rows.
        self._order = {t.name: torch.randperm(t.rows, generator=g) for t in self.tables}
        self._weights = {t.name: torch.randn(t.rows, generator=g) * SIGNAL for t in self.tables}

    def global_batch(self, step: int, batch: int) -> Batch:
        """All ``batch`` samples of ``step``; the same in every process for the same seed."""
        g = stream_generator(self.seed, step)
        ids: dict[str, torch.Tensor] = {}
        logits = torch.full((batch,), BIAS)
        for t in self.tables:
            popularity = (torch.rand(batch, t.bag, generator=g) ** SKEW * t.rows).long().clamp_(max=t.rows - 1)
            ids[t.name] = self._order[t.name][popularity]
            logits += self._weights[t.name][ids[t.name]].mean(dim=1)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return Batch(ids, labels, logits)

    def rank_batch(self, step: int, batch: int, rank: int, world: int) -> Batch:
        """``rank``'s slice of step ``step``'s global batch, out of ``world`` ranks.

        Every rank draws the whole global batch and keeps its rows: drawing
        ids is cheap next to a training step, and it makes the slices
        independent of the world size by construction.
        """
        return self.global_batch(step, batch)[rank_rows(batch, rank, world)]
