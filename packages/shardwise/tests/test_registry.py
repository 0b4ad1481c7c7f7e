"""Plugin manager, record collection and accessors (single process)."""

from __future__ import annotations

import sys
import types
from typing import Any, Iterable

import pytest
import torch

import shardwise
from shardwise import Availability, Backend, Launcher, ShardedOp, hookimpl, plugins
from shardwise._registry.manager import DEFAULT_PLUGINS, create_registry
from shardwise.errors import BackendNotFoundError, OpNotFoundError, PluginError


def _backend(name: str, **kw: Any) -> Backend:
    return Backend(name=name, is_available=lambda: Availability(True), create_group=lambda launch, timeout: None, **kw)  # type: ignore[arg-type,return-value]


class BackendPlugin:
    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def shardwise_backends(self) -> Iterable[Backend]:
        for name in self.names:
            yield _backend(name)


class SpecBase:
    pass


class SpecChild(SpecBase):
    pass


def _impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> str:
    return "impl"


def _other_impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> str:
    return "other"


class OpPlugin:
    def __init__(self, *records: ShardedOp) -> None:
        self.records = records

    @hookimpl
    def shardwise_sharded_ops(self) -> Iterable[ShardedOp]:
        return self.records


def test_import_builds_nothing() -> None:
    code = "import shardwise, shardwise._registry.manager as r, sys; print(r._current is None, 'mpi4py' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_default_plugins_register_through_the_same_hooks(core_only: None) -> None:
    names = [p.name for p in plugins.list_plugins()]
    for module in DEFAULT_PLUGINS:
        assert module in names
    assert [launcher.name for launcher in plugins.list_launchers()][:2] == ["torchrun", "openmpi"]
    info = {p.name: p for p in plugins.list_plugins()}["shardwise._session.launchers"]
    assert info.distribution == "shardwise" and info.version == shardwise.__version__


def test_test_backend_loaded_from_env(core_only: None) -> None:
    assert [b.name for b in plugins.list_backends()] == ["test-gloo"]
    assert plugins.plugin_for_backend("test-gloo") == "core_test_backend"


def test_unknown_backend_lists_installed_and_names_distribution(core_only: None) -> None:
    with pytest.raises(BackendNotFoundError) as info:
        plugins.get_backend("mpi")
    message = str(info.value)
    assert "backend 'mpi' is not installed; installed: test-gloo" in message
    assert "pip install shardwise-mpi[mpich]" in message
    with pytest.raises(LookupError, match="'nope' is not installed; installed: test-gloo"):
        plugins.get_backend("nope")


def test_blocked_plugin_then_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("SHARDWISE_PLUGINS", "core_test_backend")
    monkeypatch.setenv("SHARDWISE_BLOCKED_PLUGINS", "core_test_backend, gloo")
    plugins.reset()
    assert plugins.list_backends() == []
    with pytest.raises(BackendNotFoundError) as info:
        plugins.get_backend("gloo")
    message = str(info.value)
    assert "installed: (none)" in message
    assert "Blocked plugins (SHARDWISE_BLOCKED_PLUGINS): core_test_backend, gloo" in message
    assert "remove 'gloo' from SHARDWISE_BLOCKED_PLUGINS" in message


def test_default_plugins_can_be_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("SHARDWISE_BLOCKED_PLUGINS", "shardwise._session.launchers")
    plugins.reset()
    assert plugins.list_launchers() == []


def test_duplicate_backend_names_both_plugins(core_only: None) -> None:
    plugins.register(BackendPlugin("test-gloo"), name="impostor")
    with pytest.raises(PluginError, match="'test-gloo' is provided by two plugins: 'core_test_backend' and 'impostor'"):
        plugins.list_backends()


def test_duplicate_op_names_both_plugins(core_only: None) -> None:
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecBase, _impl)), name="first")
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecBase, _other_impl)), name="second")
    with pytest.raises(PluginError, match=r"torch\.add for SpecBase is implemented by two plugins: 'first' and 'second'"):
        plugins.find_op(torch.add, SpecBase)


def test_find_op_walks_the_spec_mro(core_only: None) -> None:
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecBase, _impl)), name="base-ops")
    assert plugins.find_op(torch.add, SpecChild).impl is _impl
    assert plugins.find_op(torch.add, SpecChild()).impl is _impl
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecChild, _other_impl)), name="child-ops")
    assert plugins.find_op(torch.add, SpecChild()).impl is _other_impl
    assert plugins.find_op(torch.add, SpecBase()).impl is _impl
    assert [(o.op_name, o.spec.__name__) for o in plugins.list_sharded_ops() if o.spec in (SpecBase, SpecChild)] == [
        ("torch.add", "SpecBase"),
        ("torch.add", "SpecChild"),
    ]


def test_override_replaces_a_plugin_op_for_every_spec(core_only: None) -> None:
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecChild, _impl)), name="child-ops")
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecBase, _other_impl, override=True)), name="user")
    # The override is declared for the base class, yet wins over the plugin's more specific impl.
    assert plugins.find_op(torch.add, SpecChild).impl is _other_impl
    plugins.register(OpPlugin(ShardedOp(torch.add, SpecBase, _impl, override=True)), name="user-2")
    with pytest.raises(PluginError, match=r"override op torch\.add for SpecBase is implemented by two plugins: 'user' and 'user-2'"):
        plugins.find_op(torch.add, SpecChild)


def test_missing_op_names_specs_and_distribution(core_only: None) -> None:
    # torch.kron: an op the core itself does not implement.
    plugins.register(OpPlugin(ShardedOp(torch.kron, SpecChild, _impl)), name="child-ops")
    with pytest.raises(OpNotFoundError, match="no sharded implementation of torch.kron for SpecBase; it is implemented for: SpecChild"):
        plugins.find_op(torch.kron, SpecBase)
    with pytest.raises(LookupError, match=r"embedding for SpecBase; no installed plugin.*pip install shardwise-embedding"):
        plugins.find_op(torch.nn.functional.embedding, SpecBase)
    assert plugins.find_op_or_none(torch.nn.functional.embedding, SpecBase) is None


def test_records_of_the_wrong_type_are_rejected(core_only: None) -> None:
    class Bad:
        @hookimpl
        def shardwise_backends(self) -> Any:
            return ["gloo"]

    plugins.register(Bad(), name="bad")
    with pytest.raises(PluginError, match=r"plugin 'bad' yielded 'gloo' from shardwise_backends\(\); expected Backend"):
        plugins.list_backends()


def test_a_crashing_hook_names_the_plugin(core_only: None) -> None:
    class Crash:
        @hookimpl
        def shardwise_backends(self) -> Any:
            raise RuntimeError("kaput")

    plugins.register(Crash(), name="crash")
    with pytest.raises(PluginError, match="plugin 'crash' failed in shardwise_backends\\(\\): RuntimeError: kaput.*SHARDWISE_BLOCKED_PLUGINS=crash"):
        plugins.list_backends()


def test_unknown_hook_fails_check_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("typo_plugin")

    @hookimpl
    def shardwise_backend() -> Any:  # missing "s"
        return []

    module.shardwise_backend = shardwise_backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "typo_plugin", module)
    with pytest.raises(PluginError, match="does not define"):
        create_registry({"SHARDWISE_DISABLE_PLUGIN_AUTOLOAD": "1", "SHARDWISE_PLUGINS": "typo_plugin"})


def test_unimportable_plugin_module() -> None:
    with pytest.raises(PluginError, match="cannot import plugin module 'no_such_module_xyz' \\(SHARDWISE_PLUGINS\\)"):
        create_registry({"SHARDWISE_DISABLE_PLUGIN_AUTOLOAD": "1", "SHARDWISE_PLUGINS": "no_such_module_xyz"})


def test_register_and_unregister_invalidate_tables(core_only: None) -> None:
    assert [b.name for b in plugins.list_backends()] == ["test-gloo"]
    plugins.register(BackendPlugin("zeta", "alpha"), name="extra")
    assert [b.name for b in plugins.list_backends()] == ["alpha", "test-gloo", "zeta"]
    plugins.unregister("extra")
    assert [b.name for b in plugins.list_backends()] == ["test-gloo"]


def test_launcher_duplicates_rejected(core_only: None) -> None:
    class Dup:
        @hookimpl
        def shardwise_launchers(self) -> Iterable[Launcher]:
            yield Launcher("slurm", lambda env: None)

    plugins.register(Dup(), name="dup")
    with pytest.raises(PluginError, match="launcher 'slurm' is provided by two plugins: 'shardwise._session.launchers' and 'dup'"):
        plugins.list_launchers()


def test_availability_turns_crashes_into_reasons() -> None:
    def boom() -> Availability:
        raise OSError("driver missing")

    crashing = Backend(name="x", is_available=boom, create_group=lambda launch, timeout: None)  # type: ignore[arg-type,return-value]
    result = plugins.availability(crashing)
    assert not result and "OSError: driver missing" in result.reason
    with pytest.raises(ValueError, match="needs a reason"):
        Availability(False)


def test_records_are_frozen() -> None:
    record = _backend("x")
    with pytest.raises(AttributeError):
        record.name = "y"  # type: ignore[misc]


def test_hookimpl_is_exported_for_plugin_authors() -> None:
    from shardwise.hookspecs import hookimpl as spec_hookimpl

    assert shardwise.hookimpl is spec_hookimpl
    assert "hookimpl" in shardwise.__all__
