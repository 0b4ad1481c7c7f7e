"""The DLRM-style model of ``dlrm.py``, and the pieces its sharded training and its dense replay share.

DLRM (Naumov et al., 2019; the model of the MLPerf recommendation
benchmark), at a small scale:

* the 13 dense features go through the **bottom MLP** to one vector of the
  embedding width ``D``;
* each of the 26 categorical features is a bag of ids pooled (summed) from
  its own embedding table, giving 26 more vectors of width ``D``; the tables
  live in an **embedding-bag collection**: the dense ``EmbeddingBagCollection``
  on one process, or the ``ShardedEmbeddingBagCollection`` that
  ``shard_collection`` makes of it, split across ranks by a plan;
* the **interaction** takes the dot product of every pair of those 27
  vectors (351 numbers per sample) and puts the bottom MLP's vector beside
  them;
* the **top MLP** turns that into one click logit.

The model does not care which collection it holds: anything that maps a
``KeyedJaggedTensor`` to a ``KeyedTensor`` of ``[batch, 26 * D]`` will do.
The tables are what makes such a model big (here up to 10^6 rows each), so
they are sharded; the MLPs are small, so every rank holds all of them and
the ranks keep their copies identical by summing the MLPs' gradients before
each optimizer step (:func:`sum_dense_grads`).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from _dlrm_data import NUM_DENSE
from _training import sum_grads_and_loss
from shardwise_embedding import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torch import nn

import shardwise

__all__ = [
    "DLRM",
    "INIT_STD",
    "ReferenceRowWiseAdagrad",
    "UnshardedTables",
    "batch_loss",
    "build_collection",
    "build_model",
    "mlp",
    "mlp_optimizer_state",
    "sum_dense_grads",
    "table_weight",
]

#: Standard deviation of the tables' initial values.
INIT_STD = 0.1


def mlp(widths: Sequence[int], last_activation: bool) -> nn.Sequential:
    """Linear layers of the given widths (input first), SiLU between them (and after the last if asked).

    SiLU rather than DLRM's ReLU: at ReLU's kink a rounding difference of
    1e-7 switches a sample's whole gradient on or off, and the sharded run
    and its dense replay (which add the same numbers in another order)
    would drift apart for that reason alone.
    """
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(widths) - 2:
            layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embedding-bag collection, pairwise dot-product interaction, top MLP: one click logit.

    Args:
        embeddings: The collection (dense, sharded, or :class:`UnshardedTables`);
            every table ``dim`` wide, one feature per table.
        num_features: Categorical features (26).
        dim: Embedding width ``D``; the bottom MLP ends at ``D`` too.
        bottom: Hidden widths of the bottom MLP.
        top: Hidden widths of the top MLP.
    """

    def __init__(
        self, embeddings: nn.Module, num_features: int, dim: int, bottom: Sequence[int], top: Sequence[int]
    ) -> None:
        super().__init__()
        self.bottom = mlp([NUM_DENSE, *bottom, dim], last_activation=True)
        self.embeddings = embeddings
        vectors = num_features + 1
        self.top = mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)
        # The pairs (i, j), i > j, of the interaction: the strictly lower triangle.
        self._pairs = torch.tril_indices(vectors, vectors, offset=-1)
        self.num_features, self.dim = num_features, dim

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        """Click logits.

        Collective when the collection is sharded: every rank calls it, each
        with its own samples.

        Args:
            dense: ``[samples, 13]`` dense features.
            features: The samples' 26 bags of ids.

        Returns:
            ``[samples]`` logits.
        """
        x = self.bottom(dense)  # [n, D]
        pooled: KeyedTensor = self.embeddings(features)
        vectors = torch.cat([x.unsqueeze(1), pooled.values().view(-1, self.num_features, self.dim)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # [n, 27, 27]
        pairs = dots[:, self._pairs[0], self._pairs[1]]  # [n, 351]
        logits: torch.Tensor = self.top(torch.cat([x, pairs], dim=1))
        return logits.squeeze(1)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The MLPs' parameters: replicated on every rank, stepped by a dense optimizer."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The MLPs' weights by state-dict name (``bottom.0.weight`` ...)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embeddings.")}


def table_weight(collection: Any, name: str) -> torch.Tensor:
    """The weight of table ``name`` of a dense collection (``collection.embedding_bags[name].weight``)."""
    bag = collection.embedding_bags[name]
    assert isinstance(bag, nn.EmbeddingBag)
    return bag.weight


def build_collection(tables: Sequence[EmbeddingBagConfig], seed: int) -> EmbeddingBagCollection:
    """The dense collection with its initial weights, the same in every process for the same ``seed``.

    Every rank builds it before sharding (``shard_collection`` keeps each
    rank's blocks of it), and the dense replay starts from it: both start
    from identical tables. The MLPs are made right after, from the same
    seeded stream (see :func:`build_model`).
    """
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables)
    with torch.no_grad():
        for table in tables:
            # Smaller than nn.EmbeddingBag's N(0, 1), as recommendation models usually start: rows not
            # trained yet add little noise to the interactions.
            nn.init.normal_(table_weight(ebc, table.name), std=INIT_STD)
    return ebc


def build_model(
    embeddings: nn.Module, tables: Sequence[EmbeddingBagConfig], bottom: Sequence[int], top: Sequence[int], seed: int
) -> DLRM:
    """The model around ``embeddings``, its MLPs initialised from ``seed`` (the same in every process)."""
    torch.manual_seed(seed + 1)
    return DLRM(embeddings, len(tables), tables[0].embedding_dim, bottom, top)


class UnshardedTables(nn.Module):
    """The dense collection's tables, looked up with sparse gradients: what the one-process replay trains.

    It holds the very ``nn.EmbeddingBag`` modules of an
    :class:`EmbeddingBagCollection` (so its state dict has the same keys,
    ``embedding_bags.<table>.weight``, as the sharded collection's) and pools
    each feature with ``F.embedding_bag`` as the collection does, but with
    ``sparse=True``: the gradient of a 10^6-row table then holds only the
    rows a batch touched, and an optimizer step costs that many rows, not
    the table. The sharded collection's blocks get sparse gradients the
    same way.
    """

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bags = ebc.embedding_bags
        self._order = [(f, t) for t in ebc.embedding_bag_configs() for f in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags from its table; the same values as ``EmbeddingBagCollection.forward``."""
        pooled = []
        for f, t in self._order:
            bags = features[f]
            weight = table_weight(self, t.name)
            pooled.append(F.embedding_bag(bags.values(), weight, bags.offsets()[:-1], mode=t.pooling, sparse=True))
        return KeyedTensor(
            [f for f, _ in self._order], [t.embedding_dim for _, t in self._order], torch.cat(pooled, dim=1)
        )


class ReferenceRowWiseAdagrad:
    """Row-wise Adagrad written out plainly, for the one-process replay (not sharded, not optimized).

    One accumulator per row: for every row ``r`` with a gradient ``g_r``,
    ``acc[r] += mean(g_r ** 2)`` and then ``w_r -= lr * g_r / (sqrt(acc[r]) + eps)``.
    A row without a gradient keeps its weights and accumulator. This is the
    update FBGEMM and TorchRec call ``EXACT_ROWWISE_ADAGRAD``, and the one
    ``shardwise_embedding``'s ``RowWiseAdagrad`` does on each rank's blocks.

    Args:
        params: The tables (gradients sparse or dense).
        lr: Learning rate.
        eps: Added to the denominator.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, eps: float) -> None:
        self.params = list(params)
        self.lr, self.eps = lr, eps
        self.sums = [torch.zeros(p.shape[0], dtype=p.dtype) for p in self.params]

    def zero_grad(self) -> None:
        """Drop the gradients."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Update the rows that have a gradient."""
        for p, acc in zip(self.params, self.sums, strict=True):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                g = p.grad.coalesce()  # one entry per row, repeated lookups summed
                rows, values = g.indices()[0], g.values()
            else:
                rows = torch.arange(p.shape[0])
                values = p.grad
            acc.index_add_(0, rows, values.pow(2).mean(dim=1))
            std = acc.index_select(0, rows).sqrt().add(self.eps)
            p.index_add_(0, rows, values / std.unsqueeze(1), alpha=-self.lr)


def batch_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch: int) -> torch.Tensor:
    """Binary cross-entropy of this rank's samples, as their share of the mean over the global batch.

    Summing over the local samples and dividing by the *global* batch size
    makes the ranks' losses add up to exactly the mean loss of one dense
    step on the whole batch, even when ranks hold different numbers of
    samples. The sharded collection's backward adds every rank's
    contribution to each row, so this scaling is what makes the tables'
    gradients the dense ones; the MLPs' become them after :func:`sum_dense_grads`.
    """
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_batch


def sum_dense_grads(model: DLRM, loss: torch.Tensor, group: shardwise.Group) -> float:
    """Sum the MLPs' gradients over ``group``; return the global batch's mean loss.

    Every rank holds both MLPs; the one all-reduce of
    :func:`_training.sum_grads_and_loss` makes each rank's gradients the
    full-batch ones and brings the loss along.
    """
    return sum_grads_and_loss(model.dense_parameters(), loss, group)


def mlp_optimizer_state(optimizer: torch.optim.Optimizer, model: DLRM) -> dict[str, Any]:
    """The dense optimizer's state keyed by parameter name, for ``shardwise.checkpoint`` (plain tensors).

    ``torch.optim``'s own ``state_dict()`` numbers the parameters; names
    keep a checkpoint readable and independent of the parameter order.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(state) for p, state in optimizer.state.items()}
