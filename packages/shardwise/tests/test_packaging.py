"""Every distribution's packaging metadata: license, URLs, classifiers, the torch bound, the core's extras.

The repository holds six distributions (``packages/shardwise`` and each
``plugins/*``). What PyPI shows and what pip resolves comes from their
``pyproject.toml``; these tests read them all (``tomllib``) and check that
they agree with each other, with ``constraints.txt`` (the torch that every
test runs against) and with the files at the repository root. The last test
builds each wheel and looks inside, because a declared license file that
setuptools cannot find is only reported there.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
CORE = ROOT / "packages" / "shardwise"
PLUGINS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))
DISTS = [CORE, *PLUGINS]
IDS = [d.name for d in DISTS]

URL_KEYS = {"Homepage", "Documentation", "Issues", "Changelog"}
REQUIRED_CLASSIFIERS = {
    "Development Status :: 3 - Alpha",
    "Operating System :: POSIX :: Linux",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Topic :: System :: Distributed Computing",
    "Typing :: Typed",
}
_PY_CLASSIFIER = re.compile(r"^Programming Language :: Python :: 3\.(\d+)$")


def _project(dist: Path) -> dict[str, Any]:
    with open(dist / "pyproject.toml", "rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _requirements(project: dict[str, Any]) -> list[Requirement]:
    return [Requirement(r) for r in project.get("dependencies", [])]


def _torch_spec(project: dict[str, Any]) -> SpecifierSet:
    specs = [r.specifier for r in _requirements(project) if r.name == "torch"]
    assert len(specs) == 1, f"{project['name']} must require torch exactly once, got {specs}"
    return specs[0]


def _pinned_torch() -> Version:
    pins = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            if req.name == "torch":
                pins.append(req)
    assert len(pins) == 1, f"constraints.txt must pin torch once, got {pins}"
    (spec,) = list(pins[0].specifier)
    assert spec.operator == "==", f"constraints.txt must pin torch to one version, got {pins[0]}"
    return Version(spec.version)


def test_the_repository_holds_the_core_and_five_plugins() -> None:
    # The other tests iterate over DISTS: an empty or partial list would make them prove nothing.
    assert [d.name for d in PLUGINS] == [
        "shardwise-embedding",
        "shardwise-fsdp",
        "shardwise-gloo",
        "shardwise-mpi",
        "shardwise-nccl",
    ]
    assert [_project(d)["name"] for d in DISTS] == IDS


def test_root_license_is_bsd_3_clause() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n"), text[:80]
    assert "Copyright (c) 2026, the shardwise authors" in text
    assert "Neither the name of the copyright holder nor the names of its" in text


@pytest.mark.parametrize("dist", DISTS, ids=IDS)
def test_license_is_declared_and_the_file_ships(dist: Path) -> None:
    project = _project(dist)
    assert project["license"] == "BSD-3-Clause"
    # setuptools reads license files from inside the distribution's folder only, so each holds a copy.
    assert project["license-files"] == ["LICENSE"]
    assert (dist / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), (
        f"{dist / 'LICENSE'} differs from the repository's LICENSE: copy it again"
    )
    # PEP 639: a license expression replaces the License :: classifiers (setuptools refuses both).
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


@pytest.mark.parametrize("dist", DISTS, ids=IDS)
def test_urls_authors_and_description(dist: Path) -> None:
    project = _project(dist)
    core = _project(CORE)
    assert set(project["urls"]) == URL_KEYS
    assert project["urls"] == core["urls"], "every distribution points to the same project pages"
    assert all(url.startswith("https://") for url in project["urls"].values())
    assert project["urls"]["Changelog"].endswith("/CHANGELOG.md") and (ROOT / "CHANGELOG.md").is_file()
    assert project["authors"] == core["authors"] and project["authors"]
    description = project["description"]
    assert description.strip() and "\n" not in description
    assert "to come" not in description.lower(), description
    assert (dist / project["readme"]).is_file()


def test_changelog_has_this_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    version = _project(CORE)["version"]
    assert re.search(rf"^## \[{re.escape(version)}\]", text, re.MULTILINE), f"CHANGELOG.md has no section for {version}"


@pytest.mark.parametrize("dist", DISTS, ids=IDS)
def test_classifiers_name_exactly_the_supported_pythons(dist: Path) -> None:
    project = _project(dist)
    classifiers = project["classifiers"]
    assert REQUIRED_CLASSIFIERS <= set(classifiers), REQUIRED_CLASSIFIERS - set(classifiers)
    assert project["requires-python"] == _project(CORE)["requires-python"]
    requires = SpecifierSet(project["requires-python"])
    minors = sorted(int(m.group(1)) for c in classifiers if (m := _PY_CLASSIFIER.match(c)))
    assert minors, "no Programming Language :: Python :: 3.N classifier"
    assert minors == list(range(minors[0], minors[-1] + 1)), f"gaps in the Python classifiers: {minors}"
    for minor in minors:
        assert Version(f"3.{minor}") in requires, f"classifier 3.{minor} is outside requires-python {requires}"
    # The oldest Python that requires-python admits is listed, and so is the one running these tests.
    assert Version(f"3.{minors[0] - 1}") not in requires, f"requires-python {requires} admits 3.{minors[0] - 1}"
    assert sys.version_info[1] in minors, f"this Python (3.{sys.version_info[1]}) is tested but not listed"


def test_torch_bound_is_one_minor_release_and_admits_the_pinned_torch() -> None:
    bounds = {d.name: str(_torch_spec(_project(d))) for d in DISTS}
    assert len(set(bounds.values())) == 1, f"torch bounds differ: {bounds}"
    spec = _torch_spec(_project(CORE))
    pinned = _pinned_torch()
    assert pinned in spec, f"{spec} excludes the torch every test runs against ({pinned}, constraints.txt)"
    major, minor = pinned.release[:2]
    # Tested with one minor release only: neither the next nor the previous one is admitted.
    assert Version(f"{major}.{minor + 1}.0") not in spec and Version(f"{major}.{minor - 1}.99") not in spec, spec
    installed = Version(importlib.metadata.version("torch"))
    assert installed in spec, f"the installed torch {installed} is outside {spec}"


def test_core_has_one_extra_per_plugin_and_all() -> None:
    extras = _project(CORE)["optional-dependencies"]
    core_version = Version(_project(CORE)["version"])
    for plugin in PLUGINS:
        project = _project(plugin)
        extra = plugin.name.removeprefix("shardwise-")
        assert extra in extras, f'no "shardwise[{extra}]" extra installs {project["name"]}'
        (req,) = [Requirement(r) for r in extras[extra]]
        assert req.name == project["name"]
        assert Version(project["version"]) in req.specifier, (req, project["version"])
        # Each plugin depends back on the core, at a version that admits this one.
        (core_req,) = [r for r in _requirements(project) if r.name == "shardwise"]
        assert core_version in core_req.specifier, (project["name"], core_req)
    assert Requirement(extras["mpi"][0]).extras == {"mpich"}, "shardwise[mpi] brings MPICH and mpiexec from PyPI"
    (everything,) = [Requirement(r) for r in extras["all"]]
    assert everything.name == "shardwise"
    assert everything.extras == {p.name.removeprefix("shardwise-") for p in PLUGINS}
    # The core's tests run without any plugin installed (tox env "core"): its test extra must not pull one.
    assert not [r for r in extras["test"] if Requirement(r).name.startswith("shardwise")]


@pytest.mark.parametrize("dist", DISTS, ids=IDS)
def test_module_version_matches_the_distribution(dist: Path) -> None:
    version = _project(dist)["version"]
    found = {
        str(path.relative_to(dist)): m.group(1)
        for path in (dist / "src").rglob("*.py")
        if (m := re.search(r'^__version__ = "([^"]+)"$', path.read_text(), re.MULTILINE))
    }
    assert all(v == version for v in found.values()), f"pyproject says {version}, the source says {found}"


@pytest.mark.timeout(600)
def test_wheels_carry_the_license_and_metadata(tmp_path: Path) -> None:
    # Built from copies: an in-tree build leaves build/ and *.egg-info next to the sources.
    wheels = tmp_path / "wheels"
    for dist in DISTS:
        src = tmp_path / dist.name
        shutil.copytree(dist, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
        pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        proc = subprocess.run(
            [*pip_wheel, "-w", str(wheels), str(src)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"pip wheel {dist.name} failed:\n{proc.stdout}\n{proc.stderr}"
    license_bytes = (ROOT / "LICENSE").read_bytes()
    built = sorted(wheels.glob("*.whl"))
    assert len(built) == len(DISTS), built
    for wheel in built:
        with zipfile.ZipFile(wheel) as zf:
            (info,) = {n.split("/", 1)[0] for n in zf.namelist() if n.split("/", 1)[0].endswith(".dist-info")}
            metadata = HeaderParser().parsestr(zf.read(f"{info}/METADATA").decode())
            assert metadata["License-Expression"] == "BSD-3-Clause", wheel.name
            assert metadata.get_all("License-File") == ["LICENSE"], wheel.name
            assert zf.read(f"{info}/licenses/LICENSE") == license_bytes, wheel.name
            assert {u.split(",", 1)[0] for u in metadata.get_all("Project-URL")} == URL_KEYS, wheel.name
            assert any(r.startswith("torch") for r in metadata.get_all("Requires-Dist")), wheel.name
