"""pytest setup for the ported torch suite: its helpers importable by name, the ports not collected directly.

The ported files (``upstream/``) are ``unittest`` classes that must run on 4
ranks at once; ``test_torch_suite.py`` runs them and reports one result per
upstream test, so pytest must not collect them itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

collect_ignore_glob = ["upstream/*"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torch-suite", "the ported torch _shard suite")
    group.addoption(
        "--torch-suite-backend",
        choices=["gloo", "mpi"],
        default=None,
        help="gloo (4 spawned ranks) or mpi (4 ranks under mpiexec); default $TORCH_SUITE_BACKEND or gloo",
    )
    group.addoption(
        "--torch-suite-target",
        choices=["shardwise", "torch"],
        default=None,
        help="the library under test; default $TORCH_SUITE_TARGET or shardwise",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The ranks (and suite_target, at import) read the environment.
    options = (("--torch-suite-backend", "TORCH_SUITE_BACKEND"), ("--torch-suite-target", "TORCH_SUITE_TARGET"))
    for option, variable in options:
        value = config.getoption(option, default=None)
        if value:
            os.environ[variable] = value
