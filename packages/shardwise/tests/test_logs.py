"""Diagnostics: ``SHARDWISE_LOGS`` (docs/diagnostics.md) and what shardwise logs at DEBUG.

- ``configure_logging`` parses the switch, puts one stderr handler on the
  ``shardwise`` logger (lines naming the rank), is idempotent, undoes itself
  when the variable goes, rejects bad values naming the variable and the valid
  values, and never touches the root logger;
- a redistribution logs one summary line per plan (``shardwise.plan``), built
  only when DEBUG is on;
- a failed agreement or a mismatched collective logs who disagreed and how
  (``shardwise.agreement``), on the rank at fault as on its peers;
- end to end: a one-rank program under ``SHARDWISE_LOGS=debug`` prints those
  lines on stderr, prints nothing without it, and fails clearly on a bad value.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytest
import torch

from shardwise._comm.agreement import Call, Rows, check_same, failed_call
from shardwise._layout import plan_description
from shardwise._layout import redistribute as redistribute_module
from shardwise._layout.plan import plan, slab_plans
from shardwise._layout.redistribute import describe, execute, redistribute
from shardwise._registry import manager
from shardwise._vocab import logs
from shardwise._vocab.logs import COMPONENTS, LEVELS, LogSettings, configure_logging, parse_logs
from shardwise._vocab.metadata import ShardedTensorMetadata, TensorProperties
from shardwise._vocab.shard import Shard
from shardwise.errors import CollectiveMismatchError, PeerError
from shardwise.sharding_spec import ChunkShardingSpec

from rank_helpers import ScriptedPeer

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def switch_off_after() -> Iterator[None]:
    """Each test leaves the ``shardwise`` logger as it found it (the switch off)."""
    yield
    configure_logging({})


def _ours() -> list[logging.Handler]:
    handler = logs._applied.handler if logs._applied is not None else None
    return [h for h in logging.getLogger("shardwise").handlers if h is handler]


@contextlib.contextmanager
def _stderr_of_switch() -> Iterator[io.StringIO]:
    """What the switch's handler writes, instead of the real stderr."""
    assert logs._applied is not None
    handler = logs._applied.handler
    assert isinstance(handler, logging.StreamHandler)
    out = io.StringIO()
    previous = handler.setStream(out)
    try:
        yield out
    finally:
        handler.setStream(previous)


# -- the switch ---------------------------------------------------------------------


def test_values_parse() -> None:
    assert parse_logs("") is None and parse_logs("  ") is None
    assert parse_logs("debug") == LogSettings(logging.DEBUG, ())
    assert parse_logs(" Info , plan = DEBUG,session=warning") == LogSettings(
        logging.INFO, (("plan", logging.DEBUG), ("session", logging.WARNING))
    )
    assert parse_logs("agreement=error") == LogSettings(None, (("agreement", logging.ERROR),))
    assert set(LEVELS) == {"debug", "info", "warning", "error", "critical"}
    assert {"plan", "agreement", "session", "plugins"} <= set(COMPONENTS)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("loud", "'loud' is not a level"),
        ("plan=loud", "'loud' is not a level"),
        ("plna=debug", "'plna' is not a component"),
        ("=debug", "'' is not a component"),
        ("debug,info", "more than one bare level"),
        ("plan=debug,plan=info", "component 'plan' is named twice"),
        ("debug,,plan=info", "an empty item (two commas in a row, or one at an end)"),
    ],
)
def test_bad_values_name_the_variable_and_the_valid_values(value: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        configure_logging({"SHARDWISE_LOGS": value})
    message = str(info.value)
    assert message.startswith(f"SHARDWISE_LOGS={value!r}: {problem}. "), message
    assert "(debug, info, warning, error, critical)" in message, message
    assert f"(components: {', '.join(sorted(COMPONENTS))})" in message, message
    assert logs._applied is None and not _ours()


def test_switch_is_idempotent_undone_and_leaves_the_root_logger_alone() -> None:
    root, top, plan_log = logging.getLogger(), logging.getLogger("shardwise"), logging.getLogger("shardwise.plan")
    before = (root.level, list(root.handlers), top.level, top.propagate, list(top.handlers), plan_log.level)
    assert configure_logging({}) is False and logs._applied is None
    assert configure_logging({"SHARDWISE_LOGS": "debug"}, rank=0) is True
    assert configure_logging({"SHARDWISE_LOGS": "debug"}) is True
    assert len(_ours()) == 1 and len(top.handlers) == len(before[4]) + 1
    assert top.level == logging.DEBUG and top.propagate is False
    # Another value replaces the previous settings, it does not add to them.
    configure_logging({"SHARDWISE_LOGS": "plan=info"})
    assert len(_ours()) == 1 and len(top.handlers) == len(before[4]) + 1
    assert top.level == before[2] and plan_log.level == logging.INFO
    # A bad value changes nothing.
    with pytest.raises(ValueError):
        configure_logging({"SHARDWISE_LOGS": "plan=loud"})
    assert len(_ours()) == 1 and plan_log.level == logging.INFO
    configure_logging({})
    after = (root.level, list(root.handlers), top.level, top.propagate, list(top.handlers), plan_log.level)
    assert after == before and logs._applied is None


def test_lines_name_the_rank_on_every_line() -> None:
    configure_logging({"SHARDWISE_LOGS": "debug"}, rank=3)
    with _stderr_of_switch() as out:
        logging.getLogger("shardwise.plan").debug("first\nsecond")
        logging.getLogger("shardwise.session").info("chose %s", "gloo")
    assert out.getvalue().splitlines() == [
        "[shardwise rank 3] DEBUG shardwise.plan: first",
        "[shardwise rank 3] second",
        "[shardwise rank 3] INFO shardwise.session: chose gloo",
    ]


def test_rank_comes_from_the_launcher_until_init_says() -> None:
    logs._known_rank = None
    configure_logging({"SHARDWISE_LOGS": "info", "PMI_RANK": "5"})
    assert logs._applied is not None and logs._applied.formatter.rank == "5"
    configure_logging({"SHARDWISE_LOGS": "info", "PMI_RANK": "5"}, rank=2)
    assert logs._applied.formatter.rank == "2"
    configure_logging({"SHARDWISE_LOGS": "info"})  # a later call without a rank keeps the one init gave
    assert logs._applied.formatter.rank == "2"
    logs._known_rank = None
    configure_logging({"SHARDWISE_LOGS": "debug"})
    assert logs._applied.formatter.rank == "0"  # no launcher: a plain process is rank 0 of 1


def test_per_component_levels_filter_records() -> None:
    configure_logging({"SHARDWISE_LOGS": "warning,plan=debug"}, rank=0)
    with _stderr_of_switch() as out:
        logging.getLogger("shardwise.plan").debug("shown")
        logging.getLogger("shardwise.agreement").debug("hidden")
        logging.getLogger("shardwise.agreement").warning("shown too")
    assert out.getvalue().splitlines() == [
        "[shardwise rank 0] DEBUG shardwise.plan: shown",
        "[shardwise rank 0] WARNING shardwise.agreement: shown too",
    ]


def test_the_plugin_managers_first_build_applies_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("SHARDWISE_LOGS", "plugins=debug")
    manager.reset()
    manager.get_registry()
    assert len(_ours()) == 1
    monkeypatch.setenv("SHARDWISE_LOGS", "loud")
    manager.reset()
    with pytest.raises(ValueError, match="SHARDWISE_LOGS='loud'"):
        manager.get_registry()


# -- what is logged: plans ----------------------------------------------------------


def _chunks(size: list[int], dim: int, world: int) -> ShardedTensorMetadata:
    spec = ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in range(world)])
    return spec.build_metadata(size, TensorProperties(torch.float32))


class _HalfOfTwo:
    """Rank 0 of a two-rank group, as far as ``redistribute`` looks: the all-to-all returns zeros."""

    def __init__(self) -> None:
        self.rank, self.global_rank, self.size = 0, 0, 2
        self.device = torch.device("cpu")
        self.calls = 0

    def global_to_group(self) -> None:
        return None

    def unverified(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def all_to_all_single(
        self,
        send: torch.Tensor,
        *,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        out: Optional[torch.Tensor],
        async_op: bool = False,
    ) -> Any:
        self.calls += 1
        recv = torch.zeros(sum(output_split_sizes), dtype=torch.uint8)
        result = recv if out is None else out.copy_(recv)
        return _Done(result) if async_op else result


class _Done:
    """A finished asynchronous collective's handle."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


def test_a_plan_is_described_in_one_line() -> None:
    rows, cols = _chunks([8, 8], 0, 2), _chunks([8, 8], 1, 2)
    assert describe(plan(rows, cols, 0, 2), torch.float32) == (
        "rank 0 of 2, [8, 8] float32: keeps 1 piece (64 B); sends 1 piece {1: 64 B} packed into a send buffer; "
        "receives 1 piece {1: 64 B} into a view of target shard 0; 1 round, 64 B of buffers"
    )
    whole = ChunkShardingSpec(0, ["rank:1/cpu"]).build_metadata([8, 8], TensorProperties(torch.float32))
    assert describe(plan(cols, whole, 1, 2), torch.float64) == (
        "rank 1 of 2, [8, 8] float64: keeps 1 piece (256 B); sends nothing; "
        "receives 1 piece {0: 256 B} into a receive buffer, then unpacked; 1 round, 256 B of buffers"
    )
    assert describe(plan(whole, rows, 1, 2), torch.float32) == (
        "rank 1 of 2, [8, 8] float32: keeps 1 piece (128 B); sends 1 piece {0: 128 B} from a view of source "
        "shard 0; receives nothing; 1 round, 0 B of buffers"
    )
    assert describe(plan(rows, rows, 0, 2), torch.float32) == (
        "rank 0 of 2, [8, 8] float32: keeps 1 piece (128 B); no rank sends anything, so no collective"
    )
    assert [plan_description._bytes(n) for n in (0, 1023, 1536, 3 << 20, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]
    # Four ranks, rows to columns: a middle rank's buffers would exceed its shard, so it moves in slabs.
    pl = plan(_chunks([8, 8], 0, 4), _chunks([8, 8], 1, 4), 1, 4)
    assert pl.rounds == 2
    assert describe(pl, torch.float32, slab_plans(pl, 2)) == (
        "rank 1 of 4, [8, 8] float32: keeps 1 piece (16 B); sends 3 pieces {0: 16 B, 2: 16 B, 3: 16 B}; "
        "receives 3 pieces {0: 16 B, 2: 16 B, 3: 16 B}; 2 rounds (dim-0 slabs), at most 48 B of buffers in each; "
        "sent from a view in 0 and received into one in 2 of them"
    )


def test_redistribute_and_execute_log_each_plan_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shardwise.plan")
    src, dst = _chunks([8, 8], 0, 2), _chunks([8, 8], 1, 2)
    mine = [Shard(torch.zeros(4, 8), src.shards_metadata[0])]
    group: Any = _HalfOfTwo()
    redistribute(mine, src, dst, group, trusted=True, rounds=2)
    assert group.calls == 4  # four slabs (two in flight at a time, so twice the rounds), one line
    records = [r for r in caplog.records if r.name == "shardwise.plan"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert (
        records[0]
        .getMessage()
        .startswith(
            "rank 0 of 2, [8, 8] float32: keeps 1 piece (64 B); sends 1 piece "
            "{1: 64 B}; receives 1 piece {1: 64 B}; 4 rounds (dim-0 slabs)"
        )
    )
    caplog.clear()
    pl = plan(src, dst, 0, 2)
    execute(pl, {0: mine[0].tensor}, {0: torch.empty(8, 4)}, group, torch.float32, trusted=True)
    assert [r.getMessage() for r in caplog.records] == [describe(pl, torch.float32)]


def test_plans_cost_nothing_when_debug_is_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shardwise")

    def refuse(*args: Any) -> str:
        raise AssertionError("describe() ran with DEBUG off")

    monkeypatch.setattr(redistribute_module, "describe", refuse)
    src, dst = _chunks([8, 8], 0, 2), _chunks([8, 8], 1, 2)
    group: Any = _HalfOfTwo()
    redistribute([Shard(torch.zeros(4, 8), src.shards_metadata[0])], src, dst, group, trusted=True)
    execute(plan(src, dst, 0, 2), {0: torch.zeros(4, 8)}, {0: torch.empty(8, 4)}, group, torch.float32)
    assert group.calls == 2 and not caplog.records


# -- what is logged: disagreements --------------------------------------------------


def _agreement_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shardwise.agreement" and r.levelno == logging.DEBUG]


def _raise(error: Exception) -> Any:
    raise error


def test_a_peers_rejection_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shardwise.agreement")
    group = ScriptedPeer(failed_call(ValueError("spec does not fit\n  the tensor"), 2))
    with pytest.raises(PeerError):
        group.agree(lambda: 1, op="shard_tensor")
    assert _agreement_lines(caplog) == [
        "shard_tensor: rank 1 rejected its arguments (ValueError: spec does not fit the tensor); "
        "every rank raises, no data moved"
    ]


def test_this_ranks_rejection_is_logged_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shardwise.agreement")
    group = ScriptedPeer(Call("agree"))
    with pytest.raises(KeyError):
        group.agree(lambda: _raise(KeyError("no such table")), op="reshard")
    assert _agreement_lines(caplog) == [
        "reshard: rank 0 rejected its arguments (KeyError: 'no such table'); every rank raises, no data moved"
    ]


def test_mismatched_collectives_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shardwise.agreement")
    with pytest.raises(CollectiveMismatchError):
        ScriptedPeer(Call("barrier")).all_reduce(torch.ones(2))
    rows = Rows([Call("all_reduce", reduce_op=op).encode(2) for op in ("sum", "max")], 2)
    with pytest.raises(CollectiveMismatchError):
        check_same(rows, rows.reduce_op, what="reduce op")
    assert _agreement_lines(caplog) == [
        "ranks called different collectives at the same point (rank 0: all_reduce, rank 1: barrier); "
        "every rank must call the same collectives in the same order",
        "all_reduce: ranks disagree on the reduce op (rank 0: sum, rank 1: max)",
    ]


def test_agreeing_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shardwise")
    assert ScriptedPeer(Call("agree")).agree(lambda: 7, op="reshard") == 7
    assert not caplog.records


# -- end to end: a one-rank program -------------------------------------------------

PROGRAM = """
import torch
import shardwise
from shardwise.sharding_spec import ChunkShardingSpec

group = shardwise.init(backend="test-gloo")
st = shardwise.shard_tensor(torch.arange(8.0).reshape(4, 2), ChunkShardingSpec(0, ["rank:0/cpu"]))
try:
    group.agree(lambda: int("x"), op="my_op")
except ValueError:
    pass
shardwise.destroy()
print("done")
"""


def _run(program: str, logs_value: Optional[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")}
    env.update(SHARDWISE_PLUGINS="core_test_backend", SHARDWISE_DISABLE_PLUGIN_AUTOLOAD="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        env.pop(name, None)
    if logs_value is not None:
        env["SHARDWISE_LOGS"] = logs_value
    return subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_debug_switch_prints_the_debug_lines_on_stderr() -> None:
    done = _run(PROGRAM, "debug")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n"
    lines = done.stderr.splitlines()
    assert any(
        line.startswith("[shardwise rank 0] DEBUG shardwise.plugins: plugin manager built: core_test_backend")
        for line in lines
    ), done.stderr
    assert (
        "[shardwise rank 0] DEBUG shardwise.plan: rank 0 of 1, [4, 2] float32: keeps 1 piece (32 B); no rank "
        "sends anything, so no collective" in lines
    ), done.stderr
    assert (
        "[shardwise rank 0] DEBUG shardwise.agreement: my_op: rank 0 rejected its arguments (ValueError: "
        "invalid literal for int() with base 10: 'x'); every rank raises, no data moved" in lines
    ), done.stderr


def test_without_the_switch_nothing_is_printed() -> None:
    done = _run(PROGRAM, None)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n" and "shardwise" not in done.stderr, done.stderr


def test_a_bad_value_fails_clearly_on_first_use_not_at_import() -> None:
    done = _run(PROGRAM, "verbose")
    assert done.returncode == 1 and done.stdout == ""
    assert (
        done.stderr.rstrip()
        .splitlines()[-1]
        .startswith(
            "ValueError: SHARDWISE_LOGS='verbose': 'verbose' is not a level. Give a level (debug, info, warning, "
            "error, critical), or component=level pairs"
        )
    ), done.stderr
    imported = _run("import shardwise, shardwise.sharded_tensor; print('imported')", "verbose")
    assert imported.returncode == 0 and imported.stdout == "imported\n" and imported.stderr == "", imported.stderr
