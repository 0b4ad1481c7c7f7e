"""Print every target checklist that one `make bench` run wrote, as one list (the last step of `make bench`).

Each benchmark writes its results file (benchmarks/results/*.md) with a
``Targets:`` section of ``- [x]``/``- [ ]`` lines. This reads the files named
on the command line, in that order, and prints their checklists under one
heading each, then how many targets are met. Exit status 0 either way: a
target not met is a finding, reported with its figures (and the results file
says what bounds it), not a failure of the run.

Usage: ``python benchmarks/targets.py benchmarks/results/bench-2ranks.md ...``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


def checklist(path: Path) -> list[str]:
    """The ``- [x]`` / ``- [ ]`` lines of ``path``'s ``Targets:`` section(s)."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.strip().lstrip("#").strip().rstrip(":").lower() == "targets":  # "Targets:" or "## Targets"
            inside = True
            continue
        if inside and line.startswith("- ["):
            lines.append(line)
        elif inside and line.startswith("#"):
            inside = False
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    out = ["", "=" * 20 + " make bench: targets " + "=" * 20]
    met = total = 0
    for path in paths:
        if not path.exists():
            out += ["", f"{path}: not written (its benchmark failed; see above)"]
            continue
        items = checklist(path)
        out += ["", f"{path}:"] + items
        total += len(items)
        met += sum(1 for item in items if item.startswith("- [x]"))
    out += ["", f"{met} of {total} targets met; each results file says what bounds the ones not met.", ""]
    sys.stdout.write("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
