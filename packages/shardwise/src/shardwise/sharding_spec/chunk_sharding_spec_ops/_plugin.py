"""Where the embedding modules find the ``shardwise-embedding`` distribution."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["DISTRIBUTION", "load"]

#: The distribution that implements the sharded embedding ops.
DISTRIBUTION = "shardwise-embedding"


def load(path: str) -> ModuleType:
    """The ``shardwise_embedding`` package, for the torch-compatible module at ``path``.

    Args:
        path: The module that needs it (for the message).

    Raises:
        ModuleNotFoundError: the distribution is not installed; the message
            says to ``pip install shardwise-embedding``.
    """
    try:
        return importlib.import_module("shardwise_embedding")
    except ModuleNotFoundError as exc:
        if exc.name != "shardwise_embedding":
            raise  # the plugin is there but one of its own imports failed: show that
        raise ModuleNotFoundError(
            f"{path} re-exports the sharded embedding ops of the {DISTRIBUTION} distribution, which is not "
            f"installed; pip install {DISTRIBUTION}",
            name="shardwise_embedding",
        ) from exc
