"""No unreferenced functions: every function, class and method of the four packages is named somewhere else --
called, imported, registered, listed in a docs page, or named in a string (a Ray actor method called by name, a vLLM
``collective_rpc`` target, a ``module:function`` entry point).

A floor, read statically in about a second: a name counts as used when the word appears anywhere in the packages,
tests, bench, examples, docs or build files besides its own ``def`` (so a dead function whose name is a common word
passes unseen; one whose name is nowhere else does not). Decorated with a call (``@register_policy_loss("ppo")``,
``@phase("reference")``), a function is reachable through the registry it joins. Delete what this finds, or use it.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where a name counts as used (besides the packages' own sources).
CORPUS = ("packages", "tests", "bench", "examples", "docs", ".ci", "README.md", "hatch.toml")
SUFFIXES = {".py", ".md", ".toml", ".sh", ".json", ".yaml", ".yml", ".txt", ".cfg", ".ini"}
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Unreferenced on purpose, each with its reason (keep this short).
ALLOWED: dict[str, str] = {}


def definitions(src_roots: list[Path]) -> list[tuple[Path, int, str]]:
    """(file, line, qualified name) of every function, class and method, save dunders and registered ones."""
    found = []

    def walk(path: Path, body: list[ast.stmt], owner: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            name = node.name
            registered = any(isinstance(d, ast.Call) for d in node.decorator_list)
            if not (name.startswith("__") and name.endswith("__")) and not registered:
                found.append((path, node.lineno, f"{owner}{name}"))
            if isinstance(node, ast.ClassDef):
                walk(path, node.body, f"{owner}{name}.")

    for src in src_roots:
        for path in sorted(src.rglob("*.py")):
            walk(path, ast.parse(path.read_text(), str(path)).body, "")
    return found


def word_counts(root: Path, corpus: tuple[str, ...] = CORPUS) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for entry in corpus:
        top = root / entry
        files = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in files:
            parts = path.relative_to(root).parts
            if (
                path.suffix not in SUFFIXES
                or not path.is_file()
                or "__pycache__" in parts
                or any(p.startswith(".") and p != ".ci" for p in parts)
            ):
                continue
            try:
                counts.update(WORD.findall(path.read_text(errors="replace")))
            except OSError:
                continue
    return counts


def unreferenced(root: Path) -> list[str]:
    counts = word_counts(root)
    return [
        f"{path.relative_to(root)}:{line} {qualified}"
        for path, line, qualified in definitions(sorted(root.glob("packages/*/src")))
        if counts[qualified.rpartition(".")[2]] <= 1 and qualified not in ALLOWED
    ]


def test_every_function_class_and_method_is_referenced():
    found = unreferenced(ROOT)
    assert not found, (
        "referenced nowhere (not called, imported, registered, documented or named in a string): "
        "delete it, or use it:\n  " + "\n  ".join(found)
    )


def test_the_check_finds_an_unreferenced_function(tmp_path):
    """The check itself: a function named nowhere else is found; a called one, one named only in a string (a Ray
    method called by name), a registered one and a dunder are not."""
    src = tmp_path / "packages" / "p" / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "m.py").write_text(
        "def used():\n    pass\n\n\ndef forgotten_helper():\n    pass\n\n\n"
        "class Worker:\n    def by_name(self):\n        pass\n\n    def __repr__(self):\n        return ''\n\n"
        "    def stale_method(self):\n        pass\n\n\n"
        "@register('x')\ndef registered_loss():\n    pass\n\n\nused()\ncall('by_name')\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("`Worker` does the work.\n")
    assert unreferenced(tmp_path) == [
        "packages/p/src/pkg/m.py:5 forgotten_helper",
        "packages/p/src/pkg/m.py:16 Worker.stale_method",
    ]
