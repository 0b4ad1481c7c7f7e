"""Progress display for long loops: a tqdm bar on a terminal, a few plain lines in a log.

A tqdm bar redraws itself with a carriage return several times a second.
On a terminal that is one line that keeps changing; in a log file (CI, ``make
demo > log``) every redraw stays, hundreds of them glued into one line. So
:func:`progress` draws the bar only when the output ends on a terminal, and
otherwise prints a plain line at every tenth of the way (no more often than
every few seconds) and one at the end.

Under ``mpiexec`` no rank writes to a terminal itself: a rank's stderr is a
pipe to the launcher, which copies it to its own stderr. There the answer
is the launcher's: see :func:`writes_to_terminal`.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import IO, Any, Optional, Protocol

from tqdm import tqdm

__all__ = ["LogLines", "Progress", "progress", "writes_to_terminal"]

#: Names of the processes that relay a rank's output to the launcher's own stderr
#: (MPICH's and Intel MPI's hydra, Open MPI's PRRTE and ORTE).
_RELAYS = frozenset(
    {"mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "hydra_pmi_proxy", "prterun", "prted", "orterun", "orted"}
)
#: How many relays to look through: a rank's proxy, then the launcher.
_MAX_RELAYS = 3


class Progress(Protocol):
    """What the demo and the benchmarks call on a progress display (a subset of tqdm's)."""

    def update(self, n: int = 1) -> Any:
        """Count ``n`` more units done."""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Show ``s`` after the counts (a loss, the current row)."""

    def write(self, s: str) -> None:
        """Print a message line without breaking the display."""

    def close(self) -> None:
        """Finish the display."""


def _is_terminal_path(path: str) -> bool:
    return path.startswith(("/dev/pts/", "/dev/tty")) or path == "/dev/console"


def writes_to_terminal(stream: IO[str]) -> bool:
    """Whether what is written to ``stream`` ends up on a terminal.

    True when ``stream`` is a terminal, or when it is a pipe to an MPI
    launcher (``mpiexec`` and its per-host proxy) whose own stderr is one.
    A pipe to anything else (``| tee log``, a test capturing the output) and
    a file are not terminals, nor is anything this cannot tell (no
    ``/proc``: not Linux).

    Args:
        stream: A text stream, usually ``sys.stderr``.

    Returns:
        Whether to draw a progress bar on ``stream``.
    """
    try:
        if stream.isatty():
            return True
        mode = os.fstat(stream.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # no file descriptor (StringIO) or a closed one
        return False
    if not stat.S_ISFIFO(mode):
        return False
    pid = os.getppid()
    for _ in range(_MAX_RELAYS):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
            if name not in _RELAYS:
                return False
            if _is_terminal_path(os.readlink(f"/proc/{pid}/fd/2")):
                return True
            with open(f"/proc/{pid}/stat") as status:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
                pid = int(status.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended, or /proc is not there
            return False
    return False


class LogLines:
    """A progress display for logs: a plain line at every tenth of ``total`` and one at the end.

    A line for a tenth is printed only if ``interval`` seconds have passed
    since the start or the last line, so a short loop prints just its final
    line and a long one at most eleven. No carriage returns.

    Args:
        total: Units the loop will count.
        desc: What the loop does; starts every line.
        unit: Name of one unit (``"sample"``).
        unit_scale: Write counts with SI prefixes (``1.23M``), as tqdm's ``unit_scale``.
        file: Where to print.
        interval: Fewest seconds between two lines (the final line excepted).
        disable: Print nothing (as tqdm's ``disable``, for the ranks other than 0).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        *,
        unit_scale: bool = False,
        file: Optional[IO[str]] = None,
        interval: float = 10.0,
        disable: bool = False,
    ) -> None:
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.file = sys.stderr if file is None else file
        self.interval, self.disable = interval, disable
        self.n = 0
        self.postfix = ""
        self._started = self._last_line = time.monotonic()
        self._tenths_shown = 0
        self._closed = False

    def _count(self, n: int) -> str:
        return tqdm.format_sizeof(n) if self.unit_scale else f"{n:,}"

    def _line(self, text: str) -> None:
        if not self.disable:
            # One write per line: stderr writes through, and mpiexec would interleave another
            # stream's output between a line and its newline if they came in two writes.
            self.file.write(text + "\n")
            self.file.flush()

    def _figures(self, now: float) -> str:
        elapsed = now - self._started
        rate = f", {tqdm.format_sizeof(self.n / elapsed)} {self.unit}s/s" if elapsed > 0 and self.n else ""
        postfix = f", {self.postfix}" if self.postfix else ""
        return f"{self._count(self.n)}/{self._count(self.total)} {self.unit}s in {elapsed:.1f} s{rate}{postfix}"

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units; print a line if a new tenth is reached and ``interval`` has passed."""
        self.n += n
        tenths = self.n * 10 // self.total if self.total > 0 else 0
        now = time.monotonic()
        if self._tenths_shown < tenths < 10 and now - self._last_line >= self.interval:
            self._tenths_shown, self._last_line = tenths, now
            self._line(f"{self.desc}: {tenths * 10}%, {self._figures(now)}")

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Show ``s`` at the end of the next line (``refresh`` is tqdm's; lines are never redrawn)."""
        self.postfix = s

    def write(self, s: str) -> None:
        """Print ``s`` on stdout, as ``tqdm.write`` does (also when disabled)."""
        sys.stdout.write(s + "\n")
        sys.stdout.flush()

    def close(self) -> None:
        """Print the final line (once)."""
        if not self._closed:
            self._closed = True
            self._line(f"{self.desc}: done, {self._figures(time.monotonic())}")


def progress(
    total: int,
    desc: str,
    unit: str,
    *,
    unit_scale: bool = False,
    disable: bool = False,
    file: Optional[IO[str]] = None,
    **bar_options: Any,
) -> Progress:
    """A tqdm bar if ``file`` ends on a terminal (:func:`writes_to_terminal`), else :class:`LogLines`.

    Args:
        total: Units the loop will count.
        desc: What the loop does.
        unit: Name of one unit.
        unit_scale: Write counts with SI prefixes.
        disable: Show nothing (a rank other than 0).
        file: Where to write; ``sys.stderr`` by default.
        **bar_options: More tqdm options (``dynamic_ncols``, ``leave``), for the bar only.

    Returns:
        The display; call ``update``, ``set_postfix_str``, ``write`` and ``close`` on it.
    """
    stream = sys.stderr if file is None else file
    if writes_to_terminal(stream):
        bar: Progress = tqdm(
            total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable, file=stream, **bar_options
        )
        return bar
    return LogLines(total, desc, unit, unit_scale=unit_scale, file=stream, disable=disable)
