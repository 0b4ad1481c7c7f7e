"""The recommendation model of ``recsys.py``: sharded embedding tables under a replicated MLP.

Each categorical feature is a bag of ids pooled by an ``nn.EmbeddingBag``.
The tables are what makes a recommendation model large, so they are
sharded across ranks with shardwise (one by rows, one by columns); the MLP
on top is small, so every rank holds all of it and the ranks keep their
copies identical by summing its gradients before each optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from _training import sum_grads_and_loss
from torch import nn

import shardwise
from shardwise import ChunkShardingSpec, shard_parameter

__all__ = ["INIT_STD", "RecModel", "Table", "batch_loss", "build_model", "shard_tables", "sync_dense_grads"]

#: Standard deviation of the tables' initial values.
INIT_STD = 0.1


@dataclass(frozen=True)
class Table:
    """One categorical feature and the embedding table that pools it.

    Attributes:
        name: Feature name; also the table's key in ``RecModel.tables``.
        rows: Vocabulary size (rows of the table).
        dim: Embedding width (columns of the table).
        bag: Ids per sample (a fixed-length bag).
        shard_dim: 0 to shard the table by rows, 1 by columns.
    """

    name: str
    rows: int
    dim: int
    bag: int
    shard_dim: int


class RecModel(nn.Module):
    """Pooled embeddings of every feature, concatenated, into an MLP that outputs one click logit.

    Args:
        tables: The features and their tables.
        hidden: Widths of the MLP's hidden layers.
    """

    def __init__(self, tables: Sequence[Table], hidden: Sequence[int]) -> None:
        super().__init__()
        self.tables = nn.ModuleDict({t.name: nn.EmbeddingBag(t.rows, t.dim, mode="mean") for t in tables})
        layers: list[nn.Module] = []
        width = sum(t.dim for t in tables)
        for out in hidden:
            # SiLU rather than ReLU: at ReLU's kink a rounding difference of
            # 1e-7 switches a sample's whole gradient on or off, and the sharded
            # run and its dense reference would drift apart for that reason alone.
            layers += [nn.Linear(width, out), nn.SiLU()]
            width = out
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Click logits, one per sample.

        Args:
            ids: Feature name to a ``[samples, bag]`` tensor of ids.

        Returns:
            A ``[samples]`` tensor of logits.
        """
        pooled = [table(ids[name]) for name, table in self.tables.items()]
        logits: torch.Tensor = self.mlp(torch.cat(pooled, dim=1))
        return logits.squeeze(1)


def build_model(tables: Sequence[Table], hidden: Sequence[int], seed: int, device: torch.device) -> RecModel:
    """The dense model with its initial weights, the same for the same ``seed`` in every process.

    Both the sharded run (on every rank, before sharding) and the dense
    reference start from this, so they start from identical weights.
    """
    torch.manual_seed(seed)
    model = RecModel(tables, hidden)
    for table in model.modules():
        if not isinstance(table, nn.EmbeddingBag):
            continue
        # Smaller than nn.EmbeddingBag's N(0, 1), as recommendation models
        # usually start: rows not trained yet then add little noise to the
        # pooled vectors, and here the loss falls markedly faster.
        nn.init.normal_(table.weight, std=INIT_STD)
    return model.to(device)


def shard_tables(model: RecModel, tables: Sequence[Table], group: shardwise.Group) -> None:
    """Replace each table's weight by a ShardedTensor split across ``group`` along ``Table.shard_dim``.

    The values come from rank 0's dense weight, so the sharded tables are
    exactly the dense model's.
    """
    # Each rank names its own device: under NCCL every rank has its own GPU.
    devices = group.exchange(str(group.device))
    placements = [f"rank:{r}/{device}" for r, device in enumerate(devices)]
    for t in tables:
        spec = ChunkShardingSpec(dim=t.shard_dim, placements=placements)
        shard_parameter(model.tables[t.name], "weight", spec, src_rank=0, process_group=group)


def batch_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch: int) -> torch.Tensor:
    """Binary cross-entropy of this rank's samples, as their share of the mean over the global batch.

    Summing over the local samples and dividing by the *global* batch size
    makes the sum of every rank's loss exactly the mean loss of one dense
    step on the whole batch, even when ranks hold different numbers of
    samples. The sharded tables' backward already adds up every rank's
    contribution, so this scaling is what makes their gradients the dense
    gradients; the MLP's gradients become them after :func:`sync_dense_grads`.
    """
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_batch


def sync_dense_grads(model: RecModel, loss: torch.Tensor, group: shardwise.Group) -> float:
    """Sum the MLP's gradients over ``group`` and return the global batch's mean loss.

    Every rank holds the whole MLP; the one all-reduce of
    :func:`_training.sum_grads_and_loss` makes each rank's gradient the
    full-batch one and brings the loss along.

    Args:
        model: The model, after ``backward``.
        loss: This rank's :func:`batch_loss`.
        group: The group the tables are sharded over.

    Returns:
        The mean loss over the global batch (the same on every rank).
    """
    return sum_grads_and_loss([p for p in model.mlp.parameters() if p.requires_grad], loss, group)
