"""shardwise backend ``"gloo"``: CPU collectives over torch.distributed's gloo."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
