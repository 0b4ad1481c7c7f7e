"""Each benchmark script runs end to end on tiny sizes under ``mpiexec -n 2`` (``--smoke``), within a timeout.

The timings of a smoke run mean nothing; what is checked is that the
scripts, their correctness checks (every column against the dense result)
and their outputs still work, so ``make bench`` does not rot between runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mpiexec import mpiexec

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_bench_smoke_writes_table_targets_and_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="make bench draws its chart with matplotlib")
    out = mpiexec(BENCHMARKS / "bench.py", 2, "--smoke", "--out", str(tmp_path))
    text = (tmp_path / "bench-2ranks.md").read_text()
    for row in ("scatter 64 KiB", "reshard dim 0 <-> 1 64 KiB", "gather to rank 0 64 KiB", "full_tensor 64 KiB",
                "embedding row-wise fwd+bwd", "embedding_bag sum column-wise fwd"):
        assert f"| {row} |" in text, text
    assert "Targets:" in text and text in out
    assert (tmp_path / "bench-2ranks.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("script", "result"), [("embedding.py", "embedding.md"),
                                                 ("mpi_collectives.py", "mpi_collectives.md")])
def test_benchmark_smoke(tmp_path: Path, script: str, result: str) -> None:
    out = mpiexec(BENCHMARKS / script, 2, "--smoke", "--out", str(tmp_path))
    text = (tmp_path / result).read_text()
    assert text.count("\n| ") >= 4 and text in out
