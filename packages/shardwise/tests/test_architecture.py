"""The core's architecture, checked from its own imports (docs/architecture.md).

The core is a stack of layers, each a subpackage that imports only from the
layers below it, with the public faces on top. ``make lint`` enforces this with
import-linter (``.importlinter``); these tests check it a second time, from
grimp's import graph and the source's syntax tree, and say exactly what broke:

- the core has no import cycle at all (imports under ``if TYPE_CHECKING:`` and
  inside functions count; grimp sees both);
- no module of a layer imports a module of a higher layer or a face;
- no import inside a function, except of a heavy optional dependency with a
  comment saying why;
- no plugin imports a private ``shardwise._*`` module.

grimp is part of the core's ``test`` extra: without it these tests fail (the
import below), they never skip.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import sys
import tokenize
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import grimp
import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "shardwise"
REPO = TESTS.parents[2]
PLUGINS = REPO / "plugins"

# The layers, bottom to top, by the name of the child of ``shardwise`` that holds
# them (a subpackage, or a public module that belongs to a layer). Keep in step
# with .importlinter's `core-layers` contract and docs/architecture.md.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary (leaf)", ("errors",)),
    ("vocabulary", ("_vocab",)),
    ("comm", ("_comm",)),
    ("registry", ("_registry", "hookspecs")),
    ("layout", ("_layout",)),
    ("tensor", ("_tensor",)),
    ("modules", ("_modules",)),
    ("session", ("_session",)),
]
#: The public faces: torch-compatible module paths and shardwise's own public
#: modules, plus the package ``shardwise`` itself. They may import anything.
FACES = (
    "__main__",
    "api",
    "checkpoint",
    "common_op_utils",
    "metadata",
    "nn",
    "op_registry_utils",
    "plugins",
    "sdk",
    "sharded_optim",
    "sharded_tensor",
    "sharder",
    "sharding_plan",
    "sharding_spec",
    "testing",
    "torch_group",
)
FACE_RANK = len(LAYERS)

_RANK_OF_CHILD = {child: rank for rank, (_, children) in enumerate(LAYERS) for child in children}
_RANK_OF_CHILD.update({face: FACE_RANK for face in FACES})

#: Core dependencies every layer imports at module level anyway: deferring their
#: import into a function saves nothing.
CORE_DEPENDENCIES = ("torch", "pluggy")


# ---------------------------------------------------------------- the graph


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        "shardwise", include_external_packages=False, exclude_type_checking_imports=False, cache_dir=None
    )


def _package_dir() -> Path:
    """Where the graph's ``shardwise`` lives (the editable install: ``SRC``)."""
    spec = importlib.util.find_spec("shardwise")
    assert spec is not None and spec.origin is not None, "shardwise is not importable"
    return Path(spec.origin).parent


def _where(module: str, line: Optional[int] = None) -> str:
    """``module``'s file, relative to the repository when it is in it, with ``:line``."""
    parts = module.split(".")[1:]
    base = _package_dir().joinpath(*parts)
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    try:
        shown = str(path.relative_to(REPO))
    except ValueError:
        shown = str(path)
    return f"{shown}:{line}" if line is not None else shown


def _rank(module: str) -> Optional[int]:
    """The layer of a core module (``FACE_RANK`` for a face); None when it has none."""
    parts = module.split(".")
    if len(parts) == 1:
        return FACE_RANK  # the package itself: the main public face
    return _RANK_OF_CHILD.get(parts[1])


def _layer_name(rank: int) -> str:
    return "public face" if rank == FACE_RANK else f"layer {rank} {LAYERS[rank][0]}"


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _import_lines(graph: grimp.ImportGraph, importer: str, imported: str) -> list[tuple[Optional[int], str]]:
    details = graph.get_import_details(importer=importer, imported=imported)
    return [(d["line_number"], d["line_contents"]) for d in details] or [(None, "")]


# ---------------------------------------------------------------- cycles


@dataclass(frozen=True)
class _Edge:
    """``importer`` depends on ``imported``: directly, or (``through`` set) by
    importing ``through``, a module inside package ``imported``, which runs that
    package's ``__init__`` first."""

    importer: str
    imported: str
    through: Optional[str] = None


def _dependencies(graph: grimp.ImportGraph) -> dict[str, dict[str, _Edge]]:
    """Every module's dependencies: its direct imports, and the packages whose
    ``__init__`` those imports run first (a package that is not already being
    imported around the importer, i.e. not one of the importer's own ancestors)."""
    deps: dict[str, dict[str, _Edge]] = {module: {} for module in graph.modules}
    for importer in graph.modules:
        own = set(_ancestors(importer))
        for imported in graph.find_modules_directly_imported_by(importer):
            deps[importer][imported] = _Edge(importer, imported)
            for package in _ancestors(imported):
                if package != importer and package not in own:
                    deps[importer].setdefault(package, _Edge(importer, package, through=imported))
    return deps


def _strongly_connected(deps: dict[str, dict[str, _Edge]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with a cycle, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(deps):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(deps[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(deps[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in deps[node]:
                    found.append(sorted(component))
    return sorted(found)


def _one_cycle(deps: dict[str, dict[str, _Edge]], component: list[str]) -> list[_Edge]:
    """A shortest cycle through the component's first module, as edges."""
    members = set(component)
    start = component[0]
    came_from: dict[str, _Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ, edge in sorted(deps[node].items()):
            if succ not in members or succ in came_from:
                continue
            came_from[succ] = edge
            if succ == start:
                queue.clear()
                break
            queue.append(succ)
    path = [came_from[start]]
    while path[-1].importer != start:
        path.append(came_from[path[-1].importer])
    return path[::-1]


def _describe_edge(graph: grimp.ImportGraph, edge: _Edge) -> str:
    if edge.through is None:
        line, text = _import_lines(graph, edge.importer, edge.imported)[0]
        return f"{edge.importer} -> {edge.imported}    ({_where(edge.importer, line)}: {text})"
    line, text = _import_lines(graph, edge.importer, edge.through)[0]
    return (
        f"{edge.importer} -> {edge.imported}    (importing {edge.through} runs package {edge.imported}'s "
        f"__init__ first: {_where(edge.importer, line)}: {text})"
    )


def test_the_core_has_no_import_cycle(graph: grimp.ImportGraph) -> None:
    deps = _dependencies(graph)
    components = _strongly_connected(deps)
    report = []
    for component in components:
        cycle = "\n".join("      " + _describe_edge(graph, edge) for edge in _one_cycle(deps, component))
        report.append(
            f"  {len(component)} modules import each other: {', '.join(component)}\n    for example:\n{cycle}"
        )
    assert not components, (
        f"{len(components)} import cycle(s) in the core (TYPE_CHECKING imports and imports inside functions "
        "count); each layer imports only from below (docs/architecture.md):\n" + "\n".join(report)
    )


def test_the_cycle_finder_finds_cycles() -> None:
    """The checker itself: a planted cycle, and one closed through a package ``__init__``."""
    edges = {
        "p.a": {"p.b": _Edge("p.a", "p.b")},
        "p.b": {"p.a": _Edge("p.b", "p.a")},
        "p.c": {},
        "p": {},
    }
    assert _strongly_connected(edges) == [["p.a", "p.b"]]
    assert [e.importer for e in _one_cycle(edges, ["p.a", "p.b"])] == ["p.a", "p.b"]

    g = grimp.ImportGraph()
    for module in ("q", "q.low", "q.sub", "q.sub.top"):
        g.add_module(module)
    g.add_import(importer="q.sub", imported="q.sub.top")  # the package's __init__ imports its child
    g.add_import(importer="q.sub.top", imported="q.low")
    g.add_import(importer="q.low", imported="q.sub.top")  # q.low -> q.sub (its __init__) -> q.sub.top -> q.low
    assert _strongly_connected(_dependencies(g)) == [["q.low", "q.sub", "q.sub.top"]]


# ---------------------------------------------------------------- layers


def test_every_core_module_has_a_layer(graph: grimp.ImportGraph) -> None:
    homeless = sorted(module for module in graph.modules if _rank(module) is None)
    assert not homeless, (
        "modules of the core in no layer: give each a layer (or make it a face) in this test's LAYERS/FACES, in "
        f".importlinter's core-layers contract and in docs/architecture.md: {homeless}"
    )


def _upward_imports(graph: grimp.ImportGraph) -> list[str]:
    """One line per import of a higher layer or a face by a layer's module."""
    upward = []
    for importer in sorted(graph.modules):
        low = _rank(importer)
        if low is None or low == FACE_RANK:
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            high = _rank(imported)
            if high is None or high <= low:
                continue
            for line, text in _import_lines(graph, importer, imported):
                upward.append(
                    f"  {_where(importer, line)}: {importer} ({_layer_name(low)}) imports {imported} "
                    f"({_layer_name(high)}): {text}"
                )
    return upward


def test_no_layer_imports_a_higher_layer_or_a_face(graph: grimp.ImportGraph) -> None:
    upward = _upward_imports(graph)
    assert not upward, (
        f"{len(upward)} upward import(s): a layer imports only from the layers below it, and never a public face "
        "(docs/architecture.md):\n" + "\n".join(upward)
    )


def test_the_layer_check_finds_upward_imports() -> None:
    g = grimp.ImportGraph()
    for module in ("shardwise", "shardwise.errors", "shardwise._vocab", "shardwise._vocab.wire", "shardwise._session"):
        g.add_module(module)
    g.add_module("shardwise._session.runtime")
    g.add_module("shardwise.api")
    imports = [
        ("shardwise._vocab.wire", "shardwise.errors", "from shardwise.errors import WireError"),  # down: fine
        ("shardwise._session.runtime", "shardwise._vocab.wire", "from shardwise._vocab import wire"),  # down: fine
        ("shardwise.api", "shardwise._session.runtime", "from shardwise._session import runtime"),  # a face: fine
        ("shardwise._vocab.wire", "shardwise._session.runtime", "from shardwise._session import runtime"),
        ("shardwise.errors", "shardwise._vocab", "from shardwise import _vocab"),
        ("shardwise._session.runtime", "shardwise", "import shardwise"),
    ]
    for line, (importer, imported, text) in enumerate(imports, start=1):
        g.add_import(importer=importer, imported=imported, line_number=line, line_contents=text)
    found = _upward_imports(g)
    assert len(found) == 3, found
    assert (
        "_session/runtime.py:6: shardwise._session.runtime (layer 7 session) imports shardwise (public face)"
        in found[0]
    )
    assert "_vocab/wire.py:4: shardwise._vocab.wire (layer 1 vocabulary) imports shardwise._session.runtime" in found[1]
    assert "errors.py:5: shardwise.errors (layer 0 vocabulary (leaf)) imports shardwise._vocab" in found[2]


def test_grimp_sees_type_checking_and_function_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above rely on grimp reporting imports under ``if TYPE_CHECKING:``
    and inside functions: both count."""
    package = tmp_path / "archprobe"
    package.mkdir()
    for name in ("__init__", "b", "c"):
        (package / f"{name}.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from archprobe import b\n"
        "def f():\n"
        "    from archprobe import c\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = grimp.build_graph("archprobe", exclude_type_checking_imports=False, cache_dir=None)
    assert probe.find_modules_directly_imported_by("archprobe.a") == {"archprobe.b", "archprobe.c"}


# ---------------------------------------------------------------- function-level imports


def _comment_lines(source: str) -> set[int]:
    return {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }


def _function_imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, int]]:
    """Each import statement inside a function (at any depth), with the first line
    of the run of import statements on consecutive lines it belongs to (one
    comment above the run covers it)."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.stmt, int]]:
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            run_start: Optional[int] = None
            run_end = -1
            for stmt in block:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    if run_start is None or stmt.lineno != run_end + 1:
                        run_start = stmt.lineno
                    run_end = stmt.end_lineno or stmt.lineno
                    if in_function:
                        yield stmt, run_start
                else:
                    run_start = None
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, inside)

    yield from visit(tree, False)


def _imported_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    assert isinstance(stmt, ast.ImportFrom)
    if stmt.level:
        return ["shardwise (relative import)"]
    return [stmt.module or ""]


def _why_not_deferred(name: str) -> Optional[str]:
    """Why ``name`` may never be imported inside a function, or None."""
    top = name.split(".")[0]
    if top == "shardwise":
        return "shardwise's own modules are imported at module level, from a lower layer"
    if name in CORE_DEPENDENCIES:
        return f"{name} is a core dependency, imported at module level anyway"
    if top in sys.stdlib_module_names:
        return "the standard library is neither heavy nor optional"
    return None


def _python_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*.py") if "egg-info" not in str(path))


def test_no_import_inside_a_function_in_the_core() -> None:
    files = _python_files(SRC)
    assert files, f"no source found under {SRC}"
    bad = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        comments = _comment_lines(source)
        for stmt, run_start in _function_imports(ast.parse(source, filename=str(path))):
            where = f"{path.relative_to(REPO)}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}"
            reasons = [r for r in map(_why_not_deferred, _imported_names(stmt)) if r]
            if reasons:
                bad.append(f"  {where}    ({reasons[0]})")
                continue
            commented = range(run_start - 1, (stmt.end_lineno or stmt.lineno) + 1)
            if not comments.intersection(commented):
                bad.append(f"  {where}    (no comment on the line or the line above saying why it is deferred)")
    assert not bad, (
        f"{len(bad)} import(s) inside a function in the core: import at module level from a lower layer; only a "
        "heavy optional dependency may be imported on first use, with a comment on that line or the line above "
        "saying so (docs/architecture.md):\n" + "\n".join(bad)
    )


def test_the_function_import_check_sees_what_it_should() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    from shardwise._vocab import wire\n"
        "    if True:\n"
        "        import json\n"
        "    # mpi4py is heavy and optional: loaded by the mpi backend only\n"
        "    import mpi4py\n"
        "    from mpi4py import MPI\n"
        "    import numpy\n"
        "\n"
        "    import yaml\n"
        "    return lambda: __import__('x')\n"
        "class C:\n"
        "    from typing import Any\n"
    )
    found = sorted((stmt.lineno, run, _imported_names(stmt)) for stmt, run in _function_imports(ast.parse(source)))
    assert found == [
        (3, 3, ["shardwise._vocab"]),
        (5, 5, ["json"]),
        (7, 7, ["mpi4py"]),
        (8, 7, ["mpi4py"]),
        (9, 7, ["numpy"]),
        (11, 11, ["yaml"]),
    ]
    assert _comment_lines(source) == {6}
    assert _why_not_deferred("shardwise._vocab") and _why_not_deferred("json") and _why_not_deferred("torch")
    assert _why_not_deferred("torch.distributed.checkpoint") is None and _why_not_deferred("mpi4py") is None


# ---------------------------------------------------------------- plugins


def _private_core_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import of a private ``shardwise._*`` module,
    wherever it is (module level, TYPE_CHECKING, functions, importlib calls)."""

    def private(name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 1 and parts[0] == "shardwise" and parts[1].startswith("_")

    def is_private_module(name: str) -> bool:  # `from shardwise import _x` where _x is a module
        return name.startswith("_") and ((SRC / name).is_dir() or (SRC / f"{name}.py").is_file())

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if private(alias.name):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if private(node.module):
                yield node.lineno, node.module
            elif node.module == "shardwise":
                for alias in node.names:
                    if is_private_module(alias.name):
                        yield node.lineno, f"shardwise.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str) and private(arg.value):
                    yield node.lineno, arg.value


def test_plugins_import_no_private_core_module() -> None:
    files = [path for src in sorted(PLUGINS.glob("*/src")) for path in _python_files(src)]
    assert files, f"no plugin sources found under {PLUGINS}/*/src"
    bad = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for line, module in _private_core_imports(ast.parse(source, filename=str(path))):
            bad.append(f"  {path.relative_to(REPO)}:{line}: imports {module}: {lines[line - 1].strip()}")
    assert not bad, (
        f"{len(bad)} import(s) of private core modules from plugins: a plugin uses only public shardwise names "
        "(the plugin SDK is shardwise.sdk; docs/architecture.md):\n" + "\n".join(bad)
    )


def test_the_plugin_check_sees_every_form() -> None:
    source = (
        "import shardwise._comm.buffers as b\n"
        "from shardwise._comm import default_group\n"
        "from shardwise import _comm, Group, _shard_tensor\n"
        "import shardwise.sdk\n"
        "from shardwise.sharding_spec import _internals\n"
        "def f():\n"
        "    importlib.import_module('shardwise._session.runtime')\n"
    )
    assert list(_private_core_imports(ast.parse(source))) == [
        (1, "shardwise._comm.buffers"),
        (2, "shardwise._comm"),
        (3, "shardwise._comm"),
        (7, "shardwise._session.runtime"),
    ]
