"""docs/ARCHITECTURE.md is the map of the code: every path it names exists, every module of the four packages is on
it, and its "Five questions" answer each question with full paths, at most two files an answer.

What counts as a path: a backticked name of path characters with a `/` or a file suffix (`placement/spec.py`,
`hybrid_algos/train/`, `bench/RESULTS.md`), or a dotted module path of a package (`hybrid_core.remote.deadline`: the
longest prefix that is a module, then at most one name that module's text holds). A relative path resolves
repo-relative, from a package's `src/`, or, inside a package's section (`## hybrid_core`), as the tail of a path in
that package's folder (`workers/frozen.py` in `## hybrid_algos` is hybrid_algos/train/workers/frozen.py). A module
is on the page when a name there resolves to it alone (`plan.py` in `## hybrid_core` is two modules: neither).
`__init__.py` files are not asked for: their package's row stands for them.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = {p.name.replace("-", "_"): p for p in sorted((ROOT / "packages").iterdir()) if (p / "src").is_dir()}
SUFFIXES = (".py", ".md", ".json", ".toml", ".yaml", ".yml", ".sh", ".txt", ".ini", ".cfg")
PLACEHOLDERS = {"FILE.py"}  # the page's own placeholder for "your file" (`FILE.py:NAME`)
QUESTIONS = "## Five questions"


def _sections() -> list[tuple[str, str]]:
    """(heading, text) per `## ` section, fenced code blocks left out; the text before the first heading is ''."""
    text = re.sub(r"```.*?```", "", PAGE.read_text(), flags=re.S)
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return [("", parts[0])] + [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts), 2)]


def _names(text: str) -> list[str]:
    """The backticked names of a text that look like a file path or a package's module path."""
    out = []
    for name in re.findall(r"`([^`\n]+)`", text):
        if name in PLACEHOLDERS or ".." in name:
            continue
        path = re.fullmatch(r"[\w.\-/]+", name) and ("/" in name or name.endswith(SUFFIXES))
        if path or re.fullmatch(rf"({'|'.join(PACKAGES)})(\.\w+)+", name):
            out.append(name)
    return out


@cache
def _dirs(base: Path) -> tuple[Path, ...]:
    """Every folder under a package's folder (caches and build output left out)."""
    skip = {"__pycache__", ".pytest_cache", "build", "dist"}
    return tuple([base] + [d for d in base.rglob("*") if d.is_dir() and not (skip & set(d.parts))])


def _package_of(heading: str) -> Path | None:
    """The package folder a section is about (`## hybrid_core` -> packages/hybrid-core), else None."""
    words = heading[3:].split()
    return PACKAGES.get(words[0]) if words else None


def _resolve_dotted(name: str) -> list[Path]:
    parts = name.split(".")
    src = PACKAGES[parts[0]] / "src"
    for n in range(len(parts), 0, -1):
        base = src.joinpath(*parts[:n])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            continue
        rest = parts[n:]
        if not rest:
            return [module]
        if len(rest) == 1 and re.search(rf"\b{re.escape(rest[0])}\b", module.read_text()):
            return [module]
        return []
    return []


def _resolve(name: str, heading: str) -> list[Path]:
    """What a name on the page stands for: the files or folders it resolves to (empty: it names nothing)."""
    if "/" not in name and not name.endswith(SUFFIXES):
        return _resolve_dotted(name)
    rel = name.rstrip("/")
    for base in [ROOT] + [p / "src" for p in PACKAGES.values()]:
        if (base / rel).exists():
            return [base / rel]
    if heading == QUESTIONS:  # a newcomer's answer: a full path, nothing to guess
        return []
    package = _package_of(heading)
    bases = [package] if package else list(PACKAGES.values())
    return sorted({d / rel for b in bases for d in _dirs(b) if (d / rel).exists()})


def _modules() -> dict[Path, str]:
    """Every module file of the four packages -> its name from the package's src/ (`hybrid_core/errors.py`)."""
    out = {}
    for package in PACKAGES.values():
        src = package / "src"
        for f in sorted(src.glob("*/**/*.py")):
            if f.name != "__init__.py" and "__pycache__" not in f.parts:
                out[f] = str(f.relative_to(src))
    return out


def test_every_path_on_the_page_exists():
    missing = [
        f"{heading or '(top)'}: {name}"
        for heading, text in _sections()
        for name in _names(text)
        if not _resolve(name, heading)
    ]
    assert missing == [], "names on docs/ARCHITECTURE.md that no file or module is:\n  " + "\n  ".join(missing)


def test_every_module_is_on_the_page():
    named = set()
    for heading, text in _sections():
        for name in _names(text):
            found = _resolve(name, heading)
            if len(found) == 1:
                named.add(found[0])
    modules = _modules()
    assert len(modules) > 100, "fewer modules than the packages hold: is PACKAGES right?"
    missing = sorted(rel for f, rel in modules.items() if f not in named)
    assert missing == [], "modules docs/ARCHITECTURE.md does not name (a row or a sentence each):\n  " + "\n  ".join(
        missing
    )


def test_the_five_questions_are_answered_within_two_files_each():
    sections = dict(_sections())
    assert QUESTIONS in sections, f"docs/ARCHITECTURE.md has no '{QUESTIONS}' section"
    answers = re.split(r"^\d\. ", sections[QUESTIONS], flags=re.M)[1:]
    assert len(answers) == 5, f"'{QUESTIONS}' holds {len(answers)} numbered answers, not 5"
    for answer in answers:
        files = {n.rstrip("/") for n in _names(answer) if n.endswith(SUFFIXES)}
        assert 1 <= len(files) <= 2, f"an answer names {sorted(files)} (1 or 2 files): {answer[:80]!r}"


def test_resolution_rules():
    """The rules above on names the page could hold: each one resolves, or does not, as the docstring says."""
    assert _resolve("hybrid_core/residency/steps.py", "") and _resolve("bench/RESULTS.md", QUESTIONS)
    assert _resolve("workers/frozen.py", "## hybrid_algos") and not _resolve("workers/frozen.py", "## hybrid_core")
    assert len(_resolve("plan.py", "## hybrid_core")) == 2
    assert not _resolve("residency/planner.py", QUESTIONS)  # an answer spells the full path
    assert _resolve("hybrid_core.remote.get_with_timeout", "") and not _resolve("hybrid_core.remote.nothing_x", "")
    assert _names("`a/b.py` `--flag` `FILE.py` `agent/...` `x.py` `hybrid_core.errors` `ctx.enter`") == [
        "a/b.py",
        "x.py",
        "hybrid_core.errors",
    ]
