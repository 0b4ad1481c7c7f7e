"""shardwise sharded ops ``embedding`` and ``embedding_bag`` for chunk-sharded weights.

Importing this package registers nothing: the ops reach shardwise through the
``shardwise_sharded_ops`` hook of :mod:`shardwise_embedding.plugin`, which
shardwise loads through its entry point the first time an op is looked up.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
