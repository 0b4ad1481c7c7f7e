"""The ``shardwise`` command line: ``--version``, help, ``info`` and its ``--all`` / ``--json`` forms.

The last tests check the sample output in the README against what ``shardwise info``
prints here, whichever plugins this environment has installed (see
:func:`_comparable`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import pytest
import torch

import shardwise
from shardwise import ChunkShardingSpec, ShardedOp, hookimpl
from shardwise._comm import buffers
from shardwise._registry import access as plugins
from shardwise._registry.manager import DEFAULT_PLUGINS
from shardwise._session.info import collect, is_internal, main, render, version_line
from shardwise._tensor import custom_ops
from shardwise.sharded_tensor import custom_sharded_op_impl

README = Path(__file__).resolve().parents[3] / "README.md"
START, END = "<!-- shardwise-info-sample:start -->", "<!-- shardwise-info-sample:end -->"
CORE_OPS = "shardwise._tensor.core_ops"
#: What "fits a screen" means for the default output.
SCREEN_LINES = 40


def _impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> None:
    raise AssertionError("never called: the tests only list ops")


@hookimpl
def _toy_ops() -> Iterator[ShardedOp]:
    yield ShardedOp(torch.nn.functional.embedding, ChunkShardingSpec, _impl, "toy embedding")
    yield ShardedOp(torch.nn.functional.embedding_bag, ChunkShardingSpec, _impl, "toy embedding_bag")
    yield ShardedOp(torch.Tensor.__matmul__, ChunkShardingSpec, _impl, "a dunder: only --all lists it")


#: A plugin object whose hook yields ops the core does not provide.
TOY_PLUGIN = SimpleNamespace(shardwise_sharded_ops=_toy_ops)


@pytest.fixture
def toy(core_only: None) -> Iterator[None]:
    """The core's plugins, the core test backend and the ``toy`` op plugin."""
    plugins.register(TOY_PLUGIN, name="toy")
    yield
    plugins.unregister("toy")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == version_line() + "\n"
    assert out.startswith(f"shardwise {shardwise.__version__} (torch {torch.__version__}, python ")


def test_no_arguments_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardwise [-h] [--version] COMMAND ...")
    assert "info" in out and "Plugins:" not in out


def test_console_entry_points_print_help_and_version() -> None:
    for argv, expected in (([], "usage: shardwise"), (["--version"], version_line())):
        done = subprocess.run(
            [sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(expected)


def test_default_fits_a_screen_grouped_by_plugin(toy: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= SCREEN_LINES, out
    # No torch internals: no dunder method, no attribute accessor.
    assert "__" not in out and "torch.Tensor.__reduce_ex__" not in out
    summary = lines[lines.index(next(line for line in lines if line.startswith("Sharded ops by providing plugin"))) :]
    core_ops = {op.op_name for op, plugin in plugins.list_sharded_ops_with_plugins() if plugin == CORE_OPS}
    internal = sum(is_internal(name) for name in core_ops)
    assert internal > 0
    assert f"  {CORE_OPS}: {len(core_ops)} ops" in summary
    assert any(
        re.fullmatch(rf"    internal\s+{internal}\s+dunder methods.*--all lists them\)", line) for line in summary
    )
    toy_at = summary.index("  toy: 3 ops")
    assert re.fullmatch(r"    torch\.nn\.functional\s+2\s+embedding, embedding_bag", summary[toy_at + 1])
    assert re.fullmatch(r"    internal\s+1\s+dunder methods.*", summary[toy_at + 2])
    # A plugin that provides no op (the backend, the launchers) gets no block.
    assert not any(line.startswith("  core_test_backend") for line in summary)


def test_default_fits_a_screen_with_what_is_installed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= SCREEN_LINES, out
    assert "__get__" not in out


def test_summary_folds_inplace_twins_and_cuts_long_lists() -> None:
    info: dict[str, Any] = {"plugins": [{"name": "p", "distribution": "", "version": "", "module": "p"}]}
    names = ["add", "add_", "mul", "normal_"] + [f"op{i:03d}" for i in range(40)]
    info["sharded_ops"] = [{"op": f"torch.{name}", "plugin": "p"} for name in names]
    block = render({**_minimal_info(), **info}).splitlines()[-2:]
    assert block[0] == "  p: 44 ops"
    assert re.fullmatch(r"    torch  44  add\(_\), mul, normal_, op000, op001, .*, \.\.\.", block[1])
    assert len(block[1].split("  ")[-1]) <= 64


def test_all_lists_every_op_with_its_plugin(toy: None, capsys: pytest.CaptureFixture[str]) -> None:
    @custom_sharded_op_impl(torch.nn.functional.gelu)
    def _gelu(types: Any, args: Any, kwargs: Any, process_group: Any) -> None:
        raise AssertionError("never called")

    try:
        assert main(["info", "--all"]) == 0
        implementations = len(plugins.list_sharded_ops())
    finally:
        custom_ops._remove(torch.nn.functional.gelu, shardwise.ShardingSpec)
    out = capsys.readouterr().out
    spec = r"shardwise\.sharding_spec\.ShardingSpec"
    assert re.search(rf"^  torch\.Tensor\.__reduce_ex__\s+{spec}\s+shardwise\._tensor\.core_ops$", out, re.M)
    assert re.search(r"^  torch\.Tensor\.shape\.__get__\s+\S+\s+shardwise\._tensor\.core_ops$", out, re.M)
    assert re.search(r"^  torch\.Tensor\.__matmul__\s+shardwise\.sharding_spec\.ChunkShardingSpec\s+toy$", out, re.M)
    assert re.search(rf"^  \S*gelu\s+{spec}\s+shardwise\._tensor\.custom_ops \(override\)$", out, re.M)
    assert f"Sharded ops ({implementations} implementations):" in out


def test_json_keeps_everything_and_names_each_provider(toy: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {
        "shardwise", "torch", "python", "plugins", "backends", "launchers", "buffer_cache", "sharded_ops",
    }  # fmt: skip
    ops = {(o["op"], o["spec"].rsplit(".", 1)[-1]): o for o in info["sharded_ops"]}
    assert len(ops) == len(info["sharded_ops"]) == len(plugins.list_sharded_ops())
    assert ops[("torch.Tensor.__reduce_ex__", "ShardingSpec")]["plugin"] == CORE_OPS
    toy_op = ops[("torch.nn.functional.embedding", "ChunkShardingSpec")]
    assert toy_op == {
        "op": "torch.nn.functional.embedding",
        "spec": "shardwise.sharding_spec.ChunkShardingSpec",
        "description": "toy embedding",
        "plugin": "toy",
        "override": False,
    }
    assert info["backends"][0]["plugin"] == "core_test_backend"
    cache = info["buffer_cache"]
    assert cache == {
        "held_bytes": cache["held_bytes"],
        "limit_bytes": buffers.cache_limit(),
        "env": "SHARDWISE_BUFFER_CACHE_MB",
        "error": "",
    }
    assert cache["held_bytes"] >= 0


def test_buffer_cache_line(
    core_only: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "3")
    assert main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Buffer cache:"))
    assert line == (
        "Buffer cache: 0 MiB held, limit 3 MiB (SHARDWISE_BUFFER_CACHE_MB; shardwise.empty_cache() frees it)"
    )
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "0")
    assert main(["info"]) == 0
    assert "Buffer cache: off (SHARDWISE_BUFFER_CACHE_MB=0)\n" in capsys.readouterr().out


def test_malformed_cache_setting_is_reported_not_fatal(
    core_only: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "lots")
    assert main(["info", "--json"]) == 0
    cache = json.loads(capsys.readouterr().out)["buffer_cache"]
    assert cache["limit_bytes"] is None and "SHARDWISE_BUFFER_CACHE_MB='lots'" in cache["error"]
    assert main(["info"]) == 0
    assert f"Buffer cache: {cache['error']}\n" in capsys.readouterr().out


def test_shardwise_error_exits_1_with_its_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDWISE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("SHARDWISE_PLUGINS", "no_such_plugin_mod")
    with pytest.raises(SystemExit) as exit_info:
        main(["info"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("shardwise: error: cannot import plugin module 'no_such_plugin_mod'")


# -- the README's sample ------------------------------------------------------------------------------------------

_VERSION = re.compile(r"\d+\.\d+[0-9A-Za-z.+-]*")


def _readme_sample(text: str) -> str:
    """The output inside the README's ```text block between the sample markers."""
    assert START in text and END in text, f"README.md has no {START} ... {END} block"
    block = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert block.startswith("```text\n") and block.endswith("\n```"), "the sample is not one ```text block"
    sample = block[len("```text\n") : -len("\n```")]
    assert sample.strip(), "README.md's shardwise info sample is empty: paste the output of `shardwise info` into it"
    return sample


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def _model(text: str) -> dict[str, Any]:
    """``shardwise info``'s text, parsed into what must match, without what legitimately varies.

    Versions (of shardwise, torch, python and each plugin), backend availability and
    its reason (nccl is available on a GPU machine), the cache's numbers (and the off
    form a limit of 0 prints) and column padding are dropped.
    """
    lines = text.strip("\n").splitlines()
    sections: dict[str, list[str]] = {}
    title = ""
    for line in lines[1:]:
        if not line.strip():
            continue
        if not line.startswith(" "):
            title = line.split(":", 1)[0].split(" (", 1)[0]
            sections[title] = [line]
        else:
            sections[title].append(line)
    plugin_rows = [_cells(line) for line in sections["Plugins"][2:]]
    backend_rows = [_cells(line) for line in sections["Backends"][1:]]
    if backend_rows[0][0].startswith("(none installed"):
        backend_rows = []
    else:
        assert backend_rows.pop(0) == ["name", "status", "devices", "plugin", "why"]
    (cache,) = sections["Buffer cache"]
    cache = re.sub(r"Buffer cache: off \(SHARDWISE_BUFFER_CACHE_MB=0\)", "Buffer cache: 0 MiB held, limit 0 MiB "
                   "(SHARDWISE_BUFFER_CACHE_MB; shardwise.empty_cache() frees it)", cache)  # fmt: skip
    op_blocks: dict[str, list[str]] = {}
    op_lines = sections.get("Sharded ops by providing plugin") or sections["Sharded ops"]
    block: list[str] = []
    for line in op_lines[1:]:
        if line.startswith("    "):
            block.append(" ".join(line.split()))
        else:  # "  PLUGIN: N ops" starts a plugin's block
            block = op_blocks[line.strip().split(":", 1)[0]] = [line.strip()]
    return {
        "header": _VERSION.sub("<version>", lines[0]),
        "plugins": {row[0]: (row[1], _VERSION.sub("<version>", row[2]), row[3]) for row in plugin_rows},
        "backends": {row[0]: (row[2], row[3], row[1] in ("available", "unavailable")) for row in backend_rows},
        "launchers": [_cells(line) for line in sections["Launchers"][1:]],
        "cache": re.sub(r"\d+(\.\d+)? MiB", "<n> MiB", cache),
        "ops_heading": op_lines[0],
        "ops": op_blocks,
    }


def _comparable(model: dict[str, Any], keep: set[str]) -> dict[str, Any]:
    """The model restricted to the plugins in ``keep``.

    The README shows every plugin of this repository installed; an environment with
    fewer (tox's ``core`` env has none) compares the parts those plugins do not
    change: the header, the core's plugins, the launchers, the cache line and the
    core's op summary. A plugin's lines depend only on that plugin (the summary's
    name lists are cut at a fixed width), so dropping one leaves the others as they are.
    """
    return {
        **model,
        "plugins": {name: row for name, row in model["plugins"].items() if name in keep},
        "backends": {name: row for name, row in model["backends"].items() if row[1] in keep},
        "ops": {name: block for name, block in model["ops"].items() if name in keep},
    }


def _check_sample(sample: str, actual: str) -> Optional[str]:
    """None when the README's sample matches ``actual``, else what differs."""
    expected_model, actual_model = _model(sample), _model(actual)
    keep = set(expected_model["plugins"]) & set(actual_model["plugins"])
    missing = set(DEFAULT_PLUGINS) - keep
    if missing:
        return f"the sample lacks the core's own plugins {sorted(missing)}"
    expected, got = _comparable(expected_model, keep), _comparable(actual_model, keep)
    if expected == got:
        return None
    report = []
    for key in (key for key in expected if expected[key] != got[key]):
        want, have = expected[key], got[key]
        if isinstance(want, dict):  # only the entries that differ
            names = sorted(name for name in set(want) | set(have) if want.get(name) != have.get(name))
            want, have = {n: want.get(n) for n in names}, {n: have.get(n) for n in names}
        report.append(f"{key}:\n  README: {want}\n  here:   {have}")
    return "\n".join(report)


def test_readme_sample_fits_a_screen() -> None:
    sample = _readme_sample(README.read_text(encoding="utf-8"))
    assert len(sample.splitlines()) <= SCREEN_LINES


def test_readme_sample_matches_the_output() -> None:
    sample = _readme_sample(README.read_text(encoding="utf-8"))
    actual = render(collect())
    problem = _check_sample(sample, actual)
    assert problem is None, (
        f"README.md's `shardwise info` sample is out of date; paste the output of `shardwise info` "
        f"(all plugins of this repository installed) between its markers. {problem}"
    )


def test_sample_check_finds_differences() -> None:
    actual = render(collect())
    assert _check_sample(actual, actual) is None
    # Versions and availability may differ; what the plugins provide may not.
    varied = actual.replace(f"torch {torch.__version__}", "torch 9.9.9+cu999")
    assert _check_sample(varied, actual) is None
    core_line = next(line for line in actual.splitlines() if line.startswith(f"  {CORE_OPS}: "))
    assert _check_sample(actual.replace(core_line, f"  {CORE_OPS}: 1 ops"), actual) is not None
    launcher_line = next(line for line in actual.splitlines() if line.startswith("  single "))
    assert _check_sample(actual.replace(launcher_line, "  single  something else"), actual) is not None


def test_sample_check_compares_only_installed_plugins(toy: None) -> None:
    with_toy = render(collect())
    plugins.unregister("toy")
    without_toy = render(collect())
    # The README lists a plugin not installed here: its lines are left out of the comparison ...
    assert _check_sample(with_toy, without_toy) is None
    # ... but a plugin both have must match.
    plugins.register(TOY_PLUGIN, name="toy")
    changed = with_toy.replace("  toy: 3 ops", "  toy: 4 ops")
    assert _check_sample(changed, with_toy) is not None


def _minimal_info() -> dict[str, Any]:
    return {
        "shardwise": "0",
        "torch": "t",
        "python": "p",
        "plugins": [],
        "backends": [],
        "launchers": [{"name": "single", "description": "d"}],
        "buffer_cache": {"held_bytes": 0, "limit_bytes": 1 << 20, "env": "SHARDWISE_BUFFER_CACHE_MB", "error": ""},
        "sharded_ops": [],
    }


def test_python_dash_m_error_exit_status(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")}
    env.update(SHARDWISE_DISABLE_PLUGIN_AUTOLOAD="1", SHARDWISE_PLUGINS="no_such_plugin_mod")
    done = subprocess.run([sys.executable, "-m", "shardwise", "info", "--all"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == (
        "shardwise: error: cannot import plugin module 'no_such_plugin_mod' (SHARDWISE_PLUGINS): "
        "No module named 'no_such_plugin_mod'\n"
    )
