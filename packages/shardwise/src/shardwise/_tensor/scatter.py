"""The ShardedTensor entry points that move data: ``shard_tensor``, ``gather``, ``full_tensor`` (``reshard``: _reshard).

Each validates its arguments locally (a failing rank calls
``Group.reject``, so its peers raise PeerError instead of hanging), then
the ranks exchange what they were asked to do (spec, ``src_rank``,
``dst``, a digest of the tensor's metadata) and stop with the same
ValueError everywhere if they disagree. Only then does data move, through
:mod:`shardwise._layout.redistribute`: ``shard_tensor`` is a redistribution from "the
whole tensor on ``src_rank``" to the spec's layout, ``reshard`` one between
two layouts, ``gather`` one into "the whole tensor on ``dst``". Every
element goes straight from the rank that holds it to the rank that needs
it, once; pieces that stay on a rank never touch the wire. ``full_tensor``
is one all-gather of each rank's shards, after a two-int64 all-gather in
which the ranks agree on the digest of the tensor's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from shardwise._comm import buffers as _memory
from shardwise._layout.redistribute import box, execute, match_sources, plan, redistribute, row_major_start
from shardwise._vocab.metadata import (
    ShardMetadata,
    ShardedTensorMetadata,
    TensorProperties,
    dtype_from_name,
    dtype_name,
)
from shardwise._layout.plan import owners
from shardwise.errors import PeerError
from shardwise._vocab.shard import Shard

if TYPE_CHECKING:
    from shardwise._comm.group import Group
    from shardwise._tensor.sharded_tensor import ShardedTensor
    from shardwise._tensor.specs import ShardingSpec

__all__ = ["all_gather_tensor", "gather_to", "scatter_tensor", "shard_tensor"]


# -- agreement between ranks ---------------------------------------------------

SAME_TENSOR = "every rank must call it on the same ShardedTensor (built with the same metadata)"


def layout_digest(md: ShardedTensorMetadata) -> str:
    """A short digest of ``md`` (boxes, placements, size, properties) for ranks to compare."""
    return hashlib.sha256(json.dumps(md.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


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
    from shardwise._tensor.placements import validate_placements

    size = list(md.size)
    try:
        target = spec.build_metadata(md.size, dataclasses.replace(md.tensor_properties))
        validate_placements(target.shards_metadata, group, need_rank=True)
        if list(target.size) != size:
            raise ValueError(f"it builds a tensor of size {list(target.size)}")
    except Exception as exc:
        raise ValueError(f"cannot {verb} a tensor of size {size} with {spec!r}: {exc}") from exc
    return target


# -- shard_tensor ---------------------------------------------------------------


def _local_payload(tensor: Any, spec: Any, src_rank: Any, group: Group) -> dict[str, Any]:
    from shardwise._tensor.sharded_tensor import ShardedTensor
    from shardwise._tensor.specs import ShardingSpec

    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"sharding_spec must be a ShardingSpec, got {type(spec).__name__}")
    if isinstance(src_rank, bool) or not isinstance(src_rank, int):
        raise TypeError(f"src_rank must be an int, got {src_rank!r}")
    if not 0 <= src_rank < group.size:
        raise ValueError(
            f"src_rank={src_rank} is not a rank of the group (size {group.size}, ranks 0..{group.size - 1})"
        )
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
        what = (
            "a ShardedTensor (use reshard to change its spec)"
            if isinstance(tensor, ShardedTensor)
            else type(tensor).__name__
        )
        raise TypeError(f"shard_tensor takes a plain torch.Tensor, got {what}")
    if tensor.layout != torch.strided:
        raise TypeError(f"shard_tensor takes a dense (strided) tensor, got layout {tensor.layout}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"input tensor on rank {group.rank} is not a contiguous Tensor (strides {tensor.stride()}); "
            "call .contiguous() first"
        )
    payload: dict[str, Any] = {"src_rank": src_rank, "spec": spec.to_dict()}
    if group.rank == src_rank:
        props = TensorProperties.create_from_tensor(tensor)
        payload["tensor"] = {"size": list(tensor.size()), "props": props.to_dict()}
    return payload


def shard_tensor(
    tensor: torch.Tensor, sharding_spec: ShardingSpec, src_rank: int = 0, process_group: Any = None
) -> ShardedTensor:
    """Shard ``tensor``, held by ``src_rank``, across the group by ``sharding_spec``.

    torch 2.13's ``_shard_tensor``, for any spec (torch supports only
    ``ChunkShardingSpec``). Every rank calls it. Ranks first exchange their
    ``src_rank`` and spec (as JSON) and ``src_rank`` its tensor's size,
    dtype and ``requires_grad``; then each shard goes straight from
    ``src_rank`` to its owner in one all-to-all (``src_rank``'s own shards
    are copied locally).

    Only ``src_rank``'s ``tensor`` is read. The other ranks must pass a
    contiguous tensor too, but its size and dtype are ignored, so a
    placeholder such as ``torch.empty(0)`` will do (torch needs the same
    size everywhere; passing it is of course fine).

    Args:
        tensor: The whole tensor (on ``src_rank``); contiguous on every rank.
        sharding_spec: How to shard it; the same on every rank.
        src_rank: Rank of the group whose ``tensor`` is sharded; the same on
            every rank.
        process_group: Group, torch ProcessGroup or None (default group).

    Returns:
        The ShardedTensor; its local shards are new leaf tensors (never
        views of ``tensor``) whose ``requires_grad`` is that of
        ``src_rank``'s tensor.

    Raises:
        ValueError: ranks pass different specs or ``src_rank`` values; the
            spec cannot shard a tensor of that size or places a shard
            outside the group (all on every rank); ``src_rank`` is outside
            the group or a rank's tensor is not contiguous (on that rank;
            its peers raise :class:`~shardwise.errors.PeerError`).
        TypeError: a rank passed something other than a tensor or a spec
            (on that rank; peers raise PeerError).
    """
    if _overrides_shard(sharding_spec):
        # As torch's _shard_tensor: a spec that implements shard() itself decides how it shards.
        return sharding_spec.shard(tensor, src_rank=src_rank, process_group=process_group)
    return scatter_tensor(tensor, sharding_spec, src_rank, process_group)


def _overrides_shard(spec: Any) -> bool:
    """Whether ``spec``'s class defines its own ``shard`` (the base class's is :func:`scatter_tensor`)."""
    from shardwise._tensor.specs import ShardingSpec

    return isinstance(spec, ShardingSpec) and type(spec).shard is not ShardingSpec.shard


def scatter_tensor(
    tensor: torch.Tensor, sharding_spec: ShardingSpec, src_rank: int = 0, process_group: Any = None
) -> ShardedTensor:
    """:func:`shard_tensor`'s data movement, which ``ShardingSpec.shard`` runs (it never calls a spec's ``shard``)."""
    from shardwise._comm.default_group import resolve_group
    from shardwise._tensor.sharded_tensor import ShardedTensor

    group = resolve_group(process_group)
    if not group.is_member:
        return _outside_group(tensor, sharding_spec, group)
    try:
        payload = _local_payload(tensor, sharding_spec, src_rank, group)
    except (TypeError, ValueError) as exc:
        group.reject(exc, op="shard_tensor")
    entries = group.exchange(payload, op="shard_tensor")
    check_same([e["src_rank"] for e in entries], "src_rank", "every rank must pass the same src_rank")
    check_same([e["spec"] for e in entries], "sharding spec", "every rank must pass the same spec")
    info = entries[src_rank]["tensor"]
    size = torch.Size(info["size"])
    props = TensorProperties.from_dict(info["props"])
    device = str(tensor.device) if group.rank == src_rank else "cpu"
    # src_rank is a rank of the group; placements name global ranks.
    whole = ShardedTensorMetadata(
        [ShardMetadata([0] * len(size), list(size), f"rank:{group.ranks[src_rank]}/{device}")], size, props
    )
    target = build_target(sharding_spec, whole, group, "shard")
    mine = [Shard(tensor, whole.shards_metadata[0])] if group.rank == src_rank else []
    shards = redistribute(mine, whole, target, group, trusted=True)
    return ShardedTensor._create(sharding_spec, target, shards, group)


def _outside_group(tensor: Any, spec: Any, group: Group) -> ShardedTensor:
    """``shard_tensor`` on a rank outside the group: no local shards, metadata from this rank's own arguments.

    Such a rank cannot hear from ``src_rank``; torch requires every rank to
    pass a tensor of the full size, so its own tensor gives the size and
    properties (torch 2.13 itself fails here with a bare AssertionError).
    """
    from shardwise._tensor.sharded_tensor import ShardedTensor
    from shardwise._tensor.specs import ShardingSpec

    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"sharding_spec must be a ShardingSpec, got {type(spec).__name__}")
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
        raise TypeError(f"shard_tensor takes a plain torch.Tensor, got {type(tensor).__name__}")
    md = spec.build_metadata(tensor.size(), TensorProperties.create_from_tensor(tensor))
    return ShardedTensor._create(spec, md, [], group)


# -- gather and full_tensor ----------------------------------------------------


def _whole(md: ShardedTensorMetadata, rank: int, device: str = "cpu") -> ShardedTensorMetadata:
    """``md``'s tensor as one shard on global rank ``rank``."""
    n = len(md.size)
    return ShardedTensorMetadata(
        [ShardMetadata([0] * n, list(md.size), f"rank:{rank}/{device}")], md.size, md.tensor_properties
    )


def _gather_payload(st: ShardedTensor, group: Group, dst: Any, out: Any, dtype: Any, enforce: bool) -> dict[str, Any]:
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < group.size:
        raise ValueError(f"dst={dst!r} is not a rank of the group (size {group.size})")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    match_sources(st._local_shards, st._metadata, group.global_rank)
    payload = {
        "dst": dst,
        "dtype": dtype_name(dtype) if dtype else None,
        "enforce_dtype": enforce,
        "layout": layout_digest(st._metadata),
        "out": None,
    }
    size = tuple(st._metadata.size)
    if group.rank != dst:
        if out is not None:
            raise ValueError(
                f"Argument ``out`` must NOT be specified on non-destination ranks "
                f"(rank {group.rank}; dst={dst}); pass None"
            )
        return payload
    if out is None:
        raise ValueError(
            f"Argument ``out`` must be specified on destination rank {dst}: a tensor of size {size} to gather into"
        )
    from shardwise._tensor.sharded_tensor import ShardedTensor

    if not isinstance(out, torch.Tensor) or isinstance(out, ShardedTensor):
        raise TypeError(f"out must be a plain torch.Tensor, got {type(out).__name__}")
    if tuple(out.size()) != size:
        raise ValueError(f"Argument ``out`` has size {tuple(out.size())}, but should be {size}")
    payload["out"] = dtype_name(out.dtype)
    return payload


def gather_to(
    st: ShardedTensor,
    dst: int = 0,
    out: Optional[torch.Tensor] = None,
    *,
    enforce_dtype: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write the whole of ``st`` into ``out`` on rank ``dst`` (torch 2.13's ``ShardedTensor.gather``).

    Every rank sends its shards straight to ``dst`` in one all-to-all;
    ``dst`` copies its own shards without the wire and writes what arrives
    into ``out``.

    Args:
        st: The sharded tensor.
        dst: The receiving rank (the same on every rank).
        out: On ``dst``, a tensor of ``st``'s size; None elsewhere (torch
            2.13 only notices a non-empty tensor there, shardwise any).
        enforce_dtype: Deprecated (as in torch): cast to ``out``'s dtype.
        dtype: Cast shards to this dtype before sending.

    Raises:
        ValueError: ``out`` is missing on ``dst``, given elsewhere, of the
            wrong size, or of a dtype the data cannot be cast to safely;
            ``dst`` or ``dtype`` differ between ranks. Every rank raises
            (the rank at fault the real error, its peers PeerError when
            the fault is local).
    """
    if enforce_dtype:
        warnings.warn("`enforce_dtype` is deprecated. Please use `dtype` instead.", FutureWarning, stacklevel=4)
    group = st._process_group
    if not group.is_member:
        # dst is a rank of the group, so this rank is not it: nothing to send, nothing to receive.
        if out is not None:
            raise ValueError("Argument ``out`` must NOT be specified on non-destination ranks (this rank is "
                             "outside the tensor's process group); pass None")
        return
    try:
        mine = _gather_payload(st, group, dst, out, dtype, bool(enforce_dtype))
    except (TypeError, ValueError) as exc:
        group.reject(exc, op="gather")
    entries = group.exchange(mine, op="gather")
    for key in ("dst", "dtype", "enforce_dtype"):
        check_same([e[key] for e in entries], f"gather {key}", f"every rank must pass the same {key}")
    check_same([e["layout"] for e in entries], "tensor's layout (digest of its metadata)", SAME_TENSOR)
    out_dtype = dtype_from_name(entries[dst]["out"])
    wire = st._metadata.tensor_properties.dtype
    if dtype is not None:
        wire = dtype
    elif enforce_dtype:
        wire = out_dtype
    if not torch.can_cast(wire, out_dtype):
        raise ValueError(f"gather: cannot write {wire} data into ``out`` of dtype {out_dtype} without losing values")
    md = st._metadata
    target = _whole(md, group.ranks[dst])
    pl = plan(md, target, group.rank, group.size, group.global_to_group())
    sources = match_sources(st._local_shards, md, group.global_rank)
    execute(pl, sources, {0: out} if out is not None else {}, group, wire, trusted=True)


def _home_device(st: ShardedTensor) -> torch.device:
    if st._local_shards:
        return st._local_shards[0].tensor.device
    for entry in st._metadata.shards_metadata:
        if entry.placement is not None and entry.placement.rank() == st._process_group.global_rank:
            return entry.placement.device()
    return torch.device(st._process_group.device)


def _agree_to_gather_all(st: ShardedTensor, group: Group) -> dict[int, torch.Tensor]:
    """This rank's shards by metadata index, once every rank has checked that all hold the same tensor.

    Every rank derives from its own metadata which bytes each peer sends
    and where they go, so ranks holding tensors built with different
    metadata (another size or spec on one rank) would otherwise fail on
    some ranks only, or silently assemble garbage. One all-gather of a
    two-int64 row per rank (this rank's status and a digest of its
    metadata) lets every rank reach the same verdict.

    Raises:
        ValueError: the ranks' metadata differ (on every rank), or this
            rank's local shards do not match its metadata (on this rank).
        PeerError: another rank's local shards do not match its metadata.
    """
    md = st._metadata
    error: Optional[ValueError] = None
    sources: dict[int, torch.Tensor] = {}
    try:
        sources = match_sources(st._local_shards, md, group.global_rank)
    except ValueError as exc:
        error = exc
    digest = int.from_bytes(bytes.fromhex(layout_digest(md)), "big", signed=True)
    mine = torch.tensor([int(error is not None), digest], dtype=torch.int64, device=group.device)
    table = torch.empty(2 * group.size, dtype=torch.int64, device=group.device)
    with group.unverified():  # a fixed two-int64 row: the handshake would only repeat this check
        group.all_gather(mine, out=table)
    rows = table.view(group.size, 2).tolist()
    if error is not None:
        raise error
    failed = [r for r, (status, _) in enumerate(rows) if status]
    if failed:
        raise PeerError(
            f"full_tensor: rank(s) {failed} hold local shards that do not match the tensor's metadata, "
            "so no data was sent; see that rank's traceback for the cause"
        )
    check_same(
        [f"{d & 0xFFFFFFFFFFFFFFFF:016x}" for _, d in rows],
        "tensor's layout (digest of its metadata)",
        f"{SAME_TENSOR}; this rank's has size {list(md.size)} and spec {st._sharding_spec!r}",
    )
    return sources


def all_gather_tensor(st: ShardedTensor) -> torch.Tensor:
    """The whole of ``st`` on every rank (a new tensor on this rank's shard device, not part of autograd).

    A small all-gather first checks that every rank holds the same tensor
    (its metadata's digest; ValueError on every rank if not), then one
    all-gather of each rank's shards: every rank receives every
    element once. When the shards, taken rank by rank, are consecutive
    row-major ranges of the tensor (a dim-0 chunk spec in rank order), the
    gathered buffer is the result and no further copy is made.
    """
    md = st._metadata
    group = st._process_group
    if not group.is_member:
        raise ValueError(
            "full_tensor: this rank is outside the tensor's process group (torch's GroupMember.NON_GROUP_MEMBER); "
            "only the group's members hold its data"
        )
    dtype, device = md.tensor_properties.dtype, _home_device(st)
    sources = (
        _agree_to_gather_all(st, group) if group.size > 1 else match_sources(st._local_shards, md, group.global_rank)
    )
    # After the agreement: every rank holds the same metadata, so this fails on every rank or none.
    holders = owners(md.shards_metadata, len(md.size), "tensor", group.global_to_group(), group.size)
    result = _memory.empty(md.size, dtype, device)
    by_rank: list[list[int]] = [[] for _ in range(group.size)]
    for i, entry in enumerate(md.shards_metadata):
        if entry.numel() > 0:
            by_rank[holders[i]].append(i)
    with torch.no_grad():
        if group.size == 1 or result.numel() == 0:
            for i, t in sources.items():
                # An empty shard may sit anywhere, even past the end, where narrow would refuse its offsets.
                if t.numel():
                    box(result, md.shards_metadata[i].shard_offsets, t.shape).copy_(t)
            return result
        mine = [sources[i] for i in by_rank[group.rank]]
        if len(mine) == 1 and mine[0].is_contiguous() and mine[0].dtype == dtype:
            flat = mine[0].detach().reshape(-1)
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in mine]) if mine else result.new_empty(0)
        parts = [p.view(dtype) for p in group.all_gather(flat.view(torch.uint8))]
        whole = _contiguous_result(parts, md, by_rank)
        if whole is not None:
            return whole.view(md.size).to(device)
        for r, part in enumerate(parts):
            pos = 0
            for i in by_rank[r]:
                entry = md.shards_metadata[i]
                n = entry.numel()
                box(result, entry.shard_offsets, entry.shard_sizes).copy_(part[pos : pos + n].view(entry.shard_sizes))
                pos += n
    return result


def _contiguous_result(
    parts: list[torch.Tensor], md: ShardedTensorMetadata, by_rank: list[list[int]]
) -> Optional[torch.Tensor]:
    """The gathered buffer as the flat result, when it already is one (else None)."""
    expected = 0
    for r in range(len(parts)):
        for i in by_rank[r]:
            entry = md.shards_metadata[i]
            if row_major_start(entry.shard_offsets, entry.shard_sizes, list(md.size)) != expected:
                return None
            expected += entry.numel()
    base = parts[0]
    storage = base.untyped_storage()
    item = base.element_size()
    if storage.nbytes() < base.storage_offset() * item + expected * item:
        return None
    for r, part in enumerate(parts):
        offset = sum(p.numel() for p in parts[:r])
        if part.numel() and part.data_ptr() != base.data_ptr() + offset * item:
            return None
    return base.new_empty(0).set_(storage, base.storage_offset(), (expected,), (1,))
