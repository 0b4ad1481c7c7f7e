"""The README's quick start, run literally in a fresh virtual environment.

Builds wheels of ``shardwise``, ``shardwise-gloo`` and ``shardwise-mpi``
from this checkout into a wheelhouse (they are not on PyPI yet), creates a
new venv with ``python -m venv``, and then does what the README's "Quick
start" tells a user to do, reading every piece from README.md itself:

* each ``pip install`` line of the block after ``<!-- quickstart:install -->``,
  run as written with the venv's ``bin`` first on PATH, plus
  ``PIP_FIND_LINKS=<wheelhouse>`` and ``PIP_CONSTRAINT=constraints.txt``
  (torch 2.13.0, the CPU build) in the environment;
* the program after ``<!-- quickstart:program -->`` written to ``quickstart.py``;
* each ``$ ...`` command of the block after ``<!-- quickstart:launch -->``
  (torchrun and mpiexec), whose stdout must be the lines shown under it, in
  any order (ranks print concurrently).

Slow (a venv and a torch install, a minute or two), so only the tox env
``integration-mpi`` runs it. It skips, saying why, where the packages
cannot be had: no route to the package index, or no CPU build of torch
2.13.0 reachable without downloading the multi-GB CUDA one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_torchrun_gloo import _environment, _kill_job

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CONSTRAINTS = REPO / "constraints.txt"
#: The distributions the quick start installs, built from this checkout.
DISTRIBUTIONS = ("packages/shardwise", "plugins/shardwise-gloo", "plugins/shardwise-mpi")

#: Seconds for building the wheels, creating the venv, and each pip line.
SETUP_TIMEOUT = 420
#: Seconds one launch of the quick start (2 ranks importing torch) may take.
LAUNCH_TIMEOUT = 180
#: Launches of each command: ranks print concurrently, and a program whose lines can
#: run together (a plain print under torchrun's `python -u` did) fails only now and then.
LAUNCH_REPEATS = 5

#: pip output that means the index (or the network) could not be reached, not that the README is wrong.
_NO_NETWORK = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution"
    r"|Name or service not known|Network is unreachable|ProxyError|ConnectTimeoutError|Read timed out"
    r"|No matching distribution found for (?!shardwise)"
)


def _block_after(marker: str, text: str) -> tuple[str, str]:
    """The info string and the body of the first fenced code block after ``<!-- marker -->`` in ``text``."""
    tag = f"<!-- {marker} -->"
    start = text.find(tag)
    assert start >= 0, f"README.md has no {tag} marker"
    match = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S).search(text, start + len(tag))
    assert match is not None, f"README.md has no code block after {tag}"
    return match[1].strip(), match[2]


def _readme_quickstart() -> tuple[list[str], str, list[tuple[str, list[str]]]]:
    """The quick start's pip lines, program, and (command, expected stdout lines) pairs, as README.md shows them."""
    text = README.read_text(encoding="utf-8")
    _, install = _block_after("quickstart:install", text)
    pip_lines = [line.strip() for line in install.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert pip_lines and all(line.startswith("pip install ") for line in pip_lines), (
        f"the install block should hold only `pip install` lines:\n{install}"
    )
    lang, program = _block_after("quickstart:program", text)
    assert lang == "python" and program.startswith("# quickstart.py\n"), (
        f"the program block should be ```python starting with '# quickstart.py':\n{program}"
    )
    _, console = _block_after("quickstart:launch", text)
    launches: list[tuple[str, list[str]]] = []
    for line in console.splitlines():
        if line.startswith("$ "):
            launches.append((line[2:].split(" #")[0].strip(), []))
        elif line.strip():
            assert launches, f"output before the first `$ ` command in the launch block:\n{console}"
            launches[-1][1].append(line.rstrip())
    return pip_lines, program, launches


PIP_LINES, PROGRAM, LAUNCHES = _readme_quickstart()


def _run(cmd: str, env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str, str]:
    """Run the shell command line ``cmd``; a timeout kills it and every process it started, and fails the test."""
    started = time.monotonic()
    with subprocess.Popen(
        ["bash", "-c", cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_job(proc.pid)
            out, err = proc.communicate()
            pytest.fail(
                f"`{cmd}` did not finish within {timeout:g}s (killed every process it started);\n"
                f"stdout (all ranks):\n{out}\nstderr (all ranks):\n{err}"
            )
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stray ranks, if any
            except ProcessLookupError:
                pass
    print(f"$ {cmd}  # exit {proc.returncode} after {time.monotonic() - started:.1f}s\n{out}{err}")
    return proc.returncode, out, err


def _find_links(wheelhouse: Path) -> str:
    """``PIP_FIND_LINKS`` for the venv: the wheelhouse, then the find-links pip already has here.

    The variable replaces pip's own ``find-links`` setting (from its config
    files or from ``PIP_FIND_LINKS``), which may be where this machine keeps
    torch's CPU wheel, so those locations are kept after the wheelhouse.
    """
    links = [str(wheelhouse), *os.environ.get("PIP_FIND_LINKS", "").split()]
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    for key, _, value in (line.partition("=") for line in listed.splitlines()):
        if key.endswith(".find-links"):
            links += value.strip().strip("'\"").split()
    return " ".join(dict.fromkeys(links))


def _pip_failure(cmd: str, code: int, out: str, err: str) -> None:
    """Skip where ``cmd`` failed for want of a network, else fail with its output."""
    if _NO_NETWORK.search(out + err):
        pytest.skip(f"`{cmd}` could not reach the package index (exit {code}): {err.strip().splitlines()[-1:]}")
    pytest.fail(f"`{cmd}` exited {code}:\n{out}\n{err}")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with what the README's install block installs; returns its work dir and environment."""
    root = tmp_path_factory.mktemp("quickstart")
    wheelhouse = root / "wheelhouse"
    build_env = dict(os.environ, PIP_CONSTRAINT=str(CONSTRAINTS))
    # --no-build-isolation: build with this env's setuptools instead of fetching one.
    wheel_cmd = (
        f"{shlex.quote(sys.executable)} -m pip wheel --quiet --no-deps --no-build-isolation "
        f"--wheel-dir {shlex.quote(str(wheelhouse))} " + " ".join(shlex.quote(str(REPO / d)) for d in DISTRIBUTIONS)
    )
    code, out, err = _run(wheel_cmd, build_env, root, SETUP_TIMEOUT)
    assert code == 0, f"building the wheels failed:\n{out}\n{err}"
    code, out, err = _run(f"{shlex.quote(sys.executable)} -m venv venv", build_env, root, SETUP_TIMEOUT)
    assert code == 0, f"python -m venv failed:\n{out}\n{err}"

    bin_dir = root / "venv" / "bin"
    env = _environment(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(root / "venv"),
        PIP_FIND_LINKS=_find_links(wheelhouse),
        PIP_CONSTRAINT=str(CONSTRAINTS),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    # Nothing of this test's own environment may leak into the user's. PYTHONUNBUFFERED (set in
    # some CI shells) in particular: it makes print() write its text and its newline separately,
    # so mpiexec, which forwards whatever each rank writes as it comes, can splice two ranks'
    # lines together; with Python's default buffering, each print(..., flush=True) is one write.
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "SHARDWISE_TIMEOUT"):
        env.pop(name, None)

    # First resolve without installing: where torch 2.13.0's CPU build cannot be had here (no local wheel
    # and no index that serves it), pip would download the multi-GB CUDA build, which the README warns of.
    for line in PIP_LINES:
        cmd = line.replace("pip install ", "pip install --dry-run --quiet --report report.json ", 1)
        code, out, err = _run(cmd, env, root, SETUP_TIMEOUT)
        if code != 0:
            _pip_failure(cmd, code, out, err)
        report = json.loads((root / "report.json").read_text())
        torch_versions = [
            item["metadata"]["version"] for item in report["install"] if item["metadata"]["name"] == "torch"
        ]
        if torch_versions and not torch_versions[0].endswith("+cpu"):
            pytest.skip(f"`{line}` would install torch {torch_versions[0]}, not the CPU build: no CPU wheel here")

    for line in PIP_LINES:  # the README's lines, as written
        code, out, err = _run(line, env, root, SETUP_TIMEOUT)
        if code != 0:
            _pip_failure(line, code, out, err)
    (root / "quickstart.py").write_text(PROGRAM, encoding="utf-8")
    return root, env


def test_docs_quick_start_page_shows_the_same_blocks() -> None:
    """docs/quickstart.md repeats the README's three blocks; they must not drift apart."""
    readme = README.read_text(encoding="utf-8")
    page = (REPO / "docs" / "quickstart.md").read_text(encoding="utf-8")
    for marker in ("quickstart:install", "quickstart:install-from-clone", "quickstart:program", "quickstart:launch"):
        lang, body = _block_after(marker, readme)
        assert f"```{lang}\n{body}```" in page, f"docs/quickstart.md lacks the README's {marker} block, as written"


def test_docs_shard_example_is_the_program_ci_runs() -> None:
    """docs/quickstart.md says its shard_example.py runs in CI as programs/sharded_readme.py: the same code."""
    page = (REPO / "docs" / "quickstart.md").read_text(encoding="utf-8")
    start = page.index("```python\n# shard_example.py\n") + len("```python\n# shard_example.py\n")
    shown = page[start : page.index("```", start)]
    program = (REPO / "integration_tests" / "programs" / "sharded_readme.py").read_text(encoding="utf-8")
    assert program.split('"""\n\n', 1)[1] == shown, "docs/quickstart.md's shard_example.py and sharded_readme.py differ"


def test_readme_shows_a_torchrun_and_an_mpiexec_launch() -> None:
    commands = [cmd.split()[0] for cmd, _ in LAUNCHES]
    assert commands == ["torchrun", "mpiexec"], f"the launch block's commands: {commands}"
    for cmd, expected in LAUNCHES:
        assert expected, f"no output shown under `$ {cmd}`"


@pytest.mark.timeout(SETUP_TIMEOUT * 4 + LAUNCH_TIMEOUT * LAUNCH_REPEATS)
@pytest.mark.parametrize(("command", "expected"), LAUNCHES, ids=[cmd.split()[0] for cmd, _ in LAUNCHES])
def test_quickstart_runs_as_the_readme_shows(
    venv: tuple[Path, dict[str, str]], command: str, expected: list[str]
) -> None:
    workdir, env = venv
    shown = "\n".join(expected)
    for attempt in range(1, LAUNCH_REPEATS + 1):
        code, out, err = _run(command, env, workdir, LAUNCH_TIMEOUT)
        assert code == 0, f"`{command}` exited {code};\nstdout (all ranks):\n{out}\nstderr (all ranks):\n{err}"
        got = [line.rstrip() for line in out.splitlines() if line.strip()]
        assert Counter(got) == Counter(expected), (
            f"`{command}` (run {attempt} of {LAUNCH_REPEATS}) printed (in any order) other lines than README.md "
            f"shows.\nREADME.md:\n{shown}\nstdout (all ranks):\n{out}\nstderr (all ranks):\n{err}"
        )


def _from_clone_pip_lines() -> list[str]:
    """The ``pip install`` lines of the block after ``<!-- quickstart:install-from-clone -->``."""
    _, block = _block_after("quickstart:install-from-clone", README.read_text(encoding="utf-8"))
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    assert lines[0].startswith("python -m venv ") and len(lines) == 2, f"a venv, then pip install:\n{block}"
    assert lines[1].startswith("pip install -c constraints.txt ./"), block
    return lines[1:]


@pytest.mark.timeout(SETUP_TIMEOUT * 3 + LAUNCH_TIMEOUT)
def test_the_install_from_a_clone_gives_a_working_quickstart(tmp_path: Path) -> None:
    # The README's from-clone line, run in the clone's top directory as it says, into a venv of this
    # test's own (the block's first line would make one in the user's home): then one mpiexec launch.
    (pip_line,) = _from_clone_pip_lines()
    code, out, err = _run(f"{shlex.quote(sys.executable)} -m venv venv", dict(os.environ), tmp_path, SETUP_TIMEOUT)
    assert code == 0, f"python -m venv failed:\n{out}\n{err}"
    bin_dir = tmp_path / "venv" / "bin"
    env = _environment(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(tmp_path / "venv"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "SHARDWISE_TIMEOUT", "PIP_CONSTRAINT"):
        env.pop(name, None)
    report_path = tmp_path / "report.json"
    dry = pip_line.replace("pip install ", f"pip install --dry-run -q --report {shlex.quote(str(report_path))} ", 1)
    code, out, err = _run(dry, env, REPO, SETUP_TIMEOUT)
    if code != 0:
        _pip_failure(dry, code, out, err)
    report = json.loads(report_path.read_text())
    torch_versions = [item["metadata"]["version"] for item in report["install"] if item["metadata"]["name"] == "torch"]
    if torch_versions and not torch_versions[0].endswith("+cpu"):
        pytest.skip(f"`{pip_line}` would install torch {torch_versions[0]}, not the CPU build: no CPU wheel here")
    code, out, err = _run(pip_line, env, REPO, SETUP_TIMEOUT)
    if code != 0:
        _pip_failure(pip_line, code, out, err)
    (tmp_path / "quickstart.py").write_text(PROGRAM, encoding="utf-8")
    command, expected = next((cmd, lines) for cmd, lines in LAUNCHES if cmd.startswith("mpiexec "))
    code, out, err = _run(command, env, tmp_path, LAUNCH_TIMEOUT)
    assert code == 0, f"`{command}` exited {code};\nstdout (all ranks):\n{out}\nstderr (all ranks):\n{err}"
    assert Counter(line.rstrip() for line in out.splitlines() if line.strip()) == Counter(expected), out + err
