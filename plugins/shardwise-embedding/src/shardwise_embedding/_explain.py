"""A sharding plan as text: what ``plan.explain()`` and ``shardwise plan --explain`` print."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the plan's module imports this one to render itself
    from shardwise_embedding._plan_data import EmbeddingShardingPlan, TablePlan

__all__ = ["human_bytes", "render_plan"]


def human_bytes(n: float) -> str:
    """``n`` bytes with a binary unit (``"1.5 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> list[str]:
    """Aligned columns: those in ``left`` (text) flush left, the others (numbers) flush right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def _spans(ranks: Sequence[int]) -> str:
    """``0-3,8,10-11``: sorted ranks with runs folded, so 128 ranks fit on a line."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def _where(t: TablePlan) -> str:
    if t.sharding_type == "data_parallel":
        return "every rank"
    if t.sharding_type == "table_wise":
        return f"rank {t.ranks[0]}"
    cols = len(t.column_cuts)
    return f"ranks {_spans(t.ranks)}" + (f" ({cols} column blocks)" if cols > 1 else "")


def _held(plan: EmbeddingShardingPlan) -> list[int]:
    """How many tables (whole or in part) each rank holds."""
    held = [0] * plan.world_size
    for t in plan.tables:
        for r in range(plan.world_size) if t.sharding_type == "data_parallel" else {b.rank for b in t.blocks}:
            if 0 <= r < plan.world_size:
                held[r] += 1
    return held


def render_plan(plan: EmbeddingShardingPlan) -> str:
    """The plan's explanation: per-rank estimates (when the planner made it), then one line per table."""
    lines = [
        f"Sharding plan for {plan.world_size} rank(s)"
        + (f", {plan.ranks_per_host} per host" if plan.ranks_per_host else "")
        + (f", budget {human_bytes(plan.memory_budget_bytes)} per rank" if plan.memory_budget_bytes else "")
        + f": {len(plan.tables)} table(s)"
    ]
    lines += [f"  {n}" for n in plan.notes]
    if plan.tables:
        counts = Counter(t.sharding_type for t in plan.tables).most_common()
        lines.append("  chosen: " + ", ".join(f"{n} {kind}" for kind, n in counts))
    if plan.loads:
        budget = plan.memory_budget_bytes
        held = _held(plan)
        lines.append("Per rank (planner's estimates; bytes and lookups per training step):")
        rows = [["rank", "memory", *(["of budget"] if budget else []), "tables", "sends", "receives", "lookups"]]
        for x in plan.loads:
            share = [f"{100 * x.memory_bytes / budget:.0f}%"] if budget else []
            count = str(held[x.rank]) if 0 <= x.rank < plan.world_size else "?"
            rows.append(
                [str(x.rank), human_bytes(x.memory_bytes), *share, count, human_bytes(x.send_bytes),
                 human_bytes(x.recv_bytes), str(x.lookups)]
            )  # fmt: skip
        lines += _table(rows)
    lines.append("Tables:")
    rows = [["table", "rows x dim", "sharding", "where", "why"]]
    rows += [
        [t.name, f"{t.num_embeddings} x {t.embedding_dim}", t.sharding_type, _where(t), t.reason or "(given)"]
        for t in plan.tables
    ]
    lines += _table(rows, left=(0, 2, 3, 4))
    return "\n".join(lines)
