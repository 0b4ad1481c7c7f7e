"""The core distribution's version (``shardwise.__version__``), in the lowest layer so every layer may name it."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
