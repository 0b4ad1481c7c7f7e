"""Sharded ops for ``ChunkShardingSpec``, at torch 2.13's path ``sharding_spec.chunk_sharding_spec_ops``.

A torch-compatible public face. The ``embedding`` and ``embedding_bag``
modules re-export the sharded embedding ops, which live in the
``shardwise-embedding`` distribution: importing them without it raises
ImportError saying to ``pip install shardwise-embedding``. This package
itself imports neither, so it imports without the plugin.
"""

from __future__ import annotations

__all__: list[str] = []
