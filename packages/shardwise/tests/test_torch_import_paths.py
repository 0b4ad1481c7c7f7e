"""Every module path and public name of torch 2.13's ``torch.distributed._shard`` exists under ``shardwise``.

The walk enumerates the installed torch's package at test time (pkgutil),
so a module or name torch adds shows up here as a failure; each function
shared with torch must take torch's parameters. The helpers shardwise
implements for these paths are compared with torch's in
``test_torch_path_helpers.py``.
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
import torch.distributed._shard as torch_shard

import shardwise

TORCH = "torch.distributed._shard"


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
