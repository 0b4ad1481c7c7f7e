"""``shardwise plan``: the command end to end (a subprocess), and its parts in process."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from shardwise_embedding import _plan_cli
from shardwise_embedding._plan_data import EmbeddingShardingPlan
from shardwise_embedding._planner import ParameterConstraints

from shardwise import plugins

TABLES = [
    {"name": "tiny", "embedding_dim": 16, "num_embeddings": 10},
    {"name": "big", "embedding_dim": 64, "num_embeddings": 5_000_000, "feature_names": ["a", "b"]},
    {"name": "mid", "embedding_dim": 32, "num_embeddings": 100_000, "pooling": "mean", "pooling_factor": 5},
]


def _start(*args: str) -> subprocess.Popen[str]:
    """``python -m shardwise ARGS`` started: the end-to-end runs start together, so they overlap their imports."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardwise", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _file(tmp_path: Path, data: Any, name: str = "tables.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``shardwise plan ARGV`` in process: its status, stdout and stderr."""
    parser = argparse.ArgumentParser(prog="shardwise plan")
    _plan_cli.add_arguments(parser)
    status = _plan_cli.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_plugin_provides_the_command() -> None:
    (command,) = [c for c in plugins.list_cli_commands() if c.name == "plan"]
    assert command.plugin == "embedding" and command.run is _plan_cli.run and command.help == _plan_cli.HELP


def test_shardwise_plan_end_to_end(tmp_path: Path) -> None:
    # Two runs, started together (each imports torch): a plan, and bad input.
    constrained = _file(tmp_path, {"tables": TABLES, "constraints": {"mid": {"sharding_types": ["table_wise"]}}})
    out = tmp_path / "plan.json"
    good = _start("plan", constrained, "--world-size", "4", "--ranks-per-host", "2", "--explain", "--output", str(out))
    bad_json = _file(tmp_path, "[{", "bad.json")
    bad = _start("plan", bad_json, "--world-size", "2")

    # --explain: the explanation on stdout, naming every table; --output: the JSON in the file.
    status, stdout, stderr = _finish(good)
    assert status == 0, stderr
    assert stdout.startswith("Sharding plan for 4 rank(s), 2 per host: 3 table(s)")
    for name in ("tiny", "big", "mid"):
        assert f"\n  {name} " in stdout
    plan = EmbeddingShardingPlan.from_json(out.read_text(encoding="utf-8"))
    assert [t.name for t in plan.tables] == ["tiny", "big", "mid"]
    assert plan["mid"].sharding_type == "table_wise" and plan.ranks_per_host == 2

    status, stdout, stderr = _finish(bad)
    assert (status, stdout) == (1, "")
    assert stderr == (
        f"shardwise plan: error: {bad_json} is not JSON (Expecting property name enclosed in double quotes at "
        "line 1 column 3); fix the file\n"
    )


def test_the_plan_goes_to_stdout_and_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, _file(tmp_path, TABLES), "--world-size", "4", "--memory-budget", "1GiB")
    assert (status, err) == (0, "")
    plan = EmbeddingShardingPlan.from_json(out)
    assert plan.world_size == 4 and plan.memory_budget_bytes == 1 << 30
    assert [t.name for t in plan.tables] == ["tiny", "big", "mid"]
    assert plan["big"].sharding_type == "row_wise"
    assert any("mid 5" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read {path}: No such file or directory; pass a JSON file of tables"),
        ("[{", "{path} is not JSON (Expecting property name enclosed in double quotes at line 1 column 3)"),
        ({"tables": TABLES, "constraints": {"big": {"sharding_types": ["rowwise"]}}},
         "constraints['big']: unknown sharding types ['rowwise']; valid: data_parallel, table_wise, row_wise"),
        ({"tables": TABLES, "constraints": {"nope": {}}}, "name tables ['nope'] not among"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, message: str
) -> None:
    path = str(tmp_path / "missing.json") if content is None else _file(tmp_path, content)
    status, out, err = _run(capsys, path, "--world-size", "2")
    assert (status, out) == (1, "")
    assert err.startswith("shardwise plan: error: ") and err.count("\n") == 1
    assert message.format(path=path) in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--world-size", "0"), "argument --world-size: must be an int >= 1, got '0'"),
        (("--world-size", "two"), "argument --world-size: must be an int >= 1, got 'two'"),
        (("--world-size", "2", "--memory-budget", "lots"), "argument --memory-budget: 'lots' is not a size"),
        (("--world-size", "2", "--optimizer-state", "lamb"), "argument --optimizer-state: invalid choice: 'lamb'"),
        ((), "the following arguments are required: --world-size"),
    ],
)
def test_bad_options_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        _run(capsys, _file(tmp_path, TABLES), *args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "t"}, "expected a list"),
        ([], "the tables must be a non-empty JSON list"),
        ({"tables": [], "extra": 1}, "the object has keys ['extra', 'tables']"),
        ([3], "table #0 is int, not an object"),
        ([{"name": "t", "embedding_dim": 4}], "table #0 ('t') lacks num_embeddings"),
        ([{"name": "t", "embedding_dim": 4, "num_embeddings": 9, "rows": 3}], "unknown keys ['rows']"),
        ([{"name": "t", "embedding_dim": 0, "num_embeddings": 9}], "embedding_dim must be an int >= 1"),
        ([{"name": "t", "embedding_dim": 4, "num_embeddings": 9, "feature_names": "f"}], "must be a list of names"),
        ([{"name": "t", "embedding_dim": 4, "num_embeddings": 9, "dtype": "int8"}], "dtype 'int8' is not one of"),
        ([{"name": "t", "embedding_dim": 4, "num_embeddings": 9, "pooling": "max"}], "pooling must be 'sum' or"),
        ({"tables": [{"name": "t", "embedding_dim": 4, "num_embeddings": 9}], "constraints": {"t": {"rank": [1]}}},
         "constraints['t']: unknown keys ['rank']"),
        ({"tables": [{"name": "t", "embedding_dim": 4, "num_embeddings": 9}], "constraints": []},
         "'constraints' must be an object"),
    ],
)  # fmt: skip
def test_malformed_tables_say_what_to_fix(data: Any, message: str) -> None:
    if message == "expected a list":
        message = "give 'tables' (a list)"
    with pytest.raises(ValueError) as info:
        _plan_cli.load_tables(data)
    assert message in str(info.value)


def test_load_tables_reads_constraints_sizes_and_pooling() -> None:
    data = {
        "tables": [{"name": "a", "embedding_dim": 8, "num_embeddings": 100, "pooling_factor": 2.5, "dtype": "float16"}],
        "constraints": {"a": {"sharding_types": ["row_wise"], "ranks": [0, 1], "max_bytes_per_rank": "1KiB"}},
    }
    tables, constraints, pooling = _plan_cli.load_tables(data)
    assert tables[0].feature_names == ("a",) and tables[0].dtype.itemsize == 2
    assert constraints == {"a": ParameterConstraints(("row_wise",), (0, 1), 1024)}
    assert pooling == {"a": 2.5}


@pytest.mark.parametrize(
    ("text", "size"),
    [("1024", 1024), ("512MiB", 512 << 20), ("512M", 512 << 20), ("512mb", 512_000_000), ("1.5 GiB", 3 << 29),
     ("2g", 2 << 30), ("10B", 10), ("0.5KB", 500)],
)  # fmt: skip
def test_sizes(text: str, size: int) -> None:
    assert _plan_cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-5MiB", "0", "5 XB", "1.2.3G"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        _plan_cli.parse_size(text)


def test_in_process_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    tables = _file(tmp_path, TABLES)
    status, out, err = _run(capsys, tables, "--world-size", "2", "--batch-size", "64", "--optimizer-state", "sgd")
    assert status == 0 and err == "" and "batch 64 per rank" in EmbeddingShardingPlan.from_json(out).notes[0]
    # Nothing fits: status 1, one line naming the table and the budget.
    status, out, err = _run(capsys, tables, "--world-size", "2", "--memory-budget", "1MiB")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and "table 'big'" in err and "1.0 MiB" in err
    # --output alone: the JSON goes to the file, nothing to stdout.
    target = tmp_path / "out.json"
    status, out, err = _run(capsys, tables, "--world-size", "3", "--output", str(target))
    assert status == 0 and out == "" and EmbeddingShardingPlan.from_json(target.read_text()).world_size == 3
    status, out, err = _run(capsys, tables, "--world-size", "3", "--output", str(tmp_path / "no" / "such.json"))
    assert status == 1 and "cannot write" in err
    # '-' reads the tables from standard input.
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(TABLES)))
    status, out, err = _run(capsys, "-", "--world-size", "2", "--explain")
    assert status == 0 and "Tables:" in out
    # A table of a bad shape or a negative pooling factor: one line naming it.
    dotted = _file(tmp_path, [{"name": "x.y", "embedding_dim": 2, "num_embeddings": 2}], "dotted.json")
    status, out, err = _run(capsys, dotted, "--world-size", "2")
    assert status == 1 and "table #0 ('x.y')" in err
    status, out, err = _run(capsys, tables, "--world-size", "2", "--pooling-factor", "-1")
    assert status == 1 and "default_pooling_factor must be a number >= 0" in err


# -- the docs' examples ----------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
#: The pages whose console blocks run ``shardwise plan`` on ``examples/criteo_tables.json``.
PAGES = ("README.md", "docs/collections.md", "docs/cli.md")


def _shown_runs(text: str) -> list[tuple[list[str], list[str]]]:
    """Each ``$ shardwise plan ...`` line of ``text``'s console blocks: its arguments and the lines shown after it."""
    runs: list[tuple[list[str], list[str]]] = []
    shown: list[str] = []
    for line in text.splitlines():
        if line.startswith("$ shardwise plan "):
            shown = []
            runs.append((line[len("$ shardwise plan ") :].split("#")[0].split(), shown))
        elif line.startswith(("$", "```")):
            shown = []  # another command, or the block's end: what follows belongs to no plan run
        elif line.strip() not in ("", "...") and runs and shown is runs[-1][1]:
            shown.append(line.rstrip())
    return runs


@pytest.mark.parametrize("page", PAGES)
def test_the_docs_show_what_shardwise_plan_prints_for_the_example_tables(
    page: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = _shown_runs((ROOT / page).read_text(encoding="utf-8"))
    assert runs, f"{page} shows no `shardwise plan` run"
    monkeypatch.chdir(ROOT)  # the pages name the tables by their path in the repository
    for argv, shown in runs:
        assert argv[0] == "examples/criteo_tables.json", (page, argv)
        if "--output" in argv:
            at = argv.index("--output") + 1
            argv[at] = str(tmp_path / argv[at])
        status, out, err = _run(capsys, *argv)
        printed = [line.rstrip() for line in (out + err).splitlines()]
        missing = [line for line in shown if line not in printed]
        assert not missing, f"{page}: `shardwise plan {' '.join(argv)}` (exit {status}) did not print {missing}"
        if "--output" in argv:
            plan = EmbeddingShardingPlan.from_json(Path(argv[at]).read_text())
            assert status == 0 and plan.world_size == 16 and len(plan.tables) == 26, (status, plan)
