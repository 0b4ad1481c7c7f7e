"""Synthetic Criteo-like click logs for ``dlrm.py``, reproducible from the seed and step alone.

Each sample has 13 dense features (log-transformed counts, as DLRM
preprocesses Criteo's ``I1..I13``) and 26 categorical features
(``C1..C26``), each a bag of 1 to 3 ids from its own vocabulary. The
vocabularies have the sizes of the Criteo Kaggle (Display Advertising
Challenge) dataset's features, capped: from 3 rows to 10^6. Ids follow a
power law, as real categorical values do (a few values are very frequent,
most are rare), with the popular ids scattered over the whole table by a
fixed shuffle, as hashing them would.

A hidden logistic model labels the clicks: every id of every feature has a
weight, every dense feature a coefficient, and a sample is a click with
probability ``sigmoid(bias + dense part + sum over features of the mean
weight of the bag's ids)``. So there is a signal to learn, and a best
achievable loss (the hidden model's own) to compare the training loss with.

Step ``s``'s global batch depends only on ``(seed, s)``. Each rank cuts its
slice out of it, so the samples a step trains on do not depend on the number
of ranks: a run resumed on another world size and the single-process replay
see exactly the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from _training import stream_generator
from shardwise_embedding import EmbeddingBagConfig, KeyedJaggedTensor

__all__ = [
    "CRITEO_KAGGLE_ROWS",
    "MAX_BAG",
    "NUM_DENSE",
    "Batch",
    "ClickLog",
    "criteo_tables",
    "feature_names",
]

#: Distinct values of each of the Criteo Kaggle dataset's 26 categorical features, C1..C26.
CRITEO_KAGGLE_ROWS = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
#: Dense features per sample (Criteo's I1..I13).
NUM_DENSE = 13
#: Most ids in one bag; each bag holds 1 to MAX_BAG ids, uniformly.
MAX_BAG = 3
#: Exponent of the id distribution: ``rank = rows * u ** SKEW`` for uniform ``u``,
#: so the most popular 1% of a table's ids get about a fifth of its lookups.
SKEW = 3.0
#: Standard deviation of one feature's hidden per-id weights. 26 of them add up to a
#: logit spread of about 2.5, enough that knowing the ids predicts clicks well.
SIGNAL = 0.5
#: Standard deviation of the hidden dense coefficients.
DENSE_SIGNAL = 0.5
#: About the mean of a dense feature: the hidden model centres them on it.
DENSE_CENTER = 1.0
#: Hidden bias: about one sample in four is a click, as in Criteo.
BIAS = -1.5


def feature_names() -> list[str]:
    """The categorical features, ``C1`` .. ``C26``."""
    return [f"C{i + 1}" for i in range(len(CRITEO_KAGGLE_ROWS))]


def criteo_tables(max_rows: int, dim: int) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, named after it, of Criteo's size capped at ``max_rows`` rows."""
    return [
        EmbeddingBagConfig(name=f, embedding_dim=dim, num_embeddings=min(rows, max_rows), feature_names=[f])
        for f, rows in zip(feature_names(), CRITEO_KAGGLE_ROWS, strict=True)
    ]


@dataclass(frozen=True)
class Batch:
    """Samples of one step (the global batch, or one rank's slice of it).

    Attributes:
        dense: ``[samples, 13]`` float dense features.
        ids: ``[26, samples, MAX_BAG]`` int64 ids; only the first ``lengths``
            of each bag count (the rest is padding, never looked up).
        lengths: ``[26, samples]`` int64 bag sizes, 1 to MAX_BAG.
        labels: ``[samples]`` float 0 (no click) or 1 (click).
        true_logits: ``[samples]`` the hidden model's logits (only to report
            the best achievable loss; never trained on).
    """

    dense: torch.Tensor
    ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    true_logits: torch.Tensor

    def __getitem__(self, rows: slice) -> Batch:
        return Batch(
            self.dense[rows], self.ids[:, rows], self.lengths[:, rows], self.labels[rows], self.true_logits[rows]
        )

    def __len__(self) -> int:
        return self.labels.numel()

    def features(self, keys: Sequence[str]) -> KeyedJaggedTensor:
        """The categorical features as a :class:`KeyedJaggedTensor` (``keys``: the feature names, in order)."""
        used = torch.arange(MAX_BAG) < self.lengths.unsqueeze(-1)  # [26, samples, MAX_BAG]
        # Boolean indexing keeps the order feature-major, then sample, then position: a KJT's layout.
        return KeyedJaggedTensor.from_lengths_sync(keys, self.ids[used], self.lengths.reshape(-1))

    def true_loss(self) -> float:
        """Mean binary cross-entropy of the hidden model on these samples: the loss to hope for."""
        return float(F.binary_cross_entropy_with_logits(self.true_logits, self.labels))


class ClickLog:
    """Click samples over ``tables``' features, drawn from a hidden logistic model fixed by ``seed``.

    Args:
        tables: One table per categorical feature, in feature order.
        seed: Fixes the hidden model and every batch.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], seed: int) -> None:
        self.rows = [t.num_embeddings for t in tables]
        self.seed = seed
        g = stream_generator(seed, -1)
        # A fixed shuffle of each vocabulary spreads the popular ids over the whole table (and over every
        # rank's rows), as hashed ids are.
        self._order = [torch.randperm(n, generator=g) for n in self.rows]
        self._weights = [torch.randn(n, generator=g) * SIGNAL for n in self.rows]
        self._dense_weights = torch.randn(NUM_DENSE, generator=g) * DENSE_SIGNAL

    def global_batch(self, step: int, batch: int) -> Batch:
        """All ``batch`` samples of ``step``; the same in every process for the same seed."""
        g = stream_generator(self.seed, step)
        counts = torch.exp(torch.randn(batch, NUM_DENSE, generator=g) * 1.5).floor()
        dense = torch.log1p(counts)  # what DLRM does to Criteo's counts
        logits = BIAS + (dense - DENSE_CENTER) @ self._dense_weights
        lengths = torch.randint(1, MAX_BAG + 1, (len(self.rows), batch), generator=g)
        used = torch.arange(MAX_BAG) < lengths.unsqueeze(-1)
        ids = torch.empty(len(self.rows), batch, MAX_BAG, dtype=torch.int64)
        for f, rows in enumerate(self.rows):
            popularity = (torch.rand(batch, MAX_BAG, generator=g) ** SKEW * rows).long().clamp_(max=rows - 1)
            ids[f] = self._order[f][popularity]
            weights = self._weights[f][ids[f]] * used[f]
            logits = logits + weights.sum(dim=1) / lengths[f]
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return Batch(dense, ids, lengths, labels, logits)
