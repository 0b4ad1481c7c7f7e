"""The sharding plan of an embedding collection: frozen, plain data that carries every decision.

A plan says, for every table, how it is sharded and exactly which block of
rows and columns each rank holds. The sharded collection executes it and
decides nothing itself; the planner (or a user, by hand or by editing the
JSON) makes it. A table is cut into column blocks, each cut into row blocks;
each block lives on one rank, and a rank holds at most one block of a table:

* ``data_parallel`` — no blocks: every rank holds the whole table;
* ``table_wise`` — one block, the whole table, on one rank;
* ``row_wise`` / ``table_row_wise`` — one column block cut into row blocks
  over all ranks / over some ranks (usually one host's);
* ``column_wise`` — column blocks, each with all the rows, one per rank;
* ``grid`` — column blocks, each cut into row blocks over a group of ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping, Optional, Sequence

from shardwise.errors import ShardwiseError
from shardwise_embedding._explain import render_plan
from shardwise_embedding._tables import EmbeddingBagConfig

__all__ = [
    "SHARDING_TYPES",
    "Block",
    "EmbeddingShardingPlan",
    "PlanError",
    "RankLoad",
    "TablePlan",
    "check_budget",
    "chunks",
    "make_blocks",
    "plan_fingerprint",
]

#: Every sharding type, in the order the planner prefers them when costs tie.
SHARDING_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid")

#: The format version written into a plan's JSON.
PLAN_FORMAT = 1


class PlanError(ShardwiseError, ValueError):
    """A plan that cannot be used: malformed, for other tables or another world size, or not fitting."""


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``torch.chunk``-sized pieces of ``range(n)``, empty pieces left out."""
    if parts < 1:
        raise PlanError(f"cannot cut {n} into {parts} pieces")
    size = -(-n // parts)
    return [(s, min(s + size, n)) for s in range(0, n, size)] if n else []


@dataclasses.dataclass(frozen=True)
class Block:
    """A rectangle of a table held by one rank.

    Attributes:
        rank: The rank holding it (a rank of the collection's group).
        rows: ``(start, stop)`` of its rows.
        cols: ``(start, stop)`` of its columns.
    """

    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, columns)``."""
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])


def make_blocks(
    sharding_type: str, num_embeddings: int, embedding_dim: int, ranks: Sequence[int], column_blocks: int = 1
) -> tuple[Block, ...]:
    """The blocks of a table sharded ``sharding_type`` over ``ranks``.

    Row and column cuts follow ``torch.chunk`` (equal pieces, the last one
    shorter; a table smaller than its ranks leaves the last ranks without a block).

    Args:
        sharding_type: One of :data:`SHARDING_TYPES`.
        num_embeddings: The table's rows.
        embedding_dim: The table's columns.
        ranks: The ranks the table is spread over, in block order. For
            ``grid``, ``len(ranks) // column_blocks`` consecutive ranks hold
            each column block's row blocks.
        column_blocks: For ``column_wise`` (default: one per rank) and
            ``grid``: how many column blocks.

    Returns:
        The blocks (none for ``data_parallel``).

    Raises:
        PlanError: an unknown type, or ranks that do not fit it.
    """
    ranks = [int(r) for r in ranks]
    if sharding_type not in SHARDING_TYPES:
        raise PlanError(f"unknown sharding type {sharding_type!r}; choose one of {', '.join(SHARDING_TYPES)}")
    if not ranks:
        raise PlanError(f"a {sharding_type} table needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"ranks {ranks} name a rank twice: a rank holds at most one block of a table")
    full_rows, full_cols = (0, num_embeddings), (0, embedding_dim)
    if sharding_type == "data_parallel":
        return ()
    if sharding_type == "table_wise":
        if len(ranks) != 1:
            raise PlanError(f"a table_wise table lives on one rank, got ranks {ranks}")
        return (Block(ranks[0], full_rows, full_cols),)
    if sharding_type in ("row_wise", "table_row_wise"):
        return tuple(
            Block(r, rows, full_cols) for r, rows in zip(ranks, chunks(num_embeddings, len(ranks)), strict=False)
        )
    if sharding_type == "column_wise":
        return tuple(
            Block(r, full_rows, cols) for r, cols in zip(ranks, chunks(embedding_dim, len(ranks)), strict=False)
        )
    if column_blocks < 1 or len(ranks) % column_blocks:
        raise PlanError(
            f"a grid of {column_blocks} column blocks needs a multiple of {column_blocks} ranks, got {ranks}"
        )
    per = len(ranks) // column_blocks
    cols = chunks(embedding_dim, column_blocks)
    return tuple(
        Block(r, rows, c)
        for i, c in enumerate(cols)
        for r, rows in zip(ranks[i * per : (i + 1) * per], chunks(num_embeddings, per), strict=False)
    )


def _pair(x: Sequence[Any]) -> tuple[int, int]:
    if len(x) != 2:
        raise ValueError(f"expected [start, stop], got {x!r}")
    return (int(x[0]), int(x[1]))


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """How one table is sharded.

    Attributes:
        name: The table.
        sharding_type: One of :data:`SHARDING_TYPES`.
        ranks: The ranks holding part of it (every rank for ``data_parallel``).
        num_embeddings: The table's rows (so a plan for other tables is caught).
        embedding_dim: The table's columns.
        blocks: Which rank holds which rows and columns (none for ``data_parallel``).
        reason: Why the planner chose this (free text; empty for a hand-made plan).
    """

    name: str
    sharding_type: str
    ranks: tuple[int, ...]
    num_embeddings: int
    embedding_dim: int
    blocks: tuple[Block, ...] = ()
    reason: str = ""

    @property
    def column_cuts(self) -> list[tuple[int, int]]:
        """The distinct column ranges of the blocks, in order."""
        return sorted({b.cols for b in self.blocks})

    def block_of(self, rank: int) -> Optional[Block]:
        """The block ``rank`` holds, or None."""
        return next((b for b in self.blocks if b.rank == rank), None)

    def check(self, world_size: int) -> None:
        """The blocks tile the table exactly, each on a distinct rank below ``world_size``.

        Raises:
            PlanError: naming the table and what is wrong.
        """
        where = f"table {self.name!r}"
        if self.sharding_type not in SHARDING_TYPES:
            raise PlanError(f"{where}: unknown sharding type {self.sharding_type!r}")
        bad = [r for r in self.ranks if not 0 <= r < world_size]
        if bad:
            raise PlanError(f"{where}: ranks {bad} are not ranks of a world of {world_size}")
        if self.sharding_type == "data_parallel":
            if self.blocks:
                raise PlanError(f"{where}: a data_parallel table has no blocks")
            return
        if not self.blocks:
            raise PlanError(f"{where}: a {self.sharding_type} table needs blocks")
        owners = [b.rank for b in self.blocks]
        if len(set(owners)) != len(owners):
            raise PlanError(f"{where}: a rank holds two blocks ({owners}); a rank holds at most one block of a table")
        if sorted(set(owners)) != sorted(set(self.ranks)):
            raise PlanError(f"{where}: ranks {list(self.ranks)} differ from the blocks' ranks {owners}")
        # Sorted cuts instead of comparing every pair of blocks: O(n log n) in the blocks. Column blocks
        # must tile the columns, and each must be cut into row blocks tiling every row, so that a looked-up
        # id goes to exactly one rank per column block.
        by_cols: dict[tuple[int, int], list[Block]] = {}
        for b in self.blocks:
            (r0, r1), (c0, c1) = b.rows, b.cols
            if not (0 <= r0 < r1 <= self.num_embeddings and 0 <= c0 < c1 <= self.embedding_dim):
                raise PlanError(
                    f"{where}: block {b} is empty or outside the table's {self.num_embeddings} x {self.embedding_dim}"
                )
            by_cols.setdefault(b.cols, []).append(b)
        cuts = sorted(by_cols)
        for left, right in zip(cuts, cuts[1:], strict=False):
            if left[1] > right[0]:
                raise PlanError(f"{where}: column blocks {left} and {right} overlap")
        if (
            cuts[0][0] != 0
            or cuts[-1][1] != self.embedding_dim
            or any(x[1] != y[0] for x, y in zip(cuts, cuts[1:], strict=False))
        ):
            raise PlanError(f"{where}: the blocks leave part of the table uncovered")
        for cols in cuts:
            blocks = sorted(by_cols[cols], key=lambda b: b.rows)
            for a, b in zip(blocks, blocks[1:], strict=False):
                if a.rows[1] > b.rows[0]:
                    raise PlanError(f"{where}: blocks {a} and {b} overlap")
            if (
                blocks[0].rows[0] != 0
                or blocks[-1].rows[1] != self.num_embeddings
                or any(a.rows[1] != b.rows[0] for a, b in zip(blocks, blocks[1:], strict=False))
            ):
                raise PlanError(f"{where}: column block {cols} is not cut into row blocks covering every row")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "name": self.name,
            "sharding_type": self.sharding_type,
            "ranks": list(self.ranks),
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "blocks": [{"rank": b.rank, "rows": list(b.rows), "cols": list(b.cols)} for b in self.blocks],
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TablePlan:
        """Read :meth:`to_dict`'s form.

        Raises:
            PlanError: a field missing or of the wrong kind.
        """
        try:
            return cls(
                name=str(d["name"]),
                sharding_type=str(d["sharding_type"]),
                ranks=tuple(int(r) for r in d["ranks"]),
                num_embeddings=int(d["num_embeddings"]),
                embedding_dim=int(d["embedding_dim"]),
                blocks=tuple(
                    Block(
                        int(b["rank"]), (int(b["rows"][0]), int(b["rows"][1])), (int(b["cols"][0]), int(b["cols"][1]))
                    )
                    for b in d.get("blocks", ())
                ),
                reason=str(d.get("reason", "")),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PlanError(f"a table entry of the plan is malformed ({exc!r}): {dict(d)!r}") from None


@dataclasses.dataclass(frozen=True)
class RankLoad:
    """What the planner expects one rank to hold and move per batch.

    Attributes:
        rank: The rank.
        memory_bytes: Its tables' bytes, optimizer state included.
        send_bytes: Bytes it sends per batch (ids out, pooled vectors back).
        recv_bytes: Bytes it receives per batch.
        lookups: Rows it looks up per batch.
    """

    rank: int
    memory_bytes: int
    send_bytes: int
    recv_bytes: int
    lookups: int


@dataclasses.dataclass(frozen=True)
class EmbeddingShardingPlan:
    """Where every table of a collection lives, for one world size.

    Attributes:
        world_size: The ranks it is for.
        tables: One :class:`TablePlan` per table, in the collection's order.
        ranks_per_host: Ranks per host the planner assumed (None: not known).
        loads: The planner's per-rank estimates (empty for a hand-made plan).
        memory_budget_bytes: The per-rank budget it was planned for, if any.
        notes: The planner's overall remarks (cost model, batch assumed ...).
    """

    world_size: int
    tables: tuple[TablePlan, ...]
    ranks_per_host: Optional[int] = None
    loads: tuple[RankLoad, ...] = ()
    memory_budget_bytes: Optional[int] = None
    notes: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"the plan has no table {name!r} (tables: {[t.name for t in self.tables]})")

    def __iter__(self) -> Any:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def check(self, tables: Optional[Sequence[EmbeddingBagConfig]] = None, world_size: Optional[int] = None) -> None:
        """Check the plan itself, and that it is for ``tables`` and ``world_size``.

        Raises:
            PlanError: naming the mismatch and how to get a fitting plan.
        """
        if world_size is not None and world_size != self.world_size:
            raise PlanError(
                f"the plan is for a world of {self.world_size} ranks but this group has {world_size}: "
                f"plan again for {world_size} (EmbeddingShardingPlanner(world_size={world_size}).plan(ebc))"
            )
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise PlanError(f"the plan names a table twice: {names}")
        for t in self.tables:
            t.check(self.world_size)
        if tables is None:
            return
        by_name = {t.name: t for t in tables}
        missing = [n for n in by_name if n not in names]
        extra = [n for n in names if n not in by_name]
        if missing or extra:
            raise PlanError(
                f"the plan is for other tables: tables without a place in it {missing}, planned tables the "
                f"collection lacks {extra}; plan this collection (EmbeddingShardingPlanner(...).plan(ebc))"
            )
        for t in self.tables:
            cfg = by_name[t.name]
            if (cfg.num_embeddings, cfg.embedding_dim) != (t.num_embeddings, t.embedding_dim):
                raise PlanError(
                    f"table {t.name!r} is {cfg.num_embeddings} x {cfg.embedding_dim} but the plan is for "
                    f"{t.num_embeddings} x {t.embedding_dim}; plan this collection again"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "format": PLAN_FORMAT,
            "world_size": self.world_size,
            "ranks_per_host": self.ranks_per_host,
            "memory_budget_bytes": self.memory_budget_bytes,
            "tables": [t.to_dict() for t in self.tables],
            "loads": [dataclasses.asdict(x) for x in self.loads],
            "notes": list(self.notes),
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The plan as JSON text: save it, edit it, hand it back to :meth:`from_json`."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EmbeddingShardingPlan:
        """Read :meth:`to_dict`'s form (checked with :meth:`check`)."""
        if not isinstance(d, Mapping) or "tables" not in d or "world_size" not in d:
            raise PlanError(
                "a plan is a JSON object with 'world_size' and 'tables' (see EmbeddingShardingPlan.to_json)"
            )
        if d.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise PlanError(f"plan format {d.get('format')!r} is not {PLAN_FORMAT}, the one this version reads")
        try:
            loads = tuple(RankLoad(**{k: int(v) for k, v in x.items()}) for x in d.get("loads", ()))
        except TypeError as exc:
            raise PlanError(f"the plan's loads are malformed: {exc}") from None
        rph = d.get("ranks_per_host")
        budget = d.get("memory_budget_bytes")
        plan = cls(
            world_size=int(d["world_size"]),
            tables=tuple(TablePlan.from_dict(t) for t in d["tables"]),
            ranks_per_host=None if rph is None else int(rph),
            loads=loads,
            memory_budget_bytes=None if budget is None else int(budget),
            notes=tuple(str(n) for n in d.get("notes", ())),
        )
        plan.check()
        return plan

    @classmethod
    def from_json(cls, text: str) -> EmbeddingShardingPlan:
        """Read a plan written by :meth:`to_json` (possibly edited), checked.

        Raises:
            PlanError: not JSON, malformed, or blocks that do not tile their table.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"the plan is not JSON: {exc}") from None
        return cls.from_dict(data)

    def explain(self) -> str:
        """What the plan does and why: per-rank memory and bytes, then each table's choice and reason."""
        return render_plan(self)


def plan_fingerprint(tables: Sequence[EmbeddingBagConfig], plan: EmbeddingShardingPlan) -> str:
    """A short digest of the tables and the plan (reasons aside): ranks compare it to agree they got the same."""
    cfg = [[t.name, t.num_embeddings, t.embedding_dim, list(t.feature_names), t.pooling, str(t.dtype)] for t in tables]
    body = json.dumps({"tables": cfg, "plan": [t.to_dict() | {"reason": ""} for t in plan.tables]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def check_budget(tables: Sequence[EmbeddingBagConfig], plan: EmbeddingShardingPlan) -> None:
    """The tables' bytes on each rank fit the plan's per-rank budget, if it has one (a hand edit may break it)."""
    budget = plan.memory_budget_bytes
    if budget is None:
        return
    held = [0] * plan.world_size
    for t in tables:
        p = plan[t.name]
        if p.sharding_type == "data_parallel":
            for r in range(plan.world_size):
                held[r] += t.bytes
        for b in p.blocks:
            held[b.rank] += b.shape[0] * b.shape[1] * t.dtype.itemsize
    over = [(r, n) for r, n in enumerate(held) if n > budget]
    if over:
        worst = ", ".join(f"rank {r}: {n} bytes" for r, n in over)
        raise PlanError(
            f"the plan does not fit its memory budget of {budget} bytes per rank ({worst}, tables alone); "
            "plan again (EmbeddingShardingPlanner(..., memory_budget_bytes=...)) or raise the budget"
        )
