"""JSON forms of the torch.distributed.checkpoint records that ranks exchange while saving.

torch's own ``dcp.save`` gathers plans with ``gather_object`` (pickle), so a
peer's bytes are unpickled on the coordinator. :mod:`shardwise._modules.checkpoint`
sends the same records as strict JSON through ``Group.exchange`` instead;
decoding accepts only the fields and the dtypes, layouts and memory formats
listed here, so a peer can send data but never code.

The records are those of torch 2.13 (``SavePlan``, ``WriteItem``,
``WriteResult`` and the file system writer's ``_StoragePrefix`` and
``_StorageInfo``); a field this module does not know is an error, not a
silent loss.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["decode_plan", "decode_results", "encode_plan", "encode_results"]

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo, torch.sparse_csr, torch._mkldnn)}  # type: ignore[attr-defined]
_FORMATS = {str(v): v for v in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
                                torch.preserve_format)}


def _pick(table: Mapping[str, Any], name: Any, what: str) -> Any:
    if name not in table:
        raise ValueError(f"checkpoint plan from a peer has an unknown {what} {name!r}")
    return table[name]


def _index(index: MetadataIndex) -> dict[str, Any]:
    offset = None if index.offset is None else list(index.offset)
    return {"fqn": index.fqn, "offset": offset, "index": index.index}


def _unindex(data: dict[str, Any]) -> MetadataIndex:
    offset = None if data["offset"] is None else torch.Size(data["offset"])
    return MetadataIndex(str(data["fqn"]), offset, data["index"])


def _item(item: WriteItem) -> dict[str, Any]:
    out: dict[str, Any] = {"index": _index(item.index), "type": item.type.name, "bytes": None, "tensor": None}
    if item.bytes_io_data is not None:
        out["bytes"] = item.bytes_io_data.nbytes
    if item.tensor_data is not None:
        data, props = item.tensor_data, item.tensor_data.properties
        out["tensor"] = {
            "offsets": list(data.chunk.offsets),
            "sizes": list(data.chunk.sizes),
            "size": list(data.size),
            "dtype": str(props.dtype),
            "layout": str(props.layout),
            "requires_grad": bool(props.requires_grad),
            "memory_format": str(props.memory_format),
            "pin_memory": bool(props.pin_memory),
        }
    return out


def _unitem(data: dict[str, Any]) -> WriteItem:
    tensor_data: Optional[TensorWriteData] = None
    if data["tensor"] is not None:
        t = data["tensor"]
        props = TensorProperties(
            dtype=_pick(_DTYPES, t["dtype"], "dtype"),
            layout=_pick(_LAYOUTS, t["layout"], "layout"),
            requires_grad=bool(t["requires_grad"]),
            memory_format=_pick(_FORMATS, t["memory_format"], "memory format"),
            pin_memory=bool(t["pin_memory"]),
        )
        chunk = ChunkStorageMetadata(offsets=torch.Size(t["offsets"]), sizes=torch.Size(t["sizes"]))
        tensor_data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size(t["size"]))
    bytes_data = None if data["bytes"] is None else BytesIOWriteData(nbytes=int(data["bytes"]))
    return WriteItem(
        index=_unindex(data["index"]),
        type=_pick(WriteItemType.__members__, data["type"], "write item type"),
        bytes_io_data=bytes_data,
        tensor_data=tensor_data,
    )


def encode_plan(plan: SavePlan) -> dict[str, Any]:
    """A ``SavePlan`` of the default planner and file system writer as JSON-safe data."""
    storage = plan.storage_data
    if storage is not None and not isinstance(storage, _StoragePrefix):
        raise TypeError(f"cannot send a save plan whose storage data is a {type(storage).__name__}")
    mappings = plan.planner_data
    if mappings is not None and not isinstance(mappings, dict):
        raise TypeError(f"cannot send a save plan whose planner data is a {type(mappings).__name__}")
    return {
        "items": [_item(i) for i in plan.items],
        "prefix": None if storage is None else storage.prefix,
        # flatten_state_dict's mappings: flat key -> path of keys into the nested state dict.
        "mappings": None if mappings is None else {k: list(v) for k, v in mappings.items()},
        "usable": bool(plan.usable),
    }


def decode_plan(data: dict[str, Any]) -> SavePlan:
    """The inverse of :func:`encode_plan`."""
    mappings = data["mappings"]
    return SavePlan(
        items=[_unitem(i) for i in data["items"]],
        storage_data=None if data["prefix"] is None else _StoragePrefix(str(data["prefix"])),
        planner_data=None if mappings is None else {str(k): tuple(v) for k, v in mappings.items()},
        usable=bool(data["usable"]),
    )


def encode_results(results: list[WriteResult]) -> list[dict[str, Any]]:
    """What the file system writer reports for each written item, as JSON-safe data."""
    out = []
    for result in results:
        info = result.storage_data
        if not isinstance(info, _StorageInfo):
            raise TypeError(f"cannot send a write result whose storage data is a {type(info).__name__}")
        transforms = None if info.transform_descriptors is None else list(info.transform_descriptors)
        out.append({
            "index": _index(result.index),
            "size": int(result.size_in_bytes),
            "path": info.relative_path,
            "offset": int(info.offset),
            "length": int(info.length),
            "transforms": transforms,
        })
    return out


def decode_results(data: list[dict[str, Any]]) -> list[WriteResult]:
    """The inverse of :func:`encode_results`."""
    return [
        WriteResult(
            index=_unindex(r["index"]),
            size_in_bytes=int(r["size"]),
            storage_data=_StorageInfo(
                relative_path=str(r["path"]), offset=int(r["offset"]), length=int(r["length"]),
                transform_descriptors=None if r["transforms"] is None else [str(t) for t in r["transforms"]],
            ),
        )
        for r in data
    ]
