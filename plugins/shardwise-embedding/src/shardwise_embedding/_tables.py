"""Embedding-bag tables and their dense collection, under TorchRec's names.

:class:`EmbeddingBagConfig` describes one table (its rows, its dim, the
features looked up in it, how bags are pooled); :class:`EmbeddingBagCollection`
is an ordinary ``nn.Module`` holding one ``nn.EmbeddingBag`` per table. It is
the dense reference the sharded collection equals, and what
:func:`~shardwise_embedding.shard_collection` takes its tables' values from.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from shardwise_embedding._jagged import KeyedJaggedTensor
from shardwise_embedding._keyed_tensor import KeyedTensor

__all__ = ["EmbeddingBagCollection", "EmbeddingBagConfig", "PoolingType", "TableDict", "check_tables", "feature_order"]


class PoolingType(str, enum.Enum):
    """How a bag's rows are pooled: their (weighted) sum or their mean."""

    SUM = "sum"
    MEAN = "mean"


@dataclasses.dataclass(frozen=True)
class EmbeddingBagConfig:
    """One embedding table and the features looked up in it.

    Args:
        name: The table's name (a key of the state dict: ``embedding_bags.<name>.weight``).
        embedding_dim: Columns of the table.
        num_embeddings: Rows of the table: ids ``0 .. num_embeddings - 1``.
        feature_names: The features (keys of the input) whose bags are
            pooled from this table; several features may share one table.
        pooling: ``"sum"`` (weighted by per-id weights, if any) or ``"mean"``.
        dtype: The table's element type.
    """

    name: str
    embedding_dim: int
    num_embeddings: int
    feature_names: Sequence[str]
    pooling: Union[str, PoolingType] = "sum"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if isinstance(self.feature_names, str):
            raise TypeError(
                f"table {self.name!r}: feature_names must be a list of names, got the string {self.feature_names!r}"
            )
        object.__setattr__(self, "feature_names", tuple(str(f) for f in self.feature_names))
        try:
            pooling = PoolingType(getattr(self.pooling, "value", self.pooling))
        except ValueError:
            raise ValueError(f"table {self.name!r}: pooling must be 'sum' or 'mean', got {self.pooling!r}") from None
        object.__setattr__(self, "pooling", pooling.value)
        if not self.name or not isinstance(self.name, str) or "." in self.name:
            raise ValueError(f"a table's name must be a non-empty string without '.', got {self.name!r}")
        for field in ("embedding_dim", "num_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"table {self.name!r}: {field} must be an int >= 1, got {value!r}")
        if not self.feature_names:
            raise ValueError(f"table {self.name!r} has no feature_names: name the features looked up in it")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table {self.name!r} names a feature twice: {list(self.feature_names)}")
        if not (self.dtype.is_floating_point or self.dtype.is_complex):
            raise ValueError(f"table {self.name!r}: dtype must be a floating type, got {self.dtype}")

    @property
    def bytes(self) -> int:
        """The table's size in bytes."""
        return self.num_embeddings * self.embedding_dim * self.dtype.itemsize


def check_tables(tables: Sequence[EmbeddingBagConfig]) -> None:
    """Distinct table names, and each feature in exactly one table.

    Raises:
        TypeError: an entry is not an EmbeddingBagConfig.
        ValueError: two tables of one name, or two tables claiming one feature.
    """
    owner: dict[str, str] = {}
    names: set[str] = set()
    for t in tables:
        if not isinstance(t, EmbeddingBagConfig):
            raise TypeError(f"tables must be EmbeddingBagConfig, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"two tables are named {t.name!r}: table names must be distinct")
        names.add(t.name)
        for f in t.feature_names:
            if f in owner:
                raise ValueError(
                    f"feature {f!r} is claimed by tables {owner[f]!r} and {t.name!r}: a feature is pooled from "
                    "one table (its output key is the feature's name). Features may share a table (list them "
                    "in one table's feature_names); to pool the same ids from two tables, give the input a "
                    "second key with the same bags and list one key in each table"
                )
            owner[f] = t.name


def feature_order(tables: Sequence[EmbeddingBagConfig]) -> list[tuple[str, EmbeddingBagConfig]]:
    """Every feature with its table, in output order: table by table, each table's features in order."""
    return [(f, t) for t in tables for f in t.feature_names]


def check_input(kjt: Any, features: Sequence[str]) -> None:
    """The input is a KeyedJaggedTensor whose keys are exactly the collection's features.

    Raises:
        TypeError: not a KeyedJaggedTensor.
        KeyError: a key with no table, or a feature the input lacks.
    """
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"the input must be a KeyedJaggedTensor, got {type(kjt).__name__}")
    keys = kjt.keys()
    unknown = [k for k in keys if k not in features]
    if unknown:
        raise KeyError(
            f"input features {unknown} have no table (the tables' features are {list(features)}); "
            "add them to a table's feature_names or drop them from the input (kjt.select([...]))"
        )
    missing = [f for f in features if f not in keys]
    if missing:
        raise KeyError(f"the input lacks features {missing}: give every feature a (possibly empty) bag per sample")


def check_weights_pooling(kjt: KeyedJaggedTensor, tables: Sequence[EmbeddingBagConfig]) -> None:
    """Per-id weights only with sum pooling, as ``nn.EmbeddingBag``.

    Raises:
        ValueError: the input has weights and some table pools by mean.
    """
    if kjt.weights_or_none() is None:
        return
    means = [t.name for t in tables if t.pooling == "mean"]
    if means:
        raise ValueError(
            f"the input has per-id weights but tables {means} pool by mean; like nn.EmbeddingBag, "
            "weights need pooling='sum'"
        )


class TableDict(nn.ModuleDict):
    """A ModuleDict that takes any table name, also one of its own attributes (``items``, ``keys``, ``update``).

    ``nn.ModuleDict`` refuses a key that names one of its methods, and
    "items" is a natural name for a recommendation model's table. Entries
    are read by key (``tables["items"]``), never as attributes, so they are
    stored directly.
    """

    def __setitem__(self, key: str, module: nn.Module) -> None:
        if not isinstance(key, str) or not key or "." in key:
            raise KeyError(f"a table name must be a non-empty string without '.', got {key!r}")
        self._modules[key] = module


class EmbeddingBagCollection(nn.Module):
    """Many embedding-bag tables, dense on one process: the reference a sharded collection equals.

    ``forward(kjt)`` pools each feature's bags from its table and returns a
    :class:`KeyedTensor` whose keys are the features, table by table, each
    table's features in order (the order TorchRec uses).

    Args:
        tables: The tables.
        device: Where to create the tables (``"meta"`` works, for planning only).

    Example:
        >>> ebc = EmbeddingBagCollection([
        ...     EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"]),
        ...     EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"]),
        ... ])
        >>> ebc(kjt).values().shape          # [batch, 8 + 4 + 4]
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__()
        tables = list(tables)
        check_tables(tables)
        self._tables = tables
        self.embedding_bags = TableDict()
        for t in tables:
            self.embedding_bags[t.name] = nn.EmbeddingBag(
                t.num_embeddings, t.embedding_dim, mode=t.pooling, dtype=t.dtype, device=device
            )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The tables, in order."""
        return list(self._tables)

    def _weight(self, name: str) -> torch.Tensor:
        bag = self.embedding_bags[name]
        assert isinstance(bag, nn.EmbeddingBag)
        return bag.weight

    def feature_names(self) -> list[str]:
        """The output keys, in order."""
        return [f for f, _ in feature_order(self._tables)]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags from its table (per-id weights in the table's dtype).

        Raises:
            KeyError: an input key with no table, or a feature missing.
            IndexError: an id outside its table's rows.
        """
        order = feature_order(self._tables)
        names = [f for f, _ in order]
        check_input(features, names)
        check_weights_pooling(features, self._tables)
        pooled = []
        for f, t in order:
            bags = features[f]
            ids, weights = bags.values(), bags.weights_or_none()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.num_embeddings):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise IndexError(f"feature {f!r}: id {bad} is out of table {t.name!r}'s rows 0..{t.num_embeddings - 1}")
            weight = self._weight(t.name)
            pooled.append(
                F.embedding_bag(
                    ids,
                    weight,
                    bags.offsets()[:-1],
                    mode=t.pooling,
                    per_sample_weights=None if weights is None else weights.to(t.dtype),
                )
            )
        values = torch.cat(pooled, dim=1) if pooled else torch.empty(features.stride(), 0)
        return KeyedTensor(names, [t.embedding_dim for _, t in order], values)
