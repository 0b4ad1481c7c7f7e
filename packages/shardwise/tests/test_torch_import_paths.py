"""Every module path and public name of torch 2.13's ``torch.distributed._shard`` exists under ``shardwise``.

The walk enumerates the installed torch's package at test time (pkgutil),
so a module or name torch adds shows up here as a failure. Then the helpers
shardwise implements for these paths are compared with torch's results:
in-process (hypothesis) and on 2 ranks through the harness.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import warnings
from types import ModuleType
from typing import Any, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import shardwise
from shardwise.sharded_tensor import ShardMetadata, ShardedTensorMetadata, TensorProperties
from shardwise.sharding_spec import ChunkShardingSpec

from rank_helpers import HAS_TORCH_PG
from rank_helpers import run as _run

TORCH = "torch.distributed._shard"

with warnings.catch_warnings():
    # Importing torch's checkpoint alias warns that it is deprecated; nothing here uses it.
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch.distributed._shard as torch_shard
    import torch.distributed._shard.sharded_tensor.reshard as torch_reshard
    import torch.distributed._shard.sharded_tensor.utils as torch_st_utils
    import torch.distributed._shard.sharding_spec._internals as torch_internals
    from torch.distributed._shard._utils import narrow_tensor as torch_narrow_tensor
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata as TorchSTMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunk

#: Not walked: ``checkpoint`` is torch's alias of DCP (``shardwise.checkpoint``
#: is shardwise's own API), ``logger``/``logging_handlers`` torch's private logging.
EXCLUDED = {"checkpoint": "torch's DCP alias", "logger": "torch's logging", "logging_handlers": "torch's logging"}

#: Private modules outside code imports all the same, so they are walked too.
PRIVATE_BUT_USED = {"sharding_spec._internals", "sharding_spec.chunk_sharding_spec_ops._common"}

#: Modules and names that re-export the optional shardwise-embedding distribution.
PLUGIN_MODULES = {
    "sharding_spec.chunk_sharding_spec_ops.embedding",
    "sharding_spec.chunk_sharding_spec_ops.embedding_bag",
}
PLUGIN_NAMES = {
    ("sharded_tensor", "sharded_embedding"),
    ("sharded_tensor", "sharded_embedding_bag"),
    ("sharding_spec.chunk_sharding_spec_ops", "embedding"),
    ("sharding_spec.chunk_sharding_spec_ops", "embedding_bag"),
}
HAS_PLUGIN = importlib.util.find_spec("shardwise_embedding") is not None
NO_PLUGIN = "shardwise-embedding is not installed (tox env core has no plugins); its modules re-export it"

#: Private module-level functions outside code imports from torch's modules.
EXTRA_NAMES = {
    "": ["_shard_tensor"],
    "api": ["_shard_tensor", "_reshard_output", "_collect_local_shard", "_get_current_process_group"],
    "common_op_utils": ["_basic_validation", "_register_default_op"],
    "op_registry_utils": ["_register_op", "_decorator_func"],
    "sharded_tensor.api": ["_create_tensor_from_params"],
    "sharded_tensor.utils": ["_parse_and_validate_remote_device"],
    "sharding_spec.api": ["_infer_sharding_spec_from_shards_metadata"],
    "sharding_spec.chunk_sharding_spec_ops._common": ["_register_sharded_op_on_local_tensor"],
}


def _rel(name: str) -> str:
    return name[len(TORCH) :].lstrip(".")


def _is_private(rel: str) -> bool:
    return any(part.startswith("_") for part in rel.split(".") if part)


def _walk(package: ModuleType) -> Iterator[str]:
    """Every module under ``package`` (pkgutil), not descending into excluded packages.

    (pkgutil.walk_packages would import torch's checkpoint alias, which warns on import whatever the filters.)
    """
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name.rsplit(".", 1)[-1] in EXCLUDED:
            continue
        yield info.name
        if info.ispkg:
            yield from _walk(importlib.import_module(info.name))


def torch_modules() -> list[str]:
    """The walked modules, relative to ``torch.distributed._shard`` (``""`` is the package itself)."""
    return [""] + [rel for rel in map(_rel, _walk(torch_shard)) if not _is_private(rel) or rel in PRIVATE_BUT_USED]


MODULES = torch_modules()


def torch_module(rel: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"{TORCH}.{rel}" if rel else TORCH)


def shardwise_name(rel: str) -> str:
    return f"shardwise.{rel}" if rel else "shardwise"


def _names_from_shard_source(module: ModuleType) -> set[str]:
    """Top-level names the module's source assigns or imports from ``torch.distributed._shard``."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(TORCH)):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def torch_public_names(module: ModuleType) -> set[str]:
    """The names of the ``_shard`` API a module exposes.

    ``__all__`` where torch defines it. Otherwise every name without a
    leading underscore whose value belongs to ``torch.distributed._shard``:
    a class or function defined there, a public module of it (private
    submodules such as ``sharded_tensor._ops.init`` are internals), or data
    the module assigns or imports from there. Names the module merely
    imports from elsewhere (``torch``, ``dataclass``, ``TYPE_CHECKING``) are
    not its API.
    """
    if hasattr(module, "__all__"):
        return set(module.__all__)
    from_source = _names_from_shard_source(module)
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if inspect.ismodule(value):
            if value.__name__.startswith(TORCH) and not _is_private(_rel(value.__name__)):
                names.add(name)
        elif inspect.isclass(value) or callable(value):
            if (getattr(value, "__module__", None) or "").startswith(TORCH):
                names.add(name)
        elif name in from_source:
            names.add(name)
    return names


@pytest.fixture(scope="module")
def imported() -> dict[str, ModuleType]:
    """Every walked shardwise module, imported (so packages carry their submodules as attributes)."""
    out = {}
    for rel in MODULES:
        if rel in PLUGIN_MODULES and not HAS_PLUGIN:
            continue
        out[rel] = importlib.import_module(shardwise_name(rel))
    return out


def test_the_walk_finds_torch_modules() -> None:
    # Guards the walk itself: these must be among what it enumerates.
    for rel in ("", "api", "metadata", "sharded_tensor.api", "sharding_spec.chunk_sharding_spec", *PRIVATE_BUT_USED):
        assert rel in MODULES, rel
    assert not [m for m in MODULES if m.split(".")[0] == "checkpoint" or "logg" in m]
    assert not [m for m in MODULES if m.startswith("sharded_tensor._ops")]


@pytest.mark.parametrize("rel", MODULES)
def test_module_imports_under_shardwise(rel: str) -> None:
    if rel in PLUGIN_MODULES and not HAS_PLUGIN:
        pytest.skip(NO_PLUGIN)
    module = importlib.import_module(shardwise_name(rel))
    assert module.__name__ == shardwise_name(rel)


@pytest.mark.parametrize("rel", MODULES)
def test_public_names_resolve(rel: str, imported: dict[str, ModuleType]) -> None:
    if rel not in imported:
        pytest.skip(NO_PLUGIN)
    ours = imported[rel]
    theirs = torch_module(rel)
    wanted = sorted(torch_public_names(theirs) | set(EXTRA_NAMES.get(rel, [])))
    missing = []
    for name in wanted:
        if (rel, name) in PLUGIN_NAMES and not HAS_PLUGIN:
            continue
        if not hasattr(ours, name):
            missing.append(name)
            continue
        value = getattr(theirs, name)
        if inspect.ismodule(value):
            # A module name (a submodule, or an alias such as sharding_spec.api.sharded_tensor_meta)
            # must name shardwise's module at the same path.
            assert getattr(ours, name).__name__ == shardwise_name(_rel(value.__name__)), (rel, name)
    assert not missing, f"shardwise.{rel} lacks torch's names {missing}"


def test_extra_names_are_torchs() -> None:
    # The private names listed above really are torch's (so the list cannot drift into inventions).
    for rel, names in EXTRA_NAMES.items():
        for name in names:
            assert callable(getattr(torch_module(rel), name)), (rel, name)


def _params(fn: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def _simple(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, torch.layout, torch.memory_format))


def check_signature(theirs: Any, ours: Any) -> list[str]:
    """Differences that break a call written for torch: problems as strings (empty when compatible).

    torch's parameters must appear in shardwise's in the same order with the
    same names, kinds and (simple) defaults; a parameter shardwise adds must
    be optional, so every call torch accepts binds the same way.
    """
    problems = []
    mine = {p.name: p for p in _params(ours)}
    order = [p.name for p in _params(ours)]
    shared = [p.name for p in _params(theirs)]
    if [n for n in order if n in shared] != shared:
        problems.append(f"parameters {order} do not contain torch's {shared} in order")
    for p in _params(theirs):
        q = mine.get(p.name)
        if q is None:
            continue
        if q.kind != p.kind:
            problems.append(f"{p.name} is {q.kind.description}, torch's is {p.kind.description}")
        if (p.default is inspect.Parameter.empty) != (q.default is inspect.Parameter.empty):
            problems.append(f"{p.name}: default {q.default!r}, torch's {p.default!r}")
        elif _simple(p.default) and p.default is not inspect.Parameter.empty and p.default != q.default:
            problems.append(f"{p.name}: default {q.default!r}, torch's {p.default!r}")
    for q in _params(ours):
        if (
            q.name not in shared
            and q.default is inspect.Parameter.empty
            and q.kind
            not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            )
        ):
            problems.append(f"shardwise adds the required parameter {q.name}")
    return problems


def shared_functions() -> Iterator[tuple[str, str]]:
    for rel in MODULES:
        if rel in PLUGIN_MODULES and not HAS_PLUGIN:
            continue
        theirs = torch_module(rel)
        for name in sorted(torch_public_names(theirs) | set(EXTRA_NAMES.get(rel, []))):
            if (rel, name) in PLUGIN_NAMES and not HAS_PLUGIN:
                continue
            if inspect.isfunction(getattr(theirs, name)):
                yield rel, name


@pytest.mark.parametrize(("rel", "name"), list(shared_functions()))
def test_signatures_match_torch(rel: str, name: str, imported: dict[str, ModuleType]) -> None:
    ours = getattr(imported[rel], name)
    theirs = getattr(torch_module(rel), name)
    assert not check_signature(theirs, ours), (rel, name, check_signature(theirs, ours))


def test_signature_check_catches_differences() -> None:
    def torchs(a: Any, b: Any = 0, *, c: Any = None) -> None: ...

    def renamed(a: Any, bb: Any = 0, *, c: Any = None) -> None: ...

    def other_default(a: Any, b: Any = 1, *, c: Any = None) -> None: ...

    def required_extra(a: Any, b: Any = 0, *, c: Any = None, d: Any) -> None: ...

    def optional_extra(a: Any, b: Any = 0, *, c: Any = None, d: Any = 2) -> None: ...

    def absorbed(a: Any, b: Any = 0, **kwargs: Any) -> None: ...

    for bad in (renamed, other_default, required_extra, absorbed):
        assert check_signature(torchs, bad), bad
    assert check_signature(torchs, optional_extra) == []
    assert check_signature(torchs, torchs) == []


# -- the embedding modules without the plugin ------------------------------------


@pytest.mark.parametrize("rel", sorted(PLUGIN_MODULES))
def test_embedding_modules_say_what_to_install(rel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "shardwise_embedding", None)  # as if not installed
    monkeypatch.delitem(sys.modules, shardwise_name(rel), raising=False)
    with pytest.raises(ModuleNotFoundError, match="pip install shardwise-embedding"):
        importlib.import_module(shardwise_name(rel))
    import shardwise.sharded_tensor as st

    with pytest.raises(ModuleNotFoundError, match="pip install shardwise-embedding"):
        _ = st.sharded_embedding
    # The packages above them import without it.
    importlib.reload(importlib.import_module("shardwise.sharding_spec.chunk_sharding_spec_ops"))
    with pytest.raises(AttributeError):
        _ = st.no_such_name


# -- constants ---------------------------------------------------------------------


def test_constants_equal_torchs() -> None:
    from torch.distributed._shard.sharded_tensor.api import DEPRECATE_MSG
    from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING

    from shardwise.sharded_tensor import api, metadata

    assert api.DEPRECATE_MSG == DEPRECATE_MSG
    assert {m.name: m.value for m in metadata.MEM_FORMAT_ENCODING} == {m.name: m.value for m in MEM_FORMAT_ENCODING}
    assert shardwise._shard_tensor is shardwise.api._shard_tensor


# -- chunk arithmetic, against torch (no processes) -------------------------------

from shardwise.sharded_tensor import reshard as sw_reshard  # noqa: E402
from shardwise.sharded_tensor import utils as sw_utils  # noqa: E402
from shardwise.sharding_spec import _internals as sw_internals  # noqa: E402
from shardwise.sharding_spec.chunk_sharding_spec import narrow_tensor  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(hst.integers(0, 10**6), hst.integers(1, 64), hst.integers(0, 80))
def test_chunk_sizes_equal_torchs(dim_size: int, chunks: int, idx: int) -> None:
    split = sw_internals.get_split_size(dim_size, chunks)
    assert split == torch_internals.get_split_size(dim_size, chunks)
    assert sw_internals.get_chunked_dim_size(dim_size, split, idx) == torch_internals.get_chunked_dim_size(
        dim_size, split, idx
    )
    # The same cut as torch.chunk (where it makes as many pieces).
    pieces = [sw_internals.get_chunked_dim_size(dim_size, split, i) for i in range(chunks)]
    assert sum(pieces) == dim_size


def _placements(order: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in order]


@settings(max_examples=200, deadline=None)
@given(hst.integers(0, 500), hst.permutations(list(range(6))), hst.integers(1, 6), hst.data())
def test_chunk_sharding_params_equal_torchs(dim_size: int, perm: list[int], world: int, data: Any) -> None:
    order = [r for r in perm if r < world]
    rank = data.draw(hst.sampled_from(order))
    ours = sw_internals.get_chunk_sharding_params(dim_size, world, ChunkShardingSpec(0, _placements(order)), rank)
    assert ours == torch_internals.get_chunk_sharding_params(dim_size, world, TorchChunk(0, _placements(order)), rank)


def test_chunk_sharding_params_refuse_a_rank_without_a_chunk() -> None:
    # torch returns (0, size of the last chunk) here; shardwise says why there is no answer.
    with pytest.raises(ValueError, match="rank 5 holds no chunk"):
        sw_internals.get_chunk_sharding_params(10, 2, ChunkShardingSpec(0, _placements([0, 1])), 5)


@settings(max_examples=150, deadline=None)
@given(
    hst.lists(hst.integers(0, 9), min_size=1, max_size=3),
    hst.permutations(list(range(4))),
    hst.data(),
)
def test_build_reshard_metadata_equals_torchs(size: list[int], order: list[int], data: Any) -> None:
    dim = data.draw(hst.integers(-len(size), len(size) - 1))
    ours, our_ranks = sw_reshard.build_reshard_metadata(torch.Size(size), ChunkShardingSpec(dim, _placements(order)), 4)
    theirs, their_ranks = torch_reshard.build_reshard_metadata(torch.Size(size), TorchChunk(dim, _placements(order)), 4)
    assert our_ranks == their_ranks
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shard_offsets, a.shard_sizes, str(a.placement)) == (b.shard_offsets, b.shard_sizes, str(b.placement))
    for rank in order:
        assert sw_reshard.get_idx_from_placements(
            ChunkShardingSpec(dim, _placements(order)).placements, rank
        ) == torch_reshard.get_idx_from_placements(TorchChunk(dim, _placements(order)).placements, rank)
    with pytest.raises(RuntimeError, match="current_rank not in the placement"):
        sw_reshard.get_idx_from_placements(ChunkShardingSpec(dim, _placements(order)).placements, 9)


def _both(offsets: list[int], sizes: list[int], rank: int = 0) -> tuple[ShardMetadata, TorchShardMetadata]:
    return ShardMetadata(offsets, sizes, f"rank:{rank}/cpu"), TorchShardMetadata(offsets, sizes, f"rank:{rank}/cpu")


def _outcome(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except ValueError:
        return "ValueError"
    return "ok"


@pytest.mark.parametrize(
    ("boxes", "size"),
    [
        ([([0, 0], [2, 4]), ([2, 0], [2, 4])], [4, 4]),  # rows
        ([([0, 0], [4, 2]), ([0, 2], [4, 2])], [4, 4]),  # columns
        ([([0, 0], [3, 4]), ([2, 0], [2, 4])], [4, 4]),  # overlapping rows
        ([([0, 0], [4, 3]), ([0, 2], [4, 2])], [4, 4]),  # overlapping columns
        ([([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 4])], [4, 4]),  # grid
        ([([0, 0], [2, 2]), ([1, 1], [2, 2])], [4, 4]),  # overlapping blocks
        ([([0, 0], [2, 4])], [4, 4]),  # leaves a gap
        ([([0, 0], [2, 4]), ([2, 0], [3, 4])], [4, 4]),  # sticks out
        ([([0, 0], [2, 4]), ([2, 0], [2, 4])], [4, 4, 1]),  # other number of dims
    ],
)
def test_layout_checks_agree_with_torch(boxes: list[tuple[list[int], list[int]]], size: list[int]) -> None:
    ours, theirs = zip(*(_both(o, s, i) for i, (o, s) in enumerate(boxes)), strict=True)
    assert _outcome(sw_internals.validate_non_overlapping_shards_metadata, list(ours)) == _outcome(
        torch_internals.validate_non_overlapping_shards_metadata, list(theirs)
    )
    if _outcome(torch_internals.validate_non_overlapping_shards_metadata, list(theirs)) == "ok":
        assert _outcome(sw_internals.check_tensor, list(ours), size) == _outcome(
            torch_internals.check_tensor, list(theirs), size
        )


def test_create_tensor_from_params_as_torchs() -> None:
    from torch.distributed._shard.sharded_tensor.api import _create_tensor_from_params as theirs

    from shardwise.sharded_tensor.api import _create_tensor_from_params as ours

    for props, torch_props in (
        (
            TensorProperties(dtype=torch.float64, requires_grad=True),
            TorchProperties(dtype=torch.float64, requires_grad=True),
        ),
        (TensorProperties(dtype=torch.int8), TorchProperties(dtype=torch.int8)),
    ):
        a = ours(5, 3, local_device=torch.device("cpu"), tensor_properties=props)
        b = theirs(5, 3, local_device=torch.device("cpu"), tensor_properties=torch_props)
        assert (a.shape, a.dtype, a.device, a.requires_grad, a.layout) == (
            b.shape,
            b.dtype,
            b.device,
            b.requires_grad,
            b.layout,
        )


def test_narrow_tensor_equals_torchs() -> None:
    t = torch.arange(60.0).reshape(4, 5, 3)
    for offsets, sizes in (([0, 0, 0], [4, 5, 3]), ([1, 2, 0], [2, 3, 3]), ([3, 0, 1], [1, 5, 2]), ([0, 4], [4, 1])):
        ours = narrow_tensor(t, ShardMetadata(offsets, sizes, "rank:0/cpu"))
        theirs = torch_narrow_tensor(t, TorchShardMetadata(offsets, sizes, "rank:0/cpu"))
        assert torch.equal(ours, theirs) and ours.data_ptr() == theirs.data_ptr()


def _rows(sizes: list[int], ranks: list[int], cols: int = 3) -> tuple[ShardedTensorMetadata, TorchSTMetadata]:
    """Row shards listed in the given rank order, offsets laid out in list order (before recalc fixes them)."""
    ours, theirs, offset = [], [], 0
    for n, r in zip(sizes, ranks, strict=True):
        a, b = _both([offset, 0], [n, cols], r)
        ours.append(a)
        theirs.append(b)
        offset += n
    size = [offset, cols]
    return (
        ShardedTensorMetadata(ours, torch.Size(size), TensorProperties()),
        TorchSTMetadata(theirs, torch.Size(size), TorchProperties()),
    )


def _boxes(md: Any) -> list[tuple[list[int], list[int], str]]:
    return [(list(s.shard_offsets), list(s.shard_sizes), str(s.placement)) for s in md.shards_metadata]


@settings(max_examples=100, deadline=None)
@given(hst.lists(hst.integers(1, 5), min_size=1, max_size=4), hst.data())
def test_build_global_metadata_equals_torchs(sizes: list[int], data: Any) -> None:
    # One rank's shards per entry, in rank order (as torch's callers gather them), and a rank without any.
    ours_md, theirs_md = _rows(sizes, list(range(len(sizes))))
    gathered_ours: list[Any] = [None]
    gathered_theirs: list[Any] = [None]
    for a, b in zip(ours_md.shards_metadata, theirs_md.shards_metadata, strict=True):
        gathered_ours.append(ShardedTensorMetadata([a], ours_md.size, TensorProperties()))
        gathered_theirs.append(TorchSTMetadata([b], theirs_md.size, TorchProperties()))
    recalc = data.draw(hst.booleans())
    ours = sw_utils.build_global_metadata(gathered_ours, recalc)
    theirs = torch_st_utils.build_global_metadata(gathered_theirs, recalc)
    assert _boxes(ours) == _boxes(theirs) and list(ours.size) == list(theirs.size)
    assert gathered_ours[1].shards_metadata[0] is not ours.shards_metadata[0]  # the inputs are not modified


def test_build_global_metadata_errors_as_torchs() -> None:
    a = ShardedTensorMetadata([ShardMetadata([0, 0], [2, 3], "rank:0/cpu")], torch.Size([4, 3]), TensorProperties())
    b = ShardedTensorMetadata([ShardMetadata([2, 0], [2, 3], "rank:1/cpu")], torch.Size([5, 3]), TensorProperties())
    with pytest.raises(ValueError, match="global_size property does not match from different ranks"):
        sw_utils.build_global_metadata([a, b])
    with pytest.raises(ValueError, match="ShardedTensor have no local shards on all ranks"):
        sw_utils.build_global_metadata([None, None])
    with pytest.raises(ValueError, match="overlap"):
        sw_utils.build_global_metadata([a, a])


def test_recalc_in_rank_order_equals_torch_and_fixes_other_orders() -> None:
    ours, theirs = _rows([1, 2, 3], [0, 1, 2])
    sw_utils.recalc_global_sharded_tensor_metadata(ours, 0)
    torch_st_utils.recalc_global_sharded_tensor_metadata(theirs, 0)
    assert _boxes(ours) == _boxes(theirs) and list(ours.size) == list(theirs.size) == [6, 3]
    # Listed out of rank order: each shard goes where its rank puts it (torch gives shard i the
    # i-th offset in rank order, so rank 0's 1 row would start at 0 but rank 2's 3 rows at 1).
    ours, _ = _rows([3, 1, 2], [2, 0, 1])
    sw_utils.recalc_global_sharded_tensor_metadata(ours, 0)
    assert _boxes(ours) == [
        ([3, 0], [3, 3], "rank:2/cpu"),
        ([0, 0], [1, 3], "rank:0/cpu"),
        ([1, 0], [2, 3], "rank:1/cpu"),
    ]
    sw_utils.validate_non_overlapping_shards_metadata(ours.shards_metadata)


# -- op registry helpers (no processes) ------------------------------------------------


def test_decorator_func_checks_the_signature_and_registers() -> None:
    from shardwise.op_registry_utils import _decorator_func

    table: dict[Any, Any] = {}
    with pytest.raises(TypeError, match=r"expects signature: \(types, args, kwargs, process_group\)"):
        _decorator_func(lambda types, args: None, torch.add, table)
    assert table == {}

    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> str:
        return "called"

    wrapper = _decorator_func(impl, torch.add, table)
    assert table[torch.add] is wrapper and wrapper.__name__ == "impl"
    # The common checks run first: no ShardedTensor among the arguments.
    with pytest.raises(TypeError, match="called without any distributed tensor"):
        wrapper((), (torch.ones(1),), {}, None)
    with pytest.raises(ValueError, match="No input for 'add'"):
        wrapper((), (), {}, None)


def test_register_default_op_runs_torchs_own() -> None:
    from shardwise.common_op_utils import _register_default_op

    table: dict[Any, Any] = {}

    def decorator(op: Any) -> Any:
        def register(impl: Any) -> Any:
            table[op] = impl
            return impl

        return register

    _register_default_op(torch.Tensor.size, decorator)
    assert table[torch.Tensor.size]((), (torch.ones(2, 3),), None) == torch.Size([2, 3])
    assert table[torch.Tensor.size]((), (torch.ones(2, 3),), {"dim": 1}) == 3


# -- on 2 ranks ------------------------------------------------------------------------


def _dense(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)


def _torch_group() -> Any:
    return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None


def _shard_tensor_and_hooks() -> int:
    from shardwise.api import _get_current_process_group, _shard_tensor, load_with_process_group

    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    done = 0
    dense = _dense(7, 4)
    for dim, order in ((0, list(range(w))), (1, list(range(w))[::-1])):
        st = _shard_tensor(dense, ChunkShardingSpec(dim, _placements(order)), src_rank=w - 1, process_group=None)
        (shard,) = st.local_shards()
        assert torch.equal(shard.tensor, narrow_tensor(dense, shard.metadata))
        tg = _torch_group()
        if tg is not None:
            from torch.distributed._shard.api import _shard_tensor as torch_shard_tensor

            theirs = torch_shard_tensor(dense, TorchChunk(dim, _placements(order)), src_rank=w - 1, process_group=tg)
            (their_shard,) = theirs.local_shards()
            assert torch.equal(shard.tensor, their_shard.tensor)
            assert shard.metadata.shard_offsets == their_shard.metadata.shard_offsets
            done += 1
        done += 1
    assert _get_current_process_group() is g
    with load_with_process_group(g):
        assert _get_current_process_group() is g
    assert r in range(w)
    return done


def _reshard_helpers() -> int:
    """torch's reshard helpers: the chunks each rank gets equal the dense tensor's and torch's own."""
    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    done = 0
    dense = _dense(5, 6).requires_grad_(True)
    order, reordered = list(range(w)), list(range(w))[::-1]
    for dim in (0, 1):
        old = ChunkShardingSpec(dim, _placements(order))
        mine = old.build_metadata(dense.shape, TensorProperties()).shards_metadata[r]
        local = narrow_tensor(dense, mine)
        # Same dim, other order: reshuffle.
        new = ChunkShardingSpec(dim, _placements(reordered))
        (shard,), metas = sw_reshard.reshuffle_local_shard(local, dense.shape, old, new, None)
        assert torch.equal(shard.tensor, narrow_tensor(dense, shard.metadata))
        assert [m.placement.rank() for m in metas] == list(range(w))
        # Another dim: reshard; gradients flow back to this rank's chunk of the input.
        other = ChunkShardingSpec(1 - dim, _placements(reordered))
        (moved,), _ = sw_reshard.reshard_local_shard(local, dense.shape, old, other, g)
        assert torch.equal(moved.tensor, narrow_tensor(dense, moved.metadata))
        moved.tensor.sum().backward()
        assert torch.equal(
            dense.grad[tuple(slice(o, o + n) for o, n in zip(mine.shard_offsets, mine.shard_sizes, strict=True))],
            torch.ones(mine.shard_sizes, dtype=dense.dtype),
        )
        dense.grad = None
        tg = _torch_group()
        if tg is not None:
            (theirs,), _ = torch_reshard.reshuffle_local_shard(
                local.detach(),
                dense.shape,
                TorchChunk(dim, _placements(order)),
                TorchChunk(dim, _placements(reordered)),
                tg,
            )
            assert torch.equal(shard.tensor.detach(), theirs.tensor)
            done += 1
        done += 1
    return done


def _metadata_from_local_shards() -> int:
    from shardwise.sharded_tensor import Shard

    g = shardwise.get_default_group()
    r = g.rank
    shard = Shard(torch.ones(2, 3), ShardMetadata([2 * r, 0], [2, 3], f"rank:{r}/cpu"))
    md = sw_utils.build_metadata_from_local_shards([shard], torch.Size([2 * g.size, 3]), r, None)
    assert md.shards_metadata == [shard.metadata] and md.tensor_properties.dtype == torch.float32
    errors = []
    for shards, rank in (
        ([shard], r + 1),
        ([Shard(torch.ones(2, 3), ShardMetadata([0, 0], [2, 3], f"rank:{g.size + 3}/cpu"))], r),
        ([shard, Shard(torch.ones(2, 3, dtype=torch.float64), ShardMetadata([0, 0], [2, 3], f"rank:{r}/cpu"))], r),
    ):
        with pytest.raises(ValueError) as info:
            sw_utils.build_metadata_from_local_shards(shards, torch.Size([2 * g.size, 3]), rank, g)
        errors.append(str(info.value))
    assert "does not match with the rank in its process group" in errors[0]
    assert "does not exist in input process group" in errors[1]
    assert "dtype property need to be the same" in errors[2]
    assert sw_utils._parse_and_validate_remote_device(g, ShardMetadata([0], [1], f"rank:{r}/cpu").placement) == (
        r,
        torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="remote device is None"):
        sw_utils._parse_and_validate_remote_device(None, ShardMetadata([0], [1]).placement)
    with pytest.raises(ValueError, match=r"Global rank 7 does not exist in input process group: \[0, 1\]"):
        sw_utils._parse_and_validate_remote_device(g, "rank:7/cpu")
    with pytest.raises(AssertionError, match="must have local shards"):
        sw_utils.build_metadata_from_local_shards([], torch.Size([2, 3]), r, g)
    gathered = [
        ShardedTensorMetadata([ShardMetadata([2 * q, 0], [2, 3], f"rank:{q}/cpu")], md.size, md.tensor_properties)
        for q in range(g.size)
    ]
    whole = sw_utils.build_global_metadata(gathered)
    assert [m.rank for m in whole.shards_metadata] == list(range(g.size))
    return 1


def _op_faces() -> int:
    """sharded_tensor.equal/allclose/uniform_ ..., _common._register_sharded_op_on_local_tensor, the embedding ops."""
    import shardwise.sharded_tensor as st_mod
    from shardwise import _custom_ops
    from shardwise.common_op_utils import _basic_validation
    from shardwise.sharding_spec.chunk_sharding_spec_ops._common import _register_sharded_op_on_local_tensor

    g = shardwise.get_default_group()
    w = g.size
    spec = ChunkShardingSpec(0, _placements(list(range(w))))
    dense = _dense(2 * w, 3).float()
    a = shardwise.shard_tensor(dense, spec)
    b = shardwise.shard_tensor(dense, spec)
    c = shardwise.shard_tensor(dense + 1, spec)
    assert st_mod.equal((), (a, b), {}, g) is True and st_mod.equal((), (a, c), None, g) is False
    assert st_mod.allclose((), (a, c), {"atol": 2.0}, g) is True
    st_mod.constant_((), (), {"tensor": a, "val": 5.0})
    assert torch.equal(a.local_tensor(), torch.full_like(a.local_tensor(), 5.0))
    st_mod.uniform_((), (), {"tensor": c, "a": 2.0, "b": 3.0})
    assert bool(((c.local_tensor() >= 2.0) & (c.local_tensor() < 3.0)).all())
    _basic_validation(torch.add, (a, b))
    other = shardwise.shard_tensor(dense, spec, process_group=g.new_group(list(range(w))))
    with pytest.raises(RuntimeError, match="same ProcessGroup"):
        _basic_validation(torch.add, (a, [other]))
    # The registered op runs on the local tensor (torch.Tensor.t is not otherwise registered for sharded tensors).
    calls = []

    def check(*args: Any, **kwargs: Any) -> None:
        calls.append(len(args))

    try:
        _register_sharded_op_on_local_tensor(torch.Tensor.neg_, extra_check=check)
        out = b.neg_()
        assert torch.equal(out.local_tensor(), -narrow_tensor(dense, b.local_shards()[0].metadata)) and calls == [1]
    finally:
        _custom_ops._remove(torch.Tensor.neg_, ChunkShardingSpec)
    done = 1
    if HAS_PLUGIN:
        import torch.nn.functional as F

        from shardwise.sharding_spec.chunk_sharding_spec_ops.embedding import sharded_embedding
        from shardwise.sharding_spec.chunk_sharding_spec_ops.embedding_bag import sharded_embedding_bag

        weight = shardwise.shard_tensor(dense, spec)
        ids = (torch.tensor([[0, 2 * w - 1], [1, 1]]) + g.rank) % (2 * w)
        assert torch.equal(sharded_embedding((), (ids, weight), {}, None), F.embedding(ids, dense))
        assert torch.equal(st_mod.sharded_embedding((), (ids,), {"weight": weight}, g), F.embedding(ids, dense))
        bags = sharded_embedding_bag(
            (), (ids.flatten(), weight), {"offsets": torch.tensor([0, 1]), "mode": "sum"}, None
        )
        assert torch.allclose(bags, F.embedding_bag(ids.flatten(), dense, torch.tensor([0, 1]), mode="sum"))
        done += 1
    return done


def ranks_battery() -> list[int]:
    return [_shard_tensor_and_hooks(), _reshard_helpers(), _metadata_from_local_shards(), _op_faces()]


def test_helpers_on_two_ranks() -> None:
    compared = 2 if HAS_TORCH_PG else 0
    expected = [2 + compared, 2 + compared, 1, 1 + int(HAS_PLUGIN)]
    assert _run(ranks_battery, 2) == [expected, expected]


def _cycles_and_subgroups() -> int:
    """Placement orders that are not their own inverse, and a subgroup whose placements name global ranks."""
    g = shardwise.get_default_group()
    w, r = g.size, g.rank
    dense = _dense(6, 7)
    done = 0
    order, rotated = list(range(w)), list(range(1, w)) + [0]
    for dim in (0, 1):
        old = ChunkShardingSpec(dim, _placements(rotated))
        local = narrow_tensor(
            dense, old.build_metadata(dense.shape, TensorProperties()).shards_metadata[rotated.index(r)]
        )
        # torch 2.13 receives from the rank it sends to, right only for swaps; a rotation needs the true source.
        (shard,), _ = sw_reshard.reshuffle_local_shard(
            local, dense.shape, old, ChunkShardingSpec(dim, _placements(order)), g
        )
        assert torch.equal(shard.tensor, narrow_tensor(dense, shard.metadata))
        (moved,), _ = sw_reshard.reshard_local_shard(
            local, dense.shape, old, ChunkShardingSpec(1 - dim, _placements(rotated[::-1])), g
        )
        assert torch.equal(moved.tensor, narrow_tensor(dense, moved.metadata))
        done += 2
    sub = g.new_group([1, 2])
    if sub is not None:
        # Placements name global ranks 1 and 2; this group numbers them 0 and 1.
        spec, other = ChunkShardingSpec(0, _placements([1, 2])), ChunkShardingSpec(1, _placements([2, 1]))
        local = narrow_tensor(dense, spec.build_metadata(dense.shape, TensorProperties()).shards_metadata[r - 1])
        (moved,), metas = sw_reshard.reshard_local_shard(local, dense.shape, spec, other, sub)
        assert torch.equal(moved.tensor, narrow_tensor(dense, moved.metadata)) and moved.metadata.rank == r
        assert [m.rank for m in metas] == [1, 2]
        done += 1
    return done


def test_reshard_helpers_on_three_ranks() -> None:
    assert _run(_cycles_and_subgroups, 3) == [4, 5, 5]
