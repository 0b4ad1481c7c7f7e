"""``SHARDWISE_LOGS``: the debug switch that sends shardwise's log records to stderr.

shardwise logs through the :mod:`logging` module, under the logger
``shardwise`` and one child per *component* (:data:`COMPONENTS`:
``shardwise.plan``, ``shardwise.agreement`` ...). By itself it configures
nothing, so an application's own logging setup decides what is shown. Like
``TORCH_LOGS``, the variable ``SHARDWISE_LOGS`` asks shardwise to show its
records itself:

* ``SHARDWISE_LOGS=debug`` (or ``info``, ``warning``, ``error``,
  ``critical``): every component at that level;
* ``SHARDWISE_LOGS=plan=debug,session=info``: those components at those
  levels, the others as the application configured them (by default:
  warnings and worse);
* ``SHARDWISE_LOGS=info,plan=debug``: both (a bare level is the default for
  the components not named).

Then :func:`configure_logging` gives the ``shardwise`` logger one stderr
handler whose lines name the rank (``[shardwise rank 0] DEBUG
shardwise.plan: ...``) and stops its records from also reaching the root
logger's handlers (each line is shown once; the root logger itself is never
touched). It runs when shardwise is first used (``shardwise.init``, the
plugin manager's first build), never at import. It is idempotent, and undoes
what it did when the variable is later unset or changed.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["COMPONENTS", "LEVELS", "LOGS_ENV", "LogSettings", "configure_logging", "parse_logs"]

LOGS_ENV = "SHARDWISE_LOGS"
ROOT = "shardwise"  # the top of shardwise's loggers (not the root logger)

#: The levels ``SHARDWISE_LOGS`` accepts, by name.
LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

#: The components (child loggers ``shardwise.<name>``) and what each logs.
#: Library code logs only through ``shardwise`` or one of these (a test keeps
#: every ``getLogger`` call in step with this table).
COMPONENTS: Mapping[str, str] = {
    "agreement": "handshake disagreements: which rank rejected which call, and why (DEBUG)",
    "comm": "how collectives move data: same-host one-copy reads, the asynchronous collectives' worker (DEBUG)",
    "plan": "each redistribution plan (reshard, shard_tensor, gather): pieces, bytes per peer, rounds, buffers (DEBUG)",
    "plugins": "the plugin manager: which plugins it loaded (DEBUG)",
    "session": "init and destroy: the launcher and the backend chosen",
}

#: Where a launcher puts this process's rank, read only to label log lines
#: until ``init`` says the rank (torchrun, Open MPI, MPICH/Intel MPI, PMIx, Slurm).
#: None of them set: a plain process, rank 0 of 1.
RANK_ENVS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


@dataclass(frozen=True)
class LogSettings:
    """A parsed ``SHARDWISE_LOGS`` value.

    Attributes:
        level: Level of the ``shardwise`` logger (every component not named
            in ``components``); None: left as the application set it.
        components: ``(component, level)`` pairs, in the order given.
    """

    level: Optional[int]
    components: tuple[tuple[str, int], ...]


def _usage(raw: str, problem: str) -> ValueError:
    levels = ", ".join(LEVELS)
    components = ", ".join(sorted(COMPONENTS))
    return ValueError(
        f"{LOGS_ENV}={raw!r}: {problem}. Give a level ({levels}), or component=level pairs "
        f"(components: {components}), separated by commas: for example {LOGS_ENV}=debug or "
        f"{LOGS_ENV}=info,plan=debug. Unset it to leave logging to the application."
    )


def _level(raw: str, text: str) -> int:
    level = LEVELS.get(text.strip().lower())
    if level is None:
        raise _usage(raw, f"{text.strip()!r} is not a level")
    return level


def parse_logs(raw: str) -> Optional[LogSettings]:
    """Parse a ``SHARDWISE_LOGS`` value.

    Args:
        raw: The value (case and spaces do not matter).

    Returns:
        The settings, or None when ``raw`` is empty (the switch is off).

    Raises:
        ValueError: an unknown level or component, a component named twice,
            or more than one bare level; the message names the variable and
            lists the valid values.
    """
    if not raw.strip():
        return None
    level: Optional[int] = None
    components: dict[str, int] = {}
    for item in raw.split(","):
        if not item.strip():
            raise _usage(raw, "an empty item (two commas in a row, or one at an end)")
        name, equals, value = item.partition("=")
        if not equals:
            if level is not None:
                raise _usage(raw, "more than one bare level")
            level = _level(raw, name)
            continue
        component = name.strip().lower()
        if component not in COMPONENTS:
            raise _usage(raw, f"{name.strip()!r} is not a component")
        if component in components:
            raise _usage(raw, f"component {component!r} is named twice")
        components[component] = _level(raw, value)
    return LogSettings(level, tuple(components.items()))


class _RankFormatter(logging.Formatter):
    """``[shardwise rank R] LEVEL logger: message``, the prefix repeated on each line of a multi-line message."""

    def __init__(self, rank: str) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"[shardwise rank {self.rank}] "
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


@dataclass
class _Applied:
    """What :func:`configure_logging` changed, so a later call can undo exactly that."""

    settings: LogSettings
    handler: logging.Handler
    formatter: _RankFormatter
    saved: dict[str, tuple[int, bool]]  # logger name -> (level, propagate) before


_lock = threading.Lock()
_applied: Optional[_Applied] = None
_known_rank: Optional[str] = None  # the rank the last call that knew it was given


def _guess_rank(env: Mapping[str, str]) -> str:
    for name in RANK_ENVS:
        value = env.get(name, "").strip()
        if value:
            return value
    return "0"


def _undo() -> None:
    global _applied
    if _applied is None:
        return
    top = logging.getLogger(ROOT)
    top.removeHandler(_applied.handler)
    _applied.handler.close()
    for name, (level, propagate) in _applied.saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
    _applied = None


def _apply(settings: LogSettings, rank: str) -> None:
    global _applied
    top = logging.getLogger(ROOT)
    saved = {ROOT: (top.level, top.propagate)}
    if settings.level is not None:
        top.setLevel(settings.level)
    # Records reach this handler and no other: the root logger's handlers
    # would print each line a second time (TORCH_LOGS does the same).
    top.propagate = False
    for component, level in settings.components:
        logger = logging.getLogger(f"{ROOT}.{component}")
        saved[logger.name] = (logger.level, logger.propagate)
        logger.setLevel(level)
    formatter = _RankFormatter(rank)
    handler = logging.StreamHandler()  # its default stream: stderr
    handler.setFormatter(formatter)
    top.addHandler(handler)
    _applied = _Applied(settings, handler, formatter, saved)


def configure_logging(environ: Optional[Mapping[str, str]] = None, *, rank: Optional[int] = None) -> bool:
    """Apply ``SHARDWISE_LOGS``: a stderr handler on the ``shardwise`` logger at the levels it names.

    Call it when shardwise is first used, never at import. Calling it again
    with the same value changes nothing (one handler, whatever the number
    of calls); with another value it undoes the previous settings first;
    with the variable unset it undoes them and leaves logging as the
    application set it. The root logger is never touched.

    Args:
        environ: Environment to read; defaults to ``os.environ``.
        rank: This process's rank, shown in each line. None: the rank a
            previous call was given, else the launcher's rank variable
            (``RANK``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``PMIX_RANK``,
            ``SLURM_PROCID``), else 0.

    Returns:
        Whether the switch is on.

    Raises:
        ValueError: ``SHARDWISE_LOGS`` is malformed (nothing is changed);
            the message names the variable and the valid values.
    """
    global _known_rank
    env = os.environ if environ is None else environ
    settings = parse_logs(env.get(LOGS_ENV, ""))
    with _lock:
        if rank is not None:
            _known_rank = str(rank)
        shown = _known_rank if _known_rank is not None else _guess_rank(env)
        if _applied is not None and _applied.settings == settings:
            _applied.formatter.rank = shown
            return True
        _undo()
        if settings is None:
            return False
        _apply(settings, shown)
        return True
