"""The chart of ``make bench``: speedup over torch._shard, one group of three bars per workload.

In each group torch._shard over gloo is 1, and shardwise over the same gloo
group and over MPI stand beside it, so the gloo-against-gloo comparison
(same transport, only the library differs) sits next to what MPI adds. A
bar's height is torch._shard's median time divided by the column's median
(> 1: faster than torch._shard), written on the bar. Its whisker spans the
column's fastest to slowest call, against torch._shard's median; torch's own
whisker is its own spread. A workload that torch._shard has no call for
(``full_tensor``) gets "n/a" in torch's place and each shardwise column's
time in milliseconds instead of a bar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from _timing import Spread

__all__ = ["COLUMNS", "Bar", "speedup_bars", "speedup_chart"]

#: The columns, in their order within a group: the reference first.
COLUMNS = ("torch", "gloo", "mpi")
LEGEND = {"torch": "torch._shard over gloo (= 1)", "gloo": "shardwise over gloo", "mpi": "shardwise over MPI"}
COLOURS = {"torch": "0.6", "gloo": "C0", "mpi": "C1"}
#: Width of one bar; a group of three takes 0.84 of the 1 between workloads.
WIDTH = 0.28


@dataclass(frozen=True)
class Bar:
    """One bar of the chart, or the mark in its place.

    Attributes:
        workload: The group's workload (``"scatter 64 MiB"``).
        column: ``"torch"``, ``"gloo"`` or ``"mpi"``.
        speedup: torch._shard's median time / this column's, or None where
            there is none to compare (no torch._shard call, or no time).
        low: The whisker's bottom: torch's median / this column's slowest call.
        high: The whisker's top: torch's median / this column's fastest call.
        label: What is written on it: ``"3.33×"``, ``"n/a"``, or the column's
            median time where only torch._shard is missing (``"5.9 ms"``).
    """

    workload: str
    column: str
    speedup: Optional[float]
    low: Optional[float]
    high: Optional[float]
    label: str


def speedup_bars(workloads: Sequence[tuple[str, Mapping[str, Spread]]]) -> list[Bar]:
    """The bars of every workload, normalised to torch._shard's median.

    Args:
        workloads: ``(name, times)`` per workload, where ``times`` maps a
            column to its :class:`Spread` of times (any one unit; ms for the
            labels of workloads torch._shard lacks). A column may be absent.

    Returns:
        One :class:`Bar` per workload and column, in ``COLUMNS`` order.
    """
    bars = []
    for name, times in workloads:
        base = times.get("torch")
        for column in COLUMNS:
            spread = times.get(column)
            if spread is None:
                bars.append(Bar(name, column, None, None, None, "n/a"))
            elif base is None:
                bars.append(Bar(name, column, None, None, None, f"{spread.median:.3g} ms"))
            else:
                speedup = base.median / spread.median
                bars.append(
                    Bar(name, column, speedup, base.median / spread.max, base.median / spread.min, f"{speedup:.2f}×")
                )
    return bars


def speedup_chart(workloads: Sequence[tuple[str, Mapping[str, Spread]]], title: str, note: str) -> Any:
    """Draw :func:`speedup_bars` as grouped bars; returns the matplotlib ``Figure`` (save it with ``savefig``).

    Args:
        workloads: As for :func:`speedup_bars`, times in milliseconds.
        title: The chart's title.
        note: A line under the title (how the bars were measured).

    Raises:
        ImportError: matplotlib is not installed.
    """
    # Imported here, not at the top: matplotlib is heavy and only the chart needs it (the timing, the
    # table and the tests of the timings do not). Figure, not pyplot: no global backend or state.
    from matplotlib.figure import Figure

    bars = speedup_bars(workloads)
    names = [name for name, _ in workloads]
    ticks = [name if "torch" in times else f"{name}\n(torch._shard: n/a)" for name, times in workloads]
    fig = Figure(figsize=(14, 6.5), layout="constrained")
    ax = fig.subplots()
    drawn = [bar for bar in bars if bar.speedup is not None]
    top = max([bar.high or bar.speedup or 1.0 for bar in drawn] + [1.0])
    for i, column in enumerate(COLUMNS):
        own = [(names.index(bar.workload) + (i - 1) * WIDTH, bar) for bar in bars if bar.column == column]
        shown = [(x, bar) for x, bar in own if bar.speedup is not None]
        if shown:
            xs = [x for x, _ in shown]
            heights = [bar.speedup or 0.0 for _, bar in shown]
            below = [h - (bar.low or h) for h, (_, bar) in zip(heights, shown, strict=True)]
            above = [(bar.high or h) - h for h, (_, bar) in zip(heights, shown, strict=True)]
            ax.bar(
                xs,
                heights,
                WIDTH,
                yerr=[below, above],
                capsize=2,
                color=COLOURS[column],
                label=LEGEND[column],
                error_kw={"elinewidth": 0.8, "ecolor": "0.2"},
            )
        for x, bar in own:
            if bar.speedup is None:
                # No bar: the mark stands where the bar would start.
                ax.text(
                    x,
                    0.03 * top,
                    bar.label,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=9,
                    color="0.2",
                )
            else:
                ax.text(
                    x,
                    (bar.high or bar.speedup) + 0.01 * top,
                    bar.label,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(0, top * 1.18)  # room for the labels above the whiskers
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(ticks, rotation=30, ha="right", fontsize=9)
    ax.set_ylabel("speedup over torch._shard (torch._shard ms / ms)")
    ax.set_title(f"{title}\n{note}", fontsize=11)
    ax.legend(loc="upper left")
    return fig
