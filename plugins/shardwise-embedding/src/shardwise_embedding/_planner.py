"""The embedding sharding planner: which sharding each table of a collection gets, and why.

:class:`EmbeddingShardingPlanner` places tables one at a time, largest
(bytes with optimizer state) first. For each table it prices the allowed
layouts on the ranks that suit them (``table_wise`` on the least loaded
ranks, ``data_parallel`` on all, ``row_wise`` over all ranks,
``table_row_wise`` over one of the least loaded hosts, ``column_wise`` and
``grid`` in 2, 4, 8 ... column blocks of at least ``min_column_width``
columns) and keeps the one that fits every rank's memory budget and leaves
the busiest rank least busy, then the load most even (sum of squares), then
the earliest in :data:`SHARDING_TYPES`. When that pass runs out of memory a
second one places tables to balance memory first. Pricing a layout costs
O(hosts + ranks holding it), and a lower bound skips layouts that cannot win.

Cost model, per rank and training step (``batch_size`` samples on every rank,
``pooling_factor`` ids per bag, ``itemsize`` bytes per element):

* memory: the rows and columns a rank holds × (1 + optimizer state: sgd 0,
  adagrad 1, rowwise_adagrad one value per row, adam 2); ``data_parallel``:
  the whole table on every rank;
* ids: every rank sends each owner of a table the ids that fall in its rows
  (uniform ids assumed) plus every bag's length, int64 (8 bytes) each; each
  column block's owners get the ids anew;
* vectors: each owner sends every rank its partial pooled vectors
  (``batch × features × block columns × itemsize``) and gets their
  gradients back, as the collection's single output exchange does (no
  partial sums within a host first): fewer owners per column block means
  fewer vectors;
* lookups: an owner pools its share of every rank's ids, reading at least a
  64-byte line per row;
* ``data_parallel``: no ids or vectors move, but the gradient of the whole
  table is all-reduced (a ring: 2 × its bytes × (ranks - 1) / ranks out, as
  much in);
* time = (bytes sent + received) / bandwidth (intra-host or cross-host)
  + bytes of rows looked up / lookup bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence, Union

from shardwise_embedding._explain import human_bytes
from shardwise_embedding._placement import OPTIMIZER_STATES, _S_IN, _S_X, Layout, NoFit, Placer, Table
from shardwise_embedding._plan_data import (
    SHARDING_TYPES,
    EmbeddingShardingPlan,
    PlanError,
    RankLoad,
    TablePlan,
    make_blocks,
)
from shardwise_embedding._tables import EmbeddingBagCollection, EmbeddingBagConfig, check_tables

__all__ = ["OPTIMIZER_STATES", "EmbeddingShardingPlanner", "ParameterConstraints"]


def _check_int(what: str, value: object, optional: bool = False) -> None:
    if not (optional and value is None) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PlanError(f"{what} must be an int >= 1{' or None' if optional else ''}, got {value!r}")


def _check_pooling(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise PlanError(f"{what} must be a number >= 0 (mean ids per bag), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ParameterConstraints:
    """What the planner may do with one table (TorchRec's name).

    Attributes:
        sharding_types: The sharding types allowed for it (None: any).
        ranks: The only ranks it may be placed on (None: any). A
            ``data_parallel`` table is on every rank, so pinning rules it out.
        max_bytes_per_rank: The most bytes (optimizer state included) of it
            any one rank may hold.
        pooling_factor: Mean ids per bag of its features (overrides the
            planner's ``pooling_factors``).
    """

    sharding_types: Optional[Sequence[str]] = None
    ranks: Optional[Sequence[int]] = None
    max_bytes_per_rank: Optional[int] = None
    pooling_factor: Optional[float] = None

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            types = (self.sharding_types,) if isinstance(self.sharding_types, str) else tuple(self.sharding_types)
            bad = [t for t in types if t not in SHARDING_TYPES]
            if bad or not types:
                raise PlanError(f"unknown sharding types {bad or '(none given)'}; valid: {', '.join(SHARDING_TYPES)}")
            object.__setattr__(self, "sharding_types", types)
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
                raise PlanError(f"constraint ranks must be a non-empty list of ints >= 0, got {list(ranks)}")
            object.__setattr__(self, "ranks", tuple(sorted(set(ranks))))
        _check_int("max_bytes_per_rank", self.max_bytes_per_rank, optional=True)
        if self.pooling_factor is not None:
            _check_pooling("pooling_factor", self.pooling_factor)


class EmbeddingShardingPlanner:
    """Chooses each table's sharding for a world of ranks (see the module's cost model).

    Args:
        world_size: Ranks of the group the collection will be sharded over.
        ranks_per_host: Ranks per host; hosts are consecutive ranks, the last
            may be smaller (None: one host).
        memory_budget_bytes: The most bytes of tables and optimizer state any
            rank may hold (None: no limit).
        constraints: Per table name, a :class:`ParameterConstraints`.
        batch_size: Samples per rank and step the costs assume.
        pooling_factors: Per table name, mean ids per bag.
        default_pooling_factor: Mean ids per bag of the other tables.
        optimizer_state: One of :data:`OPTIMIZER_STATES`: how much state the
            optimizer keeps per weight.
        min_column_width: Column blocks are at least this wide (TorchRec's
            default too), so only tables twice as wide are cut by columns;
            any width when a table's constraints allow only column cuts.
        intra_host_bandwidth: Bytes per second a rank moves within its host.
        cross_host_bandwidth: Bytes per second a rank moves across hosts.
        lookup_bandwidth: Bytes per second a rank reads rows at.

    Raises:
        PlanError: an argument out of range.

    Example:
        >>> plan = EmbeddingShardingPlanner(8, memory_budget_bytes=2 << 30).plan(ebc)
        >>> print(plan.explain())
    """

    def __init__(
        self,
        world_size: int,
        ranks_per_host: Optional[int] = None,
        memory_budget_bytes: Optional[int] = None,
        constraints: Optional[Mapping[str, ParameterConstraints]] = None,
        *,
        batch_size: int = 512,
        pooling_factors: Optional[Mapping[str, float]] = None,
        default_pooling_factor: float = 1.0,
        optimizer_state: str = "adagrad",
        min_column_width: int = 128,
        intra_host_bandwidth: float = 50e9,
        cross_host_bandwidth: float = 12.5e9,
        lookup_bandwidth: float = 100e9,
    ) -> None:
        for name, value in (
            ("world_size", world_size),
            ("batch_size", batch_size),
            ("min_column_width", min_column_width),
        ):
            _check_int(name, value)
        _check_int("ranks_per_host", ranks_per_host, optional=True)
        _check_int("memory_budget_bytes", memory_budget_bytes, optional=True)
        self.bandwidths = (float(intra_host_bandwidth), float(cross_host_bandwidth), float(lookup_bandwidth))
        for name, bw in zip(("intra-host", "cross-host", "lookup"), self.bandwidths, strict=True):
            if not 0 < bw < math.inf:
                raise PlanError(f"the {name} bandwidth must be a positive number of bytes per second, got {bw!r}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise PlanError(f"unknown optimizer_state {optimizer_state!r}; valid: {', '.join(OPTIMIZER_STATES)}")
        self.constraints = dict(constraints or {})
        for name, c in self.constraints.items():
            if not isinstance(c, ParameterConstraints):
                raise PlanError(f"constraints[{name!r}] must be a ParameterConstraints, got {type(c).__name__}")
        pooling_factors = pooling_factors or {}
        self.pooling_factors = {k: _check_pooling(f"pooling_factors[{k!r}]", v) for k, v in pooling_factors.items()}
        default_pooling_factor = _check_pooling("default_pooling_factor", default_pooling_factor)
        self.world_size = world_size
        self.ranks_per_host = None if ranks_per_host is None else min(ranks_per_host, world_size)
        self.memory_budget_bytes = memory_budget_bytes
        self.batch_size, self.default_pooling_factor = batch_size, float(default_pooling_factor)
        self.optimizer_state, self.min_column_width = optimizer_state, min_column_width
        self._placer = Placer(world_size, self.ranks_per_host or world_size, memory_budget_bytes, optimizer_state,
                              self.bandwidths)  # fmt: skip

    def _reason(self, t: Table, layout: Layout, base: list[list[float]]) -> str:
        kind, ranks, c, groups = layout
        size = human_bytes(t.full)
        limits = [x for x in (self.memory_budget_bytes, t.cap) if x is not None]
        why = f"{size}: "
        if limits and t.full > min(limits):
            what = "its per-rank cap" if t.cap == min(limits) else "one rank's budget"
            why = f"{size}: too big for {what} of {human_bytes(min(limits))}; "
        elif "table_wise" not in t.types:
            why = f"{size}: constraints allow {', '.join(t.types)}; "
        shares = self._placer.shares(t, layout)
        each = f"{human_bytes(max(shares.values()))} each"
        if kind == "data_parallel":
            if self.world_size == 1:
                return f"{size}: the only rank holds it whole; nothing to exchange"
            moved = human_bytes(base[0][_S_IN] + base[0][_S_X])
            return f"{why}replicated on every rank: no ids or vectors move, only a {moved} gradient all-reduce"
        if kind == "table_wise":
            room = " with room" if self.memory_budget_bytes else ""
            return f"{why}whole on rank {ranks[0]}, the least loaded rank{room}"
        if kind == "row_wise":
            return f"{why}row-wise over {len(shares)} ranks spreads it ({each}) and its lookups"
        if kind == "table_row_wise":
            host = self._placer.host_of[ranks[0]]
            return f"{why}row-wise within host {host} over {len(shares)} ranks ({each}): fewer partial vectors per bag"
        if kind == "column_wise":
            return f"{why}{c} column blocks of ~{t.d // c} of its {t.d} columns ({each}): smaller vectors to send"
        over = f"{len(groups[0][0])} ranks"
        return f"{why}a grid of {c} column blocks, each row-wise over {over} ({each})"

    # -- the plan -------------------------------------------------------------------------------------
    def _tables(self, configs: list[EmbeddingBagConfig]) -> list[Table]:
        names = {c.name for c in configs}
        unknown = sorted((set(self.constraints) | set(self.pooling_factors)) - names)
        if unknown:
            raise PlanError(f"constraints or pooling factors name tables {unknown} not among {sorted(names)}")
        out = []
        for cfg in configs:
            con = self.constraints.get(cfg.name, ParameterConstraints())
            bad = [r for r in con.ranks or () if r >= self.world_size]
            if bad:
                raise PlanError(f"table {cfg.name!r}: constraint ranks {bad} are outside a world of {self.world_size}")
            pooling = con.pooling_factor
            if pooling is None:
                pooling = self.pooling_factors.get(cfg.name, self.default_pooling_factor)
            types = tuple(con.sharding_types or SHARDING_TYPES)
            # A user who allows only column cuts gets them even on a narrow table.
            narrow = not {"table_wise", "row_wise", "table_row_wise"} & set(types)
            t = Table(cfg, cfg.num_embeddings, cfg.embedding_dim, cfg.dtype.itemsize,
                       self.batch_size * len(cfg.feature_names), float(pooling), 0, types,
                       list(con.ranks or range(self.world_size)), con.max_bytes_per_rank,
                       1 if narrow else self.min_column_width)  # fmt: skip
            t.full = self._placer.held(t, t.n, t.d)
            out.append(t)
        return out

    def _unplaceable(self, t: Table, free: Optional[int] = None) -> Optional[str]:
        """Why ``t`` cannot be placed (on empty ranks, or with ``free`` bytes left at most), or None."""
        limit = min(x for x in (self.memory_budget_bytes, t.cap, 1 << 62) if x is not None)
        if free is None and t.full <= limit and ("table_wise" in t.types or len(t.ranks) == self.world_size):
            return None  # it fits whole on one rank (or everywhere): no need to look further
        zeros = [0] * self.world_size
        layouts = self._placer.layouts(t, [0.0] * self.world_size, zeros, None)
        name = f"table {t.cfg.name!r} ({human_bytes(t.full)}, {t.n} x {t.d})"
        if not layouts:
            return (
                f"{name}: its constraints leave no layout (types {', '.join(t.types)} on ranks {t.ranks}; "
                "data_parallel needs every rank, the others need more ranks than one for a split); widen them"
            )
        share, layout = min((max(self._placer.shares(t, x).values()), x) for x in layouts)
        split = len(self._placer.shares(t, layout))
        how = "whole" if layout[0] in ("data_parallel", "table_wise") else f"{layout[0]} over {split} ranks"
        limits = [f"the budget of {human_bytes(self.memory_budget_bytes)} per rank"] if self.memory_budget_bytes else []
        limits += [f"its max_bytes_per_rank of {human_bytes(t.cap)}"] if t.cap is not None else []
        if free is None and share <= limit:
            return None
        fixes = ["raise memory_budget_bytes"] + ([] if "row_wise" in t.types else ["allow row_wise for it"])
        fixes += ["plan for more ranks" if len(t.ranks) == self.world_size else "pin it to more ranks"]
        where = (
            f"over {' and '.join(limits)}"
            if free is None
            else f"but no rank has that much room left next to the larger tables ({human_bytes(max(free, 0))} at most)"
        )
        return (
            f"{name} fits no allowed layout: the smallest share of it on one rank is {human_bytes(share)} "
            f"({how}), {where}; {', '.join(fixes)}"
        )

    def plan(self, tables: Union[EmbeddingBagCollection, Sequence[EmbeddingBagConfig]]) -> EmbeddingShardingPlan:
        """Choose each table's sharding.

        Args:
            tables: An :class:`EmbeddingBagCollection` or its tables.

        Returns:
            The plan: every table, in the given order, with its reason; the
            per-rank loads the cost model expects; notes saying what it assumed.

        Raises:
            PlanError: constraints that name unknown tables or ranks, or
                tables that fit no allowed layout (naming them, the smallest
                share any layout needs, the budget, and what to change).
        """
        configs = list(tables.embedding_bag_configs() if isinstance(tables, EmbeddingBagCollection) else tables)
        try:
            check_tables(configs)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        items = self._tables(configs)
        problems = [p for p in map(self._unplaceable, items) if p]
        if problems:
            raise PlanError("; ".join(problems))
        need, budget = sum(t.full for t in items), self.memory_budget_bytes
        if budget is not None and need > budget * self.world_size:
            raise PlanError(
                f"the tables need {human_bytes(need)} with optimizer state but {self.world_size} rank(s) x "
                f"{human_bytes(budget)} hold {human_bytes(budget * self.world_size)}: raise memory_budget_bytes, "
                "plan for more ranks, or use a lighter optimizer_state"
            )
        notes = []
        try:
            chosen, loads = self._placer.place(items, by_memory=False)
        except NoFit:
            try:
                chosen, loads = self._placer.place(items, by_memory=True)
            except NoFit as exc:
                raise PlanError(self._unplaceable(exc.table, exc.free)) from None
            notes.append("placed to balance memory: placing for speed did not fit the memory budget")
        plans = []
        for cfg, t in zip(configs, items, strict=True):
            layout, base = chosen[cfg.name]
            kind, ranks, c, _ = layout
            blocks = make_blocks(kind, cfg.num_embeddings, cfg.embedding_dim, ranks, column_blocks=c)
            held = tuple(range(self.world_size)) if kind == "data_parallel" else tuple(b.rank for b in blocks)
            reason = self._reason(t, layout, base)
            plans.append(TablePlan(cfg.name, kind, held, cfg.num_embeddings, cfg.embedding_dim, blocks, reason))
        pooled = ", ".join(f"{t.cfg.name} {t.pooling:g}" for t in items if t.pooling != self.default_pooling_factor)
        gb = [f"{b / 1e9:g} GB/s" for b in self.bandwidths]
        notes[:0] = [
            f"assumed per step: batch {self.batch_size} per rank; mean ids per bag {self.default_pooling_factor:g}"
            + (f" ({pooled})" if pooled else "")
            + f"; optimizer state {self.optimizer_state}",
            f"cost per rank: bytes sent+received / bandwidth (host {gb[0]}, cross-host {gb[1]}) + rows read / {gb[2]}"
            "; ids to owners, pooled vectors back, gradients to owners; data_parallel: gradient all-reduce",
        ]
        plan = EmbeddingShardingPlan(
            world_size=self.world_size,
            tables=tuple(plans),
            ranks_per_host=self.ranks_per_host,
            loads=tuple(RankLoad(r, int(m), round(s), round(v), round(lk)) for r, (s, v, lk, m) in enumerate(loads)),
            memory_budget_bytes=self.memory_budget_bytes,
            notes=tuple(notes),
        )
        plan.check(configs, self.world_size)
        return plan
