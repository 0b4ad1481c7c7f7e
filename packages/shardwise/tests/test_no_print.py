"""Library code reports through ``logging`` only (docs/diagnostics.md), checked from the syntax tree.

Under ``packages/*/src`` and ``plugins/*/src`` no code may

- call ``print``, or ``traceback.print_*`` / ``pprint.pprint`` without a ``file=``;
- touch ``sys.stdout`` / ``sys.stderr`` (or their ``__stdout__``/``__stderr__``),
  or ``os.write`` to file descriptor 1 or 2;
- log through the root logger (``logging.info(...)``, ``logging.basicConfig``,
  ``logging.getLogger()``), or through a logger that ``SHARDWISE_LOGS`` does
  not reach: a logger is ``shardwise`` or ``shardwise.<component>``, with the
  component listed in ``shardwise._vocab.logs.COMPONENTS``.

Except where :data:`ALLOWED` says: the ``shardwise`` command line's own output,
and what a dying MPI job must print before ``MPI_Abort`` (no logging handler
can be trusted to flush in time there).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

from shardwise._vocab.logs import COMPONENTS

REPO = Path(__file__).resolve().parents[3]

#: Where writing to the terminal is the point. A path maps to the functions
#: (qualified names, nested functions included) that may; ``"*"``: the whole module.
ALLOWED: dict[str, frozenset[str]] = {
    # `shardwise info` / `python -m shardwise`: the command line's own output.
    "packages/shardwise/src/shardwise/_session/info.py": frozenset({"*"}),
    # The excepthook that ends the MPI job: says which rank raised, then MPI_Abort.
    "plugins/shardwise-mpi/src/shardwise_mpi/plugin.py": frozenset({"install_abort_hook"}),
    # The watchdog that aborts a job blocked past its timeout: says why, then MPI_Abort.
    "plugins/shardwise-mpi/src/shardwise_mpi/_watchdog.py": frozenset({"Watchdog._expire"}),
    # `shardwise plan`: the command's own output (the plan, its explanation) and its one-line error.
    "plugins/shardwise-embedding/src/shardwise_embedding/_plan_cli.py": frozenset({"run", "_fail"}),
}
#: Modules that may name loggers by computed names: the ``SHARDWISE_LOGS`` switch,
#: which configures ``shardwise.<component>`` for each component it is given.
CONFIGURE_LOGGERS = frozenset({"packages/shardwise/src/shardwise/_vocab/logs.py"})

_STREAMS = {"stdout", "stderr", "__stdout__", "__stderr__"}
_PRINTERS = {
    ("traceback", "print_exc"),
    ("traceback", "print_exception"),
    ("traceback", "print_stack"),
    ("traceback", "print_tb"),
    ("traceback", "print_last"),
    ("pprint", "pprint"),
    ("pprint", "pp"),
}
_ROOT_LOGGING = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log", "basicConfig"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    function: str
    what: str
    rule: str  # "terminal" (writes to it) or "logger" (a logger SHARDWISE_LOGS does not reach)

    def __str__(self) -> str:
        return f"{self.path}:{self.line} (in {self.function or 'module level'}): {self.what}"


def _dotted(node: ast.AST) -> Optional[tuple[str, ...]]:
    """``("sys", "stderr", "write")`` for ``sys.stderr.write``; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return (node.id, *reversed(parts))


def _logger_name_problem(call: ast.Call) -> Optional[str]:
    if not call.args and not call.keywords:
        return "logging.getLogger() is the root logger; use logging.getLogger('shardwise.<component>')"
    arg = call.args[0] if call.args else call.keywords[0].value
    if not isinstance(arg, ast.Constant) or not isinstance(arg.value, str):
        return (
            f"logger name {ast.unparse(arg)} is not a string literal; "
            "use 'shardwise' or 'shardwise.<component>' so SHARDWISE_LOGS reaches it"
        )
    name = arg.value
    if name == "shardwise":
        return None
    prefix, _, component = name.partition(".")
    if prefix != "shardwise" or not component:
        return f"logger {name!r} is outside 'shardwise', so SHARDWISE_LOGS does not reach it"
    if component not in COMPONENTS:
        return (
            f"logger {name!r}: {component!r} is not a component; add it to COMPONENTS in "
            "shardwise/_vocab/logs.py and to docs/diagnostics.md"
        )
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.found: list[Finding] = []
        self.functions: set[str] = set()

    def _report(self, node: ast.AST, what: str, rule: str = "terminal") -> None:
        self.found.append(Finding(self.path, getattr(node, "lineno", 0), ".".join(self.scope), what, rule))

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        if not isinstance(node, ast.ClassDef):
            self.functions.add(".".join(self.scope))
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "sys":
            for alias in node.names:
                if alias.name in _STREAMS:
                    self._report(node, f"from sys import {alias.name}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "sys" and node.attr in _STREAMS:
            self._report(node, f"sys.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        has_file = any(k.arg == "file" for k in node.keywords)
        if name == ("print",):
            self._report(node, "print()")
        elif name is not None and name[-2:] in _PRINTERS and not has_file:
            self._report(node, f"{'.'.join(name)}() without file= (writes to the terminal)")
        elif name == ("os", "write") and node.args:
            fd = node.args[0]
            if isinstance(fd, ast.Constant) and fd.value in (1, 2):
                self._report(node, f"os.write({fd.value}, ...)")
        elif name is not None and name[:1] == ("logging",) and len(name) == 2:
            if name[1] in _ROOT_LOGGING:
                self._report(node, f"logging.{name[1]}() logs through (and may configure) the root logger", "logger")
            elif name[1] == "getLogger":
                problem = _logger_name_problem(node)
                if problem is not None:
                    self._report(node, problem, "logger")
        self.generic_visit(node)


def audit(source: str, path: str) -> tuple[list[Finding], set[str]]:
    """What ``source`` does that library code may not, and the qualified names of its functions."""
    visitor = _Visitor(path)
    visitor.visit(ast.parse(source, filename=path))
    return visitor.found, visitor.functions


def _allowed(finding: Finding) -> bool:
    if finding.rule == "logger":
        return finding.path in CONFIGURE_LOGGERS and finding.what.startswith("logger name ")
    allowed = ALLOWED.get(finding.path, frozenset())
    return "*" in allowed or any(finding.function == f or finding.function.startswith(f + ".") for f in allowed)


def library_files() -> Iterator[Path]:
    for src in sorted([*REPO.glob("packages/*/src"), *REPO.glob("plugins/*/src")]):
        yield from sorted(src.rglob("*.py"))


def test_library_code_writes_to_no_terminal_and_logs_under_shardwise() -> None:
    files = list(library_files())
    roots = {f.relative_to(REPO).parts[:2] for f in files}
    # The core and every plugin are covered (a new plugin is picked up by the glob).
    assert ("packages", "shardwise") in roots
    assert {("plugins", p.name) for p in REPO.glob("plugins/*") if (p / "src").is_dir()} <= roots
    assert len(roots) >= 6, roots
    bad: list[Finding] = []
    functions: dict[str, set[str]] = {}
    for file in files:
        path = file.relative_to(REPO).as_posix()
        found, functions[path] = audit(file.read_text(), path)
        bad += [f for f in found if not _allowed(f)]
    assert not bad, (
        f"{len(bad)} place(s) write to the terminal or log where SHARDWISE_LOGS cannot reach; log through "
        "logging.getLogger('shardwise.<component>') instead (docs/diagnostics.md):\n" + "\n".join(f"  {f}" for f in bad)
    )
    # The allow-list names code that exists: a renamed function loses its exemption loudly.
    for path, names in [*ALLOWED.items(), *((path, frozenset({"*"})) for path in CONFIGURE_LOGGERS)]:
        assert path in functions, f"ALLOWED names {path}, which is not a library file"
        missing = sorted(names - {"*"} - functions[path])
        assert not missing, f"ALLOWED names {missing} in {path}, which defines no such function"


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("print('hi')", "print()"),
        ("import sys\nsys.stderr.write('x')", "sys.stderr"),
        ("import sys\nf(file=sys.stdout)", "sys.stdout"),
        ("import sys\nsys.__stderr__.flush()", "sys.__stderr__"),
        ("from sys import stderr", "from sys import stderr"),
        ("import os\nos.write(2, b'x')", "os.write(2, ...)"),
        ("import traceback\ntraceback.print_exc()", "traceback.print_exc() without file="),
        ("import logging\nlogging.warning('x')", "logging.warning() logs through"),
        ("import logging\nlogging.basicConfig(level=10)", "logging.basicConfig() logs through"),
        ("import logging\nlogging.getLogger()", "logging.getLogger() is the root logger"),
        ("import logging\nlogging.getLogger(__name__)", "logger name __name__ is not a string literal"),
        ("import logging\nlogging.getLogger('torch')", "logger 'torch' is outside 'shardwise'"),
        ("import logging\nlogging.getLogger('shardwise.nonesuch')", "logger 'shardwise.nonesuch': 'nonesuch' is not a"),
    ],
)
def test_the_audit_catches(source: str, what: str) -> None:
    found, _ = audit(source, "x.py")
    assert len(found) == 1 and found[0].what.startswith(what), found


def test_the_audit_lets_pass() -> None:
    source = (
        "import logging, os, traceback, sys\n"
        "log = logging.getLogger('shardwise.plan')\n"
        "top = logging.getLogger('shardwise')\n"
        "def f(out):\n"
        "    log.debug('%s', 1)\n"
        "    traceback.print_exc(file=out)\n"
        "    os.write(out.fileno(), b'x')\n"
        "    sys.exit(1)\n"
        "    out.write('fine: a file the caller gave')\n"
    )
    assert audit(source, "x.py")[0] == []


def test_the_allow_list_is_by_function() -> None:
    source = (
        "import sys\n"
        "class Watchdog:\n"
        "    def _expire(self):\n"
        "        sys.stderr.flush()\n"
        "    def other(self):\n"
        "        print('no')\n"
    )
    path = "plugins/shardwise-mpi/src/shardwise_mpi/_watchdog.py"
    found, functions = audit(source, path)
    assert {"Watchdog._expire", "Watchdog.other"} <= functions
    assert [(f.function, _allowed(f)) for f in found] == [("Watchdog._expire", True), ("Watchdog.other", False)]
