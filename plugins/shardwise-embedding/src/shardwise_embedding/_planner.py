"""The embedding sharding planner: which sharding each table of a collection gets, and why.

:class:`EmbeddingShardingPlanner` places tables one at a time, largest first.
For each table it prices every allowed layout (``data_parallel``,
``table_wise`` on a few of the least loaded ranks, ``row_wise`` over all
ranks, ``table_row_wise`` over a host, ``column_wise`` over the least loaded
ranks, ``grid``) and keeps the one that leaves the busiest rank least busy
while every rank stays within its memory budget; when that greedy pass runs
out of memory, a second pass places tables to balance memory instead.

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
  gradients back; ``table_row_wise`` (and ``grid`` over hosts) first reduces
  the partials within the host, so each other rank gets one vector instead of
  one per owner;
* lookups: an owner pools its share of every rank's ids, reading at least a
  64-byte line per row;
* ``data_parallel``: no ids or vectors move, but the gradient of the whole
  table is all-reduced (2 × its bytes out and in);
* time = (bytes sent + received) / bandwidth (intra-host or cross-host)
  + bytes of rows looked up / lookup bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence, Union

from shardwise_embedding._explain import human_bytes
from shardwise_embedding._plan_data import (
    SHARDING_TYPES,
    EmbeddingShardingPlan,
    PlanError,
    RankLoad,
    TablePlan,
    chunks,
    make_blocks,
)
from shardwise_embedding._tables import EmbeddingBagCollection, EmbeddingBagConfig, check_tables

__all__ = ["OPTIMIZER_STATES", "EmbeddingShardingPlanner", "ParameterConstraints"]

#: Optimizer state per weight element (``rowwise_adagrad`` keeps one value per row instead).
OPTIMIZER_STATES: Mapping[str, float] = {"sgd": 0.0, "adagrad": 1.0, "rowwise_adagrad": 0.0, "adam": 2.0}
_ORDER = {name: i for i, name in enumerate(SHARDING_TYPES)}
_ID_BYTES = 8  # ids and lengths travel as int64
_LINE = 64  # a looked-up row costs at least one cache line
# Per-rank sums kept for a layout: bytes sent / received within the host and across hosts, rows looked
# up, bytes read by those lookups. An owner's entry also carries its memory (index _MEM).
_S_IN, _R_IN, _S_X, _R_X, _LOOK, _READ, _MEM = range(7)


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
        cap = self.max_bytes_per_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise PlanError(f"max_bytes_per_rank must be an int >= 1, got {cap!r}")
        pf = self.pooling_factor
        if pf is not None and (isinstance(pf, bool) or not isinstance(pf, (int, float)) or not 0 <= pf < math.inf):
            raise PlanError(f"pooling_factor must be a number >= 0, got {pf!r}")


@dataclasses.dataclass
class _Table:
    """One table with what its prices need, worked out once."""

    cfg: EmbeddingBagConfig
    n: int
    d: int
    s: int
    bags: int  # bags per rank and step: batch x features
    pooling: float
    full: int  # bytes of the whole table with optimizer state
    types: tuple[str, ...]
    ranks: list[int]  # allowed ranks
    cap: Optional[int]
    min_cols: int
    constrained: bool


# A layout: (sharding type, ranks in block order, column blocks, column groups). A group is (owner ranks,
# their row counts, its columns, whether its partial vectors are reduced within the host first).
_Group = tuple[list[int], list[int], int, bool]
_Layout = tuple[str, list[int], int, list[_Group]]


class _NoFit(Exception):
    def __init__(self, table: _Table, free: int) -> None:
        self.table, self.free = table, free


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
        min_column_width: Column blocks are at least this wide (narrower
            ones when a table's constraints name only column-cut types).
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
        min_column_width: int = 32,
        intra_host_bandwidth: float = 50e9,
        cross_host_bandwidth: float = 12.5e9,
        lookup_bandwidth: float = 100e9,
    ) -> None:
        for name, value in (("world_size", world_size), ("batch_size", batch_size), ("min_column_width", min_column_width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be an int >= 1, got {value!r}")
        for name, opt in (("ranks_per_host", ranks_per_host), ("memory_budget_bytes", memory_budget_bytes)):
            if opt is not None and (isinstance(opt, bool) or not isinstance(opt, int) or opt < 1):
                raise PlanError(f"{name} must be an int >= 1 or None, got {opt!r}")
        for name, bw in (("intra", intra_host_bandwidth), ("cross", cross_host_bandwidth), ("lookup", lookup_bandwidth)):
            if not 0 < bw < math.inf:
                raise PlanError(f"{name} bandwidth must be a positive number of bytes per second, got {bw!r}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise PlanError(f"unknown optimizer_state {optimizer_state!r}; valid: {', '.join(OPTIMIZER_STATES)}")
        self.constraints = dict(constraints or {})
        for name, c in self.constraints.items():
            if not isinstance(c, ParameterConstraints):
                raise PlanError(f"constraints[{name!r}] must be a ParameterConstraints, got {type(c).__name__}")
        self.pooling_factors = {k: float(ParameterConstraints(pooling_factor=v).pooling_factor or 0.0)
                                for k, v in (pooling_factors or {}).items()}  # fmt: skip
        ParameterConstraints(pooling_factor=default_pooling_factor)  # validates it
        self.world_size = world_size
        self.ranks_per_host = None if ranks_per_host is None else min(ranks_per_host, world_size)
        self.memory_budget_bytes = memory_budget_bytes
        self.batch_size, self.default_pooling_factor = batch_size, float(default_pooling_factor)
        self.optimizer_state, self.min_column_width = optimizer_state, min_column_width
        self.bandwidths = (float(intra_host_bandwidth), float(cross_host_bandwidth), float(lookup_bandwidth))
        per = self.ranks_per_host or world_size
        self._host_of = [r // per for r in range(world_size)]
        self._hosts = [list(range(h, min(h + per, world_size))) for h in range(0, world_size, per)]

    # -- prices ---------------------------------------------------------------------------------------
    def _bytes(self, t: _Table, rows: int, cols: int) -> int:
        state = rows * t.s if self.optimizer_state == "rowwise_adagrad" else 0
        return rows * cols * t.s + int(rows * cols * t.s * OPTIMIZER_STATES[self.optimizer_state]) + state

    def _time(self, v: Sequence[float]) -> float:
        bi, bx, bl = self.bandwidths
        return (v[_S_IN] + v[_R_IN]) / bi + (v[_S_X] + v[_R_X]) / bx + v[_READ] / bl

    def _effect(self, t: _Table, kind: str, groups: list[_Group]) -> tuple[list[list[float]], dict[int, list[float]]]:
        """What a layout adds: per host, to each of its ranks; per owner, on top of its host's entry."""
        world, host_of, nh = self.world_size, self._host_of, len(self._hosts)
        base = [[0.0] * 6 for _ in range(nh)]
        owners: dict[int, list[float]] = {}
        if kind == "data_parallel":
            reduce = 2.0 * t.n * t.d * t.s * (world - 1) / world  # a ring all-reduce of the gradient
            look = float(t.bags * t.pooling)
            for b in base:
                b[_S_X if nh > 1 else _S_IN] = b[_R_X if nh > 1 else _R_IN] = reduce
                b[_LOOK], b[_READ] = look, look * max(t.d * t.s, _LINE)
            return base, owners
        for ranks, rows, cols, hier in groups:
            k = len(ranks)
            vec = float(t.bags * cols * t.s)  # one rank's pooled vectors of these columns
            pair = vec / k if hier else vec  # what an owner and a rank swap each way (vectors, gradients)
            xs = [t.bags * (t.pooling * r / t.n + 1) * _ID_BYTES for r in rows]
            ids_on, owners_on = [0.0] * nh, [0] * nh
            for j, x in zip(ranks, xs, strict=True):
                ids_on[host_of[j]] += x
                owners_on[host_of[j]] += 1
            total = sum(xs)
            for h, b in enumerate(base):  # every rank as a sender of ids and receiver of vectors
                b[_S_IN] += ids_on[h] + owners_on[h] * pair
                b[_R_IN] += owners_on[h] * pair
                b[_S_X] += total - ids_on[h] + (k - owners_on[h]) * pair
                b[_R_X] += (k - owners_on[h]) * pair
            # Within the host: reduce-scatter the partials forward, all-gather their gradients backward.
            within = 2.0 * (k - 1) / k * world * vec if hier else 0.0
            width = max(cols * t.s, _LINE)
            for j, x, r in zip(ranks, xs, rows, strict=True):
                local = len(self._hosts[host_of[j]])
                look = world * t.bags * t.pooling * r / t.n
                e = owners.setdefault(j, [0.0] * 7)
                # An owner sends no ids to itself and swaps no vectors with itself (the host entry counted it).
                e[_S_IN] += (local - 1) * pair - x - pair + within
                e[_R_IN] += (local - 1) * (x + pair) - pair + within
                e[_S_X] += (world - local) * pair
                e[_R_X] += (world - local) * (x + pair)
                e[_LOOK] += look
                e[_READ] += look * width
                e[_MEM] += self._bytes(t, r, cols)
        return base, owners

    # -- layouts --------------------------------------------------------------------------------------
    def _layouts(self, t: _Table, cost: list[float], mem: list[int]) -> list[_Layout]:
        budget, world = self.memory_budget_bytes, self.world_size
        allowed = set(t.ranks)
        by_load = sorted(t.ranks, key=lambda r: (cost[r], mem[r], r))
        out: list[_Layout] = []

        def rows_over(kind: str, ranks: list[int], hier: bool) -> None:
            # A table with fewer rows than ranks goes to its least loaded ones.
            ranks = sorted(sorted(ranks, key=lambda r: (cost[r], r))[: t.n]) if t.n < len(ranks) else ranks
            if len(ranks) > 1:
                cuts = [b - a for a, b in chunks(t.n, len(ranks))]
                out.append((kind, ranks, 1, [(ranks[: len(cuts)], cuts, t.d, hier)]))

        if "data_parallel" in t.types and len(allowed) == world:
            out.append(("data_parallel", list(range(world)), 1, []))
        if "table_wise" in t.types:
            room = [r for r in by_load if budget is None or mem[r] + t.full <= budget]
            picks = room[:3] + sorted(room, key=lambda r: (mem[r], cost[r], r))[:1]
            for r in dict.fromkeys(picks):
                out.append(("table_wise", [r], 1, [([r], [t.n], t.d, False)]))
        if "row_wise" in t.types:
            rows_over("row_wise", sorted(allowed), False)
        hosts = [[r for r in h if r in allowed] for h in self._hosts]
        hosts = [h for h in hosts if len(h) > 1]
        if "table_row_wise" in t.types and (len(self._hosts) > 1 or "row_wise" not in t.types):
            light = sorted(hosts, key=lambda h: max(cost[r] for r in h))[:2]
            light += sorted(hosts, key=lambda h: max(mem[r] for r in h))[:1]
            for h in {tuple(h): h for h in light}.values():
                rows_over("table_row_wise", h, len(self._hosts) > 1)
        splits = [c for c in (2, 4, 8, 16, 32, 64, 128, 256) if c <= t.d // t.min_cols]
        if "column_wise" in t.types:
            top = min(len(allowed), t.d // t.min_cols)
            for k in sorted({c for c in splits if c <= top} | ({top} if top > 1 else set())):
                need = self._bytes(t, t.n, -(-t.d // k))
                fit = [r for r in by_load if budget is None or mem[r] + need <= budget][:k]
                if len(fit) == k:
                    cols = [b - a for a, b in chunks(t.d, k)]
                    out.append(("column_wise", sorted(fit), k, [([r], [t.n], c, False) for r, c in zip(sorted(fit), cols)]))
        if "grid" in t.types:
            full = [h for h in hosts if len(h) == len(self._hosts[0])]
            full.sort(key=lambda h: max(cost[r] for r in h))
            for c in splits:
                if len(self._hosts) > 1:  # each column block row-wise over one host
                    groups, hier = full[:c] if len(full) >= c else [], True
                else:  # one host: each column block row-wise over a slice of its ranks
                    per = len(by_load) // c
                    least = sorted(by_load[: c * per]) if per > 1 else []
                    groups, hier = [least[i * per : (i + 1) * per] for i in range(c)] if least else [], False
                if not groups:
                    continue
                cuts = [b - a for a, b in chunks(t.n, len(groups[0]))]
                cols = [b - a for a, b in chunks(t.d, c)]
                out.append(("grid", [r for g in groups for r in g], c,
                            [(g[: len(cuts)], cuts, w, hier) for g, w in zip(groups, cols)]))  # fmt: skip
        return out

    def _smallest_share(self, t: _Table) -> tuple[int, str]:
        """The fewest bytes any allowed layout puts on one rank, with empty ranks: why a table cannot fit."""
        best = (self._bytes(t, t.n, t.d), "the whole table on one rank")
        a = len(t.ranks)
        host = max(len([r for r in h if r in set(t.ranks)]) for h in self._hosts)
        top = min(a, t.d // t.min_cols)
        options = {
            "row_wise": (-(-t.n // a), t.d, f"row_wise over {a} ranks"),
            "table_row_wise": (-(-t.n // host), t.d, f"table_row_wise over {host} ranks"),
            "column_wise": (t.n, -(-t.d // max(top, 1)), f"column_wise in {top} blocks"),
            "grid": (-(-t.n // max(a // max(top, 1), 1)), -(-t.d // max(top, 1)), f"grid over {a} ranks"),
        }
        for kind, (rows, cols, text) in options.items():
            if kind in t.types and self._bytes(t, rows, cols) < best[0]:
                best = (self._bytes(t, rows, cols), text)
        return best

    # -- placing --------------------------------------------------------------------------------------
    def _place(self, tables: list[_Table], by_memory: bool) -> tuple[dict[str, tuple[_Layout, str]], list[list[float]]]:
        world, host_of, budget = self.world_size, self._host_of, self.memory_budget_bytes
        cost, mem = [0.0] * world, [0] * world
        sums = [[0.0] * 3 for _ in range(world)]  # sent, received, looked up
        chosen: dict[str, tuple[_Layout, str]] = {}
        for t in sorted(tables, key=lambda t: -t.full):
            best: Optional[tuple[tuple[float, ...], _Layout, list[list[float]], dict[int, list[float]]]] = None
            for layout in self._layouts(t, cost, mem):
                base, owners = self._effect(t, layout[0], layout[3])
                if layout[0] == "data_parallel":
                    adds = dict.fromkeys(range(world), t.full)
                else:
                    adds = {r: int(e[_MEM]) for r, e in owners.items()}
                if any((budget is not None and mem[r] + b > budget) or (t.cap is not None and b > t.cap)
                       for r, b in adds.items()):  # fmt: skip
                    continue
                step = [self._time(b) for b in base]
                new = [c + step[h] for c, h in zip(cost, host_of)]
                for r, e in owners.items():
                    new[r] += self._time(e)
                top, spread = float(f"{max(new):.9g}"), float(f"{sum(v * v for v in new):.9g}")
                key: tuple[float, ...] = (top, spread, _ORDER[layout[0]], layout[1][0])
                if by_memory:
                    key = (max(mem[r] + b for r, b in adds.items()), *key)
                if best is None or key < best[0]:
                    best = (key, layout, base, owners)
            if best is None:
                raise _NoFit(t, max((budget or 0) - m for m in mem))
            _, layout, base, owners = best
            for r in range(world):
                b, e = base[host_of[r]], owners.get(r)
                tot = [x + y for x, y in zip(b, e)] if e else b
                sums[r][0] += tot[_S_IN] + tot[_S_X]
                sums[r][1] += tot[_R_IN] + tot[_R_X]
                sums[r][2] += tot[_LOOK]
                cost[r] += self._time(tot)
                mem[r] += t.full if layout[0] == "data_parallel" else int(e[_MEM]) if e else 0
            chosen[t.cfg.name] = (layout, self._reason(t, layout, base, owners))
        return chosen, [[*s, m] for s, m in zip(sums, mem)]

    def _reason(self, t: _Table, layout: _Layout, base: list[list[float]], owners: dict[int, list[float]]) -> str:
        kind, ranks, c, groups = layout
        size = human_bytes(t.full)
        budget = self.memory_budget_bytes
        limit = min(x for x in (budget, t.cap) if x is not None) if budget or t.cap else None
        why = f"{size}: "
        if limit is not None and t.full > limit:
            what = "its per-rank cap" if t.cap is not None and t.cap == limit else "one rank's budget"
            why = f"{size}: too big for {what} of {human_bytes(limit)}; "
        elif "table_wise" not in t.types:
            why = f"{size}: constraints allow {', '.join(t.types)}; "
        share = human_bytes(max((e[_MEM] for e in owners.values()), default=0))
        if kind == "data_parallel":
            if self.world_size == 1:
                return f"{size}: the only rank holds it whole; nothing to exchange"
            moved = human_bytes(base[0][_S_IN] + base[0][_S_X])
            return f"{why}replicated on every rank, no exchange of ids or vectors, only a {moved} gradient all-reduce"
        if kind == "table_wise":
            return f"{why}whole on rank {ranks[0]}, the cheapest rank{' with room' if budget else ''}"
        if kind == "row_wise":
            return f"{why}row-wise over {len(owners)} ranks spreads it ({share} each) and its lookups"
        if kind == "table_row_wise":
            host = self._host_of[ranks[0]]
            local = "; vectors are summed on the host before crossing hosts" if groups[0][3] else ""
            return f"{why}row-wise within host {host} over {len(owners)} ranks ({share} each){local}"
        if kind == "column_wise":
            return f"{why}{c} column blocks of ~{t.d // c} of its {t.d} columns ({share} each): each rank gets slices"
        return f"{why}a grid of {c} column blocks, each row-wise over {len(groups[0][0])} ranks ({share} each)"

    # -- the plan -------------------------------------------------------------------------------------
    def _tables(self, configs: list[EmbeddingBagConfig]) -> list[_Table]:
        names = {c.name for c in configs}
        unknown = sorted((set(self.constraints) | set(self.pooling_factors)) - names)
        if unknown:
            raise PlanError(f"constraints or pooling factors name tables {unknown} the collection lacks: {sorted(names)}")
        out = []
        for cfg in configs:
            con = self.constraints.get(cfg.name, ParameterConstraints())
            bad = [r for r in con.ranks or () if r >= self.world_size]
            if bad:
                raise PlanError(f"table {cfg.name!r}: constraint ranks {bad} are not ranks of a world of {self.world_size}")
            pooling = con.pooling_factor
            if pooling is None:
                pooling = self.pooling_factors.get(cfg.name, self.default_pooling_factor)
            types = tuple(con.sharding_types or SHARDING_TYPES)
            # A user who allows only column cuts gets them even on a narrow table.
            narrow = con.sharding_types is not None and not {"table_wise", "row_wise", "table_row_wise"} & set(types)
            t = _Table(cfg, cfg.num_embeddings, cfg.embedding_dim, cfg.dtype.itemsize,
                       self.batch_size * len(cfg.feature_names), float(pooling), 0, types,
                       list(con.ranks or range(self.world_size)), con.max_bytes_per_rank,
                       1 if narrow else self.min_column_width, con.sharding_types is not None)  # fmt: skip
            t.full = self._bytes(t, t.n, t.d)
            out.append(t)
        return out

    def _too_big(self, t: _Table, free: Optional[int] = None) -> str:
        share, layout = self._smallest_share(t)
        limits = [f"the budget of {human_bytes(self.memory_budget_bytes)} per rank"] if self.memory_budget_bytes else []
        limits += [f"its max_bytes_per_rank of {human_bytes(t.cap)}"] if t.cap is not None else []
        where = f"no rank has that much room left after the larger tables ({human_bytes(max(free, 0))} at most)"
        fixes = ["raise memory_budget_bytes"] + ([] if "row_wise" in t.types else ["allow row_wise for it"])
        fixes += ["plan for more ranks" if len(t.ranks) == self.world_size else "pin it to more ranks"]
        return (
            f"table {t.cfg.name!r} ({human_bytes(t.full)}, {t.n} x {t.d}) fits no allowed layout "
            f"({', '.join(t.types)}): the smallest share on one rank is {human_bytes(share)} ({layout}), "
            f"{where if free is not None else 'over ' + ' and '.join(limits)}; {', '.join(fixes)}"
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
        too_big = []
        for t in items:
            limit = min(x for x in (self.memory_budget_bytes, t.cap, 1 << 62) if x is not None)
            if self._smallest_share(t)[0] > limit or not self._layouts(t, [0.0] * self.world_size, [0] * self.world_size):
                too_big.append(t)
        if too_big:
            raise PlanError("; ".join(self._too_big(t) for t in too_big))
        notes = []
        try:
            chosen, loads = self._place(items, by_memory=False)
        except _NoFit:
            try:
                chosen, loads = self._place(items, by_memory=True)
            except _NoFit as exc:
                raise PlanError(self._too_big(exc.table, exc.free)) from None
            notes.append("placed to balance memory: placing for speed did not fit the memory budget")
        plans = []
        for cfg in configs:
            (kind, ranks, c, _), reason = chosen[cfg.name]
            blocks = make_blocks(kind, cfg.num_embeddings, cfg.embedding_dim, ranks, column_blocks=c)
            held = tuple(range(self.world_size)) if kind == "data_parallel" else tuple(b.rank for b in blocks)
            plans.append(TablePlan(cfg.name, kind, held, cfg.num_embeddings, cfg.embedding_dim, blocks, reason))
        pooled = ", ".join(f"{t.cfg.name} {t.pooling:g}" for t in items if t.pooling != self.default_pooling_factor)
        gb = [f"{b / 1e9:g} GB/s" for b in self.bandwidths]
        notes[:0] = [
            f"assumed per step: batch {self.batch_size} per rank; mean ids per bag {self.default_pooling_factor:g}"
            + (f" ({pooled})" if pooled else "") + f"; optimizer state {self.optimizer_state}",
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
