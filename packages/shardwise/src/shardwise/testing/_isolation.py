"""A fresh plugin manager, for tests of shardwise and of plugins."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from shardwise._registry import manager as _registry

__all__ = ["isolated_plugins"]


@contextlib.contextmanager
def isolated_plugins() -> Iterator[None]:
    """Run the block with no ``SHARDWISE_*`` variables and a plugin manager built afresh.

    The manager is rebuilt on the first lookup inside the block, from the
    block's own environment (a test may set ``SHARDWISE_PLUGINS`` and the
    like first); afterwards the variables and the previous manager are
    restored, so no test sees another's plugins.

    Example (a plugin's ``conftest.py``)::

        @pytest.fixture(autouse=True)
        def _fresh_plugins():
            with shardwise.testing.isolated_plugins():
                yield
    """
    saved = {name: value for name, value in os.environ.items() if name.startswith("SHARDWISE_")}
    for name in saved:
        del os.environ[name]
    previous = _registry.reset()
    try:
        yield
    finally:
        _registry.reset(previous)
        for name in [n for n in os.environ if n.startswith("SHARDWISE_")]:
            del os.environ[name]
        os.environ.update(saved)
