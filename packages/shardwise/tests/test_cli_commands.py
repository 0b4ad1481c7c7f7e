"""Plugins' subcommands of the ``shardwise`` command line: the ``shardwise_cli_commands`` hook.

Each test registers in-process plugins on a fresh plugin manager (``core_only``:
the core's plugins and the test backend, no entry points), then runs ``main``.
"""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace
from typing import Iterator

import pytest

import shardwise
from shardwise import CliCommand, hookimpl, hookspecs
from shardwise import plugins as public_plugins
from shardwise._registry import access as plugins
from shardwise._session.info import BUILTIN_COMMANDS, main
from shardwise.errors import PluginError, ShardwiseError


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="world")
    parser.add_argument("--status", type=int, default=0)


def _run(args: argparse.Namespace) -> int:
    print(f"hello {args.name}")
    return int(args.status)


def _plugin(*commands: CliCommand, calls: list[int] | None = None) -> SimpleNamespace:
    """A plugin object whose hook yields ``commands`` (and counts its calls in ``calls``)."""

    @hookimpl
    def shardwise_cli_commands() -> Iterator[CliCommand]:
        if calls is not None:
            calls.append(1)
        yield from commands

    return SimpleNamespace(shardwise_cli_commands=shardwise_cli_commands)


HELLO = CliCommand(name="hello", help="say hello", add_arguments=_add_arguments, run=_run)


@pytest.fixture
def hello(core_only: None) -> Iterator[list[int]]:
    """The ``toy`` plugin, providing ``shardwise hello``; yields the list its hook appends to when called."""
    calls: list[int] = []
    plugins.register(_plugin(HELLO, calls=calls), name="toy")
    yield calls
    plugins.unregister("toy")


def test_the_record_is_public_frozen_and_the_hook_documented() -> None:
    assert "CliCommand" in shardwise.__all__ and shardwise.CliCommand is CliCommand
    assert public_plugins.list_cli_commands is plugins.list_cli_commands
    with pytest.raises(dataclasses.FrozenInstanceError):
        HELLO.name = "other"  # type: ignore[misc]
    doc = hookspecs.shardwise_cli_commands.__doc__ or ""
    assert "Called once per plugin manager" in doc and "Returns:" in doc and "Example::" in doc
    assert "shardwise_cli_commands" in hookspecs.__all__


def test_a_plugin_command_runs_with_its_arguments(hello: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hello", "--name", "plan"]) == 0
    assert capsys.readouterr().out == "hello plan\n"
    assert main(["hello", "--status", "3"]) == 3
    (command,) = plugins.list_cli_commands()
    assert command.plugin == "toy" and command.run is _run


def test_help_lists_plugin_commands_with_their_plugin(hello: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardwise [-h] [--version] COMMAND ...")
    assert "info" in out and "say hello (plugin toy)" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "say hello (plugin toy)" in capsys.readouterr().out


def test_version_and_info_do_not_load_commands(hello: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert main(["info"]) == 0
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    assert hello == []  # the hook was never called
    capsys.readouterr()
    assert main(["hello"]) == 0
    assert hello == [1]


def test_two_plugins_with_one_command_name_both(core_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    plugins.register(_plugin(HELLO), name="first")
    plugins.register(_plugin(dataclasses.replace(HELLO, help="another hello")), name="second")
    with pytest.raises(PluginError, match="command 'hello' is provided by two plugins: 'first' and 'second'"):
        plugins.list_cli_commands()
    with pytest.raises(SystemExit) as exit_info:
        main(["hello"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: the plugins' commands cannot be loaded: command 'hello' is provided")
    assert "'first' and 'second'" in err and err.count("\n") == 1
    # The help still prints, saying why the plugins' commands are missing.
    assert main([]) == 0
    assert "(Plugin commands unavailable: command 'hello' is provided by two plugins" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Bad Name", "declared the command 'Bad Name'; a command is a lower-case word"),
        ("--flag", "declared the command '--flag'"),
    ],
)
def test_malformed_command_names_are_refused(core_only: None, name: str, message: str) -> None:
    plugins.register(_plugin(dataclasses.replace(HELLO, name=name)), name="odd")
    with pytest.raises(PluginError, match=f"plugin 'odd' {message}"):
        plugins.list_cli_commands()


def test_a_builtin_name_is_refused(core_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert BUILTIN_COMMANDS == ("info",)
    plugins.register(_plugin(HELLO, dataclasses.replace(HELLO, name="info")), name="greedy")
    with pytest.raises(SystemExit) as exit_info:
        main(["hello"])
    assert exit_info.value.code == 1
    assert "plugin 'greedy' declares the command 'info', a built-in command" in capsys.readouterr().err
    assert main(["info"]) == 0  # the built-in command is untouched


def test_a_failing_plugin_load_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDWISE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("SHARDWISE_PLUGINS", "no_such_plugin_mod")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "tables.json", "--world-size", "2"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (
        "shardwise: error: the plugins' commands cannot be loaded: cannot import plugin module "
        "'no_such_plugin_mod' (SHARDWISE_PLUGINS): No module named 'no_such_plugin_mod'\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert main([]) == 0
    assert "Plugin commands unavailable: cannot import plugin module" in capsys.readouterr().out


def test_unknown_commands(core_only: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "tables.json"])
    assert exit_info.value.code == 2
    hint = "no installed plugin provides the command 'plan': `pip install shardwise-embedding`"
    assert capsys.readouterr().err.endswith(f"{hint}\n")
    monkeypatch.setenv("SHARDWISE_BLOCKED_PLUGINS", "embedding")
    plugins.reset()
    with pytest.raises(SystemExit):
        main(["plan", "tables.json"])
    assert capsys.readouterr().err.endswith(f"{hint}, or unblock its plugin (SHARDWISE_BLOCKED_PLUGINS=embedding)\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_a_command_s_shardwise_error_exits_1(core_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    def _fails(args: argparse.Namespace) -> int:
        raise ShardwiseError("the tables do not fit")

    def _bad_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--x")
        parser.add_argument("--x")  # argparse refuses a second --x

    plugins.register(_plugin(dataclasses.replace(HELLO, run=_fails)), name="toy")
    with pytest.raises(SystemExit) as exit_info:
        main(["hello"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "shardwise: error: the tables do not fit\n"
    plugins.unregister("toy")
    plugins.register(_plugin(dataclasses.replace(HELLO, add_arguments=_bad_arguments)), name="clumsy")
    with pytest.raises(SystemExit) as exit_info:
        main(["hello"])
    assert exit_info.value.code == 1
    assert (
        "plugin 'clumsy' failed to declare the arguments of command 'hello': ArgumentError" in capsys.readouterr().err
    )


def test_records_of_another_type_are_refused(core_only: None) -> None:
    plugins.register(_plugin("hello"), name="sloppy")  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="plugin 'sloppy' yielded 'hello' from shardwise_cli_commands"):
        plugins.list_cli_commands()
