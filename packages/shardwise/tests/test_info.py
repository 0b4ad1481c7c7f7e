"""``shardwise info`` and plugin discovery through a real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardwise._session.info import collect, main, render

PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "shardwise-throwaway"
version = "9.8.7"
dependencies = []

[project.entry-points.shardwise]
throwaway = "shardwise_throwaway"

[tool.setuptools]
py-modules = ["shardwise_throwaway"]
"""

PLUGIN_MODULE = '''
from shardwise import Availability, Backend, hookimpl


def _create(launch, timeout):
    raise RuntimeError("throwaway backends make no groups")


@hookimpl
def shardwise_backends():
    yield Backend(
        name="throwaway",
        is_available=lambda: Availability(False, "it is only a test"),
        create_group=_create,
        distribution="shardwise-throwaway",
    )
'''


def test_text_output_lists_every_section(core_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("shardwise 0.1.0 (torch ")
    for heading in ("Plugins:", "Backends:", "Launchers (tried in this order):", "Buffer cache:", "Sharded ops by"):
        assert heading in out
    assert "core_test_backend" in out and "shardwise._session.launchers" in out
    assert "test-gloo  available" in out
    # The core's own ops come through the same hook as any plugin's; its torch internals are only in --all.
    assert "  shardwise._tensor.core_ops: " in out and "torch.Tensor.shape.__get__" not in out
    assert main(["info", "--all"]) == 0
    out = capsys.readouterr().out
    assert "torch.Tensor.shape.__get__" in out and "shardwise.sharding_spec.ShardingSpec" in out


def test_json_output(core_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == collect()
    assert [b["name"] for b in info["backends"]] == ["test-gloo"]
    assert info["backends"][0]["plugin"] == "core_test_backend"
    assert [entry["name"] for entry in info["launchers"]][-1] == "single"


def test_render_without_backends() -> None:
    info = {"shardwise": "0", "torch": "t", "python": "p", "plugins": [], "backends": [], "launchers": [], "sharded_ops": []}
    info["launchers"] = [{"name": "single", "description": "d"}]
    info["buffer_cache"] = {"held_bytes": 0, "limit_bytes": 0, "env": "SHARDWISE_BUFFER_CACHE_MB", "error": ""}
    assert "(none installed: `pip install shardwise-gloo`)" in render(info)


def test_python_dash_m_and_errors_exit_nonzero(tmp_path: Path) -> None:
    env = {**os.environ, "SHARDWISE_DISABLE_PLUGIN_AUTOLOAD": "1", "SHARDWISE_PLUGINS": "no_such_plugin_mod"}
    done = subprocess.run([sys.executable, "-m", "shardwise", "info"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "cannot import plugin module 'no_such_plugin_mod'" in done.stderr


@pytest.fixture(scope="module")
def throwaway_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build a plugin distribution and install it into its own directory."""
    root = tmp_path_factory.mktemp("throwaway")
    source = root / "src"
    source.mkdir()
    (source / "pyproject.toml").write_text(textwrap.dedent(PLUGIN_PYPROJECT))
    (source / "shardwise_throwaway.py").write_text(PLUGIN_MODULE)
    wheels, site = root / "wheels", root / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)], check=True, timeout=240
    )
    (wheel,) = wheels.glob("shardwise_throwaway-9.8.7-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True, timeout=240)
    return site


def _info_with(site: Path, **extra: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "shardwise", "info", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_entry_point_plugin_is_discovered_and_listed(throwaway_site: Path) -> None:
    info = _info_with(throwaway_site)
    plugins = {p["name"]: p for p in info["plugins"]}  # type: ignore[attr-defined]
    assert plugins["throwaway"]["distribution"] == "shardwise-throwaway"
    assert plugins["throwaway"]["version"] == "9.8.7"
    backends = {b["name"]: b for b in info["backends"]}  # type: ignore[attr-defined]
    assert backends["throwaway"]["available"] is False
    assert backends["throwaway"]["reason"] == "it is only a test"


def test_entry_point_plugin_is_blocked(throwaway_site: Path) -> None:
    info = _info_with(throwaway_site, SHARDWISE_BLOCKED_PLUGINS="throwaway")
    assert "throwaway" not in {p["name"] for p in info["plugins"]}  # type: ignore[attr-defined]
    assert "throwaway" not in {b["name"] for b in info["backends"]}  # type: ignore[attr-defined]
    info = _info_with(throwaway_site, SHARDWISE_DISABLE_PLUGIN_AUTOLOAD="1")
    assert "throwaway" not in {p["name"] for p in info["plugins"]}  # type: ignore[attr-defined]


def test_blocked_entry_point_backend_asked_for(throwaway_site: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")}
    env.update(PYTHONPATH=str(throwaway_site), SHARDWISE_BLOCKED_PLUGINS="throwaway")
    code = "import shardwise\ntry:\n    shardwise.init('throwaway')\nexcept LookupError as e:\n    print(e)\n"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "backend 'throwaway' is not installed" in done.stdout, done.stderr
    assert "Blocked plugins (SHARDWISE_BLOCKED_PLUGINS): throwaway" in done.stdout
