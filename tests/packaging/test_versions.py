"""Versions and releases: each package's version has one source, the ranges it declares for its siblings hold the
versions in this repository, every sibling it imports is declared (in the right extra), its changelog has an entry
for its version, and its sdist (and the wheel built from that sdist) carries what a release needs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "hybrid-core": "hybrid_core",
    "hybrid-engines": "hybrid_engines",
    "hybrid-algos": "hybrid_algos",
    "hybrid-cli": "hybrid_cli",
}
MODULE_TO_DIST = {module: dist for dist, module in PACKAGES.items()}
VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']\s*$""", re.MULTILINE)  # hatchling's default pattern


def pyproject(dist: str) -> dict:
    return tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())


def repo_version(dist: str) -> str:
    init = ROOT / "packages" / dist / "src" / PACKAGES[dist] / "__init__.py"
    found = VERSION_LINE.findall(init.read_text())
    assert len(found) == 1, f'{init}: expected one `__version__ = "X.Y.Z"` line, found {found}'
    return found[0]


def sibling_requirements(dist: str) -> list[tuple[str, Requirement]]:
    """``(where, requirement)`` for every sibling named in dependencies or an extra (``where``: "" or the extra)."""
    project = pyproject(dist)["project"]
    declared = [("", r) for r in project.get("dependencies", [])]
    declared += [(extra, r) for extra, reqs in project.get("optional-dependencies", {}).items() for r in reqs]
    out = []
    for where, text in declared:
        req = Requirement(text)
        if canonicalize_name(req.name) in PACKAGES:
            out.append((where, req))
    return out


@pytest.mark.parametrize("dist", PACKAGES)
def test_version_has_a_single_source(dist: str) -> None:
    data = pyproject(dist)
    assert "version" not in data["project"], f"{dist}: a static version in pyproject.toml duplicates __init__.py"
    assert "version" in data["project"].get("dynamic", []), f"{dist}: version must be dynamic"
    assert data["tool"]["hatch"]["version"]["path"] == f"src/{PACKAGES[dist]}/__init__.py"
    version = Version(repo_version(dist))  # PEP 440
    assert str(version) == repo_version(dist), f"{dist}: write the version in normal form ({version})"
    others = [
        p
        for p in (ROOT / "packages" / dist / "src").rglob("*.py")
        if p.name != "__init__.py" or p.parent.name != PACKAGES[dist]
    ]
    defining = [str(p) for p in others if VERSION_LINE.search(p.read_text())]
    assert not defining, f"{dist}: __version__ is also set in {defining}; import it from {PACKAGES[dist]} instead"


@pytest.mark.parametrize("dist", PACKAGES)
def test_declared_sibling_ranges_hold_the_repo_versions(dist: str) -> None:
    for where, req in sibling_requirements(dist):
        sibling = canonicalize_name(req.name)
        version = repo_version(sibling)
        label = f"{dist} {'[' + where + '] ' if where else ''}requires {req}"
        assert req.specifier.contains(version, prereleases=True), f"{label}, but the repo has {sibling} {version}"
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", ">", "~=", "=="}, f"{label}: give a lower bound (the first version with what you use)"
        assert ops & {"<", "<=", "~=", "=="}, f"{label}: give an upper bound (the next minor version while 0.x)"


@pytest.mark.parametrize("dist", PACKAGES)
def test_every_imported_sibling_is_declared(dist: str) -> None:
    """A sibling imported by the package must be a dependency; one imported only by ``hybrid_algos.train`` must be
    in the ``[train]`` extra; importing ``hybrid_algos.train`` from another package needs ``hybrid-algos[train]``."""
    src = ROOT / "packages" / dist / "src" / PACKAGES[dist]
    declared = sibling_requirements(dist)
    for path in src.rglob("*.py"):
        in_train = dist == "hybrid-algos" and "train" in path.relative_to(src).parts
        for module in _absolute_imports(path):
            top = module.split(".")[0]
            sibling = MODULE_TO_DIST.get(top)
            if sibling is None or sibling == dist:
                continue
            allowed = {"", "train"} if in_train else {""}
            reqs = [r for where, r in declared if canonicalize_name(r.name) == sibling and where in allowed]
            assert reqs, f"{path.relative_to(ROOT)} imports {module} but {dist} does not declare {sibling}" + (
                " in its [train] extra" if in_train else " in its dependencies"
            )
            if module.startswith("hybrid_algos.train"):
                assert any("train" in r.extras for r in reqs), (
                    f"{path.relative_to(ROOT)} imports {module}: declare hybrid-algos[train], not hybrid-algos"
                )


@pytest.mark.parametrize("dist", PACKAGES)
def test_changelog_has_an_entry_for_the_version(dist: str) -> None:
    changelog = ROOT / "packages" / dist / "CHANGELOG.md"
    assert changelog.exists(), f"{dist} has no CHANGELOG.md"
    text = changelog.read_text()
    assert "## [Unreleased]" in text, f"{changelog}: keep an [Unreleased] section on top for the next changes"
    version = repo_version(dist)
    heading = re.search(rf"^## \[{re.escape(version)}\] - (\d{{4}}-\d{{2}}-\d{{2}}|unreleased)$", text, re.MULTILINE)
    assert heading, f"{changelog}: no '## [{version}] - YYYY-MM-DD' entry for the version in __init__.py"
    entry = text[heading.end() :].split("\n## ", 1)[0]
    assert "### " in entry and "\n- " in entry, f"{changelog}: the {version} entry lists no changes"


@pytest.mark.slow
def test_sdists_and_wheels_carry_what_a_release_needs(tmp_path: Path, package_index) -> None:
    """Build as the release command does (``python -m build``: the sdist, then the wheel from that sdist)."""
    pytest.importorskip("build")
    for dist, module in PACKAGES.items():
        out = tmp_path / dist
        package_dir = ROOT / "packages" / dist
        result = subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(out), str(package_dir)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"building {dist} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        version = repo_version(dist)
        stem = f"{module}-{version}"
        (sdist,) = out.glob("*.tar.gz")
        assert sdist.name == f"{stem}.tar.gz"
        with tarfile.open(sdist) as tar:
            names = set(tar.getnames())
            pkg_info = tar.extractfile(f"{stem}/PKG-INFO").read().decode()
        wanted = {"README.md", "CHANGELOG.md", "pyproject.toml", f"src/{module}/__init__.py"}
        wanted |= {p.name for p in package_dir.iterdir() if re.match(r"(LICEN[CS]E|NOTICE|COPYING)", p.name)}
        missing = sorted(w for w in wanted if f"{stem}/{w}" not in names)
        assert not missing, f"{sdist.name} lacks {missing}"
        _check_metadata(dist, Parser().parsestr(pkg_info), version)

        (wheel,) = out.glob("*.whl")
        assert wheel.name == f"{stem}-py3-none-any.whl"
        with zipfile.ZipFile(wheel) as whl:
            meta = Parser().parsestr(whl.read(f"{stem}.dist-info/METADATA").decode())
            assert f"{module}/__init__.py" in whl.namelist()
        _check_metadata(dist, meta, version)
        assert "## Public API" in meta.get_payload(), f"{wheel.name}: the long description is not the README"


def _check_metadata(dist: str, meta, version: str) -> None:
    assert meta["Name"] == dist and meta["Version"] == version
    declared = {str(Requirement(r)) for r in pyproject(dist)["project"].get("dependencies", [])}
    required = {str(Requirement(r)) for r in meta.get_all("Requires-Dist", []) if "extra ==" not in r}
    assert required == declared, f"{dist} {version}: Requires-Dist {required} != pyproject {declared}"


def _absolute_imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return modules
