"""Placing tables on ranks: the layouts the planner considers, their prices, and its greedy pass.

The cost model is described in :mod:`shardwise_embedding._planner`, which
validates the user's settings and turns what :class:`Placer` chose into a plan.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from shardwise_embedding._plan_data import SHARDING_TYPES, chunks
from shardwise_embedding._tables import EmbeddingBagConfig

__all__ = ["OPTIMIZER_STATES", "Group", "Layout", "NoFit", "Placer", "Table"]

#: Optimizer state per weight element (``rowwise_adagrad`` keeps one value per row instead).
OPTIMIZER_STATES: Mapping[str, float] = {"sgd": 0.0, "adagrad": 1.0, "rowwise_adagrad": 0.0, "adam": 2.0}
_ORDER = {name: i for i, name in enumerate(SHARDING_TYPES)}
_ID_BYTES = 8  # ids and lengths travel as int64
_LINE = 64  # a looked-up row costs at least one cache line
# Per-rank sums kept for a layout: bytes sent / received within the host and across hosts, rows looked
# up, bytes read by those lookups.
_S_IN, _R_IN, _S_X, _R_X, _LOOK, _READ = range(6)


@dataclasses.dataclass
class Table:
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


# A layout: (sharding type, ranks in block order, column blocks, column groups). A group is (owner ranks,
# their row counts, its columns). Every owner sends every rank its own partial vectors: the collection
# has one output exchange, so partials are not summed within a host first.
Group = tuple[list[int], list[int], int]
Layout = tuple[str, list[int], int, list[Group]]


class NoFit(Exception):
    """The greedy pass found no room for ``table``; ``free`` is the most any of its ranks had left."""

    def __init__(self, table: Table, free: int) -> None:
        super().__init__(table.cfg.name)
        self.table, self.free = table, free


class Placer:
    """Prices layouts and places tables for one world of ranks.

    Args:
        world_size: The ranks.
        ranks_per_host: Ranks per host (consecutive ranks; the last host may be smaller).
        budget: The most bytes any rank may hold, or None.
        optimizer_state: A key of :data:`OPTIMIZER_STATES`.
        bandwidths: Bytes per second within a host, across hosts, and of row lookups.
    """

    def __init__(
        self, world_size: int, ranks_per_host: int, budget: Optional[int], optimizer_state: str,
        bandwidths: tuple[float, float, float],
    ) -> None:  # fmt: skip
        self.world_size, self.budget, self.bandwidths = world_size, budget, bandwidths
        self.optimizer_state = optimizer_state
        self.host_of = [r // ranks_per_host for r in range(world_size)]
        self.hosts = [list(range(h, min(h + ranks_per_host, world_size))) for h in range(0, world_size, ranks_per_host)]

    # -- prices ---------------------------------------------------------------------------------------
    def held(self, t: Table, rows: int, cols: int) -> int:
        """Bytes of a block of ``rows`` x ``cols`` of ``t`` with its optimizer state."""
        state = rows * t.s if self.optimizer_state == "rowwise_adagrad" else 0
        return rows * cols * t.s + int(rows * cols * t.s * OPTIMIZER_STATES[self.optimizer_state]) + state

    def time(self, v: Sequence[float]) -> float:
        """Seconds one rank spends on the sums ``v`` (indexed by ``_S_IN`` ... ``_READ``)."""
        bi, bx, bl = self.bandwidths
        return (v[_S_IN] + v[_R_IN]) / bi + (v[_S_X] + v[_R_X]) / bx + v[_READ] / bl

    def effect(self, t: Table, kind: str, groups: list[Group]) -> tuple[list[list[float]], dict[int, list[float]]]:
        """What a layout adds per step: per host, to each of its ranks; per owner, on top of its host's entry."""
        world, host_of, nh = self.world_size, self.host_of, len(self.hosts)
        base = [[0.0] * 6 for _ in range(nh)]
        owners: dict[int, list[float]] = {}
        if kind == "data_parallel":
            reduce = 2.0 * t.n * t.d * t.s * (world - 1) / world  # a ring all-reduce of the gradient
            look = float(t.bags * t.pooling)
            for b in base:
                b[_S_X if nh > 1 else _S_IN] = b[_R_X if nh > 1 else _R_IN] = reduce
                b[_LOOK], b[_READ] = look, look * max(t.d * t.s, _LINE)
            return base, owners
        for ranks, rows, cols in groups:
            k = len(ranks)
            vec = float(t.bags * cols * t.s)  # one rank's pooled vectors of these columns
            pair = vec  # what an owner and a rank swap each way (vectors, gradients)
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
            width = max(cols * t.s, _LINE)
            for j, x, r in zip(ranks, xs, rows, strict=True):
                local = len(self.hosts[host_of[j]])
                look = world * t.bags * t.pooling * r / t.n
                e = owners.setdefault(j, [0.0] * 6)
                # An owner sends no ids to itself and swaps no vectors with itself (its host entry counted it).
                e[_S_IN] += (local - 1) * pair - x - pair
                e[_R_IN] += (local - 1) * (x + pair) - pair
                e[_S_X] += (world - local) * pair
                e[_R_X] += (world - local) * (x + pair)
                e[_LOOK] += look
                e[_READ] += look * width
        return base, owners

    def floor(self, t: Table, layout: Layout, cost: list[float], busiest: int) -> float:
        """A floor on the busiest rank's time after a layout: skips most layouts without pricing them rank by rank."""
        bi, bx, bl = self.bandwidths
        fast, world = max(bi, bx), self.world_size
        if layout[0] == "data_parallel":  # every rank all-reduces the gradient
            return cost[busiest] + 4.0 * t.n * t.d * t.s * (world - 1) / world / fast
        every, top = 0.0, cost[busiest]
        for ranks, rows, cols in layout[3]:
            k, vec = len(ranks), t.bags * cols * t.s
            pair = vec
            every += 2 * (k - (busiest in ranks)) * pair  # the busiest rank swaps vectors with the other owners
            # An owner swaps them with every other rank and pools its share of every rank's ids.
            own = 2 * (world - 1) * pair / fast
            own += world * t.bags * t.pooling * min(rows) / t.n * max(cols * t.s, _LINE) / bl
            top = max(top, max(cost[j] for j in ranks) + own)
        return max(cost[busiest] + every / fast, top)

    def shares(self, t: Table, layout: Layout) -> dict[int, int]:
        """The bytes (optimizer state included) each rank holding part of the table gets."""
        if layout[0] == "data_parallel":
            return dict.fromkeys(range(self.world_size), t.full)
        groups = layout[3]
        return {j: self.held(t, r, cols) for ranks, rows, cols in groups for j, r in zip(ranks, rows, strict=True)}

    # -- layouts --------------------------------------------------------------------------------------
    def layouts(self, t: Table, cost: list[float], mem: list[int], budget: Optional[int]) -> list[Layout]:
        """The layouts worth pricing: each allowed type on the least loaded ranks it can use."""
        allowed = set(t.ranks)
        by_load = [r for r in sorted(range(self.world_size), key=cost.__getitem__) if r in allowed]
        out: list[Layout] = []

        def least(ranks: Sequence[int], k: int) -> list[int]:
            return sorted(sorted(ranks, key=cost.__getitem__)[:k])

        def rows_over(kind: str, ranks: list[int]) -> None:
            cuts = [b - a for a, b in chunks(t.n, len(ranks))]
            if len(cuts) < len(ranks):  # fewer rows than ranks: the least loaded ranks hold them
                ranks = least(ranks, len(cuts))
            if len(ranks) > 1:
                out.append((kind, ranks, 1, [(ranks, cuts, t.d)]))

        def col_counts() -> list[int]:
            top = min(len(allowed), t.d // t.min_cols)
            counts = {c for c in (2, 4, 8, 16, 32, 64, 128, 256) if c <= top} | ({top} if top > 1 else set())
            return sorted(c for c in counts if len(chunks(t.d, c)) == c)  # every column block non-empty

        if "table_wise" in t.types:
            # Within a host the least loaded rank beats the others (it adds the same to a lower load): the
            # best rank of the two least loaded hosts, and the rank with the most memory left.
            room = [r for r in by_load if budget is None or mem[r] + t.full <= budget]
            picks: list[int] = []
            for r in room:
                if len(picks) == 2:
                    break
                if not picks or self.host_of[r] != self.host_of[picks[0]]:
                    picks.append(r)
            picks += [min(room, key=mem.__getitem__)] if room else []
            for r in dict.fromkeys(picks):
                out.append(("table_wise", [r], 1, [([r], [t.n], t.d)]))
        if "data_parallel" in t.types and len(allowed) == self.world_size:
            out.append(("data_parallel", list(range(self.world_size)), 1, []))
        if "row_wise" in t.types:
            rows_over("row_wise", sorted(allowed))
        hosts = [h for h in ([r for r in h if r in allowed] for h in self.hosts) if len(h) > 1]
        multi = len(self.hosts) > 1
        if "table_row_wise" in t.types and (multi or "row_wise" not in t.types):
            light = sorted(hosts, key=lambda h: max(cost[r] for r in h))[:2]
            light += sorted(hosts, key=lambda h: max(mem[r] for r in h))[:1]
            for h in {tuple(h): h for h in light}.values():
                rows_over("table_row_wise", h)
        if "column_wise" in t.types:
            for k in col_counts():
                need = self.held(t, t.n, -(-t.d // k))
                fit = least([r for r in by_load if budget is None or mem[r] + need <= budget], k)
                if len(fit) == k:
                    cols = [b - a for a, b in chunks(t.d, k)]
                    groups = [([r], [t.n], c) for r, c in zip(fit, cols, strict=True)]
                    out.append(("column_wise", fit, k, groups))
        if "grid" in t.types:
            full = sorted((h for h in hosts if len(h) == len(self.hosts[0])), key=lambda h: max(cost[r] for r in h))
            for c in col_counts():
                if multi:  # each column block row-wise over one host
                    slices = full[:c] if len(full) >= c else []
                else:  # one host: each column block row-wise over a slice of its least loaded ranks
                    per = len(by_load) // c
                    pick = least(by_load, c * per) if per > 1 else []
                    slices = [pick[i * per : (i + 1) * per] for i in range(c)] if pick else []
                if slices:
                    cuts = [b - a for a, b in chunks(t.n, len(slices[0]))]
                    cols = [b - a for a, b in chunks(t.d, c)]
                    parts = [(g[: len(cuts)], cuts, w) for g, w in zip(slices, cols, strict=True)]
                    out.append(("grid", [r for g in slices for r in g], c, parts))
        return out

    # -- placing ---------------------------------------------------------------------------------------
    def place(
        self, tables: list[Table], by_memory: bool
    ) -> tuple[dict[str, tuple[Layout, list[list[float]]]], list[list[float]]]:
        """Place the tables largest first, each on its cheapest layout that fits: the chosen layouts and the loads.

        Raises:
            NoFit: a table fits nowhere next to the ones placed before it.
        """
        world, host_of, budget, hosts = self.world_size, self.host_of, self.budget, self.hosts
        cost, mem = [0.0] * world, [0] * world
        sent, got, looked = [0.0] * world, [0.0] * world, [0.0] * world
        chosen: dict[str, tuple[Layout, list[list[float]]]] = {}
        for t in sorted(tables, key=lambda t: -t.full):
            # Per host: its ranks busiest first, the sum of their times and of their squares. A layout adds
            # the same to every rank of a host but its owners, so pricing it costs O(hosts + owners).
            desc = sorted(range(world), key=cost.__getitem__, reverse=True)
            busy: list[list[int]] = [[] for _ in hosts]
            for r in desc:
                busy[host_of[r]].append(r)
            sum1 = [sum(map(cost.__getitem__, h)) for h in hosts]
            sum2 = [sum(c * c for c in map(cost.__getitem__, h)) for h in hosts]
            best: Optional[tuple[tuple[float, ...], Layout, list[list[float]], dict[int, list[float]]]] = None
            layouts = self.layouts(t, cost, mem, budget)
            # Cheapest-looking first, so that the floor skips the rest once one is priced.
            for floor, i in sorted((self.floor(t, x, cost, desc[0]), i) for i, x in enumerate(layouts)):
                kind, ranks, _, groups = layout = layouts[i]
                if best is not None and not by_memory and floor > best[0][0]:
                    break
                adds = self.shares(t, layout)
                if kind == "data_parallel":
                    over = budget is not None and max(mem) + t.full > budget
                else:
                    over = budget is not None and any(mem[r] + b > budget for r, b in adds.items())
                if over or (t.cap is not None and max(adds.values()) > t.cap):
                    continue
                base, owners = self.effect(t, kind, groups)
                step = [self.time(b) for b in base]
                top = spread = 0.0
                for s1, s2, x, rs in zip(sum1, sum2, step, busy, strict=True):
                    spread += s2 + 2 * x * s1 + len(rs) * x * x
                    r = next((r for r in rs if r not in owners), -1)  # the host's busiest rank owning nothing
                    top = max(top, cost[r] + x) if r >= 0 else top
                for r, e in owners.items():
                    was = cost[r] + step[host_of[r]]
                    now = was + self.time(e)
                    top, spread = max(top, now), spread + now * now - was * was
                # The busiest rank first, then how evenly the rest is spread; rounded so that float noise
                # does not break a tie that SHARDING_TYPES' order and the lowest rank should decide.
                key: tuple[float, ...] = (float(f"{top:.9g}"), float(f"{spread:.9g}"), _ORDER[kind], ranks[0])
                if by_memory:
                    key = (max(mem[r] + b for r, b in adds.items()), *key)
                if best is None or key < best[0]:
                    best = (key, layout, base, owners)
            if best is None:
                raise NoFit(t, max((budget or 0) - mem[r] for r in t.ranks))
            _, layout, base, owners = best
            for r, b in self.shares(t, layout).items():
                mem[r] += b
            # Every rank gets its host's entry, owners their own on top.
            add = [(b[_S_IN] + b[_S_X], b[_R_IN] + b[_R_X], b[_LOOK], self.time(b)) for b in base]
            sent = [x + add[h][0] for x, h in zip(sent, host_of, strict=True)]
            got = [x + add[h][1] for x, h in zip(got, host_of, strict=True)]
            looked = [x + add[h][2] for x, h in zip(looked, host_of, strict=True)]
            cost = [x + add[h][3] for x, h in zip(cost, host_of, strict=True)]
            for r, e in owners.items():
                sent[r] += e[_S_IN] + e[_S_X]
                got[r] += e[_R_IN] + e[_R_X]
                looked[r] += e[_LOOK]
                cost[r] += self.time(e)
            chosen[t.cfg.name] = (layout, base)
        return chosen, [list(x) for x in zip(sent, got, looked, mem, strict=True)]
