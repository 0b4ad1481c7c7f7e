"""The loss curve of ``recsys.py`` as a picture: the sharded run against the dense replay, every run in its colour.

The top panel shows the sharded loss of every step (faint) and its moving
average (bold), one colour per run (the first training and each resumed
one, with a line where a run took over), the dense replay's moving average
dashed on top of it, the hidden model's loss (the best achievable) and the
loss of predicting the overall click rate (what learning nothing scores).
The two curves lie on each other; the bottom panel shows by how much they
differ at each step, against the tolerance the demo checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from _recsys_report import LOSS_TOLERANCE, Reference, blind_loss, effective_window

__all__ = ["save_loss_picture"]

#: Where a step whose sharded and dense losses are exactly equal is drawn on the log-scale difference axis.
EQUAL = 1e-9


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def segments(runs: Sequence[Sequence[Any]], steps: int) -> list[tuple[int, int, str]]:
    """Each run's ``(first step, end step, label)``, from ``[first step, label]`` per run (``History.runs``).

    Taken from the runs, not from the label of each step, so that a run
    resumed on the same ranks and backend as the one before still shows
    where it took over.
    """
    ends = [int(first) for first, _ in runs[1:]] + [steps]
    return [(int(first), end, str(label)) for (first, label), end in zip(runs, ends, strict=True)]


def save_loss_picture(
    path: Path, losses: Sequence[float], reference: Reference, runs: Sequence[Sequence[Any]], window: int
) -> bool:
    """Draw the loss curve against the dense replay and save it as a PNG at ``path``.

    Args:
        path: The PNG to write (its directory is created).
        losses: The sharded run's loss at every step from 0.
        reference: The dense replay of the same steps.
        runs: ``[first step, label]`` of every run so far (``[[0, "2 ranks (mpi)"], [300, ...]]``).
        window: Steps in each moving average (at most half the steps, as in the printed table).

    Returns:
        True when the picture was saved; False when matplotlib is not installed.
    """
    try:
        # Imported here, not at the top: matplotlib is an optional, heavy dependency (a dev tool of the
        # Makefile) that only this picture needs, so the demo trains and checks without it.
        from matplotlib.figure import Figure
    except ImportError:
        return False

    steps = range(len(losses))
    window = effective_window(len(losses), window)
    fig = Figure(figsize=(10, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    average = moving_average(losses, window)
    worst = EQUAL
    for i, (start, end, label) in enumerate(segments(runs, len(losses))):
        colour = f"C{i}"
        top.plot(steps[start:end], losses[start:end], color=colour, alpha=0.3, linewidth=0.8)
        top.plot(
            steps[start:end],
            average[start:end],
            color=colour,
            linewidth=2.2,
            label=f"sharded, {label}: steps {start}..{end - 1}",
        )
        if start > 0:
            top.axvline(start, color=colour, linestyle=":", linewidth=1.2)
            top.annotate(
                f"resumed on {label} ",
                (start, 0.98),
                xycoords=("data", "axes fraction"),
                # Left of the line, from the top down: the curve has fallen by then, the legend is further right.
                ha="right",
                va="top",
                rotation=90,
                color=colour,
                fontsize=9,
            )
        differences = [abs(a - b) or EQUAL for a, b in zip(losses[start:end], reference.losses[start:end], strict=True)]
        bottom.scatter(steps[start:end], differences, color=colour, s=6)
        worst = max(worst, *differences)
    top.plot(
        steps,
        moving_average(reference.losses, window),
        color="black",
        linestyle="--",
        linewidth=1,
        label="dense replay: 1 process, plain nn.EmbeddingBag (on the sharded curve)",
    )
    top.plot(
        steps,
        moving_average(reference.true_losses, window),
        color="grey",
        linestyle="-.",
        linewidth=1,
        label="hidden model that labelled the data (best achievable)",
    )
    top.axhline(
        blind_loss(reference.click_rate),
        color="grey",
        linewidth=1,
        label=f"predicting the click rate, {reference.click_rate:.2f}, for every sample",
    )
    top.set_ylabel(f"loss (binary cross-entropy)\nfaint: each step; bold: mean of the last {window}")
    top.set_title(f"recsys demo: sharded training against the dense replay, steps 0..{len(losses) - 1}")
    top.legend(fontsize=8, loc="center right")
    bottom.axhline(LOSS_TOLERANCE, color="red", linestyle="--", linewidth=1, label=f"tolerance {LOSS_TOLERANCE:g}")
    bottom.set_yscale("log")
    bottom.set_ylim(EQUAL / 3, max(LOSS_TOLERANCE, worst) * 10)  # a mismatch must show, not fall off the top
    bottom.set_ylabel(f"|sharded - dense|\n(equal: drawn at {EQUAL:g})")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8, loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True
