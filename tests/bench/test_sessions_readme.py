"""bench/sessions/README.md's table is the map of the GPU session scripts: every script of bench/sessions/ is in it,
every script it names is there, every phase it names is a phase of that script, and every metric it says a script
makes is a metric of bench/RESULTS.md (or named in the script's own text, for a row not recorded yet)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = ROOT / "bench" / "sessions"
README = SESSIONS / "README.md"


def _cells(line: str) -> list[str]:
    """A markdown table row's cells; `\\|` (a bar inside a cell) stays in its cell, unescaped."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _table() -> list[tuple[str, list[str], list[str]]]:
    """(script path, phases, metric patterns) per row of the table under "## The session scripts"; a row with an
    empty script cell continues the script above it."""
    text = README.read_text()
    section = text.split("## The session scripts", 1)[1].split("\n## ", 1)[0]
    rows, script = [], None
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("| ---") or line.startswith("| script "):
            continue
        cells = _cells(line)
        assert len(cells) == 4, f"README row without 4 cells: {line}"
        if cells[0]:  # the script's path first, in backticks; then notes (`(sources `_peer_session.sh`)`)
            named = re.match(r"`([^`]+)`", cells[0])
            assert named, f"a script cell starts with the script's path in backticks: {cells[0]!r}"
            script = named.group(1)
        assert script, f"the table's first row names no script: {line}"
        rows.append((script, re.findall(r"`([^`]+)`", cells[1]), re.findall(r"`([^`]+)`", cells[3])))
    assert rows, "no table under '## The session scripts' in bench/sessions/README.md"
    return rows


def _results_metrics() -> set[str]:
    metrics = set()
    for line in (ROOT / "bench" / "RESULTS.md").read_text().splitlines()[2:]:
        if line.startswith("|"):
            metrics.add(_cells(line)[0])
    return metrics


def _variants(pattern: str) -> list[str]:
    """A README metric as regexes: `...` is the rest of a family's names; `[a|b]` an optional word, each variant
    (without it, with a, with b) a metric of its own."""
    m = re.search(r"\[([^\]]+)\]", pattern)
    if m:
        options = ["", *m.group(1).split("|")]
        out = []
        for o in options:
            out += _variants(re.sub(r"\s+", " ", pattern[: m.start()] + o + pattern[m.end() :]).strip())
        return out
    return [r"\s+".join(re.escape(w) if w != "..." else ".+" for w in pattern.split())]


def _phases(script: Path) -> set[str]:
    """The phases a session script's `case` accepts (`stage)`, `a|a2)`)."""
    phases = set()
    for labels in re.findall(r"^\s*([A-Za-z0-9_|]+)\)", script.read_text(), flags=re.M):
        phases.update(labels.split("|"))
    return phases


def test_every_script_in_the_folder_is_in_the_table_and_every_named_script_exists():
    named = {script for script, _, _ in _table()}
    present = {f"bench/sessions/{p.name}" for p in SESSIONS.iterdir() if p.suffix == ".sh"}
    assert present, "no session scripts in bench/sessions/"
    assert sorted(present - named) == [], "scripts of bench/sessions/ missing from its README's table"
    assert sorted(named - present) == [], "scripts the README's table names that bench/sessions/ lacks"
    assert not list((ROOT / "bench").glob("*.sh")), "a session script outside bench/sessions/: move it there"


def test_every_phase_the_table_names_is_a_phase_of_its_script():
    missing = []
    for script, phases, _ in _table():
        known = _phases(ROOT / script)
        missing += [f"{script} {p}" for p in phases if p not in known]
    assert missing == [], f"phases the README names that their script's case does not take: {missing}"


def test_every_metric_the_table_claims_is_a_results_metric_or_named_by_its_script():
    results = _results_metrics()
    claimed = 0
    missing = []
    for script, _, patterns in _table():
        text = (ROOT / script).read_text()
        for pattern in patterns:
            for rx in _variants(pattern):
                claimed += 1
                if not any(re.fullmatch(rx, m) for m in results) and not re.search(rx, text):
                    missing.append(f"{script}: {rx}")
    assert claimed > 50, f"only {claimed} metrics parsed from the README's table: is its format changed?"
    assert missing == [], f"metrics the README's table claims that RESULTS.md and the script lack: {missing}"


def test_the_metric_patterns_mean_what_the_readme_says():
    rx = _variants("OpenRLHF grpo step [zero3ref|1.5B] s")
    assert [re.fullmatch(r, "OpenRLHF grpo step s") is not None for r in rx] == [True, False, False]
    assert re.fullmatch(rx[1], "OpenRLHF grpo step zero3ref s") and re.fullmatch(rx[2], "OpenRLHF grpo step 1.5B s")
    family = _variants("agent rollout ...")
    assert len(family) == 1 and re.fullmatch(family[0], "agent rollout tokens/s (3-turn task)")
    assert not re.fullmatch(family[0], "agent rollout")
    assert not re.fullmatch(_variants("vllm kv release s")[0], "vllm kv release s 7B")
