"""A sharding plan as text: what ``plan.explain()`` and ``shardwise plan --explain`` print."""

from __future__ import annotations

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


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False)))
        for r in rows
    ]


def _where(t: TablePlan) -> str:
    if t.sharding_type == "data_parallel":
        return "every rank"
    if t.sharding_type == "table_wise":
        return f"rank {t.ranks[0]}"
    return "ranks " + ",".join(str(r) for r in t.ranks)


def render_plan(plan: EmbeddingShardingPlan) -> str:
    """The plan's explanation: per-rank estimates (when the planner made it), then one line per table."""
    lines = [
        f"Sharding plan for {plan.world_size} rank(s)"
        + (f", {plan.ranks_per_host} per host" if plan.ranks_per_host else "")
        + (f", budget {human_bytes(plan.memory_budget_bytes)} per rank" if plan.memory_budget_bytes else "")
        + f": {len(plan.tables)} table(s)"
    ]
    lines += [f"  {n}" for n in plan.notes]
    if plan.loads:
        lines.append("Per rank (estimates per batch):")
        rows = [["rank", "memory", "sends", "receives", "lookups"]]
        rows += [
            [
                str(x.rank),
                human_bytes(x.memory_bytes),
                human_bytes(x.send_bytes),
                human_bytes(x.recv_bytes),
                str(x.lookups),
            ]
            for x in plan.loads
        ]
        lines += _table(rows)
    lines.append("Tables:")
    rows = [["table", "rows x dim", "sharding", "where", "why"]]
    rows += [
        [t.name, f"{t.num_embeddings} x {t.embedding_dim}", t.sharding_type, _where(t), t.reason or "(given)"]
        for t in plan.tables
    ]
    lines += _table(rows)
    return "\n".join(lines)
