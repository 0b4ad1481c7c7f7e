"""shardwise backend ``"nccl"``: CUDA collectives over torch.distributed's NCCL."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
