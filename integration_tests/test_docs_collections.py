"""The program of docs/collections.md, run as the page shows: written out literally, launched by torchrun.

The page's program (the code block after ``<!-- collections:program -->``)
builds three tables, plans them, shards them, takes a training step and saves
a checkpoint; the launch block after ``<!-- collections:launch -->`` shows the
command and what it prints. The test checks the ranks' result lines and that
rank 0 printed the plan's explanation as the page shows it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "collections.md"


def _block_after(marker: str) -> str:
    text = PAGE.read_text()
    found = re.search(re.escape(marker) + r"\s*```\w*\n(.*?)```", text, re.S)
    assert found, f"no code block after {marker} in {PAGE}"
    return found.group(1)


def test_the_collections_page_program_runs_as_shown(tmp_path: Path) -> None:
    (tmp_path / "collection.py").write_text(_block_after("<!-- collections:program -->"))
    shown = _block_after("<!-- collections:launch -->").splitlines()
    command = shown[0].removeprefix("$ ").split()
    assert command[0] == "torchrun", command
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    printed = run.stdout.splitlines()
    expected = shown[1:]
    # Ranks print concurrently: the result lines in any order, the explanation (rank 0 alone) as shown.
    results = sorted(line for line in expected if line.startswith("rank "))
    assert sorted(line for line in printed if line.startswith("rank ")) == results, run.stdout
    explanation = [line for line in expected if not line.startswith("rank ")]
    assert [line for line in printed if not line.startswith("rank ")] == explanation, run.stdout
    assert (tmp_path / "ckpt" / ".metadata").exists()
