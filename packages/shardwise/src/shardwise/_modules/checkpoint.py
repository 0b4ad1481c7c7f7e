"""Distributed checkpoints over any shardwise Group, written atomically.

:func:`save` and :func:`load` write and read the format of
``torch.distributed.checkpoint`` (DCP, file system storage): a checkpoint
saved here loads with ``dcp.load`` and the other way round. ShardedTensors
take part through the DCP protocol they implement, so a checkpoint saved on
N ranks loads on M ranks into tensors of any sharding spec, plain tensors
are saved once, and other values are saved as bytes.

What differs from calling DCP directly:

* Any :class:`~shardwise.Group` coordinates (MPI included), not only a torch
  process group. Ranks exchange their plans as strict JSON, never pickle.
* A load never runs code from the checkpoint: the ``.metadata`` file is
  unpickled with only DCP's metadata types allowed, and non-tensor values
  with ``torch.load(weights_only=True)`` (torch's own reader and planner
  unpickle both without restriction); see :mod:`shardwise._modules.safe_load`.
* A save is atomic: every rank writes into a temporary directory beside
  ``path``, which replaces ``path`` only once every rank has written its data
  and rank 0 the metadata. A save that fails or is killed half-way leaves the
  previous checkpoint at ``path`` as it was (its unfinished directory,
  ``.<name>.saving-<id>``, is removed by the next save that completes).
* An error on any rank (a bad path, a value that cannot be saved, a tensor
  of another global size at load) raises on every rank instead of leaving
  the others waiting: the rank at fault raises its own error, the others
  :class:`~shardwise.errors.PeerError` naming it.

``path`` must be a directory every rank can reach (a shared file system
when ranks are on several hosts). Tested with torch 2.13.

Example:
    >>> import shardwise, shardwise._modules.checkpoint
    >>> shardwise._modules.checkpoint.save({"model": model.state_dict(), "step": 100}, "ckpt/")
    >>> state = {"model": model.state_dict(), "step": 0}
    >>> shardwise._modules.checkpoint.load(state, "ckpt/")    # fills the tensors in place
    >>> model.load_state_dict(state["model"]); step = state["step"]

    With the optimizer (its state resharded to the parameters' current specs):

    >>> shardwise._modules.checkpoint.save({"model": model.state_dict(),
    ...                            "optim": shardwise._modules.checkpoint.optimizer_state(opt)}, "ckpt/")
    >>> shardwise._modules.checkpoint.load_optimizer(opt, "ckpt/", key="optim")
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from shardwise._comm.default_group import resolve_group
from shardwise._comm.group import Group
from shardwise._modules.optim_checkpoint import apply_loaded, empty_targets
from shardwise._modules.optim_checkpoint import optimizer_state as build
from shardwise._modules.safe_load import safe_planner, safe_reader
from shardwise._vocab import dcp_codec as codec

__all__ = ["load", "load_optimizer", "optimizer_state", "save"]

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]


def _together(group: Group, step: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (``Group.agree``)."""
    return group.agree(fn, op=f"checkpoint {step}")


def _coordinator_only(group: Group, step: str, fn: Callable[[], T]) -> Optional[T]:
    return _together(group, step, fn if group.rank == 0 else (lambda: None))


def save(state_dict: dict[str, Any], path: PathLike, *, process_group: Any = None) -> None:
    """Save ``state_dict`` (nested dicts of tensors, ShardedTensors and values) to the directory ``path``.

    Every rank of the group calls it with its own state dict (the same keys
    everywhere; ShardedTensors with their local shards). ``path`` is replaced
    atomically when the save is complete.

    Args:
        state_dict: What to save. Plain tensors and values are written
            once, by one of the ranks (DCP balances the writes between
            them), so they should be the same on every rank.
        path: Checkpoint directory (created; an existing one is replaced).
        process_group: A shardwise Group, a torch ProcessGroup or None (the
            default group).

    Raises:
        PeerError: the save failed on another rank (this rank's message
            names it and its error); ``path`` is unchanged.
        PeerLostError: a rank died or stopped answering during the save
            (see the group's timeout); ``path`` is unchanged.
        Exception: the error of this rank's own failure; ``path`` is unchanged.
    """
    # torch.distributed.checkpoint is heavy to import; only a save or a load needs it.
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter


    group = resolve_group(process_group)
    target = Path(os.fspath(path)).absolute()
    token = group.exchange(uuid.uuid4().hex if group.rank == 0 else None)[0]
    staging = target.parent / f".{target.name}.saving-{token}"
    coordinator = group.rank == 0
    planner = DefaultSavePlanner()
    writer = FileSystemWriter(staging)
    try:
        # Rank 0 makes the directory every rank then checks it sees: a rank given another path (a relative
        # one from another working directory) or a file system the others do not share would otherwise
        # write its part elsewhere, and the checkpoint would lack it.
        _coordinator_only(group, "creating the directory", lambda: staging.mkdir(parents=True))

        def local_plan() -> dict[str, Any]:
            if not staging.is_dir():
                raise ValueError(
                    f"rank {group.rank} does not see the directory rank 0 is saving into: this rank's path is "
                    f"{target}; every rank must pass the same checkpoint path, on a file system all ranks share"
                )
            meta = writer.storage_meta()
            if meta is not None:
                # The checkpoint's name is where it will be, not the staging directory renamed at the end.
                meta.checkpoint_id = target
            planner.set_up_planner(state_dict=state_dict, storage_meta=meta, is_coordinator=coordinator)
            writer.set_up_storage_writer(coordinator, rank=group.rank, use_collectives=True)
            return codec.encode_plan(writer.prepare_local_plan(planner.create_local_plan()))

        # As DCP: the coordinator alone receives every rank's plan and results, and sends each rank its
        # own final plan (an all-gather would hand every rank every plan: O(ranks x plans) each).
        plans = group.gather_json(_together(group, "planning", local_plan), 0, op="checkpoint planning")
        metadata: list[Any] = []

        def global_plan() -> list[dict[str, Any]]:
            assert plans is not None
            central, meta = planner.create_global_plan([codec.decode_plan(p) for p in plans])
            metadata.append(meta)
            return [codec.encode_plan(p) for p in writer.prepare_global_plan(central)]

        mine = group.scatter_json(_coordinator_only(group, "planning", global_plan), 0, op="checkpoint planning")

        def write() -> list[dict[str, Any]]:
            final = planner.finish_plan(codec.decode_plan(mine))
            written = writer.write_data(final, planner)
            written.wait()
            return codec.encode_results(written.value())

        results = group.gather_json(_together(group, "writing", write), 0, op="checkpoint writing")

        def finish() -> None:
            assert results is not None
            writer.finish(metadata=metadata[0], results=[codec.decode_results(r) for r in results])

        _coordinator_only(group, "metadata", finish)
        _coordinator_only(group, "replacing the old checkpoint", lambda: _replace(staging, target, token))
    except BaseException:
        if coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace(staging: Path, target: Path, token: str) -> None:
    """Put the complete ``staging`` directory at ``target``; the old checkpoint is removed only afterwards.

    Then removes what earlier saves to ``target`` left when they were killed:
    their unfinished ``.saving-*`` directories and ``.old-*`` copies (the
    checkpoint now at ``target`` is newer than any of them).
    """
    if not target.exists():
        os.replace(staging, target)
    else:
        old = target.parent / f".{target.name}.old-{token}"
        os.replace(target, old)
        # Between these two renames ``target`` is briefly missing; load() then finds the old copy.
        os.replace(staging, target)
        _remove(old)
    for leftover in _siblings(target, "saving") + _siblings(target, "old"):
        _remove(leftover)


def _remove(path: Path) -> None:
    """Remove a directory tree, or the plain file a save replaced (``rmtree`` leaves a file where it was)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _siblings(target: Path, kind: str) -> list[Path]:
    """``target``'s own ``.<name>.<kind>-<token>`` directories (never another checkpoint's).

    Matched exactly, not by glob: a name with ``[``, ``*`` or ``?`` in it, or
    one that is a prefix of another checkpoint's, must not reach that
    checkpoint's copies.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.{kind}-[0-9a-f]{{32}}")
    try:
        names = os.listdir(target.parent)
    except FileNotFoundError:
        return []
    return [target.parent / name for name in names if pattern.fullmatch(name)]


def _readable(path: Path) -> Path:
    """``path``, or the previous checkpoint a save was replacing when it was interrupted."""
    if path.exists():
        return path
    olds = sorted(_siblings(path, "old"), key=lambda p: p.stat().st_mtime)
    if olds and (olds[-1] / ".metadata").exists():
        return olds[-1]
    raise FileNotFoundError(f"no checkpoint at {path}")


def load(state_dict: dict[str, Any], path: PathLike, *, process_group: Any = None) -> None:
    """Load the checkpoint at ``path`` into ``state_dict``, in place.

    Tensors and ShardedTensors receive the saved values (a ShardedTensor may
    have any spec and any number of ranks); other values are replaced in
    ``state_dict``. Keys in ``state_dict`` must all be in the checkpoint.

    Args:
        state_dict: Tensors to fill, keyed as when saved.
        path: Checkpoint directory written by :func:`save` or ``dcp.save``.
        process_group: A shardwise Group, a torch ProcessGroup or None.

    Raises:
        PeerError: loading failed on another rank.
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: a tensor's global size differs from the saved one, its
            dtype is of another kind than the saved one (float into an
            integer or bool tensor, complex into a real one:
            ``torch.can_cast`` refuses; DCP itself would copy and truncate),
            or a key is missing from the checkpoint (naming every such key).
    """
    group = resolve_group(process_group)
    source = Path(os.fspath(path)).absolute()
    coordinator = group.rank == 0
    planner = safe_planner()
    reader: list[Any] = []

    planned: list[Any] = []

    def plan() -> dict[str, Optional[str]]:
        reader.append(safe_reader(_readable(source)))
        metadata = reader[0].read_metadata()
        planner.set_up_planner(state_dict, metadata, coordinator)
        _check_against(planner.state_dict, metadata, source)
        reader[0].set_up_storage_reader(metadata, coordinator, rank=group.rank, use_collectives=True)
        local = reader[0].prepare_local_plan(planner.create_local_plan())
        # The default planner and reader make no global decisions: each rank's plan stands alone.
        planned.append(reader[0].prepare_global_plan(planner.create_global_plan([local]))[0])
        saved = getattr(metadata, "storage_meta", None)
        return {"save": None if saved is None else saved.save_id, "path": str(source)}

    read_from = group.agree(plan, op="checkpoint planning", gather=True)
    differ = [r for r, seen in enumerate(read_from) if seen["save"] != read_from[0]["save"]]
    if differ:
        # Ranks given different paths would fill one state dict from several checkpoints.
        first = read_from[differ[0]]
        raise ValueError(
            f"ranks are loading different checkpoints: rank 0 the one at {read_from[0]['path']} (save "
            f"{read_from[0]['save']}), rank {differ[0]} the one at {first['path']} (save {first['save']}); every "
            "rank must pass the same checkpoint path"
        )
    central = planned[0]

    def read() -> None:
        reader[0].read_data(planner.finish_plan(central), planner).wait()

    _together(group, "reading", read)


def _check_against(flat: dict[str, Any], metadata: Any, source: Path) -> None:
    """Raise unless the checkpoint has every key of ``flat`` (the planner's flattened state dict) at its size and kind.

    DCP's planner finds these problems too, but one at a time and a
    missing key as a RuntimeError; this names every one, as a ValueError.

    Raises:
        ValueError: keys the checkpoint lacks (listing what it holds) or
            holds with another global size (naming both sizes) or a dtype
            that ``torch.can_cast`` refuses to cast to the target's.
    """
    # torch.distributed.checkpoint is heavy to import; only a save or a load needs it.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    problems = []
    missing = [key for key in flat if key not in saved]
    if missing:
        held = sorted(saved)
        shown = ", ".join(map(repr, held[:20])) + (f", ... ({len(held)} in all)" if len(held) > 20 else "")
        problems.append(f"it has no {', '.join(map(repr, missing))} (it holds {shown})")
    for key, value in flat.items():
        entry = saved.get(key)
        size = getattr(value, "size", None)
        if not isinstance(entry, TensorStorageMetadata) or not callable(size):
            continue
        if list(entry.size) != list(size()):
            problems.append(f"{key!r} was saved with size {list(entry.size)} but the tensor to load into has size "
                            f"{list(size())}")
        dtype = getattr(value, "dtype", None)
        if isinstance(dtype, torch.dtype) and not torch.can_cast(entry.properties.dtype, dtype):
            # DCP would copy_ the values across kinds (float to int truncates, complex to real drops a part).
            problems.append(f"{key!r} was saved as {entry.properties.dtype} and cannot be loaded into a "
                            f"{dtype} tensor without changing its kind of number (torch.can_cast refuses); load it "
                            "into a tensor of the saved dtype and convert it after")
    if problems:
        raise ValueError(f"cannot load the checkpoint at {source} into this state_dict: {'; '.join(problems)}")


def optimizer_state(optimizer: Any) -> dict[str, Any]:
    """A :class:`~shardwise.sharded_optim.ShardedOptimizer`'s state, ready to put in a state dict to :func:`save`.

    State shaped like a parameter's shards (momentum, Adam's moments) becomes
    a ShardedTensor laid out like the parameter, so it reshards on load;
    param groups name parameters, not shards.

    Returns:
        ``{"state": {param name: {field: value}}, "param_groups": [...]}``.
    """
    return build(optimizer)


def load_optimizer(optimizer: Any, path: PathLike, *, key: str = "optim", process_group: Any = None) -> None:
    """Load the optimizer state saved under ``key`` (from :func:`optimizer_state`) into ``optimizer``.

    Works for any number of ranks and any sharding of the parameters (the
    same parameter names and param groups): each rank receives the state of
    the shards it holds now.

    Args:
        optimizer: A ShardedOptimizer over the model's parameters.
        path: Checkpoint directory.
        key: Top-level key the optimizer state was saved under.
        process_group: A shardwise Group, a torch ProcessGroup or None.

    Raises:
        KeyError: the checkpoint has no optimizer state under ``key``.
        ValueError: the checkpoint names parameters this optimizer lacks.
        PeerError: loading failed on another rank.
    """
    # torch.distributed.checkpoint is heavy to import; only a save or a load needs it.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    group = resolve_group(process_group)
    source = Path(os.fspath(path)).absolute()

    def targets() -> dict[str, Any]:
        metadata = safe_reader(_readable(source)).read_metadata()
        saved: dict[str, dict[str, Any]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for flat, where in (metadata.planner_data or {}).items():
            if not where or where[0] != key:
                continue
            md = metadata.state_dict_metadata[flat]
            spec = (list(md.size), md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
            if len(where) == 4 and where[1] == "state":
                saved.setdefault(str(where[2]), {})[str(where[3])] = spec
            elif len(where) == 4 and where[1] == "param_groups":
                # A tensor hyperparameter (torch allows lr=torch.tensor(0.01)) needs a tensor to load into.
                target = None if spec is None else torch.zeros(spec[0], dtype=spec[1])
                groups.setdefault(int(where[2]), {})[str(where[3])] = target
        if not groups:
            raise KeyError(f"the checkpoint at {source} has no optimizer state under {key!r}")
        return {"state": empty_targets(optimizer, saved), "param_groups": [groups[i] for i in sorted(groups)]}

    built = _together(group, "reading the optimizer state's layout", targets)
    state = {key: built}
    load(state, source, process_group=group)
    _together(group, "applying the optimizer state",
              lambda: apply_loaded(optimizer, built["state"], built["param_groups"]))
