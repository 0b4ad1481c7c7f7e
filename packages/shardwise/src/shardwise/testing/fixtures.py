"""pytest fixtures for the test suites of shardwise plugins; import them into a ``conftest.py``.

    # tests/conftest.py
    from shardwise.testing.fixtures import fresh_plugin_manager, importable_tests

    importable_tests(__file__)
    __all__ = ["fresh_plugin_manager"]

This module imports pytest (a test dependency, not one of shardwise's).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from shardwise.testing._isolation import isolated_plugins

__all__ = ["fresh_plugin_manager", "importable_tests"]


@pytest.fixture(autouse=True)
def fresh_plugin_manager() -> Iterator[None]:
    """Each test starts from a plugin manager built from its own environment (installed plugins load
    through their entry points), and nothing it registers leaks into the next test."""
    with isolated_plugins():
        yield


def importable_tests(conftest_file: str) -> None:
    """Put the tests directory on ``sys.path``.

    Ranks started by :func:`~shardwise.testing.run_ranks` copy this
    process's ``sys.path``, so they can then import the test modules (and
    helpers) their rank functions live in.
    """
    here = str(Path(conftest_file).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
