"""hybrid-core names no CLI flag: its errors and notes name settings as ``section.name`` (``residency.host_memory_gb``),
which the run's boundary says in the flags' words (``hybrid_algos.train.sections.flag_words`` / ``flag_text``). A
string literal under hybrid-core/src (docstrings too) that names a ``--flag`` fails here, unless it is another
program's flag (``ray start --head``)."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "packages" / "hybrid-core" / "src"
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*)")
#: Flags of other programs that core's messages tell the user to run: ray start's, pip's, nvidia-smi's.
OTHER_PROGRAMS = {
    "head",
    "node-ip-address",
    "min-worker-port",
    "max-worker-port",
    "no-deps",
    "id",
    "query-compute-apps",
}
OTHER_PROGRAMS |= {"format"}


def flags_named(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [(node.lineno, m.group(0)) for m in FLAG.finditer(node.value) if m.group(1) not in OTHER_PROGRAMS]
    return out


def test_no_string_under_hybrid_core_names_a_flag():
    found = [
        f"{p.relative_to(SRC)}:{line}: {flag}"
        for p in sorted(SRC.rglob("*.py"))
        for line, flag in flags_named(p.read_text())
    ]
    assert not found, "name the setting as section.name instead:\n" + "\n".join(found)


def test_the_check_sees_flags_in_messages_and_docstrings():
    source = (
        '"""Set ``--zero_stage``."""\nraise ConfigError("x", "bad", f"Use --host_memory_gb {n} or ray start --head.")\n'
    )
    assert [flag for _, flag in flags_named(source)] == ["--zero_stage", "--host_memory_gb"]
