"""Each benchmark script runs end to end on tiny sizes under ``mpiexec -n 2`` (``--smoke``), within a timeout.

The timings of a smoke run mean nothing; what is checked is that the
scripts, their correctness checks (every column against the dense result)
and their outputs still work, so ``make bench`` does not rot between runs.
The chart of ``make bench`` is also built from synthetic timings, in this
process, to check what it shows.
"""

from __future__ import annotations

import importlib
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_mpiexec import mpiexec

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    """``path`` is a PNG with a nonzero size: its signature, then an IHDR chunk with its width and height."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, (width, height)


def test_bench_smoke_writes_table_targets_and_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="make bench draws its chart with matplotlib")
    out = mpiexec(BENCHMARKS / "bench.py", 2, "--smoke", "--out", str(tmp_path))
    text = (tmp_path / "bench-2ranks.md").read_text()
    for row in ("scatter 64 KiB", "reshard dim 0 <-> 1 64 KiB", "gather to rank 0 64 KiB", "full_tensor 64 KiB",
                "embedding row-wise fwd", "embedding_bag sum column-wise fwd"):
        assert f"| {row} |" in text, text
    assert "Targets:" in text and text in out
    # The bound (every result byte written once, the ranks sharing the memory bus) beside the floor.
    assert "| mpi x floor | bound x floor |" in text and "the bound: 2.00x floor" in text, text
    assert f"chart: {tmp_path / 'bench-2ranks.png'}" in out, out
    _assert_png(tmp_path / "bench-2ranks.png")
    # The output is a pipe, not a terminal: plain progress lines, no bar redrawn with carriage returns.
    assert "\r" not in out, repr(out)
    progress = re.findall(r"^bench: .*$", out, flags=re.MULTILINE)
    assert 1 <= len(progress) <= 11 and progress[-1].startswith("bench: done, 12/12 rows in "), progress


@pytest.mark.parametrize(("script", "result"), [("embedding.py", "embedding.md"),
                                                 ("mpi_collectives.py", "mpi_collectives.md"),
                                                 ("collection.py", "collection-2ranks.md"),
                                                 ("pipeline.py", "pipeline-2ranks.md"),
                                                 ("after_traffic.py", "after-traffic-2ranks.md")])
def test_benchmark_smoke(tmp_path: Path, script: str, result: str) -> None:
    out = mpiexec(BENCHMARKS / script, 2, "--smoke", "--out", str(tmp_path))
    text = (tmp_path / result).read_text()
    assert text.count("\n| ") >= 4 and text in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cross-memory attach is Linux only")
def test_cross_memory_benchmark_times_every_kind_of_copy(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "cross_memory.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    text = (tmp_path / "cross-memory.md").read_text()
    assert text in done.stdout
    rows = re.findall(r"^\| (.+?) \| ([0-9.]+) \| ([0-9.]+) \|$", text, flags=re.MULTILINE)
    assert [what for what, _, _ in rows][:3] == [
        "local memcpy", "read from huge pages, contiguous", "read from 4 KiB pages, contiguous"
    ] and len(rows) == 7, text
    assert all(float(ms) > 0 for _, ms, _ in rows), text


def test_dtensor_benchmark_quick_run_writes_every_column_and_target(tmp_path: Path) -> None:
    # DTensor and shardwise over gloo and over MPI, and the c10d collectives over gloo and "mpi4py", in one run.
    out = mpiexec(BENCHMARKS / "dtensor.py", 2, "--quick", "--out", str(tmp_path), timeout=120)
    text = (tmp_path / "dtensor-2ranks.md").read_text()
    assert text in out
    for column in ("DTensor[gloo] ms", "DTensor[mpi4py] ms", "shardwise[gloo] ms", "shardwise[mpi] ms"):
        assert column in text, text
    for row in ("distribute / shard_tensor", "redistribute / reshard", "full_tensor / full_tensor",
                "all_reduce | 4 KiB", "scatter | 256 KiB", "send/recv | 256 KiB", "barrier | —"):
        assert f"| {row} |" in text, text
    targets = re.findall(r"^- \[[ x]\] (.*): ([0-9.]+)x", text, flags=re.MULTILINE)
    assert any(what.startswith("DTensor[mpi4py] redistribute within 1.5x") for what, _ in targets), text
    assert sum(what.startswith("mpi4py ") for what, _ in targets) >= 20, text


def test_gloo_rounds_benchmark_times_the_three_ways_to_swap_rows(tmp_path: Path) -> None:
    out = mpiexec(BENCHMARKS / "gloo_rounds.py", 2, "--smoke", "--out", str(tmp_path))
    text = (tmp_path / "gloo-rounds-2ranks.md").read_text()
    assert text in out
    cells = r" \| ([0-9.]+)" * 4
    rows = re.findall(rf"^\| (8 B|64 KiB){cells} \|$", text, flags=re.MULTILINE)
    assert [row[0] for row in rows] == ["8 B", "64 KiB"], text
    assert all(float(ms) > 0 for row in rows for ms in row[1:]), text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cross-memory attach is Linux only")
def test_copy_bounds_benchmark_checks_and_times_every_split(tmp_path: Path) -> None:
    # Every split's copies are checked against the dense tensor before timing (a wrong one fails the run).
    out = mpiexec(BENCHMARKS / "copy_bounds.py", 2, "--smoke", "--out", str(tmp_path))
    text = (tmp_path / "copy-bounds-2ranks.md").read_text()
    assert text in out
    names = ("scatter 64 KiB", "gather to rank 0 64 KiB", "reshard dim 0 <-> 1 64 KiB")
    _, table, _, splits, _, bounds = text.split("\n\n")
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [row[0] for row in rows] == [f"| {name}" for name in names] and all(len(r) == 9 for r in rows), text
    split_rows = [line.split(" | ") for line in splits.splitlines()[2:]]
    assert [row[0] for row in split_rows] == [f"| {name}" for name in names[:2]], text
    assert all(float(ms.rstrip(" |")) > 0 for row in split_rows for ms in row[1:]) and len(split_rows[0]) == 10, text
    verdicts = re.findall(r"^- (.+?): the copies alone take [0-9.]+ ms; .*(?:within reach|out of reach here)", bounds,
                          flags=re.MULTILINE)  # fmt: skip
    assert verdicts == list(names), text


@pytest.fixture
def chart(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/_chart.py, imported as the benchmarks import it (their directory on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("_chart")


def _synthetic(chart: ModuleType) -> list[tuple[str, dict[str, object]]]:
    spread = importlib.import_module("_timing").Spread
    return [
        # torch 60 ms; shardwise over gloo 20 ms (3x), over mpi 5 ms (12x); each with its own min-max.
        ("scatter", {"torch": spread(50.0, 60.0, 90.0), "gloo": spread(15.0, 20.0, 30.0),
                     "mpi": spread(4.0, 5.0, 6.0)}),
        # torch._shard has no full_tensor.
        ("full_tensor", {"gloo": spread(40.0, 55.3, 70.0), "mpi": spread(5.0, 5.9, 9.0)}),
        # shardwise over gloo slower than torch: a bar below 1.
        ("bag fwd", {"torch": spread(10.0, 12.0, 14.0), "gloo": spread(14.0, 15.0, 20.0),
                     "mpi": spread(4.0, 6.0, 8.0)}),
    ]


def test_speedup_bars_normalise_to_torch_with_min_max_whiskers_and_na(chart: ModuleType) -> None:
    bars = {(bar.workload, bar.column): bar for bar in chart.speedup_bars(_synthetic(chart))}
    assert [key[1] for key in bars][:3] == ["torch", "gloo", "mpi"]  # the reference first in each group
    torch_bar, gloo, mpi = bars["scatter", "torch"], bars["scatter", "gloo"], bars["scatter", "mpi"]
    assert (torch_bar.speedup, torch_bar.low, torch_bar.high, torch_bar.label) == (1.0, 60 / 90, 60 / 50, "1.00×")
    assert (gloo.speedup, gloo.low, gloo.high, gloo.label) == (3.0, 2.0, 4.0, "3.00×")
    assert (mpi.speedup, mpi.low, mpi.high, mpi.label) == (12.0, 10.0, 15.0, "12.00×")
    assert bars["bag fwd", "gloo"].speedup == pytest.approx(0.8) and bars["bag fwd", "gloo"].label == "0.80×"
    # No torch._shard call: no bar in the group, "n/a" in torch's place, the shardwise times in ms.
    na = [bars["full_tensor", col] for col in ("torch", "gloo", "mpi")]
    assert [bar.speedup for bar in na] == [None, None, None]
    assert [bar.label for bar in na] == ["n/a", "55.3 ms", "5.9 ms"]


def test_speedup_chart_draws_the_bars_and_their_labels(chart: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the chart is drawn with matplotlib")
    fig = chart.speedup_chart(_synthetic(chart), "title", "how it was measured")
    ax = fig.axes[0]
    heights = sorted(round(patch.get_height(), 6) for patch in ax.patches)
    # Two workloads with torch._shard, three bars each; full_tensor has none.
    assert heights == sorted([1.0, 3.0, 12.0, 1.0, 0.8, 2.0]), heights
    texts = [text.get_text() for text in ax.texts]
    assert sorted(texts) == sorted(["1.00×", "3.00×", "12.00×", "1.00×", "0.80×", "2.00×", "n/a", "55.3 ms",
                                    "5.9 ms"]), texts
    assert [label.get_text() for label in ax.get_xticklabels()] == ["scatter", "full_tensor\n(torch._shard: n/a)",
                                                                    "bag fwd"]
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "torch._shard over gloo (= 1)", "shardwise over gloo", "shardwise over MPI"]
    fig.savefig(tmp_path / "chart.png")
    _assert_png(tmp_path / "chart.png")


def test_targets_gathers_every_checklist(tmp_path: Path) -> None:
    """benchmarks/targets.py (make bench's last step) lists each file's targets and counts those met."""
    (tmp_path / "a.md").write_text("# A\n\n| x |\n\nTargets:\n\n- [x] fast: 2x\n- [ ] faster: 0.9x\n")
    (tmp_path / "b.md").write_text("# B\n\n## Targets\n\n- [x] small: 1 s\n\n## After\n\n- [ ] not a target\n")
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "targets.py"), str(tmp_path / "a.md"), str(tmp_path / "b.md"),
         str(tmp_path / "missing.md")],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    assert "- [x] fast: 2x" in out and "- [ ] faster: 0.9x" in out and "- [x] small: 1 s" in out
    assert "missing.md: not written" in out
    assert "2 of 3 targets met" in out
