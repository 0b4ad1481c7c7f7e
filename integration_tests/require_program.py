"""Fail a tox env at once, naming the fix, when a system program its tests need is missing.

Usage: ``python require_program.py PATH PACKAGE``. Without it the tests that
launch ``PATH`` would skip, and the env would pass having tested nothing.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    path, package = argv
    if os.access(path, os.X_OK):
        return 0
    print(
        f"{path} is missing: this tox env needs the Debian package {package}. Install it with "
        f"`make system-deps` (as root; .ci/run does), or `apt-get install {package}`.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
