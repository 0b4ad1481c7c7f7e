"""What ranks compare before a verb moves data: the spec's target layout and a digest of the tensor's.

Every data-moving verb (``shard_tensor``, ``reshard``, ``gather``,
``full_tensor``) lets the ranks agree on what they were asked to do before
any byte moves; these are the facts they compare and the one wording of
"ranks disagree" they raise on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Optional, Sequence

from shardwise._comm.group import Group
from shardwise._tensor.placements import validate_placements
from shardwise._tensor.specs import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec
from shardwise._vocab.metadata import Placement, ShardedTensorMetadata

__all__ = [
    "SAME_TENSOR",
    "build_target",
    "check_same",
    "check_same_spec",
    "declared_placements",
    "layout_digest",
    "spec_fingerprint",
    "spec_text",
]

SAME_TENSOR = "every rank must call it on the same ShardedTensor (built with the same metadata)"


def layout_digest(md: ShardedTensorMetadata) -> str:
    """A short digest of ``md`` (boxes, placements, size, properties) for ranks to compare."""
    return hashlib.sha256(json.dumps(md.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def spec_text(spec: Any, limit: int = 160) -> str:
    """``spec``'s repr for an error message, cut to ``limit`` characters (a chunk spec of 4 096 ranks is long)."""
    text = repr(spec)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def spec_fingerprint(spec: ShardingSpec) -> dict[str, str]:
    """What ranks compare of a spec before its size is known: a digest of its value, and text for errors.

    A built-in spec's :meth:`~ShardingSpec.to_dict` is its value, so its
    digest compares it (a chunk spec of 4 096 placements in 16 bytes). A
    spec of another class is known only by its ``repr``, which may name an
    object's address (different in every process) or hide a difference:
    only its class is compared here, and the caller compares the layout it
    builds (:func:`layout_digest`) once the size is known.
    """
    value = spec.to_dict() if declared_placements(spec) is not None else {"type": type(spec).__qualname__}
    digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
    return {"digest": digest, "text": spec_text(spec)}


def check_same_spec(fingerprints: Sequence[dict[str, str]], hint: str) -> None:
    """Raise ValueError naming rank 0's and the first differing rank's spec if their fingerprints differ."""
    first = fingerprints[0]
    # The ranks whose spec equals rank 0's print as rank 0's, so the message names the first that differs.
    check_same([first["text"] if f["digest"] == first["digest"] else f["text"] for f in fingerprints],
               "sharding spec", hint)
    for r, fingerprint in enumerate(fingerprints):
        if fingerprint["digest"] != first["digest"]:
            raise ValueError(
                f"ranks disagree on the sharding spec: rank 0 and rank {r} passed specs that print alike "
                f"({fingerprint['text']}) but differ; {hint}"
            )


def check_same(values: Sequence[Any], what: str, hint: str) -> None:
    """Raise ValueError naming rank 0's and the first differing rank's value, if any differ."""
    for r, value in enumerate(values):
        if value != values[0]:
            # Also torch 2.13's wording ("src_rank=0 on rank: 0 does not match with src_rank=1 on rank: 1").
            name = what.replace(" ", "_")
            torch_words = (
                f" ({name}={values[0]} on rank: 0 does not match with {name}={value} on rank: {r})"
                if name.isidentifier()
                else ""
            )
            raise ValueError(
                f"ranks disagree on the {what}: rank 0 passed {values[0]}, rank {r} passed {value}; {hint}{torch_words}"
            )


def build_target(spec: ShardingSpec, md: ShardedTensorMetadata, group: Group, verb: str) -> ShardedTensorMetadata:
    """The metadata ``spec`` gives a tensor like ``md``'s, checked against the group.

    Raises:
        ValueError: the spec cannot shard a tensor of that size, or places a
            shard outside the group (the message names the spec and size).
    """
    size = list(md.size)
    try:
        target = spec.build_metadata(md.size, dataclasses.replace(md.tensor_properties))
        validate_placements(target.shards_metadata, group, need_rank=True)
        if list(target.size) != size:
            raise ValueError(f"it builds a tensor of size {list(target.size)}")
    except Exception as exc:
        raise ValueError(f"cannot {verb} a tensor of size {size} with {spec!r}: {exc}") from exc
    return target


def declared_placements(spec: Any) -> Optional[list[Optional[Placement]]]:
    """Every placement ``spec`` gives shards, known without the tensor's size; None when only its metadata says.

    A chunk spec makes one shard per placement (trailing ones possibly
    empty, but still made) and an enumerable spec one per listed shard, so
    a rank can check its devices before it learns the size (``shard_tensor``'s
    non-source ranks). A spec of another class, or one that builds its own
    metadata, must be asked with a size.
    """
    if isinstance(spec, ChunkShardingSpec) and type(spec).build_metadata is ChunkShardingSpec.build_metadata:
        return list(spec.placements)
    if isinstance(spec, EnumerableShardingSpec) and type(spec).build_metadata is EnumerableShardingSpec.build_metadata:
        return [shard.placement for shard in spec.shards]
    return None
