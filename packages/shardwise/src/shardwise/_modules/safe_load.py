"""Loading a checkpoint without letting its files run code.

torch 2.13's DCP unpickles two things from a checkpoint with no
restriction: ``FileSystemReader.read_metadata`` reads the ``.metadata``
file with plain ``pickle.load``, and ``DefaultLoadPlanner.load_bytes``
reads every non-tensor value with ``torch.load(weights_only=False)``. A
checkpoint directory from anywhere (a shared file system, a download) could
name any importable callable there and have it called on every rank that
loads. shardwise reads both restricted:

* the metadata (only plain data: DCP's metadata dataclasses, sizes, dtypes,
  paths) with an unpickler that resolves exactly those names and refuses
  every other one before anything is called;
* values with ``torch.load(weights_only=True)``, which allows tensors and
  plain Python data (numbers, strings, lists, dicts), what state dicts hold.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch

from shardwise._modules.load_plan import local_load_plan
from shardwise.errors import UnsafeCheckpointError

__all__ = ["UnsafeCheckpointError", "load_metadata", "safe_planner", "safe_reader"]

#: (module, name) pairs a DCP metadata pickle may refer to. Dtypes and
#: layouts are checked by type below rather than listed.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}

#: Where Python 3.13 and later define the path classes (pickles name them there).
_PATH_MODULES = ("pathlib._local", "pathlib._abc")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module in _PATH_MODULES and ("pathlib", name) in _ALLOWED:
            # Python 3.13 pickles paths under the private module that now defines them; any Python reads them.
            return getattr(pathlib, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata {self._source} refers to {module}.{name}, which checkpoint metadata never "
            "contains; refusing to load it (unpickling it could run code). Only load checkpoints you trust, and "
            "check that this one was written by torch.distributed.checkpoint or shardwise._modules.checkpoint"
        )


def load_metadata(file: Any, source: str) -> Any:
    """Unpickle DCP metadata from ``file`` (named ``source`` in errors), allowing only metadata types.

    Raises:
        UnsafeCheckpointError: the pickle refers to anything else.
    """
    return _MetadataUnpickler(file, source).load()


def safe_reader(path: Path) -> Any:
    """A ``FileSystemReader`` for ``path`` whose ``read_metadata`` uses :func:`load_metadata`."""
    # torch.distributed.checkpoint is heavy to import; only a checkpoint load needs it.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as stream:
                metadata = load_metadata(stream, str(metadata_path))
            # As torch's reader does: older files lack storage_meta; the load id is this reader's.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


def safe_planner() -> Any:
    """A ``DefaultLoadPlanner`` whose non-tensor values load with ``torch.load(weights_only=True)``.

    Its errors name the key, so a value that needs more than plain data
    (an arbitrary object saved by pickle) says which one and why.
    """
    # torch.distributed.checkpoint is heavy to import; only a checkpoint load needs it.
    from torch.distributed.checkpoint import DefaultLoadPlanner, _version
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    class _SafePlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            """As ``DefaultLoadPlanner``'s, the flattening of a checkpoint saved before torch 2.4 chosen here.

            torch 2.13 chooses it in ``create_local_plan``; here the keys
            are final when set-up ends, so the check of every key against
            the checkpoint (before planning) sees the names the load uses.
            """
            super().set_up_planner(state_dict, metadata, is_coordinator)
            if self.flatten_state_dict and self.metadata is not None:
                # As torch 2.13: keys missing under the current flattening may be a checkpoint saved before 2.4.
                missing = set(self.metadata.state_dict_metadata) - set(self.state_dict)
                if missing:
                    _version._derived_version = "2_3"
                    try:
                        old_state_dict, old_mappings = flatten_state_dict(self.original_state_dict)
                    finally:
                        _version._derived_version = None
                    if set(old_state_dict) & missing:
                        self.state_dict, self.mappings = old_state_dict, old_mappings

        def create_local_plan(self) -> Any:
            """As ``DefaultLoadPlanner``'s, its reads found by :func:`~shardwise._modules.load_plan.local_load_plan`."""
            if self.metadata is None:
                raise AssertionError("the planner was not set up with the checkpoint's metadata")
            return local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(
                    f"checkpoint value {fqn!r} is not plain data (tensors, numbers, strings, lists, dicts) and "
                    f"is not loaded: unpickling it could run code ({exc})"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return _SafePlanner()
