"""The import graph of the four packages, read statically (AST, nothing imported): no import circles, and the layers
of the design hold (core <- engines <- algos.train <- cli; the algorithm math imports torch and the standard library
only).

Every import counts: at module level, inside a function (a lazy import is still a dependency: it only moves the
circle to run time) and under ``if TYPE_CHECKING:`` (a circle of types is a circle of ideas). A circle is broken by
moving the shared piece down into the lower module, not by hiding an import inside a function.
"""

from __future__ import annotations

import ast
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package -> the first-party packages it must not import (hybrid_algos.train is checked on its own, see LAYERS).
LAYERS = {
    "hybrid_core": ("hybrid_engines", "hybrid_algos", "hybrid_cli"),
    "hybrid_engines": ("hybrid_algos", "hybrid_cli"),
    "hybrid_algos.train": ("hybrid_cli",),
}
#: What the algorithm math (hybrid_algos outside hybrid_algos.train) may import besides the standard library.
MATH_MAY_IMPORT = ("torch", "hybrid_algos")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module, as written (absolute)
    line: int
    where: str  # "module", "function" or "TYPE_CHECKING"


def modules(src_roots: list[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the given ``src`` folders."""
    found = {}
    for src in src_roots:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path) -> list[Import]:
    """Every import statement of one module, relative ones made absolute."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                here = "function"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and where == "module":
                here = "TYPE_CHECKING"
            if isinstance(child, ast.Import):
                out.extend(Import(name, alias.name, child.lineno, here) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package[: len(package) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import sub`` imports the module pkg.sub when there is one, else a name of pkg
                out.extend(Import(name, f"{base}.{alias.name}", child.lineno, here) for alias in child.names)
            visit(child, here)

    visit(tree, "module")
    return out


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The first-party module an import reaches (the longest known prefix), or None for a third-party one."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def graph(known: dict[str, Path]) -> dict[str, dict[str, list[Import]]]:
    """module -> imported first-party module -> the imports that make the edge."""
    edges: dict[str, dict[str, list[Import]]] = {m: {} for m in known}
    for name, path in known.items():
        for imp in imports(name, path):
            target = resolve(imp.target, known)
            if target is not None and target != name:
                edges[name].setdefault(target, []).append(imp)
    return edges


def cycles(edges: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm, then a path inside it)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_circle(group, edges) for group in groups]


def _circle(group: set[str], edges: dict[str, dict[str, list[Import]]]) -> list[str]:
    """A shortest circle from the group's first module back to itself (breadth-first inside the group)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in group:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in {sorted(group)}")  # a strongly connected group always has one


def describe(circle: list[str], edges: dict[str, dict[str, list[Import]]], known: dict[str, Path]) -> str:
    """The circle, then each import closing it (file:line, what, where in the file)."""
    lines = [" -> ".join(circle)]
    for a, b in itertools.pairwise(circle):
        imp = edges[a][b][0]
        lines.append(f"    {known[a].relative_to(ROOT)}:{imp.line} imports {imp.target} ({imp.where})")
    return "\n".join(lines)


def layer_violations(known: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports that climb a layer: core, engines, algos.train, cli; the math imports torch and the stdlib only."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for name, path in known.items():
        in_train = name == "hybrid_algos.train" or name.startswith("hybrid_algos.train.")
        layer = "hybrid_algos.train" if in_train else name.split(".")[0]
        for imp in imports(name, path):
            top = imp.target.split(".")[0]
            where = f"{path.relative_to(root)}:{imp.line} imports {imp.target} ({imp.where})"
            if any(top == p for p in LAYERS.get(layer, ())):
                found.append(f"{where}: {layer} may not import {top}")
            elif layer == "hybrid_algos" and top not in stdlib and top not in MATH_MAY_IMPORT:
                found.append(f"{where}: the algorithm math imports torch and the standard library only")
            elif layer == "hybrid_algos" and imp.target.startswith("hybrid_algos.train"):
                found.append(f"{where}: the algorithm math may not import the training loop (hybrid_algos.train)")
    return found


@pytest.fixture(scope="module")
def known() -> dict[str, Path]:
    return modules(sorted(ROOT.glob("packages/*/src")))


def test_the_scan_sees_every_package(known):
    tops = {name.split(".")[0] for name in known}
    assert tops == {"hybrid_core", "hybrid_engines", "hybrid_algos", "hybrid_cli"}
    assert len(known) > 100 and "hybrid_algos.train.loop" in known and "hybrid_core.placement.plan" in known


def test_no_import_circles(known):
    edges = graph(known)
    found = cycles(edges)
    assert not found, "import circles (move the shared piece down into the lower module):\n" + "\n".join(
        describe(c, edges, known) for c in found
    )


def test_the_layers_hold(known):
    found = layer_violations(known)
    assert not found, "imports across the layers:\n" + "\n".join(found)


def test_the_scan_finds_lazy_and_type_only_circles(tmp_path):
    """The checks themselves: a circle closed only by a function-level import, one closed only under TYPE_CHECKING,
    and a layer climbed inside a function are all found."""
    src = tmp_path / "src"
    for rel, text in {
        "hybrid_core/__init__.py": "",
        "hybrid_core/a.py": "from .b import B\n",
        "hybrid_core/b.py": "B = 1\n\ndef f():\n    from . import a\n",
        "hybrid_core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hybrid_core.d import D\n",
        "hybrid_core/d.py": "from hybrid_core import c\nD = 1\n",
        "hybrid_core/e.py": "def g():\n    import hybrid_cli.main\n",
        "hybrid_algos/__init__.py": "import numpy\n",
    }.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    fake = modules([src])
    edges = graph(fake)
    assert sorted(sorted(c) for c in cycles(edges)) == [
        ["hybrid_core.a", "hybrid_core.a", "hybrid_core.b"],
        ["hybrid_core.c", "hybrid_core.c", "hybrid_core.d"],
    ]
    assert edges["hybrid_core.b"]["hybrid_core.a"][0].where == "function"
    assert edges["hybrid_core.c"]["hybrid_core.d"][0].where == "TYPE_CHECKING"

    found = layer_violations(fake, root=tmp_path)
    assert any("e.py:2 imports hybrid_cli.main (function): hybrid_core may not import hybrid_cli" in f for f in found)
    assert any("imports numpy" in f and "torch and the standard library only" in f for f in found)
