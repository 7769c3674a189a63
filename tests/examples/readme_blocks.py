"""Code blocks of the Markdown docs, and the rule that says which of them the test suite runs.

* A ```python block runs, in a fresh interpreter from an empty folder, unless the line above it is
  ``<!-- not run: why -->`` (GPU-only code, or a loop the training tests already run). A block that is not run is
  still compiled, and every ``from hybrid_... import name`` in it must resolve, so it cannot drift from the API.
* A ```bash block runs only when the line above it is ``<!-- run -->``, one command per line.
* The "Public API" table of a package README names what a user imports; every name in its first column must exist.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hybrid-core", "hybrid-engines", "hybrid-algos", "hybrid-cli")
DOCS = (ROOT / "README.md", *(ROOT / "packages" / p / "README.md" for p in PACKAGES), ROOT / "examples" / "README.md")

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(run|not run)\b[^>]*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str | None  # "run", "not run" or None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        if self.lang == "python":
            return self.mark != "not run"
        return self.lang == "bash" and self.mark == "run"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with its language and the marker comment right above it."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 1}: code block never closed")
        above = lines[i - 1].strip() if i > 0 else ""
        mark = _MARK.match(above)
        found.append(
            Block(path, i + 1, opening.group(1), "\n".join(lines[i + 1 : end]) + "\n", mark.group(1) if mark else None)
        )
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for doc in DOCS if doc.exists() for b in blocks(doc)]


def hybrid_imports(code: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from hybrid_x... import name`` in ``code``."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0].startswith("hybrid_"):
            out += [(node.module, alias.name) for alias in node.names]
    return out


def resolve(dotted: str) -> object:
    """Import ``a.b.c`` as a module, or ``a.b`` and take attribute ``c`` (and so on up the path)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def api_names(readme: Path) -> list[str]:
    """Dotted names in the first column of the README's "Public API" table.

    A cell holds backticked items: the first is a full dotted path (call signature allowed), the next ones may be bare
    names of the same module (``hybrid_core.placement.parse_gpu_range``, ``format_gpus``).
    """
    text = readme.read_text()
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    names = []
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        cell = row.split("|")[1]
        module = None
        for item in re.findall(r"`([^`]+)`", cell):
            name = item.split("(")[0].strip()
            if "." in name:
                module = name.rsplit(".", 1)[0]
                names.append(name)
            elif module is not None:
                names.append(f"{module}.{name}")
    return names
