"""The recommendation demo (``examples/recsys.py --tiny``) under the real launchers.

It trains on 2 ranks under ``mpiexec`` (backend mpi) and saves a
checkpoint, which then resumes on 3 ranks, once under ``mpiexec`` and once
under ``torchrun`` with backend gloo. Every run must end with rank 0's
dense replay of all its steps matching the sharded run, and draw the loss
curve as a PNG (the torchrun run without matplotlib: it must say so and
still succeed). The output goes to a pipe, as in a CI log: it must hold a
few plain progress lines and no carriage returns. Skipped where no mpiexec
is installed; every job is killed (its whole process group) after
``DEMO_TIMEOUT`` seconds, and its full output is in the assertion message.

The progress display itself (``examples/_progress.py``) is tested in this
process, and under ``mpiexec`` on a pseudo-terminal.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_torchrun_gloo import _environment, torchrun

pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
pytest.importorskip("shardwise_embedding", reason="the demo's sharded tables need shardwise-embedding")
try:
    from shardwise.testing import find_mpiexec

    MPIEXEC = find_mpiexec()
except FileNotFoundError as exc:  # pragma: no cover - depends on the env
    pytest.skip(f"no mpiexec: {exc}", allow_module_level=True)

from test_mpiexec import mpiexec  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEMO = EXAMPLES / "recsys.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: Seconds one tiny demo job may take: it trains for well under a second,
#: the rest is starting the ranks and importing torch on a small machine.
DEMO_TIMEOUT = 180

#: The tiny demo's default number of steps per run.
TINY_STEPS = 12


def _mpiexec(n: int, *args: str) -> str:
    return mpiexec(DEMO, n, "--tiny", *args, timeout=DEMO_TIMEOUT)


def _assert_matches_dense(out: str, ranks: int, last_step: int) -> None:
    assert f"dense reference (1 process, plain nn.EmbeddingBag, steps 0..{last_step}):" in out, out
    assert f"the MLP is identical on all {ranks} ranks" in out, out
    assert "dense reference: MATCH" in out, out
    _assert_log_friendly(out)


def _assert_log_friendly(out: str) -> None:
    """The progress of a run whose output is not a terminal: a few plain lines, no bar redrawn with \\r."""
    assert "\r" not in out, repr(out)
    # Progress lines, ours ("desc: 40%, ..." / "desc: done, ...") or a bar's ("desc:  40%|████ ...").
    lines = re.findall(r"^(?:steps \d+\.\.\d+ on [^:]*|dense reference): +(?:\d+%|done).*$", out, flags=re.MULTILINE)
    # A tiny run is over within seconds: just each loop's final line (a long one adds one per tenth, at most).
    assert len(lines) <= 4 and any(line.startswith("dense reference: done, ") for line in lines), lines


def _assert_picture(out: str, png: Path, last_step: int) -> None:
    """The run printed where it drew its loss curve, and ``png`` is a PNG with a nonzero size."""
    assert f"loss curve picture (sharded against dense, steps 0..{last_step}): {png}" in out, out
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, (width, height)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the tiny demo after training on 2 ranks under mpiexec."""
    path = tmp_path_factory.mktemp("demo") / "recsys"
    out = _mpiexec(2, "--checkpoint", str(path))
    assert f"trained steps 0..{TINY_STEPS - 1} on 2 ranks (mpi)" in out, out
    assert f"saved {path} at step {TINY_STEPS}" in out, out
    _assert_matches_dense(out, ranks=2, last_step=TINY_STEPS - 1)
    _assert_picture(out, path.parent / f"recsys-loss-steps-0-{TINY_STEPS - 1}.png", TINY_STEPS - 1)
    return path


def _assert_resumed(out: str, path: Path, label: str) -> None:
    assert f"resumed {path} at step {TINY_STEPS} (2 ranks (mpi) trained steps up to {TINY_STEPS - 1}) on {label}" in out
    assert re.search(rf"first resumed step {TINY_STEPS}: loss \d\.\d{{4}}", out), out
    assert f"trained steps {TINY_STEPS}..{2 * TINY_STEPS - 1} on {label}" in out, out
    _assert_matches_dense(out, ranks=3, last_step=2 * TINY_STEPS - 1)


def test_demo_resumes_on_three_ranks_under_mpiexec(checkpoint: Path) -> None:
    out = _mpiexec(3, "--resume", str(checkpoint))
    _assert_resumed(out, checkpoint, "3 ranks (mpi)")
    # Both runs' steps in one picture, beside the first run's.
    _assert_picture(out, checkpoint.parent / f"recsys-loss-steps-0-{2 * TINY_STEPS - 1}.png", 2 * TINY_STEPS - 1)


def test_demo_resumes_on_three_ranks_under_torchrun_with_gloo_and_without_matplotlib(
    checkpoint: Path, tmp_path: Path
) -> None:
    pytest.importorskip("shardwise_gloo", reason="the torchrun half needs shardwise-gloo")
    # matplotlib is optional: hidden here by a module of that name that cannot be imported.
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "matplotlib.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "hide"), os.environ.get("PYTHONPATH", "")) if p)
    png = tmp_path / "loss.png"
    args = ("--tiny", "--backend", "gloo", "--resume", str(checkpoint), "--plot", str(png))
    result = torchrun(DEMO, 3, DEMO_TIMEOUT, args=args, PYTHONPATH=path)
    assert result.returncode == 0, f"torchrun exited {result.returncode}; output:\n{result.stdout}"
    _assert_resumed(result.stdout, checkpoint, "3 ranks (gloo)")
    assert "loss curve picture: not drawn, matplotlib is not installed" in result.stdout, result.stdout
    assert not png.exists()


def test_picture_marks_a_resume_on_the_same_ranks_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plot = importlib.import_module("_recsys_plot")
    runs = [[0, "2 ranks (mpi)"], [5, "2 ranks (mpi)"], [8, "3 ranks (gloo)"]]
    # The second run has the first one's label, and still is a segment of its own.
    assert plot.segments(runs, 10) == [(0, 5, "2 ranks (mpi)"), (5, 8, "2 ranks (mpi)"), (8, 10, "3 ranks (gloo)")]
    assert plot.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@pytest.fixture
def progress(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/_progress.py, imported as the demo imports it (its directory on sys.path)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("_progress")


def test_progress_in_a_log_is_a_line_per_tenth_at_most(progress: ModuleType) -> None:
    log = io.StringIO()
    display = progress.progress(1000, "steps 0..999", "sample", unit_scale=True, file=log)
    assert isinstance(display, progress.LogLines)  # a StringIO is no terminal
    display.interval = 0  # every tenth gets its line, however fast the loop
    for _ in range(1000):
        display.set_postfix_str("loss=0.5000", refresh=False)
        display.update(1)
    display.close()
    display.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [line.split(",")[0] for line in lines] == [f"steps 0..999: {p}%" for p in range(10, 100, 10)] + [
        "steps 0..999: done"
    ]
    assert lines[-1].startswith("steps 0..999: done, 1.00k/1.00k samples in ") and lines[-1].endswith(
        "samples/s, loss=0.5000"
    ), lines


def test_progress_in_a_log_of_a_short_loop_is_one_line(progress: ModuleType) -> None:
    log = io.StringIO()
    display = progress.progress(471, "dense reference", "step", file=log)
    for _ in range(471):
        display.update(1)
    display.close()
    assert log.getvalue().startswith("dense reference: done, 471/471 steps in "), log.getvalue()
    assert log.getvalue().count("\n") == 1, log.getvalue()


def test_progress_disabled_prints_nothing(progress: ModuleType) -> None:
    log = io.StringIO()
    display = progress.progress(10, "rank 1", "step", disable=True, file=log)
    display.update(10)
    display.close()
    assert log.getvalue() == ""


def test_progress_on_a_terminal_is_a_tqdm_bar(progress: ModuleType) -> None:
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as terminal:
        try:
            assert progress.writes_to_terminal(terminal)
            display = progress.progress(10, "steps", "step", file=terminal, disable=True)
            assert type(display).__name__ == "tqdm", type(display)
        finally:
            os.close(master)
    reader, writer = os.pipe()
    with os.fdopen(reader), os.fdopen(writer, "w") as pipe_out:
        assert not progress.writes_to_terminal(pipe_out)  # a pipe to pytest, not to an MPI launcher


def _under_mpiexec_on(stdout: int) -> str:
    """What ``writes_to_terminal(sys.stderr)`` says in a rank of ``mpiexec -n 1`` whose output goes to ``stdout``."""
    code = (
        f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); from _progress import writes_to_terminal; "
        "print('on a terminal:', writes_to_terminal(sys.stderr))"
    )
    env = _environment(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = subprocess.run(
        [MPIEXEC, "-n", "1", sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result
    return "" if result.stdout is None else result.stdout.decode()


def test_progress_under_mpiexec_follows_the_launchers_terminal() -> None:
    # A rank's stderr is a pipe to the launcher: a bar only if the launcher writes to a terminal.
    assert "on a terminal: False" in _under_mpiexec_on(subprocess.PIPE)
    master, slave = os.openpty()
    try:
        _under_mpiexec_on(slave)
    finally:
        os.close(slave)
    output = b""
    try:
        while chunk := os.read(master, 4096):
            output += chunk
    except OSError:  # EIO: the terminal's other end is closed and everything was read
        pass
    finally:
        os.close(master)
    assert b"on a terminal: True" in output, output
