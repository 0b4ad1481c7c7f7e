"""Which sharding library the ported suite tests: torch 2.13's ``_shard`` or shardwise.

``TORCH_SUITE_TARGET=torch`` imports ``torch.distributed._shard.<path>``,
``TORCH_SUITE_TARGET=shardwise`` (the default) imports ``shardwise.<path>``:
the ported tests name every module by torch's path with the prefix cut off
(``load("sharded_tensor.api", "TensorProperties")``), exactly the rewrite a
user migrating from torch makes.

A module or name the target lacks does not stop the file from importing:
it comes back as a stand-in that raises ``ImportError`` (naming the missing
path) when a test uses it, so only the tests that need it fail.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, NoReturn

__all__ = ["PREFIX", "TARGET", "load"]

_PREFIXES = {"torch": "torch.distributed._shard", "shardwise": "shardwise"}

TARGET = os.environ.get("TORCH_SUITE_TARGET", "shardwise")
if TARGET not in _PREFIXES:
    raise ValueError(f"TORCH_SUITE_TARGET must be one of {sorted(_PREFIXES)}, got {TARGET!r}")
PREFIX = _PREFIXES[TARGET]


class _MissingMeta(type):
    """Metaclass of a stand-in: every use raises the import error it stands for."""

    _error: str

    def _fail(cls) -> NoReturn:
        raise ImportError(cls._error)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        cls._fail()

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        cls._fail()

    def __instancecheck__(cls, instance: Any) -> bool:
        cls._fail()

    def __subclasscheck__(cls, subclass: Any) -> bool:
        cls._fail()


def _missing(label: str, error: BaseException) -> Any:
    # A class (not an instance), so upstream code may still subclass it at
    # import time (`class GridShardingSpec(ShardingSpec)`); the subclass
    # inherits the metaclass and fails when it is instantiated.
    message = f"{label} is missing in target {TARGET!r}: {type(error).__name__}: {error}"
    return _MissingMeta(label.rsplit(".", 1)[-1], (), {"_error": message})


def _module(path: str) -> Any:
    full = f"{PREFIX}.{path}" if path else PREFIX
    try:
        return importlib.import_module(full)
    except ImportError as exc:
        return _missing(full, exc)


def load(path: str, *names: str) -> Any:
    """Import ``<prefix>.<path>`` (``path`` "" for the package itself).

    Args:
        path: Module path below ``torch.distributed._shard`` (torch's spelling).
        *names: Names to take from the module.

    Returns:
        The module when no name is given, the one object for one name, else a
        tuple in the order given. Anything missing is a stand-in that raises
        ``ImportError`` when used.
    """
    module = _module(path)
    if not names:
        return module
    found = []
    for name in names:
        if not isinstance(module, ModuleType):
            found.append(module)
            continue
        try:
            found.append(getattr(module, name))
        except AttributeError as exc:
            found.append(_missing(f"{module.__name__}.{name}", exc))
    return found[0] if len(found) == 1 else tuple(found)
